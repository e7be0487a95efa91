"""Score and mask modifiers (notebook 10): the rules that turn plain attention into sliding-window, ALiBi,
soft-capped, document-masked or prefix-LM attention.

A `Modifier` carries each rule twice: as a Triton function that the kernels call on a tile of scores, and as a
PyTorch function of broadcast index tensors, which the float64 reference (and PyTorch's own `flex_attention`)
uses. Triton functions cannot capture Python values, so a modifier's parameters reach them as `args`, the tuple
`(tensor, int_arg, float_arg)` built by the kernel from its arguments.

Positions: `q_idx` is the query's position in the key sequence, `i + Nk - Nq` (the course's bottom-right
alignment; the same as `flex_attention`'s q_idx when Nq == Nk). Scores reaching `score_mod` are already scaled by
`sm_scale`, as in `flex_attention`. On ragged tiles the kernels give every rule positions of at most Nk - 1 (rows
and keys past the end, masked or never stored, get the last key's), so a table with one entry per key is never read
past its end.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from utils.checks import check_attention_inputs, check_bool, positive_int, resolve_scale


@dataclass(frozen=True)
class Modifier:
    name: str
    score_mod: Callable | None = None    # Triton: (score, b, h, q_idx, kv_idx, args) -> score
    score_grad: Callable | None = None   # Triton: d score_mod / d score at score (None: 1, a bias)
    mask_mod: Callable | None = None     # Triton: (b, h, q_idx, kv_idx, args) -> True where the key is visible
    torch_score: Callable | None = None  # PyTorch twin of score_mod: (score, b, h, q_idx, kv_idx) -> score
    torch_mask: Callable | None = None   # PyTorch twin of mask_mod: (b, h, q_idx, kv_idx) -> bool
    tensor: torch.Tensor | None = None   # args[0]: the rule's data (document ids, ALiBi slopes)
    int_arg: int = 0                     # args[1]: window, prefix length, row stride of the document ids
    float_arg: float = 0.0               # args[2]: the soft cap
    per_batch: bool = False              # mask_mod depends on b: the block mask gets a batch dim
    per_head: bool = False               # mask_mod depends on h: the block mask gets a head dim
    indexed_by: str = ""                 # what the tensor's last dim is indexed by: "position", "head" or ""

    def __post_init__(self):
        if (self.score_mod is None) != (self.torch_score is None):
            raise ValueError(f"modifier {self.name!r}: score_mod and torch_score come together")
        if (self.mask_mod is None) != (self.torch_mask is None):
            raise ValueError(f"modifier {self.name!r}: mask_mod and torch_mask come together")
        if self.score_grad is not None and self.score_mod is None:
            raise ValueError(f"modifier {self.name!r}: score_grad without score_mod")
        if self.indexed_by not in ("", "position", "head"):
            raise ValueError(f"modifier {self.name!r}: indexed_by must be 'position', 'head' or ''")
        if self.tensor is not None and not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"modifier {self.name!r}: tensor must be a torch.Tensor or None")

    def __repr__(self):
        return f"Modifier({self.name})"


# --- the Triton rules -----------------------------------------------------------------------------------------

@triton.jit
def causal_mask(b, h, q_idx, kv_idx, args):
    return kv_idx <= q_idx


@triton.jit
def window_causal_mask(b, h, q_idx, kv_idx, args):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < args[1])


@triton.jit
def window_mask(b, h, q_idx, kv_idx, args):
    return (q_idx - kv_idx < args[1]) & (kv_idx - q_idx < args[1])


@triton.jit
def document_causal_mask(b, h, q_idx, kv_idx, args):
    row = args[0] + b * args[1]
    return (tl.load(row + q_idx) == tl.load(row + kv_idx)) & (kv_idx <= q_idx)


@triton.jit
def document_mask(b, h, q_idx, kv_idx, args):
    row = args[0] + b * args[1]
    return tl.load(row + q_idx) == tl.load(row + kv_idx)


@triton.jit
def prefix_lm_mask(b, h, q_idx, kv_idx, args):
    return (kv_idx <= q_idx) | (kv_idx < args[1])


@triton.jit
def alibi_causal_score(score, b, h, q_idx, kv_idx, args):
    return score - tl.load(args[0] + h) * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def alibi_score(score, b, h, q_idx, kv_idx, args):
    distance = q_idx - kv_idx
    return score - tl.load(args[0] + h) * tl.where(distance < 0, -distance, distance).to(tl.float32)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both ends (e^2x overflows to inf -> 1; underflows to 0 -> -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def softcap_score(score, b, h, q_idx, kv_idx, args):
    return args[2] * _tanh(score / args[2])


@triton.jit
def softcap_grad(score, b, h, q_idx, kv_idx, args):
    t = _tanh(score / args[2])
    return 1.0 - t * t


# --- the factories ----------------------------------------------------------------------------------------------

def causal() -> Modifier:
    """Each query sees the keys at or before its position."""
    return Modifier("causal", mask_mod=causal_mask, torch_mask=lambda b, h, q, kv: kv <= q)


def sliding_window(window: int, causal: bool = True) -> Modifier:
    """Each query sees `window` keys: itself and the window-1 before it (Mistral); not causal: |q - kv| < window."""
    window = positive_int("window", window)
    check_bool("causal", causal)
    if causal:
        return Modifier(f"sliding window {window}, causal", mask_mod=window_causal_mask, int_arg=window,
                        torch_mask=lambda b, h, q, kv: (kv <= q) & (q - kv < window))
    return Modifier(f"sliding window {window}", mask_mod=window_mask, int_arg=window,
                    torch_mask=lambda b, h, q, kv: (q - kv < window) & (kv - q < window))


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al., 2022): the geometric sequence 2^(-8/heads), 2^(-16/heads), ... (for
    head counts that are not powers of two the paper interleaves; this course keeps the plain sequence)."""
    heads = positive_int("heads", heads)
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads).float()


