"""FlashAttention-2 backward kernels in Triton, tuned (notebook 07): the backward of the registry's "triton".

Three launches, in the order of FlashAttention-2 (Dao, 2023, Algorithm 2), with the dQ pass split off so that no
atomics are needed (the design of Triton's fused-attention tutorial, which recomputes P in a second loop for dQ):

1. `_bwd_preprocess`: D = rowsum(dO ∘ O) per query row, and the log-sum-exp in base 2 (rows that see no key get
   +inf, so that P = 2^(S·log2e − lse₂) is exactly 0 there), less LSE2_SHIFT (0 here; utils.explicit.backward
   shifts it by log2(scale) to compute scale·P);
2. `_bwd_dkdv`: one program per (K/V block, K/V head) keeps K_j, V_j, dK_j, dV_j on chip and loops over the Q
   blocks (of every query head of its GQA group) that see it, recomputing Pᵀ = exp(K Qᵀ·scale − lse);
3. `_bwd_dq`: one program per (Q block, query head) keeps Q_i, dO_i, dQ_i on chip and loops over the K/V blocks
   it sees.

Causal masking is aligned bottom-right (query i sees key j <= i + Nk − Nq). Tiles entirely above the diagonal are
skipped; only tiles that cross it, or the ragged end of the sequence, pay for a mask (a constexpr flag compiles
two versions of the inner loop). Pointer arithmetic with masks, any strides; on Hopper, at head dim 128, the tiles
the passes loop over come through TMA descriptors instead (`use_tma`), and so do the per-row lse₂ and D
that the dK/dV loop reads with each Q tile. The loads pinned either way and dQ added by the dK/dV pass (worklog
07w) live in utils.course.worklogs.triton_backward.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from utils import gpu
from utils.checks import AttentionShape, check_bool
from utils.eager.backward import check_backward_inputs
from utils.tiled.fast.forward import _forward, _kind, tma_supported
from utils.tiled.fast import launch
from utils.tiled.fast.launch import FastLauncher
from utils.triton_utils import cdiv

__all__ = ["flash_attention", "FlashAttentionFunction", "flash_attention_backward", "Config", "pick_config",
           "use_tma", "HEAD_DIMS", "DTYPES"]

HEAD_DIMS = tuple(range(16, 257))   # as the forward (utils.tiled.fast.forward): padded to a power of two
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Config:
    """Launch parameters of the two main kernels. dK/dV pass: tiles of block_n1 keys (kept on chip) by block_m1
    queries (looped over); dQ pass: block_m2 queries (kept) by block_n2 keys (looped over)."""
    block_m1: int = 32
    block_n1: int = 128
    warps1: int = 4
    stages1: int = 3
    block_m2: int = 128
    block_n2: int = 32
    warps2: int = 4
    stages2: int = 3

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if name.startswith("block") and value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")


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
    """Launch parameters. 16-bit, head dims up to 128: the tiles the sweep of `python -m
    utils.course.bench.backward_tiles` chose for each pass on an H200 (notebook 07). Smaller tiles for fp32/fp64
    (exact dots, twice the bytes) and head dims above 128 (registers); mid-sized tiles in the interpreter, where
    each program is NumPy work and fewer, larger tiles run fastest. `smem`: bytes of shared memory per block of
    the GPU (utils.gpu.shared_memory_per_block); the tiles shrink until they fit. None: an H200's choice."""
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
    fits = [c for c in _candidates(preferred) if smem_estimate(c, head_dim, elem_bytes) <= smem
            and (smem, c) not in _TOO_BIG]
    return fits[0] if fits else SMALL_SMEM_CONFIGS[-1]


def _candidates(preferred: Config) -> tuple[Config, ...]:
    """The tiles tried in order: the preferred ones, with one stage fewer (the buffers of a stage are what a
    newer Triton allocates more of), then the small ones."""
    fewer = replace(preferred, stages1=max(1, preferred.stages1 - 1), stages2=max(1, preferred.stages2 - 1))
    return tuple(dict.fromkeys((preferred, fewer, *SMALL_SMEM_CONFIGS)))


