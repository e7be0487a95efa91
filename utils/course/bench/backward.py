"""Backward-pass benchmark (notebooks 07, 07w and 06bw): the course's Triton and CUDA backwards against SDPA's
backends.

FLOPs are counted as 2.5× the forward's (`utils.course.bench.attention_flops(mode="bwd")`: five N×N matmuls instead of
two), halved when causal, as in the FlashAttention-2 paper. Every number of a table is measured in one run.
Besides the default backends, `--backends` takes sdpa_efficient, triton_pointer, triton_tma and triton_tma_stats (the
Triton backward with its loads pinned, worklog 07w sections 2 and 3), triton_atomic_dq and triton_reduce_dq (dQ
added by the dK/dV pass instead of a dQ pass, with an atomic add per element or a TMA bulk reduce-add per tile,
section 4; these five run the worklog's copy of the kernels, utils.course.worklogs.triton_backward),
gluon_bwd (the one-kernel warp-specialised Gluon backward of section 5, sm_90 only; gluon_bwd_by_head
and gluon_bwd_group2, gluon_bwd_grouped, gluon_bwd_group8, gluon_bwd_group16: its programs launched head by
head, or in groups of 2, 4, 8 or 16 heads, on every shape;
gluon_bwd_dq_writer: its dQ reduce-adds issued by a warp of their own; gluon_bwd_ds_first and
gluon_bwd_dv_first: dSᵀ formed before dV's product is issued, or after, on every shape; gluon_bwd_scaled_p
and gluon_bwd_plain_p: P computed as scale·P or as P, on every shape; gluon_bwd_fragments and
gluon_bwd_row_boxes: dQ staged in register order or by rows, on every shape; gluon_bwd_mask_loop and
gluon_bwd_one_loop: the masked tiles in a loop of their own or tested in the one loop; gluon_bwd_dq_first,
gluon_bwd_dk_first and gluon_bwd_dq_ds_first: dK's product issued after dQ's or before, and after dQ's with
dSᵀ formed before dV's product; gluon_bwd_free_early and gluon_bwd_free_late: the ring slot freed before dQ's
reduce-adds are issued or after, on every shape; gluon_bwd_one_dq_buffer and gluon_bwd_two_dq_buffers: dQ
staged in one buffer per consumer or two, on every shape), cuda_hopper
(notebook 06c's backward on wgmma and TMA, the Gluon backward's schedule in CUDA, sm_90 only; cuda_hopper_<step>
pins one of its steps), and
`--peers triton-tutorial` the Triton tutorial's backward (utils.course.bench.peers, read from its own
file; shapes it cannot run are "not supported"). `--rounds 3` times each shape three times in rotated order and
keeps the medians (the stored run's setting). Each backend is timed as a closure without arguments, so
utils.course.bench.benchmark takes torch's Timer after 25 ms of calls: back-to-back calls with the GPU synchronised
around each block of them, no L2 flush; the same for every backend.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from utils.course.bench import attention_flops, benchmark, error_line, median_rows, peers, rotated, shape_table
from utils.native.backward import BWD_STEPS, flash_mma_backward, flash_mma_forward
from utils.native.hopper_backward import BWD_STEPS as HOPPER_BWD_STEPS

BACKENDS = ("triton", "sdpa_flash", "sdpa_cudnn")                # the default set (notebook 07's)
# The worklog's Triton backward (utils.course.worklogs.triton_backward) with its loads pinned, (tma, tma_stats):
# "triton" picks per shape (utils.tiled.fast.backward.use_tma).
TRITON_LOADS = {"triton_pointer": (False, False), "triton_tma": (True, False), "triton_tma_stats": (True, True)}
# Measured when asked for; cuda_*: notebook 06bw's tensor-core backward in each of its steps (utils.native.backward).
CUDA_BACKENDS = tuple(f"cuda_{step}" for step in BWD_STEPS)
# ... and cuda_hopper_*: notebook 06c's backward in each of its steps ("cuda_hopper": its default step).
HOPPER_BACKENDS = tuple(f"cuda_hopper_{step}" for step in HOPPER_BWD_STEPS)
# The Gluon backward with fields of its Config (utils.explicit.backward) pinned on every shape, where "gluon_bwd"
# takes pick_config's: the launch order (bh_group: head by head or groups of 2 to 16 heads), a warp of its own
# issuing dQ's reduce-adds (dq_writer), dSᵀ formed before dV's product or after it (ds_first), P computed as
# scale·P or as P (scaled_p), dQ staged in register order or by rows (dq_fragments), the masked tiles in a loop
# of their own or not (mask_loop), dK's product issued after dQ's or before (dq_first; with ds_first too), the
# ring slot freed before dQ's reduce-adds or after (free_early; off beside dq_writer and dq_first, which free
# it themselves), dQ staged in one buffer per consumer or two (dq_buffers; one beside dq_writer).
GLUON_PINNED = {"gluon_bwd_by_head": dict(bh_group=0), "gluon_bwd_grouped": dict(bh_group=4),
                "gluon_bwd_group2": dict(bh_group=2), "gluon_bwd_group8": dict(bh_group=8),
                "gluon_bwd_group16": dict(bh_group=16),
                "gluon_bwd_dq_writer": dict(dq_writer=True, free_early=False, dq_buffers=1),
                "gluon_bwd_ds_first": dict(ds_first=True), "gluon_bwd_dv_first": dict(ds_first=False),
                "gluon_bwd_scaled_p": dict(scaled_p=True), "gluon_bwd_plain_p": dict(scaled_p=False),
                "gluon_bwd_fragments": dict(dq_fragments=True), "gluon_bwd_row_boxes": dict(dq_fragments=False),
                "gluon_bwd_mask_loop": dict(mask_loop=True), "gluon_bwd_one_loop": dict(mask_loop=False),
                "gluon_bwd_dk_first": dict(dq_first=False, free_early=False),
                "gluon_bwd_dq_first": dict(dq_first=True, free_early=False),
                "gluon_bwd_dq_ds_first": dict(dq_first=True, ds_first=True, free_early=False),
                "gluon_bwd_free_early": dict(free_early=True), "gluon_bwd_free_late": dict(free_early=False),
                "gluon_bwd_one_dq_buffer": dict(dq_buffers=1), "gluon_bwd_two_dq_buffers": dict(dq_buffers=2)}
KNOWN = (BACKENDS + tuple(TRITON_LOADS) + ("triton_atomic_dq", "triton_reduce_dq", "gluon_bwd", *GLUON_PINNED,
                                          "sdpa_efficient", "triton_tutorial")
         + CUDA_BACKENDS
         + ("cuda_hopper",) + HOPPER_BACKENDS)
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "07_backward_benchmark.json"


def autograd_backward(attention):
    """A function (q, k, v, do, causal) -> timing closure for the backward that `attention`'s forward recorded in
    autograd (SDPA with a backend pinned: that backend's backward kernel; a peer's kernel): one forward is kept
    and its gradients are taken again at each call."""
    def prepare(q, k, v, do, causal):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, causal=causal)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return prepare


def _sdpa_backward(backend_name):
    """SDPA with `backend_name` ("sdpa_flash", ...) pinned: utils.course.bench.forward.sdpa_pinned, timed backward."""
    from utils.course.bench.forward import sdpa_pinned

    return autograd_backward(sdpa_pinned(backend_name.removeprefix("sdpa_")))


def _triton_backward(config=None, **switches):
    """The fast Triton backward (utils.tiled.fast.backward) after its forward; with `switches` (tma, tma_stats,
    dq_atomic) the worklog's copy (utils.course.worklogs.triton_backward) with them set."""
    def prepare(q, k, v, do, causal):
        from utils.tiled.fast.forward import flash_attention_forward

        if switches:
            from utils.course.worklogs.triton_backward import flash_attention_backward
        else:
            from utils.tiled.fast.backward import flash_attention_backward

        o, lse = flash_attention_forward(q, k, v, causal=causal)
        return lambda: flash_attention_backward(do, q, k, v, o, lse, causal=causal, config=config, **switches)
    return prepare


