"""Nsight Compute readings of a worklog's steps: one profiled launch per step and kernel, stored beside the timings.

    python -m utils.course.bench.ncu --worklog hopper --steps softmax overlap wide_tiles --name 06c_ncu_h200
    python -m utils.course.bench.ncu --worklog mma --steps tiles exp2 --head-dim 64 --seqlen 4096 --causal
    python -m utils.course.bench.ncu --worklog triton_bwd --seqlen 4096 --causal --name 07_ncu_d128_causal_h200
    python -m utils.course.bench.ncu --worklog hopper_bwd --steps late_dq_first flash-attn-4 --source

Worklog triton_bwd is notebook 07's Triton backward with its loads pinned per step, as the backward benchmark's
pinned backends pin them (TRITON_BWD_STEPS: pointer loads, the tiles through TMA, the tiles and lse₂ and D through
TMA); each of its two main kernels is profiled on its own (TRITON_BWD_KERNELS), so a step gives two rows,
"b2_tma dkdv" and "b2_tma dq". Worklog hopper_bwd is notebook 06c's backward (utils.native.hopper_backward), one
kernel a step; its step "flash-attn-4" profiles FlashAttention-4's backward kernel beside them (the peer of
utils.course.bench.peers, from its own installed package).

Each step runs in its own process under `ncu --clock-control none` with the sections SECTIONS, filtered to the
worklog's kernel (KERNEL_REGEX) and skipping its first launch (the one that builds and warms it up). ncu's
details page comes back as CSV; `parse_details` keeps section -> metric -> (value, unit), and the JSON
(images/<name>.json: environment, settings, steps) keeps all of it; the table shows HEADLINE. With --source the
profile also samples each instruction (SourceCounters), and `parse_source` keeps, from ncu's SASS page, the
instruction mix, the stall reasons and the instructions the warps stalled at most (a step's "source" entry).
The CSV parsing, the command lines and the table run anywhere; the readings need ncu and an sm_90 (hopper,
hopper_bwd) or CUDA GPU.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from utils.course.bench.backward import TRITON_LOADS
from utils.course.bench.cuda_mma import WORKLOGS, check_steps, step_functions, step_label
from utils.course.bench.peers import FA4
from utils.native.hopper_backward import BWD_STEPS

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "InstructionStats")
SOURCE_SECTIONS = (*SECTIONS, "SourceCounters")  # --source: each instruction sampled too
KERNEL_REGEX = {"mma": "regex:flash_mma_kernel", "hopper": "regex:hopper_attention",
                "hopper_bwd": "regex:hopper_backward_kernel"}
# worklog hopper_bwd: the Hopper backward's steps, then FlashAttention-4's backward (its main kernel, not the passes
# before and after it)
HOPPER_BWD = (*BWD_STEPS, FA4)
FA4_BWD_REGEX = "regex:BackwardSm90"
# step -> (tma, tma_stats): utils.course.bench.backward's pinned backends, "triton_tma" -> "tma"
TRITON_BWD_STEPS = {name.removeprefix("triton_"): loads for name, loads in TRITON_LOADS.items()}
TRITON_BWD_KERNELS = {"dkdv": "regex:_bwd_dkdv", "dq": "regex:_bwd_dq"}
# the worklogs whose steps this module defines (the others' are utils.course.bench.cuda_mma's)
OWN_STEPS = {"triton_bwd": tuple(TRITON_BWD_STEPS), "hopper_bwd": HOPPER_BWD}
WORKLOG_NAMES = (*WORKLOGS, *OWN_STEPS)
# (section, metric as ncu names it, short label): the columns of the table
HEADLINE = (("GPU Speed Of Light Throughput", "Duration", "time µs"),
            ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "SM %"),
            ("GPU Speed Of Light Throughput", "Memory Throughput", "mem %"),
            ("Compute Workload Analysis", "Executed Ipc Active", "IPC"),
            ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cyc/issue"),
            ("Launch Statistics", "Registers Per Thread", "regs"),
            ("Occupancy", "Achieved Occupancy", "occ %"))
TOP_INSTRUCTIONS = 25  # parse_source: the instructions kept, by stall samples
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


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse_source(text: str, top: int = TOP_INSTRUCTIONS) -> dict:
    """ncu's `--csv --page source --print-source sass` output for one kernel -> {"instructions": executed in all,
    "opcodes": {opcode: share of those}, "stalls": {reason: share of the stall samples}, "stalled_at": {opcode:
    share of the samples taken at its instructions}, "top": the `top` instructions by samples, each [share of
    samples, SASS text, {reason: its share of that line's samples}]}.
    Shares are fractions; an opcode is the SASS mnemonic without its modifiers (predicates dropped). ncu may print
    the kernel's listing more than once: the first is read."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}")
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"]), None)
    if start is None:
        raise ValueError("no SASS listing in the text (expected a header \"Address\",\"Source\"; was it made with "
                         "--page source --print-source sass?)")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    missing = {"Instructions Executed", "Warp Stall Sampling (All Samples)"} - set(col)
    if missing:
        raise ValueError(f"the SASS listing has no column {sorted(missing)}; was SourceCounters collected?")
    reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    opcodes, stalls, stalled_at, lines = Counter(), Counter(), Counter(), []
    for row in rows[start + 1:]:
        if len(row) < len(header) or row[0] == "Kernel Name":
            break  # the end of the first listing
        words = [w for w in row[col["Source"]].split() if not w.startswith("@")]
        if not words:
            continue
        opcode = words[0].split(".")[0]
        opcodes[opcode] += _number(row[col["Instructions Executed"]])
        samples = _number(row[col["Warp Stall Sampling (All Samples)"]])
        stalled_at[opcode] += samples
        by_reason = {r.removeprefix("stall_"): _number(row[col[r]]) for r in reasons}
        stalls.update(by_reason)
        lines.append((samples, " ".join(words), by_reason))
    executed, sampled = sum(opcodes.values()), sum(stalls.values())
    if not lines or executed == 0:
        raise ValueError("the SASS listing has no executed instruction")
    total = sum(samples for samples, _, _ in lines) or 1.0
    lines.sort(key=lambda line: -line[0])
    return dict(instructions=executed,
                opcodes={op: n / executed for op, n in opcodes.most_common() if n},
                stalls={r: n / (sampled or 1.0) for r, n in stalls.most_common() if n},
                stalled_at={op: n / total for op, n in stalled_at.most_common() if n},
                top=[[samples / total, sass, {r: n / samples for r, n in sorted(by_reason.items(), key=lambda x: -x[1])
                                              if samples and n >= 0.1 * samples}]
                     for samples, sass, by_reason in lines[:top]])


def profile_label(step: str, worklog: str, kernel: str | None = None) -> str:
    """The row label of one profile: step_label's ('h6_overlap'), for triton_bwd 'b2_tma dq' (step, kernel), for
    hopper_bwd 'hb15_late_dq_first' or 'flash-attn-4'."""
    if worklog == "hopper_bwd":
        if step not in HOPPER_BWD:
            raise ValueError(f"step must be one of {HOPPER_BWD}, got {step!r}")
        return step if step == FA4 else f"hb{BWD_STEPS.index(step) + 1}_{step}"
    if worklog != "triton_bwd":
        return step_label(step, worklog)
    if step not in TRITON_BWD_STEPS:
        raise ValueError(f"step must be one of {tuple(TRITON_BWD_STEPS)}, got {step!r}")
    if kernel not in TRITON_BWD_KERNELS:
        raise ValueError(f"kernel must be one of {tuple(TRITON_BWD_KERNELS)} for worklog triton_bwd, got {kernel!r}")
    return f"b{list(TRITON_BWD_STEPS).index(step) + 1}_{step} {kernel}"


def ncu_command(ncu: str, worklog: str, step: str, args: argparse.Namespace, kernel: str | None = None,
                report: str | None = None) -> list[str]:
    """The ncu command line that profiles the second launch of `step`'s kernel (for triton_bwd: of `kernel`,
    "dkdv" or "dq") in a child process. It prints the details page as CSV, or with `report` (a path) it also
    samples each instruction (SourceCounters) and saves the profile there for `import_commands`."""
    profile_label(step, worklog, kernel)  # validates all three
    if worklog == "triton_bwd":
        regex = TRITON_BWD_KERNELS[kernel]
    else:
        regex = FA4_BWD_REGEX if step == FA4 else KERNEL_REGEX[worklog]
    sections = [a for s in (SOURCE_SECTIONS if report else SECTIONS) for a in ("--section", s)]
    child = [sys.executable, "-m", "utils.course.bench.ncu", "--child", "--worklog", worklog, "--steps", step,
             "--head-dim", str(args.head_dim), "--seqlen", str(args.seqlen), "--batch", str(args.batch),
             "--heads", str(args.heads), "--dtype", args.dtype] + (["--causal"] if args.causal else [])
    output = ["--csv", "--page", "details"] if report is None else ["--import-source", "no", "-f", "-o", report]
    return [ncu, "--clock-control", "none", *sections, *output, "-k", regex, "--launch-skip", "1",
            "--launch-count", "1", *child]


def import_commands(ncu: str, report: str) -> tuple[list[str], list[str]]:
    """The two ncu command lines that print a saved profile (`report`, as given to ncu_command) as CSV: its
    details page (for parse_details) and its SASS with the per-instruction counters (for parse_source)."""
    path = report if report.endswith(".ncu-rep") else report + ".ncu-rep"
    return ([ncu, "--import", path, "--csv", "--page", "details"],
            [ncu, "--import", path, "--csv", "--page", "source", "--print-source", "sass"])


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


SHARES = ("stalled_at", "opcodes", "stalls")  # a --source reading's shares: see parse_source


def _check_shares(source, names, what: str) -> None:
    if not isinstance(source, dict):
        raise TypeError(f"source must be a dict (a reading's \"source\" entry), got {type(source).__name__}")
    if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{what} must be a non-empty sequence of names, got {names!r}")


def format_shares(source: dict, entry: str, names) -> str:
    """One row per step of a --source reading (its "source" entry): in percent, the share of each of `names` in
    its `entry`: "opcodes" (instructions executed, by SASS mnemonic), "stalls" (stall samples, by reason) or
    "stalled_at" (stall samples, by the mnemonic they were taken at)."""
    if entry not in SHARES:
        raise ValueError(f"entry must be one of {SHARES}, got {entry!r}")
    _check_shares(source, names, "names")
    lines = [f"{entry + ', %':<20s}" + "".join(f"{n:>10s}" for n in names)]
    for label, reading in source.items():
        lines.append(f"{label:<20s}" + "".join(f"{100 * reading[entry].get(n, 0.0):>10.1f}" for n in names))
    return "\n".join(lines)


def format_stalls(source: dict, opcodes=("WARPGROUP", "HGMMA", "FENCE", "STS", "FFMA")) -> str:
    """One row per step of a --source reading (its "source" entry): the instructions it executed, in billions,
    then the share of its stall samples taken at each of `opcodes` (SASS mnemonics, as parse_source keeps them),
    in percent."""
    _check_shares(source, opcodes, "opcodes")
    lines = [f"{'step':<20s}{'instr G':>9s}" + "".join(f"{op + ' %':>12s}" for op in opcodes)]
    for label, reading in source.items():
        at = reading["stalled_at"]
        lines.append(f"{label:<20s}{reading['instructions'] / 1e9:>9.3f}"
                     + "".join(f"{100 * at.get(op, 0.0):>12.1f}" for op in opcodes))
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
    p.add_argument("--source", action="store_true",
                   help="also sample each instruction: instruction mix, stall reasons, top instructions")
    p.add_argument("--name", default=None, help="images/<name>.json (default: <worklog>_ncu)")
    p.add_argument("--out-dir", type=Path, default=IMAGES)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the profiled process
    args = p.parse_args(argv)
    if args.worklog in OWN_STEPS:
        every = OWN_STEPS[args.worklog]
        for step in args.steps or ():
            if step not in every:
                p.error(f"--steps: {step!r} is not a step of the {args.worklog} worklog {every}")
        args.steps = list(args.steps or every)
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
    if args.worklog == "hopper_bwd":
        (step,) = args.steps
        do = torch.randn_like(q)
        if step == FA4:  # its backward through autograd; the forward's kernels do not match FA4_BWD_REGEX
            from utils.course.bench.peers import load_flash_attention_4

            peer = load_flash_attention_4()
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            fn = lambda: peer(q, k, v, causal=args.causal).backward(do)  # noqa: E731
        else:
            from utils.native.hopper import flash_hopper_forward
            from utils.native.hopper_backward import flash_hopper_backward

            o, lse = flash_hopper_forward(q, k, v, causal=args.causal)
            fn = lambda: flash_hopper_backward(do, q, k, v, o, lse, causal=args.causal, step=step)  # noqa: E731
    elif args.worklog == "triton_bwd":
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

    def run(cmd, step):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"ncu failed on step {step!r} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout

    steps, source = {}, {}
    kernels = list(TRITON_BWD_KERNELS) if args.worklog == "triton_bwd" else [None]
    for step in args.steps:
        for kernel in kernels:
            label = profile_label(step, args.worklog, kernel)
            if not args.source:
                steps[label] = parse_details(run(ncu_command(ncu, args.worklog, step, args, kernel), step))
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    report = str(Path(tmp) / "profile")
                    run(ncu_command(ncu, args.worklog, step, args, kernel, report=report), step)
                    details, sass = import_commands(ncu, report)
                    steps[label] = parse_details(run(details, step))
                    source[label] = parse_source(run(sass, step))
            print(format_table(steps).splitlines()[-1], flush=True)
    settings = {k: getattr(args, k) for k in ("worklog", "head_dim", "seqlen", "batch", "heads", "dtype", "causal")}
    data = dict(environment=gpu.environment(), settings=settings,
                sections=list(SOURCE_SECTIONS if args.source else SECTIONS), steps=steps)
    if source:
        data["source"] = source
    if FA4 in args.steps:
        from utils.course.bench.peers import load_flash_attention_4

        data["peers"] = {FA4: load_flash_attention_4().provenance()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(format_table(steps))
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
