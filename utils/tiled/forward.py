"""FlashAttention-2 forward in Triton, as notebook 05 teaches it: one kernel, one launch, read top to bottom.

Conventions as in utils.eager.reference: (batch, heads, seq, head_dim) tensors with any strides; K/V may have fewer
heads than Q (GQA, read in place); Nq != Nk allowed; causal masking aligned bottom-right (query i sees keys
j <= i + Nk - Nq), and a query that sees no key gets output 0 and lse -inf. Head dims 16 to 256, padded to a
power of two. fp16, bf16, fp32 (exact fp32 dots). On a CPU the Triton interpreter runs it; it has no bf16
arithmetic, so bf16 there is computed in fp32 and returned in bf16.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from utils import gpu
from utils.checks import check_attention_inputs, positive_int, resolve_scale

HEAD_DIMS = range(16, 257)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634   # exp(x) = exp2(x * log2(e)): the kernel works in base 2


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, lo, hi, stride_kn, stride_vn,
                   seqlen_k, causal_offset, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
            qk = tl.where(keep, qk, float("-inf"))
        # Online softmax in base 2: qk_scale = sm_scale * log2(e), so exp2 below is the softmax's exp.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_ij
        if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 (-inf - -inf would be nan)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)                                    # rescales what came before
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                     heads, group, seqlen_q, seqlen_k, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head) against every key they see.
    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Query head h reads K/V head h // group."""
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # [0, n_full): keys every query of the tile sees, in whole blocks, no masks. [n_full, n_end): the ragged
    # last block and, when causal, the blocks crossing the diagonal. Keys from n_end on are skipped.
    causal_offset = seqlen_k - seqlen_q          # bottom-right: query i sees keys j <= i + causal_offset
    if CAUSAL:
        n_full = tl.maximum(start_m + causal_offset + 1, 0)                             # the first query's keys
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)  # the last query's
    else:
        n_full = seqlen_k
        n_end = seqlen_k
    n_full = (n_full // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, 0, n_full,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, DOT_PRECISION)
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, n_full, n_end,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, DOT_PRECISION)

    # Rows that saw no key (causal, Nq > Nk) have l = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)   # ln 2: natural log
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
             mask=rows)


class Config(NamedTuple):
    """One launch's tiles: block_m queries per program, block_n keys per loop step, warps, pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The tiles chosen per head dim on an H200; smaller ones, in the order tried, where shared memory is smaller
# (a T4 has 64 KiB per block); small ones in the interpreter, where a tile is NumPy work.
H200_TILES = Config(128, 64, 8, 3)
SMALL_SMEM_TILES = (Config(64, 64, 4, 2), Config(64, 32, 4, 2), Config(32, 32, 4, 1), Config(16, 16, 4, 1))
INTERPRETER_TILES = Config(32, 32, 4, 1)


def smem_estimate(config: Config, head_dim: int, elem_bytes: int) -> int:
    """Shared memory a program needs, roughly: Q's tile once, K's and V's once per pipeline stage."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return elem_bytes * block_d * (config.block_m + config.num_stages * 2 * config.block_n)


def pick_config(head_dim: int, dtype: torch.dtype, smem: int | None = None) -> Config:
    """The tiles for a head dim and dtype, shrunk until they fit `smem` bytes of shared memory per block
    (None: an H200's choice)."""
    return candidate_tiles(head_dim, dtype, smem)[0]


def candidate_tiles(head_dim: int, dtype: torch.dtype, smem: int | None = None) -> list[Config]:
    """pick_config's tiles first, then the ones to try if Triton refuses them: the same with one stage fewer,
    then the small ones, each within `smem` by smem_estimate (see first_that_launches)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: small tiles keep registers in check
        preferred = Config(64 if block_d <= 64 else 32, 32, 4, 2)
    else:
        preferred = H200_TILES if block_d <= 128 else Config(64, 64, 8, 2)
    if smem is None:
        return [preferred]
    fewer_stages = preferred._replace(num_stages=max(1, preferred.num_stages - 1))
    fits = [c for c in dict.fromkeys((preferred, fewer_stages, *SMALL_SMEM_TILES))
            if smem_estimate(c, head_dim, dtype.itemsize) <= smem]
    return fits or [SMALL_SMEM_TILES[-1]]


def first_that_launches(launch, candidates):
    """launch(tiles) with each of `candidates` in turn until Triton takes one; the last one's error is raised.
    smem_estimate counts tiles, but Triton decides the buffers: a launch whose compiled kernel needs more shared
    memory than the GPU has raises OutOfResources (Triton 3.7 gives each pipelined loop its own buffers: 225 KiB
    for the H200's tiles at head dim 128, more than an A100's 163 KiB)."""
    *first, last = candidates
    for tiles in first:
        try:
            return launch(tiles)
        except OutOfResources:
            pass
    return launch(last)


def check_inputs(q, k, v, causal, sm_scale):
    """(shape, scale) of valid inputs; a TypeError or ValueError naming the argument otherwise."""
    shape = check_attention_inputs(q, k, v, causal=causal, dtypes=DTYPES, runs_on="triton")
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported: the kernel takes 16 to 256")
    return shape, resolve_scale(sm_scale, shape.head_dim)


def check_config(config, kind=Config):
    """`config`, or a TypeError/ValueError: a `kind` (a NamedTuple of tiles) of positive ints with power-of-two
    block sizes."""
    if not isinstance(config, kind):
        got = type(config)
        raise TypeError(f"config must be a {kind.__module__}.{kind.__name__} or None, got "
                        f"{'' if got.__module__ == 'builtins' else got.__module__ + '.'}{got.__name__}")
    for name, value in config._asdict().items():
        positive_int(f"config.{name}", value)
        if name.startswith("block") and value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two, got {value}")
    return config


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None, config=None):
    """(o, lse): o shaped and typed like q (contiguous); lse the natural-log log-sum-exp of each query's scaled
    scores, fp32, (batch, heads, seqlen_q), -inf where a query sees no key. `config`: tiles (None: pick_config)."""
    (b, h, hk, nq, nk, d), scale = check_inputs(q, k, v, causal, sm_scale)
    if config is None and q.is_cuda:   # the first of the tiles that fit this GPU that Triton can launch
        return first_that_launches(lambda tiles: flash_attention_forward(q, k, v, causal=causal, sm_scale=scale,
                                                                          config=tiles),
                                   candidate_tiles(d, q.dtype, gpu.shared_memory_per_block(q.device)))
    config = check_config(INTERPRETER_TILES if config is None else config)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        o, lse = flash_attention_forward(q.float(), k.float(), v.float(), causal=causal, sm_scale=scale,
                                         config=config)
        return o.to(torch.bfloat16), lse
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(nq, config.block_m), b * h)
    flash_fwd_kernel[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                           h, h // hk, nq, nk, scale * LOG2E,
                           HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                           BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=causal,
                           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                           num_warps=config.num_warps, num_stages=config.num_stages)
    return o, lse
