"""The backward pass of the course's tensor-core CUDA kernel (worklog notebook 06bw, section 6;
utils/native/src/flash_mma_bwd.cu).

- `flash_mma_forward(q, k, v)` -> (o, lse): the registry's "cuda" forward (utils.native.build.MMA_DEFAULT_STEP),
  which also writes the log-sum-exp the backward rebuilds P from.
- `flash_mma_backward(do, q, k, v, o, lse)` -> (dq, dk, dv), as of one of BWD_STEPS, the backward's worklog
  (utils/native/src/flash_mma_bwd_steps.cuh, one struct per step): "atomic_dq" (1) one kernel per block of keys
  computes dK and dV and adds its share of dQ with fp32 atomics, as FlashAttention-2 does; "dq_pass" (2) the same
  kernel without dQ, then a kernel per block of queries that recomputes S and dP and writes dQ once (no atomics:
  deterministic, two more matmuls); "narrow_rows" (3) 32 queries per step instead of 64; "two_blocks" (4) and
  two blocks per SM at D = 64; "per_head_dim" (5) tiles and occupancy chosen per head dim; "unroll_two" (6)
  partly unrolled k loops, which end the spills at D = 128;
  "mask_after" (7) Pᵀ's exponentials before its mask, which then takes no branch; "warp_tiles" (8) FlashAttention-2's
  32 x 32 warp tiles, Pᵀ and dSᵀ through shared memory; "hoisted" (9) every copy and ldmatrix address worked out
  once, before the loop; "wide_queries" (10) 128 queries per step at D = 64; "store_matrix" (11) Pᵀ and dSᵀ
  stored by stmatrix on sm_90; "pair_dq" (12) dQ added with 8-byte atomics, no shuffles; "dq_between" (13)
  step 11 with dQ between dV and dK, FlashAttention-2's order; "prepare" (14) step 11 with lse2, delta and dQ's
  scale and cast by two small kernels; "padded_dq" (15) dQ's accumulator padded, its atomics without a row
  test; "lse_by_thread" (16) lse2 and delta in each thread's read order; "pairs_between" (17) step 12's atomics
  in step 13's place; "split_kv" (18) dV in warps 0-3, dK in warps 4-7; "stagger" (19) each block's walk over
  the query blocks starting at a block of its own (the default). 06bw compares the steps from their stored runs.
- `flash_mma_attention(q, k, v)`: differentiable attention with both.
- `flash_attention_cuda(q, k, v)`: the registry's "cuda": the kernels of utils.native.kernels without a gradient
  (flash_mma, or flash_tiled where the tensor cores cannot run), flash_mma_attention when a gradient is wanted.

D = rowsum(dO ∘ O) and lse·log2(e), padded so that the kernels read them in whole tiles, are prepared in torch
(backward_inputs) up to step 13, and by the extension's prepare kernel from step 14.
"""
from __future__ import annotations

import math
import warnings

import torch

from utils import gpu
from utils.native import build as native_build, kernels as native_kernels
from utils.checks import CUDA_GRID_Y, check_attention_inputs, check_batch_heads, check_device, resolve_scale
from utils.native.kernels import (CUDA_HEAD_DIMS, FLASH_DTYPES, MMA_HEAD_DIMS, check_mma_capability, flash_mma,
                                  flash_tiled)
from utils.eager.backward import check_backward_inputs

BWD_STEPS = ("atomic_dq", "dq_pass", "narrow_rows", "two_blocks", "per_head_dim", "unroll_two", "mask_after",
             "warp_tiles", "hoisted", "wide_queries", "store_matrix", "pair_dq", "dq_between", "prepare", "padded_dq",
             "lse_by_thread", "pairs_between", "split_kv", "stagger")
BWD_DEFAULT_STEP = "stagger"  # the fastest measured (images/06b_bwd_steps1619_h200.json)
LSE_PAD = 128  # kLsePad in utils/native/src/flash_params.h
LOG2E = 1.4426950408889634

_EXTENSIONS: dict = {}


def _extension(q):
    capability = gpu.capability(q.device)
    native_kernels.check_mma_capability(capability)
    if capability not in _EXTENSIONS:  # load() once: its check for edited sources costs ~30 µs a call
        _EXTENSIONS[capability] = native_build.load("flash_mma_bwd")
    return _EXTENSIONS[capability]


def flash_mma_forward(q, k, v, *, causal=False, sm_scale=None):
    """(o, lse): the tensor-core forward of notebook 06b and the natural-log log-sum-exp of the scaled scores,
    fp32 (batch, heads, seqlen_q), -inf for a query that sees no key. fp16/bf16, D = 64 or 128, sm_80+."""
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=native_kernels.MMA_HEAD_DIMS,
                                   dtypes=native_kernels.MMA_DTYPES, max_batch_heads=CUDA_GRID_Y)
    scale = resolve_scale(sm_scale, shape.head_dim)
    check_device("q", q, "cuda")
    ext = _extension(q)
    o, lse = ext.flash_mma_bwd_forward(*(native_kernels._aligned(t) for t in (q, k, v)), causal, scale)
    return o, lse


def backward_inputs(do, o, lse):
    """(lse2, delta), fp32 (batch · heads, seqlen_q padded to LSE_PAD): lse·log2(e) with +inf for rows that see no
    key, and rowsum(dO ∘ O); +inf and 0 in the padding, so that P and dS are 0 there."""
    b, h, n, _ = o.shape
    padded = math.ceil(n / LSE_PAD) * LSE_PAD
    lse2 = torch.full((b * h, padded), math.inf, dtype=torch.float32, device=o.device)
    delta = torch.zeros((b * h, padded), dtype=torch.float32, device=o.device)
    lse = lse.reshape(b * h, n).float()
    lse2[:, :n] = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    delta[:, :n] = (do.float() * o.float()).sum(-1).reshape(b * h, n)
    return lse2, delta


