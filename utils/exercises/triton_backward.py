"""Checks of notebook 07's kernel exercise: the dQ loop of the Triton backward, written by the learner.

The learner's kernel has the signature of notebook 07's `dq_kernel` (contiguous (B, H, N, d) tensors, one program
per (Q block, batch·head)); the check launches it on odd shapes and compares dQ with float64 autograd computed
here, from scratch, so no library kernel can stand in for the learner's.
"""
from __future__ import annotations

import math

import torch

from utils.exercises import assert_rows_close

LOG2E = 1.4426950408889634

# (batch, heads, kv_heads, N_q, N_k, head_dim, causal): ragged ends (no length a multiple of 16), N_q < N_k and
# N_q > N_k (causal: the first rows see no key), GQA and MQA.
DQ_CASES = [
    (1, 4, 2, 45, 70, 32, False),
    (1, 4, 2, 45, 70, 32, True),
    (2, 2, 1, 70, 45, 16, True),
    (1, 2, 2, 33, 33, 16, False),
]


def attention_grads_float64(q, k, v, do, *, causal: bool, scale: float):
    """(out, lse, dq) of softmax attention in float64 by autograd; GQA by repeating K/V heads; causal masks
    bottom-right; rows that see no key give out 0, lse −inf and dq 0 (no NaN)."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    q.requires_grad_()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
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
    (dq,) = torch.autograd.grad(out, q, do)
    return out.detach(), lse, dq


def run_dq_kernel(kernel, q, k, v, do, lse, delta, *, causal: bool, scale: float, block_m: int = 16,
                  block_n: int = 16):
    """Launch a learner's `dq_kernel` (fp32, contiguous) and return dQ."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    # The preprocessing's work, as _bwd_preprocess does it: base-2 lse, +inf for rows that see no key.
    lse2 = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    dev = q.device
    args = [t.float().contiguous().to(dev) for t in (q, k, v, do, lse2, delta)]
    dq = torch.zeros_like(args[0])
    kernel[(math.ceil(nq / block_m), b * h)](*args, dq, h, h // hk, nq, nk, scale * LOG2E, scale,
                                              CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d)
    return dq


def check_dq_kernel(kernel, *, device="cpu", cases=DQ_CASES, block_m: int = 16) -> None:
    """Assert that `kernel` computes dQ on every case; the message names the wrong (batch, head) rows and Q
    blocks. On a GPU fp32 dots run as TF32, hence the looser tolerance there."""
    tol = 2e-2 if torch.device(device).type == "cuda" else 1e-4
    for b, h, hk, nq, nk, d, causal in cases:
        gen = torch.Generator().manual_seed(nq * 1000 + nk)
        q, do = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64) for _ in range(2))
        scale = 1 / math.sqrt(d)
        out, lse, expected = attention_grads_float64(q, k, v, do, causal=causal, scale=scale)
        delta = (do * out).sum(-1)
        got = run_dq_kernel(kernel, *(t.to(device) for t in (q, k, v, do, lse, delta)), causal=causal,
                            scale=scale, block_m=block_m)
        try:
            assert_rows_close(got, expected, atol=tol, rtol=tol, block_rows=block_m, name="dQ")
        except AssertionError as err:
            raise AssertionError(f"B={b} H={h} H_kv={hk} N_q={nq} N_k={nk} d={d} causal={causal}: {err}") from None
