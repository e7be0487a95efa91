"""Notebook 06's softmax kernels beside torch.softmax, timed on a GPU, into images/06_softmax_h200.json.

    python -m utils.course.bench.softmax --out images/06_softmax_h200.json

`softmax_table` measures; `format_softmax_table` prints its records (notebook 06 prints the stored ones).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from utils import gpu
from utils.course.bench import benchmark
from utils.native.build import load
from utils.native.kernels import SOFTMAX_VARIANTS

SOFTMAX_SHAPES = ((1024, 1024), (4096, 4096), (8192, 8192), (65536, 128))


def softmax_table(shapes=SOFTMAX_SHAPES, *, seed: int = 0) -> list[dict]:
    """Each softmax kernel beside torch.softmax on float32 (rows, cols) inputs: ms, GB/s, speed-up over torch.

    Every kernel's output is checked against torch.softmax before it is timed. The kernels are timed through
    the extension function itself (as torch.softmax is timed through its C++ entry), without the Python-side
    checks of `utils.native.kernels.softmax()`, which would add microseconds to kernels that take a few of them.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("softmax_table needs a CUDA GPU")
    ext = load("softmax")
    records = []
    for rows, cols in shapes:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(rows, cols, device="cuda", generator=gen) * 3
        expected = torch.softmax(x, dim=-1)
        gigabytes = 2 * x.numel() * x.element_size() / 1e9  # one read, one write
        base = benchmark(torch.softmax, x, -1)
        records.append(dict(rows=rows, cols=cols, kernel="torch.softmax", ms=base, gbps=gigabytes / base * 1e3,
                            vs_torch=1.0))
        for index, variant in enumerate(SOFTMAX_VARIANTS):
            torch.testing.assert_close(ext.softmax_forward(x, index), expected, atol=1e-6, rtol=1e-4)
            ms = benchmark(ext.softmax_forward, x, index)
            records.append(dict(rows=rows, cols=cols, kernel=variant, ms=ms, gbps=gigabytes / ms * 1e3,
                                vs_torch=base / ms))
    return records


def format_softmax_table(records) -> str:
    """A text table of softmax_table's records."""
    lines = [f"{'rows x cols':>13s} {'kernel':>14s} {'µs':>9s} {'GB/s':>7s} {'vs torch':>9s}"]
    for r in records:
        lines.append(f"{r['rows']:>6d}x{r['cols']:<6d} {r['kernel']:>14s} {r['ms'] * 1e3:9.1f} {r['gbps']:7.0f} "
                     f"{r['vs_torch']:8.2f}x")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m utils.course.bench.softmax", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the records and the environment as JSON here")
    args = parser.parse_args(argv)
    records = softmax_table()
    print(format_softmax_table(records))
    if args.out:
        args.out.write_text(json.dumps(dict(environment=gpu.environment(), results=records), indent=1))
    return records


if __name__ == "__main__":
    main()
