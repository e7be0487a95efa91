"""Notebook 11's backward in Triton: notebook 07's three kernels (utils/tiled/backward.py) with a sink and a window,
the sink's gradient, and autograd over forward and backward.

The sink changes nothing inside the kernels. P_ij = exp(x_ij − lse_i) is recomputed from the forward's lse, which
already holds the sink, so P is the sink-aware softmax. The sink's column has no value, so its dP is 0, and
D_i = Σ_k P_ik dP_ik = rowsum(dO ∘ O) is still the preprocess's sum: dS = P ∘ (dP − D) as before.

The sink's own gradient follows from the same softmax rule for its column: dS_sink,i = P_sink,i (0 − D_i), with
P_sink,i = exp(s_h − lse_i), and s_h is shared by every query of head h:

    ∂L/∂s_h = −Σ_{batch, i} exp(s_h − lse_i) · D_i

The window only moves loop bounds and adds a mask: the dK/dV kernel skips the Q blocks whose windows have left
its keys behind, the dQ kernel the K/V blocks that slid out of its queries' windows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from utils import gpu
from utils.sinks.forward import sink_attention_forward
from utils.sinks.reference import check_sinks, check_window
# The preprocess (D = rowsum(dO ∘ O), lse in base 2) and the column mask are the lesson's, unchanged.
from utils.tiled.backward import (INTERPRETER_CONFIG, LOG2E, Config, _bwd_preprocess, _column_mask,
                                  candidate_configs, check_config, check_inputs, pick_config)
from utils.tiled.forward import first_that_launches

__all__ = ["sink_attention_backward", "SinkAttention", "sink_attention", "Config", "pick_config"]


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE2, DELTA, s_qm, s_qd, s_dom, s_dod,
                offs_n, offs_d, mask_d, N_Q, offset, window, qk_scale, start, end,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK_j, dV_j over the Q blocks [start, end): the tiles are transposed (keys × queries) so that
    Pᵀ and dSᵀ come out of the dots directly."""
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N_Q
        q_t = tl.load(Q + offs_m[None, :] * s_qm + offs_d[:, None] * s_qd,
                      mask=mask_m[None, :] & mask_d[:, None], other=0.0)             # (D, M)
        lse2 = tl.load(LSE2 + offs_m, mask=mask_m, other=float("inf"))             # rows past the end: P = 0
        s_t = tl.dot(k, q_t, input_precision=PRECISION)                                  # (N, M) = (S_ij)ᵀ
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:  # causal: key j visible to query i iff j <= i + offset; a window also needs j > i + offset - W
            visible = offs_n[:, None] <= offs_m[None, :] + offset
            if WINDOW:
                visible = visible & (offs_n[:, None] > offs_m[None, :] + offset - window)
            p_t = tl.where(visible, p_t, 0.0)
        do = tl.load(DO + offs_m[:, None] * s_dom + offs_d[None, :] * s_dod,
                     mask=mask_m[:, None] & mask_d[None, :], other=0.0)              # (M, D)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)                    # dV += Pᵀ dO
        delta = tl.load(DELTA + offs_m, mask=mask_m, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                        # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])                                             # dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=PRECISION)       # dK += dSᵀ Q
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV,
              s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
              s_dob, s_doh, s_dom, s_dod, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd,
              H_KV, N_Q, N_K, window, qk_scale, sm_scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
              ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // H_KV).to(tl.int64)
    hk = (bhk % H_KV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = _column_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_nd = (offs_n[:, None] < N_K) & mask_d[None, :]
    k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd, mask=mask_nd, other=0.0)
    v = tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd, mask=mask_nd, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    offset = N_K - N_Q
    # Q blocks, top to bottom: [start, split) cross the diagonal (masked); [split, mid) see every key of this
    # block (no mask); [mid, end) are blocks whose windows' left edge crosses it (masked). Blocks from end on
    # have windows that left these keys behind: they are not read.
    if CAUSAL:
        # Queries before n0 - offset see none of these keys: start at the Q block holding that row. Blocks
        # starting before n0 + BLOCK_N - 1 - offset cross the diagonal and need the mask; the rest do not.
        start = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
        n_masked = tl.maximum(n0 + BLOCK_N - 1 - offset - start + BLOCK_M - 1, 0) // BLOCK_M
        split = tl.minimum(start + n_masked * BLOCK_M, N_Q)
    else:
        start = 0
        split = 0
    if WINDOW:
        # Query i sees key j while i < j - offset + window: every key of the block until row n0 - offset + window
        # (a whole block of them ends there), the last key until row n0 + BLOCK_N - 1 - offset + window.
        mid = tl.maximum(tl.minimum(tl.maximum(n0 - offset + window, 0) // BLOCK_M * BLOCK_M, N_Q), split)
        end = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - offset + window, 0), N_Q)
    else:
        mid = N_Q
        end = N_Q
    for g in range(GROUP):  # the query heads sharing this K/V head: their gradients add up here
        h = hk * GROUP + g
        q_ptr = Q + b * s_qb + h * s_qh
        do_ptr = DO + b * s_dob + h * s_doh
        row = (b * H_KV * GROUP + h) * N_Q
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             offs_n, offs_d, mask_d, N_Q, offset, window, qk_scale, start, split,
                             BLOCK_M, True, WINDOW, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             offs_n, offs_d, mask_d, N_Q, offset, window, qk_scale, split, mid,
                             BLOCK_M, False, WINDOW, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             offs_n, offs_d, mask_d, N_Q, offset, window, qk_scale, mid, end,
                             BLOCK_M, True, WINDOW, PRECISION)
    dk *= sm_scale
    tl.store(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dkn + offs_d[None, :] * s_dkd, dk, mask=mask_nd)
    tl.store(DV + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvn + offs_d[None, :] * s_dvd, dv, mask=mask_nd)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, s_kn, s_kd, s_vn, s_vd,
              offs_m, offs_d, mask_d, N_K, offset, window, qk_scale, start, end,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              PRECISION: tl.constexpr):
    """Accumulate dQ_i over the K/V blocks [start, end)."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_kv = (offs_n[None, :] < N_K) & mask_d[:, None]
        k_t = tl.load(K + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd, mask=mask_kv, other=0.0)  # (D, N)
        v_t = tl.load(V + offs_n[None, :] * s_vn + offs_d[:, None] * s_vd, mask=mask_kv, other=0.0)  # (D, N)
        s = tl.dot(q, k_t, input_precision=PRECISION)                                    # (M, N)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # the ragged last block, and blocks crossing the diagonal or the window's left edge
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
            if WINDOW:
                visible = visible & (offs_n[None, :] > offs_m[:, None] + offset - window)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=PRECISION)                                  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])                                                   # dS = P ∘ (dP − D)
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)         # dQ += dS K
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE2, DELTA, DQ,
            s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
            s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
            H, N_Q, N_K, window, qk_scale, sm_scale,
            GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
            ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = _column_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd, mask=mask_md, other=0.0)
    do = tl.load(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dom + offs_d[None, :] * s_dod, mask=mask_md,
                 other=0.0)
    row = bh.to(tl.int64) * N_Q
    lse2 = tl.load(LSE2 + row + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(DELTA + row + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
    offset = N_K - N_Q
    # K/V blocks, left to right, as in the forward: [lo, mid) cross the window's left edge (masked); [mid, split)
    # are seen by every query of the block (no mask); [split, end) cross the diagonal or hold the ragged end.
    if CAUSAL:
        # Keys past m0 + BLOCK_M - 1 + offset are invisible to the whole block; blocks ending at or before
        # m0 + offset + 1 are visible to every row of it and need no mask.
        end = tl.minimum(tl.maximum(m0 + BLOCK_M + offset, 0), N_K)
        split = tl.minimum(tl.maximum(m0 + offset + 1, 0) // BLOCK_N, N_K // BLOCK_N) * BLOCK_N
    else:
        end = N_K
        split = N_K // BLOCK_N * BLOCK_N
    if WINDOW:
        # The first row's window starts at key m0 + offset - window + 1, the last row's BLOCK_M - 1 keys later.
        lo = tl.maximum(m0 + offset - window + 1, 0) // BLOCK_N * BLOCK_N
        mid = tl.maximum(m0 + BLOCK_M + offset - window, 0)
        mid = tl.minimum((mid + BLOCK_N - 1) // BLOCK_N * BLOCK_N, split)
    else:
        lo = 0
        mid = 0
    k_ptr = K + b * s_kb + hk * s_kh
    v_ptr = V + b * s_vb + hk * s_vh
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, mask_d, N_K,
                   offset, window, qk_scale, lo, mid, BLOCK_N, True, CAUSAL, WINDOW, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, mask_d, N_K,
                   offset, window, qk_scale, mid, split, BLOCK_N, False, CAUSAL, WINDOW, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, mask_d, N_K,
                   offset, window, qk_scale, split, end, BLOCK_N, True, CAUSAL, WINDOW, PRECISION)
    dq *= sm_scale
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqm + offs_d[None, :] * s_dqd, dq, mask=mask_md)


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """∂L/∂s_h = −Σ_{batch, i} P_sink,i · D_i, with P_sink,i = exp(s_h − lse_i): (heads,), in sinks' dtype.

    Done in PyTorch rather than in a kernel: it is O(batch · heads · Nq) elementwise work and a sum over batch
    and queries, which a kernel would have to gather across programs (atomics, in no fixed order); PyTorch's
    reduction is deterministic and the cost is negligible beside the kernels' O(N²·d)."""
    # A row with lse = -inf (no key, and a sink of -inf) has P_sink = 0: subtract +inf there, not -inf.
    safe_lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - safe_lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def sink_attention_backward(do, q, k, v, sinks, o, lse, *, causal=False, window=None, sm_scale=None, config=None):
    """(dq, dk, dv, dsinks) from the forward's output o and natural-log lse (sink included). q, do, o:
    (B, H, Nq, D); k, v: (B, Hkv, Nk, D), their gradients summed over the query heads of a GQA group. dsinks:
    (H,) in sinks' dtype, None when sinks is None. `config`: tiles of utils.tiled.backward (None: pick_config)."""
    (b, h, hk, nq, nk, d), scale = check_inputs(do, q, k, v, o, lse, causal, sm_scale)
    sinks = check_sinks(sinks, q)
    window = check_window(window, causal)
    if config is None and q.is_cuda:   # as utils.tiled.backward: the first tiles Triton can launch here
        return first_that_launches(lambda tiles: sink_attention_backward(do, q, k, v, sinks, o, lse, causal=causal,
                                                                         window=window, sm_scale=sm_scale,
                                                                         config=tiles),
                                   candidate_configs(d, q.dtype, gpu.shared_memory_per_block(q.device)))
    c = check_config(INTERPRETER_CONFIG if config is None else config, Config)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        *grads, dsinks = sink_attention_backward(*(t.float() for t in (do, q, k, v)), sinks, o.float(), lse,
                                                 causal=causal, window=window, sm_scale=scale, config=c)
        return (*(g.to(torch.bfloat16) for g in grads), dsinks)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(acc).contiguous()
    delta = torch.empty((b, h, nq), dtype=acc, device=q.device)
    lse2 = torch.empty_like(delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_d = max(16, triton.next_power_of_2(d))
    common = dict(GROUP=h // hk, CAUSAL=causal, WINDOW=window is not None, HEAD_DIM=d, BLOCK_D=block_d,
                  ACC=tl.float64 if acc == torch.float64 else tl.float32,
                  PRECISION="tf32" if q.dtype in (torch.float16, torch.bfloat16) else "ieee")   # exact fp32/fp64
    w = 0 if window is None else window   # unread without a window
    _bwd_preprocess[(triton.cdiv(nq, 64), b * h)](o, do, lse, delta, lse2, *o.stride(), *do.stride(), h, nq, d,
                                                  BLOCK_M=64, BLOCK_D=block_d, ACC=common["ACC"])
    _bwd_dkdv[(triton.cdiv(nk, c.block_n1), b * hk)](
        q, k, v, do, lse2, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
        *dv.stride(), hk, nq, nk, w, scale * LOG2E, scale, BLOCK_M=c.block_m1, BLOCK_N=c.block_n1,
        num_warps=c.warps1, num_stages=c.stages1, **common)
    _bwd_dq[(triton.cdiv(nq, c.block_m2), b * h)](
        q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        h, nq, nk, w, scale * LOG2E, scale, BLOCK_M=c.block_m2, BLOCK_N=c.block_n2,
        num_warps=c.warps2, num_stages=c.stages2, **common)
    dsinks = None if sinks is None else sink_gradient(sinks, lse, delta)
    return dq, dk, dv, dsinks


class SinkAttention(torch.autograd.Function):
    """forward: the Triton forward, saving (q, k, v, sinks, o, lse); backward: the three Triton backward kernels
    and the sink's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window, sm_scale):
        o, lse = sink_attention_forward(q, k, v, sinks, causal=causal, window=window, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, sinks, o, lse)   # O(N·d): no N×N matrix is kept
        ctx.causal, ctx.window, ctx.sm_scale = causal, window, sm_scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = sink_attention_backward(do, q, k, v, sinks, o, lse, causal=ctx.causal,
                                                     window=ctx.window, sm_scale=ctx.sm_scale)
        return dq, dk, dv, dsinks, None, None, None   # no gradient for causal, window and sm_scale


def sink_attention(q, k, v, sinks=None, *, causal=False, window=None, sm_scale=None):
    """Attention with an optional per-head sink logit and sliding window (see utils.sinks.reference),
    differentiable in q, k, v and sinks. Returns O, shaped and typed like q."""
    o, _ = SinkAttention.apply(q, k, v, sinks, causal, window, sm_scale)
    return o
