"""Benchmark helpers: FLOP counts and timings (triton.testing.do_bench on a GPU, torch.utils.benchmark on a CPU)."""
from __future__ import annotations


import statistics
import time

import torch
import torch.utils.benchmark

from utils.checks import positive_int

_MODES = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, *, causal=False, mode="fwd") -> float:
    """FLOPs of attention: 4·B·H·Nq·Nk·D for the two matmuls, half that when causal, ×2.5 for the backward."""
    for name, x in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                    ("head_dim", head_dim)):
        positive_int(name, x)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops * (0.5 if causal else 1.0) * _MODES[mode]


def benchmark(fn, *args, warmup=25, rep=100, **kwargs) -> float:
    """Median time of `fn(*args, **kwargs)` in milliseconds, after `warmup` ms of calls.

    On a GPU (any CUDA tensor among args) this is `triton.testing.do_bench` (warmup/rep in ms, L2 flushed);
    otherwise `torch.utils.benchmark.Timer` over at least `rep` ms, which has no GPU or driver needs. A closure
    without arguments takes the second path on a GPU too: calls back to back, the GPU synchronised around each
    block of them, no L2 flush.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for name, value in (("warmup", warmup), ("rep", rep)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of milliseconds, got {type(value).__name__}")
    if not warmup >= 0:
        raise ValueError(f"warmup must be >= 0 ms, got {warmup}")
    if not rep > 0:
        raise ValueError(f"rep must be > 0 ms, got {rep}")
    on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    if on_gpu:
        import triton.testing

        return float(triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=warmup, rep=rep,
                                             return_mode="median"))
    _warm_up(fn, args, kwargs, warmup)
    timer = torch.utils.benchmark.Timer(stmt="fn(*args, **kwargs)",
                                        globals=dict(fn=fn, args=args, kwargs=kwargs))
    return timer.blocked_autorange(min_run_time=rep / 1000).median * 1e3


def _warm_up(fn, args, kwargs, warmup_ms: float) -> None:
    """Call fn for `warmup_ms` of wall time, the GPU drained at the end, so that timing starts from the clocks
    (and caches) that sustained calls run at, not from an idle GPU's."""
    if warmup_ms <= 0:
        return
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    end = time.perf_counter() + warmup_ms / 1000
    while True:
        fn(*args, **kwargs)
        sync()
        if time.perf_counter() >= end:
            return


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms must be positive, got {ms}")
    return flops / (ms * 1e-3) / 1e12


def error_line(err: BaseException, limit: int = 200) -> str:
    """An exception as one line of a results table: its type and the start of its first line."""
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:limit]}"


def median_rows(rows: dict[str, dict], times: dict[str, list[float]], flops: float) -> list[dict]:
    """The rows of one shape, in order, each without an error given the median of its times (ms) and TFLOP/s."""
    for name, row in rows.items():
        if row["error"] is None and times[name]:
            ms = statistics.median(times[name])
            row.update(ms=ms, tflops=tflops(flops, ms))
    return list(rows.values())


def rotated(items: list, r: int) -> list:
    """`items` starting at the r-th (cyclically): round r of a timing in rounds, so that no position in the list
    (the first, cold; the last, on a GPU heated by the others) is always the same implementation's."""
    return items[r % len(items):] + items[:r % len(items)]


def shape_table(heads: list[str], lines: list[tuple[tuple[int, bool, int], list[str]]]) -> str:
    """A plain-text table of one run: a line per shape (head dim, causal, N) and its cells, under `heads`, each
    column as wide as its heading and two spaces."""
    widths = [len(h) + 2 for h in heads]
    out = [f"{'D':>4s} {'mask':7s} {'N':>6s}" + "".join(f"{h:>{w}s}" for h, w in zip(heads, widths))]
    for (d, c, n), cells in lines:
        out.append(f"{d:4d} {'causal' if c else 'none':7s} {n:6d}"
                   + "".join(f"{x:>{w}s}" for x, w in zip(cells, widths)))
    return "\n".join(out)