def alibi(heads: int, causal: bool = True, device=None) -> Modifier:
    """A linear penalty on distance, one slope per head, instead of position embeddings (BLOOM, MPT)."""
    check_bool("causal", causal)
    slopes = alibi_slopes(heads).to(device)
    if causal:
        return Modifier("ALiBi, causal", score_mod=alibi_causal_score, mask_mod=causal_mask, tensor=slopes,
                        indexed_by="head",
                        torch_score=lambda s, b, h, q, kv: s - slopes.to(h.device)[h] * (q - kv),
                        torch_mask=lambda b, h, q, kv: kv <= q)
    return Modifier("ALiBi", score_mod=alibi_score, tensor=slopes, indexed_by="head",
                    torch_score=lambda s, b, h, q, kv: s - slopes.to(h.device)[h] * (q - kv).abs())


def softcap(cap: float, causal: bool = True, window: int | None = None) -> Modifier:
    """Scores squashed into (-cap, cap) by cap·tanh(score/cap) (Gemma 2 uses 50 on attention logits), with a
    causal mask and, optionally, a causal sliding window as Gemma 2's local layers."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0 or cap == float("inf"):
        raise ValueError(f"cap must be a finite positive number, got {cap!r}")
    check_bool("causal", causal)
    cap = float(cap)
    score = dict(score_mod=softcap_score, score_grad=softcap_grad, float_arg=cap,
                 torch_score=lambda s, b, h, q, kv: cap * torch.tanh(s / cap))
    if window is not None:
        if not causal:
            raise ValueError("softcap: window needs causal=True")
        mask = sliding_window(window)
        return Modifier(f"softcap {cap:g}, {mask.name}", **score, mask_mod=mask.mask_mod,
                        torch_mask=mask.torch_mask, int_arg=mask.int_arg)
    if causal:
        return Modifier(f"softcap {cap:g}, causal", **score, mask_mod=causal_mask,
                        torch_mask=lambda b, h, q, kv: kv <= q)
    return Modifier(f"softcap {cap:g}", **score)


def document_ids(lengths, device=None) -> torch.Tensor:
    """int32 ids (sum(lengths),): 0 for the first document's tokens, 1 for the next, ... (a packed batch)."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    lengths = [int(n) for n in lengths]
    if not lengths or any(n < 0 for n in lengths) or sum(lengths) == 0:
        raise ValueError(f"lengths must be non-negative with a positive sum, got {lengths}")
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(device=device, dtype=torch.int32)


