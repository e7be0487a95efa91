"""Differentiable FlashAttention-2 in Triton: notebook 05's forward and notebook 07's backward under autograd."""
from __future__ import annotations

import torch

from utils.checks import check_bool
from utils.tiled.backward import flash_attention_backward
from utils.tiled.forward import flash_attention_forward


class FlashAttention(torch.autograd.Function):
    """forward: the Triton forward, saving (q, k, v, o, lse); backward: the three Triton backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = flash_attention_forward(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)   # O(N·d): no N×N matrix is kept
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None   # no gradient for causal and sm_scale


def flash_attention(q, k, v, *, causal=False, sm_scale=None, return_lse=False):
    """softmax(Q Kᵀ · sm_scale) V, differentiable. Returns O (shaped and typed like q), or (O, lse) with
    return_lse=True (lse: fp32, (batch, heads, seqlen_q), natural log, -inf for a query that sees no key)."""
    check_bool("return_lse", return_lse)
    o, lse = FlashAttention.apply(q, k, v, causal, sm_scale)
    return (o, lse) if return_lse else o
