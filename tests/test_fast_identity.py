"""The fast Triton kernels lost only switches: they compile to the same code as the worklog's kernels.

utils.tiled.fast.forward and utils.tiled.fast.backward are utils.course.worklogs' triton_forward and triton_backward with
the experiments taken out (the overlapped loop, exponentials on the FMA units, descriptors made per program, dQ
by atomics or TMA reduce-adds). At the registry's settings (those switches off; TMA 0 or 2 in the forward, the
loads through pointers or TMA in the backward) each launch of a fast kernel is compiled for sm_90 on the CPU
(utils.course.cross_compile) beside the worklog kernel's launch with the same tiles and constexprs; their PTX must
match, up to debug information. So a speed measured on the worklog's kernels holds for the fast ones.

The compiles run in a fresh process (`python tests/test_fast_identity.py CASES`): kernels defined under
TRITON_INTERPRET cannot be compiled. A few cases run by default; `pytest --full` (and a GPU machine) runs a covering design of the rest.
"""
from __future__ import annotations

import difflib
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from utils.course.testing import pairwise

ROOT = Path(__file__).resolve().parents[1]

# (pass, head dim, causal, dtype, TMA, tile index): "forward" TMA is the kernel's switch (0 or 2), tile an index
# into TUNE_TILES; "backward" TMA is whether the looped-over tiles, lse₂ and D come through descriptors, tile unused.
DEFAULT_CASES = (("forward", 128, True, "bf16", 2, 0), ("forward", 64, False, "fp16", 0, 1),
                 ("backward", 128, True, "fp16", 1, 0), ("backward", 64, False, "bf16", 0, 0))
# How the full cases are chosen: the two kernels of a pair differ only in the switches the fast one lost, so what
# can make their PTX differ is a constexpr reaching a removed branch. Each pass runs a covering design of strength
# 2 over its constexpr axes (utils.course.testing.pairwise): every value of every axis, and every pair of values of
# two axes, at least once: with the default cases, half the 38 of the full product.
FULL_CASES = tuple(row for row in (
    *(("forward", r["d"], r["causal"], r["dtype"], r["tma"], r["tile"]) for r in pairwise(
        dict(d=(64, 128), causal=(False, True), dtype=("fp16", "bf16"), tma=(0, 2), tile=(0, 1, 2, 3)))),
    *(("backward", r["d"], r["causal"], r["dtype"], r["tma"], 0) for r in pairwise(
        dict(d=(64, 128), causal=(False, True), dtype=("fp16", "bf16"), tma=(0, 1))))) if row not in DEFAULT_CASES)


def case_id(case) -> str:
    what, d, causal, dtype, tma, tile = case
    name = f"{what}-d{d}-{'causal' if causal else 'full'}-{dtype}-tma{tma}"
    return name + (f"-tile{tile}" if what == "forward" else "")


def normalized_ptx(ptx: str, name: str) -> list[str]:
    """PTX without its debug information (the .debug sections, .loc/.file lines, comments, $L__tmp labels), the
    entry named KERNEL: what differs between two copies of one kernel defined in two files."""
    ptx = re.split(r"\.section\s+\.debug", ptx)[0].replace(name, "KERNEL")
    ptx = re.sub(r"\$L__tmp\d+:?", "", ptx)
    return [line.rstrip() for line in ptx.splitlines()
            if line.strip() and not re.match(r"\s*(\.loc|\.file|//)", line)]


