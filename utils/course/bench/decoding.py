"""Decoding benchmarks (notebook 08): utils.decoding.split_kv's split-KV kernel against SDPA's backends.

    python -m utils.course.bench.decoding --out images                 # decoding_h200.json and its plots (MHA, GQA, splits)
    python -m utils.course.bench.decoding --launch-floor --out images  # the latency floor of one decode step
    python -m utils.course.bench.decoding --tile-sweep --out images    # every tile on four shapes (GPU_CONFIG's origin)
    python -m utils.course.bench.decoding --paged --out images         # a paged cache against the contiguous one
    python -m utils.course.bench.decoding --latency --out images       # batch-1 steps at 1k-128k, eager and graphed

Needs a CUDA GPU; the pure parts (the launch-floor bookkeeping, the plots) take fake timings and run anywhere.
"""
from __future__ import annotations

import functools

import torch
import triton
from einops import rearrange

from utils.course.bench import error_line
from utils.decoding.split_kv import choose_num_splits, default_num_sms, flash_decode, flash_decode_paged
from utils.decoding.paged_kv import check_page_size
from utils.triton_utils import cdiv



def decoding_methods() -> dict:
    """{name: fn(q, k, v)} compared at decode time: this kernel (auto splits and one split), notebook 05's
    kernel if present, and SDPA with each backend pinned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        return run

    methods = {"flash_decode": lambda q, k, v: flash_decode(q, k, v),
               "flash_decode, 1 split": lambda q, k, v: flash_decode(q, k, v, num_splits=1)}
    try:
        from utils.tiled.fast.backward import flash_attention
        methods["notebook 05 kernel"] = lambda q, k, v: flash_attention(q, k, v)
    except ImportError:
        pass
    methods.update({"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
                    "SDPA efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)})
    return methods


def paged_copy(k, v, page_size: int, *, seed: int = 0):
    """The cache k, v (B, Hkv, N, D) as pools of `page_size`-token pages in a shuffled order, and the block table
    (B, N / page_size) int32 that finds them: a server's pool after many appends and frees, where a sequence's
    pages are rarely neighbours. N must be a multiple of the page size."""
    page_size = check_page_size(page_size)
    if k.shape[2] % page_size:
        raise ValueError(f"the cache length {k.shape[2]} must be a multiple of page_size={page_size}")
    batch, per_seq = k.shape[0], k.shape[2] // page_size
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed)).to(k.device)
    pools = []
    for t in (k, v):
        pages = rearrange(t, "b h (p s) d -> (b p) h s d", s=page_size)  # in sequence order
        pool = torch.empty_like(pages)
        pool[order] = pages
        pools.append(pool)
    return pools[0], pools[1], order.view(batch, per_seq).to(torch.int32)


def benchmark_decoding(batches, seqlens, *, heads=16, kv_heads=16, head_dim=128, new_tokens=1,
                       dtype=torch.bfloat16, methods=None, splits=None, page_sizes=()) -> list[dict]:
    """Time each method on q (B, heads, new_tokens, D) against a cache (B, kv_heads, N, D) on the GPU.

    One row per (batch, seqlen, method): ms, TFLOP/s and GB/s (bytes of K, V, q and o over the time: decoding
    reads the whole cache once, so bandwidth is its roofline), and the error against the fp32 SDPA.
    `splits`: also time flash_decode with each of these num_splits (method "flash_decode, S splits").
    `page_sizes`: also time flash_decode_paged on a shuffled copy of the cache in pages of each size, and
    flash_decode given the lengths too ("flash_decode, cache_seqlens"), so that pair differs only by the page
    look-ups (the lengths and the table are read on the host at the first call only: the same tensors follow).
    """
    methods = dict(decoding_methods() if methods is None else methods)  # {} means: only the split sweep
    for s in splits or ():
        methods[f"flash_decode, {s} splits"] = lambda q, k, v, s=s: flash_decode(q, k, v, num_splits=s)
    rows = []
    for n in seqlens:
        for b in batches:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, heads, new_tokens, head_dim, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(b, kv_heads, n, head_dim, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(b, kv_heads, n, head_dim, device="cuda", dtype=dtype, generator=gen)
            # fp32 reference one sequence at a time: an fp32 copy of a 64 × 128k cache would not fit
            ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), enable_gqa=kv_heads != heads)
                for i in range(b)])
            case = dict(batch=b, seqlen_k=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        new_tokens=new_tokens, dtype=str(dtype).removeprefix("torch."))

            timed = list(methods.items())
            if page_sizes:
                lengths = torch.full((b,), n, device="cuda", dtype=torch.int32)
                timed.append(("flash_decode, cache_seqlens",
                              lambda q, k, v: flash_decode(q, k, v, cache_seqlens=lengths)))
            for name, fn in timed:
                rows.append(_row(name, case, *_measure(fn, q, k, v, ref)))
            for p in page_sizes:  # one pool at a time: each is a copy of the cache
                pools = paged_copy(k, v, p)
                paged = lambda q, k, v, pools=pools: flash_decode_paged(q, *pools, lengths)  # noqa: E731
                rows.append(_row(f"flash_decode_paged, {p}-token pages", dict(case, page_size=p),
                                 *_measure(paged, q, k, v, ref)))
                del pools, paged
            del q, k, v, ref
            torch.cuda.empty_cache()
    return rows


def _measure(fn, q, k, v, ref):
    """(max |error| against ref, ms) of fn(q, k, v), or (the error message, None) if it raises."""
    from utils.course.bench import benchmark

    try:
        err = float((fn(q, k, v).float() - ref).abs().max())
        return err, benchmark(fn, q, k, v)
    except Exception as exc:  # a backend that does not take this shape (or OOM): recorded
        torch.cuda.empty_cache()
        return error_line(exc, 120), None


def _row(method, case, err, ms):
    """One benchmark row: the case, and the timing with what follows from it, or the error that stopped it."""
    if ms is None:
        return dict(method=method, **case, error=err)
    from utils.course.bench import attention_flops, tflops

    b, h, hk, nq, n, d = (case[key] for key in ("batch", "heads", "kv_heads", "new_tokens", "seqlen_k", "head_dim"))
    nbytes = (2 * b * hk * n * d + 2 * b * h * nq * d) * getattr(torch, case["dtype"]).itemsize  # K, V, q, o
    programs = b * hk * cdiv(h // hk * nq, 64)
    return dict(method=method, **case, ms=ms, tflops=tflops(attention_flops(b, h, nq, n, d), ms),
                gbps=nbytes / ms / 1e6, max_abs_err=err,
                auto_splits=choose_num_splits(programs, n, 64, default_num_sms("cuda")))


def plot_decoding_benchmark(rows, *, title="", peak_gbps=None):
    """One panel per batch size: achieved bandwidth (TB/s) against the KV length, one line per method."""
    import matplotlib.pyplot as plt

    from utils.course.plotting import use_course_style

    use_course_style()
    rows = [r for r in rows if "ms" in r]
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.6), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        for m in methods:
            pts = sorted((r["seqlen_k"], r["gbps"] / 1e3) for r in rows if r["batch"] == b and r["method"] == m)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, linestyle="--" if "1 split" in m else "-")
        if peak_gbps:
            ax.axhline(peak_gbps / 1e3, color="k", linewidth=1, linestyle=":", label="HBM peak")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("KV cache length")
    axes[0][0].set_ylabel("K/V read bandwidth (TB/s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # one legend beside the panels: inside one it would hide the lines it names
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return fig


def save_decoding_plots(result: dict, folder, tag: str) -> list:
    """decoding_mha_<tag>.png and decoding_gqa_<tag>.png from a benchmark result (the JSON `_main` writes)."""
    from pathlib import Path

    paths = []
    for key, label in (("mha", "16 heads"), ("gqa", "16 query heads, 2 KV heads")):
        fig = plot_decoding_benchmark(result[key], peak_gbps=result.get("peak_gbps"),
                                      title=f"Decoding one token, {label}, D=128, bf16 — {result['device']}")
        paths.append(Path(folder) / f"decoding_{key}_{tag}.png")
        fig.savefig(paths[-1], bbox_inches="tight")
    return paths


# --- launch floor (GPU): `python -m utils.course.bench.decoding --launch-floor --out images` ---------------------------

LAUNCH_FLOOR_COMMAND = "python -m utils.course.bench.decoding --launch-floor --out images"
LAUNCH_FLOOR_SHAPE = dict(batch=1, heads=16, kv_heads=16, seqlen_k=4096, head_dim=128)


def _stored(kind: str):
    """The path function of one kind of stored measurement: (folder, tag) -> <folder>/decoding_<kind>_<tag>.json."""
    def path(folder, tag: str = "h200"):
        from pathlib import Path

        return Path(folder) / f"decoding_{kind}_{tag}.json"

    path.__doc__ = f"Where the {kind.replace('_', ' ')} measurement of a GPU tagged `tag` is kept."
    return path


def _write_json(path, payload) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


launch_floor_path = _stored("launch_floor")
latency_path = _stored("latency")
paged_path = _stored("paged")


def wall_time_us(fn, *, iters: int = 200, warmup: int = 20) -> float:
    """Microseconds per call of `fn()` called back to back, as the host sees it (synchronised at both ends).

    For a tiny problem this is the floor of a decoding step: the GPU finishes each kernel before the CPU has
    launched the next one, so the time is the launch path's, not the kernel's."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def graphed(step):
    """`step()` captured once in a CUDA graph, after a warm-up on a side stream (compilation, allocation, the
    value checks) as torch.cuda.graphs asks; returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def launch_floor_methods(q, k, v) -> dict:
    """{name: fn()} for one decode step on (q, k, v): flash_decode through its Python entry point, the same call
    (and one with every sequence's length, as a server passes them) captured in a CUDA graph and replayed, and
    SDPA with the flash and cuDNN backends pinned, called and replayed from a graph. A step that cannot be
    captured is recorded as its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        return run

    def failed(exc):
        def fn():
            raise exc
        return fn

    lengths = torch.full((q.shape[0],), k.shape[2], device=q.device, dtype=torch.int32)
    steps = {"flash_decode": functools.partial(flash_decode, q, k, v),
             "flash_decode, cache_seqlens": functools.partial(flash_decode, q, k, v, cache_seqlens=lengths),
             "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}
    methods = {"flash_decode (Python launch)": steps["flash_decode"]}
    for name, step in steps.items():
        if name.startswith("SDPA"):
            methods[name] = step
        try:
            methods[f"{name} (CUDA graph replay)"] = graphed(step)
        except Exception as exc:  # a backend that cannot be captured (or does not take this shape)
            methods[f"{name} (CUDA graph replay)"] = failed(exc)
    return methods


def launch_floor_env(command: str = LAUNCH_FLOOR_COMMAND) -> dict:
    """The environment a launch-floor measurement was taken in: GPU, versions, date and command."""
    from utils import gpu

    return gpu.environment(command)


def measure_launch_floor(*, methods=None, timer=wall_time_us, shape=None, dtype=torch.bfloat16,
                         command: str = LAUNCH_FLOOR_COMMAND) -> dict:
    """Time one decode step of a tiny problem (`LAUNCH_FLOOR_SHAPE`: a 4k cache at batch 1) each way of
    `launch_floor_methods`. Returns {"environment", "shape", "rows": [{"method", "us"} or {"method", "error"}]}.

    `methods` ({name: fn()}) and `timer` (fn -> µs) replace the GPU parts, e.g. in a test on the CPU."""
    shape = dict(LAUNCH_FLOOR_SHAPE if shape is None else shape)
    if methods is None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(shape["batch"], shape["heads"], 1, shape["head_dim"], device="cuda", dtype=dtype,
                        generator=gen)
        k, v = (torch.randn(shape["batch"], shape["kv_heads"], shape["seqlen_k"], shape["head_dim"], device="cuda",
                            dtype=dtype, generator=gen) for _ in range(2))
        methods = launch_floor_methods(q, k, v)
    rows = []
    for name, fn in methods.items():
        try:
            rows.append({"method": name, "us": float(timer(fn))})
        except Exception as exc:  # a backend that does not take this shape: recorded, not fatal
            rows.append({"method": name, "error": error_line(exc, 120)})
    shape["dtype"] = str(dtype).removeprefix("torch.")
    return {"environment": launch_floor_env(command), "shape": shape, "rows": rows}


def write_launch_floor(folder, tag: str = "h200", **kwargs):
    """Measure the launch floor (`measure_launch_floor(**kwargs)`) and write it as JSON; returns the path."""
    path = launch_floor_path(folder, tag)
    _write_json(path, measure_launch_floor(**kwargs))
    return path


LATENCY_COMMAND = "python -m utils.course.bench.decoding --latency --out images"
LATENCY_SEQLENS = (1024, 4096, 16384, 65536, 131072)


def write_latency(folder, tag: str = "h200", *, seqlens=LATENCY_SEQLENS, command: str = LATENCY_COMMAND,
                  **kwargs):
    """Batch-1 decoding latency at each cache length, a served model's heads (32 query heads on 8 KV heads,
    d = 128, bf16), each way of `launch_floor_methods` (kwargs go to `measure_launch_floor`); writes
    decoding_latency_<tag>.json, rows {"seqlen_k", "method", "us" or "error"}, and returns its path."""
    rows, result = [], None
    for n in seqlens:
        shape = dict(batch=1, heads=32, kv_heads=8, seqlen_k=n, head_dim=128)
        result = measure_launch_floor(shape=shape, command=command, **kwargs)
        rows += [dict(seqlen_k=n, **r) for r in result["rows"]]
        torch.cuda.empty_cache()
    shape = {k: v for k, v in result["shape"].items() if k != "seqlen_k"}
    path = latency_path(folder, tag)
    _write_json(path, {"environment": result["environment"], "shape": shape, "rows": rows})
    return path


# The tile sweep behind GPU_CONFIG: four decode shapes (batch, heads, kv_heads, cache length), every tile.
SWEEP_SHAPES = ((1, 16, 16, 32768), (4, 16, 16, 131072), (16, 16, 2, 65536), (64, 16, 16, 16384))
SWEEP_TILES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def tile_sweep(shapes=SWEEP_SHAPES, tiles=SWEEP_TILES, *, head_dim=128, dtype=torch.bfloat16) -> dict:
    """Time flash_decode (automatic splits) with each (keys per tile, warps, stages) on each shape. Returns
    {"rows": [{shape, bn, w, st, ms, gbps, err}], "best": the tile with the best geometric mean of GB/s}."""
    import math

    from utils.course.bench import benchmark

    rows = []
    for b, h, hk, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, 1, head_dim, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hk, n, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), enable_gqa=hk != h) for i in range(b)])
        nbytes = (2 * k.numel() + 2 * q.numel()) * k.element_size()
        for bn, w, st in tiles:
            fn = functools.partial(flash_decode, _block_n=bn, _num_warps=w, _num_stages=st)
            err = (fn(q, k, v).float() - ref).abs().max().item()
            ms = benchmark(fn, q, k, v)
            rows.append(dict(shape=[b, h, hk, n], bn=bn, w=w, st=st, ms=ms, gbps=nbytes / ms / 1e6, err=err))
    score = {t: math.prod(r["gbps"] for r in rows if (r["bn"], r["w"], r["st"]) == t) for t in tiles}
    return {"rows": rows, "best": list(max(score, key=score.get))}


