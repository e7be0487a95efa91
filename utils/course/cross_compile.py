"""Compile the course's Triton kernels for a GPU this machine does not have, and check their shared memory.

A Triton kernel that asks for more shared memory than the GPU gives a block fails at launch ("out of resource:
shared memory"), and only there: an H200 (227 KiB) runs what a T4 (64 KiB) refuses, and emulating a T4 on an
H200 (utils.gpu) cannot see it. Triton compiles for any architecture on any machine, so the course checks it
on CPU: the kernels' launches are captured instead of run (`capture_launches`), then compiled for the target
(`shared_memory`), e.g. sm_75 for the T4. On sm_75 Triton lowers tl.dot to FMA instructions (its MMA path
needs sm_80), and the shared memory it needs differs from sm_80+'s, so only a compile tells. The same compile
shows the order of a loop's instructions (`schedule`): where Triton waits for its asynchronous Hopper matrix
products, which decides what overlaps (notebooks 05b and 07). ptxas schedules the PTX again, so for the
Gluon kernels `--sass` reads the same order in the machine code (`sass_schedule`).

    python -m utils.course.cross_compile          # the table for each GPU profile of utils.gpu (a T4 today)
    python -m utils.course.cross_compile --lessons 07   # ... of one notebook's kernels only
    python -m utils.course.cross_compile --schedule   # the forward loop's instruction order on sm_90 (notebook 05b)
    python -m utils.course.cross_compile --schedule exp2 --head-dim 64   # ... with exponentials moved to the FMA units
    python -m utils.course.cross_compile --schedule gluon --head-dim 64   # the Gluon forward, per tile (05b section 9)
    python -m utils.course.cross_compile --schedule gluon_ws   # ... warp-specialised, per tile (05b section 10)
    python -m utils.course.cross_compile --schedule gluon_ws --sass   # ... in the machine code ptxas makes of it
    python -m utils.course.cross_compile --schedule backward --head-dim 64   # the backward's passes (notebook 07)
    python -m utils.course.cross_compile --schedule gluon_bwd --head-dim 64  # the one-kernel Gluon backward (07w 5)
    python -m utils.course.cross_compile --schedule gluon_bwd --local-memory   # ... its spills per tile, either order
    python -m utils.course.cross_compile --schedule gluon_bwd --scaled-p  # ... its loop's instructions, P scaled or not
    python -m utils.course.cross_compile --schedule gluon_bwd --dq-fragments  # ... its dQ stores, either staging

The kernels must have been defined without TRITON_INTERPRET (they are then JITFunctions); the launches are
made with CPU tensors, only their dtypes and sizes matter.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction, mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from utils.gpu import Profile
from utils.tiled.fast.launch import dispatch_by_triton

POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64",
                 torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


class Launch(NamedTuple):
    """A captured launch: what triton.compile needs."""
    kernel: JITFunction
    signature: dict        # argument name -> Triton type ("*fp16", "i32", "fp32", "constexpr")
    constexprs: dict       # constexpr (and None) arguments -> value
    options: dict          # num_warps, num_stages

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _argument_type(value, name: str) -> str:
    if isinstance(value, TensorDescriptor) or hasattr(value, "layout") and hasattr(value, "block_shape"):
        return mangle_type(value)   # 'tensordesc<bf16[1, 1, 128, 128]>' (a Gluon one adds its shared layout)
    if isinstance(value, torch.Tensor):
        if value.dtype not in POINTER_TYPES:
            raise TypeError(f"argument {name}: no Triton pointer type for {value.dtype}")
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type a {type(value).__name__} for a captured launch")


def describe(kernel: JITFunction, args: tuple, kwargs: dict) -> Launch:
    """The Launch of `kernel[grid](*args, **kwargs)`: Python values typed as Triton would type them (the
    integer 1 and None become constants, as Triton specialises them)."""
    kwargs = dict(kwargs)
    params = {p.name for p in kernel.params}   # a Gluon kernel may take num_warps as a constexpr as well
    options = {k: kwargs[k] if k in params else kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param, (name, value) in zip(kernel.params, bound.arguments.items()):
        constant = value is None or (type(value) is int and value == 1 and not param.do_not_specialize)
        if param.is_constexpr or constant:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = _argument_type(value, name)
    return Launch(kernel, signature, constexprs, options)


@contextlib.contextmanager
def capture_launches():
    """Within the block, `kernel[grid](...)` records a Launch in the yielded list instead of running."""
    launches = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(describe(self, args, kwargs))

    JITFunction.run = run
    try:
        with dispatch_by_triton():  # kernels the course launches directly (utils.tiled.fast.launch) go through run too
            yield launches
    finally:
        JITFunction.run = original


def compile_launch(launch: Launch, capability: tuple[int, int]):
    """The launch's kernel compiled for `capability` (a CompiledKernel: .asm["ptx"], .metadata.shared, ...)."""
    if getattr(launch.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = triton.compiler.ASTSource
    source = Source(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return triton.compile(source, target=target, options=launch.options)


def shared_memory(launch: Launch, capability: tuple[int, int]) -> int:
    """Bytes of shared memory the launch's kernel needs per block when compiled for `capability`."""
    return compile_launch(launch, capability).metadata.shared


# --- the order of a Hopper kernel's instructions (notebook 05b, section 5) ---------------------------------------

SCHEDULE_EVENTS = (("wgmma.mma_async", "wgmma"), ("wgmma.commit_group", "commit"), ("wgmma.wait_group", "wait"),
                   ("ex2.approx", "ex2"), ("cp.async.bulk.tensor", "tma"), ("mbarrier.try_wait", "tile?"))


# What `--schedule backward_dq` adds (worklog 07w, section 4): the ways the dK/dV pass can hand dQ on.
DQ_EVENTS = SCHEDULE_EVENTS + (("mma.sync", "mma"), ("atom.global", "atomic"), ("red.global", "atomic"),
                               ("cp.reduce.async.bulk", "reduce"), ("cp.async.bulk.wait_group", "reduce-wait"),
                               ("bar.sync", "bar"))


def schedule(ptx: str, kinds=SCHEDULE_EVENTS) -> list[str]:
    """The basic blocks of `ptx` that issue tensor-core work, each as the order of its wgmma, wait, ex2 and TMA
    instructions (or of `kinds`: (PTX prefix, name) pairs) with repeats counted: 'wgmma×8 commit wait(0) ex2×66
    ...'. `wait(n)` lets n groups of wgmmas stay in flight; `tile?` waits for a TMA copy to land."""
    blocks, events = [], []
    for line in ptx.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].startswith("$L__BB") and words[0].endswith(":"):   # a new basic block
            blocks.append(events)
            events = []
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]   # '@%p1 op ...': predicated
        for prefix, name in kinds:
            if op.startswith(prefix):
                events.append(f"wait({words[-1].rstrip(';')})" if name == "wait" else name)
    blocks.append(events)
    return [_count_repeats(b) for b in blocks if "wgmma" in b]