def _gluon_backward(**changes):
    """Worklog 07w section 5's one-kernel Gluon backward, after the Triton forward's (o, lse); `changes`: fields of
    pick_config's Config replaced (none: pick_config's own)."""
    def prepare(q, k, v, do, causal):
        from utils.explicit.backward import flash_attention_backward as flash_attention_gluon_backward, pick_config
        from utils.tiled.fast.forward import flash_attention_forward

        o, lse = flash_attention_forward(q, k, v, causal=causal)
        config = pick_config(q.shape[-1], causal, k.shape[2])._replace(**changes) if changes else None
        return lambda: flash_attention_gluon_backward(do, q, k, v, o, lse, causal=causal, config=config)
    return prepare


def _cuda_backward(step):
    def prepare(q, k, v, do, causal):
        o, lse = flash_mma_forward(q, k, v, causal=causal)
        return lambda: flash_mma_backward(do, q, k, v, o, lse, causal=causal, step=step)
    return prepare


def _hopper_backward(q, k, v, do, causal, step=None):
    """Notebook 06c's backward on wgmma and TMA (utils.native.hopper.flash_hopper_backward) in `step` (None:
    the head dim's default), after its forward's (o, lse)."""
    from utils.native.hopper import flash_hopper_forward
    from utils.native.hopper_backward import flash_hopper_backward

    o, lse = flash_hopper_forward(q, k, v, causal=causal)
    return lambda: flash_hopper_backward(do, q, k, v, o, lse, causal=causal, step=step)


