"""Checks for notebook 05's kernel exercises: the step kernels of the FlashAttention-2 forward in Triton.

Every step kernel has one signature, so one launcher runs them all:

    kernel(Q, K, V, O, LSE, seqlen_q, seqlen_k, qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N[, CAUSAL])

on contiguous (batch * heads, seq, head_dim) buffers, with the grid (cdiv(Nq, BLOCK_M), batch * heads); query
head h of a batch reads K/V head h // GROUP, i.e. row pid_bh // GROUP of the K/V buffers (GQA without copies).
`qk_scale` is sm_scale · log2(e): the kernels work in base 2.

The references are computed here from scratch in float64, never by a course kernel. An interpreted kernel
(CPU) runs on fp32 inputs with tight tolerances; a compiled one runs on the GPU on fp16 inputs (fp32 dots
would use TF32) with fp16 tolerances. The checks run odd shapes: Nq and Nk not multiples of the blocks, Nq != Nk, GQA, scores large enough for the running maximum to
move between key blocks. A failure names the (batch, head) slices, rows and Q blocks that are wrong.
"""
from __future__ import annotations

import math

import torch

from utils.exercises import assert_rows_close

LOG2E = 1.4426950408889634
BLOCK_M = BLOCK_N = 16


def launch(kernel, q, k, v, *, causal=None, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """Run a step kernel on (batch, heads, seq, head_dim) tensors; returns (o, lse), lse natural-log.

    `causal=None` launches a kernel without a CAUSAL argument (steps 1-3)."""
    b, h, nq, d = q.shape
    h_kv, nk = k.shape[1], k.shape[2]
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of k's {h_kv}")
    q, k, v = (t.reshape(-1, t.shape[2], d).contiguous() for t in (q, k, v))
    o = torch.zeros_like(q)
    lse = torch.full((b * h, nq), float("nan"), device=q.device, dtype=torch.float32)
    meta = {} if causal is None else {"CAUSAL": causal}
    grid = ((nq + block_m - 1) // block_m, b * h)
    kernel[grid](q, k, v, o, lse, nq, nk, LOG2E / math.sqrt(d), GROUP=h // h_kv, HEAD_DIM=d,
                 BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    return o.view(b, h, nq, d), lse.view(b, h, nq)


def reference(q, k, v, causal: bool = False):
    """(o, lse) in float64: softmax(Q Kᵀ / sqrt(d)) V with K/V heads repeated for GQA and the causal mask aligned
    bottom-right (query i sees key j iff j <= i + Nk - Nq); a query that sees no key gives 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        sees = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(~sees.to(s.device), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def _setting(kernel):
    """(device, dtype, tolerance) for a kernel: interpreted on the CPU in fp32, compiled on the GPU in fp16."""
    from triton.runtime.interpreter import InterpretedFunction  # not imported by `import triton` on a GPU

    if isinstance(kernel, InterpretedFunction):
        return "cpu", torch.float32, 1e-4
    return "cuda", torch.float16, 1e-2


def _qkv(b, h, h_kv, nq, nk, d, growing: bool, seed: int):
    """Random fp32 inputs; `growing` scales the keys up along the sequence so the running maximum rises from
    one key block to the next (a missing rescale of the accumulator cannot hide)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=gen) for x, n in ((h, nq), (h_kv, nk), (h_kv, nk)))
    if growing:
        k = k * torch.linspace(0.5, 4.0, nk)[:, None]
    return q, k, v


def _check(kernel, cases, causal):
    for b, h, h_kv, nq, nk, d, growing in cases:
        device, dtype, tol = _setting(kernel)
        q, k, v = (t.to(device, dtype) for t in _qkv(b, h, h_kv, nq, nk, d, growing, seed=nq * 1000 + nk))
        o, lse = launch(kernel, q, k, v, causal=causal)
        o_ref, lse_ref = reference(q, k, v, causal=bool(causal))
        where = f"B={b}, H={h}, H_kv={h_kv}, Nq={nq}, Nk={nk}, d={d}{', causal' if causal else ''}"
        assert_rows_close(o, o_ref, atol=tol, rtol=tol, block_rows=BLOCK_M, name=f"O ({where})")
        yield lse.cpu(), lse_ref.cpu(), where, tol


def _check_lse(lse, lse_ref, where, tol):
    wrong = (torch.isinf(lse) != torch.isinf(lse_ref)) | (torch.isfinite(lse_ref) & ~torch.isclose(
        lse.double(), lse_ref, atol=tol, rtol=tol))
    if wrong.any():
        rows = wrong.any(0).any(0).nonzero().flatten().tolist()
        raise AssertionError(f"lse ({where}) is wrong in rows {rows[:8]}{' ...' if len(rows) > 8 else ''}: "
                             f"got {lse[wrong][:3].tolist()}, expected {lse_ref[wrong][:3].tolist()}")


def check_online_softmax(kernel) -> None:
    """Exercise 5.1: the online-softmax update of step 1 (Nk a multiple of BLOCK_N, no masks yet)."""
    cases = [(1, 2, 2, 40, 48, 32, True),    # Nq ragged (3 Q blocks, the last one 8 rows), 3 key blocks
             (2, 4, 2, 17, 64, 16, True),    # GQA: 2 query heads per K/V head
             (1, 1, 1, 16, 16, 16, False)]   # one key block: no rescale needed yet
    for _ in _check(kernel, cases, causal=None):
        pass


def check_ragged(kernel) -> None:
    """Exercise 5.2: masks for a ragged last key block (Nk not a multiple of BLOCK_N); o and lse."""
    cases = [(1, 2, 2, 40, 37, 32, True), (2, 4, 1, 5, 100, 16, True), (1, 2, 1, 33, 5, 16, False),
             (1, 1, 1, 16, 48, 16, True)]
    for result in _check(kernel, cases, causal=None):
        _check_lse(*result)


def check_causal(kernel) -> None:
    """Exercise 5.3: the causal mask of the diagonal blocks, bottom-right aligned, with Nq < Nk, Nq > Nk (queries
    that see no key: output 0, lse -inf), Nq = Nk and GQA; and the ragged tail, causal or not."""
    cases = [(1, 2, 1, 40, 56, 32, True), (1, 2, 2, 56, 40, 16, True), (2, 4, 2, 17, 17, 16, False),
             (1, 1, 1, 1, 30, 16, False), (1, 1, 1, 30, 1, 16, False)]
    for causal in (True, False):
        for result in _check(kernel, cases, causal=causal):
            _check_lse(*result)