# The same events in the machine code ptxas makes of the PTX (SASS, disassembled with the cuobjdump that Triton ships).
SASS_EVENTS = (("HGMMA", "wgmma"), ("WARPGROUP.DEPBAR.LE", "wait"), ("MUFU.EX2", "ex2"), ("UTMALDG", "tma"),
               ("SYNCS.PHASECHK", "tile?"))


def _sass_text(line: str) -> str:
    """A SASS line's instruction or label: without the address or the control bits before it, or cuobjdump's
    encoding after it."""
    return line.split("*/", 1)[-1].split("\t")[-1].split("/*")[0].strip()


def _opcode(words: list[str]) -> str:
    """The opcode of an instruction split into words, past its predicate ('@P0', '@!UP1')."""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def sass_schedule(sass: str, kinds=SASS_EVENTS) -> list[str]:
    """schedule() for a kernel's SASS (CompiledKernel.asm["sass"], or the text of `cuobjdump -sass`, which has no
    labels: one block): the blocks that issue tensor-core work, each as the order of its HGMMA (`wgmma`),
    WARPGROUP.DEPBAR.LE (`wait(n)`), MUFU.EX2 (`ex2`), UTMALDG (`tma`) and SYNCS.PHASECHK (`tile?`)
    instructions, and the blocks that run exponentials. ptxas schedules the PTX again: a wait can move above the
    instructions written before it, and a branch splits what the PTX had in one block."""
    blocks, events = [], []
    for line in sass.splitlines():
        text = _sass_text(line)
        if text.endswith(":"):   # a label: a new basic block
            blocks.append(events)
            events = []
            continue
        words = text.split()
        if not words:
            continue
        op = _opcode(words)
        for prefix, name in kinds:
            if op.startswith(prefix):
                events.append(f"wait({int(text.rstrip(' ;').split(',')[-1], 16)})" if name == "wait" else name)
    blocks.append(events)
    return [_count_repeats(b) for b in blocks if "wgmma" in b or "ex2" in b]


