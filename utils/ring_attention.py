"""Ring attention: sequence-parallel attention over W processes with torch.distributed.

Each rank holds a chunk of the sequence: its queries, keys and values. The K/V chunks travel around a ring,
rank r sending to r+1 and receiving from r-1, so after W steps every rank has seen every key; each step's partial
result is merged into the running one by log-sum-exp (`utils.softmax.merge_attention`, notebook 02). The next
transfer is posted before the current chunk is computed on, so communication hides behind computation. No rank
ever holds more than its own chunk plus one chunk in flight: memory per rank falls as 1/W.

Causal attention with contiguous chunks leaves rank 0 idle after the first step (every other key is in its
future) while rank W-1 works at every step. The zigzag layout gives rank r chunks r and 2W-1-r of 2W: one early
and one late, and every rank does the same work at every step (`step_work`).

`simulate_ring_attention` runs the same steps for all ranks in one process (no communication): for teaching and
fast tests. `run_ring_check` starts W processes (torch.multiprocessing, spawn) on gloo (CPU) or NCCL (one GPU
per rank) and compares with single-device attention. On 2 GPUs: `python -m utils.ring_attention --backend nccl
--world-size 2`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import numbers
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from utils.checks import check_attention_inputs, resolve_scale
from utils.softmax import attention_with_lse, merge_attention
from utils.testing import random_qkv, tolerances

LAYOUTS = ("contiguous", "zigzag")
PARTS = {"all", "first", "second"}


# --- layouts --------------------------------------------------------------------------------------------

def _check_layout_args(seqlen, world_size, rank, layout):
    for name, x in (("seqlen", seqlen), ("world_size", world_size), ("rank", rank)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    chunks = 2 * world_size if layout == "zigzag" else world_size
    if seqlen <= 0 or seqlen % chunks:
        raise ValueError(f"seqlen {seqlen} must be a positive multiple of {chunks} "
                         f"({'2 × ' if layout == 'zigzag' else ''}world_size) for the {layout} layout")


def zigzag_chunks(world_size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·world_size) that rank holds in the zigzag layout: one early, one late."""
    _check_layout_args(2 * world_size, world_size, rank, "zigzag")
    return rank, 2 * world_size - 1 - rank


def shard_indices(seqlen: int, world_size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Positions in the sequence held by `rank`, in the order it holds them."""
    _check_layout_args(seqlen, world_size, rank, layout)
    if layout == "contiguous":
        n = seqlen // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    c = seqlen // (2 * world_size)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in zigzag_chunks(world_size, rank)])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The part of `x` (the full sequence along `dim`) that `rank` holds: a contiguous copy."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    idx = shard_indices(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, idx).contiguous()


def unshard(parts, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Reassemble the full sequence from the parts of ranks 0..W-1 (the inverse of `shard`)."""
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty list of tensors, one per rank")
    world_size = len(parts)
    shape = list(parts[0].shape)
    if any(p.shape != parts[0].shape for p in parts):
        raise ValueError("every rank's part must have the same shape")
    seqlen = shape[dim] * world_size
    shape[dim] = seqlen
    full = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, shard_indices(seqlen, world_size, rank, layout).to(part.device), part)
    return full


def step_work(rank: int, src: int, world_size: int, *, causal: bool, layout: str = "zigzag"):
    """What rank computes when it holds the K/V chunk of rank `src`: None (nothing visible) or
    (query part, key part, causal) with parts "all", "first" or "second" half of the local rows.

    Zigzag, rank r holds chunks (r, 2W-1-r). With src < r: chunk src precedes both query chunks and chunk
    2W-1-src follows both: all queries see the first half of the keys. With src > r: both key chunks follow
    chunk r and precede chunk 2W-1-r: the second half of the queries sees all keys. Either way half the work.
    """
    _check_layout_args(2 * world_size, world_size, rank, layout)
    if not (isinstance(src, numbers.Integral) and 0 <= src < world_size):
        raise ValueError(f"src must be a rank in [0, {world_size}), got {src!r}")
    if not causal:
        return "all", "all", False
    if src == rank:  # the diagonal: an ordinary causal mask (with zigzag too: see the notebook)
        return "all", "all", True
    if layout == "contiguous":
        return ("all", "all", False) if src < rank else None
    return ("all", "first", False) if src < rank else ("second", "all", False)


