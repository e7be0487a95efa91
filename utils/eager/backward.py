"""The FlashAttention-2 backward pass in PyTorch: the gradient formulas, then the same computation in tiles.

With S = scale·Q Kᵀ (masked), P = softmax(S) row by row and O = P V, the gradients of a loss L given dO = ∂L/∂O:

    dV = Pᵀ dO        dP = dO Vᵀ        D = rowsum(dO ∘ O)        dS = P ∘ (dP − D)
    dQ = scale · dS K                   dK = scale · dSᵀ Q

P is never stored: the forward saves only O and the row log-sum-exp `lse` (natural log, -inf for a row that sees
no key), and the backward recomputes P = exp(S − lse) one tile at a time. `flash_backward_pytorch` runs in the
order of FlashAttention-2 (Dao, 2023, Algorithm 2, with the dQ pass split off as in its Triton implementation):
1. preprocess: D = rowsum(dO ∘ O);
2. for each K/V block: loop over the Q blocks that can see it, accumulating dK and dV for that block;
3. for each Q block: loop over the K/V blocks it can see, accumulating dQ.
Every tile is (block_q × block_k): memory beyond the inputs and gradients is O(N·D), not O(N²).

`KernelPair` and `wants_grad` make a compiled forward and backward one differentiable operation (the Gluon and
the Hopper CUDA entries of the registry use them).
"""
from __future__ import annotations

import math

import torch

from utils.eager.forward import flash2_attention
from utils.checks import check_attention_inputs, positive_int, resolve_scale

__all__ = ["attention_gradients", "flash_backward_pytorch", "FlashAttentionPyTorch",
           "flash_attention_pytorch", "saved_tensor_bytes", "check_backward_inputs"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32




def check_backward_inputs(do, q, k, v, o, lse, *, causal, sm_scale, head_dims=None, dtypes=None):
    """Validate the inputs of a backward pass; return (shape, scale). q, k, v as in `check_attention_inputs`;
    do and o must match q (shape, dtype, device); lse must be a floating (batch, heads, seqlen_q) tensor."""
    kwargs = {} if dtypes is None else {"dtypes": dtypes}
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=head_dims, **kwargs)
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; they must match")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    expected = (shape.batch, shape.heads, shape.seqlen_q)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {expected}, got {tuple(lse.shape)}")
    if not lse.is_floating_point():
        raise TypeError(f"lse must be a floating-point tensor, got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}; they must match")
    return shape, resolve_scale(sm_scale, shape.head_dim)


def _expand_kv(k, v, heads):
    """K/V repeated to Q's head count (GQA): each group of heads//kv_heads query heads shares one K/V head."""
    group = heads // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _sum_groups(grad, kv_heads):
    """Gradients of the repeated K/V heads summed back into the shared heads: (B, H, N, D) -> (B, Hkv, N, D)."""
    b, h, n, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, n, d).sum(dim=2)


