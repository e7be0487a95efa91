"""The backward of notebook 06c's Hopper kernel (worklog 06cw section 7): worklog 07w's Gluon backward in CUDA, on
wgmma and TMA (utils/native/src/hopper_backward.cu), and the registry's differentiable "cuda_hopper".

- `flash_hopper_backward(do, q, k, v, o, lse)` -> (dq, dk, dv), from the forward's o and lse
  (utils.native.hopper.flash_hopper_forward), in one of the steps below (`BWD_STEPS`; by default the head dim's
  `BWD_DEFAULT_STEPS`).
- `flash_hopper_attention(q, k, v)`: the forward, and this backward through autograd when an input requires grad.

The steps, each built on the one it names:

    atomic_dq      dQ added to global memory by 8-byte atomics from every thread
    reduce_dq      on atomic_dq: dQ staged in shared memory, added by a TMA reduce-add
    prefetch_s     on reduce_dq: the next tile's Sᵀ issued while dQ leaves
    bh_group       on reduce_dq: causal blocks launched key block by key block over groups of four
                   (batch, K/V head)s
    stsm_ds        on reduce_dq: dSᵀ stored with stmatrix
    stsm_uniform   on stsm_ds: the warpgroup index read from lane 0, so that ptxas keeps addresses uniform
    dq_first       on stsm_uniform: dQ issued before dK, and staged while dK runs
    desc_add       on stsm_uniform: each operand's wgmma descriptor built once and stepped by an addition
    edge_mask      on desc_add: the mask in a branch that only the tiles on the diagonal or past Nk take
    dv_late        on edge_mask: dV issued after dS, so that P's 16-bit fragments are not live beside Sᵀ and dPᵀ
    late_prefetch  on dv_late: the next Sᵀ issued while dQ leaves, after the last tile too (no branch that keeps
                   ptxas from pipelining it)
    late_group     on late_prefetch: the causal blocks launched as bh_group's
    rows80         on late_prefetch: 80-query tiles at D = 128, dQ computed transposed (dQᵀ = Kᵀ dSᵀ), as
                   FlashAttention-3 does
    rows80_group   on rows80: the causal blocks launched as bh_group's
    late_dq_first  on rows80_group: dQ issued before dK and staged while dK runs; dK waited for before the next Sᵀ
    frag_dq        on rows80_group: dQ staged in its accumulator's register order, 16 bytes a store, and added by
                   a dQ writer warp, one bulk reduce a consumer and tile; a last pass puts dQ back in rows
    early_lse      on frag_dq: the tile's lse2 values loaded into registers before the wait for Sᵀ
    dq_writer      on late_dq_first: dQ staged in rows, added by the writer warp (the consumer's two boxes by TMA)
    stagger        on late_dq_first: without a mask, each block's walk of a head's query blocks started at its
                   own (key block index mod their number), so that blocks running together add into other rows
    rows64         on late_dq_first: 64-query tiles at D = 128, as FlashAttention-3 and -4 take under a mask
    frag_dq_first  on late_dq_first: at D = 64, dQ staged in register order for the writer warp as frag_dq
                   stages it (FlashAttention-4's loop); at D = 128 it is late_dq_first
"""
from __future__ import annotations

import torch

from utils.checks import CUDA_GRID_Y, check_device
from utils.eager.backward import KernelPair, check_backward_inputs, wants_grad
from utils.native import build as native_build
from utils.native.hopper import _readable, flash_hopper, flash_hopper_forward, pick_by_head_dim

BWD_STEPS = ("atomic_dq", "reduce_dq", "prefetch_s", "bh_group", "stsm_ds", "stsm_uniform",
             "dq_first", "desc_add", "edge_mask", "dv_late", "late_prefetch",
             "late_group", "rows80", "rows80_group", "late_dq_first", "frag_dq",
             "early_lse", "dq_writer", "stagger", "rows64", "frag_dq_first")  # the kernel's kBwd* steps, in order
# the registry's step per head dim: the fastest measured there (06cw section 7)
BWD_DEFAULT_STEPS = {64: "frag_dq_first", 128: "late_dq_first"}


def bwd_default_step(head_dim: int) -> str:
    """The step `flash_hopper_backward` runs at `head_dim` when given none (BWD_DEFAULT_STEPS)."""
    return pick_by_head_dim(BWD_DEFAULT_STEPS, head_dim)


def flash_hopper_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, *, causal: bool = False, sm_scale=None, step: str | None = None):
    """Gradients (dq, dk, dv) of attention with wgmma and TMA (utils/native/src/hopper_backward.cu), on an sm_90 GPU
    only, from the forward's o and its natural-log lse, fp32 (batch, heads, seqlen_q), -inf for a row that sees no
    key (as `flash_hopper_forward` returns it).

    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with Hkv dividing H (dk, dv per K/V head, summed over its group); do and
    o like q. fp16 or bf16, head dims 64 and 128, any lengths, causal aligned bottom-right. `step`: one of
    BWD_STEPS, or None for the head dim's default (BWD_DEFAULT_STEPS)."""
    if step is not None and (not isinstance(step, str) or step not in BWD_STEPS):
        raise ValueError(f"step must be one of {BWD_STEPS} or None, got {step!r}")
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale, head_dims=(64, 128),
                                         dtypes=(torch.float16, torch.bfloat16))
    step = bwd_default_step(q.shape[-1]) if step is None else step
    check_device("q", q, "cuda")
    if shape.batch * shape.kv_heads > CUDA_GRID_Y:
        raise ValueError(f"batch x kv_heads = {shape.batch * shape.kv_heads} is more than the backward's grid has rows "
                         f"(gridDim.y, at most {CUDA_GRID_Y}); split the batch")
    do, q, k, v, o = (_readable(t) for t in (do, q, k, v, o))
    extension = native_build.load("hopper_backward")
    return tuple(extension.hopper_attention_backward(do, q, k, v, o, lse.float().contiguous(), causal, scale,
                                                     BWD_STEPS.index(step)))


def flash_hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, sm_scale=None):
    """The registry's "cuda_hopper": `flash_hopper`'s default step, differentiable through `flash_hopper_backward`
    when an input requires grad (the forward then also writes the log-sum-exp)."""
    if wants_grad(q, k, v):
        return KernelPair.apply(q, k, v, causal, sm_scale, flash_hopper_forward, flash_hopper_backward)
    return flash_hopper(q, k, v, causal=causal, sm_scale=sm_scale)
