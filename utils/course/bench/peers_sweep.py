"""Forward and backward, fp16 and bf16, in one run and one plot: the course's kernel beside SDPA's pinned
backends (cuDNN, FlashAttention-2, efficient), the official Triton tutorial's kernel (issue 22) and, where the
flash-attn-4 package is installed, FlashAttention-4 (issue 78).

    python -m utils.course.bench.peers_sweep --tutorial .peer/06-fused-attention.py --tutorial-ref release/3.6.x \\
        --name peers_h200
    python -m utils.course.bench.peers_sweep ... --resume     # go on where an interrupted run stopped
    python -m utils.course.bench.peers_sweep ... --resume --remeasure bwd --rounds 3   # the backward again, 3 rounds

Why a module of its own: utils.course.bench.forward times one dtype's forward and utils.course.bench.backward a fixed backward
grid, each with a stored format that notebooks read; this comparison needs both passes and both dtypes as one set
of records {impl, mode, dtype, head_dim, causal, seqlen, ms, tflops, max_err, error}, and for the kernels built
in named steps the steps measured (`kernel_steps`). It reuses their parts: the
candidates (utils.course.bench.forward.candidates: registry names, pinned SDPA, peers from utils.course.bench.peers), the FLOP
counts and utils.course.bench.benchmark (given closures without arguments, that is torch's Timer after `--warmup` ms
of calls: back-to-back calls with the GPU synchronised around each block of them, no L2 flush). Every
implementation is timed the same way, through its autograd function, `--rounds` times per shape (each round
starting one further along the list), and the median kept, with the timings in the record (at N = 1k the
backward is bound by the host's Python, whose time per call drifts by tens of percent from one timing to the
next: rounds spread that drift over every implementation alike):

    fwd      fn(q, k, v, causal=...) on inputs that need no gradient
    bwd      torch.autograd.grad of one stored forward output: the backward alone, as the tutorial times it
    fwd_bwd  both

Each implementation's forward is also compared, once per shape, with an fp32 reference on the first (batch, head)
(`max_err`): a fast but wrong kernel is flagged and left out of the ratios instead of being ranked. This matters
for the release/3.6.x tutorial: its causal forward is wrong when its autotuner picks BLOCK_M < BLOCK_N (a config
it keeps on Hopper; Triton's main branch prunes it since triton-lang/triton#8853). The JSON is rewritten after
every shape and `--resume` skips the records it already has, so the sweep (with the tutorial's autotuning) can be
split over several commands of a machine that limits each one's time.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from utils import gpu
from utils.course.bench import attention_flops, backward, error_line, forward, peers, rotated, tflops

DTYPES = forward.DTYPES
# Far above rounding (fp16 2^-11, bf16 2^-8 of outputs below 1), far below a wrong mask or tile (errors ~0.1-1).
TOLERANCE = {"fp16": 1e-2, "bf16": 4e-2, "fp32": 1e-3}
MODES = ("fwd", "bwd", "fwd_bwd")
KEY = ("impl", "mode", "dtype", "head_dim", "causal", "seqlen")
ENVIRONMENT = ("gpu", "emulated", "torch", "triton", "cudnn")   # what a resumed run must share with the new one


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.peers_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", nargs="*", default=["triton"], help="registry names (utils.attention.REGISTRY)")
    p.add_argument("--sdpa", nargs="*", default=list(forward.SDPA_BACKENDS), choices=forward.SDPA_BACKENDS)
    peers.add_arguments(p, default=tuple(peers.PEERS))
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=MODES)
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    forward.add_grid_arguments(p)
    p.add_argument("--name", default="peers", help="output files <out-dir>/<name>.json and .png")
    p.add_argument("--out-dir", type=Path, default=forward.IMAGES)
    p.add_argument("--resume", action="store_true", help="keep the records of <name>.json and measure the rest")
    p.add_argument("--remeasure", nargs="+", default=[], choices=MODES,
                   help="with --resume: measure these modes again on this run's grid (dtypes, head dims, causal, "
                        "seqlens), every implementation (those records are dropped; the others are kept)")
    args = forward.check_grid_arguments(p, p.parse_args(argv))
    if args.remeasure and not args.resume:
        p.error("--remeasure goes with --resume")
    return args


def configurations(args) -> list[tuple]:
    """(dtype name, head_dim, causal, seqlen) in the order measured; the modes share each one's inputs."""
    return [(t, *shape) for t in args.dtypes for shape in forward.configurations(args)]


