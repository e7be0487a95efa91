"""FP8 (e4m3) attention forward in Triton, as notebook 11 teaches it: notebook 05's kernel with both products in FP8.

What changes from utils.tiled.forward:
- Q, K and V arrive as torch.float8_e4m3fn, with fp32 scales: one per block of `scale_block` rows of Q and of K
  (per batch and head), one for all of V. Both products run on FP8 tensor cores (twice bf16's rate on Hopper)
  and accumulate in fp32.
- V arrives transposed, (batch, kv_heads, head_dim, seq), seq contiguous: laid out for the second product. On
  Hopper the FP8 wgmma wants its B operand K-major (the reduction dimension contiguous); in P·V the reduction
  runs over the keys, so V is stored with the keys contiguous. (Q·Kᵀ needs nothing: K's rows, head_dim
  contiguous, are already K-major for it.)
- Scores: the fp32 product of the FP8 tiles times the row's Q scale and the column's K scale (each row and
  column reads its own block's scale, so tiles and scale blocks need not line up).
- P = exp2(s - m) lies in [0, 1] and is cast to e4m3 with a fixed scale of 1 before P·V, as FlashAttention-3
  does; the row sum l adds the fp32 P. V's scale multiplies the output once, at the end.
- Each P·V product starts from a zero accumulator and is added to the running output in fp32: on sm_90 Triton
  lets an FP8 dot accumulate with the tensor core's reduced precision (max_num_imprecise_acc), so the sum over
  all key blocks is kept out of it.

Conventions otherwise as notebook 05's: GQA (K/V heads read in place), Nq != Nk, causal masks aligned
bottom-right, a query that sees no key gives 0 and lse -inf, head dims 16 to 256 (padded to a power of two, at
least 32: an FP8 dot reduces over 32 at a time). The output is bf16, fp16 or fp32. utils.fp8.study emulates
this arithmetic in float64 (attention_fp8_emulated with block_n = the kernel's block_n).

On a CPU the Triton interpreter runs it. The interpreter loads FP8 tensors and multiplies FP8 tiles exactly, but
its fp32 -> fp8 cast (of P) drops the carry when rounding overflows the mantissa (0.49 becomes 0.25;
triton-lang/triton#11897): fix_interpreter_fp8_casts() swaps in PyTorch's rounding, and the launcher calls it
for CPU tensors. It has no bf16 arithmetic either: a bf16 output is computed in fp32 there and converted.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from utils import gpu
from utils.checks import (check_attention_inputs, check_bool, check_device, check_query_key_shapes, positive_int,
                          resolve_scale)
from utils.fp8 import quant
from utils.tiled.forward import LOG2E, Config, check_config, first_that_launches, smem_estimate

HEAD_DIMS = range(16, 257)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# FP8 tiles are half the bytes of bf16 ones, so 128 keys per step fit where bf16 takes 64. At least 32 keys per
# step: P·V reduces over the keys, and an FP8 dot over at least 32. 64 queries, 4 warps: the fastest of the sweep
# on an H200 at N 8k and 16k, causal or not (images/11_fp8_sweep_h200.json).
H200_TILES = Config(64, 128, 4, 3)
LARGE_HEAD_TILES = Config(128, 64, 8, 2)      # head dim 256
INTERPRETER_TILES = Config(32, 32, 4, 1)


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, offs_m, offs_n, offs_d, lo, hi, stride_kn,
                   stride_vn, seqlen_k, scale_block, causal_offset, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the key blocks [lo, hi) into the running max m_i, sum l_i and output acc of one Q tile.
    q_scale: each query's Q scale times sm_scale · log2(e). MASKED=False: every query sees every key here."""
    k_ptrs += lo * stride_kn
    vt_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:  # keys past the end read as 0 (a scale of 1); padded head-dim rows and columns too
            k = tl.load(k_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_d[:, None] < HEAD_DIM) & (cols[None, :] < seqlen_k), other=0.0)
            k_scale = tl.load(ks_ptr + cols // scale_block, mask=cols < seqlen_k, other=1.0)
        elif BLOCK_D != HEAD_DIM:  # a head dim padded to BLOCK_D
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
            k_scale = tl.load(ks_ptr + cols // scale_block)
        else:
            k = tl.load(k_ptrs)
            vt = tl.load(vt_ptrs)
            k_scale = tl.load(ks_ptr + cols // scale_block)
        qk = tl.dot(q, tl.trans(k))                            # FP8 x FP8 -> fp32, (BLOCK_M, BLOCK_N)
        t = qk * k_scale[None, :]                              # the scores but for Q's scale
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            t = tl.where(keep, t, float("-inf"))
        # Q's scale is positive: the row max can be taken first, and s - m is then one multiply-add a score.
        m_ij = tl.maximum(m_i, tl.max(t, 1) * q_scale)
        m_sub = m_ij
        if MASKED:  # a row that has seen no key yet keeps m = -inf: subtract 0 (-inf - -inf would be nan)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(t * q_scale[:, None] - m_sub[:, None])   # in [0, 1]: e4m3 holds it with a scale of 1
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)                       # the sum of the fp32 P, before its rounding
        pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))          # FP8 x FP8 -> fp32, from a zero accumulator
        acc = acc * alpha[:, None] + pv                        # the running sum in full fp32
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        vt_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def fp8_fwd_kernel(Q, K, VT, QS, KS, VS, O, LSE,
                   stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vd, stride_vn, stride_ob, stride_oh, stride_om, stride_od,
                   heads, group, seqlen_q, seqlen_k, q_blocks, k_blocks, scale_block, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   CAUSAL: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head) against every key they see.
    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Query head h reads K/V head h // group.
    QS: (batch, heads, q_blocks) and KS: (batch, kv_heads, k_blocks) fp32, contiguous; VS: one fp32."""
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
    vt_base = VT + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    vt_ptrs = vt_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn    # a (BLOCK_D, BLOCK_N) tile
    ks_ptr = KS + (b * (heads // group) + h_kv).to(tl.int64) * k_blocks
    rows = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=rows, other=0.0)
    # Each query's Q scale with the softmax scale and log2(e) folded in: one factor per row for the three.
    # Rows past the end get a scale of 1: any positive one (their q is 0), so that -inf * scale stays -inf.
    q_scale = tl.load(QS + pid_bh.to(tl.int64) * q_blocks + offs_m // scale_block, mask=offs_m < seqlen_q,
                      other=1.0) * qk_scale

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
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, offs_m, offs_n, offs_d,
                                   0, n_full, stride_kn, stride_vn, seqlen_k, scale_block, causal_offset,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL)
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, offs_m, offs_n, offs_d,
                                   n_full, n_end, stride_kn, stride_vn, seqlen_k, scale_block, causal_offset,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL)

    # Rows that saw no key (causal, Nq > Nk) have l = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0.0
    acc = acc * (tl.load(VS) / tl.where(seen, l_i, 1.0))[:, None]        # V's scale, once, with the 1/l
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)   # ln 2: natural log
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
             mask=rows)


def fix_interpreter_fp8_casts() -> bool:
    """Make the Triton interpreter round fp32/fp16 -> float8e4nv casts correctly: to nearest, ties to even,
    saturating at ±448 as the GPU's cvt.rn.satfinite does, by PyTorch's conversion. The interpreter's own
    (Triton 3.7) drops the carry when the rounding overflows the mantissa, so p = 0.49 becomes 0.25
    (triton-lang/triton#11897). Other casts are left to it. Returns whether it changed anything (once)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "course_fixed", False):
        return False

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (dst_type.scalar == tl.float8e4nv and src.data.dtype in (np.float32, np.float16)
                and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE):
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).clamp(-quant.FP8_MAX, quant.FP8_MAX)
            return interpreter.TensorHandle(x.to(quant.FP8).view(torch.uint8).numpy(), dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp.course_fixed = True
    builder.create_fp_to_fp = create_fp_to_fp
    return True


def pick_config(head_dim: int, smem: int | None = None) -> Config:
    """The tiles for a head dim on a GPU of `smem` bytes of shared memory per block (None: an H200's, see
    H200_TILES)."""
    return candidate_tiles(head_dim, smem)[0]


def candidate_tiles(head_dim: int, smem: int | None = None) -> list[Config]:
    """pick_config's tiles, then the ones to try if Triton refuses them (utils.tiled.forward's
    first_that_launches), each within `smem` by smem_estimate: fewer stages, then fewer queries per program.
    The keys per step stay: they decide where P is rounded, which the emulation repeats."""
    preferred = H200_TILES if head_dim <= 128 else LARGE_HEAD_TILES
    if smem is None:
        return [preferred]
    fewer = [preferred._replace(num_stages=s) for s in range(preferred.num_stages - 1, 0, -1)]
    smaller = (preferred, *fewer, Config(32, preferred.block_n, 4, 1))
    fits = [c for c in dict.fromkeys(smaller) if smem_estimate(c, head_dim, 1) <= smem]
    return fits or [smaller[-1]]


def check_fp8_config(config) -> Config:
    """`config`, or a TypeError/ValueError: a utils.tiled.forward.Config with power-of-two blocks, block_n >= 32."""
    check_config(config)
    if config.block_n < 32:
        raise ValueError(f"config.block_n must be at least 32 (an FP8 dot reduces over 32 keys at a time), got "
                         f"{config.block_n}")
    return config


def _check_fp8_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != quant.FP8:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.float8_e4m3fn (utils.fp8.quant)")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    return t


def _check_scales(name: str, t, shape: tuple, device) -> torch.Tensor:
    """`t` as a contiguous fp32 tensor, or a TypeError/ValueError naming `name` unless it has `shape`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of scales, got dtype {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; they must match")
    return t.to(torch.float32).contiguous()


def check_quantized_inputs(q, k, vt, q_scale, k_scale, v_scale, scale_block, causal, out_dtype):
    """fp8_attention_quantized's checks, shared by the FP8 kernels: a TypeError/ValueError naming the argument, or
    ((b, h, nq, hk, nk, d), q_scale, k_scale, v_scale) with the scales as contiguous fp32 (v_scale 0-dim)."""
    for name, t in (("q", q), ("k", k), ("vt", vt)):
        _check_fp8_tensor(name, t)
    check_bool("causal", causal)
    b, h, hk, nq, nk, d = check_query_key_shapes(q, k)
    if tuple(vt.shape) != (b, hk, d, nk):
        raise ValueError(f"vt must be V transposed, (batch, kv_heads, head_dim, seqlen_k) = {(b, hk, d, nk)}, got "
                         f"{tuple(vt.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported: the kernel takes 16 to 256")
    for name, t in (("k", k), ("vt", vt)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    positive_int("scale_block", scale_block)
    q_scale = _check_scales("q_scale", q_scale, (b, h, math.ceil(nq / scale_block)), q.device)
    k_scale = _check_scales("k_scale", k_scale, (b, hk, math.ceil(nk / scale_block)), q.device)
    if not isinstance(v_scale, torch.Tensor) or v_scale.numel() != 1:
        raise TypeError(f"v_scale must be a tensor of one number, got {type(v_scale).__name__}"
                        + (f" of shape {tuple(v_scale.shape)}" if isinstance(v_scale, torch.Tensor) else ""))
    v_scale = _check_scales("v_scale", v_scale, tuple(v_scale.shape), q.device).reshape(())
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {', '.join(str(t) for t in OUT_DTYPES)}, got {out_dtype}")
    return (b, h, nq, hk, nk, d), q_scale, k_scale, v_scale


def fp8_attention_quantized(q, k, vt, q_scale, k_scale, v_scale, *, scale_block: int, causal: bool = False,
                            sm_scale=None, out_dtype=torch.bfloat16, config=None):
    """The kernel on tensors already quantised: (o, lse).

    q: (batch, heads, seqlen_q, head_dim), k: (batch, kv_heads, seqlen_k, head_dim), vt: V transposed,
    (batch, kv_heads, head_dim, seqlen_k) (any strides; seq contiguous is the fast layout), all
    torch.float8_e4m3fn. q_scale: (batch, heads, ceil(seqlen_q / scale_block)) and k_scale: (batch, kv_heads,
    ceil(seqlen_k / scale_block)), one per block of rows (utils.fp8.quant.quantize_per_block); v_scale: one number
    (a 0-dim or 1-element tensor). sm_scale defaults to 1/sqrt(head_dim). o: out_dtype (bf16, fp16 or fp32),
    (batch, heads, seqlen_q, head_dim), contiguous; lse: fp32, (batch, heads, seqlen_q), natural log, of the scores
    the FP8 inputs give."""
    (b, h, nq, hk, nk, d), q_scale, k_scale, v_scale = check_quantized_inputs(
        q, k, vt, q_scale, k_scale, v_scale, scale_block, causal, out_dtype)
    scale = resolve_scale(sm_scale, d)
    check_device("q", q, "triton")
    if config is None and q.is_cuda:   # the first tiles Triton can launch here (utils.tiled.forward)
        return first_that_launches(lambda tiles: fp8_attention_quantized(
            q, k, vt, q_scale, k_scale, v_scale, scale_block=scale_block, causal=causal, sm_scale=scale,
            out_dtype=out_dtype, config=tiles), candidate_tiles(d, gpu.shared_memory_per_block(q.device)))
    config = check_fp8_config(INTERPRETER_TILES if config is None else config)

    kernel_dtype = out_dtype
    if q.device.type == "cpu":
        fix_interpreter_fp8_casts()
        if out_dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic: fp32 here, converted below
            kernel_dtype = torch.float32
    o = torch.empty((b, h, nq, d), dtype=kernel_dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(nq, config.block_m), b * h)
    fp8_fwd_kernel[grid](q, k, vt, q_scale, k_scale, v_scale, o, lse,
                         *q.stride(), *k.stride(), *vt.stride(), *o.stride(),
                         h, h // hk, nq, nk, q_scale.shape[-1], k_scale.shape[-1], scale_block, scale * LOG2E,
                         HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                         BLOCK_D=max(32, triton.next_power_of_2(d)), CAUSAL=causal,
                         num_warps=config.num_warps, num_stages=config.num_stages)
    return o.to(out_dtype), lse


def quantize_inputs(q, k, v, *, block: int = 64, rotate: bool = False, seed: int = 0):
    """(q_fp8, k_fp8, vt_fp8, q_scale, k_scale, v_scale): what fp8_attention_quantized takes. Q and K get one scale
    per `block` rows, after the random Hadamard rotation from `seed` when `rotate`; V one scale, and is transposed
    to (batch, kv_heads, head_dim, seq), contiguous (after the cast: a copy of 1-byte elements)."""
    positive_int("block", block)
    check_bool("rotate", rotate)
    if rotate:
        q, k = quant.rotate(q, k, quant.hadamard(q.shape[-1], seed=seed, device=q.device))
    q8, q_scale = quant.quantize_per_block(q, block)
    k8, k_scale = quant.quantize_per_block(k, block)
    v8, v_scale = quant.quantize_per_tensor(v)
    return q8, k8, v8.transpose(-2, -1).contiguous(), q_scale, k_scale, v_scale


def fp8_attention_forward(q, k, v, *, causal: bool = False, sm_scale=None, block: int = 64, rotate: bool = False,
                          out_dtype=torch.bfloat16, config=None, seed: int = 0):
    """(o, lse) of attention on fp16/bf16/fp32 q, k, v (batch, heads, seq, head_dim), computed in FP8: Q and K
    quantised with one scale per `block` rows (after a random Hadamard rotation from `seed` when `rotate`), V with
    one scale, then fp8_attention_quantized. o: out_dtype; lse: fp32, natural log."""
    shape = check_attention_inputs(q, k, v, causal=causal, dtypes=INPUT_DTYPES, runs_on="triton")
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported: the kernel takes 16 to 256")
    scale = resolve_scale(sm_scale, shape.head_dim)
    positive_int("block", block)
    check_bool("rotate", rotate)
    if rotate and shape.head_dim & (shape.head_dim - 1):
        raise ValueError(f"rotate needs a power-of-two head_dim (a Hadamard matrix), got {shape.head_dim}")
    q8, k8, vt8, q_scale, k_scale, v_scale = quantize_inputs(q, k, v, block=block, rotate=rotate, seed=seed)
    return fp8_attention_quantized(q8, k8, vt8, q_scale, k_scale, v_scale, scale_block=block, causal=causal,
                                   sm_scale=scale, out_dtype=out_dtype, config=config)
