"""Checks for the exercises of notebooks 03 (Algorithm 1) and 04 (FlashAttention-2), in PyTorch.

Each reference is computed here, from the mask or the algorithm's definition, or measured by running the
course's implementation with an `HBMCounter`: never by calling the library function that answers the exercise.
While the learner's function runs, the course functions that answer it are refused (`refusing`).
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from utils.eager import forward as flash_pytorch
from utils.course.exercises import assert_rows_close
from utils.course.exercises.naive_attention import course_attention
from utils.course.exercises.refuse import refusing
from utils.eager.forward import HBMCounter, flash1_attention, flash2_attention
from utils.course.testing import random_qkv

# The course functions that answer each exercise, or measure its answer (a run with an HBMCounter).
ANSWERS = {
    "3.1": [flash_pytorch.flash1_block_sizes],
    "3.3": [flash_pytorch.flash1_hbm_accesses, flash_pytorch.flash1_attention],
    "4.1": [flash_pytorch.flash2_kv_end],
    "4.3": [flash_pytorch.flash2_hbm_accesses, flash_pytorch.flash2_attention, flash_pytorch.flash2_program,
            flash_pytorch._flash2_lockstep],
}


def _visible(nq: int, nk: int) -> torch.Tensor:
    """(nq, nk) bool: query i sees key j under the bottom-right causal mask, j <= i + nk - nq."""
    return torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)


def check_block_sizes(block_sizes) -> None:
    """Exercise 3.1: block_sizes(M, d) = (B_r, B_c), Algorithm 1's line 1, checked against its definition:
    B_c is the smallest integer with 4·d·B_c >= M, and B_r = min(B_c, d)."""
    for M in (1, 100, 255, 256, 257, 4096, 49152, 98304, 10**6):
        for d in (16, 64, 80, 128):
            B_c = next(b for b in range(1, M + 1) if 4 * d * b >= M)
            with refusing(*ANSWERS["3.1"]):
                got = block_sizes(M, d)
            assert tuple(got) == (min(B_c, d), B_c), f"block_sizes({M}, {d}) = {got}, expected {(min(B_c, d), B_c)}"
            assert all(isinstance(x, int) for x in got), f"block sizes must be ints, got {got}"


def check_fa1_accesses(fa1_accesses) -> None:
    """Exercise 3.3: fa1_accesses(N, d, M) must equal what `flash1_attention` is measured to move."""
    for N, d, M in [(64, 16, 256), (100, 16, 1000), (33, 8, 4 * 8 * 5), (1, 32, 4096), (256, 32, 32768)]:
        q, k, v = random_qkv(1, 1, N, N, d, seed=N)
        counter = HBMCounter()
        flash1_attention(q, k, v, sram_bytes=4 * M, counter=counter)
        with refusing(*ANSWERS["3.3"]):
            got = fa1_accesses(N, d, M)
        assert got == counter.accesses, f"N={N}, d={d}, M={M}: you count {got:,}, the run made {counter.accesses:,}"


def check_keys_to_visit(keys_to_visit) -> None:
    """Exercise 4.1: keys_to_visit(pid_m, BLOCK_M, Nq, Nk) = one past the last key any query of the block sees."""
    for nq, nk, bm in [(64, 64, 16), (50, 50, 16), (100, 30, 16), (30, 100, 8), (1, 1, 16), (7, 3, 2)]:
        mask = _visible(nq, nk)
        for pid_m in range(-(-nq // bm)):
            seen = mask[pid_m * bm:(pid_m + 1) * bm].any(0).nonzero()
            want = int(seen.max()) + 1 if len(seen) else 0
            with refusing(*ANSWERS["4.1"]):
                got = keys_to_visit(pid_m, bm, nq, nk)
            assert got == want, f"Nq={nq}, Nk={nk}, BLOCK_M={bm}, pid_m={pid_m}: {got}, expected {want}"


def check_fa2_accesses(fa2_accesses) -> None:
    """Exercise 4.3: fa2_accesses(...) must equal what `flash2_attention` is measured to move."""
    for nq, nk, d, bm, bn, causal in [(64, 64, 16, 16, 16, False), (100, 77, 8, 32, 16, False),
                                      (100, 77, 8, 32, 16, True), (77, 100, 8, 16, 32, True),
                                      (30, 12, 8, 8, 8, True), (1, 1, 16, 16, 16, True)]:
        counter = HBMCounter()
        flash2_attention(*random_qkv(1, 1, nq, nk, d), causal=causal, block_m=bm, block_n=bn, counter=counter)
        with refusing(*ANSWERS["4.3"]):
            got = fa2_accesses(nq, nk, d, bm, bn, causal)
        assert got == counter.accesses, (f"Nq={nq}, Nk={nk}, d={d}, blocks {bm}x{bn}, causal={causal}: you count "
                                         f"{got:,}, the run made {counter.accesses:,}")


def _causal_reference(q, k, v, sm_scale):
    """float64 causal attention from its definition: (O, lse), O = 0 and lse = -inf for a row with no key."""
    s = (q.double() @ k.double().T) * sm_scale
    s = s.masked_fill(~_visible(q.shape[0], k.shape[0]), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isneginf(), 0.0, lse)[:, None])
    return p @ v.double(), lse


# (Nq, Nk, d): N not a multiple of the blocks; Nq > Nk, where the first blocks see no key; Nq < Nk
CAPSTONE_SHAPES = [(37, 37, 16), (50, 21, 8), (21, 50, 8), (16, 16, 8)]


class _MatmulWork(TorchDispatchMode):
    """`with _MatmulWork() as work:` ... `work.macs` is the multiply-adds of every matrix product run inside."""

    _PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "mv", "addmv", "dot", "vdot"}

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self._PRODUCTS:
            left = args[1] if name in ("addmm", "baddbmm", "addmv") else args[0]
            self.macs += out.numel() * left.shape[-1]
        return out


def _keys_needed(start_m: int, rows: int, nq: int, nk: int, block_n: int) -> int:
    """The keys of the whole key blocks the queries start_m ... start_m + rows - 1 need, clipped at Nk."""
    n_end = min(nk, start_m + rows + nk - nq)
    return 0 if n_end <= 0 else min(nk, -(-n_end // block_n) * block_n)


def _run_block(flash2_block, q_blk, k, v, start_m, nq, sm_scale, block_n):
    """One call of the learner's block function with the course's attention functions refused; returns its
    result and the multiply-adds of its matrix products."""
    with refusing(*course_attention(), *ANSWERS["4.3"]), _MatmulWork() as work:
        out = flash2_block(q_blk, k, v, start_m, nq, sm_scale, block_n)
    return out, work.macs


def check_flash2_block(flash2_block, *, BLOCK_M: int = 16, BLOCK_N: int = 16) -> None:
    """The capstone of notebook 04: flash2_block(q_blk, k, v, start_m, seqlen_q, sm_scale, BLOCK_N) -> (o, lse)
    for the queries start_m ... start_m + len(q_blk) - 1 of a causal attention, visiting K/V in blocks.

    Runs every Q block of each shape, with the course's attention functions refused, assembles O and lse, and
    compares them with a float64 reference, naming the wrong rows and Q blocks. The matrix products of a block
    may cost at most its own rows against the key blocks they see: computing other rows (a padded call over
    the whole sequence) fails. Then runs each block again with NaN in the key blocks its causal mask hides
    entirely: a block that loads them instead of skipping them gets NaN.
    """
    for nq, nk, d in CAPSTONE_SHAPES:
        q, k, v = (t[0, 0] for t in random_qkv(1, 1, nq, nk, d, dtype=torch.float64, seed=nq * nk))
        sm_scale = d ** -0.5
        o_ref, lse_ref = _causal_reference(q, k, v, sm_scale)
        o, lse = torch.full_like(o_ref, math.nan), torch.full_like(lse_ref, math.nan)
        where = f"Nq={nq}, Nk={nk}, d={d}, BLOCK_M={BLOCK_M}, BLOCK_N={BLOCK_N}"
        work = []
        for start_m in range(0, nq, BLOCK_M):
            rows = slice(start_m, start_m + BLOCK_M)
            (o_blk, lse_blk), macs = _run_block(flash2_block, q[rows], k, v, start_m, nq, sm_scale, BLOCK_N)
            o[rows], lse[rows] = o_blk, lse_blk
            work.append((start_m, len(range(nq)[rows]), macs))
        assert_rows_close(o, o_ref, atol=1e-9, rtol=1e-9, block_rows=BLOCK_M, name=f"O ({where})")
        both_inf = lse.isneginf() & lse_ref.isneginf()
        assert_rows_close(torch.where(both_inf, 0.0, lse)[:, None], torch.where(both_inf, 0.0, lse_ref)[:, None],
                          atol=1e-9, rtol=1e-9, block_rows=BLOCK_M, name=f"lse ({where}; -inf for a row with no key)")
        for start_m in range(0, nq, BLOCK_M):
            last_row = min(start_m + BLOCK_M, nq) - 1
            visited = _keys_needed(start_m, last_row + 1 - start_m, nq, nk, BLOCK_N)   # whole key blocks it needs
            if visited >= nk:
                continue
            k_bad, v_bad = k.clone(), v.clone()
            k_bad[visited:], v_bad[visited:] = math.nan, math.nan
            (o_blk, _), _ = _run_block(flash2_block, q[start_m:last_row + 1], k_bad, v_bad, start_m, nq, sm_scale,
                                       BLOCK_N)
            assert torch.isfinite(o_blk).all(), (
                f"{where}: the Q block of rows {start_m}–{last_row} used keys {visited}–{nk - 1}, which its "
                f"causal mask hides entirely: stop the loop before them (skip, don't mask)")
        for start_m, n_rows, macs in work:   # after the NaN test: a block that masks also does too much work
            budget = 2 * n_rows * d * _keys_needed(start_m, n_rows, nq, nk, BLOCK_N)
            assert macs <= budget, (
                f"{where}: for the Q block of rows {start_m}–{start_m + n_rows - 1} your function's matrix "
                f"products did {macs:,} multiply-adds, more than the {budget:,} of QKᵀ and PV for its own "
                f"{n_rows} rows against the key blocks they see: compute only this block's rows, and only up to "
                f"its last key block (a padded call over the whole sequence does every block's work)")
