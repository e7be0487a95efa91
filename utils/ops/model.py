"""A small decoder model whose attention is a function argument (notebook 07b, tests/test_ops.py and the
real-model benchmark): pre-norm transformer blocks with grouped-query attention, as a Llama stacks them.

`attend(q, k, v)` takes (batch, heads, seq, head_dim) query heads and (batch, kv_heads, seq, head_dim) key and
value heads, causal, and returns (batch, heads, seq, head_dim).
"""
import torch.nn.functional as F
from torch import nn

from utils.checks import positive_int


def sdpa_causal(q, k, v):
    """PyTorch's scaled_dot_product_attention, causal, K/V heads shared by groups of query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Block(nn.Module):
    """x + out(attend(q, k, v)) with q, k, v projected from norm(x), then x + MLP(norm(x))."""

    def __init__(self, attend, dim: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        dim, heads, kv_heads = (positive_int(n, x) for n, x in (("dim", dim), ("heads", heads),
                                                                  ("kv_heads", kv_heads)))
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}), and heads of kv_heads ({kv_heads})")
        if not callable(attend):
            raise TypeError(f"attend must be a function (q, k, v) -> o, got {type(attend).__name__}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)   # one matmul for q, k, v
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attend = attend

    def forward(self, x):
        b, n, _ = x.shape
        # views of the projection, (batch, heads, seq, head_dim) with seq-major strides: no copy
        q, k, v = self.qkv(self.norm1(x)).view(b, n, -1, self.head_dim).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        x = x + self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Token embeddings, `layers` Blocks, a final norm and a linear head: ids (batch, seq) -> logits."""

    def __init__(self, attend, vocab: int = 256, dim: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(positive_int("vocab", vocab), dim)
        self.blocks = nn.ModuleList(Block(attend, dim, heads, kv_heads) for _ in range(positive_int("layers", layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)   # no position embedding: causal attention alone tells positions apart
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