def work_per_step(world_size: int, *, causal: bool, layout: str) -> list[list[float]]:
    """[rank][step] fraction of a full (local Q × local K) block computed, counting a causal diagonal as 1/2."""
    size = {"all": 1.0, "first": 0.5, "second": 0.5}
    table = []
    for rank in range(world_size):
        row = []
        for step in range(world_size):
            task = step_work(rank, (rank - step) % world_size, world_size, causal=causal, layout=layout)
            row.append(0.0 if task is None else size[task[0]] * size[task[1]] * (0.5 if task[2] else 1.0))
        table.append(row)
    return table


# --- the computation shared by the simulation and the distributed version ------------------------------

def _rows(part: str, n: int) -> slice:
    return {"all": slice(0, n), "first": slice(0, n // 2), "second": slice(n // 2, n)}[part]


def _torch_attention(q, k, v, *, causal, sm_scale):
    return attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale)


def pick_local_attention(device, name: str = "auto"):
    """Attention inside a rank, `fn(q, k, v, *, causal, sm_scale) -> (o, lse)` with a natural-log lse.

    "torch": `utils.softmax.attention_with_lse` (scores in memory; any device); "flash_triton": notebook 05's
    Triton forward; "flash_decoding": this course's split-KV kernel with one split. "auto": on a GPU the first
    Triton kernel that is there, on the CPU "torch" (the interpreter would make the ring crawl).
    """
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return _torch_attention
    if name in ("auto", "flash_triton"):
        try:
            from utils.flash_triton import flash_attention_forward
            return flash_attention_forward
        except ImportError:
            if name == "flash_triton":
                raise
    if name in ("auto", "flash_decoding"):
        from utils.flash_decoding import flash_decode

        def decoding_attention(q, k, v, *, causal, sm_scale):
            return flash_decode(q, k, v, causal=causal, sm_scale=sm_scale, num_splits=1, return_lse=True)
        return decoding_attention
    raise ValueError(f"local attention must be 'auto', 'torch', 'flash_triton' or 'flash_decoding', got {name!r}")


def _accumulate(out, lse, q, k, v, task, attention, scale):
    """Attend the `task`'s part of the local queries to the part of this K/V chunk, merge into (out, lse)."""
    if task is None:
        return
    q_part, kv_part, causal = task
    rows, cols = _rows(q_part, q.shape[2]), _rows(kv_part, k.shape[2])
    o_step, lse_step = attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=causal, sm_scale=scale)
    out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows], o_step, lse_step)


def _check_ring_inputs(q, k, v, causal, sm_scale, layout, world_size):
    shape = check_attention_inputs(q, k, v, causal=causal)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if shape.seqlen_q != shape.seqlen_k:
        raise ValueError(f"q and k must hold the same positions (a rank's chunk), got {shape.seqlen_q} and "
                         f"{shape.seqlen_k} rows")
    if causal and layout == "zigzag" and shape.seqlen_q % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: the local length must be even, "
                         f"got {shape.seqlen_q}")
    return resolve_scale(sm_scale, shape.head_dim)


def _empty_state(q):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def simulate_ring_attention(q, k, v, *, world_size: int, causal=False, sm_scale=None, layout="zigzag",
                            local_attention="torch"):
    """Ring attention with every rank played in turn by this process; q, k, v hold the full sequence.

    The same steps as `ring_attention`, with the ring's transfer replaced by indexing: rank r at step s holds
    the K/V shard of rank (r - s) mod W. Returns the full output, reassembled from the ranks' shards.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    scale = _check_ring_inputs(q, k, v, causal, sm_scale, layout, 1)
    _check_layout_args(q.shape[2], world_size, 0, layout)
    attention = pick_local_attention(q.device, local_attention)
    qs, ks, vs = ([shard(t, world_size, r, layout) for r in range(world_size)] for t in (q, k, v))
    outs = []
    for rank in range(world_size):
        out, lse = _empty_state(qs[rank])
        for step in range(world_size):
            src = (rank - step) % world_size
            task = step_work(rank, src, world_size, causal=causal, layout=layout)
            _accumulate(out, lse, qs[rank], ks[src], vs[src], task, attention, scale)
        outs.append(out.to(q.dtype))
    return unshard(outs, layout)


# --- the distributed version --------------------------------------------------------------------------

def _post_exchange(send: torch.Tensor, recv: torch.Tensor, world_size: int, rank: int):
    """Post send-to-next and receive-from-previous; returns the requests to wait on."""
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world_size)]
    return dist.batch_isend_irecv(ops)


def ring_attention(q, k, v, *, causal=False, sm_scale=None, layout="zigzag", overlap=True,
                   local_attention="auto"):
    """Attention of this rank's queries against the whole sequence, the K/V chunks passed around the ring.

    q, k, v: this rank's shard (`shard(x, world_size, rank, layout)`), the same shape on every rank; needs an
    initialised default process group. With `overlap` the next transfer is posted before computing on the
    current chunk; without, the ring waits for each transfer first (to measure what overlap buys). Returns this
    rank's shard of the output, in q's dtype.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised (dist.init_process_group)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    scale = _check_ring_inputs(q, k, v, causal, sm_scale, layout, world_size)
    attention = pick_local_attention(q.device, local_attention)
    kv = torch.stack([k, v]).contiguous()  # one message per step instead of two
    out, lse = _empty_state(q)
    for step in range(world_size):
        src = (rank - step) % world_size
        last = step == world_size - 1
        if not last:
            incoming = torch.empty_like(kv)
            if overlap:
                requests = _post_exchange(kv, incoming, world_size, rank)
        task = step_work(rank, src, world_size, causal=causal, layout=layout)
        if not last and not overlap:
            for request in _post_exchange(kv, incoming, world_size, rank):
                request.wait()
        _accumulate(out, lse, q, kv[0], kv[1], task, attention, scale)
        if not last:
            if overlap:
                for request in requests:
                    request.wait()
            kv = incoming
    return out.to(q.dtype)


