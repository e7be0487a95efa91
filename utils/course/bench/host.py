"""Host time against GPU time for small attention problems (notebook 05b, step 3), into images/<name>.json.

    python -m utils.course.bench.host --name host_h200

Per implementation, pass and shape, in µs per call:
  host   CPU time to issue one call: the fastest of `--reps` loops of `--calls` calls, none waiting for the GPU
         (the fastest, since on a shared host noise only ever adds time)
  gpu    GPU time alone. Forward: the call replayed from a CUDA graph (triton.testing.do_bench_cudagraph), no
         Python. Backward (a graph cannot capture autograd's engine): the sum of the kernels a call runs, as
         torch.profiler records them over `--calls` calls
  bench  what the course's backward benchmarks report (utils.course.bench.benchmark of a closure: torch's Timer,
         back-to-back calls with the GPU synchronised around each block of them, no L2 flush)
When `host` exceeds what the GPU spends per call, the GPU waits for Python and `bench` rises above `gpu`.
The course's Triton kernel is measured twice: launched directly (utils.tiled.fast.launch, the default) and inside
`utils.tiled.fast.launch.dispatch_by_triton()` (every launch through `kernel[grid]`), beside SDPA's FlashAttention-2 and
cuDNN backends (forward through F.scaled_dot_product_attention, backward through autograd for all), and
beside the registry names of `--impls` (the Gluon kernels: gluon, gluon_ws) and the `--peers` (the Triton
tutorial's attention, read from its own file: utils.course.bench.peers; `--dtype fp16`, the only dtype it takes).
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from utils import gpu
from utils.course.bench import benchmark, error_line, peers
from utils.course.bench.backward import autograd_backward
from utils.course.bench.forward import DTYPES, IMAGES, sdpa_pinned

TRITON_DISPATCH = "triton, Triton's dispatch"
IMPLS = ("triton", TRITON_DISPATCH, "sdpa-flash", "sdpa-cudnn")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"],
                   help="fp16 to time the Triton tutorial, whose kernel takes no bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--calls", type=int, default=100, help="calls per host-time loop")
    p.add_argument("--reps", type=int, default=7, help="host-time loops; the fastest is kept")
    p.add_argument("--impls", nargs="*", default=[], help="registry names timed besides the four, e.g. gluon_ws")
    peers.add_arguments(p)
    p.add_argument("--name", default="host")
    p.add_argument("--out-dir", type=Path, default=IMAGES)
    args = p.parse_args(argv)
    for flag in ("batch", "heads", "calls", "reps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag} must be positive")
    if any(n <= 0 for n in args.seqlens):
        p.error("--seqlens must be positive")
    if "/" in args.name or not args.name:
        p.error("--name must be a bare file name")
    return args


def host_us(fn, calls: int, reps: int) -> float:
    """The least CPU time per call of `fn` over `reps` loops of `calls` calls (the GPU is drained before each
    loop, so the launch queue never fills and the CPU never waits on it)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return min(times)


def implementations(args) -> dict:
    """{label: attention(q, k, v, causal=...)}: IMPLS, then args.impls (registry names), then args.peers."""
    from utils.attention import REGISTRY
    from utils.tiled.fast.backward import flash_attention

    fns = {"triton": flash_attention, TRITON_DISPATCH: flash_attention,
           **{impl: sdpa_pinned(impl.removeprefix("sdpa-")) for impl in IMPLS if impl.startswith("sdpa-")}}
    for name in args.impls:
        if name not in REGISTRY:
            raise ValueError(f"unknown implementation {name!r}; registered: {', '.join(REGISTRY)}")
        fns[name] = REGISTRY[name].load()
    return {**fns, **peers.from_args(args)}


def kernel_us(call, calls: int) -> float:
    """GPU time of one call of `call`: the kernels `calls` calls run (torch.profiler's CUDA activity), summed,
    per call. Kernels that overlap (several streams) would count twice; the implementations here use one."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def measure_case(impl, attention, mode, q, k, v, causal, args) -> dict:
    from utils.tiled.fast.launch import dispatch_by_triton

    context = dispatch_by_triton if impl == TRITON_DISPATCH else nullcontext
    if mode == "fwd":
        call = lambda: attention(q, k, v, causal=causal)  # noqa: E731
    else:
        call = autograd_backward(attention)(q, k, v, torch.randn_like(q), causal)
    with context():
        record = dict(host_us=host_us(call, args.calls, args.reps), bench_us=benchmark(call) * 1e3)
        if mode == "fwd":
            import triton.testing

            record["gpu_us"] = triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
        else:
            record["gpu_us"] = kernel_us(call, args.calls)
    return record


def measure(args, fns: dict, device="cuda") -> list[dict]:
    records = []
    for d in args.head_dims:
        for causal in (False, True):
            for n in args.seqlens:
                gen = torch.Generator(device="cpu").manual_seed(0)
                q, k, v = (torch.randn(args.batch, args.heads, n, d, generator=gen)
                           .to(device=device, dtype=DTYPES[args.dtype]) for _ in range(3))
                for mode in ("fwd", "bwd"):
                    for impl, attention in fns.items():
                        record = dict(impl=impl, mode=mode, head_dim=d, causal=causal, seqlen=n)
                        try:
                            record.update(measure_case(impl, attention, mode, q, k, v, causal, args))
                        except Exception as err:  # noqa: BLE001 - a dtype or shape refused, OOM, a peer's own error
                            record.update(host_us=None, bench_us=None, gpu_us=None, error=error_line(err))
                        records.append(record)
                        print(" ".join(f"{k_}={v_:.1f}" if isinstance(v_, float) else f"{k_}={v_}"
                                       for k_, v_ in record.items()), flush=True)
    return records


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("utils.course.bench.host needs a CUDA GPU")
    fns = implementations(args)
    records = measure(args, fns)
    settings = dict(batch=args.batch, heads=args.heads, dtype=args.dtype, calls=args.calls, reps=args.reps)
    provenance = {label: fn.provenance() for label, fn in fns.items() if hasattr(fn, "provenance")}
    path = Path(args.out_dir) / f"{args.name}.json"
    path.write_text(json.dumps(dict(environment=gpu.environment(), settings=settings, peers=provenance,
                                    results=records), indent=1))
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
