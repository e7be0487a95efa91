"""The trainable Triton kernels as PyTorch operators (torch.library), so that a model can use them under
torch.compile without a graph break, with fake tensors for shapes and autograd for the backward.

    from utils.ops import attention as ops
    o = ops.attention(q, k, v, causal=True, kernel="triton")      # differentiable in q, k, v
    torch.ops.course.triton_attention(q, k, v, True, 0.125)       # the operator itself: (o, lse)

Each kernel of KERNELS is two operators: `course::<kernel>_attention(q, k, v, causal, scale) -> (o, lse)` and
`course::<kernel>_attention_backward(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)`, the second registered
as the first's gradient. Their fake implementations give each output's shape, dtype and strides without running a
kernel: o and lse are new contiguous tensors, dq, dk and dv are laid out like q, k and v (as the kernels make them).
Registering imports no kernel: a kernel module is imported on the operator's first run.

No `from __future__ import annotations` here: torch.library reads the operators' schemas from their annotations.
"""
import importlib

import torch
from torch import Tensor

from utils.checks import check_attention_inputs, check_bool, resolve_scale

# kernel -> (forward "module:function", backward "module:function"): plain functions on (batch, heads, seq, dim)
# tensors, forward(q, k, v, causal=, sm_scale=) -> (o, lse) and backward(do, q, k, v, o, lse, causal=, sm_scale=).
KERNELS = {
    "triton": ("utils.tiled.fast.forward:flash_attention_forward",
               "utils.tiled.fast.backward:flash_attention_backward"),
    "triton_lesson": ("utils.tiled.forward:flash_attention_forward",
                      "utils.tiled.backward:flash_attention_backward"),
}


def _load(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def _register(kernel: str, forward: str, backward: str):
    """Define and register the two operators of `kernel`; returns the forward operator."""

    @torch.library.custom_op(f"course::{kernel}_attention", mutates_args=())
    def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        o, lse = _load(forward)(q, k, v, causal=causal, sm_scale=scale)
        return o, lse

    @attention_op.register_fake
    def _(q, k, v, causal, scale):
        b, h, nq, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((b, h, nq), dtype=torch.float32)

    @torch.library.custom_op(f"course::{kernel}_attention_backward", mutates_args=())
    def backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = _load(backward)(do, q, k, v, o, lse, causal=causal, sm_scale=scale)
        return dq, dk, dv

    @backward_op.register_fake
    def _(do, q, k, v, o, lse, causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)   # O(N·d), as the autograd Functions keep
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)

    def gradient(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None

    attention_op.register_autograd(gradient, setup_context=setup_context)
    return attention_op


OPS = {kernel: _register(kernel, *targets) for kernel, targets in KERNELS.items()}


def attention(q, k, v, *, causal=False, sm_scale=None, kernel="triton", return_lse=False):
    """softmax(Q Kᵀ · sm_scale) V through the operator of `kernel` (one of KERNELS), differentiable. Returns O,
    shaped and typed like q (contiguous), or (O, lse) with return_lse=True."""
    if not isinstance(kernel, str) or kernel not in OPS:
        raise ValueError(f"kernel must be one of {sorted(OPS)}, got {kernel!r}")
    check_bool("return_lse", return_lse)
    shape = check_attention_inputs(q, k, v, causal=causal, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                                   runs_on="triton")
    scale = resolve_scale(sm_scale, shape.head_dim)
    o, lse = OPS[kernel](q, k, v, causal, float(scale))
    return (o, lse) if return_lse else o