def settings(args) -> dict:
    return dict(batch=args.batch, heads=args.heads, warmup_ms=args.warmup, rep_ms=args.rep)


def prepare(fn, mode, q, k, v, do, causal):
    """The closure that one measurement times (see the module docstring)."""
    if mode == "fwd":
        return lambda: fn(q, k, v, causal=causal)
    if mode == "bwd":
        return backward.autograd_backward(fn)(q, k, v, do, causal)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(fn(q, k, v, causal=causal), (q, k, v), do)


def kernel_steps(impl: str, mode: str, head_dim: int) -> dict:
    """{pass: step} for the passes `mode` runs of a registry kernel built in named steps (06b's "cuda", 06c's
    "cuda_hopper"): the step each pass takes at `head_dim` when given none. Stored with each measured row, so that
    a later change of default cannot relabel a stored run; {} for the other implementations."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if impl == "cuda":
        from utils.native.backward import BWD_DEFAULT_STEP
        from utils.native.build import MMA_DEFAULT_STEP

        table = {"fwd": MMA_DEFAULT_STEP, "bwd": BWD_DEFAULT_STEP}
    elif impl == "cuda_hopper":
        from utils.native.hopper import default_step
        from utils.native.hopper_backward import bwd_default_step

        table = {"fwd": default_step(head_dim), "bwd": bwd_default_step(head_dim)}
    else:
        return {}
    return {p: table[p] for p in ("fwd", "bwd") if p in mode.split("_")}


def stale_steps(path: Path) -> list[str]:
    """The rows of a stored sweep whose recorded steps are no longer the defaults (`kernel_steps`), one line each:
    a default changed without a new measurement would credit one step with another's speed."""
    return [f"{Path(path).name}: {r['impl']} {r['mode']} {r['dtype']} D={r['head_dim']} N={r['seqlen']}"
            f"{' causal' if r['causal'] else ''} measured {r['steps']}"
            for r in json.loads(Path(path).read_text())["results"]
            if "steps" in r and r["steps"] != kernel_steps(r["impl"], r["mode"], r["head_dim"])]


def max_error(fn, q, k, v, causal) -> float:
    """Largest |fn's output - fp32 attention| on the first (batch, head): enough to catch a wrong mask or tile,
    small enough for N = 16k (its N×N scores take 1 GiB)."""
    from utils.eager.reference import naive_attention

    with torch.no_grad():
        out = fn(q, k, v, causal=causal)[:1, :1].float()
        ref = naive_attention(*(t[:1, :1].float() for t in (q, k, v)), causal=causal)
    return (out - ref).abs().max().item()