def _count_repeats(events: list[str]) -> str:
    runs = []
    for event in events:
        if runs and runs[-1][0] == event:
            runs[-1][1] += 1
        else:
            runs.append([event, 1])
    return " ".join(name if n == 1 else f"{name}×{n}" for name, n in runs)


# The forward's variants that `--schedule forward` and `--schedule exp2` compile: name -> Steps switches.
FORWARD_VARIANTS = {"forward": {"in order": {}, "overlapped": {"overlap": True}},
                    "exp2": {"MUFU only": {}, "1/2 on FMA": {"exp2_fma": 2}, "1/4 on FMA": {"exp2_fma": 4}}}


def forward_schedules(head_dim: int = 128, tiles=None, capability=(9, 0), variants=None) -> dict[str, list[str]]:
    """The worklog's forward kernel (utils.course.worklogs.triton_forward) with host descriptors (notebook 05b's
    final loads), compiled for `capability` in each of `variants` (default: FORWARD_VARIANTS["forward"], the loop
    in order and overlapped by one tile): {name: schedule}."""
    from utils.course.worklogs import triton_forward as worklog

    tiles = tiles or worklog.TUNE_TILES[0]
    q = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
    out = {}
    for name, switches in (variants or FORWARD_VARIANTS["forward"]).items():
        steps = worklog.Steps(tma=True, host_descriptors=True, **switches)
        (launch,) = _capture(lambda: worklog._launch(q, q, q, False, 0.1, tiles, steps))
        out[name] = schedule(compile_launch(launch, capability).asm["ptx"])
    return out


def _backward_launches(head_dim: int, causal: bool, **options) -> dict[str, Launch]:
    """The backward's main launches, {"dkdv": ..., "dq": ...} (no "dq" with dq_atomic), as the worklog's
    flash_attention_backward(**options) makes them (utils.course.worklogs.triton_backward, which takes tma,
    tma_stats and dq_atomic) with notebook 07's default tiles for 16-bit inputs (fp16: the interpreter path
    keeps bf16 for fp32). CPU tensors have no GPU to ask whether TMA runs: it is said to."""
    from utils.course.worklogs import triton_backward as bwd

    q = torch.zeros(1, 2, 1024, head_dim, dtype=torch.float16)
    lse = torch.zeros(1, 2, 1024)
    config = bwd.pick_config(head_dim, torch.float16, causal, None)
    with mock.patch.object(bwd, "tma_supported", lambda *args: True), \
            mock.patch.object(bwd, "tma_reduce_supported", lambda q: True):
        launches = _capture(lambda: bwd.flash_attention_backward(q, q, q, q, q, lse, causal=causal, config=config,
                                                                 **options))
    return {launch.name.removeprefix("_bwd_"): launch for launch in launches
            if launch.name in ("_bwd_dkdv", "_bwd_dq")}


def backward_schedules(head_dim: int = 128, capability=(9, 0)) -> dict[str, dict[str, list[str]]]:
    """The backward's two passes (notebook 07's default tiles, causal, 16-bit) compiled for `capability` with
    pointer loads and with TMA: {"pointer loads": {"dkdv": schedule, "dq": schedule}, "TMA": {...}}."""
    return {name: {which: schedule(compile_launch(launch, capability).asm["ptx"])
                   for which, launch in _backward_launches(head_dim, True, tma=tma, tma_stats=tma).items()}
            for name, tma in (("pointer loads", False), ("TMA", True))}


