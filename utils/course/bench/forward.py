"""Forward-attention benchmark: registry implementations beside PyTorch SDPA with each backend pinned.

    python -m utils.course.bench.forward                                  # triton vs SDPA flash/cudnn/efficient, the full grid
    python -m utils.course.bench.forward --impls triton --seqlens 1024 2048 --head-dims 64 --name quick
    python -m utils.course.bench.forward --worklog --sdpa flash cudnn --name triton_fwd_h200   # notebook 05b's steps too
    python -m utils.course.bench.forward --overlap --sdpa cudnn --name 05b_overlap_h200       # 05b: a step that did not pay
    python -m utils.course.bench.forward --exp2-fma --sdpa cudnn --name 05b_exp2_h200         # 05b: exponentials on FMA
    python -m utils.course.bench.forward --gluon-tiles --sdpa cudnn flash --name 05b_gluon_h200  # 05b: Gluon, per tile
    python -m utils.course.bench.forward --impls gluon gluon_ws --ws-tiles --sdpa cudnn flash --name 05b_gluon_ws_h200  # 05b: WS
    python -m utils.course.bench.forward --impls gluon_ws --ws3-tiles --sdpa cudnn --head-dims 64 --name 05b_gluon_ws3_h200
    python -m utils.course.bench.forward --dtype fp16 --peers triton-tutorial --tutorial PATH --tutorial-ref release/3.6.x

Every configuration is timed in the same run with `utils.course.bench.benchmark` (triton.testing.do_bench: median,
L2 flushed) and reported as TFLOP/s (utils.course.bench.attention_flops: 4·B·H·N²·D, halved when causal) and as
ratios to each SDPA backend. `--peers` adds the Triton tutorial's kernel (utils.course.bench.peers: read from its own
file at run time; shapes it cannot run are recorded as "not supported"). Results go to images/<name>.json and a
plot images/<name>.png (TFLOP/s against N, one line per implementation, one panel per head dim and causal
setting). Needs a CUDA GPU; the pure parts (argument parsing, the JSON, the plot and the ratio table) take a
timing function and run anywhere. utils.course.bench.peers_sweep puts forward and backward, fp16 and bf16, in one run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from utils import gpu
from utils.course.bench import attention_flops, error_line, median_rows, peers, rotated

SDPA_BACKENDS = ("flash", "cudnn", "efficient")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMAGES = Path(__file__).resolve().parents[3] / "images"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.forward", description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", nargs="*", default=["triton"], help="registry names (utils.attention.REGISTRY)")
    p.add_argument("--sdpa", nargs="*", default=list(SDPA_BACKENDS), choices=SDPA_BACKENDS,
                   help="SDPA backends to pin, each measured as sdpa-<backend>")
    add_grid_arguments(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--worklog", action="store_true",
                   help="also time notebook 05b's intermediate kernels (utils.course.worklogs.triton_forward.WORKLOG)")
    p.add_argument("--sweep", action="store_true",
                   help="also time every tile config of utils.course.worklogs.triton_forward.SWEEP_CONFIGS, with and without TMA")
    p.add_argument("--overlap", action="store_true",
                   help="also time each tile of utils.course.worklogs.triton_forward.TUNE_TILES with host descriptors, its loop in "
                        "order and overlapped by one tile (notebook 05b, section 5)")
    p.add_argument("--exp2-fma", action="store_true",
                   help="also time each tile of utils.course.worklogs.triton_forward.TUNE_TILES with host descriptors, every "
                        "exponential on MUFU, 1 in 2 and 1 in 4 on the FMA units (notebook 05b, section 5)")
    p.add_argument("--gluon-tiles", action="store_true",
                   help="also time the Gluon kernel with each tile of utils.explicit.forward.GLUON_TILES (notebook 05b, "
                        "section 9; H100/H200 only)")
    p.add_argument("--ws-tiles", action="store_true",
                   help="also time the warp-specialised Gluon kernel with each tile of utils.explicit.forward_ws.WS_TILES "
                        "(notebook 05b, section 10; H100/H200 only)")
    p.add_argument("--ws-pingpong", action="store_true",
                   help="also time the warp-specialised Gluon kernels (forward_ws, forward_ws3) with each tile of their "
                        "PINGPONG_TILES: the consumers issue their products in turns (H100/H200 only)")
    p.add_argument("--ws3-tiles", action="store_true",
                   help="also time the three-consumer Gluon kernel (utils.explicit.forward_ws3, head dim 64) with "
                        "each tile of its WS3_TILES (H100/H200 only)")
    peers.add_arguments(p)
    p.add_argument("--name", default="bench_fwd", help="output files images/<name>.json and .png")
    p.add_argument("--out-dir", type=Path, default=IMAGES)
    return check_grid_arguments(p, p.parse_args(argv))


def add_grid_arguments(p: argparse.ArgumentParser) -> None:
    """The shape grid and timing options shared by the forward benchmark and utils.course.bench.peers_sweep."""
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every implementation this many times per shape, each round starting one further "
                        "along the list, and keep the median: a GPU that heats up under load (the H200 slows its "
                        "clock) then favours no position in the list")


def check_grid_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args`, or a parser error naming the first bad grid option (and the need for something to measure)."""
    for flag in ("batch", "heads", "warmup", "rep", "rounds"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag} must be positive")
    if any(n <= 0 for n in args.seqlens) or any(d <= 0 for d in args.head_dims):
        p.error("--seqlens and --head-dims must be positive")
    if not args.impls and not args.sdpa and not args.peers:
        p.error("nothing to measure: give --impls, --sdpa or --peers")
    if "/" in args.name or not args.name:
        p.error("--name must be a bare file name")
    return args


