"""The worklog's Triton backward (notebooks 07 and 07w): utils.tiled.fast.backward's kernels with every option the
worklog measures, each still runnable.

Three launches, in the order of FlashAttention-2 (Dao, 2023, Algorithm 2), with the dQ pass split off:

1. `_bwd_preprocess`: D = rowsum(dO ∘ O) per query row, and the log-sum-exp in base 2;
2. `_bwd_dkdv`: one program per (K/V block, K/V head) keeps K_j, V_j, dK_j, dV_j on chip and loops over the Q
   blocks that see it;
3. `_bwd_dq`: one program per (Q block, query head) keeps Q_i, dO_i, dQ_i on chip and loops over the K/V blocks
   it sees.

Beyond utils.tiled.fast.backward, `flash_attention_backward` takes `tma` and `tma_stats` (the loads pinned: worklog
07w, sections 2 and 3) and `dq_atomic` (dQ added by the dK/dV pass with atomic adds, ATOMIC=1, or TMA bulk
reduce-adds, ATOMIC=2, instead of a dQ pass: section 4). With those at their defaults it compiles to the same
PTX as utils.tiled.fast.backward (tests/test_fast_identity.py). `flash_attention` pairs it with the worklog's
forward (utils.course.worklogs.triton_forward).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from utils import gpu
from utils.checks import AttentionShape, check_bool
from utils.eager.backward import check_backward_inputs
from utils.course.worklogs.triton_forward import _forward, _kind, tma_supported
from utils.tiled.fast.backward import Config   # the same tiles: one class for both
from utils.tiled.fast import launch
from utils.tiled.fast.launch import FastLauncher
from utils.triton_utils import cdiv

__all__ = ["flash_attention", "FlashAttentionFunction", "flash_attention_backward", "Config", "pick_config",
           "use_tma", "tma_reduce_supported", "HEAD_DIMS", "DTYPES"]

HEAD_DIMS = tuple(range(16, 257))   # as the forward (utils.tiled.fast.forward): padded to a power of two
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Smaller tiles, in the order tried, for GPUs with less shared memory per block (a T4 has 64 KiB).
SMALL_SMEM_CONFIGS = (Config(32, 64, 4, 2, 64, 32, 4, 2), Config(32, 32, 4, 1, 32, 32, 4, 1),
                      Config(16, 32, 4, 1, 32, 16, 4, 1), Config(16, 16, 4, 1, 16, 16, 4, 1))


def smem_estimate(config: Config, head_dim: int, elem_bytes: int) -> int:
    """Shared memory the larger of the two main kernels needs, in bytes: what Triton 3.6 allocates on sm_75
    (where tl.dot runs on FMA units, and stages add nothing), an upper bound of what it allocates on sm_80+ with
    pointer loads (utils.course.cross_compile compiles both to check). TMA's staging buffers take more (165 KB at head
    dim 128), which only sm_90's 227 KB per block is asked for."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return elem_bytes * block_d * max(2 * config.block_m1 + 4 * config.block_n1,
                                      4 * config.block_m2 + 2 * config.block_n2)


def pick_config(head_dim: int, dtype: torch.dtype, causal: bool = False, smem: int | None = None) -> Config:
    """Launch parameters. 16-bit, head dims up to 128: within 3% of the fastest of each pass's candidates in
    `python -m utils.course.bench.backward_tiles` on an H200 (images/07_backward_tiles_h200.json: bf16, B=4, H=16,
    N=8192; the same tiles win causal or not). Smaller tiles for fp32/fp64 (exact dots, twice
    the bytes) and head dims above 128 (registers); mid-sized tiles in the interpreter, where each program is
    NumPy work and fewer, larger tiles run fastest. `smem`: bytes of shared memory per block of the GPU
    (utils.gpu.shared_memory_per_block); the tiles shrink until they fit. None: an H200's choice."""
    if _interpreting():
        return Config(32, 32, 4, 1, 32, 32, 4, 1)
    return _fitted_config(head_dim, dtype, causal, smem)


@functools.lru_cache(maxsize=None)  # asked at every launch
def _fitted_config(head_dim: int, dtype: torch.dtype, causal: bool, smem: int | None) -> Config:
    if head_dim > 128:
        preferred = Config(16, 32, 4, 1, 32, 16, 4, 1)
    elif dtype in (torch.float32, torch.float64):
        preferred = Config(32, 64, 4, 2, 64, 32, 4, 2)
    elif head_dim <= 64:
        preferred = Config(32, 128, 4, 3, 128, 64, 8, 3)
    else:
        preferred = Config(64, 128, 8, 3, 128, 64, 8, 3)
    if smem is None:
        return preferred
    elem_bytes = torch.finfo(dtype).bits // 8
    fits = [c for c in (preferred, *SMALL_SMEM_CONFIGS) if smem_estimate(c, head_dim, elem_bytes) <= smem]
    return fits[0] if fits else SMALL_SMEM_CONFIGS[-1]