def document(doc_ids: torch.Tensor, causal: bool = True) -> Modifier:
    """Tokens of a packed sequence see only their own document: `doc_ids` (N,) shared by the batch, or (B, N)."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() not in (1, 2) or doc_ids.numel() == 0 or doc_ids.dtype.is_floating_point:
        raise ValueError(f"doc_ids must be a non-empty integer tensor of shape (N,) or (B, N), got "
                         f"{doc_ids.dtype} {tuple(doc_ids.shape)}")
    ids = doc_ids.to(torch.int32).contiguous()
    per_batch = ids.dim() == 2
    table = ids if per_batch else ids[None]   # the PyTorch twin indexes table[b, position]

    def same_doc(b, q, kv):
        row = b if per_batch else torch.zeros_like(b)
        ids = table.to(q.device)
        return ids[row, q] == ids[row, kv]

    row_stride = ids.shape[1] if per_batch else 0
    if causal:
        return Modifier("document, causal", mask_mod=document_causal_mask, tensor=ids, int_arg=row_stride,
                        per_batch=per_batch, indexed_by="position",
                        torch_mask=lambda b, h, q, kv: same_doc(b, q, kv) & (kv <= q))
    return Modifier("document", mask_mod=document_mask, tensor=ids, int_arg=row_stride, per_batch=per_batch,
                    indexed_by="position", torch_mask=lambda b, h, q, kv: same_doc(b, q, kv))


def prefix_lm(prefix_len: int) -> Modifier:
    """The first `prefix_len` positions see each other both ways (the prompt); the rest is causal (T5's prefix-LM)."""
    prefix_len = positive_int("prefix_len", prefix_len)
    return Modifier(f"prefix-LM {prefix_len}", mask_mod=prefix_lm_mask, int_arg=prefix_len,
                    torch_mask=lambda b, h, q, kv: (kv <= q) | (kv < prefix_len))


# --- the dense reference ----------------------------------------------------------------------------------------

def _positions(batch, heads, seqlen_q, seqlen_k, device):
    """Index tensors b, h, q_idx, kv_idx broadcasting to (batch, heads, Nq, Nk); q_idx bottom-right aligned."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1) + (seqlen_k - seqlen_q)
    kv = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def dense_mask(modifier, batch, heads, seqlen_q, seqlen_k, device=None) -> torch.Tensor:
    """The modifier's mask as a bool tensor: (batch, heads, Nq, Nk) (a broadcast view), or all True (1, 1, Nq, Nk)
    without a mask."""
    b, h, q, kv = _positions(batch, heads, seqlen_q, seqlen_k, device)
    if modifier is None or modifier.torch_mask is None:
        return torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    mask = modifier.torch_mask(b, h, q, kv)
    return torch.as_tensor(mask, device=device).broadcast_to(batch, heads, seqlen_q, seqlen_k)


def reference(q, k, v, modifier=None, *, sm_scale=None):
    """(o, lse) of modified attention in float64: o in q's dtype, lse float64 (B, H, Nq); a query that sees no key
    gets o = 0 and lse = -inf (the kernels' convention)."""
    batch, heads, kv_heads, nq, nk, d = check_attention_inputs(q, k, v)
    if modifier is not None and not isinstance(modifier, Modifier):
        raise TypeError(f"modifier must be a Modifier or None, got {type(modifier).__name__}")
    group = heads // kv_heads
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = qd @ kd.transpose(-1, -2) * resolve_scale(sm_scale, d)
    if modifier is not None and modifier.torch_score is not None:
        scores = modifier.torch_score(scores, *_positions(batch, heads, nq, nk, q.device))
    scores = scores.masked_fill(~dense_mask(modifier, batch, heads, nq, nk, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])  # rows with no key: all zeros
    return (p @ vd).to(q.dtype), lse
