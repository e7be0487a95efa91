"""Attention sinks and sliding windows on the GPU (notebook 11): the sink kernels' speed, with and without a window.

    python -m utils.course.bench.sinks          # writes images/11_sinks_h200.json

Training shapes as gpt-oss uses them by default: 16 heads of head dim 64, causal, bf16, N = 4k to 16k with
batch = 16k / N. Forward, then the backward alone (from one stored forward), for:
- sinks: the course's sink kernels (utils.sinks: a learned logit per head), with no window and each of --windows;
- triton: the course's forward and backward without a sink or a window (the registry's "triton");
- sdpa-cudnn: SDPA pinned to cuDNN, causal (SDPA has neither sinks nor windows);
- flash-attn-4: FlashAttention-4 with its `learnable_sink` and `window_size`, the peer a gpt-oss user picks, where
  the flash-attn-4 package imports (utils.course.bench.peers); its output is checked against the course's first.
TFLOP/s count the (query, key) pairs each row sees (`visible_pairs`: with a window of W, about W a query), so a
windowed kernel's rate compares with a full one's. Each time is triton.testing.do_bench's median.

Decoding: utils.sinks.decode.sink_decode, one new token for --decode-batch sequences over a cache of each
--decode-seqlens, with no window and each of --windows, timed as servers run their steps (a CUDA graph's replay,
triton.testing.do_bench_cudagraph) and as a Python call (`eager_ms`); GB/s of the bytes decode_traffic counts,
beside a device copy's rate measured in the same run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "11_sinks_h200.json"
IMPLS = ("sinks", "triton", "sdpa-cudnn", "flash-attn-4")
MODES = ("fwd", "bwd")
TOLERANCE = 4e-2   # bf16 outputs below 1: far above rounding, far below a wrong sink or window (errors ~0.1-1)


def visible_pairs(seqlen: int, window: int | None = None) -> int:
    """(query, key) pairs causal attention over `seqlen` tokens computes, each query seeing its last `window`
    keys (None: all before it). Equal to utils.sinks.reference.visible_keys(...).sum(), without the matrix."""
    from utils.checks import positive_int

    positive_int("seqlen", seqlen)
    if window is None or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    window = positive_int("window", window)
    return window * (window + 1) // 2 + (seqlen - window) * window


def step_flops(batch: int, heads: int, seqlen: int, head_dim: int, window: int | None, mode: str) -> float:
    """FLOPs of one pass: 4·B·H·d per visible pair (two products), ×2.5 for the backward."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return 4.0 * batch * heads * head_dim * visible_pairs(seqlen, window) * (2.5 if mode == "bwd" else 1.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.sinks", description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of every shape (batch = tokens // N)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--windows", type=int, nargs="*", default=[4096, 128],
                   help="windows timed beside no window (gpt-oss alternates 128 with none)")
    p.add_argument("--decode-seqlens", type=int, nargs="*", default=[16384, 65536])
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the decoding cache (GQA)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for flag in ("tokens", "heads", "head_dim", "decode_batch", "kv_heads", "warmup", "rep", "copy_mib"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    for flag in ("seqlens", "windows", "decode_seqlens"):
        if any(n <= 0 for n in getattr(args, flag)):
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def _attention(impl: str, sinks, window):
    """fn(q, k, v) -> o for one implementation, with the sink and window it takes; None where it cannot run
    them (triton and SDPA have no sink and no window: they run the no-window row, without a sink)."""
    from utils.attention import REGISTRY
    from utils.course.bench.forward import sdpa_pinned
    from utils.sinks.backward import sink_attention

    if impl == "sinks":
        return lambda q, k, v: sink_attention(q, k, v, sinks, causal=True, window=window)
    if window is not None:
        return None
    if impl == "triton":
        fn = REGISTRY["triton"].load()
        return lambda q, k, v: fn(q, k, v, causal=True)
    if impl == "sdpa-cudnn":
        fn = sdpa_pinned("cudnn")
        return lambda q, k, v: fn(q, k, v, causal=True)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _flash_attention_4(peer, sinks, window):
    """FlashAttention-4 with the course's sink and window: key j seen from position p when p - W < j <= p."""
    window_size = (None, None) if window is None else (window - 1, 0)

    def attention(q, k, v):
        out = peer.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                      window_size=window_size, learnable_sink=sinks)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return attention


def measure(args, impl, fn, mode, window, q, k, v, sinks, reference=None) -> dict:
    """One row: the median ms and TFLOP/s of `fn` in `mode` (its error, if it fails), and for a peer its largest
    difference from the course's output `reference`."""
    import triton.testing

    from utils.course.bench import error_line, tflops

    batch, heads, n, d = q.shape
    row = dict(impl=impl, mode=mode, window=window, seqlen=n, batch=batch, heads=heads, head_dim=d,
               pairs=visible_pairs(n, window), ms=None, tflops=None, max_err=None, error=None)
    try:
        if mode == "fwd":
            with torch.no_grad():
                out = fn(q, k, v)
            if reference is not None:
                row["max_err"] = float((out.float() - reference.float()).abs().max())
                if row["max_err"] > TOLERANCE:
                    row["error"] = f"inaccurate: max |o - sinks' o| = {row['max_err']:.3g} > {TOLERANCE}"
                    return row
            ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=args.warmup, rep=args.rep,
                                         return_mode="median")
        else:
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)
            do = torch.randn_like(out)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True),
                                         warmup=args.warmup, rep=args.rep, return_mode="median")
    except Exception as err:  # noqa: BLE001 - a backend that refuses the shape: a row, not a crash
        row["error"] = error_line(err)
        return row
    row.update(ms=round(ms, 5), tflops=round(tflops(step_flops(batch, heads, n, d, window, mode), ms), 2))
    return row