def use_tma(head_dim: int, causal: bool) -> bool:
    """Whether `tma=None` loads the looped-over tiles, and lse₂ and D with them, through TMA (where the inputs
    allow it): at head dim 128, where that beat pointer loads on an H200 (images/07_backward_benchmark.json,
    columns triton_tma_stats and triton_pointer; worklog 07w, sections 2 and 3). At 64 TMA was slower; causal
    at 128, the tiles alone through TMA were too, and only the whole loop through TMA paid."""
    return head_dim == 128


def tma_reduce_supported(q) -> bool:
    """Whether `dq_atomic="tma"` can run: an sm_90+ GPU and 16-bit inputs. The fp32 dQ copy the TMA engine adds
    into is the course's own, allocated aligned, so the inputs' strides do not matter."""
    return q.is_cuda and gpu.capability(q) >= (9, 0) and q.dtype in (torch.float16, torch.bfloat16)


# --- kernels -------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2,
                    s_ob, s_oh, s_om, s_od, s_dob, s_doh, s_dom, s_dod,
                    H, N_Q, HEAD_DIM,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
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
    delta = tl.sum(o.to(ACC) * do.to(ACC), axis=1)
    row = bh.to(tl.int64) * N_Q + offs_m
    lse = tl.load(LSE + row, mask=mask_m, other=0.0).to(ACC)
    # Base-2 lse; +inf where no key is visible (lse = -inf) so that exp2(s - lse2) = 0 rather than NaN.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=mask_m)
    tl.store(LSE2 + row, lse2, mask=mask_m)


