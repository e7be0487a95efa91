"""The CUDA worklogs, every step beside SDPA's flash and cuDNN backends: notebook 06b's tensor-core kernel
(`--worklog mma`, the default) and notebooks 06c/06cw's Hopper kernel (`--worklog hopper`, sm_90 GPUs only).

    python -m utils.course.bench.cuda_mma --name 06b_cuda_mma_h200        # all steps, the full grid of utils.course.bench.forward
    python -m utils.course.bench.cuda_mma --steps exp2 causal_skip --seqlens 4096 --head-dims 128 --name quick
    python -m utils.course.bench.cuda_mma --worklog hopper --name 06c_hopper_h200

Everything else is utils.course.bench.forward's: the same flags, one run timing every step and SDPA backend side by side
(do_bench, medians), the JSON (images/<name>.json) and the plot (images/<name>.png, one line per step).
`worklog_table` turns the records into the notebook's table: each step's TFLOP/s, its speed-up over the step
before and over step 1, and its ratio to SDPA's FlashAttention-2 (flash) and cuDNN backends.
"""
from __future__ import annotations

import argparse
import re
from functools import partial

from utils import gpu
from utils.course.bench import shape_table
from utils.native import hopper
from utils.native.build import MMA_STEPS
from utils.native.kernels import flash_mma

# worklog -> (its steps in order, the kernel taking step=, the label prefix)
WORKLOGS = {"mma": (MMA_STEPS, flash_mma, "s"), "hopper": (hopper.ATTENTION_STEPS, hopper.flash_hopper, "h")}


def _worklog(name: str) -> tuple:
    if name not in WORKLOGS:
        raise ValueError(f"worklog must be one of {tuple(WORKLOGS)}, got {name!r}")
    return WORKLOGS[name]


def step_label(step: str, worklog: str = "mma") -> str:
    """'exp2' -> 's6_exp2', 'overlap' -> 'h6_overlap' (worklog "hopper"): the number keeps labels in order."""
    steps, _, prefix = _worklog(worklog)
    if step not in steps:
        raise ValueError(f"step must be one of {steps}, got {step!r}")
    return f"{prefix}{steps.index(step) + 1}_{step}"


def step_functions(steps=None, worklog: str = "mma") -> dict:
    """{label: fn(q, k, v, *, causal, sm_scale)} for each step (default: all), in worklog order."""
    every, fn, _ = _worklog(worklog)
    labels = {step: step_label(step, worklog) for step in (every if steps is None else steps)}  # validates
    return {labels[s]: partial(fn, step=s) for s in every if s in labels}


def check_steps(parser: argparse.ArgumentParser, worklog: str, steps) -> list[str]:
    """`steps` (default: every step of `worklog`), or the parser's error naming the first that is not one."""
    every = _worklog(worklog)[0]
    for step in steps or ():
        if step not in every:
            parser.error(f"--steps: {step!r} is not a step of the {worklog} worklog {every}")
    return list(steps or every)


def _step_number(label: str) -> int | None:
    """'s6_exp2' -> 6, 'h2_pipelined' -> 2, 'sdpa-flash' -> None."""
    match = re.fullmatch(r"[sh](\d+)_\w+", label)
    return int(match[1]) if match else None


def worklog_table(records: list[dict], *, head_dim: int, causal: bool, seqlen: int,
                  baselines=("sdpa-flash", "sdpa-cudnn")) -> list[dict]:
    """One row per step measured at (head_dim, causal, seqlen): TFLOP/s, speed-up over the previous step and over
    the first, and the ratio to each baseline (None where a number is missing)."""
    at = {r["impl"]: r["tflops"] for r in records
          if (r["head_dim"], r["causal"], r["seqlen"]) == (head_dim, causal, seqlen)}
    if not at:
        raise ValueError(f"no records at head_dim={head_dim}, causal={causal}, seqlen={seqlen}")
    labels = sorted((label for label in at if _step_number(label)), key=_step_number)
    rows, first, previous = [], None, None
    for label in labels:
        value = at[label]
        first = first if first is not None else value
        row = dict(step=label, tflops=value,
                   vs_previous=value / previous if value and previous else None,
                   vs_first=value / first if value and first else None)
        for base in baselines:
            row[f"vs {base}"] = value / at[base] if value and at.get(base) else None
        rows.append(row)
        previous = value
    return rows