def run(args, fns: dict, *, time_ms=None, device="cuda", progress=True, done=(), checkpoint=None) -> list[dict]:
    """Measure every fn in every mode on every configuration, skipping the keys in `done`; returns the new
    records. `time_ms(closure)` gives milliseconds (default: utils.course.bench.benchmark); `checkpoint(records)` is
    called after each configuration with the records so far. A failure is recorded with its error, a shape a
    peer cannot run as "not supported: <why>", and a forward outside TOLERANCE keeps its time but accurate=False.
    """
    from tqdm.auto import tqdm

    from utils.course.bench import benchmark

    if time_ms is None:
        def time_ms(closure):
            return benchmark(closure, warmup=args.warmup, rep=args.rep)

    done = set(done)
    capability = torch.cuda.get_device_capability() if torch.device(device).type == "cuda" else None
    records = []
    configs = configurations(args)
    bar = tqdm(total=len(configs) * len(args.modes) * len(fns), desc="peers", disable=not progress)
    for dtype_name, d, causal, n in configs:
        todo = [(label, mode) for label in fns for mode in args.modes
                if (label, mode, dtype_name, d, causal, n) not in done]
        bar.update(len(fns) * len(args.modes) - len(todo))
        if not todo:
            continue
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, do = (torch.randn(args.batch, args.heads, n, d, generator=gen).to(device=device,
                                                                                   dtype=DTYPES[dtype_name])
                       for _ in range(4))
        errors = {}  # label -> max_err, or the message of the failure of its first run
        timed = {}   # (label, mode) -> (its record, its closure, its timings so far)
        shape = f"{dtype_name} D={d} N={n}{' causal' if causal else ''}"
        for label, mode in todo:
            fn = fns[label]
            bar.set_postfix_str(f"{label} {shape}")
            record = dict(impl=label, mode=mode, dtype=dtype_name, head_dim=d, causal=causal, seqlen=n, ms=None,
                          tflops=None, max_err=None, accurate=None, error=None)
            records.append(record)
            why = forward.unsupported(fn, d, DTYPES[dtype_name], causal, n, mode, capability)
            if why is not None:
                record["error"] = f"not supported: {why}"
                continue
            if label not in errors:
                try:
                    errors[label] = max_error(fn, q, k, v, causal)
                except Exception as err:  # noqa: BLE001 - "No available kernel", a tutorial assert: a result
                    errors[label] = error_line(err)
            if isinstance(errors[label], str):
                record["error"] = errors[label]
                continue
            try:
                timed[label, mode] = record, prepare(fn, mode, q, k, v, do, causal), []
            except Exception as err:  # noqa: BLE001 - out of memory, a backward that refuses the shape
                record["error"] = error_line(err)
        turns = list(timed.items())
        for turn in range(args.rounds if turns else 0):  # the implementations take turns
            for (label, mode), (record, closure, times) in rotated(turns, turn):
                if record["error"] is None:
                    bar.set_postfix_str(f"{label} {mode} {shape}, round {turn + 1} of {args.rounds}")
                    try:
                        times.append(time_ms(closure))
                    except Exception as err:  # noqa: BLE001 - out of memory, a backward that refuses the shape
                        record["error"] = error_line(err)
        for (label, mode), (record, _, times) in timed.items():
            if record["error"] is None:
                ms = statistics.median(times)
                flops = attention_flops(args.batch, args.heads, n, n, d, causal=causal, mode=mode)
                record.update(ms=ms, tflops=tflops(flops, ms), max_err=errors[label],
                              accurate=errors[label] <= TOLERANCE[dtype_name], rounds=times)
                steps = kernel_steps(label, mode, d)
                if steps:
                    record["steps"] = steps
        bar.update(len(todo))
        del q, k, v, do
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(records)
    bar.close()
    return records


def key(record: dict) -> tuple:
    return tuple(record[k] for k in KEY)


def provenance(fns: dict) -> dict:
    return {label: fn.provenance() for label, fn in fns.items() if hasattr(fn, "provenance")}


def write_json(records: list[dict], args, path: Path, fns: dict, earlier: list | None = None,
               command: str | None = None) -> Path:
    """environment (this command's), earlier (the environments of the runs it resumed), settings, the peers'
    provenance (file, SHA-256, git ref, Triton) and the results."""
    data = dict(environment=gpu.environment(command), earlier=earlier or [], settings=settings(args),
                peers=provenance(fns), results=records)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)  # atomic: a run stopped mid-write (a time limit) leaves the previous checkpoint whole
    return path


