"""Split-KV decoding with a sink and a sliding window (notebook 11): notebook 08's kernel with two changes.

`split_kv_window` is `split_kv_contiguous` (utils/decoding/single_path.py) with the window added, and nothing else:
- the n_q new tokens sit last: new token i is at position p = i + L − n_q of its sequence of L entries and sees
  entries p − W < j ≤ p (utils/sinks/reference.py). The first token sees the earliest, from L − n_q − W + 1 on,
  so the visible range is [max(0, L − n_q − W + 1), L), at most W + n_q − 1 entries however long the cache is;
- the splits divide that range, not the whole cache: the first key tile starts at the window's first entry,
  rounded down to a tile, and no program reads a tile before it. Decoding is always causal here (bottom-right).

The sink is not in the kernel: it joins once, in the merge (`sink_decode` says why). `decode_traffic` counts the
FLOPs and bytes of one step with and without a window.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils.checks import check_attention_inputs, positive_int, resolve_scale
from utils.decoding.single_path import _head_dim
from utils.decoding.split_kv import (DTYPES, LOG2E, MAX_SPLITS, _check_launchable, check_seqlens,
                                     choose_num_splits, default_num_sms, merge_partials)
from utils.sinks.reference import check_sinks, check_window
from utils.triton_utils import cdiv

__all__ = ["split_kv_window", "sink_decode", "decode_traffic", "DecodeTraffic"]


@triton.jit
def split_kv_window(Q, K, V, O, LSE, SEQLENS,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sos, slb, slh, sln, sls,
                    kv_heads, group, n_q, window, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (batch, KV head, split, block of query rows): the online softmax over this split's slice
    of the keys the new tokens see in a contiguous cache; writes the slice's normalised output and its
    natural-log lse (-inf: no key seen). No window is a window as long as the cache."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    num_splits = tl.num_programs(1)
    b = (pid_bh // kv_heads).to(tl.int64)   # int64: b * stride passes 2**31 elements in a large cache
    hk = (pid_bh % kv_heads).to(tl.int64)

    # Rows of the Q tile: (query head of this KV head's group, new token) pairs, so K/V tiles are read once.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * n_q
    h = hk * group + rows // n_q
    i = rows % n_q
    d = tl.arange(0, HEAD_DIM)

    # This split's slice of the visible keys [first, seqlen): the same whole number of BLOCK_N tiles for every
    # split, counted from the tile that holds `first`. New token 0, at position seqlen - n_q, sees the earliest.
    seqlen = tl.load(SEQLENS + b)
    first = tl.maximum(seqlen - n_q - window + 1, 0)
    tile0 = first // BLOCK_N * BLOCK_N
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen - tile0, BLOCK_N), num_splits)
    lo = tile0 + split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen)

    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqn + d[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = (cols >= first) & (cols < hi)            # the first tile's entries before the window: not loaded
        k = tl.load(k_base + cols[None, :] * skn + d[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale                       # base 2: qk_scale holds log2(e)
        # new token i, at position p = i + L - n_q, sees cache entries p - window < j <= p (bottom-right)
        pos = i[:, None] + seqlen - n_q
        visible = col_ok[None, :] & (cols[None, :] <= pos) & (cols[None, :] > pos - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet: keep p = 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn + d[None, :], mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    l_safe = tl.where(l == 0.0, 1.0, l)   # rows that saw no key in this slice: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + b * sob + h[:, None] * soh + i[:, None] * son + split * sos + d[None, :], o, mask=row_ok[:, None])
    tl.store(LSE + b * slb + h * slh + i * sln + split * sls, lse, mask=row_ok)


def _splits(num_splits, programs: int, span: int, block_n: int, device) -> int:
    if num_splits is None:   # about two waves of programs over the visible span, as flash_decode chooses
        return choose_num_splits(programs, span, block_n, default_num_sms(device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return num_splits


def sink_decode(q, k_cache, v_cache, sinks=None, *, seqlens=None, window=None, sm_scale=None, num_splits=None,
                block_n=32):
    """(o, lse): attention of n_q new tokens q (B, H, n_q, D) against a cache (B, Hkv, N, D), with a sink and a
    sliding window, split over the keys each sequence's new tokens see.

    - sinks: None or one logit per query head, (H,); lse includes it (utils/sinks/reference.py);
    - seqlens: (B,) ints, the valid entries of each cache, the new tokens last (None: all N);
    - window: None (no left limit) or W, new token i at position p = i + L − n_q sees entries p − W < j ≤ p;
    - num_splits: slices of the visible range per sequence (None: `choose_num_splits` over that range);
    - block_n: keys per tile, a power of two of at least 16.
    o has q's dtype; lse is fp32, natural log, (B, H, n_q): -inf where a row sees no key and there is no sink.
    Head dims 16, 32, 64 or 128; fp16, bf16, fp32 (fp32 multiplies in TF32 on a GPU, as notebook 08's kernel).
    On the CPU (the interpreter has no bf16 arithmetic) bf16 is computed in fp32 and o rounded to bf16.
    """
    shape = check_attention_inputs(q, k_cache, v_cache, causal=True, dtypes=DTYPES)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_launchable(t, name)
    _head_dim(shape.head_dim)
    sinks = check_sinks(sinks, q)
    window = check_window(window, True)
    scale = resolve_scale(sm_scale, shape.head_dim)
    if positive_int("block_n", block_n) < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least 16 (tl.dot), got {block_n}")
    lengths = check_seqlens(seqlens, shape.batch, shape.seqlen_k, q.device)

    b, h, nq, d = q.shape
    group = h // shape.kv_heads
    # A window as long as the cache reaches its first entry from every position: the same as none, so one path.
    window = shape.seqlen_k if window is None else min(window, shape.seqlen_k)
    block_m = min(64, max(16, triton.next_power_of_2(group * nq)))
    row_blocks = cdiv(group * nq, block_m)
    span = min(shape.seqlen_k, window + nq - 1 + block_n)   # the visible range's tiles, one more for its start
    num_splits = _splits(num_splits, b * shape.kv_heads * row_blocks, span, block_n, q.device)

    out_dtype = q.dtype
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    q, k_cache, v_cache = (t.contiguous() for t in (q, k_cache, v_cache))   # the kernel takes the head dim dense

    # The sink joins once, in the merge, as one more partial. Each split's partial output is normalised by its
    # own keys alone, and the merge weighs it by exp(lse_split). Were the sink folded into every split's start,
    # as the forward kernel folds it into its one pass, the merged denominator would hold exp(s_h) once per
    # split. As a partial with output 0 (the sink has no value) and lse s_h (its one term, exp(s_h)), the course's
    # `merge_partials` adds it to the denominator exactly once. No sink is a sink at -inf: a partial of weight 0.
    o_parts = torch.empty(b, h, nq, num_splits + 1, d, device=q.device, dtype=torch.float32)
    lse_parts = torch.empty(b, h, nq, num_splits + 1, device=q.device, dtype=torch.float32)
    o_parts[..., num_splits, :] = 0.0
    lse_parts[..., num_splits] = (float("-inf") if sinks is None
                                  else sinks.detach().to(torch.float32)[None, :, None])
    grid = (b * shape.kv_heads, num_splits, row_blocks)
    split_kv_window[grid](q, k_cache, v_cache, o_parts, lse_parts, lengths,
                          *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_parts.stride()[:4],
                          *lse_parts.stride()[:4], shape.kv_heads, group, nq, window, scale * LOG2E,
                          BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    o, lse = merge_partials(o_parts, lse_parts, out_dtype=q.dtype)
    return o.to(out_dtype), lse   # .to: a no-op except for bf16 on the CPU


class DecodeTraffic(NamedTuple):
    """What one decoding step of one attention layer computes and moves (counts, not measurements)."""
    keys: int    # cache entries each (sequence, KV head) reads: min(L, W + n_q − 1) with a window, L without
    flops: int   # 4 · batch · heads · n_q · keys · head_dim: Q·K^T and P·V, a multiply-add counted as 2
    bytes: int   # K and V entries read once per KV head (GQA shares them), plus q read and o written


def decode_traffic(batch: int, heads: int, kv_heads: int, seqlen: int, head_dim: int, *, window=None, n_q: int = 1,
                   dtype_bytes: int = 2) -> DecodeTraffic:
    """The FLOPs and bytes of one decoding step of `sink_decode` (pure Python): `batch` sequences of `seqlen`
    cache entries each, `n_q` new tokens, with a `window` or without (None).

    Keys are the visible range [max(0, L − n_q − W + 1), L): the entries the kernel loads. FLOPs count the two
    matrix products over those keys for every (head, new token) row, masked entries included; the softmax's
    exps, the merge and the sink are left out. Bytes count each K/V entry once per KV head, q read and o written,
    at `dtype_bytes` each; the fp32 partials of the splits and the lengths are left out (a few bytes per row).
    """
    for name, x in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("seqlen", seqlen),
                    ("head_dim", head_dim), ("n_q", n_q), ("dtype_bytes", dtype_bytes)):
        positive_int(name, x)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    window = check_window(window, True)
    keys = seqlen if window is None else min(seqlen, window + n_q - 1)
    flops = 4 * batch * heads * n_q * keys * head_dim
    kv_bytes = 2 * batch * kv_heads * keys * head_dim * dtype_bytes
    q_o_bytes = 2 * batch * heads * n_q * head_dim * dtype_bytes
    return DecodeTraffic(keys, flops, kv_bytes + q_o_bytes)
