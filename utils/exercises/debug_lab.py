"""Launchers and checks for notebook 05a, the debugging lab: three small Triton kernels, each handed over with one
planted bug, which the learner finds with print_if / breakpoint_if / test_pid_conds and fixes.

Each check runs the learner's fixed kernel on odd shapes (sizes that are not multiples of the blocks, more
columns than rows) against a float64 reference computed here, and names the rows and blocks that are wrong.
"""
from __future__ import annotations

import torch

from utils.exercises import assert_rows_close

BLOCK_R = 8      # rows per program in the lab's kernels
BLOCK_C = 16     # columns per block where a kernel loops over column blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rand(*shape, seed: int, scale: float = 1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- Lab 1: a causal softmax (bottom-right aligned) ---------------------------------------------------------

def run_causal_softmax(kernel, s: torch.Tensor) -> torch.Tensor:
    """kernel(S, P, n_rows, n_cols, BLOCK_R, BLOCK_C): softmax of each row of the (n_rows, n_cols) scores over
    the keys it may see (key j for row i iff j <= i + n_cols - n_rows); one program per BLOCK_R rows."""
    s = s.contiguous()
    p = torch.zeros_like(s)
    n_rows, n_cols = s.shape
    kernel[(_cdiv(n_rows, BLOCK_R),)](s, p, n_rows, n_cols, BLOCK_R=BLOCK_R,
                                      BLOCK_C=max(16, 1 << (n_cols - 1).bit_length()))
    return p


def check_causal_softmax(kernel) -> None:
    for n_rows, n_cols in [(20, 20), (13, 29), (1, 5), (17, 17)]:
        s = _rand(n_rows, n_cols, seed=n_rows * 100 + n_cols)
        sees = torch.arange(n_cols)[None, :] <= torch.arange(n_rows)[:, None] + (n_cols - n_rows)
        expected = torch.softmax(s.double().masked_fill(~sees, float("-inf")), -1)
        assert_rows_close(run_causal_softmax(kernel, s), expected, atol=1e-5, rtol=1e-5, block_rows=BLOCK_R,
                          name=f"P ({n_rows}x{n_cols})")


# --- Lab 2: scale each row of a matrix, 2-D tiles -----------------------------------------------------------

def run_scale_rows(kernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kernel(X, W, OUT, n_rows, n_cols, stride, BLOCK_M, BLOCK_N): out[i, j] = x[i, j] * w[i], one program per
    (BLOCK_M, BLOCK_N) tile; grid (cdiv(n_rows, BLOCK_M), cdiv(n_cols, BLOCK_N))."""
    x = x.contiguous()
    out = torch.zeros_like(x)
    n_rows, n_cols = x.shape
    kernel[(_cdiv(n_rows, BLOCK_R), _cdiv(n_cols, BLOCK_C))](x, w.contiguous(), out, n_rows, n_cols, x.stride(0),
                                                              BLOCK_M=BLOCK_R, BLOCK_N=BLOCK_C)
    return out


def check_scale_rows(kernel) -> None:
    for n_rows, n_cols in [(8, 16), (20, 50), (37, 9), (3, 70)]:
        x, w = _rand(n_rows, n_cols, seed=n_rows), _rand(n_rows, seed=n_cols)
        assert_rows_close(run_scale_rows(kernel, x, w), x.double() * w.double()[:, None], atol=1e-6, rtol=1e-6,
                          block_rows=BLOCK_R, name=f"out ({n_rows}x{n_cols})")


# --- Lab 3: softmax-weighted sum, online over column blocks -------------------------------------------------

def run_softmax_dot(kernel, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """kernel(S, V, OUT, n_rows, n_cols, BLOCK_R, BLOCK_C): out[i] = sum_j softmax(s[i])_j v[j], computed in one
    pass over column blocks with a running max, sum and accumulator (the online softmax of notebook 02)."""
    s = s.contiguous()
    out = torch.zeros(s.shape[0], dtype=s.dtype)
    kernel[(_cdiv(s.shape[0], BLOCK_R),)](s, v.contiguous(), out, s.shape[0], s.shape[1], BLOCK_R=BLOCK_R,
                                          BLOCK_C=BLOCK_C)
    return out


def check_softmax_dot(kernel) -> None:
    for n_rows, n_cols, growth in [(20, 64, 3.0), (9, 37, 2.0), (8, 16, 1.0), (5, 100, 0.0)]:
        # `growth` makes later columns larger, so the running max moves from block to block
        s = _rand(n_rows, n_cols, seed=n_cols) * (1 + growth * torch.linspace(0, 1, n_cols))
        v = _rand(n_cols, seed=n_rows)
        expected = torch.softmax(s.double(), -1) @ v.double()
        got = run_softmax_dot(kernel, s, v)
        assert_rows_close(got[:, None], expected[:, None], atol=1e-5, rtol=1e-5, block_rows=BLOCK_R,
                          name=f"out ({n_rows} rows x {n_cols} columns)")