def training_rows(args, peer) -> list[dict]:
    """Every (impl, mode, window, N) row of the training shapes."""
    from utils.sinks.forward import sink_attention_forward

    rows = []
    for n in args.seqlens:
        batch = max(1, args.tokens // n)
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(batch, args.heads, n, args.head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(3))
        sinks = torch.randn(args.heads, device="cuda", generator=gen)
        for window in [None, *args.windows]:
            reference = sink_attention_forward(q, k, v, sinks, causal=True, window=window)[0]
            fns = {impl: _attention(impl, sinks, window) for impl in args.impls if impl != "flash-attn-4"}
            if "flash-attn-4" in args.impls and peer is not None:
                fns["flash-attn-4"] = _flash_attention_4(peer, sinks, window)
            for impl, fn in fns.items():
                if fn is None:
                    continue
                for mode in args.modes:
                    row = measure(args, impl, fn, mode, window, q, k, v, sinks,
                                  reference if impl == "flash-attn-4" else None)
                    rows.append(row)
                    shown = row["error"] or f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
                    print(f"N={n:6d} B={batch:3d} window {window or 'none':>5} {impl:13s} {mode} {shown}",
                          flush=True)
        del q, k, v
    return rows


def decode_rows(args) -> list[dict]:
    """sink_decode per (cache length, window): ms from a CUDA graph's replay, eager_ms, GB/s of decode_traffic."""
    import triton.testing

    from utils.course.bench import error_line
    from utils.sinks.decode import decode_traffic, sink_decode

    rows = []
    for n in args.decode_seqlens:
        gen = torch.Generator(device="cuda").manual_seed(n)
        b, h, hk, d = args.decode_batch, args.heads, args.kv_heads, args.head_dim
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        sinks = torch.randn(h, device="cuda", generator=gen)
        for window in [None, *args.windows]:
            traffic = decode_traffic(b, h, hk, n, d, window=window)
            row = dict(seqlen=n, batch=b, heads=h, kv_heads=hk, head_dim=d, window=window, keys=traffic.keys,
                       bytes=traffic.bytes, ms=None, eager_ms=None, gbps=None, error=None)
            try:
                step = lambda: sink_decode(q, k, v, sinks, window=window)   # noqa: E731 - the timed call
                step()
                ms = triton.testing.do_bench_cudagraph(step, rep=args.rep, return_mode="median")
                eager = triton.testing.do_bench(step, warmup=args.warmup, rep=args.rep, return_mode="median")
                row.update(ms=round(ms, 5), eager_ms=round(eager, 5), gbps=round(traffic.bytes / ms / 1e6, 1))
            except Exception as err:  # noqa: BLE001
                row["error"] = error_line(err)
            rows.append(row)
            shown = row["error"] or f"{row['ms']:.4f} ms {row['gbps']:7.0f} GB/s (eager {row['eager_ms']:.4f} ms)"
            print(f"decode cache {n:6d} B={b} window {window or 'none':>5} {shown}", flush=True)
    return rows


def main(argv=None) -> dict:
    import sys

    from utils import gpu
    from utils.course.bench import peers
    from utils.course.bench.mla import copy_gbps

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the sinks benchmark needs a CUDA GPU")
    command = " ".join(["python -m utils.course.bench.sinks", *(sys.argv[1:] if argv is None else argv)])
    peer, why_not = None, None
    if "flash-attn-4" in args.impls:
        try:
            peer = peers.load_flash_attention_4()
        except peers.FlashAttention4Unavailable as err:
            why_not = str(err)
            print(f"skipping flash-attn-4: {err}", file=sys.stderr)
    data = dict(environment=gpu.environment(command),
                settings=dict(seqlens=args.seqlens, tokens=args.tokens, heads=args.heads, head_dim=args.head_dim,
                              windows=args.windows, causal=True, dtype="bfloat16", decode_batch=args.decode_batch,
                              kv_heads=args.kv_heads, decode_seqlens=args.decode_seqlens, warmup_ms=args.warmup,
                              rep_ms=args.rep),
                flash_attn_4=dict(available=peer is not None, provenance=peer and peer.provenance(), error=why_not),
                copy=copy_gbps(args.copy_mib * 2**20, args.rep), results=[], decode=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data["results"] = training_rows(args, peer)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    data["decode"] = decode_rows(args)
    for row in data["decode"]:
        if row["gbps"]:
            row["fraction_of_copy"] = round(row["gbps"] / data["copy"]["gbps"], 3)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return data


if __name__ == "__main__":
    main()