PAGED_COMMAND = "python -m utils.course.bench.decoding --paged --out images"


def write_paged(folder, tag: str = "h200", *, command: str = PAGED_COMMAND, batches=(1, 4, 16, 64),
                seqlens=(4096, 16384, 65536), page_sizes=(16, 64, 256)):
    """Paged against contiguous decoding, the shapes of a served model (32 query heads on 8 KV heads, d = 128,
    bf16, one new token), written with its environment to decoding_paged_<tag>.json."""
    from utils import gpu

    rows = benchmark_decoding(batches, seqlens, heads=32, kv_heads=8, page_sizes=page_sizes,
                              methods={"flash_decode": lambda q, k, v: flash_decode(q, k, v)})
    path = paged_path(folder, tag)
    _write_json(path, {"environment": gpu.environment(command), "rows": rows})
    return path


def _main(argv=None):
    import argparse
    import json
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Benchmark flash-decoding on a CUDA GPU")
    parser.add_argument("--out", default="images", help="folder for decoding_<gpu>.json and the plots")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--launch-floor", action="store_true",
                        help="only measure the decode-step latency floor (decoding_launch_floor_<tag>.json)")
    parser.add_argument("--latency", action="store_true",
                        help="only time batch-1 decode steps, eager and CUDA-graphed (decoding_latency_<tag>.json)")
    parser.add_argument("--paged", action="store_true",
                        help="only time flash_decode_paged against flash_decode (decoding_paged_<tag>.json)")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="only time every tile of SWEEP_TILES on SWEEP_SHAPES (decoding_sweep_<tag>.json)")
    args = parser.parse_args(argv)
    command = "python -m utils.course.bench.decoding " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tile_sweep:
        from utils import gpu

        result = {"environment": gpu.environment(command), **tile_sweep()}
        (out / f"decoding_sweep_{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
        print("best (keys per tile, warps, stages):", result["best"])
        return
    if args.latency:
        path = write_latency(out, args.tag, command=command)
        for r in json.loads(path.read_text())["rows"]:
            print(f"N={r['seqlen_k']:6d} {r['method']:48s} " + (f"{r['us']:8.1f} µs" if "us" in r else r["error"]))
        print("wrote", path)
        return
    if args.paged:
        path = write_paged(out, args.tag, command=command)
        for r in json.loads(path.read_text())["rows"]:
            print(f"B={r['batch']:3d} N={r['seqlen_k']:6d} {r['method']:36s} " +
                  (f"{r['ms'] * 1e3:8.1f} µs {r['gbps']:6.0f} GB/s" if "ms" in r else r["error"]))
        print("wrote", path)
        return
    if args.launch_floor:
        path = write_launch_floor(out, args.tag, command=command)
        for r in json.loads(path.read_text())["rows"]:
            print(f"{r['method']:34s} " + (f"{r['us']:8.1f} µs" if "us" in r else r["error"]))
        print("wrote", path)
        return
    device = torch.cuda.get_device_name()
    peak = 4800.0 if "H200" in device else None  # GB/s, NVIDIA's H200 datasheet (HBM3e)
    batches, seqlens = (1, 4, 16, 64), (4096, 16384, 65536, 131072)
    from utils import gpu

    result = {"environment": gpu.environment(command), "device": device, "torch": torch.__version__,
              "triton": triton.__version__, "peak_gbps": peak}
    runs = {"mha": lambda: benchmark_decoding(batches, seqlens, heads=16, kv_heads=16),
            "gqa": lambda: benchmark_decoding(batches, seqlens, heads=16, kv_heads=2),
            "splits": lambda: benchmark_decoding((1,), (32768,), heads=16, kv_heads=16, methods={},
                                                 splits=(1, 2, 4, 8, 16, 32, 64, 128))}
    for key, run in runs.items():
        result[key] = run()
        (out / f"decoding_{args.tag}.json").write_text(json.dumps(result, indent=1))  # kept if a later one fails
    for key in ("mha", "gqa", "splits"):
        for r in result[key]:
            line = f"{r['ms']:8.3f} ms {r['gbps']:7.0f} GB/s {r['tflops']:6.2f} TFLOP/s err {r['max_abs_err']:.1e}" \
                if "ms" in r else r["error"]
            print(f"{key:6s} B={r['batch']:3d} N={r['seqlen_k']:6d} {r['method']:24s} {line}")
    print("wrote", *save_decoding_plots(result, out, args.tag))


if __name__ == "__main__":
    _main()
