"""FlashAttention-2 forward in Triton (notebook 05): one kernel that runs compiled on a GPU and, through the
Triton interpreter, on a CPU.

`flash_attention(q, k, v, *, causal=False, sm_scale=None, return_lse=False)` follows the course conventions
(utils.reference): `(batch, heads, seq, head_dim)` tensors, K/V with fewer heads than Q (GQA/MQA, read in place,
never copied), any strides, any sequence lengths >= 1 with Nq != Nk allowed, causal masking aligned bottom-right
(query i sees keys j <= i + Nk - Nq) and a zero output for a query that sees no key. Head dims 16 to 256; a head
dim that is not a power of two (80, 96) is padded to the next one with masks.

Dtypes: fp16, bf16 and fp32 on a GPU (16-bit inputs go through the tensor cores with an fp32 accumulator; fp32
inputs use exact fp32 dots, `input_precision="ieee"`, because TF32 rounding of Q·Kᵀ moves large logits by whole
units). On a CPU the interpreter runs fp32 and fp16; it has no bf16 arithmetic (NumPy has no bfloat16), so bf16
inputs on a CPU are computed in fp32 and the output is returned in bf16.

`flash_attention` is differentiable: its autograd Function saves (q, k, v, o, lse) and its backward calls
`utils.flash_triton_bwd.flash_attention_backward` (notebook 07). `flash_attention_forward` is the plain forward,
returning (o, lse) with the natural-log log-sum-exp, fp32, shape (batch, heads, seqlen_q), -inf where a query
sees no key.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils.checks import check_attention_inputs, check_bool, resolve_scale

HEAD_DIMS = tuple(range(16, 257))           # any head dim from 16 to 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634                  # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453                    # ln(2): back from base 2 to natural logs for the lse


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, lo, hi,
                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of the Q block against the key blocks [lo, hi). MASKED=False: every key of every block is
    visible to every query of the Q block, so no score is masked (the loop body is pure matmul + softmax)."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:  # the last, ragged key block (and, when causal, the blocks crossing the diagonal)
            kv_mask = cols[:, None] < seqlen_k
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
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
        # Running maximum in base-2 units: qk_scale = sm_scale * log2(e), so exp2 below is the softmax's exp.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:  # a row that has seen no key yet keeps m = -inf; subtract 0 there instead (-inf - -inf = nan)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        else:
            m_sub = m_ij
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)                                    # rescales what came before
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# Sequence lengths and head counts change from call to call: specializing on them (Triton otherwise compiles a
# variant per "divisible by 16" / "equal to 1") would only multiply compilations.
@triton.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k"])
def flash_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ob, stride_oh, stride_om, stride_od,
                     heads, group, seqlen_q, seqlen_k, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head) against all the keys they may see.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Query head h reads K/V head h // group (GQA without copies).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # 64-bit (batch, head) offsets: large batches times heads times seq times dims overflow 32 bits.
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    q_mask = offs_m[:, None] < seqlen_q
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Split the keys in two ranges: [0, n_full) every query of this block sees (whole blocks, no masking),
    # [n_full, n_end) needs masks (the ragged last block; when causal, the blocks crossing the diagonal).
    causal_offset = seqlen_k - seqlen_q          # bottom-right alignment: query i sees keys j <= i + offset
    if CAUSAL:
        n_full = tl.maximum(start_m + causal_offset + 1, 0)          # keys the *first* query of the block sees
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)  # ... the last one sees
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

    # Rows that saw no key (causal with Nq > Nk) have l = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    o_mask = offs_m[:, None] < seqlen_q
    if BLOCK_D != HEAD_DIM:
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def pick_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> Config:
    """Block sizes, warps and pipeline stages for one launch; chosen per head dim by measurement on an H200.

    In the interpreter the blocks only trade Python overhead against wasted padding, so they are small.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type != "cuda":
        return Config(32, 32, 4, 1)
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: small tiles keep registers in check
        return Config(64 if block_d <= 64 else 32, 32, 4, 2)
    if block_d <= 128:  # measured on an H200, bf16, D=64 and 128: ahead of (128,64,4,3), (128,128,8,3), (64,64,4,3)
        return Config(128, 64, 8, 3)
    return Config(64, 64, 8, 2)


def _launch(q, k, v, causal, scale, config: Config | None = None):
    """Run the kernel on validated inputs; returns (o, lse). `config` overrides the block sizes (tests)."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    config = config or pick_config(d, q.dtype, q.device)
    block_d = max(16, triton.next_power_of_2(d))
    o = torch.empty(b, h, nq, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, nq, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(nq, config.block_m), b * h)
    flash_fwd_kernel[grid](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        h, h // hk, nq, nk, scale * LOG2E,
        HEAD_DIM=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    return o, lse


def _validate(q, k, v, causal, sm_scale):
    shape = check_attention_inputs(q, k, v, causal=causal, dtypes=DTYPES)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported by the Triton kernel; supported: "
                         f"{HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    if q.device.type == "cpu" and not triton_interpreting():
        raise ValueError("q is on the CPU but TRITON_INTERPRET is not 1: run utils.bootstrap.setup() (or set "
                         "TRITON_INTERPRET=1) before importing utils.flash_triton, or move the tensors to a GPU")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on {q.device}; the Triton kernel runs on CUDA devices or, interpreted, on the CPU")
    return shape, resolve_scale(sm_scale, shape.head_dim)


def triton_interpreting() -> bool:
    """Whether this module's kernels were defined for the interpreter."""
    return isinstance(flash_fwd_kernel, triton.runtime.interpreter.InterpretedFunction)


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None):
    """(o, lse) without autograd. lse: natural-log log-sum-exp of the scaled scores, fp32, (batch, heads,
    seqlen_q), -inf for a query that sees no key. bf16 on a CPU is computed in fp32 (see the module doc)."""
    _, scale = _validate(q, k, v, causal, sm_scale)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:  # the interpreter has no bf16 arithmetic
        o, lse = _launch(q.float(), k.float(), v.float(), causal, scale)
        return o.to(torch.bfloat16), lse
    return _launch(q, k, v, causal, scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward runs the Triton kernel; backward is notebook 07's kernel."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = flash_attention_forward(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.sm_scale = resolve_scale(sm_scale, q.shape[-1])
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        try:
            from utils.flash_triton_bwd import flash_attention_backward
        except ModuleNotFoundError as err:
            if err.name != "utils.flash_triton_bwd":
                raise
            raise NotImplementedError("the backward pass of flash_attention lives in utils/flash_triton_bwd.py "
                                      "(notebook 07), which is not there yet") from None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, *, causal=False, sm_scale=None, return_lse=False):
    """FlashAttention-2 forward in Triton: softmax(Q Kᵀ · sm_scale) V, differentiable.

    Returns O, shaped and typed like q (contiguous), or (O, lse) with return_lse=True (lse: fp32,
    (batch, heads, seqlen_q), natural log, -inf for a query that sees no key).
    """
    check_bool("return_lse", return_lse)
    _validate(q, k, v, causal, sm_scale)  # before autograd, so errors point at the call
    o, lse = FlashAttentionFunction.apply(q, k, v, causal, sm_scale)
    return (o, lse) if return_lse else o