@triton.jit
def _column_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which of the BLOCK_D columns are real. A power-of-two head dim has no padding: a constant-true mask, which
    the compiler folds away, so loads and stores carry no per-column predicate."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    return offs_d < HEAD_DIM


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE2, DELTA, s_qm, s_qd, s_dom, s_dod, QD, DOD, LD, DD, b, h,
                offs_n, offs_d, mask_d, N_Q, offset, qk_scale, start, end, DQA, row, sm_scale,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                TMA: tl.constexpr, STATS: tl.constexpr, ATOMIC: tl.constexpr):
    """Accumulate dK_j, dV_j over the Q blocks [start, end): the tiles are transposed (keys × queries) so that
    Pᵀ and dSᵀ come out of the dots directly. TMA: Q and dO tiles come through the host's descriptors QD, DOD
    (indexed [batch, head, row, 0]; rows past the end read as zeros), else through pointers with masks.
    STATS: lse₂ and D come through descriptors LD, DD too (indexed [batch, head, row]), so that every load of
    the loop is a TMA copy. ATOMIC: also add this tile's dQ_i = sm_scale · dS_ij K_j into DQA, a (B·H·N_Q,
    BLOCK_D) accumulator in global memory whose rows of this head start at `row`, with atomic adds: no dQ pass.
    ATOMIC == 2: DQA is a TMA descriptor of that accumulator, (B, H, N_Q, BLOCK_D), and each tile is one bulk
    reduce-add."""
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N_Q
        if TMA:
            q_t = tl.trans(QD.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D))
        else:
            q_t = tl.load(Q + offs_m[None, :] * s_qm + offs_d[:, None] * s_qd,
                          mask=mask_m[None, :] & mask_d[:, None], other=0.0)             # (D, M)
        if STATS:
            lse2 = LD.load([b, h, m0]).reshape(BLOCK_M)   # rows past the end read 0: their Q and dO rows are 0
        else:
            lse2 = tl.load(LSE2 + offs_m, mask=mask_m, other=float("inf"))             # rows past the end: P = 0
        s_t = tl.dot(k, q_t, input_precision=PRECISION)                                  # (N, M) = (S_ij)ᵀ
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:  # causal: key j visible to query i iff j <= i + offset
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + offset, p_t, 0.0)
        if TMA:
            do = DOD.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            do = tl.load(DO + offs_m[:, None] * s_dom + offs_d[None, :] * s_dod,
                         mask=mask_m[:, None] & mask_d[None, :], other=0.0)              # (M, D)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)                    # dV += Pᵀ dO
        if STATS:
            delta = DD.load([b, h, m0]).reshape(BLOCK_M)
        else:
            delta = tl.load(DELTA + offs_m, mask=mask_m, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                        # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])                                             # dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=PRECISION)       # dK += dSᵀ Q
        if ATOMIC:  # dQ_i += dS K_j from every key block: programs add into the same rows, in any order
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=PRECISION) * sm_scale  # (M, D)
            if ATOMIC == 2:   # one bulk reduce-add of the tile by the TMA engine (rows past the end are clipped)
                DQA.atomic_add([b, h, m0, 0], dq.reshape(1, 1, BLOCK_M, BLOCK_D))
            else:
                tl.atomic_add(DQA + (row + offs_m[:, None]) * BLOCK_D + offs_d[None, :], dq, mask=mask_m[:, None],
                              sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV, QD, DOD, LD, DD, DQA,
              s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
              s_dob, s_doh, s_dom, s_dod, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd,
              H_KV, N_Q, N_K, qk_scale, sm_scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
              TMA: tl.constexpr, STATS: tl.constexpr, ATOMIC: tl.constexpr = False):
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
        h32 = (bhk % H_KV) * GROUP + g  # the descriptors' coordinates are 32-bit
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                                 QD, DOD, LD, DD, bhk // H_KV, h32, offs_n, offs_d, mask_d, N_Q, offset, qk_scale,
                                 start, split, DQA, row, sm_scale, BLOCK_M, BLOCK_D, True, PRECISION, TMA,
                                 STATS, ATOMIC)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             QD, DOD, LD, DD, bhk // H_KV, h32, offs_n, offs_d, mask_d, N_Q, offset, qk_scale, split,
                             N_Q, DQA, row, sm_scale, BLOCK_M, BLOCK_D, False, PRECISION, TMA, STATS,
                             ATOMIC)
    dk *= sm_scale
    tl.store(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dkn + offs_d[None, :] * s_dkd, dk, mask=mask_nd)
    tl.store(DV + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvn + offs_d[None, :] * s_dvd, dv, mask=mask_nd)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, s_kn, s_kd, s_vn, s_vd, KD, VD, b, hk,
              offs_m, offs_d, mask_d, N_K, offset, qk_scale, start, end,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dQ_i over the K/V blocks [start, end). TMA: K and V tiles through the host's descriptors."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TMA:
            k_t = tl.trans(KD.load([b, hk, n0, 0]).reshape(BLOCK_N, BLOCK_D))
            v_t = tl.trans(VD.load([b, hk, n0, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
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
def _bwd_dq(Q, K, V, DO, LSE2, DELTA, DQ, KD, VD,
            s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
            s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
            H, N_Q, N_K, qk_scale, sm_scale,
            GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
            TMA: tl.constexpr):
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
    b32, hk32 = bh // H, bh % H // GROUP  # the descriptors' coordinates are 32-bit
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, KD, VD, b32, hk32, offs_m, offs_d,
                   mask_d, N_K, offset, qk_scale, 0, split, BLOCK_N, BLOCK_D, False, CAUSAL, PRECISION, TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, s_kn, s_kd, s_vn, s_vd, KD, VD, b32, hk32, offs_m, offs_d,
                   mask_d, N_K, offset, qk_scale, split, end, BLOCK_N, BLOCK_D, True, CAUSAL, PRECISION, TMA)
    dq *= sm_scale
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqm + offs_d[None, :] * s_dqd, dq, mask=mask_md)


# --- host side -----------------------------------------------------------------------------------------------

# Launched without Triton's per-call dispatch (utils.tiled.fast.launch; notebook 05b measures what that saves).
_launch_preprocess, _launch_dkdv, _launch_dq = (FastLauncher(k) for k in (_bwd_preprocess, _bwd_dkdv, _bwd_dq))


class Choices(NamedTuple):
    """What flash_attention_backward checked and decided for one kind of call."""
    shape: AttentionShape
    scale: float
    config: Config
    tma: bool
    stats: bool
    dq_atomic: bool | str
    upcast: bool          # bf16 in the interpreter: computed in fp32
    causal: bool
    acc: torch.dtype      # of the accumulators, D and lse₂
    block_d: int          # the head dim padded to a power of two
    lse_ready: bool       # lse is already of dtype `acc` and contiguous


_KINDS = launch.kind_cache()   # _call_key -> launch.Kind of Choices: the launch.MAX_KINDS used most recently


def _call_key(do, q, k, v, o, lse, causal, sm_scale, config, tma, tma_stats, dq_atomic):
    """Everything the checks, the choices and Triton's specialization of the launches depend on, for CUDA tensors
    and options of the expected types; None otherwise (such a call is checked every time)."""
    if not (type(causal) is bool and type(sm_scale) in (float, int, type(None))
            and type(config) in (Config, type(None))
            and all(x is None or x is True or x is False for x in (tma, tma_stats))   # 1 == True: `is`
            and (dq_atomic is True or dq_atomic is False or dq_atomic == "tma")):
        return None
    return launch.kind_key((do, q, k, v, o, lse), (causal, sm_scale, config, tma, tma_stats, dq_atomic))


def _choose(do, q, k, v, o, lse, causal, sm_scale, config, tma, tma_stats, dq_atomic) -> Choices:
    """flash_attention_backward's checks (a ValueError or TypeError naming the argument) and choices."""
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale, dtypes=DTYPES)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported by the Triton backward; supported: "
                         f"{HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    if config is None:
        smem = gpu.shared_memory_per_block(q.device) if q.device.type == "cuda" else None
        config = pick_config(shape.head_dim, q.dtype, causal, smem)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a utils.tiled.fast.backward.Config or None, got {type(config).__name__}")
    if not isinstance(dq_atomic, (bool, str)):
        raise TypeError(f"dq_atomic must be a bool or \"tma\", got {type(dq_atomic).__name__}")
    if isinstance(dq_atomic, str) and dq_atomic != "tma":
        raise ValueError(f"dq_atomic must be False, True or \"tma\", got {dq_atomic!r}")
    for name, value in (("tma", tma), ("tma_stats", tma_stats)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
    if tma or (tma is None and use_tma(shape.head_dim, causal)):  # asked only then: it costs host time
        allowed = tma_supported(q, k, v) and tma_supported(do, k, v)
        if tma and not allowed:
            raise ValueError("tma=True needs an sm_90+ GPU, 16-bit inputs, a power-of-two head dim and q, k, v, do "
                             "with unit last stride and 16-byte aligned addresses and row strides")
        tma = allowed
    tma = bool(tma)
    reduce = dq_atomic == "tma"
    if reduce and not tma_reduce_supported(q):
        raise ValueError(f"dq_atomic=\"tma\" needs an sm_90+ GPU and fp16/bf16 inputs (got {q.dtype} on "
                         f"{q.device})")
    # lse₂ and D through descriptors: their rows (seqlen_q fp32 values) must be 16-byte aligned.
    stats_allowed = tma and shape.seqlen_q % 4 == 0
    if tma_stats and not stats_allowed:
        raise ValueError(f"tma_stats=True needs the TMA loads (tma=True, or the default) and seqlen_q a multiple "
                         f"of 4 (got {shape.seqlen_q})")
    stats = stats_allowed if tma_stats is None else tma_stats
    interpret = _interpreting()
    if q.device.type != "cuda" and not (interpret and q.device.type == "cpu"):
        raise ValueError(f"q is on {q.device}: the kernels need a CUDA device, or CPU tensors with "
                         "TRITON_INTERPRET=1 set before this module was imported")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return Choices(shape, scale, config, tma, stats, dq_atomic, interpret and q.dtype == torch.bfloat16, causal,
                   acc, max(16, triton.next_power_of_2(shape.head_dim)), lse.dtype == acc and lse.is_contiguous())


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, sm_scale=None, config=None, tma=None,
                             tma_stats=None, dq_atomic=False):
    """Gradients (dq, dk, dv) of attention from the forward's output `o` and log-sum-exp `lse`.

    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with Hkv dividing H (GQA: dk, dv come back with Hkv heads, the
    gradients of the query heads of a group summed); do and o like q; lse float (B, H, Nq), natural log, -inf for
    rows that see no key (their gradients are 0). Head dims 16 to 256 (padded to a power of two). dtypes: fp16, bf16, fp32,
    fp64; in the interpreter bf16 is computed in fp32 (NumPy has no bf16 arithmetic). Any strides.
    `config`: a Config (default: `pick_config`). `tma`: load the looped-over tiles (Q and dO in the
    dK/dV pass, K and V in the dQ pass) through Hopper's TMA copy engine. None: where `use_tma` says it pays
    and the inputs allow it (`utils.tiled.fast.forward.tma_supported`); False: pointer loads; True: TMA, or a
    ValueError saying why not. `tma_stats`: with TMA, load the lse₂ and D of each Q tile of the dK/dV loop
    through descriptors too. None: wherever TMA is on and seqlen_q is a multiple of 4 (16-byte aligned fp32
    rows); True: that, or a ValueError saying why not. `dq_atomic`: True: no dQ pass; the dK/dV pass adds each
    tile's dQ into an fp32 copy with one atomic add per element (as FlashAttention-2's CUDA backward does; not
    deterministic: the order of the additions varies from run to run). "tma": the same, each tile added by one
    bulk reduce-add of the TMA engine (as FlashAttention-3 does; sm_90+ and 16-bit inputs, or a ValueError).
    Worklog 07w, section 4, measures both against the separate pass.

    The checks, the choices and the launches' fixed arguments are made once per kind of call (shapes, strides,
    dtypes, device, 16-byte alignment, options) and kept for the next call of that kind on a GPU, which then
    passes only its tensors (utils.tiled.fast.launch.Bound): at N <= 1k the host's time per call is the call's time
    (notebook 05b, section 7).
    """
    key = _call_key(do, q, k, v, o, lse, causal, sm_scale, config, tma, tma_stats, dq_atomic)
    kind = launch.kind_of(_KINDS, key, lambda: _choose(do, q, k, v, o, lse, causal, sm_scale, config, tma,
                                                       tma_stats, dq_atomic))
    if kind.choices.upcast:  # the interpreter has no bf16 arithmetic: computed in fp32
        grads = flash_attention_backward(*(t.float() for t in (do, q, k, v, o)), lse, causal=causal,
                                         sm_scale=sm_scale, config=config, dq_atomic=dq_atomic)
        return tuple(g.to(torch.bfloat16) for g in grads)
    return _run(kind, key is not None, do, q, k, v, o, lse)


