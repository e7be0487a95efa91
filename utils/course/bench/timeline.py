"""Where a block of notebook 06cw's Hopper kernel spends its time: utils.native.hopper.block_timeline per step and
shape, reduced by utils.native.hopper.timeline_summary, into images/<name>.json (sm_90 GPUs only).

    python -m utils.course.bench.timeline --steps three_consumers tma_store --name 06c_timeline_h200

Each case runs `--warmup` untraced launches, then `--repeats` traced ones, and keeps the summary of the launch
whose span (first block's start to last block's end) is the median: one launch, not an average of several.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from utils import gpu
from utils.native import hopper
from utils.course.bench.forward import IMAGES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", nargs="+", default=["three_consumers", "tma_store"])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=[64, 128])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3, help="untraced launches first")
    p.add_argument("--repeats", type=int, default=5, help="traced launches; the median span's is kept")
    p.add_argument("--name", default="06c_timeline")
    p.add_argument("--out-dir", type=Path, default=IMAGES)
    args = p.parse_args(argv)
    for step in args.steps:
        if step not in hopper.ATTENTION_STEPS[2:]:
            p.error(f"--steps: {step!r} is not a warp-specialised step {hopper.ATTENTION_STEPS[2:]}")
    for flag in ("seqlen", "batch", "heads", "repeats"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag} must be positive")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    if "/" in args.name or not args.name:
        p.error("--name must be a bare file name")
    return args


def measure(args, device="cuda") -> list[dict]:
    """One record per (step, head_dim, causal): the case and timeline_summary of its median-span launch."""
    records = []
    for d in args.head_dims:
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            gen = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(args.batch, args.heads, args.seqlen, d, generator=gen)
                       .to(device=device, dtype=torch.bfloat16) for _ in range(3))
            for step in args.steps:
                for _ in range(args.warmup):
                    hopper.flash_hopper(q, k, v, causal=causal, step=step)
                runs = sorted((hopper.timeline_summary(hopper.block_timeline(q, k, v, causal=causal, step=step))
                               for _ in range(args.repeats)), key=lambda s: s["span_ns"])
                records.append(dict(step=step, head_dim=d, causal=causal, seqlen=args.seqlen,
                                    **runs[len(runs) // 2]))
    return records


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from utils.native import build as native_build

    if not torch.cuda.is_available():
        raise SystemExit("utils.course.bench.timeline needs an sm_90 GPU (H100/H200) and a CUDA build of torch")
    native_build.check_hopper_capability(gpu.capability())
    records = measure(args)
    settings = dict(batch=args.batch, heads=args.heads, dtype="bf16", warmup=args.warmup, repeats=args.repeats)
    path = Path(args.out_dir) / f"{args.name}.json"
    path.write_text(json.dumps(dict(environment=gpu.environment(), settings=settings, results=records), indent=1))
    for r in records:
        phases = ", ".join(f"{name} {ns / 1000:.2f}" for name, ns in r["phases_ns"].items())
        print(f"{r['step']:>16s} D={r['head_dim']} causal={r['causal']}: block {r['block_ns'] / 1000:.1f} us "
              f"({phases} us), launch gap {r['launch_gap_ns']:.0f} ns, span {r['span_ns'] / 1000:.0f} us")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
