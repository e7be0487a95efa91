"""Ring attention over W real processes, checked against one device (notebook 08): course tooling around
utils.ring.attention.

`run_ring_check(cases, world_size=W, backend=...)` starts W processes (torch.multiprocessing, spawn) on gloo (CPU)
or NCCL (one GPU per rank); every rank runs each `RingCase` through `utils.ring.attention.ring_attention`, and rank
0 compares the output and the gradients with single-device attention (and, with `iters`, times both). On 2 GPUs:

    python -m utils.course.ring_check --backend nccl --world-size 2

The launch (`spawn_ranks`, `rank_group`, `check_launch`) also serves `utils.course.bench.ring_comm`, which times
the ring's exchange alone.
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

from utils import gpu
from utils.course.testing import random_qkv, tolerances
from utils.ring.attention import _check_layout_args, pick_local_attention, ring_attention, shard, unshard

RING_NCCL_JSON = Path(__file__).resolve().parents[2] / "images" / "ring_nccl.json"   # the command line's nccl default


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
    backward: bool = True     # check (and, with iters, time) the gradients too
    overlap: bool = True      # for the checks; timings measure the ring with and without overlap


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
        from utils.eager.reference import reference_attention
        return reference_attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.to(device, torch.float32) for t in (q, k.repeat_interleave(group, 1),
                                                          v.repeat_interleave(group, 1)))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32, no N×N matrix
        return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)


def _reference_gradients(q, k, v, do, causal, device):
    """(dq, dk, dv) of `_reference` by autograd: in float64 on the CPU, fp32 on a GPU."""
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    _reference(*leaves, causal, device).backward(do.to(device, dtype))
    return [t.grad for t in leaves]


def _ring_gradients(shards, do, case: RingCase, overlap: bool):
    """This rank's (dq, dk, dv) through the differentiable ring: every rank calls it together."""
    leaves = [t.detach().requires_grad_() for t in shards]
    out = ring_attention(*leaves, causal=case.causal, layout=case.layout, overlap=overlap,
                         local_attention=case.local_attention)
    out.backward(do)
    return [t.grad for t in leaves]