# (shared memory per block, Config): tiles whose compiled kernels asked more shared memory than such a GPU has.
# smem_estimate is exact for the Triton it was fitted to; another version may allocate more (Triton 3.7 at head
# dim 128 on sm_90 asks 289 KiB for the H200's tiles, where 3.6 fits them in 227 KiB).
_TOO_BIG: set[tuple[int, Config]] = set()


def _drop_if_too_big(config: Config, smem: int | None) -> bool:
    """Never pick `config` again for GPUs of `smem` bytes per block; False when it is the last resort."""
    if smem is None or config == SMALL_SMEM_CONFIGS[-1] or (smem, config) in _TOO_BIG:
        return False
    _TOO_BIG.add((smem, config))
    _fitted_config.cache_clear()
    return True


def use_tma(head_dim: int, causal: bool) -> bool:
    """Whether the backward loads the looped-over tiles, and lse₂ and D with them, through TMA (where the inputs
    allow it: `utils.tiled.fast.forward.tma_supported`): at head dim 128 (worklog 07w, sections 2 and 3, compares the
    loads)."""
    return head_dim == 128


# --- kernels -------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2,
                    s_ob, s_oh, s_om, s_od, s_dob, s_doh, s_dom, s_dod,
                    H, N_Q, HEAD_DIM, LSE2_SHIFT,
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
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634 - LSE2_SHIFT)
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
                offs_n, offs_d, mask_d, N_Q, offset, qk_scale, start, end,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                TMA: tl.constexpr, STATS: tl.constexpr):
    """Accumulate dK_j, dV_j over the Q blocks [start, end): the tiles are transposed (keys × queries) so that
    Pᵀ and dSᵀ come out of the dots directly. TMA: Q and dO tiles come through the host's descriptors QD, DOD
    (indexed [batch, head, row, 0]; rows past the end read as zeros), else through pointers with masks.
    STATS: lse₂ and D come through descriptors LD, DD too (indexed [batch, head, row]), so that every load of
    the loop is a TMA copy."""
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
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV, QD, DOD, LD, DD,
              s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
              s_dob, s_doh, s_dom, s_dod, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd,
              H_KV, N_Q, N_K, qk_scale, sm_scale,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
              TMA: tl.constexpr, STATS: tl.constexpr):
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
                                 start, split, BLOCK_M, BLOCK_D, True, PRECISION, TMA, STATS)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE2 + row, DELTA + row, s_qm, s_qd, s_dom, s_dod,
                             QD, DOD, LD, DD, bhk // H_KV, h32, offs_n, offs_d, mask_d, N_Q, offset, qk_scale, split,
                             N_Q, BLOCK_M, BLOCK_D, False, PRECISION, TMA, STATS)
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

# Launched without Triton's per-call dispatch (utils.tiled.fast.launch).
_launch_preprocess, _launch_dkdv, _launch_dq = (FastLauncher(k) for k in (_bwd_preprocess, _bwd_dkdv, _bwd_dq))


class Choices(NamedTuple):
    """What flash_attention_backward checked and decided for one kind of call."""
    shape: AttentionShape
    scale: float
    config: Config
    tma: bool
    stats: bool
    upcast: bool          # bf16 in the interpreter: computed in fp32
    causal: bool
    acc: torch.dtype      # of the accumulators, D and lse₂
    block_d: int          # the head dim padded to a power of two
    lse_ready: bool       # lse is already of dtype `acc` and contiguous


_KINDS = launch.kind_cache()   # _call_key -> launch.Kind of Choices: the launch.MAX_KINDS used most recently


def _call_key(do, q, k, v, o, lse, causal, sm_scale, config):
    """Everything the checks, the choices and Triton's specialization of the launches depend on, for CUDA tensors
    and options of the expected types; None otherwise (such a call is checked every time)."""
    if not (type(causal) is bool and type(sm_scale) in (float, int, type(None))
            and type(config) in (Config, type(None))):
        return None
    return launch.kind_key((do, q, k, v, o, lse), (causal, sm_scale, config))


