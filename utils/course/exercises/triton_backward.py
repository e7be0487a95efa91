"""Checks of notebook 07's kernel exercises: the dQ loop of the Triton backward (7.5) and the capstone 7.6, the whole
dK/dV kernel, written by the learner.

The learner's kernels have the signatures of notebook 07's `dq_kernel` (one program per (Q block, batch·head)) and
`dkdv_kernel` (one program per (K/V block, batch·K/V head)), on contiguous (B, H, N, d) tensors; the checks launch
them on odd shapes and compare with float64 autograd computed here, from scratch. The capstone's check also makes
sure the kernel is the learner's own (not a course kernel, not one calling a course device function), that its
launch ran it, and that the course's backward functions refuse to run meanwhile.
"""
from __future__ import annotations

import math

import torch

from utils.course.exercises import assert_rows_close
from utils.course.exercises.refuse import RefusedAnswer, refusing
from utils.course.exercises.triton_forward import counted_launch, learner_kernel

LOG2E = 1.4426950408889634

# (batch, heads, kv_heads, N_q, N_k, head_dim, causal): ragged ends (no length a multiple of 16), N_q < N_k and
# N_q > N_k (causal: the first rows see no key), GQA and MQA.
CASES = [
    (1, 4, 2, 45, 70, 32, False),
    (1, 4, 2, 45, 70, 32, True),
    (2, 2, 1, 70, 45, 16, True),
    (1, 2, 2, 33, 33, 16, False),
]


def attention_grads_float64(q, k, v, do, *, causal: bool, scale: float):
    """(out, lse, dq, dk, dv) of softmax attention in float64 by autograd; GQA by repeating K/V heads (so dk, dv
    sum over a group); causal masks bottom-right; rows that see no key give out 0, lse −inf, no gradient."""
    q, k0, v0, do = (t.detach().double() for t in (q, k, v, do))
    for t in (q, k0, v0):
        t.requires_grad_()
    group = q.shape[1] // k0.shape[1]
    k, v = k0.repeat_interleave(group, dim=1), v0.repeat_interleave(group, dim=1)
    nq, nk = q.shape[-2], k.shape[-2]
    s = scale * q @ k.transpose(-2, -1)
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1).detach()
    seen = visible.any(-1)[:, None]
    # Softmax of rows with no visible key would be NaN, and so would its gradient: give them zeros instead.
    p = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=-1) * seen
    out = p @ v
    dq, dk, dv = torch.autograd.grad(out, (q, k0, v0), do)
    return out.detach(), lse, dq, dk, dv