def run_backward_benchmark(seqlens=(2048, 4096, 8192, 16384), head_dims=(64, 128), causal=(False, True), *,
                           batch=4, heads=16, dtype=torch.bfloat16, backends=BACKENDS, config=None,
                           tutorial=None, rounds=1) -> list[dict]:
    """Time the backward of each backend on each shape; returns rows {backend, seqlen, head_dim, causal, ms,
    tflops, error}. A backend that cannot run a shape gets ms=None and the error's message ("not supported: ..."
    where the tutorial says so beforehand). `tutorial`: the peer (utils.course.bench.peers.TutorialPeer) that backend
    "triton_tutorial" runs. `rounds` > 1: each shape is timed that many times, round r starting at the r-th
    backend, and a row keeps the median (so no backend is always the one timed first, on a cold GPU). Needs a
    CUDA GPU."""
    unknown = [b for b in backends if b not in KNOWN]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {', '.join(KNOWN)}")
    if ("triton_tutorial" in backends) != (tutorial is not None):
        raise ValueError("backend 'triton_tutorial' and tutorial= (a utils.course.bench.peers.TutorialPeer) go together")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("run_backward_benchmark needs a CUDA GPU")
    capability = torch.cuda.get_device_capability()
    special = {"triton": lambda: _triton_backward(config), "triton_tutorial": lambda: autograd_backward(tutorial),
               "triton_atomic_dq": lambda: _triton_backward(config, dq_atomic=True),
               "triton_reduce_dq": lambda: _triton_backward(config, dq_atomic="tma"),
               "gluon_bwd": _gluon_backward,
               **{b: (lambda fields=fields: _gluon_backward(**fields)) for b, fields in GLUON_PINNED.items()},
               **{b: (lambda loads=loads: _triton_backward(config, tma=loads[0], tma_stats=loads[1]))
                  for b, loads in TRITON_LOADS.items()},
               **{b: (lambda step=b.removeprefix("cuda_"): _cuda_backward(step)) for b in CUDA_BACKENDS},
               "cuda_hopper": lambda: _hopper_backward,
               **{b: (lambda step=b.removeprefix("cuda_hopper_"): functools.partial(_hopper_backward, step=step))
                  for b in HOPPER_BACKENDS}}
    makers = {b: special[b]() if b in special else _sdpa_backward(b) for b in backends}
    names = list(makers)
    rows = []
    for d in head_dims:
        for n in seqlens:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=gen)
                           for _ in range(4))
            for c in causal:
                flops = attention_flops(batch, heads, n, n, d, causal=c, mode="bwd")
                shape = {b: dict(backend=b, seqlen=n, head_dim=d, causal=c, ms=None, tflops=None, error=None)
                         for b in names}
                times, kept = {b: [] for b in names}, {}   # kept: closures prepared in round 0, for the rest
                for r in range(rounds):
                    for name in rotated(names, r):
                        row = shape[name]
                        why = None if name != "triton_tutorial" else tutorial.unsupported(
                            d, dtype, c, seqlen=n, mode="bwd", capability=capability)
                        if why is not None:
                            row["error"] = f"not supported: {why}"
                        if row["error"] is not None:
                            continue
                        try:
                            fn = kept.pop(name, None) or makers[name](q, k, v, do, c)
                            times[name].append(benchmark(fn))
                            if r + 1 < rounds:
                                kept[name] = fn
                        except Exception as err:  # noqa: BLE001 - a backend missing on this GPU is a result too
                            row["error"] = error_line(err)
                rows += median_rows(shape, times, flops)
            del q, k, v, do
            torch.cuda.empty_cache()
    return rows


