"""The tile sweep behind `utils.tiled.fast.backward.pick_config` (notebook 07): each pass's candidates timed in the
whole backward, the other pass held at the default, one shape per (head dim, masking).

`python -m utils.course.bench.backward_tiles` writes images/07_backward_tiles_h200.json; tests/test_bench_backward.py
checks that every 16-bit default is within `TOLERANCE` of the fastest stored candidate of its pass.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from utils.course.bench import benchmark, error_line

if TYPE_CHECKING:
    from utils.tiled.fast.backward import Config

# (block_m, block_n, warps, stages) of the dK/dV pass (block_n keys kept, block_m queries looped over) and of the
# dQ pass (block_m queries kept, block_n keys looped over).
DKDV_CANDIDATES = ((32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2),
                   (128, 128, 8, 2))
DQ_CANDIDATES = ((128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                 (64, 128, 4, 2))
PASSES = {"dkdv": ("block_m1", "block_n1", "warps1", "stages1"), "dq": ("block_m2", "block_n2", "warps2", "stages2")}
TOLERANCE = 0.03   # timings of one run move by about this much; closer candidates are a tie
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "07_backward_tiles_h200.json"


def candidate_config(default: Config, which: str, tiles) -> Config:
    """`default` with pass `which` ("dkdv" or "dq") given `tiles` = (block_m, block_n, warps, stages)."""
    if which not in PASSES:
        raise ValueError(f"which must be one of {sorted(PASSES)}, got {which!r}")
    if len(tiles) != 4:
        raise ValueError(f"tiles must be (block_m, block_n, warps, stages), got {tiles!r}")
    return dataclasses.replace(default, **dict(zip(PASSES[which], tiles)))


def sweep(head_dims=(64, 128), causal=(False, True), *, seqlen=8192, batch=4, heads=16,
          dtype=torch.bfloat16) -> list[dict]:
    """Rows {head_dim, causal, kernel, tiles, ms, error}: the whole backward timed with each candidate of one pass.
    Needs a CUDA GPU."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.tiled.fast.backward import pick_config, flash_attention_backward

    if not torch.cuda.is_available():
        raise RuntimeError("the tile sweep needs a CUDA GPU")
    rows = []
    for d in head_dims:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=dtype, generator=gen)
                       for _ in range(4))
        for c in causal:
            o, lse = flash_attention_forward(q, k, v, causal=c)
            default = pick_config(d, dtype, c)
            for which, candidates in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
                for tiles in candidates:
                    config = candidate_config(default, which, tiles)
                    row = dict(head_dim=d, causal=c, kernel=which, tiles=list(tiles), ms=None, error=None)
                    try:
                        row["ms"] = benchmark(flash_attention_backward, do, q, k, v, o, lse, causal=c,
                                              config=config)
                    except Exception as err:  # noqa: BLE001 - a config that does not fit (shared memory) is a result
                        row["error"] = error_line(err)
                    rows.append(row)
    return rows


def _case(row: dict) -> tuple:
    return row["head_dim"], row["causal"], row["kernel"]


def timings(rows: list[dict], head_dim: int, causal: bool, which: str) -> dict[tuple, float]:
    """{tiles: ms} of the candidates of pass `which` timed for this head dim and masking (failed ones left out)."""
    return {tuple(r["tiles"]): r["ms"] for r in rows if _case(r) == (head_dim, causal, which) and r["ms"]}


def fastest(rows: list[dict], head_dim: int, causal: bool, which: str) -> tuple[tuple, float]:
    """(tiles, ms) of the fastest stored candidate of pass `which` for this head dim and masking."""
    timed = timings(rows, head_dim, causal, which)
    if not timed:
        raise ValueError(f"no timed {which} candidates for head_dim={head_dim}, causal={causal}")
    return min(timed.items(), key=lambda item: item[1])


def format_table(rows: list[dict]) -> str:
    """One line per candidate: its time relative to the fastest of its pass and shape (1.00 = fastest)."""
    lines = []
    for d, c, which in sorted({_case(r) for r in rows}):
        best = fastest(rows, d, c, which)[1]
        cells = [f"{'x'.join(map(str, r['tiles']))} " + (f"{r['ms'] / best:.2f}" if r["ms"] else "failed")
                 for r in rows if _case(r) == (d, c, which)]
        lines.append(f"d={d:<3} {'causal' if c else 'full  '} {which:<4}: " + ", ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """`python -m utils.course.bench.backward_tiles [--out PATH] [--seqlen N]`."""
    import argparse
    import sys

    from utils import gpu

    parser = argparse.ArgumentParser(prog="python -m utils.course.bench.backward_tiles", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args(argv)
    rows = sweep(seqlen=args.seqlen)
    command = "python -m utils.course.bench.backward_tiles " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.write_text(json.dumps({"environment": gpu.environment(command),
                                    "meta": dict(batch=4, heads=16, seqlen=args.seqlen, dtype="bfloat16"),
                                    "rows": rows}, indent=1) + "\n")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
