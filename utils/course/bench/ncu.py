"""Nsight Compute readings of a worklog's steps: one profiled launch per step and kernel, stored beside the timings.

    python -m utils.course.bench.ncu --worklog hopper --steps softmax overlap wide_tiles --name 06c_ncu_h200
    python -m utils.course.bench.ncu --worklog mma --steps tiles exp2 --head-dim 64 --seqlen 4096 --causal
    python -m utils.course.bench.ncu --worklog triton_bwd --seqlen 4096 --causal --name 07_ncu_d128_causal_h200

Worklog triton_bwd is notebook 07's Triton backward with its loads pinned per step, as the backward benchmark's
pinned backends pin them (TRITON_BWD_STEPS: pointer loads, the tiles through TMA, the tiles and lse₂ and D through
TMA); each of its two main kernels is profiled on its own (TRITON_BWD_KERNELS), so a step gives two rows,
"b2_tma dkdv" and "b2_tma dq".

Each step runs in its own process under `ncu --clock-control none` with the sections SECTIONS, filtered to the
worklog's kernel (KERNEL_REGEX) and skipping its first launch (the one that builds and warms it up). ncu's
details page comes back as CSV; `parse_details` keeps section -> metric -> (value, unit), and the JSON
(images/<name>.json: environment, settings, steps) keeps all of it; the table shows HEADLINE. The CSV parsing,
the command lines and the table run anywhere; the readings need ncu and an sm_90 (hopper) or CUDA GPU.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from utils.course.bench.backward import TRITON_LOADS
from utils.course.bench.cuda_mma import WORKLOGS, check_steps, step_functions, step_label

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "InstructionStats")
KERNEL_REGEX = {"mma": "regex:flash_mma_kernel", "hopper": "regex:hopper_attention"}
# step -> (tma, tma_stats): utils.course.bench.backward's pinned backends, "triton_tma" -> "tma"
TRITON_BWD_STEPS = {name.removeprefix("triton_"): loads for name, loads in TRITON_LOADS.items()}
TRITON_BWD_KERNELS = {"dkdv": "regex:_bwd_dkdv", "dq": "regex:_bwd_dq"}
WORKLOG_NAMES = (*WORKLOGS, "triton_bwd")
# (section, metric as ncu names it, short label): the columns of the table
HEADLINE = (("GPU Speed Of Light Throughput", "Duration", "time µs"),
            ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "SM %"),
            ("GPU Speed Of Light Throughput", "Memory Throughput", "mem %"),
            ("Compute Workload Analysis", "Executed Ipc Active", "IPC"),
            ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cyc/issue"),
            ("Launch Statistics", "Registers Per Thread", "regs"),
            ("Occupancy", "Achieved Occupancy", "occ %"))
TO_MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
IMAGES = Path(__file__).resolve().parents[3] / "images"


def parse_details(text: str) -> dict:
    """ncu's `--csv --page details` output -> {section: {metric: [value, unit]}} for the one profiled kernel.
    Values that read as numbers (with thousands separators) become floats; lines before the CSV header (the
    profiled program's own output, ncu's ==PROF== notes) are skipped."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV in the text (expected a header line starting with \"ID\")")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    missing = {"Section Name", "Metric Name", "Metric Unit", "Metric Value"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"the ncu CSV has no column {sorted(missing)}; was it made with --page details?")
    rows = [row for row in reader if row["Metric Name"]]  # rule results come without a metric
    kernels = {row["ID"] for row in rows}
    if len(kernels) != 1:
        raise ValueError(f"expected one profiled kernel, found {len(kernels)}: {sorted(kernels)}")
    out: dict = {}
    for row in rows:
        value = row["Metric Value"]
        try:
            value = float(value.replace(",", ""))
        except ValueError:
            pass
        out.setdefault(row["Section Name"], {})[row["Metric Name"]] = [value, row["Metric Unit"]]
    return out


def profile_label(step: str, worklog: str, kernel: str | None = None) -> str:
    """The row label of one profile: step_label's ('h6_overlap'), or for triton_bwd 'b2_tma dq' (step, kernel)."""
    if worklog != "triton_bwd":
        return step_label(step, worklog)
    if step not in TRITON_BWD_STEPS:
        raise ValueError(f"step must be one of {tuple(TRITON_BWD_STEPS)}, got {step!r}")
    if kernel not in TRITON_BWD_KERNELS:
        raise ValueError(f"kernel must be one of {tuple(TRITON_BWD_KERNELS)} for worklog triton_bwd, got {kernel!r}")
    return f"b{list(TRITON_BWD_STEPS).index(step) + 1}_{step} {kernel}"