def ratios(rows: list[dict], numerator="triton", denominator="sdpa_flash") -> dict:
    """{(seqlen, head_dim, causal): tflops[numerator] / tflops[denominator]} where both were measured."""
    for name in (numerator, denominator):
        if name not in KNOWN:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(KNOWN)}")
    table = {(r["seqlen"], r["head_dim"], r["causal"], r["backend"]): r["tflops"] for r in rows}
    out = {}
    for (n, d, c, b), value in table.items():
        other = table.get((n, d, c, denominator))
        if b == numerator and value and other:
            out[(n, d, c)] = value / other
    return out


def format_ratios(rows: list[dict], pairs, *, tflops: str | None = None) -> str:
    """One run's rows as text, a line per (head dim, mask, N) at which every backend of `pairs` was measured:
    the TFLOP/s of backend `tflops` if one is named, then a / b for each (a, b) of `pairs` (ratios())."""
    pairs = list(pairs)
    if not pairs or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise TypeError(f"pairs must be (numerator, denominator) pairs of backends, got {pairs!r}")
    if tflops is not None and tflops not in KNOWN:
        raise ValueError(f"unknown backend {tflops!r}; known: {', '.join(KNOWN)}")
    each = [ratios(rows, a, b) for a, b in pairs]   # validates the names
    shapes = sorted(set.intersection(*(set(r) for r in each)), key=lambda s: (s[1], s[2], s[0]))
    if not shapes:
        raise ValueError(f"no shape of the rows has every backend of {pairs}")
    value = {(r["seqlen"], r["head_dim"], r["causal"]): r["tflops"] for r in rows if r["backend"] == tflops}
    short = lambda b: b.removeprefix("cuda_hopper_").removeprefix("sdpa_").removesuffix("_bwd")
    heads = ([f"{short(tflops)} TFLOP/s"] if tflops else []) + [f"{short(a)} / {short(b)}" for a, b in pairs]
    return shape_table(heads, [((d, c, n), ([f"{value[n, d, c]:.0f}"] if tflops else [])
                                + [f"{r[n, d, c]:.2f}" for r in each]) for n, d, c in shapes])


def format_table(rows: list[dict], course: str = "triton") -> str:
    """A plain-text table: one line per shape, TFLOP/s per backend, and the `course` / sdpa_flash, sdpa_cudnn and
    triton_tutorial ratios of those that were measured."""
    backends = [b for b in KNOWN if any(r["backend"] == b for r in rows)]
    width = {b: max(11, len(b)) for b in backends}
    columns = [(f"{course}/{b.removeprefix('sdpa_').removeprefix('triton_')}", b)
               for b in ("sdpa_flash", "sdpa_cudnn", "triton_tutorial") if b in backends]
    ratio = {title: ratios(rows, course, b) if {course, b} <= set(backends) else {} for title, b in columns}
    lines = [f"{'N':>6} {'D':>4} {'causal':>6} " + " ".join(f"{b:>{width[b]}}" for b in backends)
             + "".join(f"  {title:>12}" for title, _ in columns)]
    shapes = sorted({(r["seqlen"], r["head_dim"], r["causal"]) for r in rows}, key=lambda s: (s[1], s[2], s[0]))
    for n, d, c in shapes:
        cells = []
        for b in backends:
            t = next((r["tflops"] for r in rows if (r["seqlen"], r["head_dim"], r["causal"], r["backend"]) ==
                      (n, d, c, b)), None)
            cells.append(f"{t:{width[b]}.1f}" if t else f"{'-':>{width[b]}}")
        rs = [(ratio[title].get((n, d, c)), max(12, len(title))) for title, _ in columns]
        line = f"{n:>6} {d:>4} {str(c):>6} " + " ".join(cells) + "".join(
            f"  {r:{w - 1}.2f}x" if r else " " * (w + 2) for r, w in rs)
        lines.append(line.rstrip())
    return "\n".join(lines)