def sdpa_pinned(backend: str):
    """SDPA forced onto one backend (PyTorch raises if that backend cannot run the inputs)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def attention(q, k, v, *, causal=False, sm_scale=None):
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)

    return attention


def candidates(args) -> dict:
    """{label: fn(q, k, v, causal=...)} for the registry names, pinned SDPA backends and peers asked for (a peer
    whose file is missing is left out with a message)."""
    from utils.attention import REGISTRY

    out = {}
    for name in args.impls:
        if name not in REGISTRY:
            raise ValueError(f"unknown implementation {name!r}; registered: {', '.join(REGISTRY)}")
        out[name] = REGISTRY[name].load()
    if getattr(args, "worklog", False):
        from utils.course.worklogs.triton_forward import WORKLOG, worklog_variant
        out.update({name: worklog_variant(name) for name in WORKLOG})
    if getattr(args, "sweep", False):
        from utils.course.worklogs.triton_forward import SWEEP_CONFIGS, Steps, variant
        for tma in (False, True):
            for c in SWEEP_CONFIGS:
                name = f"{tile_label(c)}{' TMA' if tma else ''}"
                out[name] = variant(c, Steps(tma=tma), name)
    if getattr(args, "gluon_tiles", False):
        from utils.explicit.forward import GLUON_TILES
        from utils.explicit.forward import variant as gluon_variant
        for c in GLUON_TILES:
            name = f"gluon {c.block_m}x{c.block_n} w{c.num_warps} s{c.stages}"
            out[name] = gluon_variant(c, name)
    if getattr(args, "ws_tiles", False):
        from utils.explicit import forward_ws as gluon_ws
        out.update({gluon_ws.label(c): gluon_ws.variant(c, gluon_ws.label(c))
                    for c in gluon_ws.WS_TILES})
    if getattr(args, "ws_pingpong", False):
        from utils.explicit import forward_ws as gluon_ws, forward_ws3
        out.update({gluon_ws.label(c): gluon_ws.variant(c, gluon_ws.label(c)) for c in gluon_ws.PINGPONG_TILES})
        out.update({forward_ws3.label(c): forward_ws3.variant(c, forward_ws3.label(c))
                    for c in forward_ws3.PINGPONG_TILES})
    if getattr(args, "ws3_tiles", False):
        from utils.explicit import forward_ws3
        out.update({forward_ws3.label(c): forward_ws3.variant(c, forward_ws3.label(c))
                    for c in forward_ws3.WS3_TILES})
    for step in STEP_LABELS:   # notebook 05b section 5: one switch off and on, per tile, host descriptors
        if getattr(args, step, False):
            from utils.course.worklogs.triton_forward import TUNE_TILES, Steps, variant
            for c in TUNE_TILES:
                for value in STEP_LABELS[step]:
                    name = step_label(c, step, value)
                    out[name] = variant(c, Steps(tma=True, host_descriptors=True, **{step: value}), name)
    for backend in args.sdpa:
        out[f"sdpa-{backend}"] = sdpa_pinned(backend)
    out.update(peers.from_args(args))
    return out


def tile_label(c) -> str:
    """A tile config as the sweeps label it: 'tiles 128x64 w8 s3' (block_m x block_n, warps, stages)."""
    return f"tiles {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"


# The Steps switches that --overlap and --exp2-fma time in each of their states: the label of each state.
STEP_LABELS = {"overlap": {False: "in order", True: "overlapped"},
               "exp2_fma": {0: "exp2 on MUFU", 2: "exp2 1/2 on FMA", 4: "exp2 1/4 on FMA"}}


def step_label(config, step: str, value) -> str:
    """The label of one state of a switch: 'tiles 128x64 w8 s3 in order', '... overlapped', '... exp2 1/4 on FMA'."""
    return f"{tile_label(config)} {STEP_LABELS[step][value]}"


def configurations(args):
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [(d, causal, n) for d in args.head_dims for causal in causals for n in args.seqlens]


def run(args, fns: dict, time_ms=None, device="cuda", progress=True) -> list[dict]:
    """Time every fn on every configuration; one record per (impl, head_dim, causal, seqlen).

    `time_ms(fn, q, k, v, causal)` returns milliseconds (default: utils.course.bench.benchmark). A failure (an SDPA
    backend that refuses a shape, out of memory) is recorded with tflops None and its error, not raised; so is a
    shape that a peer says it cannot run (`fn.unsupported(...)`), as "not supported: <why>", without running it.
    With `args.rounds` > 1 (absent: 1), each shape is timed that many times over, round r starting at the r-th
    implementation, and a record keeps the median.
    """
    from tqdm.auto import tqdm

    from utils.course.bench import benchmark

    if time_ms is None:
        def time_ms(fn, q, k, v, causal):
            return benchmark(fn, q, k, v, causal=causal, warmup=args.warmup, rep=args.rep)

    dtype = DTYPES[args.dtype]
    capability = torch.cuda.get_device_capability() if torch.device(device).type == "cuda" else None
    rounds = getattr(args, "rounds", 1)
    records = []
    configs = configurations(args)
    labels = list(fns)
    bar = tqdm(total=len(configs) * len(fns) * rounds, desc="benchmark", disable=not progress)
    for d, causal, n in configs:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(args.batch, args.heads, n, d, generator=gen).to(device=device, dtype=dtype)
                   for _ in range(3))
        flops = attention_flops(args.batch, args.heads, n, n, d, causal=causal)
        shape = {label: dict(impl=label, head_dim=d, causal=causal, seqlen=n, ms=None, tflops=None, error=None)
                 for label in labels}
        times = {label: [] for label in labels}
        for r in range(rounds):
            for label in rotated(labels, r):
                fn, record = fns[label], shape[label]
                bar.set_postfix_str(f"{label} D={d} N={n}{' causal' if causal else ''}")
                bar.update()
                if record["error"] is not None:
                    continue
                why = unsupported(fn, d, dtype, causal, n, "fwd", capability)
                if why is not None:
                    record["error"] = f"not supported: {why}"
                    continue
                try:
                    times[label].append(time_ms(fn, q, k, v, causal))
                except (RuntimeError, ValueError, OutOfResources) as err:  # "No available kernel", out of memory,
                    # a tile that needs more shared memory than this GPU has
                    record["error"] = error_line(err)
        records += median_rows(shape, times, flops)
        del q, k, v
    bar.close()
    return records


def unsupported(fn, head_dim, dtype, causal, seqlen, mode, capability):
    """Why `fn` cannot run this shape, for a peer that says (utils.course.bench.peers.TutorialPeer); None otherwise."""
    check = getattr(fn, "unsupported", None)
    if check is None:
        return None
    return check(head_dim, dtype, causal, seqlen=seqlen, mode=mode, capability=capability)


def ratio_table(records: list[dict], impl: str, baselines) -> list[dict]:
    """Per configuration: impl's TFLOP/s and its ratio to each baseline (None where either is missing)."""
    by_key = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in records}
    rows = []
    for (name, d, causal, n), value in by_key.items():
        if name != impl:
            continue
        row = dict(head_dim=d, causal=causal, seqlen=n, tflops=value)
        for base in baselines:
            other = by_key.get((base, d, causal, n))
            row[f"vs {base}"] = value / other if value and other else None
        rows.append(row)
    return rows


