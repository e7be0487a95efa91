"""Test helpers: random inputs and closeness checks of outputs and gradients with dtype-aware tolerances
(torch.testing.assert_close)."""
from __future__ import annotations

import torch

from utils.checks import resolve_scale
from utils.eager.reference import causal_mask, naive_attention, reference_attention

# Attention outputs are averages of V rows, of order 1 for standard-normal inputs. fp32 allows for TF32 dots
# on GPUs (10-bit mantissa); fp16 and bf16 for rounding of P before the P·V product.
TOLERANCES = {
    torch.float64: dict(atol=1e-7, rtol=1e-7),
    torch.float32: dict(atol=3e-3, rtol=3e-3),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim) that every implementation is checked on, small enough
# for the Triton interpreter: seqlen 1, lengths that are not a multiple of any block, Nq != Nk both ways (Nq > Nk
# leaves rows that see no key when causal), GQA and MQA, head dims 80 and 96 that are not powers of two.
ATTENTION_SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 2, 2, 17, 17, 32),
    (1, 4, 2, 64, 64, 64),
    (1, 2, 1, 33, 70, 80),
    (1, 2, 2, 70, 33, 96),
    (1, 2, 2, 128, 128, 128),
]


def tolerances(dtype: torch.dtype) -> dict:
    """{'atol': ..., 'rtol': ...} for comparing attention outputs computed in `dtype`."""
    if dtype not in TOLERANCES:
        raise TypeError(f"no tolerances for dtype {dtype}; known: {', '.join(map(str, TOLERANCES))}")
    return dict(TOLERANCES[dtype])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, msg=None):
    """assert_close in float64 with the tolerances of `dtype` (default: actual's dtype)."""
    tol = tolerances(dtype or actual.dtype)
    torch.testing.assert_close(actual.double(), expected.double(), **tol, equal_nan=False, msg=msg)


def random_qkv(batch=2, heads=4, seqlen_q=128, seqlen_k=None, head_dim=64, *, kv_heads=None,
               dtype=torch.float32, device="cpu", seed=0):
    """Standard-normal q, k, v of shape (batch, heads, seq, head_dim); k and v get `kv_heads` heads."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    kv_heads = heads if kv_heads is None else kv_heads
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(h, n):
        return torch.randn(batch, h, n, head_dim, generator=gen).to(device=device, dtype=dtype)

    return rand(heads, seqlen_q), rand(kv_heads, seqlen_k), rand(kv_heads, seqlen_k)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` one element past a 16-byte boundary: same shape, strides and values, another
    alignment (Triton specializes a pointer on it; a kernel's cache of kinds of call must keep it apart)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


def assert_attention_matches_reference(fn, q, k, v, *, causal=False, sm_scale=None):
    """Run `fn(q, k, v, causal=..., sm_scale=...)` and compare it with the float64 reference."""
    out = fn(q, k, v, causal=causal, sm_scale=sm_scale)
    if out.shape != q.shape:
        raise AssertionError(f"output shape {tuple(out.shape)} != q's shape {tuple(q.shape)}")
    expected = reference_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    assert_close(out, expected, dtype=q.dtype)
    return out


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim) that the fixed-head-dim CUDA kernels (D = 64 or 128)
# must survive: a single row, lengths off every tile size, Nq > Nk (causal rows without keys) and Nq < Nk, GQA
# and MQA, several tiles of keys, both head dims.
ODD_SHAPES_64_128 = [(1, 1, 1, 1, 1, 64), (2, 2, 2, 17, 17, 128), (1, 4, 2, 200, 333, 64), (1, 2, 1, 333, 100, 128),
                     (2, 3, 3, 256, 256, 64), (1, 2, 2, 1000, 1000, 128), (1, 2, 2, 129, 1500, 64)]


def assert_matches_on_odd_shapes(fn, *, dtype, causal, device="cuda", shapes=ODD_SHAPES_64_128):
    """`fn` against the float64 reference on every shape of `shapes`, then on large logits (scores ~1e3)."""
    for b, h, hk, nq, nk, d in shapes:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=device, seed=nq + nk)
        assert_attention_matches_reference(fn, q, k, v, causal=causal)
    q, k, v = random_qkv(1, 2, 300, 300, 64, dtype=dtype, device=device)
    assert_attention_matches_reference(fn, q * 20, k, v, causal=causal, sm_scale=0.3)


def reference_lse(q, k, *, causal=False, sm_scale=None) -> torch.Tensor:
    """The float64 log-sum-exp of each query row's scaled scores (B, H, Nq), with GQA and bottom-right causal
    alignment: what a forward that returns lse must match; -inf for rows that see no key."""
    scale = resolve_scale(sm_scale, q.shape[-1])
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


# Gradients sum over N terms and pass through two rounded products (P, dS): looser than outputs. Each is compared
# relative to its largest entry.
GRAD_TOLERANCES = {torch.float64: (1e-9, 1e-7), torch.float32: (2e-4, 2e-4), torch.float16: (2e-2, 2e-2),
                   torch.bfloat16: (6e-2, 6e-2)}


def reference_gradients(q, k, v, do, *, causal=False, sm_scale=None):
    """(dq, dk, dv) by autograd through the naive formula in float64: the ground truth."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = naive_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    return torch.autograd.grad(out, (q, k, v), do.double())