def triton_tiles(head_dims, dtype, smem: int | None = None) -> dict:
    """{"d64_full": {block_m1: ..., ...}, ...}: the tiles `pick_config` gives the Triton backward on a GPU with
    `smem` bytes of shared memory per block (None: an H200), stored with a run so that the JSON says what it
    measured."""
    import dataclasses

    from utils.tiled.fast.backward import _fitted_config

    return {f"d{d}_{'causal' if c else 'full'}": dataclasses.asdict(_fitted_config(d, dtype, c, smem))
            for d in head_dims for c in (False, True)}


def triton_loads(head_dims) -> dict:
    """{"d64_full": False, ...}: whether backend "triton" loads its tiles (and lse₂ and D) through TMA on an sm_90
    GPU with aligned 16-bit inputs (utils.tiled.fast.backward.use_tma), stored with a run beside its tiles."""
    from utils.tiled.fast.backward import use_tma

    return {f"d{d}_{'causal' if c else 'full'}": use_tma(d, c) for d in head_dims for c in (False, True)}


def save_results(rows: list[dict], path, environment: dict | None = None, **meta) -> Path:
    """Write {"environment": ..., "meta": meta, "rows": rows} as JSON (environment: utils.gpu.environment)."""
    path = Path(path)
    path.write_text(json.dumps({"environment": environment, "meta": meta, "rows": rows}, indent=1))
    return path


def load_results(path) -> tuple[dict, list[dict]]:
    data = json.loads(Path(path).read_text())
    return data["meta"], data["rows"]


# a colour per backend the plot can meet (tests hold that KNOWN is covered)
COLORS = {"triton": "C0", "sdpa_flash": "C1", "sdpa_cudnn": "C2", "sdpa_efficient": "C3", "triton_tutorial": "C4",
          "gluon_bwd": "m", "gluon_bwd_by_head": "tab:pink", "gluon_bwd_grouped": "tab:olive",
          "gluon_bwd_group2": "lightcoral", "gluon_bwd_group8": "darkkhaki", "gluon_bwd_group16": "darkgoldenrod",
          "gluon_bwd_dq_writer": "tab:purple", "gluon_bwd_ds_first": "teal", "gluon_bwd_dv_first": "salmon",
          "gluon_bwd_scaled_p": "darkcyan", "gluon_bwd_plain_p": "peru", "gluon_bwd_fragments": "olive",
          "gluon_bwd_row_boxes": "rosybrown", "gluon_bwd_mask_loop": "slateblue", "gluon_bwd_one_loop": "khaki",
          "gluon_bwd_dq_first": "forestgreen", "gluon_bwd_dk_first": "sandybrown", "gluon_bwd_dq_ds_first": "indigo",
          "gluon_bwd_free_early": "deepskyblue", "gluon_bwd_free_late": "tan",
          "gluon_bwd_one_dq_buffer": "gray", "gluon_bwd_two_dq_buffers": "darkviolet",
          "triton_pointer": "C5", "triton_tma": "C6", "triton_tma_stats": "C8",
          "triton_atomic_dq": "C7", "triton_reduce_dq": "k", "cuda_hopper": "tab:brown",
          "cuda_hopper_atomic_dq": "tab:gray", "cuda_hopper_reduce_dq": "tab:cyan", "cuda_hopper_prefetch_s": "navy",
          "cuda_hopper_bh_group": "darkgreen", "cuda_hopper_stsm_ds": "chocolate",
          "cuda_hopper_stsm_uniform": "goldenrod", "cuda_hopper_dq_first": "crimson",
          "cuda_hopper_desc_add": "teal", "cuda_hopper_edge_mask": "olive",
          "cuda_hopper_dv_late": "slateblue", "cuda_hopper_late_prefetch": "darkorange",
          "cuda_hopper_late_group": "maroon", "cuda_hopper_rows80": "deeppink",
          "cuda_hopper_rows80_group": "mediumseagreen", "cuda_hopper_late_dq_first": "crimson",
          "cuda_hopper_frag_dq": "dodgerblue", "cuda_hopper_early_lse": "darkmagenta",
          "cuda_hopper_dq_writer": "black", "cuda_hopper_stagger": "darkcyan",
          "cuda_hopper_rows64": "peru", "cuda_hopper_frag_dq_first": "teal",
          **{b: f"C{9 + i}" for i, b in enumerate(CUDA_BACKENDS)}}


