"""Exercise 5b.2 (notebook 05b): the TMA load path of the forward's key loop, checked in the Triton interpreter.

The learner's kernel `tma_attention(Q, K, V, O, seqlen_q, seqlen_k, qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N)`
computes non-causal attention of contiguous (heads, seq, HEAD_DIM) tensors, one program per (Q block, query
head); query head h reads K/V head h // GROUP. Its K and V tiles come through tensor descriptors
(`tl.make_tensor_descriptor`, `.load`), and one `print_if` shows the K tiles that program (0, 3) loads.
"""
from __future__ import annotations

import numpy as np
import torch

from utils.course.exercises import _spans
from utils.course.exercises.debug_lab import _calls_of, _held_in, watch_helpers
from utils.course.exercises.refuse import RefusedAnswer, refusing
from utils.course.exercises.triton_forward import _jit_function, _names, learner_kernel

BLOCK = 16                     # BLOCK_M = BLOCK_N: tl.dot wants 16 or more
DIM = 16
CASES = [(4, 2, 40, 37), (2, 1, 17, 64), (2, 2, 16, 5)]   # (heads, K/V heads, seqlen_q, seqlen_k): ragged, GQA
PRINT_CASE = (4, 2, 16, 20)    # the print's input: program (0, 3) reads K/V head 1, two key tiles, the last ragged
PRINT_PROGRAM = (0, 3)


def _inputs(heads, kv_heads, seqlen_q, seqlen_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, seqlen_q, DIM, generator=gen)
    k, v = (torch.randn(kv_heads, seqlen_k, DIM, generator=gen) for _ in range(2))
    return q, k, v


def run_tma_attention(kernel, q, k, v):
    """Launch the learner's kernel on q (heads, Nq, D), k and v (kv_heads, Nk, D), fp32; returns O."""
    heads, seqlen_q, dim = q.shape
    kv_heads, seqlen_k = k.shape[:2]
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of k's {kv_heads}")
    out = torch.zeros_like(q)
    grid = ((seqlen_q + BLOCK - 1) // BLOCK, heads)
    kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), out, seqlen_q, seqlen_k,
                 dim ** -0.5 * 1.4426950408889634, GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=BLOCK,
                 BLOCK_N=BLOCK)
    return out


def _expected(q, k, v):
    group = q.shape[0] // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, 0) for t in (k, v))
    return torch.softmax(q.double() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ vv


def _where_wrong(got, expected, group, case) -> str:
    """Which (head, Q block) programs are wrong, and a guess from the pattern."""
    bad = ~torch.isclose(got.double(), expected, atol=1e-4, rtol=1e-4)
    heads = bad.any(-1).any(-1).nonzero().flatten().tolist()
    lines = []
    for h in heads[:3]:
        rows = bad[h].any(-1).nonzero().flatten().tolist()
        blocks = sorted({r // BLOCK for r in rows})
        lines.append(f"query head {h} (its K/V head is {h // group}): rows {_spans(rows)} wrong, in Q block(s) "
                     f"{_spans(blocks)}")
    heads_s, kv_heads, seqlen_q, seqlen_k = case
    return (f"{heads_s} heads over {kv_heads} K/V heads, Nq={seqlen_q}, Nk={seqlen_k} (key tiles of {BLOCK}, "
            f"the last {seqlen_k - (seqlen_k - 1) // BLOCK * BLOCK} rows): " + "; ".join(lines))


def _silenced(fn):
    """The kernel's globals with print_if made silent: the correctness runs print nothing."""
    names = fn.__globals__
    saved = names.get("print_if")
    names["print_if"] = lambda *args, **kwargs: None
    return names, saved


def check_tma_attention(kernel) -> None:
    """5b.2: the descriptors and tile loads (outputs right on ragged lengths and GQA), then the print_if of the
    K tiles of program (0, 3)."""
    learner_kernel(kernel, "tma_attention")
    fn = _jit_function(kernel)
    from utils.course.worklogs import triton_forward as worklog
    from utils.tiled import forward as lesson
    from utils.tiled.fast import forward as fast
    names, saved = _silenced(fn)
    try:     # the course's kernels that load through descriptors (and notebook 05's) answer nothing here
        with refusing(fast._launch, fast.flash_attention_forward, worklog._launch, lesson.flash_attention_forward):
            for seed, case in enumerate(CASES):
                q, k, v = _inputs(*case, seed=seed)
                got = run_tma_attention(kernel, q, k, v)
                expected = _expected(q, k, v)
                if not torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-4):
                    raise AssertionError("O is wrong for " + _where_wrong(got, expected, case[0] // case[1], case))
    finally:
        if saved is None:
            names.pop("print_if", None)
        else:
            names["print_if"] = saved
    if "make_tensor_descriptor" not in _names(fn.__code__):    # checked after the run: a stub says "not yet"
        raise AssertionError("tma_attention builds no tensor descriptor: load K and V through "
                             "tl.make_tensor_descriptor and its .load, not with pointers")
    _check_tile_print(kernel)


def _check_tile_print(kernel) -> None:
    q, k, v = _inputs(*PRINT_CASE, seed=9)
    with np.printoptions(precision=2, suppress=True, linewidth=150):    # a tile row on one line
        calls = _calls_of(watch_helpers(kernel, lambda: run_tma_attention(kernel, q, k, v)), "print_if")
    held = _held_in(calls)
    assert held == [PRINT_PROGRAM], (f"print_if printed in program(s) {held or 'none'}: print in program "
                                     f"{PRINT_PROGRAM} only (Q block 0 of query head 3)")
    shown = [c for c in calls if c["held"]]
    n_tiles = (PRINT_CASE[3] + BLOCK - 1) // BLOCK
    assert len(shown) == n_tiles, (f"print_if printed {len(shown)} time(s); the loop loads {n_tiles} K tiles: put "
                                   "the call inside the loop, after the load")
    kv_head = PRINT_PROGRAM[1] // (PRINT_CASE[0] // PRINT_CASE[1])
    for tile, call in enumerate(shown):
        value = call["value"]
        want = np.zeros((BLOCK, DIM), dtype=np.float32)
        rows = k[kv_head, tile * BLOCK:(tile + 1) * BLOCK].numpy()
        want[:len(rows)] = rows
        if not (isinstance(value, np.ndarray) and value.shape == want.shape):
            raise AssertionError(f"at key tile {tile} print_if printed {type(value).__name__} "
                                 f"{getattr(value, 'shape', '')}: pass the K tile itself")
        if not np.allclose(value, want):
            raise AssertionError(f"at key tile {tile} print_if printed a ({BLOCK}, {DIM}) block that is not K/V head "
                                 f"{kv_head}'s keys {tile * BLOCK}–{tile * BLOCK + BLOCK - 1}: print the K tile")
    zero = int((shown[-1]["value"] == 0).all(-1).sum())
    print(f"program {PRINT_PROGRAM} printed its {n_tiles} K tiles; the last has {zero} rows of zeros, past "
          f"seqlen_k = {PRINT_CASE[3]}: the descriptor's bounds, no mask")


__all__ = ["check_tma_attention", "run_tma_attention", "RefusedAnswer"]
