"""Multi-head latent attention (MLA) at decode time, written out in PyTorch: the ground truth of notebook 11.

DeepSeek-V2/V3 cache one latent vector c_j (r = kv_lora_rank = 512 dims) and one rope key k_r,j (d_rope = 64 dims)
per token, shared by every head. Head h's key and value are up-projections of the latent,
K_h = c W_UK_h^T (d_nope = 128 dims) and V_h = c W_UV_h^T (d_v = 128 dims), and its score concatenates a
position-free part and a rope part:

    s_hj = (q_nope,h · W_UK_h c_j + q_rope,h · k_r,j) · scale,   o_h = sum_j softmax(s_h)_j · W_UV_h c_j.

`mla_naive` computes exactly that, the keys and values of every head expanded in memory. At decode time the
up-projections are *absorbed*: q_nope,h · W_UK_h c_j = (W_UK_h^T q_nope,h) · c_j and sum_j p_hj W_UV_h c_j =
W_UV_h (sum_j p_hj c_j). So each head gets a latent query q_c,h = W_UK_h^T q_nope,h (`absorb`), attends the cache
as it is (keys: [c_j, k_r,j], 576 dims; values: c_j itself, 512 dims: one tensor shared by every head, multi-query
attention) and the latent output is up-projected by W_UV_h afterwards (`up_project`). `mla_absorbed_reference`
is that attention over the latent cache, the ground truth of the Triton kernel (utils/mla/decode.py).

The scale is 1/sqrt(d_nope + d_rope) of the *original* head dim, 1/sqrt(128 + 64) for DeepSeek: absorbing
changes how the dot product is computed, not its value. It is not 1/sqrt(576) of the latent key's width.

Decoding semantics, as in utils/decoding: a cache of capacity N holds seqlens[b] valid entries of sequence b, and
the Nq new tokens are its last Nq entries (already appended), causal among themselves: new token i sees entries
j <= i + seqlens[b] - Nq. A token that sees no entry (seqlens[b] < Nq) gets output 0 and lse -inf.
"""
from __future__ import annotations

import math

import torch

from utils.checks import resolve_scale

# DeepSeek-V2/V3: d_nope = 128 (qk_nope_head_dim) plus d_rope = 64 (qk_rope_head_dim), r = 512 (kv_lora_rank).
DEEPSEEK_SM_SCALE = 1.0 / math.sqrt(128 + 64)


