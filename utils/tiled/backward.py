"""FlashAttention-2 backward in Triton, as notebook 07 teaches it: three kernels, three launches.

1. `_bwd_preprocess`: D = rowsum(dO ∘ O) per query, and the lse in base 2 (+inf for a row that sees no key,
   so that P = 2^(S·scale·log2 e − lse₂) is exactly 0 there);
2. `_bwd_dkdv`: one program per (K/V block, batch · K/V head) keeps K, V, dK, dV on chip and loops over the Q
   blocks of every query head of its GQA group, recomputing Pᵀ from the lse;
3. `_bwd_dq`: one program per (Q block, batch · head) keeps Q, dO, dQ on chip and loops over the K/V blocks.

Causal masks are aligned bottom-right; blocks no query sees are skipped, and only the blocks that cross the
diagonal (or the ragged end) run the masked copy of a loop. Any strides; head dims 16 to 256 (padded to a power
of two); fp16, bf16, fp32, fp64; in the interpreter bf16 is computed in fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils import gpu
from utils.checks import check_device
from utils.eager.backward import check_backward_inputs
from utils.tiled.forward import check_config, first_that_launches

HEAD_DIMS = range(16, 257)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOG2E = 1.4426950408889634


@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2, s_ob, s_oh, s_om, s_od, s_dob, s_doh, s_dom, s_dod, H, N_Q,
                    HEAD_DIM, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od, mask=mask, other=0.0)
    do = tl.load(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dom + offs_d[None, :] * s_dod, mask=mask,
                 other=0.0)
    row = bh.to(tl.int64) * N_Q + offs_m
    lse = tl.load(LSE + row, mask=mask_m, other=0.0).to(ACC)
    tl.store(DELTA + row, tl.sum(o.to(ACC) * do.to(ACC), axis=1), mask=mask_m)
    tl.store(LSE2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=mask_m)


@triton.jit
def _column_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which of the BLOCK_D columns are real. A power-of-two head dim has no padding: a constant-true mask, which
    the compiler folds away, so loads and stores carry no per-column predicate."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    return offs_d < HEAD_DIM


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE2, DELTA, s_qm, s_qd, s_dom, s_dod,
                offs_n, offs_d, mask_d, N_Q, offset, qk_scale, start, end,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
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
        if MASKED:  # causal: key j visible to query i iff j <= i + offset
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + offset, p_t, 0.0)
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
              H_KV, N_Q, N_K, qk_scale, sm_scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
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
    if CAUSAL:
        # Queries before n0 - offset see none of these keys: start at the Q block holding that row. Blocks
        # starting before n0 + BLOCK_N - 1 - offset cross the diagonal and need the mask; the rest do not.
        start = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
        n_masked = tl.maximum(n0 + BLOCK_N - 1 - offset - start + BLOCK_M - 1, 0) // BLOCK_M
        split = tl.minimum(start + n_masked * BLOCK_M, N_Q)
    else:
        start = 0
        split = 0
    for g in range(GROUP):  # the query heads sharing this K/V head: their gradients add up here
        h = hk * GROUP + g
        q_ptr = Q + b * s_qb + h * s_qh
        do_ptr = DO + b * s_dob + h * s_doh
        row = (b * H_KV * GROUP + h) * N_Q
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             offs_n, offs_d, mask_d, N_Q, offset, qk_scale, start, split, BLOCK_M, True, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             offs_n, offs_d, mask_d, N_Q, offset, qk_scale, split, N_Q, BLOCK_M, False, PRECISION)
    dk *= sm_scale
    tl.store(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dkn + offs_d[None, :] * s_dkd, dk, mask=mask_nd)
    tl.store(DV + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvn + offs_d[None, :] * s_dvd, dv, mask=mask_nd)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, s_kn, s_kd, s_vn, s_vd,
              offs_m, offs_d, mask_d, N_K, offset, qk_scale, start, end,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ_i over the K/V blocks [start, end)."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_kv = (offs_n[None, :] < N_K) & mask_d[:, None]
        k_t = tl.load(K + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd, mask=mask_kv, other=0.0)  # (D, N)
        v_t = tl.load(V + offs_n[None, :] * s_vn + offs_d[:, None] * s_vd, mask=mask_kv, other=0.0)  # (D, N)
        s = tl.dot(q, k_t, input_precision=PRECISION)                                    # (M, N)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # the ragged last block, and (causal) blocks crossing the diagonal
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=PRECISION)                                  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])                                                   # dS = P ∘ (dP − D)
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)         # dQ += dS K
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE2, DELTA, DQ,
            s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
            s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
            H, N_Q, N_K, qk_scale, sm_scale,
            GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
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
    if CAUSAL:
        # Keys past m0 + BLOCK_M - 1 + offset are invisible to the whole block; blocks ending at or before
        # m0 + offset + 1 are visible to every row of it and need no mask.
        end = tl.minimum(tl.maximum(m0 + BLOCK_M + offset, 0), N_K)
        split = tl.minimum(tl.maximum(m0 + offset + 1, 0) // BLOCK_N, N_K // BLOCK_N) * BLOCK_N
    else:
        end = N_K
        split = N_K // BLOCK_N * BLOCK_N
    k_ptr = K + b * s_kb + hk * s_kh
    v_ptr = V + b * s_vb + hk * s_vh
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, mask_d, N_K,
                   offset, qk_scale, 0, split, BLOCK_N, False, CAUSAL, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, mask_d, N_K,
                   offset, qk_scale, split, end, BLOCK_N, True, CAUSAL, PRECISION)
    dq *= sm_scale
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqm + offs_d[None, :] * s_dqd, dq, mask=mask_md)


class Config(NamedTuple):
    """Tiles of the two main kernels. dK/dV pass: block_n1 keys kept on chip, block_m1 queries looped over;
    dQ pass: block_m2 queries kept, block_n2 keys looped over."""
    block_m1: int
    block_n1: int
    warps1: int
    stages1: int
    block_m2: int
    block_n2: int
    warps2: int
    stages2: int


# Smaller tiles, in the order tried, for GPUs with less shared memory per block (a T4 has 64 KiB); mid-sized
# tiles in the interpreter, where each program is NumPy work.
SMALL_SMEM_CONFIGS = (Config(32, 64, 4, 2, 64, 32, 4, 2), Config(32, 32, 4, 1, 32, 32, 4, 1),
                      Config(16, 32, 4, 1, 32, 16, 4, 1), Config(16, 16, 4, 1, 16, 16, 4, 1))
INTERPRETER_CONFIG = Config(32, 32, 4, 1, 32, 32, 4, 1)


def smem_estimate(config: Config, head_dim: int, elem_bytes: int) -> int:
    """Shared memory the larger of the two main kernels needs, in bytes (an upper bound with pointer loads)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return elem_bytes * block_d * max(2 * config.block_m1 + 4 * config.block_n1,
                                      4 * config.block_m2 + 2 * config.block_n2)