def backward_for_forward(forward_kind: launch.Kind, do, q, k, v, o, lse, *, causal, sm_scale):
    """flash_attention_backward of what a forward of kind `forward_kind` saved (FlashAttentionFunction calls
    this). That kind fixes the shapes, strides, dtypes and alignment of q, k, v, o and lse, so
    the backward's kinds of call are kept in it under the key of dO alone: one tensor's key instead of six, and
    less host time where a call's host time is its time (N <= 1k: notebook 05b, section 7)."""
    key = launch.kind_key((do,), ())
    kind = forward_kind.derived.get(key) if key is not None else None
    if kind is not None:
        forward_kind.derived.move_to_end(key)   # a kind_cache(): the least recently used go first
        return _run(kind, True, do, q, k, v, o, lse)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)  # checks, keeps
    kept = key is not None and _KINDS.get(_call_key(do, q, k, v, o, lse, causal, sm_scale, None, None, None, False))
    if kept:
        launch.keep(forward_kind.derived, key, kept)
    return grads


# ---- differentiable: the worklog's forward (utils.course.worklogs.triton_forward) with this backward ---------------

class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward runs the worklog's forward kernel; backward is notebook 07's kernel, given the
    forward's kind of call (backward_for_forward)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, kind):
        o, lse = _forward(q, k, v, causal, kind)  # flash_attention checked the inputs: `kind` is their kind
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.set_materialize_grads(False)  # lse gets no gradient: no tensor of zeros is made for it
        ctx.causal = causal
        ctx.sm_scale = kind.choices.scale
        ctx.kind = kind  # the backward keeps its kinds of call in the forward's
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:  # o took no part in what is differentiated
            return None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_for_forward(ctx.kind, do, q, k, v, o, lse, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, *, causal=False, sm_scale=None, return_lse=False):
    """FlashAttention-2 in Triton: softmax(Q Kᵀ · sm_scale) V, differentiable (the forward of
    utils.course.worklogs.triton_forward, the backward of this module).

    Returns O, shaped and typed like q (contiguous), or (O, lse) with return_lse=True (lse: fp32,
    (batch, heads, seqlen_q), natural log, -inf for a query that sees no key).
    """
    check_bool("return_lse", return_lse)
    kind = _kind(q, k, v, causal, sm_scale)  # the checks before autograd, so errors point at the call
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = FlashAttentionFunction.apply(q, k, v, causal, kind)
    else:  # nothing to differentiate: skip the autograd Function (~10 µs of host time a call)
        o, lse = _forward(q, k, v, causal, kind)
    return (o, lse) if return_lse else o


