"""Softmax the way FlashAttention computes it: safe, online, block by block, merged by log-sum-exp.

Notebook 02 derives all of this; later notebooks import it from here. The central object is the *partial
state* of a set of scores x: the pair

    m = max(x),   l = sum(exp(x - m)).

The states of two disjoint blocks merge into the state of their union (`merge_states`); the merge is
associative and commutative, and the empty set's state (-inf, 0) is its identity. So a softmax denominator can
be built from blocks in any order and grouping: one block at a time (online softmax, FlashAttention's inner
loop) or as a tree over chunks computed in parallel (flash-decoding, ring attention). `lse = m + log(l)` folds
a state into one number per row, which is what attention kernels store; `merge_attention` combines normalised
partial attention outputs by their lse.

Empty states (every score -inf, e.g. fully masked rows) never produce NaN here: a row with no finite score gets
a softmax of zeros and an lse of -inf, the course's convention for a query that sees no key. Inputs must not
contain NaN or +inf (not checked: that would cost a pass over the data).

Functions compute in their inputs' dtype, without upcasting, so that notebook 02 can measure the precision of
each variant per dtype; call them on `x.float()` when you want accuracy.
"""
from __future__ import annotations

import math
import numbers

import torch

from utils.checks import check_attention_inputs, resolve_scale
from utils.eager.reference import causal_mask

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E): kernels fold LOG2E into the softmax scale

__all__ = ["LOG2E", "naive_softmax", "safe_softmax", "online_softmax", "softmax_exp2", "softmax_state",
           "merge_states", "empty_state", "lse_from_state", "logsumexp", "merge_attention", "attention_with_lse"]


# --- validation --------------------------------------------------------------------------------------------

