"""MLA decoding bandwidth: utils.mla.decode.mla_decode at DeepSeek's shapes, beside a plain copy (notebook 11).

    python -m utils.course.bench.mla            # writes images/11_mla_h200.json
    python -m utils.course.bench.mla --sweep    # writes images/11_mla_sweep_h200.json: tiles and splits tried

One new token per sequence, r = 512, d_rope = 64, H = 128 and 16 heads, a 4096-token cache, bf16, batch 1 to
128. Each step is captured in a CUDA graph and its replay timed (triton.testing.do_bench_cudagraph, median), as
servers replay their decoding steps: that is the GPU's time, turned into GB/s of the bytes a step must move: the
cache read once (r + d_rope per token), the queries read and the latent outputs written. `eager_ms` is the same
step called from Python (triton.testing.do_bench, median): checks, allocations and launches included, it is
bound by the host for small batches. A large tensor copy
timed in the same run (bytes read + written over its time) gives the bandwidth the GPU actually reaches, and
each row its fraction of it. Each row also gives TFLOP/s, 2·B·H·Nq·N·(2r + d_rope) over its time: with H = 128
heads every cache byte feeds about 240 FLOPs, more than an H200 does per byte it reads, so there the step is
bound by the tensor cores, not by memory. FlashMLA (the `flash_mla` package), if importable, is timed on the
same cache as a peer; otherwise the file records it as absent.

--sweep times mla_decode alone at batch 64 (by default) for each Tiles of sweep_tiles() and each number of splits
of SWEEP_SPLITS (None: pick_splits), so that decode_layout's choice can be read off a stored run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "11_mla_h200.json"
SWEEP_OUT = DEFAULT_OUT.with_name("11_mla_sweep_h200.json")
SWEEP_SPLITS = (None, 4, 8)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
FLASH_MLA_PAGE = 64   # FlashMLA reads a paged cache of 64-token pages


def step_bytes(batch: int, heads: int, n_q: int, seqlen: int, latent: int, rope: int, itemsize: int) -> int:
    """Bytes one decoding step must move: the cache once for all heads, q (r + d_rope) in, the latent o out."""
    cache = batch * seqlen * (latent + rope)
    queries = batch * heads * n_q * (latent + rope)
    outputs = batch * heads * n_q * latent
    return (cache + queries + outputs) * itemsize


def step_flops(batch: int, heads: int, n_q: int, seqlen: int, latent: int, rope: int) -> int:
    """FLOPs of a step: per (head, new token, cache entry) a score over r + d_rope dims and r products for o."""
    return 2 * batch * heads * n_q * seqlen * (2 * latent + rope)


def sweep_tiles():
    """The Tiles --sweep tries: tiles of 16 to 64 entries, one to three in flight, with 8 warps (a 64-row tile's
    accumulator of 64 x 512 fp32 needs them), and with 4 warps one choice per tile size (enough for 16 rows)."""
    from utils.mla.decode import Tiles

    return [*(Tiles(block_n, 8, stages) for block_n in (16, 32, 64) for stages in (1, 2, 3)),
            Tiles(16, 4, 3), Tiles(32, 4, 2), Tiles(64, 4, 2)]


def copy_gbps(nbytes: int, rep: int) -> dict:
    """The rate of a device-to-device copy of `nbytes`: bytes read plus written over the median time."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=rep, return_mode="median")
    return dict(bytes=nbytes, ms=round(ms, 5), gbps=round(2 * nbytes / ms / 1e6, 1))


def flash_mla_peer():
    """(module, None) if FlashMLA imports, else (None, why not)."""
    try:
        import flash_mla
    except Exception as err:   # ImportError, or a build that does not load on this machine
        from utils.course.bench import error_line
        return None, error_line(err)
    return flash_mla, None


def _flash_mla_step(flash_mla, q_latent, q_rope, kv, lengths, scale):
    """A call of FlashMLA on our problem: q (B, 1, H, 576), the cache as 64-token pages (pages, 64, 1, 576)."""
    batch, heads, n_q, latent = q_latent.shape
    q = torch.cat([q_latent, q_rope], dim=-1).transpose(1, 2).contiguous()
    pages = kv.view(-1, FLASH_MLA_PAGE, 1, kv.shape[-1])
    table = torch.arange(pages.shape[0], dtype=torch.int32, device="cuda").view(batch, -1)
    metadata, splits = flash_mla.get_mla_metadata(lengths, n_q * heads, 1)

    def step():
        return flash_mla.flash_mla_with_kvcache(q, pages, table, lengths, latent, metadata, splits,
                                                softmax_scale=scale, causal=True)[0]
    return step