def backward_dq_schedules(head_dim: int = 64, capability=(9, 0)) -> dict[str, list[str]]:
    """The dK/dV pass (notebook 07's default tiles and loads, not causal, 16-bit) compiled for `capability` with
    each way of getting dQ: the separate pass, an atomic add per element, a bulk reduce-add per tile (section
    10). {name: schedule with DQ_EVENTS}."""
    from utils.tiled.fast.backward import use_tma

    tma = use_tma(head_dim, False)
    return {name: schedule(compile_launch(_backward_launches(head_dim, False, tma=tma, dq_atomic=dq_atomic)["dkdv"],
                                          capability).asm["ptx"], DQ_EVENTS)
            for name, dq_atomic in (("dQ pass", False), ("atomic adds", True), ("bulk reduce", "tma"))}


def gluon_schedules(head_dim: int = 64, capability=(9, 0), warp_specialized: bool = False,
                    sass: bool = False) -> dict[str, list[str]]:
    """The Gluon forward (notebook 05b section 9) compiled for `capability` with each tile of GLUON_TILES, or
    with `warp_specialized` the producer/consumer kernel (section 10) with each of WS_TILES: {tile label:
    schedule}. Their loops show the two products in flight and `wait(1)` before the softmax; the
    warp-specialised kernel's blocks end with its register split (`setmaxnreg`). `sass`: the schedule of the
    machine code (sass_schedule) instead of the PTX."""
    from utils.explicit import forward as gluon_forward, forward_ws as gluon_ws

    q = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 1024)
    out = {}
    if warp_specialized:
        for c in gluon_ws.WS_TILES:
            (launch,) = _capture(lambda: gluon_ws._launch(q, q, q, q, lse, False, 0.1, c))
            asm = compile_launch(launch, capability).asm
            regs = sorted({int(line.split()[-1].rstrip(";")) for line in asm["ptx"].splitlines()
                           if "setmaxnreg" in line})
            out[gluon_ws.label(c).removeprefix("gluon_ws ")] = (
                sass_schedule(asm["sass"]) if sass else schedule(asm["ptx"])) + [
                "setmaxnreg to " + ", ".join(map(str, regs))]
        return out
    for c in gluon_forward.GLUON_TILES:
        (launch,) = _capture(lambda: gluon_forward._launch(q, q, q, q, lse, False, 0.1, c))
        asm = compile_launch(launch, capability).asm
        out[f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.stages}"] = (
            sass_schedule(asm["sass"]) if sass else schedule(asm["ptx"]))
    return out


def gluon_bwd_schedule(head_dim: int = 64, causal: bool = False, capability=(9, 0)) -> tuple[list[str], int]:
    """The one-kernel Gluon backward (worklog 07w section 5) compiled for `capability` with its default tiles:
    (schedule with DQ_EVENTS, bytes of shared memory). Its consumer loop shows the dQ block's reduce-adds issued
    at the end of a tile and their wait (reduce-wait) at the next tile, before the two consumers meet (bar)."""
    compiled = compile_launch(_gluon_bwd_launch(head_dim, causal), capability)
    return schedule(compiled.asm["ptx"], DQ_EVENTS), compiled.metadata.shared


def _gluon_bwd_launch(head_dim: int, causal: bool, **changes) -> Launch:
    """The Gluon backward's launch (bf16, N = 1024) with pick_config's tiles, `changes` replacing its fields."""
    from utils.explicit import backward as gb

    q = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
    config = gb.pick_config(head_dim, causal)._replace(**changes)
    acc, stats = gb._dq_accumulator(1, 2, 1024, head_dim, config, "cpu"), torch.zeros(2, 1024)
    (launch,) = _capture(lambda: gb._launch(q, q, q, q, q, q, acc, stats, stats, causal, 0.1, config))
    return launch