def _check_float(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def _check_dim(x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor with {x.dim()} dims")
    return int(dim) % x.dim()


def _check_pair(names: tuple[str, str], a, b) -> None:
    for name, t in zip(names, (a, b)):
        _check_float(name, t)
    if a.shape != b.shape:
        raise ValueError(f"{names[0]} has shape {tuple(a.shape)} but {names[1]} has {tuple(b.shape)}; "
                         "they must match")
    if a.device != b.device:
        raise ValueError(f"{names[0]} is on {a.device} but {names[1]} is on {b.device}; they must match")


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf replaced by 0: subtracting it keeps exp(-inf - m) = 0 instead of exp(-inf + inf) = NaN."""
    return m.masked_fill(m == float("-inf"), 0.0)


# --- softmax three ways ------------------------------------------------------------------------------------

def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum(exp(x)), straight from the definition: overflows once x exceeds log(dtype's max)."""
    _check_float("x", x)
    dim = _check_dim(x, dim)
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


def safe_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax in three passes over x: the maximum m, the sum l of exp(x - m), then exp(x - m) / l.

    Every exponent is <= 0, so nothing overflows. Rows without a finite entry give zeros.
    """
    _check_float("x", x)
    dim = _check_dim(x, dim)
    if x.shape[dim] == 0:
        return x.clone()
    m = _finite(x.amax(dim, keepdim=True))              # pass 1
    l = torch.exp(x - m).sum(dim, keepdim=True)         # pass 2
    return torch.exp(x - m) / l.masked_fill(l == 0, 1)  # pass 3 (exp recomputed, as a kernel would)


def online_softmax(x: torch.Tensor, dim: int = -1, *, block_size: int = 1) -> torch.Tensor:
    """Softmax in two passes: one builds (m, l) block by block, merging as it goes; one normalises.

    With block_size=1 the first pass is the recurrence
        m_i = max(m_{i-1}, x_i),   l_i = l_{i-1} * exp(m_{i-1} - m_i) + exp(x_i - m_i).
    """
    _check_float("x", x)
    dim = _check_dim(x, dim)
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    m, l = empty_state(_reduced_shape(x, dim), dtype=x.dtype, device=x.device)
    for block in x.split(int(block_size), dim):          # pass 1
        m, l = merge_states(m, l, *softmax_state(block, dim))
    m, l = m.unsqueeze(dim), l.unsqueeze(dim)
    return torch.exp(x - _finite(m)) / l.masked_fill(l == 0, 1)  # pass 2


def softmax_exp2(x: torch.Tensor, scale: float = 1.0, dim: int = -1) -> torch.Tensor:
    """softmax(scale * x) computed as a kernel does it: exp2(x * c - m * c) with c = scale * log2(e).

    exp(scale * (x - m)) = 2 ** ((x - m) * scale * log2(e)); folding log2(e) into the scale makes each
    element one fused multiply-add and one exp2, the exponential GPUs compute natively. Needs scale > 0.
    """
    _check_float("x", x)
    dim = _check_dim(x, dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    if x.shape[dim] == 0:
        return x.clone()
    c = scale * LOG2E
    m = _finite(x.amax(dim, keepdim=True))  # the max of scale*x is scale*max(x), since scale > 0
    p = torch.exp2(x * c - m * c)
    l = p.sum(dim, keepdim=True)
    return p / l.masked_fill(l == 0, 1)


# --- partial states and their merge -----------------------------------------------------------------------

def _reduced_shape(x: torch.Tensor, dim: int) -> tuple:
    return tuple(s for i, s in enumerate(x.shape) if i != dim)


def empty_state(shape, *, dtype=torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of no scores at all, (m, l) = (-inf, 0): the identity of `merge_states`."""
    m = torch.full(tuple(shape), float("-inf"), dtype=dtype, device=device)
    return m, torch.zeros(tuple(shape), dtype=dtype, device=device)


def softmax_state(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, l) = (max of x, sum of exp(x - m)) along `dim`, which is removed from the shape.

    An empty slice, or one where every entry is -inf, gives the empty state (-inf, 0).
    """
    _check_float("x", x)
    dim = _check_dim(x, dim)
    if x.shape[dim] == 0:
        return empty_state(_reduced_shape(x, dim), dtype=x.dtype, device=x.device)
    m = x.amax(dim)
    l = torch.exp(x - _finite(m).unsqueeze(dim)).sum(dim)
    return m, l


def merge_states(m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor, l_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of the union of two disjoint blocks: m = max(m_a, m_b), l = l_a e^(m_a - m) + l_b e^(m_b - m).

    Each sum is rescaled to the common maximum, so no exponent is positive. Associative and commutative, with
    identity (-inf, 0); two empty states merge to an empty state, without NaN.
    """
    _check_pair(("m_a", "l_a"), m_a, l_a)
    _check_pair(("m_b", "l_b"), m_b, l_b)
    _check_pair(("m_a", "m_b"), m_a, m_b)
    m = torch.maximum(m_a, m_b)
    m_safe = _finite(m)
    return m, l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)


def lse_from_state(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) = m + log(l); -inf for an empty state. (lse, 1) is again a valid state."""
    _check_pair(("m", "l"), m, l)
    return m + torch.log(l)


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log(sum(exp(x))) along `dim`, without overflow: the state (m, l) folded into m + log(l)."""
    return lse_from_state(*softmax_state(x, dim))


# --- partial attention outputs -----------------------------------------------------------------------------

def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint sets of keys from their normalised outputs and log-sum-exps.

    o_a = softmax(s_a) v_a is normalised by exp(lse_a); the full output re-weights each part by its share of
    the total mass: o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse) with lse = log(exp(lse_a) + exp(lse_b)).
    o_* have shape (..., head_dim), lse_* shape (...). A part with lse = -inf (no key) contributes nothing,
    whatever its o holds; if both are empty, o = 0 and lse = -inf. The result has o_a's dtype.
    """
    _check_pair(("o_a", "o_b"), o_a, o_b)
    _check_pair(("lse_a", "lse_b"), lse_a, lse_b)
    if o_a.dim() == 0 or lse_a.shape != o_a.shape[:-1]:
        raise ValueError(f"lse_a has shape {tuple(lse_a.shape)} but o_a has {tuple(o_a.shape)}; "
                         "lse must be o's shape without its last dim")
    if lse_a.device != o_a.device:
        raise ValueError(f"lse_a is on {lse_a.device} but o_a is on {o_a.device}; they must match")
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = _finite(lse)
    acc = torch.promote_types(o_a.dtype, lse.dtype)
    out = torch.zeros(o_a.shape, dtype=acc, device=o_a.device)
    for o_part, lse_part in ((o_a, lse_a), (o_b, lse_b)):
        weight = torch.exp(lse_part - lse_safe).unsqueeze(-1).to(acc)
        out = out + torch.where(weight > 0, weight * o_part.to(acc), 0.0)  # 0 * NaN of an empty part stays 0
    return out.to(o_a.dtype), lse


def attention_with_lse(q, k, v, *, causal=False, sm_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its log-sum-exp per query row, from the full score matrix (a reference).

    Same conventions as `utils.eager.reference.naive_attention`; returns o with q's dtype and shape, and lse of
    shape (batch, heads, seqlen_q) in float32 (float64 for float64 inputs), -inf for a query that sees no key.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    group = shape.heads // shape.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(shape.seqlen_q, shape.seqlen_k, q.device), float("-inf"))
    lse = logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return (probs @ v.to(acc)).to(q.dtype), lse