def resume_from(path: Path, args, fns: dict) -> tuple[list[dict], list[dict]]:
    """(records, earlier environments) of a previous run of the same sweep, less the records of the modes
    --remeasure names on this run's grid; ValueError if its settings, its machine (GPU, emulated profile, torch,
    Triton, cuDNN), its tutorial file or its flash-attn-4 version differ, since its numbers would not compare."""
    data = json.loads(Path(path).read_text())
    if data.get("settings") != settings(args):
        raise ValueError(f"{path} was measured with {data.get('settings')}, not {settings(args)}; "
                         f"drop --resume or give another --name")
    before, now = data.get("environment", {}), gpu.environment()
    for field in ENVIRONMENT:
        if before.get(field) != now[field]:
            raise ValueError(f"{path} was measured with {field} {before.get(field)!r}, this machine has "
                             f"{now[field]!r}; drop --resume or give another --name")
    for label, now in provenance(fns).items():
        before = data.get("peers", {}).get(label)
        if before is not None and before.get("sha256") != now.get("sha256"):
            raise ValueError(f"{path} measured {label} from another file ({before['path']}, sha256 "
                             f"{before['sha256'][:12]}); drop --resume or give another --name")
        if before is not None and before.get("versions") != now.get("versions"):
            raise ValueError(f"{path} measured {label} {before.get('versions')}, this machine has "
                             f"{now.get('versions')}; drop --resume or give another --name")
    grid = set(configurations(args))
    kept = [r for r in data["results"] if r["mode"] not in args.remeasure
            or (r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) not in grid]
    return kept, [*data.get("earlier", []), data["environment"]]


def format_tables(records: list[dict]) -> str:
    """One table per (mode, dtype), as utils.course.bench.forward.format_table prints them (first impl / the others);
    an inaccurate measurement shows as a missing one, and is listed below the tables."""
    blocks = []
    for mode, dtype in dict.fromkeys((r["mode"], r["dtype"]) for r in records):
        part = [dict(r, tflops=r["tflops"] if r["accurate"] is not False else None) for r in records
                if (r["mode"], r["dtype"]) == (mode, dtype)]
        blocks.append(f"{mode} {dtype} (TFLOP/s)\n{forward.format_table(part)}")
    flagged = [r for r in records if r["accurate"] is False]
    if flagged:
        blocks.append("inaccurate (left out of the tables, the ratios and the plot):\n" + "\n".join(
            f"  {r['impl']} {r['mode']} {r['dtype']} D={r['head_dim']} {'causal ' if r['causal'] else ''}"
            f"N={r['seqlen']}: max_err {r['max_err']:.3g} > {TOLERANCE[r['dtype']]}" for r in flagged))
    return "\n\n".join(blocks)


def versus(records: list[dict], impl="triton", others=tuple(peers.TUTORIAL_PEERS)) -> list[dict]:
    """Per shape where `impl` and at least one of `others` ran accurately: impl's TFLOP/s over the best of the
    others' (by default the tutorial with and without warp specialization; or (peers.FA4,)): the issues' bar is
    >= 1.0 everywhere. `impl`
    may be a tuple of names: per shape the fastest of them that ran accurately (the course's best kernel);
    each row names it."""
    group = (impl,) if isinstance(impl, str) else tuple(impl)
    good = {key(r): r["tflops"] for r in records if r["tflops"] and r["accurate"]}
    ours = {}  # shape -> (TFLOP/s, name) of the fastest of `group`
    for r in records:
        if r["impl"] in group and key(r) in good:
            ours[key(r)[1:]] = max(ours.get(key(r)[1:], (0.0, "")), (r["tflops"], r["impl"]))
    rows = []
    for shape, (value, name) in ours.items():
        best = max((good.get((o, *shape)) or 0.0, o) for o in others)
        if best[0]:
            rows.append(dict(zip(KEY[1:], shape), impl=name, tflops=value, peer=best[1], peer_tflops=best[0],
                             ratio=value / best[0]))
    return rows