def _hgmma_loops(sass: str) -> list[list[str]]:
    """The opcodes of each innermost loop of `sass` (CompiledKernel.asm["sass"]) that issues HGMMA, in order. A
    loop is a branch back to a label; innermost: no other such loop inside it."""
    texts = [_sass_text(line) for line in sass.splitlines()]
    labels = {text[:-1]: i for i, text in enumerate(texts) if text.endswith(":") and " " not in text}
    loops = []
    for i, text in enumerate(texts):
        words = text.replace(";", " ").split()
        if "BRA" in words and words[-1] in labels and labels[words[-1]] < i:
            loops.append((labels[words[-1]], i))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    loops = [[_opcode(text.split()) for text in texts[a:b + 1] if text and not text.endswith(":")]
             for a, b in sorted(innermost)]
    return [ops for ops in loops if any(op.startswith("HGMMA") for op in ops)]


def _loop_counts(sass: str, *prefixes: str, length: bool = False) -> list[tuple[int, ...]]:
    """Per innermost loop of `sass` that issues HGMMA (_hgmma_loops): its instruction count (with `length`), then
    how many of its opcodes start with each of `prefixes`."""
    return [(len(ops),) * length + tuple(sum(op.startswith(p) for op in ops) for p in prefixes)
            for ops in _hgmma_loops(sass)]


def local_memory(sass: str) -> list[tuple[int, int]]:
    """(STL, LDL) of each innermost loop of `sass` that issues HGMMA (_hgmma_loops): the registers ptxas stores to
    local memory and loads back in one turn of the loop."""
    return _loop_counts(sass, "STL", "LDL")


def loop_instructions(sass: str) -> list[tuple[int, int]]:
    """(instructions, FMUL) of each innermost loop of `sass` that issues HGMMA (_hgmma_loops)."""
    return _loop_counts(sass, "FMUL", length=True)


def dq_staging(sass: str) -> list[tuple[int, int]]:
    """(shared stores, TMA reduce-adds) of each innermost loop of `sass` that issues HGMMA (_hgmma_loops): STS and
    UTMAREDG, the instructions that stage dQ and add it to the accumulator."""
    return _loop_counts(sass, "STS", "UTMAREDG")


def mask_selects(sass: str) -> list[tuple[int, int, int]]:
    """(instructions, FSEL, LDL) of each innermost loop of `sass` that issues HGMMA (_hgmma_loops): FSEL is the
    mask's select (-inf where a key is hidden), LDL a spilled register's reload."""
    return _loop_counts(sass, "FSEL", "LDL", length=True)


# The steps measured before Config.mask_loop existed are compiled with the one loop they were measured with.
_ONE_LOOP = {"mask_loop": False}
# The Config fields worklog 07w section 5 compiles both ways, by the CLI flag that prints them: (field, {way: value},
# what to count in each consumer's tile loop, what the count reads, the other fields held fixed).
BOTH_WAYS = {"dq_fragments": ("dq_fragments", {"fragments": True, "rows": False}, dq_staging,
                              "shared stores / TMA reduce-adds", _ONE_LOOP),
             "scaled_p": ("scaled_p", {"scale·P": True, "P": False}, loop_instructions, "instructions / FMUL",
                          _ONE_LOOP),
             # today's loops: with the one-compare mask the one loop's spills no longer follow the order
             "local_memory": ("ds_first", {"dS first": True, "dV first": False}, local_memory, "local stores / loads",
                              {}),
             "mask_loop": ("mask_loop", {"two loops": True, "one loop": False}, mask_selects,
                           "instructions / FSEL / LDL", {})}


def gluon_bwd_both_ways(flag: str, head_dim: int = 64, causal: bool = False, capability=(9, 0)) -> dict[str, list]:
    """The one-kernel Gluon backward's picked config compiled for `capability` with the Config field of
    BOTH_WAYS[flag] set each way (and its fixed fields): {way: count(sass)}, one tuple per consumer's tile loop."""
    field, ways, count, _, fixed = BOTH_WAYS[flag]
    return {name: count(compile_launch(_gluon_bwd_launch(head_dim, causal, **fixed, **{field: value}),
                                       capability).asm["sass"])
            for name, value in ways.items()}