def _tensor(name: str, t, dims: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {layout}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t


def check_latent_shapes(q_latent, q_rope, c, k_rope, *, names=("q_latent", "q_rope", "c", "k_rope"),
                        absorbed=True):
    """Validate the shapes of the absorbed problem: q_latent (B, H, Nq, r), q_rope (B, H, Nq, d_rope), the latent
    cache c (B, N, r) and the rope keys k_rope (B, N, d_rope), all on one device. Returns (B, H, Nq, N, r, d_rope).
    `names`: what the error messages call the four arguments; `absorbed` False: the first is q_nope, whose last
    dim is d_nope, not r."""
    nq_, nr_, nc_, nk_ = names
    _tensor(nq_, q_latent, 4, "(batch, heads, new tokens, latent dim)")
    _tensor(nr_, q_rope, 4, "(batch, heads, new tokens, rope dim)")
    _tensor(nc_, c, 3, "(batch, cache length, latent dim)")
    _tensor(nk_, k_rope, 3, "(batch, cache length, rope dim)")
    for name, t in ((nq_, q_latent), (nr_, q_rope), (nc_, c), (nk_, k_rope)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
        if t.device != q_latent.device:
            raise ValueError(f"{name} is on {t.device} but {nq_} is on {q_latent.device}; they must match")
    batch, heads, n_q, latent = *q_latent.shape[:3], (q_latent.shape[3] if absorbed else c.shape[2])
    if q_rope.shape[:3] != q_latent.shape[:3]:
        raise ValueError(f"{nr_} has shape {tuple(q_rope.shape)}: its (batch, heads, new tokens) must be "
                         f"{nq_}'s {tuple(q_latent.shape[:3])}")
    if c.shape[0] != batch or c.shape[2] != latent:
        raise ValueError(f"{nc_} has shape {tuple(c.shape)}, expected ({batch}, cache length, {latent}): "
                         f"{nq_}'s batch and latent dim")
    rope = q_rope.shape[3]
    if k_rope.shape != (batch, c.shape[1], rope):
        raise ValueError(f"{nk_} has shape {tuple(k_rope.shape)}, expected {(batch, c.shape[1], rope)}: "
                         f"{nc_}'s batch and length, {nr_}'s rope dim")
    return batch, heads, n_q, c.shape[1], latent, rope


def check_mla_scale(sm_scale) -> float:
    """`sm_scale` as a float, or a TypeError/ValueError. None is refused: the latent shapes do not hold the
    un-absorbed head dim d_nope + d_rope, so no default can be derived from them (pass DEEPSEEK_SM_SCALE)."""
    if sm_scale is None:
        raise TypeError("sm_scale must be a real number: 1/sqrt(d_nope + d_rope) of the un-absorbed head dim "
                        "(DEEPSEEK_SM_SCALE for DeepSeek's 128 + 64), which the latent shapes do not tell")
    return resolve_scale(sm_scale, 1)


def visible_entries(seqlens: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """(B, 1, Nq, N) bool: new token i of sequence b sees cache entry j iff j < L_b and j <= i + L_b - Nq."""
    lengths = seqlens.to(torch.int64)[:, None, None, None]
    i = torch.arange(n_q, device=seqlens.device)[None, None, :, None]
    j = torch.arange(n_k, device=seqlens.device)[None, None, None, :]
    return (j < lengths) & (j <= i + lengths - n_q)


def _lengths(seqlens, batch: int, n_k: int, device) -> torch.Tensor:
    if seqlens is None:
        return torch.full((batch,), n_k, dtype=torch.int64, device=device)
    if not isinstance(seqlens, torch.Tensor) or seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seqlens must be an int32/int64 tensor or None, got "
                        f"{seqlens.dtype if isinstance(seqlens, torch.Tensor) else type(seqlens).__name__}")
    if seqlens.shape != (batch,) or seqlens.device != device:
        raise ValueError(f"seqlens must have shape ({batch},) on {device}, got {tuple(seqlens.shape)} on "
                         f"{seqlens.device}")
    if int(seqlens.min()) < 0 or int(seqlens.max()) > n_k:
        raise ValueError(f"seqlens must lie in [0, {n_k}] (the cache length), got {seqlens.tolist()}")
    return seqlens


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor):
    """(p, lse) of scores (..., N) where only `visible` entries count; rows with none: p = 0, lse = -inf."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.where(visible, torch.exp(scores - lse[..., None]), 0.0)   # -inf - -inf is NaN: masked out
    return p, lse


def mla_naive(q_nope, q_rope, c, k_rope, w_uk, w_uv, *, seqlens=None, sm_scale=None):
    """MLA decoding without absorption, in float64: every head's keys and values expanded from the latent cache.

    q_nope (B, H, Nq, d_nope), q_rope (B, H, Nq, d_rope), c (B, N, r), k_rope (B, N, d_rope), the up-projections
    w_uk (H, d_nope, r) and w_uv (H, d_v, r); `seqlens` (B,) valid entries per sequence (None: all N).
    `sm_scale` defaults to 1/sqrt(d_nope + d_rope), the head dim of the un-absorbed key. Returns o (B, H, Nq, d_v).
    """
    batch, heads, n_q, n_k, _, _ = check_latent_shapes(q_nope, q_rope, c, k_rope, absorbed=False,
                                                       names=("q_nope", "q_rope", "c", "k_rope"))
    d_nope, latent = q_nope.shape[3], c.shape[2]
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        _tensor(name, w, 3, "(heads, head dim, latent dim)")
        if w.shape[0] != heads or w.shape[2] != latent:
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected ({heads}, head dim, {latent})")
    if w_uk.shape[1] != d_nope:
        raise ValueError(f"w_uk has shape {tuple(w_uk.shape)}, expected ({heads}, {d_nope}, {latent}): q_nope's "
                         f"head dim")
    scale = resolve_scale(sm_scale, d_nope + q_rope.shape[3])
    lengths = _lengths(seqlens, batch, n_k, c.device)
    q_nope, q_rope, c, k_rope, w_uk, w_uv = (t.double() for t in (q_nope, q_rope, c, k_rope, w_uk, w_uv))
    k_h = torch.einsum("bnr,hdr->bhnd", c, w_uk)    # (B, H, N, d_nope): a key per head and entry
    v_h = torch.einsum("bnr,hvr->bhnv", c, w_uv)    # (B, H, N, d_v)
    scores = (q_nope @ k_h.transpose(-2, -1) + torch.einsum("bhie,bne->bhin", q_rope, k_rope)) * scale
    p, _ = _masked_softmax(scores, visible_entries(lengths, n_q, n_k))
    return p @ v_h


def absorb(q_nope, w_uk) -> torch.Tensor:
    """The latent queries W_UK_h^T q_nope,h: q_nope (B, H, Nq, d_nope), w_uk (H, d_nope, r) -> (B, H, Nq, r)."""
    _tensor("q_nope", q_nope, 4, "(batch, heads, new tokens, d_nope)")
    _tensor("w_uk", w_uk, 3, "(heads, d_nope, latent dim)")
    if w_uk.shape[:2] != q_nope.shape[1:4:2]:
        raise ValueError(f"w_uk has shape {tuple(w_uk.shape)}, expected ({q_nope.shape[1]}, {q_nope.shape[3]}, r): "
                         f"q_nope's heads and head dim")
    return torch.einsum("bhid,hdr->bhir", q_nope, w_uk)


def up_project(o_latent, w_uv) -> torch.Tensor:
    """Each head's output W_UV_h o_c,h: o_latent (B, H, Nq, r), w_uv (H, d_v, r) -> (B, H, Nq, d_v)."""
    _tensor("o_latent", o_latent, 4, "(batch, heads, new tokens, latent dim)")
    _tensor("w_uv", w_uv, 3, "(heads, d_v, latent dim)")
    if w_uv.shape[0] != o_latent.shape[1] or w_uv.shape[2] != o_latent.shape[3]:
        raise ValueError(f"w_uv has shape {tuple(w_uv.shape)}, expected ({o_latent.shape[1]}, d_v, "
                         f"{o_latent.shape[3]}): o_latent's heads and latent dim")
    return torch.einsum("bhir,hvr->bhiv", o_latent, w_uv)


def mla_absorbed_reference(q_latent, q_rope, c, k_rope, seqlens=None, *, sm_scale=DEEPSEEK_SM_SCALE):
    """Attention of the absorbed queries over the latent cache, in float64: the ground truth of `mla_decode`.

    q_latent (B, H, Nq, r), q_rope (B, H, Nq, d_rope), c (B, N, r), k_rope (B, N, d_rope), `seqlens` (B,) valid
    entries per sequence (None: all N). Keys are [c_j, k_r,j], values c_j. `sm_scale`: 1/sqrt(d_nope + d_rope) of
    the un-absorbed head dim; the default is DeepSeek's 1/sqrt(128 + 64). Returns (o_latent (B, H, Nq, r),
    lse (B, H, Nq)), both float64; lse is the natural-log log-sum-exp of the scaled scores (-inf: no entry seen).
    """
    batch, _, n_q, n_k, _, _ = check_latent_shapes(q_latent, q_rope, c, k_rope)
    scale = check_mla_scale(sm_scale)
    lengths = _lengths(seqlens, batch, n_k, c.device)
    q_latent, q_rope, c, k_rope = (t.double() for t in (q_latent, q_rope, c, k_rope))
    scores = (torch.einsum("bhir,bnr->bhin", q_latent, c) + torch.einsum("bhie,bne->bhin", q_rope, k_rope)) * scale
    p, lse = _masked_softmax(scores, visible_entries(lengths, n_q, n_k))
    return torch.einsum("bhin,bnr->bhir", p, c), lse