def assert_gradients_close(actual, expected, dtype: torch.dtype):
    """(dq, dk, dv) against the reference's, each within GRAD_TOLERANCES[dtype] of its largest entry; a failure
    names the gradient and the worst entries (torch.testing's message)."""
    if dtype not in GRAD_TOLERANCES:
        raise TypeError(f"no gradient tolerances for dtype {dtype}; known: {', '.join(map(str, GRAD_TOLERANCES))}")
    atol, rtol = GRAD_TOLERANCES[dtype]
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected, strict=True):
        if a.shape != e.shape:
            raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
        scale = max(1.0, e.abs().max().item())
        torch.testing.assert_close(a.double(), e, atol=atol * scale, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def assert_gradients_match_reference(fn, q, k, v, *, causal=False, sm_scale=None, seed=1):
    """Differentiate `fn(q, k, v, causal=..., sm_scale=...)` with a random dO and compare the gradients with
    `reference_gradients`; returns them."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.device, q.dtype)
    grads = torch.autograd.grad(fn(q, k, v, causal=causal, sm_scale=sm_scale), (q, k, v), do)
    for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if g.dtype != t.dtype or g.device != t.device:
            raise AssertionError(f"{name} is {g.dtype} on {g.device}, its input {t.dtype} on {t.device}")
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal, sm_scale=sm_scale), q.dtype)
    return grads


def pairwise(axes: dict) -> list[dict]:
    """A covering design of strength 2: rows (one value per axis) in which every pair of values of every two axes
    appears at least once, far fewer rows than the full product when there are several axes.

    `axes` maps an axis name to its values (a non-empty sequence). Greedy and deterministic: each row starts
    from the first pair not yet covered, and every other axis takes the value that covers the most new pairs
    (the first such value on a tie). A single axis gives one row per value."""
    if not isinstance(axes, dict) or not axes:
        raise ValueError(f"axes must be a non-empty dict of name -> values, got {axes!r}")
    names = list(axes)
    values = []
    for name in names:
        if isinstance(axes[name], (str, bytes)) or not hasattr(axes[name], "__len__") or not len(axes[name]):
            raise ValueError(f"axis {name!r} must be a non-empty sequence of values, got {axes[name]!r}")
        values.append(list(axes[name]))
    if len(names) == 1:
        return [{names[0]: v} for v in values[0]]
    # a pair is (axis i, value index a, axis j, value index b) with i < j
    todo = {(i, a, j, b) for i in range(len(names)) for j in range(i + 1, len(names))
            for a in range(len(values[i])) for b in range(len(values[j]))}
    rows = []
    while todo:
        i, a, j, b = min(todo)
        row = {i: a, j: b}
        for axis in range(len(names)):
            if axis in row:
                continue

            def gain(c, axis=axis):
                return sum((min(axis, o), c if axis < o else row[o], max(axis, o), row[o] if axis < o else c)
                           in todo for o in row)

            row[axis] = max(range(len(values[axis])), key=lambda c: (gain(c), -c))
        todo -= {(p, row[p], q, row[q]) for p in row for q in row if p < q}
        rows.append({names[axis]: values[axis][row[axis]] for axis in range(len(names))})
    return rows