def _gather(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return [p.cpu() for p in parts]


def _run_case(case: RingCase, rank: int, world_size: int, device: torch.device) -> dict | None:
    dtype = getattr(torch, case.dtype)
    q, k, v = random_qkv(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, kv_heads=case.kv_heads,
                         dtype=dtype, seed=case.seed)  # every rank draws the same full tensors, keeps its shard
    q_loc, k_loc, v_loc = (shard(t, world_size, rank, case.layout).to(device) for t in (q, k, v))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def run(overlap=case.overlap):
        return ring_attention(q_loc, k_loc, v_loc, causal=case.causal, layout=case.layout, overlap=overlap,
                              local_attention=case.local_attention)
    out_loc = run()
    result = {"peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    if case.iters:
        result["ring_ms"] = _time(lambda: run(True), device, case.iters)
        result["ring_no_overlap_ms"] = _time(lambda: run(False), device, case.iters)
    parts = _gather(out_loc, world_size)
    if case.backward:
        do = random_qkv(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, dtype=dtype,
                        seed=case.seed + 1)[0]  # the loss's gradient dO, like q
        do_loc = shard(do, world_size, rank, case.layout).to(device)
        shards = (q_loc, k_loc, v_loc)
        grad_parts = [_gather(g, world_size) for g in _ring_gradients(shards, do_loc, case, case.overlap)]
        if case.iters:
            for key, overlap in (("ring_fwd_bwd_ms", True), ("ring_fwd_bwd_no_overlap_ms", False)):
                result[key] = _time(lambda: _ring_gradients(shards, do_loc, case, overlap), device, case.iters)
    if rank != 0:
        return None
    out = unshard(parts, case.layout).to(device)
    truth = _reference(q, k, v, case.causal, device)
    result["max_abs_err"] = float((out.double() - truth.double()).abs().max())
    result["dtype_tolerance"] = tolerances(dtype)["atol"]
    if case.backward:  # each gradient's largest error, relative to its largest entry
        errors = [(unshard(g, case.layout).to(device).double() - expect.double()).abs().max() / expect.abs().max()
                  for g, expect in zip(grad_parts, _reference_gradients(q, k, v, do, case.causal, device))]
        result["grad_rel_err"] = float(max(errors))
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


@contextlib.contextmanager
def rank_group(rank: int, world_size: int, backend: str, port: int):
    """Join the default process group as `rank` of `world_size` (127.0.0.1:`port`); yields this rank's device
    (GPU `rank` for nccl, the CPU for gloo) once every rank is in, and leaves the group on the way out."""
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
        yield device
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, backend: str, port: int, cases, results) -> None:
    """One rank: join the group, run every case, rank 0 puts one result per case on `results`."""
    with rank_group(rank, world_size, backend, port) as device:
        for case in cases:
            result = _run_case(case, rank, world_size, device)
            if rank == 0:
                results.put(result)


def check_launch(world_size: int, backend: str) -> None:
    """A clear error unless `world_size` processes can run on `backend` here (nccl: one GPU per rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with world_size {world_size} needs {world_size} GPUs, "
                           f"found {torch.cuda.device_count()}")


def spawn_ranks(worker, world_size: int, backend: str, *args) -> None:
    """Run `worker(rank, world_size, backend, port, *args)` in `world_size` fresh processes (spawn) and wait
    for all of them; an exception in one is raised here. `worker` must be importable (a module's function)."""
    import torch.multiprocessing as mp

    check_launch(world_size, backend)
    with _main_without_interpreter_file():
        mp.start_processes(worker, args=(world_size, backend, free_port(), *args), nprocs=world_size, join=True,
                           start_method="spawn")


def run_ring_check(cases, *, world_size: int, backend: str = "gloo") -> list[dict]:
    """Start `world_size` processes (spawn), run `cases` (RingCase) on each, return rank 0's results.

    gloo runs on the CPU; nccl needs one CUDA GPU per rank. Each result holds the maximum error against
    single-device attention of the full sequence (float64 on the CPU, fp32 SDPA on a GPU) and, if timed, ms.
    """
    import torch.multiprocessing as mp

    check_launch(world_size, backend)
    cases = list(cases)
    if not cases or not all(isinstance(c, RingCase) for c in cases):
        raise TypeError("cases must be a non-empty list of RingCase")
    for case in cases:
        _check_layout_args(case.seqlen, world_size, 0, case.layout)
    results = mp.get_context("spawn").SimpleQueue()  # results are a few numbers per case: the pipe never fills
    spawn_ranks(_worker, world_size, backend, cases, results)
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
    on_gpu = args.backend == "nccl"
    seqlen = args.seqlen or (65536 if on_gpu else 256)
    common = dict(batch=1, heads=args.heads, kv_heads=args.kv_heads or args.heads, seqlen=seqlen,
                  head_dim=args.head_dim, dtype="bfloat16" if on_gpu else "float32",
                  iters=args.iters if args.iters is not None else (20 if on_gpu else 3))
    cases = [RingCase(causal=False, **common), RingCase(causal=True, layout="zigzag", **common),
             RingCase(causal=True, layout="contiguous", **common)]
    results = run_ring_check(cases, world_size=args.world_size, backend=args.backend)
    name = gpu.name() if on_gpu else "CPU"  # gloo runs on the CPU even where there is a GPU
    print(f"ring attention, {args.backend}, {args.world_size} ranks on {name}; B=1 H={common['heads']} "
          f"Hkv={common['kv_heads']} N={seqlen} D={args.head_dim} {common['dtype']}")
    print(f"{'case':22s} {'max err':>9s} {'1-dev err':>9s} {'ring ms':>9s} {'no-ovl ms':>9s} {'1-dev ms':>9s} "
          f"{'speed-up':>8s} {'MiB/rank':>9s} {'grad err':>9s} {'f+b ms':>9s}")
    for r in results:
        c = r["case"]
        label = f"{'causal ' + c['layout'] if c['causal'] else 'full'}"
        mem = f"{r['peak_mem_mib']:9.0f}" if r["peak_mem_mib"] is not None else f"{'-':>9s}"
        print(f"{label:22s} {r['max_abs_err']:9.2e} {r.get('single_device_max_abs_err', math.nan):9.2e} "
              f"{r.get('ring_ms', math.nan):9.2f} {r.get('ring_no_overlap_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan) / r.get('ring_ms', math.nan):8.2f} {mem} "
              f"{r.get('grad_rel_err', math.nan):9.2e} {r.get('ring_fwd_bwd_ms', math.nan):9.2f}")
        if r["max_abs_err"] > r["dtype_tolerance"]:
            print(f"  error above the {c['dtype']} tolerance {r['dtype_tolerance']}")
        if r.get("grad_rel_err", 0.0) > r["dtype_tolerance"]:
            print(f"  gradient error (relative to the largest gradient) above {r['dtype_tolerance']}")
    path = args.json or (str(RING_NCCL_JSON) if on_gpu else None)
    if path:
        Path(path).write_text(json.dumps({"device": name, "backend": args.backend, "world_size": args.world_size,
                                          "environment": gpu.environment(), "results": results}, indent=1))
        print("wrote", path)
    return results


if __name__ == "__main__":
    _main()
