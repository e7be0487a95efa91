"""Checks for notebook 01's exercises that the course's own attention functions could otherwise answer."""
from __future__ import annotations

import math

import torch

from utils.exercises import assert_rows_close
from utils.exercises.online_softmax import run_without

_FUSED = "write the formula with torch operations, not a fused attention function"


def check_causal_attention(causal_attention) -> None:
    """Exercise 1.2: bottom-right causal attention, zeros for a query that sees no key.

    The inputs are (heads, N, d) tensors: plain torch operations handle them, while the course's attention
    functions (utils.reference) insist on (batch, heads, N, d), and PyTorch's fused attention is refused."""
    # SDPA under a dispatch mode shows up as its math decomposition, whose softmax is _safe_softmax
    forbidden = {name: _FUSED for name in ("scaled_dot_product_attention", "_safe_softmax",
                                           "_scaled_dot_product_flash_attention_for_cpu")}
    gen = torch.Generator().manual_seed(12)
    for nq, nk in [(6, 6), (3, 7), (7, 3)]:
        q, k, v = (torch.randn(2, n, 16, dtype=torch.float64, generator=gen) for n in (nq, nk, nk))
        try:
            got, _ = run_without(causal_attention, (q, k, v), forbidden)
        except ValueError as err:
            raise AssertionError(f"on (heads, N, d) inputs your function raised '{err}': {_FUSED}") from err
        s = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(
            torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, -math.inf)
        expected = torch.softmax(s, -1).nan_to_num(0.0) @ v
        assert_rows_close(got, expected, atol=1e-9, rtol=1e-9, name=f"the output for Nq={nq}, Nk={nk}")