def read_both_ways(text: str) -> dict[tuple[str, str], list[tuple[int, ...]]]:
    """What `--schedule gluon_bwd --<flag>` printed (`text`, its heading line first), read back: {(mask, way): one
    tuple of counts per consumer's tile loop}, mask "no mask" or "causal", way as BOTH_WAYS names it."""
    counts = {}
    for line in text.splitlines()[1:]:
        label, numbers = line.split(":", 1)
        mask = "no mask" if label.strip().startswith("no mask") else "causal"
        counts[mask, label.strip()[len(mask):].strip()] = [tuple(map(int, c.split(" / ")))
                                                          for c in re.findall(r"\d+(?: / \d+)+", numbers)]
    return counts


def in_fresh_process(*args: str, timeout: int = 900) -> str:
    """`python -m utils.course.cross_compile *args` in a process without TRITON_INTERPRET (where the kernels are
    compiled, not interpreted), from a notebook or test that runs interpreted; returns what it printed."""
    return _uninterpreted(["-m", "utils.course.cross_compile", *args], timeout)


def script_in_fresh_process(code: str, timeout: int = 900) -> str:
    """`python -c code` in a process without TRITON_INTERPRET, the repository importable, as in_fresh_process:
    a test's own compile probe (capture a launch, compile_launch it). Returns what it printed."""
    return _uninterpreted(["-c", code], timeout)


def _uninterpreted(argv: list[str], timeout: int) -> str:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        shown = " ".join(argv) if argv[0] == "-m" else "-c <probe>"
        raise RuntimeError(f"python {shown} failed:\n{run.stdout}{run.stderr[-3000:]}")
    return run.stdout


@contextlib.contextmanager
def cpu_launches():
    """Let the course's launchers take CPU tensors, as they do in the interpreter: they read TRITON_INTERPRET
    at call time, or ask utils.tiled.fast.forward (the kernels, defined before, stay compilable)."""
    from utils.tiled.fast import forward as fast_forward

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with mock.patch.object(fast_forward, "triton_interpreting", lambda: True):
            yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


# --- the course's launches on a GPU of a profile ----------------------------------------------------------------

class Case(NamedTuple):
    lesson: str        # the notebook whose kernel it is
    what: str          # "forward D=128 fp16", ...
    launch: Launch
    shared: int = 0    # bytes, once compiled


def _capture(fn) -> list[Launch]:
    with cpu_launches(), capture_launches() as launches:
        fn()
    return launches


def course_launches(profile: Profile) -> list[tuple[str, str, Launch]]:
    """(lesson, what, Launch) for the course's Triton kernels as its launchers configure them for `profile`:
    the forward (05), the backward (07), flash-decoding (08) and the flex kernels (10) at the head dims and dtypes
    a learner runs on it (16-bit is fp16 where the GPU has no bf16 tensor cores, sm < 80)."""
    from utils import gpu
    from utils.decoding import split_kv as flash_decoding
    from utils.tiled.fast import forward as fast_forward, backward as fast_backward
    from utils.flex import attention as flex_attention, causal, sparsity

    half = torch.float16 if profile.capability < (8, 0) else torch.bfloat16
    smem = profile.shared_memory_per_block
    out = []
    for d, dtype in ((64, half), (128, half), (256, half), (128, torch.float32)):
        q = torch.zeros(1, 2, 256, d, dtype=dtype)
        lse = torch.zeros(1, 2, 256)
        name = f"D={d} {str(dtype).removeprefix('torch.')}"
        fwd = fast_forward.pick_config(d, dtype, smem)
        bwd = fast_backward.pick_config(d, dtype, True, smem)
        out += [("05", f"forward {name}", x) for x in _capture(
            lambda: fast_forward._launch(q, q, q, True, 0.1, config=fwd, steps=fast_forward.Steps()))]
        out += [("07", f"backward {name}", x) for x in _capture(
            lambda: fast_backward.flash_attention_backward(q, q, q, q, q, lse, causal=True, config=bwd))]
        if dtype != half or d > 128:
            continue
        out += [("08", f"decode {name}", x) for x in _capture(
            lambda: flash_decoding.flash_decode(q[:, :, :1], q, q, num_splits=4))]
        states = torch.tensor([[[[sparsity.PARTIAL, sparsity.EMPTY], [sparsity.FULL, sparsity.PARTIAL]]]],
                              dtype=torch.int8)
        bm = sparsity.from_states(states, 128, 128, 256, 256, "causal")
        on_profile = contextlib.ExitStack()
        real_configs = flex_attention.pick_configs
        on_profile.enter_context(mock.patch.object(gpu, "shared_memory_per_block", lambda device=None: smem))
        on_profile.enter_context(mock.patch.object(flex_attention, "pick_configs",
                                          lambda p, dt, dev: real_configs(p, dt, torch.device("cuda"))))
        with on_profile:
            q.requires_grad_(True)
            launches = _capture(lambda: flex_attention.flex_attention(q, q, q, causal(), block_mask=bm).sum()
                                .backward())
        out += [("10", f"flex {name}", x) for x in launches]
    return out