def flash_mma_backward(do, q, k, v, o, lse, *, causal=False, sm_scale=None, step: str = BWD_DEFAULT_STEP):
    """Gradients (dq, dk, dv) of attention on tensor cores, from the forward's o and lse (flash_mma_forward).

    q (B, H, Nq, D), k and v (B, Hkv, Nk, D), Hkv dividing H (GQA: dk, dv per K/V head, summed over the query
    heads of a group); do and o like q; lse fp32 (B, H, Nq). fp16 or bf16, D = 64 or 128, an sm_80+ GPU; causal
    aligned bottom-right. `step`: one of BWD_STEPS."""
    if step not in BWD_STEPS:
        raise ValueError(f"step must be one of {BWD_STEPS}, got {step!r}")
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale,
                                         head_dims=native_kernels.MMA_HEAD_DIMS, dtypes=native_kernels.MMA_DTYPES)
    check_batch_heads(shape.batch, shape.heads)  # the dQ pass's grid has a row per (batch, head), as the forward's
    check_device("q", q, "cuda")
    ext = _extension(q)
    number = BWD_STEPS.index(step) + 1
    do, q, k, v, o = (native_kernels._aligned(t) for t in (do, q, k, v, o))
    # from step 14: lse2 and delta, and dQ's scale and cast, by two small kernels instead of torch's passes
    lse2, delta = ext.flash_mma_bwd_prepare(do, o, lse.contiguous()) if number >= 14 else backward_inputs(do, o, lse)
    dq, dk, dv = ext.flash_mma_bwd_backward(do, q, k, v, lse2, delta, causal, scale, number)
    if number >= 14:  # dq: the atomics' fp32 accumulator (step 15's with padded rows)
        dq = ext.flash_mma_bwd_finish(dq, q, scale)
    elif step != "dq_pass":  # the atomics' accumulator: fp32 and not yet scaled
        dq = (dq * scale).to(q.dtype)
    return dq, dk, dv


class FlashMmaFunction(torch.autograd.Function):
    """Autograd: the forward saves (q, k, v, o, lse); the backward runs `flash_mma_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, step):
        o, lse = flash_mma_forward(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.step = causal, sm_scale, step
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = flash_mma_backward(do, q, k, v, o, lse, causal=ctx.causal, sm_scale=ctx.sm_scale, step=ctx.step)
        return *grads, None, None, None


def flash_mma_attention(q, k, v, *, causal=False, sm_scale=None, step: str = BWD_DEFAULT_STEP):
    """Differentiable tensor-core attention: `flash_mma_forward`, and `flash_mma_backward` in `step`."""
    if step not in BWD_STEPS:
        raise ValueError(f"step must be one of {BWD_STEPS}, got {step!r}")
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=native_kernels.MMA_HEAD_DIMS,
                                   dtypes=native_kernels.MMA_DTYPES, max_batch_heads=CUDA_GRID_Y)
    resolve_scale(sm_scale, shape.head_dim)  # errors at the call, not inside autograd
    check_device("q", q, "cuda")
    return FlashMmaFunction.apply(q, k, v, causal, sm_scale, step)


def flash_attention_cuda(q, k, v, *, causal=False, sm_scale=None):
    """The course's CUDA FlashAttention forward (registry name "cuda"): `flash_mma`'s final step.

    What the tensor cores cannot take runs `flash_tiled` (CUDA cores, fp32 arithmetic) instead: float32 inputs
    on any GPU, and every input on GPUs older than sm_80 (with a warning there, e.g. Colab's T4).
    Differentiable where the tensor cores run (flash_mma_attention); a gradient asked of the fallback is an error.
    Head dims: any multiple of 16 up to 128 (CUDA_HEAD_DIMS); the tensor cores take 64 and 128, and the others
    are padded with zeros to the next of those (autograd carries the gradients through the padding).
    """
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=CUDA_HEAD_DIMS, dtypes=FLASH_DTYPES,
                                   max_batch_heads=CUDA_GRID_Y)
    tensor_cores = q.is_cuda and q.dtype != torch.float32 and gpu.capability(q.device) >= (8, 0)
    if tensor_cores and shape.head_dim not in MMA_HEAD_DIMS:
        d, padded = shape.head_dim, next(n for n in MMA_HEAD_DIMS if n >= shape.head_dim)
        q, k, v = (torch.nn.functional.pad(t, (0, padded - d)) for t in (q, k, v))
        return flash_attention_cuda(q, k, v, causal=causal, sm_scale=resolve_scale(sm_scale, d))[..., :d]
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if wants_grad and q.dtype == torch.float32:
        raise TypeError(f"the CUDA backward (notebook 06b) takes float16 or bfloat16; q has dtype {q.dtype} "
                        f"and needs a gradient (convert it, or use the registry's 'triton')")
    if q.is_cuda and q.dtype != torch.float32:
        if tensor_cores:
            if wants_grad:
                return flash_mma_attention(q, k, v, causal=causal, sm_scale=sm_scale)
            return flash_mma(q, k, v, causal=causal, sm_scale=sm_scale)
        if wants_grad:
            check_mma_capability(gpu.capability(q.device))  # the RuntimeError that says why
        warnings.warn(f"{gpu.name(q.device)} has no bf16 mma.sync (sm_80+): running the "
                      f"CUDA-core kernel flash_tiled instead of the tensor-core one", stacklevel=2)
    return flash_tiled(q, k, v, causal=causal, sm_scale=sm_scale)
