"""FP8 attention forward against bf16 (notebook 11): the course's FP8 kernel (utils.fp8.forward) beside its bf16
Triton forward (the registry's "triton") and SDPA pinned to cuDNN and to FlashAttention-2, and the FP8 error.

    python -m utils.course.bench.fp8            # writes images/11_fp8_h200.json
    python -m utils.course.bench.fp8 --sweep    # writes images/11_fp8_sweep_h200.json: both FP8 kernels' tiles

Shapes as FlashAttention-3's benchmarks: head dim 128, 16 heads, N = 2k..16k with batch = 16k / N (16k tokens
per shape, B·H·N = 16k·16), causal and not. Rows:
- fp8: the kernel alone on inputs already quantised (utils.fp8.forward.fp8_attention_quantized), as
  FlashAttention-3 reports its FP8 times;
- fp8+quantize: from bf16 inputs, the per-block quantisation and V's transpose included (fp8_attention_forward);
- fp8-ws: the warp-specialised Gluon kernel on the same quantised inputs (utils.fp8.forward_ws, sm_90 only);
- triton: the course's bf16 forward; sdpa-cudnn, sdpa-flash: SDPA in bf16 with that backend pinned.
Each is timed with triton.testing.do_bench (median, L2 flushed) in the same run; TFLOP/s = 4·B·H·N²·D / t,
halved when causal (FP8 is credited the same FLOPs). A row that fails (a backend that refuses the shape, a GPU
without FP8 tensor cores) records its error instead of a time.

The file also stores utils.fp8.study's accuracy table at one shape of outlier_inputs (emulated, float64 on the
GPU), and the FP8 kernels' own errors on those inputs: against the float64 reference, and against the
emulation of the Triton kernel's arithmetic (which it should match to fp32 rounding, up to the odd P that rounds
the other way; the Gluon kernel may sum its P·V products in the tensor cores, with fewer bits).
--sweep times the Triton kernel with each of sweep_configs() and the Gluon kernel with each of its WS_TILES.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

IMPLS = ("fp8", "fp8+quantize", "fp8-ws", "triton", "sdpa-cudnn", "sdpa-flash")
FP8_IMPLS = ("fp8", "fp8+quantize", "fp8-ws")
FP8_CAPABILITY = (8, 9)          # FP8 tensor cores: Ada and Hopper on
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "11_fp8_h200.json"
SWEEP_OUT = DEFAULT_OUT.with_name("11_fp8_sweep_h200.json")


def sweep_configs():
    """The tiles --sweep times the FP8 kernel with (utils.tiled.forward.Config: block_m, block_n, warps,
    stages): the current choice, its neighbours in stages and warps, and other tile shapes."""
    from utils.tiled.forward import Config

    return [Config(64, 128, 4, 3), Config(64, 128, 4, 2), Config(64, 128, 4, 4), Config(64, 128, 8, 3),
            Config(128, 128, 8, 3), Config(128, 128, 8, 2), Config(128, 64, 8, 3), Config(64, 64, 4, 3),
            Config(32, 128, 4, 3), Config(128, 256, 8, 2)]


def sweep_configs_by_impl():
    """{impl: the configs --sweep times it with}: the Triton kernel's sweep_configs() and the Gluon kernel's
    WS_TILES."""
    from utils.fp8 import forward_ws

    return {"fp8": sweep_configs(), "fp8-ws": list(forward_ws.WS_TILES)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of every shape (batch = tokens // N)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--block", type=int, default=64, help="rows of Q and K per FP8 scale")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--accuracy-seqlen", type=int, default=2048,
                   help="N of the accuracy table's shape (batch 1, --heads heads, --head-dim); 0: no table")
    p.add_argument("--sweep", action="store_true", help="time the fp8 row with each of sweep_configs' tiles "
                   "instead (N 8k and 16k by default, no accuracy table)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"default: images/{DEFAULT_OUT.name}, with --sweep images/{SWEEP_OUT.name}")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = SWEEP_OUT if args.sweep else DEFAULT_OUT
    if args.sweep:
        args.impls, args.accuracy_seqlen = ["fp8", "fp8-ws"], 0
        if args.seqlens == [2048, 4096, 8192, 16384]:
            args.seqlens = [8192, 16384]
    for flag in ("tokens", "heads", "head_dim", "block", "warmup", "rep"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if any(n <= 0 for n in args.seqlens):
        p.error("--seqlens must be positive")
    if args.accuracy_seqlen < 0:
        p.error("--accuracy-seqlen must be positive, or 0 for no table")
    return args


def batch_for(seqlen: int, tokens: int) -> int:
    """The batch of a shape: tokens // seqlen, at least 1."""
    return max(1, tokens // seqlen)


def timed_call(impl: str, q, k, v, causal: bool, block: int, config=None):
    """A no-argument function that runs `impl` once on q, k, v (bf16); FP8 inputs are quantised here, once.
    `config`: the FP8 kernel's tiles (None: its own choice)."""
    from utils.attention import REGISTRY
    from utils.course.bench.forward import sdpa_pinned
    from utils.fp8 import forward

    if impl == "fp8":
        inputs = forward.quantize_inputs(q, k, v, block=block)
        return lambda: forward.fp8_attention_quantized(*inputs, scale_block=block, causal=causal, config=config)
    if impl == "fp8-ws":
        from utils.fp8 import forward_ws

        inputs = forward.quantize_inputs(q, k, v, block=block)
        return lambda: forward_ws.fp8_attention_ws(*inputs, scale_block=block, causal=causal, config=config)
    if impl == "fp8+quantize":
        return lambda: forward.fp8_attention_forward(q, k, v, causal=causal, block=block, config=config)
    if impl == "triton":
        fn = REGISTRY["triton"].load()
        return lambda: fn(q, k, v, causal=causal)
    if impl.startswith("sdpa-"):
        fn = sdpa_pinned(impl.removeprefix("sdpa-"))
        return lambda: fn(q, k, v, causal=causal)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def measure(args, impl: str, causal: bool, seqlen: int, q, k, v, config=None) -> dict:
    """One row: the median time in ms and TFLOP/s of `impl` on one shape (with the FP8 kernel's tiles
    `config`, None: its own), or its error."""
    import triton.testing
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from utils import gpu
    from utils.course.bench import attention_flops, error_line, tflops

    batch = q.shape[0]
    row = dict(impl=impl, causal=causal, seqlen=seqlen, batch=batch, heads=args.heads, head_dim=args.head_dim,
               ms=None, tflops=None, error=None)
    if config is not None:
        row["config"] = config._asdict()
    if impl in FP8_IMPLS and gpu.capability() < FP8_CAPABILITY:
        row["error"] = "not supported: FP8 tensor cores need sm_89 or newer"
        return row
    if impl == "fp8-ws" and gpu.capability() != (9, 0):
        row["error"] = "not supported: the Gluon FP8 kernel's wgmma code runs on sm_90 only"
        return row
    try:
        ms = triton.testing.do_bench(timed_call(impl, q, k, v, causal, args.block, config), warmup=args.warmup,
                                     rep=args.rep, return_mode="median")
    except (RuntimeError, ValueError, OutOfResources, CompilationError) as err:   # "No available kernel", memory
        row["error"] = error_line(err)
        return row
    flops = attention_flops(batch, args.heads, seqlen, seqlen, args.head_dim, causal=causal)
    row.update(ms=round(ms, 5), tflops=round(tflops(flops, ms), 2))
    return row


def accuracy(args) -> dict:
    """utils.fp8.study's table on outlier_inputs at (1, heads, accuracy_seqlen, head_dim), emulated on the GPU, and
    the FP8 kernel's errors on the same inputs (output in fp32)."""
    from utils.eager.reference import reference_attention
    from utils.fp8 import forward, study

    n, d = args.accuracy_seqlen, args.head_dim
    inputs = dict(outlier_channels=4, outlier_scale=5.0, seed=0)
    q, k, v = (t.cuda() for t in study.outlier_inputs(1, args.heads, n, d, **inputs))
    ref = reference_attention(q, k, v)
    kernel = []
    for rotate in (False, True):
        o, _ = forward.fp8_attention_forward(q, k, v, block=args.block, rotate=rotate, out_dtype=torch.float32)
        emulated = study.attention_fp8_emulated(q, k, v, scaling="block", block=args.block, rotate=rotate,
                                                block_n=forward.pick_config(d).block_n)
        err = (o.double() - ref).abs()
        kernel.append(dict(method="kernel fp8 per-block" + (" + Hadamard" if rotate else ""),
                           rmse=math.sqrt(err.square().mean().item()), max_abs=err.max().item(),
                           max_abs_vs_emulation=(o.double() - emulated).abs().max().item()))
    from utils import gpu
    if gpu.capability() == (9, 0):
        from utils.fp8 import forward_ws

        for rotate in (False, True):
            quantized = forward.quantize_inputs(q, k, v, block=args.block, rotate=rotate)
            o, _ = forward_ws.fp8_attention_ws(*quantized, scale_block=args.block)
            err = (o.double() - ref).abs()
            kernel.append(dict(method="kernel fp8-ws per-block" + (" + Hadamard" if rotate else ""),
                               rmse=math.sqrt(err.square().mean().item()), max_abs=err.max().item()))
    return dict(shape=dict(batch=1, heads=args.heads, seqlen=n, head_dim=d, block=args.block), inputs=inputs,
                emulated=study.accuracy_table(q, k, v, block=args.block), kernel=kernel)


def main(argv=None) -> dict:
    from utils import gpu
    from utils.fp8.study import format_accuracy_table

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 benchmark needs a CUDA GPU")
    settings = dict(impls=args.impls, seqlens=args.seqlens, tokens=args.tokens, heads=args.heads,
                    head_dim=args.head_dim, block=args.block, dtype="bfloat16 (fp8 rows: float8_e4m3fn)",
                    warmup_ms=args.warmup, rep_ms=args.rep, sweep=args.sweep)
    data = dict(environment=gpu.environment(), settings=settings, results=[], accuracy=None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.accuracy_seqlen:
        data["accuracy"] = accuracy(args)
        print(format_accuracy_table(data["accuracy"]["emulated"] + data["accuracy"]["kernel"]), flush=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for causal in causals:
        for n in args.seqlens:
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(batch_for(n, args.tokens), args.heads, n, args.head_dim, generator=gen)
                       .to("cuda", torch.bfloat16) for _ in range(3))
            runs = [(impl, config) for impl, configs in sweep_configs_by_impl().items() for config in configs] \
                if args.sweep else [(impl, None) for impl in args.impls]
            for impl, config in runs:
                row = measure(args, impl, causal, n, q, k, v, config)
                data["results"].append(row)
                shown = row["error"] or f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
                tiles = f" {tuple(config)!s:20}" if config else ""
                print(f"causal={causal!s:5} N={n:6d} B={row['batch']:3d} {impl:13s}{tiles} {shown}", flush=True)
            args.out.write_text(json.dumps(data, indent=1) + "\n")   # after each shape: a cut run keeps its rows
            del q, k, v
    return data


if __name__ == "__main__":
    main()
