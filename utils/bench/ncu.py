"""Nsight Compute readings of a CUDA worklog's steps: one profiled launch per step, stored beside the timings.

    python -m utils.bench.ncu --worklog hopper --steps softmax overlap wide_tiles --name 06c_ncu_h200
    python -m utils.bench.ncu --worklog mma --steps tiles exp2 --head-dim 64 --seqlen 4096 --causal

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

from utils.bench.cuda_mma import WORKLOGS, check_steps, step_functions, step_label

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "InstructionStats")
KERNEL_REGEX = {"mma": "regex:flash_mma_kernel", "hopper": "regex:hopper_attention"}
# (section, metric as ncu names it, short label): the columns of the table
HEADLINE = (("GPU Speed Of Light Throughput", "Duration", "time µs"),
            ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "SM %"),
            ("GPU Speed Of Light Throughput", "Memory Throughput", "mem %"),
            ("Compute Workload Analysis", "Executed Ipc Active", "IPC"),
            ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cyc/issue"),
            ("Launch Statistics", "Registers Per Thread", "regs"),
            ("Occupancy", "Achieved Occupancy", "occ %"))
TO_MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
IMAGES = Path(__file__).resolve().parents[2] / "images"


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


def ncu_command(ncu: str, worklog: str, step: str, args: argparse.Namespace) -> list[str]:
    """The ncu command line that profiles `step`'s second launch in a child process."""
    step_label(step, worklog)  # validates both
    sections = [a for s in SECTIONS for a in ("--section", s)]
    child = [sys.executable, "-m", "utils.bench.ncu", "--child", "--worklog", worklog, "--steps", step,
             "--head-dim", str(args.head_dim), "--seqlen", str(args.seqlen), "--batch", str(args.batch),
             "--heads", str(args.heads), "--dtype", args.dtype] + (["--causal"] if args.causal else [])
    return [ncu, "--clock-control", "none", *sections, "--csv", "--page", "details", "-k", KERNEL_REGEX[worklog],
            "--launch-skip", "1", "--launch-count", "1", *child]


def format_table(steps: dict) -> str:
    """One row per step, the HEADLINE metrics as columns, units in the header ('—' where ncu did not report
    one; a duration in whatever unit ncu chose is shown in µs)."""
    lines = [f"{'step':<16s}" + "".join(f"{label:>10s}" for _, _, label in HEADLINE)]
    for label, sections in steps.items():
        cells = []
        for section, metric, _ in HEADLINE:
            value, unit = sections.get(section, {}).get(metric, (None, ""))
            if isinstance(value, float) and metric == "Duration":
                value *= TO_MICROSECONDS.get(unit, float("nan"))
            cells.append("—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<16s}" + "".join(f"{c:>10s}" for c in cells))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.bench.ncu", description=__doc__.split("\n\n")[0])
    p.add_argument("--worklog", choices=list(WORKLOGS), default="hopper")
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
    (fn,) = step_functions(args.steps, args.worklog).values()
    for _ in range(2):
        fn(q, k, v, causal=args.causal)
    torch.cuda.synchronize()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        _child(args)
        return {}
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("python -m utils.bench.ncu needs Nsight Compute's `ncu` on the PATH and a CUDA GPU")
    from utils import gpu

    steps = {}
    for step in args.steps:
        proc = subprocess.run(ncu_command(ncu, args.worklog, step, args), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"ncu failed on step {step!r} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        steps[step_label(step, args.worklog)] = parse_details(proc.stdout)
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
