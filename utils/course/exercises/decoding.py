"""Checks of notebook 08's merge exercises: the log-sum-exp merge of split-KV partials, in PyTorch (8.2) and
inside a Triton kernel (8.3).

The learner's `merge_splits` (8.2) takes S normalised partial outputs and their log-sum-exps per (batch, head,
query) row and returns the merged output and log-sum-exp; `merge_kernel` (8.3) does the same in one program per
row. The checks build the partials themselves, in float64, from a decode problem with ragged cache lengths (one
of them empty), GQA, a causal mask over the new tokens and large logits, and compare with attention over all
keys computed here from scratch.
"""
from __future__ import annotations

import math

import torch

from utils.course.exercises import assert_rows_close

FP32_EXP_LIMIT = 88.7   # exp(x) overflows float32 above this


def split_bounds(seqlen: int, block_n: int, num_splits: int) -> list[tuple[int, int]]:
    """The key range of each split, as flash-decoding cuts it: the same whole number of tiles per split."""
    per_split = math.ceil(math.ceil(seqlen / block_n) / num_splits) * block_n
    return [(min(s * per_split, seqlen), min((s + 1) * per_split, seqlen)) for s in range(num_splits)]


def _attend(q, k, v, visible):
    """(out, lse) of q against the visible keys, float64; rows that see nothing: out NaN, lse -inf."""
    s = (q @ k.transpose(-2, -1)).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def decode_partials(*, seqlens=(65, 23, 0), heads=4, kv_heads=2, new_tokens=2, head_dim=32, num_splits=5,
                    block_n=16, seed=0):
    """A float64 decode problem cut into splits: (o_parts (B, H, Nq, S, d), lse_parts (B, H, Nq, S), o, lse).

    Causal over the new tokens (token i sees cache entries j <= i + L - Nq: with L = 65 the last split holds
    key 64 only, which token 0 does not see); the short sequence leaves splits with no key at all; head 1's queries are scaled so that
    its log-sum-exps pass fp32's exp limit. A split with no visible key has lse -inf and an output of NaN,
    like memory nobody wrote: the merge must give it no weight at all. A sequence of length 0 merges to o = 0,
    lse = -inf.
    """
    gen = torch.Generator().manual_seed(seed)
    b, n = len(seqlens), max(seqlens)
    q = torch.randn(b, heads, new_tokens, head_dim, generator=gen, dtype=torch.float64) / math.sqrt(head_dim)
    q[:, 1] *= 80.0
    k, v = (torch.randn(b, kv_heads, n, head_dim, generator=gen, dtype=torch.float64).repeat_interleave(
        heads // kv_heads, dim=1) for _ in range(2))
    o_parts = torch.empty(b, heads, new_tokens, num_splits, head_dim, dtype=torch.float64)
    lse_parts = torch.empty(b, heads, new_tokens, num_splits, dtype=torch.float64)
    o = torch.zeros(b, heads, new_tokens, head_dim, dtype=torch.float64)
    lse = torch.empty(b, heads, new_tokens, dtype=torch.float64)
    for i, length in enumerate(seqlens):
        cols = torch.arange(n)
        causal = cols[None, :] <= torch.arange(new_tokens)[:, None] + length - new_tokens
        for s, (lo, hi) in enumerate(split_bounds(length, block_n, num_splits)):
            in_split = causal & (cols[None, :] >= lo) & (cols[None, :] < hi)
            o_parts[i, :, :, s], lse_parts[i, :, :, s] = _attend(q[i], k[i], v[i], in_split)
        full, lse[i] = _attend(q[i], k[i], v[i], causal & (cols[None, :] < length))
        o[i] = full.nan_to_num(0.0)
    return o_parts, lse_parts, o, lse


def run_merge_kernel(kernel, o_parts, lse_parts, *, device="cpu"):
    """Launch a learner's `merge_kernel` on fp32 copies (contiguous, one program per row); returns (o, lse)."""
    *lead, splits, d = o_parts.shape
    rows = math.prod(lead)
    parts = o_parts.float().reshape(rows, splits, d).contiguous().to(device)
    lses = lse_parts.float().reshape(rows, splits).contiguous().to(device)
    o = torch.zeros(rows, d, device=device)
    lse = torch.zeros(rows, device=device)
    kernel[(rows,)](parts, lses, o, lse, splits, HEAD_DIM=d, BLOCK_S=max(2, 1 << (splits - 1).bit_length()))
    return o.reshape(*lead, d).cpu(), lse.reshape(lead).cpu()


def _assert_merged(o, lse, lse_parts, o_ref, lse_ref, tol_o, tol_lse) -> None:
    """Assert that the merged (o, lse) match the reference; the message names the wrong (batch, head) query rows
    and what their splits have in common (an empty split, log-sum-exps beyond fp32's exp range)."""
    empty = (lse_parts == -math.inf).any(-1)
    large = lse_parts.max(-1).values > FP32_EXP_LIMIT
    for got, expected, name, tol in ((o, o_ref, "merged o", tol_o), (lse[..., None], lse_ref[..., None],
                                                                    "merged lse", tol_lse)):
        try:
            assert_rows_close(got, expected, atol=tol, rtol=tol, name=name)
        except AssertionError as err:
            bad = ~torch.isclose(got.double(), expected, atol=tol, rtol=tol).all(-1) | ~torch.isfinite(got).all(-1)
            notes = [f"{int((bad & empty).sum())} of the {int(empty.sum())} rows with an empty split (lse = -inf)",
                     f"{int((bad & large).sum())} of the {int(large.sum())} rows whose lse passes {FP32_EXP_LIMIT} "
                     "(exp overflows fp32)", f"{int((bad & ~empty & ~large).sum())} other rows"]
            raise AssertionError(f"{err}\n  wrong: " + "; ".join(notes)) from None


def check_merge_splits(merge_splits) -> None:
    """Assert that `merge_splits(o_parts, lse_parts)` (exercise 8.2) returns the merged (o, lse). The partials
    are `decode_partials`': an empty split's output is NaN and must get no weight (0 · NaN is NaN), and a
    sequence with no key must merge to o = 0, lse = -inf."""
    if not callable(merge_splits):
        raise TypeError(f"merge_splits must be a function, got {type(merge_splits).__name__}")
    o_parts, lse_parts, o_ref, lse_ref = decode_partials()
    got = merge_splits(o_parts.clone(), lse_parts.clone())
    assert isinstance(got, tuple) and len(got) == 2, "merge_splits must return a tuple (o, lse)"
    o, lse = got
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor), "o and lse must be tensors"
    _assert_merged(o, lse, lse_parts, o_ref, lse_ref, 1e-8, 1e-8)


def check_merge_kernel(kernel, *, device="cpu") -> None:
    """Assert that `kernel` merges split-KV partials; the message names the wrong (batch, head) query rows and
    what their splits have in common (an empty split, log-sum-exps beyond fp32's exp range)."""
    o_parts, lse_parts, o_ref, lse_ref = decode_partials()
    o, lse = run_merge_kernel(kernel, o_parts, lse_parts, device=device)
    _assert_merged(o, lse, lse_parts, o_ref, lse_ref, 1e-4, 1e-5)