def _forward_launches(case):
    """(fast launch, worklog launch) of the forward at `case`."""
    import torch

    from utils.tiled.fast import forward as fast
    from utils.course.cross_compile import _capture
    from utils.course.worklogs import triton_forward as worklog

    _, d, causal, dtype, tma, tile = case
    q = torch.zeros(1, 2, 1024, d, dtype={"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    tiles = fast.TUNE_TILES[tile]
    (a,) = _capture(lambda: fast._launch(q, q, q, causal, 0.1, tiles, fast.Steps(tma=tma == 2)))
    (b,) = _capture(lambda: worklog._launch(q, q, q, causal, 0.1, tiles,
                                            worklog.Steps(tma=tma == 2, host_descriptors=tma == 2)))
    return [(a, b)]


def _backward_launches(case):
    """[(fast launch, worklog launch)] of the backward's dK/dV and dQ passes at `case` (fp16 launches retyped to
    bf16 for bf16: on the CPU the launchers compute bf16 in fp32)."""
    from unittest import mock

    import torch

    from utils.tiled.fast import backward as fast
    from utils.course.cross_compile import Launch, _capture
    from utils.course.worklogs import triton_backward as worklog

    _, d, causal, dtype, tma, _ = case
    q = torch.zeros(1, 2, 1024, d, dtype=torch.float16)
    lse = torch.zeros(1, 2, 1024)
    config = fast._fitted_config(d, torch.float16, causal, None)
    with mock.patch.object(fast, "tma_supported", lambda *args: True), \
            mock.patch.object(fast, "use_tma", lambda head_dim, causal: bool(tma)):
        ours = _capture(lambda: fast.flash_attention_backward(q, q, q, q, q, lse, causal=causal, config=config))
    with mock.patch.object(worklog, "tma_supported", lambda *args: True):
        theirs = _capture(lambda: worklog.flash_attention_backward(q, q, q, q, q, lse, causal=causal, config=config,
                                                                   tma=bool(tma)))

    def typed(launch):
        if dtype == "fp16":
            return launch
        signature = {k: v.replace("fp16", "bf16") for k, v in launch.signature.items()}
        return Launch(launch.kernel, signature, launch.constexprs, launch.options)

    return [(typed(a), typed(b)) for a, b in zip(ours, theirs) if a.name in ("_bwd_dkdv", "_bwd_dq")]


def compare(case) -> str:
    """'' when the fast and worklog kernels of `case` compile to the same PTX; otherwise what differs."""
    from utils.course.cross_compile import compile_launch

    pairs = (_forward_launches if case[0] == "forward" else _backward_launches)(case)
    if not pairs or len(pairs) != (1 if case[0] == "forward" else 2):
        return f"captured {len(pairs)} launch pairs"
    out = []
    for fast, worklog in pairs:
        removed = {k: v for k, v in worklog.constexprs.items() if k not in fast.constexprs}
        if any(v not in (None, 0, False) for v in removed.values()):
            out.append(f"{fast.name}: the worklog launch turns on {removed}")
        common = {k: v for k, v in worklog.constexprs.items() if k in fast.constexprs}
        if common != fast.constexprs or fast.options != worklog.options:
            out.append(f"{fast.name}: constexprs or options differ: {fast.constexprs, fast.options} vs "
                       f"{common, worklog.options}")
        a = normalized_ptx(compile_launch(fast, (9, 0)).asm["ptx"], fast.name)
        b = normalized_ptx(compile_launch(worklog, (9, 0)).asm["ptx"], worklog.name)
        if a != b:
            diff = list(difflib.unified_diff(b, a, "worklog", "fast", lineterm="", n=1))
            out.append(f"{fast.name}: PTX differs ({len(b)} vs {len(a)} lines):\n" + "\n".join(diff[:40]))
    return "\n".join(out)


def run_cases(cases) -> str:
    """`python tests/test_fast_identity.py` over `cases` in a fresh process, without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__, *map(case_id, cases)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, f"the fast kernels no longer compile like the worklog's:\n{run.stdout}{run.stderr}"
    return run.stdout


# One case a test, each in its own process, so that pytest-xdist spreads the compiles over the cores.
# make test compiles the first default case of each pass (TMA on); the full suite the other two and FULL_CASES.
@pytest.mark.parametrize("case", [*(pytest.param(c, marks=() if i in (0, 2) else pytest.mark.full)
                                    for i, c in enumerate(DEFAULT_CASES)),
                                  *(pytest.param(c, marks=pytest.mark.full) for c in FULL_CASES)], ids=case_id)
def test_the_fast_kernels_compile_to_the_worklog_kernels_ptx(case):
    out = run_cases([case])
    assert out.strip() == f"{case_id(case)}: same", out


def test_ptx_normalization_keeps_code_and_drops_debug_information():
    ptx = ("//\n.visible .entry f_kernel(\n\t.loc\t1 20 5\n$L__tmp3:\n\tadd.s32 \t%r1, %r2, 1;\n"
           "\t.file\t1 \"/a/b.py\"\n\t.section\t.debug_abbrev\n{\n.b8 1\n}")
    assert normalized_ptx(ptx, "f_kernel") == [".visible .entry KERNEL(", "\tadd.s32 \t%r1, %r2, 1;"]
    assert normalized_ptx(ptx.replace("%r2, 1", "%r2, 2"), "f_kernel") != normalized_ptx(ptx, "f_kernel")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be defined for compiling")
    known = {case_id(c): c for c in DEFAULT_CASES + FULL_CASES}
    failed = 0
    for name in sys.argv[1:]:
        diff = compare(known[name])
        failed += bool(diff)
        print(f"{name}: same" if not diff else f"{name}: DIFFERS\n{diff}", flush=True)
    sys.exit(1 if failed else 0)