def format_versus(rows: list[dict], impl="triton", peer="tutorial (best of its variants)") -> str:
    label = impl if isinstance(impl, str) else "best of " + ", ".join(impl)
    if not rows:
        return f"{label} vs {peer}: no shape where both ran accurately"
    worst = min(rows, key=lambda r: r["ratio"])
    below = [r for r in rows if r["ratio"] < 1.0]
    return (f"{label} / {peer}: min {worst['ratio']:.2f}x at {worst['mode']} "
            f"{worst['dtype']} D={worst['head_dim']}{' causal' if worst['causal'] else ''} N={worst['seqlen']}; "
            f"below 1.0 on {len(below)} of {len(rows)} shapes")


def plot(records: list[dict], path: Path, title: str = "") -> Path:
    """One figure: a row per (mode, dtype), a column per (head dim, causal), TFLOP/s against N, a line per
    implementation; inaccurate measurements are left out."""
    from utils.course.plotting import pyplot, seqlen_axis, write_png

    plt = pyplot()
    rows = list(dict.fromkeys((r["mode"], r["dtype"]) for r in records))
    cols = list(dict.fromkeys((r["head_dim"], r["causal"]) for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    if not rows:
        raise ValueError("no records to plot")
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.0 * len(cols), 3.0 * len(rows)), squeeze=False,
                             sharey="row")
    colors = dict(zip(impls, plt.get_cmap("tab10").colors))
    for i, (mode, dtype) in enumerate(rows):
        for j, (d, causal) in enumerate(cols):
            ax = axes[i][j]
            for name in impls:
                pts = sorted((r["seqlen"], r["tflops"]) for r in records if r["tflops"] and r["accurate"]
                             and (r["impl"], r["mode"], r["dtype"], r["head_dim"], r["causal"])
                             == (name, mode, dtype, d, causal))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors[name], label=name)
            seqlen_axis(ax, sorted({r["seqlen"] for r in records}))
            if i < len(rows) - 1:
                ax.set_xlabel("")  # the bottom row names the axis
            ax.set_title(f"{mode} {dtype}, D={d}{', causal' if causal else ''}", fontsize=9)
        axes[i][0].set_ylabel("TFLOP/s")
    handles = [plt.Line2D([], [], color=colors[name], marker="o", label=name) for name in impls]
    fig.legend(handles=handles, loc="lower center", ncol=len(impls), bbox_to_anchor=(0.5, -0.01))
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return write_png(fig, path)


def main(argv=None) -> list[dict]:
    import sys

    args = parse_args(argv)
    command = " ".join(["python -m utils.course.bench.peers_sweep", *(sys.argv[1:] if argv is None else argv)])
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.bench.peers_sweep needs a CUDA GPU")
    fns = forward.candidates(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    kept, earlier = resume_from(json_path, args, fns) if args.resume and json_path.exists() else ([], [])
    records = run(args, fns, done={key(r) for r in kept},
                  checkpoint=lambda new: write_json(kept + new, args, json_path, fns, earlier, command))
    records = kept + records
    write_json(records, args, json_path, fns, earlier, command)
    env = gpu.environment(command)
    png = plot(records, args.out_dir / f"{args.name}.png", title=f"{env.get('gpu', '')}, B={args.batch}, "
               f"H={args.heads}: forward and backward TFLOP/s")
    print(format_tables(records))
    course = [name for name in args.impls if any(r["impl"] == name for r in records)]
    for impl in course + ([tuple(course)] if len(course) > 1 else []):
        print(format_versus(versus(records, impl), impl))
        if any(r["impl"] == peers.FA4 for r in records):
            print(format_versus(versus(records, impl, (peers.FA4,)), impl, peers.FA4))
    print(f"wrote {json_path} and {png}")
    return records


if __name__ == "__main__":
    main()