# --- a check with W processes -------------------------------------------------------------------------

@dataclass(frozen=True)
class RingCase:
    """One configuration to run in every rank: sizes of the *full* sequence, and how to check and time it."""

    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    seqlen: int = 64
    head_dim: int = 32
    causal: bool = False
    layout: str = "zigzag"
    dtype: str = "float32"
    seed: int = 0
    iters: int = 0            # timed repetitions (0: only check)
    local_attention: str = "auto"


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters):
    fn()  # warm-up (compiles the kernels)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    ms = torch.tensor((time.perf_counter() - start) / iters * 1e3, device=device)  # NCCL reduces GPU tensors only
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the ring is as slow as its slowest rank
    return float(ms)


def _reference(q, k, v, causal, device):
    """Single-device attention of the full sequence, and the ground truth it is compared with."""
    if device.type == "cpu":
        from utils.reference import reference_attention
        return reference_attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.to(device, torch.float32) for t in (q, k.repeat_interleave(group, 1),
                                                          v.repeat_interleave(group, 1)))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32, no N×N matrix
        return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)


def _run_case(case: RingCase, rank: int, world_size: int, device: torch.device) -> dict | None:
    dtype = getattr(torch, case.dtype)
    q, k, v = random_qkv(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, kv_heads=case.kv_heads,
                         dtype=dtype, seed=case.seed)  # every rank draws the same full tensors, keeps its shard
    q_loc, k_loc, v_loc = (shard(t, world_size, rank, case.layout).to(device) for t in (q, k, v))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = lambda overlap=True: ring_attention(q_loc, k_loc, v_loc, causal=case.causal, layout=case.layout,  # noqa
                                              overlap=overlap, local_attention=case.local_attention)
    out_loc = run()
    result = {"peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    if case.iters:
        result["ring_ms"] = _time(run, device, case.iters)
        result["ring_no_overlap_ms"] = _time(lambda: run(False), device, case.iters)
    parts = [torch.empty_like(out_loc) for _ in range(world_size)]
    dist.all_gather(parts, out_loc)
    if rank != 0:
        return None
    out = unshard([p.cpu() for p in parts], case.layout).to(device)
    truth = _reference(q, k, v, case.causal, device)
    result["max_abs_err"] = float((out.double() - truth.double()).abs().max())
    result["dtype_tolerance"] = tolerances(dtype)["atol"]
    if case.iters:  # the same local kernel on the full sequence, on one device
        attention = pick_local_attention(device, case.local_attention)
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        single = lambda: attention(qd, kd, vd, causal=case.causal, sm_scale=None)  # noqa: E731
        single()
        _sync(device)
        start = time.perf_counter()
        for _ in range(case.iters):
            single()
        _sync(device)
        result["single_device_ms"] = (time.perf_counter() - start) / case.iters * 1e3
        result["single_device_max_abs_err"] = float((single()[0].double() - truth.double()).abs().max())
    return {"case": asdict(case), "world_size": world_size, **result}


def _worker(rank: int, world_size: int, backend: str, port: int, cases, results) -> None:
    """One rank: join the group, run every case, rank 0 puts one result per case on `results`."""
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    try:
        dist.barrier()
        for case in cases:
            result = _run_case(case, rank, world_size, device)
            if rank == 0:
                results.put(result)
    finally:
        dist.destroy_process_group()


def run_ring_check(cases, *, world_size: int, backend: str = "gloo") -> list[dict]:
    """Start `world_size` processes (spawn), run `cases` (RingCase) on each, return rank 0's results.

    gloo runs on the CPU; nccl needs one CUDA GPU per rank. Each result holds the maximum error against
    single-device attention of the full sequence (float64 on the CPU, fp32 SDPA on a GPU) and, if timed, ms.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with world_size {world_size} needs {world_size} GPUs, "
                           f"found {torch.cuda.device_count()}")
    cases = list(cases)
    if not cases or not all(isinstance(c, RingCase) for c in cases):
        raise TypeError("cases must be a non-empty list of RingCase")
    for case in cases:
        _check_layout_args(case.seqlen, world_size, 0, case.layout)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()  # results are a few numbers per case: the pipe never fills
    with _main_without_interpreter_file():
        mp.start_processes(_worker, args=(world_size, backend, free_port(), cases, results), nprocs=world_size,
                           join=True, start_method="spawn")
    return [results.get() for _ in cases]


@contextlib.contextmanager
def _main_without_interpreter_file():
    """Hide a `__file__` that Triton's interpreter left in `__main__` while spawned children start.

    Running a kernel defined in a notebook, the interpreter copies its own module's globals, `__file__` included,
    into the notebook's namespace (`__main__`); spawn would then run triton/runtime/interpreter.py as every
    child's main script, and the children would die on its relative imports."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    stray = path is not None and Path(path).parts[-3:] == ("triton", "runtime", "interpreter.py")
    if stray:
        del main.__file__
    try:
        yield
    finally:
        if stray:
            main.__file__ = path


def _main(argv=None):
    parser = argparse.ArgumentParser(description="Ring attention over W processes, checked against one device.")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=None, help="full sequence (default: 65536 nccl, 256 gloo)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (default: 20 nccl, 3 gloo)")
    parser.add_argument("--json", default=None, help="write results here (default for nccl: images/ring_nccl.json)")
    args = parser.parse_args(argv)
    gpu = args.backend == "nccl"
    seqlen = args.seqlen or (65536 if gpu else 256)
    common = dict(batch=1, heads=args.heads, kv_heads=args.kv_heads or args.heads, seqlen=seqlen,
                  head_dim=args.head_dim, dtype="bfloat16" if gpu else "float32",
                  iters=args.iters if args.iters is not None else (20 if gpu else 3))
    cases = [RingCase(causal=False, **common), RingCase(causal=True, layout="zigzag", **common),
             RingCase(causal=True, layout="contiguous", **common)]
    results = run_ring_check(cases, world_size=args.world_size, backend=args.backend)
    if gpu:
        name = torch.cuda.get_device_name(0)
    else:
        name = "CPU"
    print(f"ring attention, {args.backend}, {args.world_size} ranks on {name}; B=1 H={common['heads']} "
          f"Hkv={common['kv_heads']} N={seqlen} D={args.head_dim} {common['dtype']}")
    print(f"{'case':22s} {'max err':>9s} {'1-dev err':>9s} {'ring ms':>9s} {'no-ovl ms':>9s} {'1-dev ms':>9s} "
          f"{'speed-up':>8s} {'MiB/rank':>9s}")
    for r in results:
        c = r["case"]
        label = f"{'causal ' + c['layout'] if c['causal'] else 'full'}"
        mem = f"{r['peak_mem_mib']:9.0f}" if r["peak_mem_mib"] is not None else f"{'-':>9s}"
        print(f"{label:22s} {r['max_abs_err']:9.2e} {r.get('single_device_max_abs_err', math.nan):9.2e} "
              f"{r.get('ring_ms', math.nan):9.2f} {r.get('ring_no_overlap_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan) / r.get('ring_ms', math.nan):8.2f} {mem}")
        if r["max_abs_err"] > r["dtype_tolerance"]:
            print(f"  error above the {c['dtype']} tolerance {r['dtype_tolerance']}")
    path = args.json or (str(Path(__file__).resolve().parents[1] / "images" / "ring_nccl.json") if gpu else None)
    if path:
        Path(path).write_text(json.dumps({"device": name, "backend": args.backend, "world_size": args.world_size,
                                          "results": results}, indent=1))
        print("wrote", path)
    return results


if __name__ == "__main__":
    _main()
