"""Notebook 11's forward in Triton: notebook 05's kernel (utils/tiled/forward.py) with a sink and a sliding window.

Two changes to the lesson's kernel, and nothing else:
- the sink s_h starts each row's online softmax: m = s_h · log2(e), l = 1, acc = 0. That is the state after a
  first "key" whose logit is s_h and whose value is 0, so every later rescale carries exp(s_h − m) along in the
  denominator, and the lse comes out with the sink in it. No sink is a sink at −inf: m = −inf, l = 0, exactly
  the lesson's start;
- with a window of W keys a query at position p sees keys p − W < j ≤ p: the key loop starts at the first
  block the window of the tile's first query reaches, so a tile reads about W + BLOCK_M keys, not all of them.
  The blocks that the window's left edge crosses are masked like those crossing the diagonal.

Conventions, dtypes, head dims and the interpreter's bf16 as in utils.tiled.forward; window semantics in
utils.sinks.reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from utils import gpu
from utils.sinks.reference import check_sinks, check_window
from utils.tiled.forward import (INTERPRETER_TILES, LOG2E, Config, candidate_tiles, check_config, check_inputs,
                                 first_that_launches, pick_config)

__all__ = ["sink_attention_forward", "key_blocks", "key_tiles_read", "Config", "pick_config"]


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, lo, hi, stride_kn, stride_vn,
                   seqlen_k, causal_offset, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Fold the key blocks [lo, hi) into the running max m_i, sum l_i and output acc of one Q tile.
    MASKED=False: every query of the tile sees every key of these blocks, so the loop has no mask code."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:  # keys past the end read as 0; padded head-dim columns too
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:  # a head dim padded to BLOCK_D
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)          # (BLOCK_M, BLOCK_N), fp32
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            if WINDOW:  # the left edge: keys that slid out of the query's window
                keep = keep & (cols[None, :] > offs_m[:, None] + causal_offset - window)
            qk = tl.where(keep, qk, float("-inf"))
        # Online softmax in base 2: qk_scale = sm_scale * log2(e), so exp2 below is the softmax's exp.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_ij
        if MASKED:  # a row that has seen no key yet, and has no sink, keeps m = -inf: subtract 0, not -inf
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)                                    # rescales what came before, sink too
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def sink_fwd_kernel(Q, K, V, SINKS, O, LSE,
                    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                    heads, group, seqlen_q, seqlen_k, window, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head) against every key they see, and the head's sink.
    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Query head h reads K/V head h // group. SINKS: fp32, one
    logit per query head, -inf for none. WINDOW (needs CAUSAL): query i sees keys j > i + Nk - Nq - window."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # 64-bit (batch, head) offsets: batch * heads * seq * head_dim can pass 2^31.
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    rows = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=rows, other=0.0)

    # The sink is the softmax's first term: m = s_h in base 2 (log2 e = 1.44...), l = exp2(s_h·log2 e − m) = 1,
    # acc = 0 (it has no value). A -inf sink (none) leaves m = -inf, l = 0: the lesson's start.
    m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h) * 1.4426950408889634
    l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key blocks, left to right: [n_lo, n_mid) cross the window's left edge (masked); [n_mid, n_full) are seen
    # by every query of the tile (no masks); [n_full, n_end) cross the diagonal or hold the ragged end (masked).
    # Blocks before n_lo have slid out of every query's window, keys from n_end on are in their future: neither
    # is read. key_blocks() below is this arithmetic in Python.
    causal_offset = seqlen_k - seqlen_q          # bottom-right: query i sees keys j <= i + causal_offset
    if CAUSAL:
        n_full = tl.maximum(start_m + causal_offset + 1, 0)                             # the first query's keys
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)  # the last query's
    else:
        n_full = seqlen_k
        n_end = seqlen_k
    n_full = (n_full // BLOCK_N) * BLOCK_N
    if WINDOW:
        # The first query's window starts at its position - window + 1: the loop starts at that key's block.
        # Keys from the last query's window start on are in every query's window (left of the diagonal).
        n_lo = tl.maximum(start_m + causal_offset - window + 1, 0) // BLOCK_N * BLOCK_N
        n_mid = tl.maximum(start_m + BLOCK_M + causal_offset - window, 0)
        n_mid = tl.minimum((n_mid + BLOCK_N - 1) // BLOCK_N * BLOCK_N, n_full)
    else:
        n_lo = 0
        n_mid = 0
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, n_lo, n_mid,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, window, qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, WINDOW, DOT_PRECISION)
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, n_mid, n_full,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, window, qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, WINDOW, DOT_PRECISION)
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, n_full, n_end,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, window, qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, WINDOW, DOT_PRECISION)

    # Rows that saw no key and have no sink have l = 0: output 0 and lse = -inf, never 0/0. With a sink l >= 1:
    # a row that saw no key gets acc = 0 and lse = s_h.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)   # ln 2: natural log
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
             mask=rows)


def key_blocks(start_m: int, *, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, causal: bool = False,
               window: int | None = None) -> tuple[int, int, int, int]:
    """(n_lo, n_mid, n_full, n_end): the key ranges the forward kernel's Q tile starting at query `start_m`
    loops over, the same arithmetic as in `sink_fwd_kernel`: masked [n_lo, n_mid), unmasked [n_mid, n_full),
    masked [n_full, n_end). Keys before n_lo and from n_end on are never read."""
    offset = seqlen_k - seqlen_q
    if causal:
        n_full = max(start_m + offset + 1, 0)
        n_end = min(max(start_m + block_m + offset, 0), seqlen_k)
    else:
        n_full = n_end = seqlen_k
    n_full = n_full // block_n * block_n
    if window is None:
        return 0, 0, n_full, n_end
    n_lo = max(start_m + offset - window + 1, 0) // block_n * block_n
    n_mid = min(-(-max(start_m + block_m + offset - window, 0) // block_n) * block_n, n_full)
    return n_lo, n_mid, n_full, n_end


def key_tiles_read(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window: int | None = None,
                   config: Config = INTERPRETER_TILES) -> int:
    """How many (Q tile, key block) pairs the forward kernel visits for one (batch, head): about
    (Nq / BLOCK_M) · (window + BLOCK_M) / BLOCK_N with a window, against (Nq / BLOCK_M) · Nk / BLOCK_N without."""
    window = check_window(window, causal)
    total = 0
    for start_m in range(0, seqlen_q, config.block_m):
        n_lo, _, _, n_end = key_blocks(start_m, block_m=config.block_m, block_n=config.block_n, seqlen_q=seqlen_q,
                                       seqlen_k=seqlen_k, causal=causal, window=window)
        total += max(-(-(n_end - n_lo) // config.block_n), 0)
    return total


def sink_attention_forward(q, k, v, sinks=None, *, causal=False, window=None, sm_scale=None, config=None):
    """(o, lse): o shaped and typed like q (contiguous); lse the natural-log log-sum-exp of each query's scaled
    scores and its head's sink, fp32, (batch, heads, seqlen_q); -inf where a query sees no key and there is no
    sink. sinks: None or one logit per query head, (heads,), any float dtype. window: None (no left limit) or
    the number of most recent keys each query sees; needs causal=True. `config`: tiles (None: pick_config)."""
    (b, h, hk, nq, nk, d), scale = check_inputs(q, k, v, causal, sm_scale)
    sinks = check_sinks(sinks, q)
    window = check_window(window, causal)
    if config is None and q.is_cuda:   # as utils.tiled.forward: the first tiles Triton can launch here
        return first_that_launches(lambda tiles: sink_attention_forward(q, k, v, sinks, causal=causal, window=window,
                                                                        sm_scale=scale, config=tiles),
                                   candidate_tiles(d, q.dtype, gpu.shared_memory_per_block(q.device)))
    config = check_config(INTERPRETER_TILES if config is None else config)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        o, lse = sink_attention_forward(q.float(), k.float(), v.float(), sinks, causal=causal, window=window,
                                        sm_scale=scale, config=config)
        return o.to(torch.bfloat16), lse
    # The kernel reads fp32 sinks, one per query head; no sink is a sink at -inf (it adds exp(-inf) = 0).
    sinks = (torch.full((h,), float("-inf"), device=q.device) if sinks is None
             else sinks.detach().to(torch.float32).contiguous())
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(nq, config.block_m), b * h)
    sink_fwd_kernel[grid](q, k, v, sinks, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                          h, h // hk, nq, nk, 0 if window is None else window, scale * LOG2E,
                          HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=causal, WINDOW=window is not None,
                          DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                          num_warps=config.num_warps, num_stages=config.num_stages)
    return o, lse