def pick_config(head_dim: int, dtype: torch.dtype, smem: int | None = None) -> Config:
    """The tiles for a head dim and dtype, shrunk until they fit `smem` bytes of shared memory per block
    (None: an H200's choice)."""
    return candidate_configs(head_dim, dtype, smem)[0]


def candidate_configs(head_dim: int, dtype: torch.dtype, smem: int | None = None) -> list[Config]:
    """pick_config's tiles first, then the ones to try if Triton refuses them (utils.tiled.forward's
    first_that_launches: Triton 3.7 asks 289 KiB for the H200's tiles at head dim 128, where 3.6 fits them in
    227 KiB): the same with one stage fewer, then the small ones, each within `smem` by smem_estimate."""
    if head_dim > 128:   # registers
        preferred = Config(16, 32, 4, 1, 32, 16, 4, 1)
    elif dtype in (torch.float32, torch.float64):   # exact dots, twice the bytes
        preferred = Config(32, 64, 4, 2, 64, 32, 4, 2)
    elif head_dim <= 64:
        preferred = Config(32, 128, 4, 3, 128, 64, 8, 3)
    else:
        preferred = Config(64, 128, 8, 3, 128, 64, 8, 3)
    if smem is None:
        return [preferred]
    fewer_stages = preferred._replace(stages1=max(1, preferred.stages1 - 1), stages2=max(1, preferred.stages2 - 1))
    fits = [c for c in dict.fromkeys((preferred, fewer_stages, *SMALL_SMEM_CONFIGS))
            if smem_estimate(c, head_dim, dtype.itemsize) <= smem]
    return fits or [SMALL_SMEM_CONFIGS[-1]]


def check_inputs(do, q, k, v, o, lse, causal, sm_scale):
    """(shape, scale) of valid inputs; a TypeError or ValueError naming the argument otherwise."""
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale, dtypes=DTYPES)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported: the kernels take 16 to 256")
    check_device("q", q, "triton")
    return shape, scale


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, sm_scale=None, config=None):
    """(dq, dk, dv) from the forward's output o and natural-log lse ((batch, heads, seqlen_q), -inf for a row
    that sees no key). q, do, o: (B, H, Nq, D); k, v: (B, Hkv, Nk, D), their gradients summed over the query
    heads of a GQA group. `config`: tiles (None: pick_config)."""
    (b, h, hk, nq, nk, d), scale = check_inputs(do, q, k, v, o, lse, causal, sm_scale)
    if config is None and q.is_cuda:   # the first of the tiles that fit this GPU that Triton can launch
        return first_that_launches(lambda tiles: flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                           sm_scale=scale, config=tiles),
                                   candidate_configs(d, q.dtype, gpu.shared_memory_per_block(q.device)))
    c = check_config(INTERPRETER_CONFIG if config is None else config, Config)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        grads = flash_attention_backward(*(t.float() for t in (do, q, k, v, o)), lse, causal=causal,
                                         sm_scale=scale, config=c)
        return tuple(g.to(torch.bfloat16) for g in grads)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(acc).contiguous()
    delta = torch.empty((b, h, nq), dtype=acc, device=q.device)
    lse2 = torch.empty_like(delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_d = max(16, triton.next_power_of_2(d))
    common = dict(GROUP=h // hk, CAUSAL=causal, HEAD_DIM=d, BLOCK_D=block_d,
                  ACC=tl.float64 if acc == torch.float64 else tl.float32,
                  PRECISION="tf32" if q.dtype in (torch.float16, torch.bfloat16) else "ieee")   # exact fp32/fp64
    _bwd_preprocess[(triton.cdiv(nq, 64), b * h)](o, do, lse, delta, lse2, *o.stride(), *do.stride(), h, nq, d,
                                                  BLOCK_M=64, BLOCK_D=block_d, ACC=common["ACC"])
    _bwd_dkdv[(triton.cdiv(nk, c.block_n1), b * hk)](
        q, k, v, do, lse2, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
        *dv.stride(), hk, nq, nk, scale * LOG2E, scale, BLOCK_M=c.block_m1, BLOCK_N=c.block_n1,
        num_warps=c.warps1, num_stages=c.stages1, **common)
    _bwd_dq[(triton.cdiv(nq, c.block_m2), b * h)](
        q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        h, nq, nk, scale * LOG2E, scale, BLOCK_M=c.block_m2, BLOCK_N=c.block_n2,
        num_warps=c.warps2, num_stages=c.stages2, **common)
    return dq, dk, dv