def measure(batch: int, heads: int, *, seqlen: int, latent: int, rope: int, rep: int, flash_mla=None,
            variants=((None, None),)) -> list:
    """Rows for one (batch, heads): mla_decode with each (tiles, num_splits) of `variants` (None: its own
    choice), and FlashMLA if given; each with ms (a CUDA graph's replay), eager_ms (the Python call), GB/s and
    TFLOP/s (of ms) and its largest difference from the float64
    reference (first sequence only: a float64 copy of every cache is large)."""
    import triton

    from utils.mla.decode import decode_layout, mla_decode
    from utils.mla.reference import DEEPSEEK_SM_SCALE, mla_absorbed_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(batch, seqlen, latent + rope, device="cuda", dtype=torch.bfloat16, generator=gen)
    c, k_rope = kv[..., :latent], kv[..., latent:]   # one cache, as servers keep it: read in place
    q_latent = torch.randn(batch, heads, 1, latent, device="cuda", dtype=torch.bfloat16, generator=gen)
    q_rope = torch.randn(batch, heads, 1, rope, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    ref, _ = mla_absorbed_reference(q_latent[:1], q_rope[:1], c[:1], k_rope[:1], lengths[:1],
                                    sm_scale=DEEPSEEK_SM_SCALE)
    nbytes = step_bytes(batch, heads, 1, seqlen, latent, rope, kv.element_size())
    flops = step_flops(batch, heads, 1, seqlen, latent, rope)
    case = dict(batch=batch, heads=heads, seqlen=seqlen, latent=latent, rope=rope, bytes=nbytes)

    def decode(tiles, num_splits):
        # seqlens None: every sequence is full, and the timed call reads no lengths on the host (a sync per call)
        return lambda: mla_decode(q_latent, q_rope, c, k_rope, sm_scale=DEEPSEEK_SM_SCALE, tiles=tiles,
                                  num_splits=num_splits)[0]

    methods = {("mla_decode", tiles, splits): decode(tiles, splits) for tiles, splits in variants}
    if flash_mla is not None:
        try:
            methods[("flash_mla", None, None)] = _flash_mla_step(flash_mla, q_latent, q_rope, kv, lengths,
                                                                  DEEPSEEK_SM_SCALE)
        except Exception as err:
            methods[("flash_mla", None, None)] = err
    rows = []
    for (name, tiles, splits), step in methods.items():
        chosen = {} if name == "flash_mla" else dict(tiles=tiles and tiles._asdict(), asked_splits=splits)
        try:
            if isinstance(step, Exception):
                raise step
            out = step()
            if name == "flash_mla":
                out = out.transpose(1, 2)   # (B, 1, H, r) -> (B, H, 1, r)
            err = float((out[:1].double() - ref).abs().max())
            ms = triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median")
            eager_ms = triton.testing.do_bench(step, rep=rep, return_mode="median")
        except Exception as exc:   # a peer that refuses the shape, or its API changed
            from utils.course.bench import error_line
            rows.append(dict(method=name, **case, **chosen, error=error_line(exc)))
            continue
        row = dict(method=name, **case, **chosen, ms=round(ms, 5), eager_ms=round(eager_ms, 5),
                   gbps=round(nbytes / ms / 1e6, 1),
                   tflops=round(flops / ms / 1e9, 1), max_abs_err=err)
        if name == "mla_decode":
            layout = decode_layout(batch, heads, 1, seqlen, latent, num_splits=splits, tiles=tiles,
                                   num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
            row.update(num_splits=layout.num_splits, row_blocks=layout.row_blocks)
        rows.append(row)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--heads", nargs="+", type=int, default=[128, 16])
    for name, default in (("seqlen", 4096), ("latent", 512), ("rope", 64), ("rep", 100), ("copy-mib", 1024)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--sweep", action="store_true",
                   help="time mla_decode with each of the sweep's tiles and splits instead (batch 64 by default)")
    p.add_argument("--out", type=Path, default=None, help=f"default: images/{DEFAULT_OUT.name}, with --sweep "
                   f"images/{SWEEP_OUT.name}")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = SWEEP_OUT if args.sweep else DEFAULT_OUT
    if args.sweep and args.batches == list(BATCHES):
        args.batches = [64]
    for name in ("seqlen", "latent", "rope", "rep", "copy_mib"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.batches) <= 0 or min(args.heads) <= 0:
        p.error("--batches and --heads must be positive")
    if args.seqlen % FLASH_MLA_PAGE:
        p.error(f"--seqlen must be a multiple of {FLASH_MLA_PAGE} (FlashMLA's page)")
    return args


def main(argv=None) -> dict:
    from utils import gpu

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the MLA benchmark needs a CUDA GPU")
    flash_mla, why_not = (None, "not timed in a sweep") if args.sweep else flash_mla_peer()
    variants = [(tiles, splits) for tiles in sweep_tiles() for splits in SWEEP_SPLITS] if args.sweep \
        else [(None, None)]
    data = dict(environment=gpu.environment(),
                settings=dict(seqlen=args.seqlen, latent=args.latent, rope=args.rope, new_tokens=1,
                              dtype="bfloat16", rep_ms=args.rep, sweep=args.sweep, timing="cuda graph replay"),
                copy=copy_gbps(args.copy_mib * 2**20, args.rep),
                flash_mla=dict(available=flash_mla is not None, version=getattr(flash_mla, "__version__", None),
                               error=why_not),
                rows=[])
    print(f"copy: {data['copy']['gbps']:.0f} GB/s", flush=True)
    for heads in args.heads:
        for batch in args.batches:
            for row in measure(batch, heads, seqlen=args.seqlen, latent=args.latent, rope=args.rope, rep=args.rep,
                               flash_mla=flash_mla, variants=variants):
                what = f"H={heads:4} B={batch:4} {row['method']:11}"
                if args.sweep:
                    what += f" {tuple(row['tiles'].values())!s:12} splits {row['asked_splits']!s:4}"
                if "gbps" in row:
                    row["fraction_of_copy"] = round(row["gbps"] / data["copy"]["gbps"], 3)
                    print(f"{what} {row['ms']:9.4f} ms {row['gbps']:7.0f} GB/s ({row['fraction_of_copy']:.0%} of "
                          f"copy) {row['tflops']:6.1f} TFLOP/s; eager {row['eager_ms']:.4f} ms", flush=True)
                else:
                    print(f"{what} {row['error']}", flush=True)
                data["rows"].append(row)
            args.out.write_text(json.dumps(data, indent=1) + "\n")   # after each shape: a cut run keeps its rows
            torch.cuda.empty_cache()
    return data


if __name__ == "__main__":
    main()