def run_backward_kernel(kernel, which: str, q, k, v, do, lse, delta, *, causal: bool, scale: float,
                        block_m: int = 16, block_n: int = 16, device="cpu"):
    """Launch a learner's `dq_kernel` (`which="dq"`, returns dQ) or `dkdv_kernel` (`which="dkdv"`, returns
    (dK, dV)) on fp32 contiguous copies of the float64 inputs."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    # The preprocessing's work, as _bwd_preprocess does it: base-2 lse, +inf for rows that see no key.
    lse2 = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    args = [t.float().contiguous().to(device) for t in (q, k, v, do, lse2, delta)]
    shape = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    if which == "dq":
        outs = [torch.zeros_like(args[0])]
        grid = (math.ceil(nq / block_m), b * h)
    elif which == "dkdv":
        outs = [torch.zeros_like(args[1]), torch.zeros_like(args[2])]
        grid = (math.ceil(nk / block_n), b * hk)
    else:
        raise ValueError(f"which must be 'dq' or 'dkdv', got {which!r}")
    counted_launch(kernel, grid, *args, *outs, h, h // hk, nq, nk, scale * LOG2E, scale, **shape)
    return outs[0].cpu() if which == "dq" else tuple(t.cpu() for t in outs)


def _check(kernel, which: str, device, cases, block: int) -> None:
    # On a GPU fp32 dots run as TF32 (10-bit mantissa): a looser tolerance there.
    tol = 2e-2 if torch.device(device).type == "cuda" else 1e-4
    for b, h, hk, nq, nk, d, causal in cases:
        gen = torch.Generator().manual_seed(nq * 1000 + nk)
        q, do = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64) for _ in range(2))
        scale = 1 / math.sqrt(d)
        out, lse, dq, dk, dv = attention_grads_float64(q, k, v, do, causal=causal, scale=scale)
        got = run_backward_kernel(kernel, which, q, k, v, do, lse, (do * out).sum(-1), causal=causal, scale=scale,
                                  block_m=block, block_n=block, device=device)
        pairs = [(got, dq, "dQ")] if which == "dq" else [(got[1], dv, "dV"), (got[0], dk, "dK")]
        try:
            for actual, expected, name in pairs:
                assert_rows_close(actual, expected, atol=tol, rtol=tol, block_rows=block, name=name)
        except AssertionError as err:
            blocks = "Q blocks" if which == "dq" else "K/V blocks"
            raise AssertionError(f"B={b} H={h} H_kv={hk} N_q={nq} N_k={nk} d={d} causal={causal} ({blocks} of "
                                 f"{block}): {err}") from None


def check_dq_kernel(kernel, *, device="cpu", cases=CASES, block: int = 16) -> None:
    """Assert that `kernel` (notebook 07's `dq_kernel`) computes dQ on every case; the message names the wrong
    (batch, head) rows and Q blocks."""
    _check(kernel, "dq", device, cases, block)


# The capstone's cases, each adding one thing to the ones before it:
# (batch, heads, kv_heads, N_q, N_k, head_dim, causal, what the case adds).
DKDV_CASES = [
    (1, 1, 1, 32, 48, 16, False, "several Q and K/V blocks: dV and dK sum over every Q block"),
    (1, 2, 2, 45, 70, 32, False, "ragged ends (no length a multiple of 16) and a second head"),
    (1, 4, 2, 45, 70, 32, False, "GQA: each K/V head sums over the two query heads that share it"),
    (1, 4, 2, 45, 70, 32, True, "the causal mask, bottom-right aligned (N_q < N_k)"),
    (2, 2, 1, 70, 45, 16, True, "a second batch, MQA, and causal with N_q > N_k (the first rows see no key)"),
]
DKDV_BLOCK = 16
DKDV_HINTS = (
    "read which case failed first and what it adds, and the K/V rows and blocks it names; each program owns one "
    "block of keys of one (batch, K/V head): load its K and V tiles once, visit every Q block of every query head "
    "of its group, recompute P there from the stored lse, and add that tile's terms to dV and dK.",
    "program (key block, g): batch ⌊g / (H / GROUP)⌋ and K/V head g mod (H / GROUP); its query heads are "
    "GROUP·(K/V head) plus 0 to GROUP − 1, and the rows of (batch, head) in a (B, H, N, d) buffer start at "
    "(batch·H + head)·N·d. Per Q block: P = 2^(q·kᵀ·qk_scale − lse₂), 0 where the key is at or past N_K or, "
    "causal, key j > query i + N_K − N_Q; dV gains Pᵀ dO; dP = dO Vᵀ; dS = P ∘ (dP − D), D along the keys; "
    "dK gains sm_scale · dSᵀ Q. Query rows past N_Q load zeros and lse₂ = +∞, so their P is 0. Store dK and dV "
    "for the block's keys below N_K.",
)


def _course_backward():
    """The course's functions that compute dK and dV: refused while the capstone's kernel runs."""
    from utils.tiled.fast import backward as fast_backward
    from utils.eager.backward import attention_gradients, flash_attention_pytorch, flash_backward_pytorch
    from utils.tiled.attention import flash_attention
    from utils.tiled.backward import flash_attention_backward

    return (attention_gradients, flash_attention_pytorch, flash_backward_pytorch, flash_attention,
            flash_attention_backward, fast_backward.flash_attention, fast_backward.flash_attention_backward)


def check_dkdv_kernel(kernel, *, device="cpu") -> None:
    """Exercise 7.6, the capstone: the whole dK/dV kernel `dkdv_kernel`, on DKDV_CASES. dV, then dK, are compared
    with float64 autograd; a failure names the case, what it adds, and the wrong (batch, K/V head) key rows and
    K/V blocks. Course kernels and backward functions are refused, and the launch must run the kernel passed."""
    learner_kernel(kernel, "dkdv_kernel")
    answers = _course_backward()
    # On a GPU fp32 dots run as TF32 (10-bit mantissa): a looser tolerance there.
    tol = 2e-2 if torch.device(device).type == "cuda" else 1e-4
    for number, (b, h, hk, nq, nk, d, causal, adds) in enumerate(DKDV_CASES, 1):
        gen = torch.Generator().manual_seed(nq * 1000 + nk + number)
        q, do = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64) for _ in range(2))
        scale = 1 / math.sqrt(d)
        out, lse, _, dk, dv = attention_grads_float64(q, k, v, do, causal=causal, scale=scale)
        with refusing(*answers):
            got_dk, got_dv = run_backward_kernel(kernel, "dkdv", q, k, v, do, lse, (do * out).sum(-1),
                                                 causal=causal, scale=scale, block_m=DKDV_BLOCK,
                                                 block_n=DKDV_BLOCK, device=device)
        try:
            assert_rows_close(got_dv, dv, atol=tol, rtol=tol, block_rows=DKDV_BLOCK, name="dV")
            assert_rows_close(got_dk, dk, atol=tol, rtol=tol, block_rows=DKDV_BLOCK, name="dK")
        except RefusedAnswer:
            raise
        except AssertionError as err:
            raise AssertionError(
                f"case {number} (B={b}, H={h}, H_kv={hk}, N_q={nq}, N_k={nk}, d={d}{', causal' if causal else ''}), "
                f"the first to add {adds}; rows are keys, heads K/V heads, K/V blocks of {DKDV_BLOCK} keys:\n  {err}"
            ) from None