def _safe_lse(lse):
    """lse with -inf (rows that see no key) replaced by +inf, so that exp(S - lse) is 0 there instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def attention_gradients(do, q, k, v, o, lse, *, causal=False, sm_scale=None):
    """(dq, dk, dv) by the formulas, with the full (Nq × Nk) matrices: P recomputed from Q, K and lse.

    Computed in fp32 (fp64 for fp64 inputs) and returned in q's dtype. Memory O(N²): this is the derivation
    written out, the yardstick for the tiled versions.
    """
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)
    ct = _compute_dtype(q.dtype)
    q_, k_, v_, o_, do_ = (t.to(ct) for t in (q, k, v, o, do))
    k_, v_ = _expand_kv(k_, v_, shape.heads)
    s = scale * q_ @ k_.transpose(-2, -1)
    p = torch.exp(s - _safe_lse(lse.to(ct))[..., None])
    if causal:
        from utils.eager.reference import causal_mask
        p = p.masked_fill(~causal_mask(shape.seqlen_q, shape.seqlen_k, q.device), 0.0)
    dv = p.transpose(-2, -1) @ do_                    # dV = Pᵀ dO
    dp = do_ @ v_.transpose(-2, -1)                   # dP = dO Vᵀ
    delta = (do_ * o_).sum(-1, keepdim=True)          # D = rowsum(dO ∘ O) = rowsum(P ∘ dP)
    ds = p * (dp - delta)                             # dS = P ∘ (dP − D)
    dq = scale * ds @ k_                              # dQ = scale · dS K
    dk = scale * ds.transpose(-2, -1) @ q_            # dK = scale · dSᵀ Q
    dk, dv = _sum_groups(dk, shape.kv_heads), _sum_groups(dv, shape.kv_heads)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _tile_mask(rows, cols, offset, causal, device):
    """(len(rows) × len(cols)) boolean mask of visible (query, key) pairs, or None when all are visible."""
    if not causal:
        return None
    return torch.arange(cols.start, cols.stop, device=device)[None, :] <= \
        torch.arange(rows.start, rows.stop, device=device)[:, None] + offset


def _visible(rows, cols, offset, causal):
    """Whether any (query, key) pair of the tile is visible: causal block skipping."""
    return not causal or cols.start <= rows.stop - 1 + offset


def flash_backward_pytorch(do, q, k, v, o, lse, *, causal=False, sm_scale=None, block_q=64, block_k=64):
    """Tiled backward in FlashAttention-2 order; returns (dq, dk, dv) in q's dtype (dk, dv with K/V's heads).

    Only (block_q × block_k) tiles of P, dP and dS exist at any time. Rows with lse = -inf (no visible key)
    get zero gradients.
    """
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)
    block_q, block_k = positive_int("block_q", block_q), positive_int("block_k", block_k)
    ct = _compute_dtype(q.dtype)
    nq, nk, offset = shape.seqlen_q, shape.seqlen_k, shape.seqlen_k - shape.seqlen_q
    kx, vx = _expand_kv(k, v, shape.heads)
    lse = _safe_lse(lse.to(ct))

    # 1. preprocess: D_i = rowsum(dO_i ∘ O_i), one number per query row.
    delta = (do.to(ct) * o.to(ct)).sum(-1)

    def tile(rows, cols):
        """Recompute P, dP and dS for one tile; returns (qi, doi, kj, p, ds)."""
        qi, doi = q[:, :, rows.start:rows.stop].to(ct), do[:, :, rows.start:rows.stop].to(ct)
        kj, vj = kx[:, :, cols.start:cols.stop].to(ct), vx[:, :, cols.start:cols.stop].to(ct)
        p = torch.exp(scale * qi @ kj.transpose(-2, -1) - lse[:, :, rows.start:rows.stop, None])
        mask = _tile_mask(rows, cols, offset, causal, q.device)
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
        dp = doi @ vj.transpose(-2, -1)
        ds = p * (dp - delta[:, :, rows.start:rows.stop, None])
        return qi, doi, kj, p, ds

    # 2. one K/V block at a time: loop over the Q blocks that see it; dK_j, dV_j stay in "registers".
    dk = torch.zeros(kx.shape, dtype=ct, device=q.device)
    dv = torch.zeros(vx.shape, dtype=ct, device=q.device)
    for j0 in range(0, nk, block_k):
        cols = range(j0, min(j0 + block_k, nk))
        first = max(0, j0 - offset) // block_q * block_q if causal else 0   # earlier Q blocks see none of it
        dk_j = torch.zeros((*q.shape[:2], len(cols), shape.head_dim), dtype=ct, device=q.device)
        dv_j = torch.zeros_like(dk_j)
        for i0 in range(first, nq, block_q):
            rows = range(i0, min(i0 + block_q, nq))
            qi, doi, _, p, ds = tile(rows, cols)
            dv_j += p.transpose(-2, -1) @ doi
            dk_j += ds.transpose(-2, -1) @ qi
        dk[:, :, cols.start:cols.stop], dv[:, :, cols.start:cols.stop] = scale * dk_j, dv_j

    # 3. one Q block at a time: loop over the K/V blocks it sees; dQ_i accumulates.
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    for i0 in range(0, nq, block_q):
        rows = range(i0, min(i0 + block_q, nq))
        for j0 in range(0, nk, block_k):
            cols = range(j0, min(j0 + block_k, nk))
            if not _visible(rows, cols, offset, causal):
                break
            _, _, kj, _, ds = tile(rows, cols)
            dq[:, :, rows.start:rows.stop] += scale * ds @ kj
    dk, dv = _sum_groups(dk, shape.kv_heads), _sum_groups(dv, shape.kv_heads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionPyTorch(torch.autograd.Function):
    """Tiled forward and backward as one differentiable operation: saves q, k, v, o and lse, never P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, block_q, block_k):
        o, lse = flash2_attention(q, k, v, causal=causal, sm_scale=sm_scale, block_m=block_q, block_n=block_k,
                                  return_lse=True)  # notebook 04's forward
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = dict(causal=causal, sm_scale=sm_scale, block_q=block_q, block_k=block_k)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward_pytorch(do, q, k, v, o, lse, **ctx.args)
        return dq, dk, dv, None, None, None, None


class KernelPair(torch.autograd.Function):
    """A forward and a backward kernel as one differentiable operation: `forward(q, k, v, causal=, sm_scale=)`
    returns (o, lse) and saves q, k, v, o, lse; `backward(do, q, k, v, o, lse, causal=, sm_scale=)` returns
    (dq, dk, dv)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, forward, backward):
        o, lse = forward(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.backward = causal, sm_scale, backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward(do, q, k, v, o, lse, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None, None, None


def wants_grad(*tensors) -> bool:
    """Whether autograd would record an operation on `tensors` (a call may skip KernelPair's host time if not)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def flash_attention_pytorch(q, k, v, *, causal=False, sm_scale=None, block_q=64, block_k=64):
    """Differentiable tiled attention in PyTorch (registry signature): forward and backward in tiles."""
    check_attention_inputs(q, k, v, causal=causal)
    resolve_scale(sm_scale, q.shape[-1])
    return FlashAttentionPyTorch.apply(q, k, v, causal, sm_scale, positive_int("block_q", block_q),
                                       positive_int("block_k", block_k))


def saved_tensor_bytes(fn, *args, **kwargs) -> int:
    """Bytes of the tensors autograd saves for the backward while running `fn(*args, **kwargs)`.

    Counts each storage once, and leaves out the inputs in `args` themselves (they exist anyway). A
    device-independent measure of the backward's memory: standard attention saves the N×N probabilities.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(storages.values())