def _choose(do, q, k, v, o, lse, causal, sm_scale, config) -> Choices:
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
    # TMA where use_tma says so and the inputs allow it (asked only then: it costs host time); lse₂ and D
    # through descriptors too where their rows (seqlen_q fp32 values) are 16-byte aligned.
    tma = use_tma(shape.head_dim, causal) and tma_supported(q, k, v) and tma_supported(do, k, v)
    stats = tma and shape.seqlen_q % 4 == 0
    interpret = _interpreting()
    if q.device.type != "cuda" and not (interpret and q.device.type == "cpu"):
        raise ValueError(f"q is on {q.device}: the kernels need a CUDA device, or CPU tensors with "
                         "TRITON_INTERPRET=1 set before this module was imported")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return Choices(shape, scale, config, tma, stats, interpret and q.dtype == torch.bfloat16, causal,
                   acc, max(16, triton.next_power_of_2(shape.head_dim)), lse.dtype == acc and lse.is_contiguous())


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, sm_scale=None, config=None):
    """Gradients (dq, dk, dv) of attention from the forward's output `o` and log-sum-exp `lse`.

    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with Hkv dividing H (GQA: dk, dv come back with Hkv heads, the
    gradients of the query heads of a group summed); do and o like q; lse float (B, H, Nq), natural log, -inf for
    rows that see no key (their gradients are 0). Head dims 16 to 256 (padded to a power of two). dtypes: fp16, bf16, fp32,
    fp64; in the interpreter bf16 is computed in fp32 (NumPy has no bf16 arithmetic). Any strides.
    `config`: a Config (default: `pick_config`). The looped-over tiles (Q and dO in the dK/dV pass, K
    and V in the dQ pass) come through Hopper's TMA copy engine where `use_tma` says so and the inputs allow
    it (`utils.tiled.fast.forward.tma_supported`), and so do lse₂ and D when seqlen_q is a multiple of 4.

    The checks, the choices and the launches' fixed arguments are made once per kind of call (shapes, strides,
    dtypes, device, 16-byte alignment, options) and kept for the next call of that kind on a GPU, which then
    passes only its tensors (utils.tiled.fast.launch.Bound): at short sequence lengths the host's time per call is the
    call's time (notebook 05b, section 7).
    """
    key = _call_key(do, q, k, v, o, lse, causal, sm_scale, config)
    kind = launch.kind_of(_KINDS, key, lambda: _choose(do, q, k, v, o, lse, causal, sm_scale, config))
    if kind.choices.upcast:  # the interpreter has no bf16 arithmetic: computed in fp32
        grads = flash_attention_backward(*(t.float() for t in (do, q, k, v, o)), lse, causal=causal,
                                         sm_scale=sm_scale, config=config)
        return tuple(g.to(torch.bfloat16) for g in grads)
    try:
        return _run(kind, key is not None, do, q, k, v, o, lse)
    except OutOfResources:   # the estimate fit, the compiled kernel does not: pick again without these tiles
        smem = gpu.shared_memory_per_block(q.device)
        if config is not None or not _drop_if_too_big(kind.choices.config, smem):
            raise
        if key is not None:
            _KINDS.pop(key, None)
        return flash_attention_backward(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)


def backward_for_forward(forward_kind: launch.Kind, do, q, k, v, o, lse, *, causal, sm_scale):
    """flash_attention_backward of what a forward of kind `forward_kind` saved (FlashAttentionFunction calls
    this). That kind fixes the shapes, strides, dtypes and alignment of q, k, v, o and lse, so
    the backward's kinds of call are kept in it under the key of dO alone: one tensor's key instead of six, and
    less host time where a call's host time is its time (notebook 05b, section 7)."""
    key = launch.kind_key((do,), ())
    kind = forward_kind.derived.get(key) if key is not None else None
    if kind is not None:
        forward_kind.derived.move_to_end(key)   # a kind_cache(): the least recently used go first
        return _run(kind, True, do, q, k, v, o, lse)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)  # checks, keeps
    kept = key is not None and _KINDS.get(_call_key(do, q, k, v, o, lse, causal, sm_scale, None))
    if kept:
        launch.keep(forward_kind.derived, key, kept)
    return grads


