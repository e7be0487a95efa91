"""Notebook 06b's worklog: every step of the tensor-core kernel beside SDPA's flash and cuDNN backends.

    python -m utils.bench.cuda_mma --name 06b_cuda_mma_h200        # all steps, the full grid of utils.bench.forward
    python -m utils.bench.cuda_mma --steps exp2 causal_skip --seqlens 4096 --head-dims 128 --name quick

Everything else is utils.bench.forward's: the same flags, one run timing every step and SDPA backend side by side
(do_bench, medians), the JSON (images/<name>.json) and the plot (images/<name>.png, one line per step).
`worklog_table` turns the records into the notebook's table: each step's TFLOP/s, its speed-up over the step
before and over step 1, and its ratio to SDPA's FlashAttention-2 (flash) and cuDNN backends.
"""
from __future__ import annotations

import argparse
from functools import partial

from utils import gpu
from utils.cuda_ext import MMA_STEPS, flash_mma, mma_kernel_name


def step_label(step: str) -> str:
    """'exp2' -> 's6_exp2': the step's number keeps the labels in worklog order."""
    return mma_kernel_name(step).removeprefix("flash_mma_")


def step_functions(steps=MMA_STEPS) -> dict:
    """{label: fn(q, k, v, *, causal, sm_scale)} for each step, in worklog order."""
    steps = list(steps)
    for step in steps:
        mma_kernel_name(step)  # validates
    return {step_label(s): partial(flash_mma, step=s) for s in MMA_STEPS if s in steps}


def worklog_table(records: list[dict], *, head_dim: int, causal: bool, seqlen: int,
                  baselines=("sdpa-flash", "sdpa-cudnn")) -> list[dict]:
    """One row per step measured at (head_dim, causal, seqlen): TFLOP/s, speed-up over the previous step and over
    the first, and the ratio to each baseline (None where a number is missing)."""
    at = {r["impl"]: r["tflops"] for r in records
          if (r["head_dim"], r["causal"], r["seqlen"]) == (head_dim, causal, seqlen)}
    if not at:
        raise ValueError(f"no records at head_dim={head_dim}, causal={causal}, seqlen={seqlen}")
    labels = [step_label(s) for s in MMA_STEPS if step_label(s) in at]
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


def format_worklog(rows: list[dict]) -> str:
    """worklog_table's rows as text."""
    if not rows:
        return "(no steps)"
    bases = [key for key in rows[0] if key.startswith("vs sdpa")]
    lines = [f"{'step':<16s}{'TFLOP/s':>9s}{'vs prev':>9s}{'vs s1':>8s}" + "".join(f"{b:>15s}" for b in bases)]
    for row in rows:
        cells = [f"{row[key]:.2f}x" if row[key] else "—" for key in ("vs_previous", "vs_first", *bases)]
        tflops = f"{row['tflops']:9.1f}" if row["tflops"] else f"{'—':>9s}"
        lines.append(f"{row['step']:<16s}{tflops}{cells[0]:>9s}{cells[1]:>8s}"
                     + "".join(f"{c:>15s}" for c in cells[2:]))
    return "\n".join(lines)


def parse_args(argv=None):
    """--steps (default: all), then utils.bench.forward's flags (defaults: SDPA flash and cuDNN, no registry impls)."""
    from utils.bench import forward as benchmark

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", nargs="+", default=list(MMA_STEPS), choices=MMA_STEPS)
    ours, rest = own.parse_known_args(argv)
    defaults = ["--impls", "--sdpa", "flash", "cudnn", "--name", "06b_cuda_mma"]
    args = benchmark.parse_args(defaults + list(rest))
    args.steps = ours.steps
    return args


def main(argv=None) -> list[dict]:
    import torch

    from utils.bench import forward as benchmark

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.bench.cuda_mma needs a CUDA GPU")
    fns = {**step_functions(args.steps), **benchmark.candidates(args)}
    records = benchmark.run(args, fns)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = gpu.environment()
    json_path = benchmark.write_json(records, args, args.out_dir / f"{args.name}.json")
    png_path = benchmark.plot(records, args.out_dir / f"{args.name}.png",
                              title=f"tensor-core steps, {env.get('gpu', '')}, {args.dtype}, B={args.batch}, "
                                    f"H={args.heads}")
    print(benchmark.format_table(records))
    for d, causal, n in benchmark.configurations(args):
        print(f"\nD={d} {'causal' if causal else 'not causal'} N={n}")
        print(format_worklog(worklog_table(records, head_dim=d, causal=causal, seqlen=n)))
    print(f"wrote {json_path} and {png_path}")
    return records


if __name__ == "__main__":
    main()
