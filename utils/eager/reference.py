"""Reference attention: the formula written out, and PyTorch's fused `scaled_dot_product_attention`.

Conventions every implementation in the course follows:
- tensors are `(batch, heads, seq, head_dim)`; K and V may have fewer heads than Q (GQA), a divisor of it;
- the scale defaults to 1/sqrt(head_dim);
- causal masking is aligned bottom-right, as in FlashAttention-2: query i sees keys j <= i + (Nk - Nq), so the
  last query sees every key. With Nq > Nk the first Nq - Nk queries see no key at all: their output is 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from utils.checks import check_attention_inputs, resolve_scale


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def naive_attention(q, k, v, *, causal=False, sm_scale=None):
    """softmax(Q Kᵀ · scale) V with the full score matrix in memory: what the course sets out to avoid.

    Scores are formed in the input dtype; the softmax runs in fp32 for stability.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    group = shape.heads // shape.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(shape.seqlen_q, shape.seqlen_k, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0, not NaN
    return (probs.to(v.dtype) @ v)


def sdpa_attention(q, k, v, *, causal=False, sm_scale=None):
    """`torch.nn.functional.scaled_dot_product_attention` with the course's conventions (GQA, bottom-right causal)."""
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    gqa = shape.heads != shape.kv_heads
    if not causal or shape.seqlen_q == shape.seqlen_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    mask = causal_mask(shape.seqlen_q, shape.seqlen_k, q.device)
    sees_a_key = mask.any(-1, keepdim=True)
    # Queries that see no key (Nq > Nk) output 0. SDPA would give them NaN, which its backward spreads into dk
    # and dv: let them see every key, then zero their rows, out of place (autograd keeps SDPA's output).
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~sees_a_key, scale=scale, enable_gqa=gqa)
    return out if shape.seqlen_q <= shape.seqlen_k else torch.where(sees_a_key, out, 0)


def reference_attention(q, k, v, *, causal=False, sm_scale=None):
    """Ground truth for tests: the naive formula in float64."""
    return naive_attention(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale)