def format_table(records: list[dict]) -> str:
    """TFLOP/s of every implementation per configuration, then the first implementation's ratios."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    keys = list(dict.fromkeys((r["head_dim"], r["causal"], r["seqlen"]) for r in records))
    value = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in records}
    titles = [impls[0] + "/" + b for b in impls[1:]]
    w = [max(16, len(name) + 2) for name in impls]  # a long name widens its column instead of running on
    wr = [max(24, len(title) + 2) for title in titles]
    lines = ["  D causal      N " + "".join(f"{name:>{x}s}" for name, x in zip(impls, w))
             + "".join(f"{title:>{x}s}" for title, x in zip(titles, wr))]
    for d, causal, n in keys:
        vals = [value.get((name, d, causal, n)) for name in impls]
        cells = "".join(f"{x:{y}.1f}" if x else f"{'—':>{y}s}" for x, y in zip(vals, w))
        ratios = "".join(f"{vals[0] / x:{y}.2f}" if vals[0] and x else f"{'—':>{y}s}" for x, y in zip(vals[1:], wr))
        lines.append(f"{d:3d} {str(causal):>6s} {n:6d} {cells}{ratios}")
    return "\n".join(lines)


def write_json(records: list[dict], args, path: Path, fns: dict | None = None) -> Path:
    """environment, settings and results; plus, when `fns` has peers, "peers": {label: the file's path, SHA-256,
    git ref and Triton version}, so that the run names the exact kernel it measured."""
    settings = dict(batch=args.batch, heads=args.heads, dtype=args.dtype, warmup_ms=args.warmup, rep_ms=args.rep)
    if getattr(args, "rounds", 1) > 1:
        settings["rounds"] = args.rounds
    data = dict(environment=gpu.environment(), settings=settings, results=records)
    provenance = {label: fn.provenance() for label, fn in (fns or {}).items() if hasattr(fn, "provenance")}
    if provenance:
        data["peers"] = provenance
    path = Path(path)
    path.write_text(json.dumps(data, indent=1))
    return path


def plot(records: list[dict], path: Path, title: str = "") -> Path:
    """TFLOP/s against N, one line per implementation, one panel per (head dim, causal)."""
    from utils.course.plotting import pyplot, seqlen_axis, write_png

    plt = pyplot()
    panels = list(dict.fromkeys((r["head_dim"], r["causal"]) for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab20" if len(impls) > 10 else "tab10").colors
    for ax, (d, causal) in zip(axes[0], panels):
        ax.set_prop_cycle(color=colors[:len(impls)])
        for name in impls:
            pts = sorted((r["seqlen"], r["tflops"]) for r in records
                         if r["impl"] == name and r["head_dim"] == d and r["causal"] == causal and r["tflops"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        seqlen_axis(ax, sorted({r["seqlen"] for r in records}))
        ax.set_title(f"D={d}, {'causal' if causal else 'not causal'}")
    axes[0][0].set_ylabel("TFLOP/s")
    values = [r["tflops"] for r in records if r["tflops"]]
    if values and max(values) > 20 * min(values):  # PyTorch models and kernels on one plot: log scale
        axes[0][0].set_yscale("log")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if title:
        fig.suptitle(title)
    if len(labels) <= 5:  # a few lines: one row below the panels; many: a column on the right
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.02))
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    else:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
    return write_png(fig, path)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.bench.forward needs a CUDA GPU")
    fns = candidates(args)
    records = run(args, fns)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = gpu.environment()
    json_path = write_json(records, args, args.out_dir / f"{args.name}.json", fns)
    png_path = plot(records, args.out_dir / f"{args.name}.png",
                    title=f"{env.get('gpu', '')}, {args.dtype}, B={args.batch}, H={args.heads}")
    print(format_table(records))
    print(f"wrote {json_path} and {png_path}")
    return records


if __name__ == "__main__":
    main()
