"""Attention with a sink and a sliding window, written out in PyTorch: the ground truth for notebook 11's kernels.

A *sink* (StreamingLLM; gpt-oss) is one learnable logit s_h per query head that joins each row's softmax but
has no value vector:

    o_i = Σ_j exp(x_ij − m) v_j / (exp(s_h − m) + Σ_j exp(x_ij − m)),      x_ij = scale · q_i · k_j

so a query may put part of its attention "nowhere" instead of spreading it over keys it has no use for. The
row's log-sum-exp includes the sink: lse_i = log(exp(s_h) + Σ_j exp(x_ij)).

A *sliding window* of W keys (Mistral, gpt-oss's local layers) lets a query see only the W most recent keys up
to its own position. It is defined for causal attention only: with the course's bottom-right alignment query i
sits at position p = i + Nk − Nq and sees key j iff p − W < j ≤ p. window=None means no left limit.

Conventions as in utils.eager.reference: (batch, heads, seq, head_dim) tensors, K/V may have fewer heads than Q
(query head h reads K/V head h // (H / Hkv)); sinks has one entry per *query* head. A query that sees no key
(causal with Nq > Nk) outputs 0; its lse is s_h with a sink (the sink takes all its attention) and -inf without.
"""
from __future__ import annotations

import torch

from utils.checks import check_attention_inputs, positive_int, resolve_scale
from utils.eager.reference import causal_mask


def check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    """`sinks`, or a TypeError/ValueError naming it unless it is None or a floating-point tensor of shape (heads,)
    on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape (heads,) = ({q.shape[1]},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; they must match")
    return sinks


def check_window(window, causal: bool) -> int | None:
    """`window` as an int or None; a TypeError/ValueError naming it unless it is None or a positive int, and a
    ValueError if it is given without causal=True (a window looks back from the query's position)."""
    if window is None:
        return None
    window = positive_int("window", window)
    if not causal:
        raise ValueError("window needs causal=True: it keeps the `window` most recent keys up to each query's "
                         "position")
    return window


def visible_keys(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window: int | None = None,
                 device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i sees key j: all keys; causal: j ≤ p, with
    p = i + seqlen_k − seqlen_q (bottom-right); with a window, also j > p − window."""
    if not causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    mask = causal_mask(seqlen_q, seqlen_k, device)
    if window is not None:
        pos = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
        mask &= torch.arange(seqlen_k, device=device)[None, :] > pos - window
    return mask


def sink_attention_reference(q, k, v, sinks=None, *, causal=False, window=None, sm_scale=None):
    """(o, lse): attention with an optional per-head sink and sliding window, the formula in full matrices.

    Computed in q's dtype promoted to at least fp32 (float64 inputs and sinks stay float64, so gradcheck works);
    differentiable in q, k, v and sinks. o has q's dtype; lse (batch, heads, seqlen_q), natural log, in the
    compute dtype, includes the sink.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    sinks = check_sinks(sinks, q)
    window = check_window(window, causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = shape.heads // shape.kv_heads
    k, v = (t.to(dtype).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.to(dtype) @ k.transpose(-2, -1)) * scale
    seen = visible_keys(shape.seqlen_q, shape.seqlen_k, causal=causal, window=window, device=q.device)
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)             # -inf for a row that sees no key
    if sinks is not None:                             # the sink is one more term of the denominator
        lse = torch.logaddexp(lse, sinks.to(dtype)[None, :, None])
    # A row with lse = -inf (no key, no sink) would give exp(-inf - -inf) = nan: subtract +inf there, so P = 0.
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), float("inf"), lse)[..., None])
    return (probs @ v).to(q.dtype), lse
