"""The split-KV kernel of notebook 08, one path per kernel: what the lesson prints before the library's kernel.

`split_kv_contiguous` reads a contiguous cache (B, Hkv, N, D); `split_kv_paged` is the same kernel reading a paged
one (utils/decoding/paged_kv.py): the only change is one block-table look-up per key tile. Both are the core of
`utils.decoding.split_kv._split_kv_kernel`, which serves both caches from one kernel (a `tl.constexpr` switch),
and adds what a server needs: strides for any layout, head dims that are not powers of two, exact fp32 products,
and NaN rows instead of reads outside the cache when a length or page id is out of range. The launchers here,
`decode_contiguous` and `decode_paged`, validate like `flash_decode` and check the kernels against it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from utils.checks import check_attention_inputs, resolve_scale
from utils.decoding.split_kv import (DTYPES, LOG2E, MAX_SPLITS, _check_block_table, _check_launchable,
                                     _check_paged_inputs, _check_seqlens, merge_partials)
from utils.triton_utils import cdiv


@triton.jit
def split_kv_contiguous(Q, K, V, O, LSE, SEQLENS,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sos, slb, slh, sln, sls,
                        kv_heads, group, n_q, qk_scale,
                        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (batch, KV head, split, block of query rows): the online softmax over this split's slice
    of a contiguous cache; writes the slice's normalised output and its natural-log lse (-inf: no key seen)."""
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

    # This split's slice of this sequence's cache: the same whole number of BLOCK_N tiles for every split.
    seqlen = tl.load(SEQLENS + b)
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), num_splits)
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen)

    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqn + d[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :] * skn + d[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale                       # base 2: qk_scale holds log2(e)
        visible = col_ok[None, :]
        if CAUSAL:  # new token i sees cache entries j <= i + L - n_q (bottom-right)
            visible = visible & (cols[None, :] <= i[:, None] + seqlen - n_q)
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


@triton.jit
def split_kv_paged(Q, K, V, O, LSE, SEQLENS, BLOCK_TABLE,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sos, slb, slh, sln, sls, stb,
                   kv_heads, group, n_q, qk_scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr):
    """One program per (batch, KV head, split, block of query rows): the online softmax over this split's slice
    of a paged cache; writes the slice's normalised output and its natural-log lse (-inf: no key seen)."""
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

    # This split's slice of this sequence's cache: the same whole number of BLOCK_N tiles for every split.
    seqlen = tl.load(SEQLENS + b)
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), num_splits)
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen)

    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqn + d[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = K + hk * skh                                 # K, V: pools (pages, Hkv, PAGE_SIZE, D)
    v_base = V + hk * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        # BLOCK_N divides PAGE_SIZE, so the whole tile lies in one page: one look-up (int64: page * stride is large)
        page = tl.load(BLOCK_TABLE + b * stb + start // PAGE_SIZE).to(tl.int64)
        in_page = cols % PAGE_SIZE
        k = tl.load(k_base + page * skb + in_page[None, :] * skn + d[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale                       # base 2: qk_scale holds log2(e)
        visible = col_ok[None, :]
        if CAUSAL:  # new token i sees cache entries j <= i + L - n_q (bottom-right)
            visible = visible & (cols[None, :] <= i[:, None] + seqlen - n_q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet: keep p = 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + page * svb + in_page[:, None] * svn + d[None, :], mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    l_safe = tl.where(l == 0.0, 1.0, l)   # rows that saw no key in this slice: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + b * sob + h[:, None] * soh + i[:, None] * son + split * sos + d[None, :], o, mask=row_ok[:, None])
    tl.store(LSE + b * slb + h * slh + i * sln + split * sls, lse, mask=row_ok)


def _num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return num_splits


def _head_dim(head_dim: int) -> int:
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128 for these kernels (tl.dot, no padding), got {head_dim}")
    return head_dim


def _launch(kernel, q, k, v, seqlens, extra, strides_extra, *, kv_heads, scale, causal, num_splits, block_n,
            constexprs):
    """Launch one of the kernels over (B·Hkv, splits, row blocks) into fp32 partials, then merge them."""
    b, h, nq, d = q.shape
    group = h // kv_heads
    block_m = min(64, max(16, triton.next_power_of_2(group * nq)))
    o_parts = torch.empty(b, h, nq, num_splits, d, device=q.device, dtype=torch.float32)
    lse_parts = torch.empty(b, h, nq, num_splits, device=q.device, dtype=torch.float32)
    grid = (b * kv_heads, num_splits, cdiv(group * nq, block_m))
    kernel[grid](q, k, v, o_parts, lse_parts, seqlens, *extra,
                 *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_parts.stride()[:4], *lse_parts.stride()[:4],
                 *strides_extra, kv_heads, group, nq, scale * LOG2E,
                 CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, **constexprs)
    return merge_partials(o_parts, lse_parts, out_dtype=q.dtype)


def decode_contiguous(q, k_cache, v_cache, *, cache_seqlens=None, causal=False, num_splits=2, sm_scale=None,
                      block_n=32):
    """`flash_decode` through `split_kv_contiguous`: q (B, H, Nq, D) against a cache (B, Hkv, N, D); returns
    (o, lse). For the lesson and tests; the head dim a power of two from 16 to 128; fp16/fp32 (bf16 too on a GPU)."""
    shape = check_attention_inputs(q, k_cache, v_cache, causal=causal, dtypes=DTYPES)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_launchable(t, name)
    _head_dim(shape.head_dim)
    seqlens = _check_seqlens(cache_seqlens, shape.batch, shape.seqlen_k, q.device)
    if seqlens is None:
        seqlens = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device=q.device)
    q, k_cache, v_cache = (t.contiguous() for t in (q, k_cache, v_cache))   # the kernel takes the head dim dense
    return _launch(split_kv_contiguous, q, k_cache, v_cache, seqlens, (), (), kv_heads=shape.kv_heads,
                   scale=resolve_scale(sm_scale, shape.head_dim), causal=causal, num_splits=_num_splits(num_splits),
                   block_n=block_n, constexprs={})


def decode_paged(q, k_pages, v_pages, block_table, cache_seqlens, *, causal=False, num_splits=2, sm_scale=None,
                 block_n=32):
    """`flash_decode_paged` through `split_kv_paged`: pools (pages, Hkv, page_size, D), a block table
    (B, pages per sequence) int32 and the lengths; returns (o, lse). The tile is cut to fit in one page."""
    num_pages, kv_heads, page_size = _check_paged_inputs(q, k_pages, v_pages, causal=causal)
    _head_dim(q.shape[3])
    seqlens = _check_block_table(block_table, cache_seqlens, num_pages, page_size, q.shape[0], q.device)
    q, k_pages, v_pages, table = (t.contiguous() for t in (q, k_pages, v_pages, block_table))
    return _launch(split_kv_paged, q, k_pages, v_pages, seqlens, (table,), (table.stride(0),), kv_heads=kv_heads, scale=resolve_scale(sm_scale, q.shape[3]),
                   causal=causal, num_splits=_num_splits(num_splits), block_n=min(block_n, page_size),
                   constexprs={"PAGE_SIZE": page_size})
