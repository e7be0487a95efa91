"""Multi-head self-attention as a small `nn.Module` whose attention kernel can be swapped.

The module owns the projections; the attention itself is any function of the registry (`utils.attention`),
`fn(q, k, v, *, causal=False, sm_scale=None)` on (batch, heads, seq, head_dim) tensors. Notebook 01 builds it
on PyTorch's SDPA; later notebooks pass their own kernels (notebook 07 trains a model with them).
"""
from __future__ import annotations

import math

import torch

from utils.checks import check_bool, positive_int
from einops import rearrange
from torch import nn

from utils.eager.reference import sdpa_attention




def _resolve_attention(attention):
    """A callable, or the name of a registry entry ("naive", "sdpa", ...)."""
    if isinstance(attention, str):
        from utils.attention import REGISTRY

        if attention not in REGISTRY:
            raise ValueError(f"attention {attention!r} is not in the registry; known: {', '.join(REGISTRY)}")
        return REGISTRY[attention].load()
    if not callable(attention):
        raise TypeError(f"attention must be a callable or a registry name, got {type(attention).__name__}")
    return attention


class MultiHeadAttention(nn.Module):
    """Self-attention over (batch, seq, embed_dim) inputs with `num_heads` heads of embed_dim // num_heads.

    One fused linear layer computes Q, K and V (one matmul instead of three); `einops.rearrange` splits its
    output into heads, (B, N, 3·E) -> 3 × (B, H, N, D), and merges the heads back, (B, H, N, D) -> (B, N, E),
    before the output projection. Scores are scaled by 1/sqrt(D).

    The fused weight stacks W_q, W_k, W_v in that order, each with heads as consecutive blocks of D rows: the
    layout of `torch.nn.MultiheadAttention.in_proj_weight`, so weights copy over one to one.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, causal: bool = False, bias: bool = True,
                 attention=sdpa_attention, device=None, dtype=None):
        super().__init__()
        embed_dim = positive_int("embed_dim", embed_dim)
        num_heads = positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        check_bool("causal", causal), check_bool("bias", bias)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.causal = causal
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.attention = _resolve_attention(attention)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias, device=device, dtype=dtype)
        self.out = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, 3·H·D) -> q, k, v of shape (B, H, N, D) (views, no copy)."""
        return rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=self.num_heads).unbind(0)

    @staticmethod
    def merge_heads(o: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) -> (B, N, H·D)."""
        return rearrange(o, "b h n d -> b n (h d)")

    def forward(self, x: torch.Tensor, *, causal: bool | None = None) -> torch.Tensor:
        """x: (batch, seq, embed_dim). `causal` overrides the module's default for this call."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have shape (batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        weight = self.qkv.weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise TypeError(f"x is {x.dtype} on {x.device} but the weights are {weight.dtype} on "
                            f"{weight.device}; convert one of them (e.g. module.to(x.dtype))")
        causal = self.causal if causal is None else causal
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool or None, got {type(causal).__name__}")
        q, k, v = self.split_heads(self.qkv(x))
        o = self.attention(q, k, v, causal=causal, sm_scale=self.scale)
        return self.out(self.merge_heads(o))

    def extra_repr(self) -> str:
        name = getattr(self.attention, "__name__", type(self.attention).__name__)
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}, attention={name}"