def ratio_range(records: list[dict], impl: str, base: str, *, head_dim: int) -> tuple[float, float]:
    """(least, greatest) over every stored shape of `impl` at `head_dim` (causal and not, each N) of its TFLOP/s
    divided by `base`'s at the same shape: how a step compares with another, or with a library, in one run."""
    at = {(r["impl"], r["causal"], r["seqlen"]): r["tflops"] for r in records if r["head_dim"] == head_dim}
    ratios = [value / at[base, causal, n] for (name, causal, n), value in at.items()
              if name == impl and value and at.get((base, causal, n))]
    if not ratios:
        raise ValueError(f"no shape at head_dim={head_dim} has numbers for both {impl!r} and {base!r}")
    return min(ratios), max(ratios)


def format_pairs(records: list[dict], pairs: dict, *, worklog: str = "hopper", name: str = "new",
                 before: str = "before", base: str = "sdpa-cudnn") -> str:
    """One run's records as text, a line per (head dim, mask, N) at which both steps of `pairs[head dim]` =
    (new, old) were timed: new / old, the new step's TFLOP/s and new / `base` (a library in the same run)."""
    if not isinstance(pairs, dict) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs.values()):
        raise TypeError(f"pairs must be a dict of head dim -> (new step, old step), got {pairs!r}")
    labels = {d: tuple(step_label(s, worklog) for s in pair) for d, pair in pairs.items()}  # validates the steps
    at = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in records if r["tflops"]}
    shapes = sorted((d, c, n) for (i, d, c, n) in at if d in labels and i == labels[d][0]
                    and (labels[d][1], d, c, n) in at and (base, d, c, n) in at)
    if not shapes:
        raise ValueError(f"no shape of the records has both steps of {pairs} and {base!r}")
    lines = []
    for d, c, n in shapes:
        new, old = (at[label, d, c, n] for label in labels[d])
        lines.append(((d, c, n), [f"{new / old:.2f}", f"{new:.0f}", f"{new / at[base, d, c, n]:.2f}"]))
    return shape_table([f"{name} / {before}", f"{name} TFLOP/s", f"{name} / {base.removeprefix('sdpa-')}"], lines)


def format_worklog(rows: list[dict]) -> str:
    """worklog_table's rows as text."""
    if not rows:
        return "(no steps)"
    bases = [key for key in rows[0] if key.startswith("vs sdpa")]
    width = max(16, *(len(row["step"]) + 1 for row in rows))  # the step column fits the longest label
    lines = [f"{'step':<{width}s}{'TFLOP/s':>9s}{'vs prev':>9s}{'vs first':>9s}" + "".join(f"{b:>15s}" for b in bases)]
    for row in rows:
        cells = [f"{row[key]:.2f}x" if row[key] else "—" for key in ("vs_previous", "vs_first", *bases)]
        tflops = f"{row['tflops']:9.1f}" if row["tflops"] else f"{'—':>9s}"
        lines.append(f"{row['step']:<{width}s}{tflops}{cells[0]:>9s}{cells[1]:>9s}"
                     + "".join(f"{c:>15s}" for c in cells[2:]))
    return "\n".join(lines)


def parse_args(argv=None):
    """--worklog and --steps (default: all of it), then utils.course.bench.forward's flags (defaults: SDPA flash and
    cuDNN, no registry impls)."""
    from utils.course.bench import forward as benchmark

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--worklog", choices=list(WORKLOGS), default="mma")
    own.add_argument("--steps", nargs="+")
    ours, rest = own.parse_known_args(argv)
    steps = check_steps(own, ours.worklog, ours.steps)
    name = "06b_cuda_mma" if ours.worklog == "mma" else "06c_hopper"
    args = benchmark.parse_args(["--impls", "--sdpa", "flash", "cudnn", "--name", name] + list(rest))
    # forward's own --worklog (notebook 05b's Triton steps) stays off: only this worklog's steps and SDPA.
    args.cuda_worklog, args.steps = ours.worklog, steps
    return args


def main(argv=None) -> list[dict]:
    import torch

    from utils.course.bench import forward as benchmark

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.bench.cuda_mma needs a CUDA GPU")
    fns = {**step_functions(args.steps, args.cuda_worklog), **benchmark.candidates(args)}
    records = benchmark.run(args, fns)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = gpu.environment()
    json_path = benchmark.write_json(records, args, args.out_dir / f"{args.name}.json")
    png_path = benchmark.plot(records, args.out_dir / f"{args.name}.png",
                              title=f"{args.cuda_worklog} steps, {env.get('gpu', '')}, {args.dtype}, B={args.batch}, "
                                    f"H={args.heads}")
    print(benchmark.format_table(records))
    for d, causal, n in benchmark.configurations(args):
        print(f"\nD={d} {'causal' if causal else 'not causal'} N={n}")
        print(format_worklog(worklog_table(records, head_dim=d, causal=causal, seqlen=n)))
    print(f"wrote {json_path} and {png_path}")
    return records


if __name__ == "__main__":
    main()