def _run(kind: launch.Kind, keep: bool, do, q, k, v, o, lse) -> tuple:
    """The gradients of a checked call of `kind`: this call's tensors made (outputs, D and lse₂, descriptors)
    and handed to the kind's launches (bound and kept with `keep`: a call with a key)."""
    c = kind.choices
    b, h, _, nq, _, d = c.shape
    # This call's tensors: the launches' leading arguments (the rest is fixed by the kind of call).
    if not c.lse_ready:
        lse = lse.to(c.acc).contiguous()
    delta = torch.empty((b, h, nq), dtype=c.acc, device=q.device)
    lse2 = torch.empty_like(delta)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = None if c.dq_atomic else torch.empty_like(q)
    dq_acc = torch.zeros((b, h, nq, c.block_d), dtype=c.acc, device=q.device) if c.dq_atomic else None
    qd = dod = kd = vd = ld = dd = dqd = None
    if c.tma or c.dq_atomic == "tma":   # host TMA descriptors: made at the kind's first call, then copied
        qd, dod, kd, vd, ld, dd, dqd = kind.descriptors((q, do, k, v, lse2, delta, dq_acc), lambda: _descriptors(
            c, q, do, k, v, lse2, delta, dq_acc))
    dqa = dqd if c.dq_atomic == "tma" else dq_acc
    heads = ((o, do, lse, delta, lse2), (q, k, v, do, lse2, delta, dk, dv, qd, dod, ld, dd, dqa),
             (q, k, v, do, lse2, delta, dq, kd, vd))[:2 if c.dq_atomic else 3]
    kind.launch(heads, lambda: _launches(c, q, k, v, do, o, dk, dv, dq), keep=keep)
    if c.dq_atomic:
        return dq_acc[..., :d].to(q.dtype), dk, dv
    return dq, dk, dv


