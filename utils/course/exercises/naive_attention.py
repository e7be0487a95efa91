"""Checks for notebook 01's exercises that the course's own attention functions could otherwise answer."""
from __future__ import annotations

import math

import torch

from utils.course.exercises import assert_rows_close
from utils.course.exercises.online_softmax import run_without
from utils.course.exercises.refuse import refusing

_FUSED = "write the formula with torch operations, not a fused attention function"


def course_attention() -> list:
    """The course's attention functions: each one answers an exercise that asks for attention itself."""
    from utils.eager import forward as flash_pytorch, reference, softmax

    return [reference.naive_attention, reference.reference_attention, reference.sdpa_attention,
            reference.causal_mask, softmax.attention_with_lse, flash_pytorch.flash1_attention,
            flash_pytorch.flash2_attention, flash_pytorch.flash2_program]


def check_split_merge_heads(split_heads, merge_heads) -> None:
    """Exercise 1.1: split_heads(x, h) turns (B, N, h·d) into (B, h, N, d), head h holding features h·d to
    (h+1)·d - 1; merge_heads is its inverse. `MultiHeadAttention.split_heads` and `.merge_heads` are refused."""
    from utils.eager.mha import MultiHeadAttention

    gen = torch.Generator().manual_seed(11)
    for b, n, h, d in [(2, 5, 3, 4), (1, 7, 4, 2), (3, 1, 1, 6)]:
        x = torch.randn(b, n, h * d, generator=gen)
        with refusing(MultiHeadAttention.split_heads, MultiHeadAttention.merge_heads):
            heads = split_heads(x, h)
            back = merge_heads(heads)
        assert tuple(heads.shape) == (b, h, n, d), (f"split_heads on shape {tuple(x.shape)} with {h} heads gave "
                                                    f"{tuple(heads.shape)}, expected {(b, h, n, d)}")
        assert torch.equal(heads, x.view(b, n, h, d).transpose(1, 2)), "head h must hold features h*d to (h+1)*d - 1"
        assert torch.equal(back, x), "merge_heads(split_heads(x)) must give x back"


def check_causal_attention(causal_attention) -> None:
    """Exercise 1.2: bottom-right causal attention, zeros for a query that sees no key.

    The inputs are (heads, N, d) tensors. The course's attention functions (utils.eager.reference and the later
    notebooks') are refused while the learner's function runs, and so is PyTorch's fused attention."""
    # SDPA under a dispatch mode shows up as its math decomposition, whose softmax is _safe_softmax
    forbidden = {name: _FUSED for name in ("scaled_dot_product_attention", "_safe_softmax",
                                           "_scaled_dot_product_flash_attention_for_cpu")}
    gen = torch.Generator().manual_seed(12)
    for nq, nk in [(6, 6), (3, 7), (7, 3)]:
        q, k, v = (torch.randn(2, n, 16, dtype=torch.float64, generator=gen) for n in (nq, nk, nk))
        try:
            with refusing(*course_attention()):
                got, _ = run_without(causal_attention, (q, k, v), forbidden)
        except ValueError as err:
            raise AssertionError(f"on (heads, N, d) inputs your function raised '{err}': {_FUSED}") from err
        s = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(
            torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, -math.inf)
        expected = torch.softmax(s, -1).nan_to_num(0.0) @ v
        assert_rows_close(got, expected, atol=1e-9, rtol=1e-9, name=f"the output for Nq={nq}, Nk={nk}")