def ncu_command(ncu: str, worklog: str, step: str, args: argparse.Namespace, kernel: str | None = None) -> list[str]:
    """The ncu command line that profiles the second launch of `step`'s kernel (for triton_bwd: of `kernel`,
    "dkdv" or "dq") in a child process."""
    profile_label(step, worklog, kernel)  # validates all three
    regex = TRITON_BWD_KERNELS[kernel] if worklog == "triton_bwd" else KERNEL_REGEX[worklog]
    sections = [a for s in SECTIONS for a in ("--section", s)]
    child = [sys.executable, "-m", "utils.course.bench.ncu", "--child", "--worklog", worklog, "--steps", step,
             "--head-dim", str(args.head_dim), "--seqlen", str(args.seqlen), "--batch", str(args.batch),
             "--heads", str(args.heads), "--dtype", args.dtype] + (["--causal"] if args.causal else [])
    return [ncu, "--clock-control", "none", *sections, "--csv", "--page", "details", "-k", regex,
            "--launch-skip", "1", "--launch-count", "1", *child]


def format_table(steps: dict) -> str:
    """One row per step, the HEADLINE metrics as columns, units in the header ('—' where ncu did not report
    one; a duration in whatever unit ncu chose is shown in µs)."""
    lines = [f"{'step':<18s}" + "".join(f"{label:>10s}" for _, _, label in HEADLINE)]
    for label, sections in steps.items():
        cells = []
        for section, metric, _ in HEADLINE:
            value, unit = sections.get(section, {}).get(metric, (None, ""))
            if isinstance(value, float) and metric == "Duration":
                value *= TO_MICROSECONDS.get(unit, float("nan"))
            cells.append("—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<18s}" + "".join(f"{c:>10s}" for c in cells))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.ncu", description=__doc__.split("\n\n")[0])
    p.add_argument("--worklog", choices=list(WORKLOG_NAMES), default="hopper")
    p.add_argument("--steps", nargs="+", help="default: every step of the worklog")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--name", default=None, help="images/<name>.json (default: <worklog>_ncu)")
    p.add_argument("--out-dir", type=Path, default=IMAGES)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the profiled process
    args = p.parse_args(argv)
    if args.worklog == "triton_bwd":
        for step in args.steps or ():
            if step not in TRITON_BWD_STEPS:
                p.error(f"--steps: {step!r} is not a step of the triton_bwd worklog {tuple(TRITON_BWD_STEPS)}")
        args.steps = list(args.steps or TRITON_BWD_STEPS)
    else:
        args.steps = check_steps(p, args.worklog, args.steps)
    for name in ("seqlen", "batch", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    args.name = args.name or f"{args.worklog}_ncu"
    return args


def _child(args) -> None:
    """Run the one step twice: the first launch builds and warms up, ncu profiles the second."""
    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(args.batch, args.heads, args.seqlen, args.head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    if args.worklog == "triton_bwd":
        from utils.course.worklogs.triton_backward import flash_attention_backward
        from utils.tiled.fast.forward import flash_attention_forward

        (step,) = args.steps
        tma, stats = TRITON_BWD_STEPS[step]
        o, lse = flash_attention_forward(q, k, v, causal=args.causal)
        do = torch.randn_like(q)
        fn = lambda: flash_attention_backward(do, q, k, v, o, lse, causal=args.causal, tma=tma,  # noqa: E731
                                              tma_stats=stats)
    else:
        (step_fn,) = step_functions(args.steps, args.worklog).values()
        fn = lambda: step_fn(q, k, v, causal=args.causal)  # noqa: E731
    for _ in range(2):
        fn()
    torch.cuda.synchronize()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        _child(args)
        return {}
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("python -m utils.course.bench.ncu needs Nsight Compute's `ncu` on the PATH and a CUDA GPU")
    from utils import gpu

    steps = {}
    kernels = list(TRITON_BWD_KERNELS) if args.worklog == "triton_bwd" else [None]
    for step in args.steps:
        for kernel in kernels:
            proc = subprocess.run(ncu_command(ncu, args.worklog, step, args, kernel), capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"ncu failed on step {step!r} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            steps[profile_label(step, args.worklog, kernel)] = parse_details(proc.stdout)
            print(format_table(steps).splitlines()[-1], flush=True)
    settings = {k: getattr(args, k) for k in ("worklog", "head_dim", "seqlen", "batch", "heads", "dtype", "causal")}
    data = dict(environment=gpu.environment(), settings=settings, sections=list(SECTIONS), steps=steps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(format_table(steps))
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