def _descriptors(choices: Choices, q, do, k, v, lse2, delta, dq_acc) -> tuple:
    """A call's host TMA descriptors, None where its choices load through pointers: Q and dO (tiles of block_m1
    rows), K and V (block_n2 rows), lse₂ and D (block_m1 values), and the fp32 dQ copy the TMA engine adds into."""
    config, tma, stats = choices.config, choices.tma, choices.stats

    def tile(t, rows):   # a box of `rows` rows of one (batch, head) of a (B, H, N, D) tensor
        return TensorDescriptor.from_tensor(t, [1, 1, rows, t.shape[-1]])

    return (*(tile(t, config.block_m1) if tma else None for t in (q, do)),
            *(tile(t, config.block_n2) if tma else None for t in (k, v)),
            *(TensorDescriptor.from_tensor(t, [1, 1, config.block_m1]) if stats else None for t in (lse2, delta)),
            tile(dq_acc, config.block_m1) if choices.dq_atomic == "tma" else None)


def _launches(choices: Choices, q, k, v, do, o, dk, dv, dq) -> list[tuple]:
    """(launcher, grid, trailing arguments, constexprs and options) of each launch of a kind of call; the
    trailing arguments (strides, sizes, scales) follow the leading tensors that flash_attention_backward makes."""
    (b, h, hk, nq, nk, d), scale, config, tma, stats, dq_atomic = choices[:6]
    block_d = choices.block_d
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    # fp32 dots would use TF32 (10-bit mantissa) on tensor cores; gradients in fp32 are expected to be exact-ish.
    precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    common = dict(GROUP=h // hk, CAUSAL=choices.causal, HEAD_DIM=d, BLOCK_D=block_d, PRECISION=precision, ACC=acc,
                  TMA=tma)
    scales = (scale * LOG2E, scale)
    launches = [(_launch_preprocess, (cdiv(nq, 64), b * h), (*o.stride(), *do.stride(), h, nq, d),
                 dict(BLOCK_M=64, BLOCK_D=block_d, ACC=acc)),
                (_launch_dkdv, (cdiv(nk, config.block_n1), b * hk),
                 (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), hk, nq, nk,
                  *scales),
                 dict(common, BLOCK_M=config.block_m1, BLOCK_N=config.block_n1, STATS=stats,
                      ATOMIC=2 if dq_atomic == "tma" else int(dq_atomic), num_warps=config.warps1,
                      num_stages=config.stages1))]
    if not dq_atomic:
        launches.append((_launch_dq, (cdiv(nq, config.block_m2), b * h),
                         (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), h, nq, nk, *scales),
                         dict(common, BLOCK_M=config.block_m2, BLOCK_N=config.block_n2, num_warps=config.warps2,
                              num_stages=config.stages2)))
    return launches
