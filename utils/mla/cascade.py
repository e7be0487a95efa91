"""Cascade decoding: a batch of sequences that share a prefix (a system prompt, the branches of one beam or
one sampled prompt) keep one copy of the prefix's latent cache and their own suffixes (notebook 11).

Attention over [prefix, suffix_b] is split in two, as split-KV splits a cache (notebook 08):

- the prefix, attended ONCE for the whole batch: every (sequence, head, new token) is a row of one problem whose
  cache is the prefix, so a tile of the prefix is loaded once per block of rows instead of once per sequence.
  No mask: the new tokens come after the whole prefix;
- each suffix, attended alone by `mla_decode`, causal among the new tokens at its end;
- the two normalised results merged by their log-sum-exps (`merge_two`).

Decoding each sequence alone reads the prefix B times; the cascade reads it once (`cascade_traffic`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from utils.decoding.split_kv import check_seqlens
from utils.mla.decode import _check_num_splits, _decode, check_mla_inputs, decode_layout
from utils.mla.reference import DEEPSEEK_SM_SCALE, check_mla_scale


def merge_two(o1, lse1, o2, lse2):
    """Merge two normalised attention results over disjoint sets of keys: o = (e^lse1 o1 + e^lse2 o2) /
    (e^lse1 + e^lse2), lse = log(e^lse1 + e^lse2). Computed relative to max(lse1, lse2), so no exp overflows;
    a side with lse = -inf (no key seen) weighs nothing, and both sides empty give o = 0, lse = -inf."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(m == float("-inf"), 0.0, m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    total_safe = torch.where(total == 0.0, 1.0, total)
    o = (w1[..., None] * o1.float() + w2[..., None] * o2.float()) / total_safe[..., None]
    lse = torch.where(total == 0.0, float("-inf"), m + torch.log(total_safe))
    return o, lse


def _check_prefix(prefix_c, prefix_k_rope, latent: int, rope: int, like: torch.Tensor) -> int:
    """Validate the shared prefix (P, r) and (P, d_rope) against the queries; returns P."""
    for name, t, width in (("prefix_c", prefix_c, latent), ("prefix_k_rope", prefix_k_rope, rope)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] != width:
            raise ValueError(f"{name} must have shape (prefix length >= 1, {width}), got {tuple(t.shape)}")
        if t.dtype != like.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q_latent has {like.dtype}; they must match")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device} but q_latent is on {like.device}; they must match")
    if prefix_k_rope.shape[0] != prefix_c.shape[0]:
        raise ValueError(f"prefix_k_rope has {prefix_k_rope.shape[0]} entries but prefix_c has {prefix_c.shape[0]}")
    return prefix_c.shape[0]


def cascade_decode(q_latent, q_rope, prefix_c, prefix_k_rope, suffix_c, suffix_k_rope, suffix_seqlens, *,
                   sm_scale=DEEPSEEK_SM_SCALE, num_splits=None):
    """MLA decoding of B sequences whose caches are a shared prefix followed by each one's own suffix.

    - q_latent (B, H, Nq, r), q_rope (B, H, Nq, d_rope): the absorbed queries of the Nq new tokens;
    - prefix_c (P, r), prefix_k_rope (P, d_rope): ONE copy of the shared prefix's cache;
    - suffix_c (B, Ns, r), suffix_k_rope (B, Ns, d_rope), suffix_seqlens (B,): each sequence's own entries after
      the prefix, the Nq new tokens last, so at least Nq of them (suffix_seqlens None: all Ns);
    - sm_scale, num_splits: as in `mla_decode` (num_splits applies to both passes).
    Returns (o_latent (B, H, Nq, r), lse (B, H, Nq)): the attention of sequence b over [prefix, its suffix].
    """
    batch, heads, n_q, n_s, latent, rope = check_mla_inputs(
        q_latent, q_rope, suffix_c, suffix_k_rope, names=("q_latent", "q_rope", "suffix_c", "suffix_k_rope"))
    _check_prefix(prefix_c, prefix_k_rope, latent, rope, q_latent)
    scale = check_mla_scale(sm_scale)
    num_splits = _check_num_splits(num_splits)
    lengths = check_seqlens(suffix_seqlens, batch, n_s, q_latent.device, name="suffix_seqlens", at_least=n_q,
                            like="q_latent")

    # The prefix: one problem of batch 1 whose B·H·Nq rows are every sequence's heads and new tokens. Nq = 1 in
    # it: each row sees the whole prefix (the causal rule of `mla_decode` would hide its end from early tokens).
    rows = batch * heads * n_q
    prefix_len = torch.full((1,), prefix_c.shape[0], dtype=torch.int32, device=q_latent.device)
    o_pre, lse_pre = _decode(q_latent.reshape(1, rows, 1, latent), q_rope.reshape(1, rows, 1, rope),
                             prefix_c[None], prefix_k_rope[None], prefix_len, scale=scale, num_splits=num_splits)
    o_pre, lse_pre = o_pre.view(batch, heads, n_q, latent), lse_pre.view(batch, heads, n_q)

    o_suf, lse_suf = _decode(q_latent, q_rope, suffix_c, suffix_k_rope, lengths, scale=scale, num_splits=num_splits)
    o, lse = merge_two(o_pre, lse_pre, o_suf, lse_suf)
    return o.to(q_latent.dtype), lse


class CascadeTraffic(NamedTuple):
    """Cache bytes a decoding step reads, with a shared prefix kept once (cascade) or attended per sequence."""
    prefix_bytes: int      # one copy of the prefix's cache, P · (r + d_rope) · itemsize
    cascade_bytes: int     # the cascade: the prefix once, and every suffix
    separate_bytes: int    # each sequence decoded alone over [prefix, suffix]: the prefix B times, every suffix
    prefix_passes: int     # programs' passes over the prefix in the cascade: Q tiles of B·H·Nq rows
    separate_passes: int   # and decoding each sequence alone: B × its Q tiles of H·Nq rows


def cascade_traffic(batch: int, heads: int, n_q: int, prefix_len: int, suffix_lens, latent_dim: int,
                    rope_dim: int, itemsize: int) -> CascadeTraffic:
    """The cache traffic of `cascade_decode` against decoding each sequence alone (pure Python).

    Bytes: each cache entry read once; the queries and outputs are the same both ways and left out. Passes: each
    Q tile of the kernel reads its whole cache, so the cascade's prefix is read from memory once per Q tile of
    (sequence, head, new token) rows; tiles of one slice run side by side (`mla_decode`'s grid puts them next
    to each other), so after the first the prefix mostly comes from L2.
    """
    suffix_lens = [int(s) for s in suffix_lens]
    if len(suffix_lens) != batch:
        raise ValueError(f"suffix_lens must have one length per sequence ({batch}), got {len(suffix_lens)}")
    per_entry = (latent_dim + rope_dim) * itemsize
    prefix = prefix_len * per_entry
    suffixes = sum(suffix_lens) * per_entry
    stacked = decode_layout(1, batch * heads * n_q, 1, prefix_len, latent_dim, num_splits=1)
    alone = decode_layout(1, heads, n_q, prefix_len, latent_dim, num_splits=1)
    return CascadeTraffic(prefix, prefix + suffixes, batch * prefix + suffixes, stacked.row_blocks,
                          batch * alone.row_blocks)