def plot_backward_benchmark(rows: list[dict], title: str = ""):
    """One panel per head dim: backward TFLOP/s against sequence length, a line per backend and masking."""
    import matplotlib.pyplot as plt

    from utils.course.plotting import use_course_style

    use_course_style()
    head_dims = sorted({r["head_dim"] for r in rows})
    if not head_dims:
        raise ValueError("no rows to plot")
    fig, axes = plt.subplots(1, len(head_dims), figsize=(6 * len(head_dims), 4), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], head_dims):
        for b in KNOWN:
            for c, style in ((False, "-"), (True, "--")):
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if r["backend"] == b and r["head_dim"] == d and r["causal"] == c and r["tflops"])
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=COLORS[b],
                            label=f"{b} {'causal' if c else 'full'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_title(f"head dim {d}")
    axes[0][0].set_ylabel("backward TFLOP/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m utils.course.bench.backward",
                                     description="Backward-pass benchmark: the course's kernels against SDPA's backends")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--backends", nargs="+", choices=[b for b in KNOWN if b != "triton_tutorial"],
                        default=list(BACKENDS), help="the tutorial is added by --peers")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--masks", nargs="+", choices=["full", "causal"], default=["full", "causal"],
                        help="without the causal mask, with it, or both")
    parser.add_argument("--rounds", type=int, default=1, help="time each shape this often, in rotated order")
    peers.add_arguments(parser, choices=("triton-tutorial",))  # warp specialization only changes its forward
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    """`python -m utils.course.bench.backward [--out images/07_backward_benchmark.json]`: the full grid, its JSON and plot."""
    import sys

    from utils import gpu

    args = parse_args(argv)
    tutorial = peers.from_args(args).get("triton-tutorial")
    backends = [*args.backends, *(["triton_tutorial"] if tutorial else [])]
    causal = tuple(m == "causal" for m in dict.fromkeys(args.masks))
    rows = run_backward_benchmark(tuple(args.seqlens), tuple(args.head_dims), causal, dtype=DTYPES[args.dtype],
                                  backends=backends, tutorial=tutorial, rounds=args.rounds)
    command = "python -m utils.course.bench.backward " + " ".join(sys.argv[1:] if argv is None else argv)
    env = gpu.environment(command)
    extra = dict(peers={"triton_tutorial": tutorial.provenance()}) if tutorial else {}
    if "triton" in backends:
        extra["configs"] = triton_tiles(args.head_dims, DTYPES[args.dtype],
                                        gpu.shared_memory_per_block(torch.device("cuda")))
        extra["tma"] = triton_loads(args.head_dims)
    if any(b.startswith("gluon_bwd") for b in backends):   # gluon_bwd's picked tiles and launch order
        from utils.explicit.backward import pick_config

        extra["gluon_configs"] = {f"d{d}_{'causal' if c else 'full'}_n{n}": pick_config(d, c, n)._asdict()
                                  for d in args.head_dims for c in causal for n in args.seqlens}
    save_results(rows, args.out, environment=env, gpu=env["gpu"], torch=env["torch"], triton=env["triton"],
                 batch=4, heads=16, dtype=str(DTYPES[args.dtype]).removeprefix("torch."), rounds=args.rounds, **extra)
    plot_backward_benchmark(rows, f"{env['gpu']}, {args.dtype}, B=4, H=16").savefig(args.out.with_suffix(".png"),
                                                                                    bbox_inches="tight")
    print(format_table(rows, course=next((b for b in backends if not b.startswith("sdpa")), "triton")))
    return rows


if __name__ == "__main__":
    main()