# ---- the registry's "triton": the forward of utils.tiled.fast.forward with this backward ---------------------------------

class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward runs utils.tiled.fast.forward's kernel; backward is notebook 07's kernel, given the
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
    utils.tiled.fast.forward, the backward of this module).

    Returns O, shaped and typed like q (contiguous), or (O, lse) with return_lse=True (lse: fp32,
    (batch, heads, seqlen_q), natural log, -inf for a query that sees no key).
    """
    check_bool("return_lse", return_lse)
    kind = _kind(q, k, v, causal, sm_scale)  # the checks before autograd, so errors point at the call
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = FlashAttentionFunction.apply(q, k, v, causal, kind)
    else:  # nothing to differentiate: skip the autograd Function and its host time
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
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qd = dod = kd = vd = ld = dd = None
    if c.tma:   # host TMA descriptors: made at the kind's first call, then copied
        qd, dod, kd, vd, ld, dd = kind.descriptors((q, do, k, v, lse2, delta), lambda: _descriptors(
            c, q, do, k, v, lse2, delta))
    heads = ((o, do, lse, delta, lse2), (q, k, v, do, lse2, delta, dk, dv, qd, dod, ld, dd),
             (q, k, v, do, lse2, delta, dq, kd, vd))
    kind.launch(heads, lambda: _launches(c, q, k, v, do, o, dk, dv, dq), keep=keep)
    return dq, dk, dv


def _descriptors(choices: Choices, q, do, k, v, lse2, delta) -> tuple:
    """A call's host TMA descriptors, None where its choices load through pointers: Q and dO (tiles of block_m1
    rows), K and V (block_n2 rows), lse₂ and D (block_m1 values)."""
    config, tma, stats = choices.config, choices.tma, choices.stats

    def tile(t, rows):   # a box of `rows` rows of one (batch, head) of a (B, H, N, D) tensor
        return TensorDescriptor.from_tensor(t, [1, 1, rows, t.shape[-1]])

    return (*(tile(t, config.block_m1) if tma else None for t in (q, do)),
            *(tile(t, config.block_n2) if tma else None for t in (k, v)),
            *(TensorDescriptor.from_tensor(t, [1, 1, config.block_m1]) if stats else None for t in (lse2, delta)))


def _launches(choices: Choices, q, k, v, do, o, dk, dv, dq) -> list[tuple]:
    """(launcher, grid, trailing arguments, constexprs and options) of each launch of a kind of call; the
    trailing arguments (strides, sizes, scales) follow the leading tensors that flash_attention_backward makes."""
    (b, h, hk, nq, nk, d), scale, config, tma, stats = choices[:5]
    block_d = choices.block_d
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    # fp32 dots would use TF32 (10-bit mantissa) on tensor cores; gradients in fp32 are expected to be exact-ish.
    precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    common = dict(GROUP=h // hk, CAUSAL=choices.causal, HEAD_DIM=d, BLOCK_D=block_d, PRECISION=precision, ACC=acc,
                  TMA=tma)
    scales = (scale * LOG2E, scale)
    launches = [(_launch_preprocess, (cdiv(nq, 64), b * h), (*o.stride(), *do.stride(), h, nq, d, 0.0),
                 dict(BLOCK_M=64, BLOCK_D=block_d, ACC=acc)),
                (_launch_dkdv, (cdiv(nk, config.block_n1), b * hk),
                 (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), hk, nq, nk,
                  *scales),
                 dict(common, BLOCK_M=config.block_m1, BLOCK_N=config.block_n1, STATS=stats,
                      num_warps=config.warps1, num_stages=config.stages1)),
                (_launch_dq, (cdiv(nq, config.block_m2), b * h),
                 (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), h, nq, nk, *scales),
                 dict(common, BLOCK_M=config.block_m2, BLOCK_N=config.block_n2, num_warps=config.warps2,
                      num_stages=config.stages2))]
    return launches