LESSONS = ("05", "07", "08", "10")   # the notebooks whose Triton kernels course_launches configures


def check(profile: Profile, lessons=LESSONS) -> list[Case]:
    """Every course launch for `profile` of the notebooks in `lessons` (of LESSONS), compiled for its architecture:
    Cases with their shared memory."""
    if isinstance(lessons, str) or not set(lessons) <= set(LESSONS):
        raise ValueError(f"lessons must be some of {LESSONS}, got {lessons!r}")
    return [Case(lesson, what, launch, shared_memory(launch, profile.capability))
            for lesson, what, launch in course_launches(profile) if lesson in lessons]


def main(argv=None) -> int:
    import argparse

    from utils.gpu import PROFILES

    parser = argparse.ArgumentParser(prog="python -m utils.course.cross_compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="t4")
    parser.add_argument("--schedule", nargs="?", const="forward", choices=("forward", "exp2", "backward",
                                                                     "backward_dq", "gluon", "gluon_ws", "gluon_bwd"),
                        help="instead: the order of a loop's instructions on sm_90: the forward's, in order and "
                        "overlapped or with a share of its exponentials on the FMA units (notebook 05b, section "
                        "5), the Gluon forward's per tile (section 9) and its warp-specialised version's (section "
                        "10), the backward's with pointer loads and TMA (07), its dK/dV loop with each way of "
                        "getting dQ (07w, section 4), or the one-kernel Gluon backward's (07w, section 5)")
    parser.add_argument("--lessons", nargs="+", default=list(LESSONS), choices=LESSONS,
                        help="with --profile: only these notebooks' kernels (a compile each, so several runs at once "
                        "share the work)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="with --schedule")
    parser.add_argument("--local-memory", action="store_true",
                        help="with --schedule gluon_bwd: instead, the spill stores and reloads (STL, LDL) in each "
                        "consumer's tile loop, dSᵀ formed before dV's product and after it, with and without a mask")
    parser.add_argument("--scaled-p", action="store_true",
                        help="with --schedule gluon_bwd: instead, the instructions and multiplies (FMUL) in each "
                        "consumer's tile loop, P computed as scale·P and as P, with and without a mask")
    parser.add_argument("--dq-fragments", action="store_true",
                        help="with --schedule gluon_bwd: instead, the shared stores (STS) and TMA reduce-adds "
                        "(UTMAREDG) in each consumer's tile loop, dQ staged in register order and by rows, with and "
                        "without a mask")
    parser.add_argument("--mask-loop", action="store_true",
                        help="with --schedule gluon_bwd: instead, the instructions, mask selects (FSEL) and spill "
                        "reloads (LDL) in each of the consumers' tile loops, the masked tiles in a loop of their own "
                        "and in the one loop")
    parser.add_argument("--sass", action="store_true",
                        help="with --schedule gluon or gluon_ws: the order in the machine code ptxas makes (SASS), "
                        "not in the PTX")
    args = parser.parse_args(argv)
    if args.sass and args.schedule not in ("gluon", "gluon_ws"):
        parser.error("--sass goes with --schedule gluon or gluon_ws")
    both_ways = [flag for flag in BOTH_WAYS if getattr(args, flag)]
    if both_ways and (args.schedule != "gluon_bwd" or len(both_ways) > 1):
        names = [f"--{flag.replace('_', '-')}" for flag in both_ways]
        parser.error(f"{names[0]} goes with --schedule gluon_bwd" + (f", without {names[1]}" if names[1:] else ""))
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels must be defined for compiling, not interpreting")
    if args.schedule == "backward":
        print(f"Triton {triton.__version__}, sm_90: backward, d={args.head_dim}, fp16, causal, default tiles; "
              "blocks with wgmma:")
        for loads, passes in backward_schedules(args.head_dim).items():
            for which, blocks in passes.items():
                for block in blocks:
                    print(f"  {loads + ', ' + which + ':':<24} {block}")
        return 0
    if args.schedule == "backward_dq":
        print(f"Triton {triton.__version__}, sm_90: the backward's dK/dV pass, d={args.head_dim}, fp16, default tiles "
              "and loads; blocks with wgmma:")
        for name, blocks in backward_dq_schedules(args.head_dim).items():
            for block in blocks:
                print(f"  {name + ':':<13} {block}")
        return 0
    if both_ways:
        what = BOTH_WAYS[both_ways[0]][3]
        print(f"Triton {triton.__version__}, sm_90: Gluon backward, d={args.head_dim}, bf16, picked tiles; per "
              f"consumer's tile loop, {what}:")
        for causal in (False, True):
            for name, loops in gluon_bwd_both_ways(both_ways[0], args.head_dim, causal).items():
                print(f"  {'causal' if causal else 'no mask':8} {name + ':':10} "
                      + "   ".join(" / ".join(map(str, counts)) for counts in loops))
        return 0
    if args.schedule == "gluon_bwd":
        blocks, shared = gluon_bwd_schedule(args.head_dim)
        print(f"Triton {triton.__version__}, sm_90: Gluon backward, d={args.head_dim}, bf16, default tiles, "
              f"{shared} bytes of shared memory; blocks with wgmma:")
        for block in blocks:
            print(f"  {block}")
        return 0
    if args.schedule in ("gluon", "gluon_ws"):
        ws = args.schedule == "gluon_ws"
        print(f"Triton {triton.__version__}, sm_90: Gluon forward{', warp-specialised' if ws else ''}, "
              f"d={args.head_dim}, bf16; {'SASS blocks with wgmma or ex2' if args.sass else 'PTX blocks with wgmma'}"
              f"{', then setmaxnreg' if ws else ''}:")
        for name, blocks in gluon_schedules(args.head_dim, warp_specialized=ws, sass=args.sass).items():
            for block in blocks:
                print(f"  {name + ':':<18} {block}")
        return 0
    if args.schedule:
        from utils.tiled.fast.forward import TUNE_TILES

        t = TUNE_TILES[0]
        print(f"Triton {triton.__version__}, sm_90: forward, d={args.head_dim}, bf16, host descriptors, tiles "
              f"{t.block_m}x{t.block_n}, {t.num_warps} warps, {t.num_stages} stages; blocks with wgmma:")
        for name, blocks in forward_schedules(args.head_dim, t, variants=FORWARD_VARIANTS[args.schedule]).items():
            for block in blocks:
                print(f"  {name + ':':<12} {block}")
        return 0
    profile = PROFILES[args.profile]
    limit = profile.shared_memory_per_block
    failures = 0
    print(f"{profile.name}, sm_{profile.capability[0]}{profile.capability[1]}: {limit // 1024} KiB of shared "
          f"memory per block; Triton {triton.__version__}")
    for case in check(profile, args.lessons):
        fits = case.shared <= limit
        failures += not fits
        print(f"  {case.lesson}  {case.what:<26} {case.launch.name:<22} {case.shared / 1024:6.1f} KiB  "
              f"{'fits' if fits else 'DOES NOT FIT'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
