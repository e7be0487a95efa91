"""Launchers and checks for notebook 05a, the debugging lab: four small Triton kernels (the last an attention
kernel with grouped K/V heads), each handed over with one planted bug. For each the learner writes a diagnostic,
one print_if / test_pid_conds / breakpoint_if call in a copy of the buggy kernel, then the fix.

A fix's check runs the learner's kernel on odd shapes (sizes that are not multiples of the blocks, more columns
than rows, several head groupings) against a float64 reference computed here, and names the rows, blocks and
heads that are wrong. A diagnostic's check runs the learner's copy with the helpers spied on (`watch_helpers`)
and says whether the call looks in the right program, at the right value, at the right place.
Hints come in two levels (`utils.course.exercises.check`, re-exported here): `check(..., hints=(first, second))`
prints the first, `hint(2)` the second.
"""
from __future__ import annotations

import os
import pdb
import sys

import torch

from utils.course.exercises import HINTS, assert_rows_close, check, hint  # noqa: F401  (05a imports check, hint here)

BLOCK_R = 8      # rows per program in the lab's kernels
BLOCK_C = 16     # columns per block where a kernel loops over column blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rand(*shape, seed: int, scale: float = 1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- Lab 1: a causal softmax (bottom-right aligned) ---------------------------------------------------------

def run_causal_softmax(kernel, s: torch.Tensor) -> torch.Tensor:
    """kernel(S, P, n_rows, n_cols, BLOCK_R, BLOCK_C): softmax of each row of the (n_rows, n_cols) scores over
    the keys it may see (key j for row i iff j <= i + n_cols - n_rows); one program per BLOCK_R rows."""
    s = s.contiguous()
    p = torch.zeros_like(s)
    n_rows, n_cols = s.shape
    kernel[(_cdiv(n_rows, BLOCK_R),)](s, p, n_rows, n_cols, BLOCK_R=BLOCK_R,
                                      BLOCK_C=max(16, 1 << (n_cols - 1).bit_length()))
    return p


def check_causal_softmax(kernel) -> None:
    for n_rows, n_cols in [(20, 20), (13, 29), (1, 5), (17, 17)]:
        s = _rand(n_rows, n_cols, seed=n_rows * 100 + n_cols)
        sees = torch.arange(n_cols)[None, :] <= torch.arange(n_rows)[:, None] + (n_cols - n_rows)
        expected = torch.softmax(s.double().masked_fill(~sees, float("-inf")), -1)
        assert_rows_close(run_causal_softmax(kernel, s), expected, atol=1e-5, rtol=1e-5, block_rows=BLOCK_R,
                          name=f"P ({n_rows}x{n_cols})")


# --- Lab 2: scale each row of a matrix, 2-D tiles -----------------------------------------------------------

def run_scale_rows(kernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kernel(X, W, OUT, n_rows, n_cols, stride, BLOCK_M, BLOCK_N): out[i, j] = x[i, j] * w[i], one program per
    (BLOCK_M, BLOCK_N) tile; grid (cdiv(n_rows, BLOCK_M), cdiv(n_cols, BLOCK_N))."""
    x = x.contiguous()
    out = torch.zeros_like(x)
    n_rows, n_cols = x.shape
    kernel[(_cdiv(n_rows, BLOCK_R), _cdiv(n_cols, BLOCK_C))](x, w.contiguous(), out, n_rows, n_cols, x.stride(0),
                                                              BLOCK_M=BLOCK_R, BLOCK_N=BLOCK_C)
    return out


def check_scale_rows(kernel) -> None:
    for n_rows, n_cols in [(8, 16), (20, 50), (37, 9), (3, 70)]:
        x, w = _rand(n_rows, n_cols, seed=n_rows), _rand(n_rows, seed=n_cols)
        assert_rows_close(run_scale_rows(kernel, x, w), x.double() * w.double()[:, None], atol=1e-6, rtol=1e-6,
                          block_rows=BLOCK_R, name=f"out ({n_rows}x{n_cols})")


# --- Lab 3: softmax-weighted sum, online over column blocks -------------------------------------------------

def run_softmax_dot(kernel, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """kernel(S, V, OUT, n_rows, n_cols, BLOCK_R, BLOCK_C): out[i] = sum_j softmax(s[i])_j v[j], computed in one
    pass over column blocks with a running max, sum and accumulator (the online softmax of notebook 02)."""
    s = s.contiguous()
    out = torch.zeros(s.shape[0], dtype=s.dtype)
    kernel[(_cdiv(s.shape[0], BLOCK_R),)](s, v.contiguous(), out, s.shape[0], s.shape[1], BLOCK_R=BLOCK_R,
                                          BLOCK_C=BLOCK_C)
    return out


def check_softmax_dot(kernel) -> None:
    for n_rows, n_cols, growth in [(20, 64, 3.0), (9, 37, 2.0), (8, 16, 1.0), (5, 100, 0.0)]:
        # `growth` makes later columns larger, so the running max moves from block to block
        s = _rand(n_rows, n_cols, seed=n_cols) * (1 + growth * torch.linspace(0, 1, n_cols))
        v = _rand(n_cols, seed=n_rows)
        expected = torch.softmax(s.double(), -1) @ v.double()
        got = run_softmax_dot(kernel, s, v)
        assert_rows_close(got[:, None], expected[:, None], atol=1e-5, rtol=1e-5, block_rows=BLOCK_R,
                          name=f"out ({n_rows} rows x {n_cols} columns)")


# --- Lab 4: attention with grouped K/V heads (GQA) ----------------------------------------------------------

ATT_BLOCK = 16   # query rows per program, and keys per step of the loop (tl.dot wants 16 or more)
ATT_DIM = 16     # head dimension


def run_gqa_attention(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """kernel(Q, K, V, O, seq_len, n_heads, n_kv_heads, scale, HEAD_DIM, BLOCK_M, BLOCK_N): attention of q
    (n_heads, seq_len, HEAD_DIM) against k, v (n_kv_heads, seq_len, HEAD_DIM); query head h reads K/V head
    h // (n_heads // n_kv_heads). One program per (block of BLOCK_M query rows, query head)."""
    n_heads, seq_len, dim = q.shape
    n_kv_heads = k.shape[0]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    out = torch.zeros_like(q)
    kernel[(_cdiv(seq_len, ATT_BLOCK), n_heads)](q.contiguous(), k.contiguous(), v.contiguous(), out, seq_len,
                                                 n_heads, n_kv_heads, dim ** -0.5, HEAD_DIM=dim,
                                                 BLOCK_M=ATT_BLOCK, BLOCK_N=ATT_BLOCK)
    return out


GQA_SHAPES = [(4, 2, 24), (6, 3, 20), (8, 2, 17), (4, 4, 16), (4, 1, 16)]   # (heads, K/V heads, seq_len)


def check_gqa_attention(kernel) -> None:
    for n_heads, n_kv_heads, seq_len in GQA_SHAPES:
        q = _rand(n_heads, seq_len, ATT_DIM, seed=n_heads)
        k = _rand(n_kv_heads, seq_len, ATT_DIM, seed=10 + n_kv_heads)
        v = _rand(n_kv_heads, seq_len, ATT_DIM, seed=20 + seq_len)
        group = n_heads // n_kv_heads
        kk, vv = (t.double().repeat_interleave(group, 0) for t in (k, v))   # query head h sees K/V head h // group
        expected = torch.softmax(q.double() @ kk.transpose(-1, -2) * ATT_DIM ** -0.5, -1) @ vv
        got = run_gqa_attention(kernel, q, k, v)
        assert_rows_close(got[None], expected[None], atol=1e-4, rtol=1e-4, block_rows=ATT_BLOCK,
                          name=f"O ({n_heads} heads, {n_kv_heads} K/V heads, {seq_len} rows)")


# --- Checks of the learner's diagnostics ---------------------------------------------------------------------
# A diagnostic is a copy of a buggy kernel with one call of print_if, test_pid_conds or breakpoint_if added. The
# check runs it with those three names replaced, in the kernel's globals, by spies that call the real helper and
# record which program called, whether the condition held there, and the kernel's variables at the call.

HELPERS = ("print_if", "test_pid_conds", "breakpoint_if")
_MISSING = object()   # a helper name absent from the kernel's globals before the spies went in


def _as_array(value):
    """A kernel value as a NumPy array (the interpreter wraps one in a tl.tensor), or the value itself."""
    data = getattr(getattr(value, "handle", None), "data", None)
    return data.copy() if data is not None else value


def _program() -> tuple:
    """The (axis 0, axis 1) ids of the program the interpreter is running."""
    from triton.runtime.interpreter import interpreter_builder
    return tuple(int(i) for i in interpreter_builder.grid_idx[:2])


def watch_helpers(kernel, run) -> list[dict]:
    """Run `run()` with the debug helpers spied on in `kernel`'s globals; returns one record per call:
    {"helper", "program", "held", "value", "locals"}."""
    from utils import triton_utils as tu

    fn = getattr(kernel, "fn", None)
    if fn is None or not hasattr(fn, "__globals__"):
        raise TypeError(f"expected a @triton.jit kernel, got {type(kernel).__name__}")
    calls = []

    def record(helper, held, value, frame):
        calls.append({"helper": helper, "program": _program(), "held": bool(held), "value": _as_array(value),
                      "locals": {k: _as_array(v) for k, v in frame.f_locals.items()}})

    def test_pid_conds(conds, *pids):
        held = tu.test_pid_conds(conds, *pids)
        record("test_pid_conds", held, None, sys._getframe(1))
        return held

    def print_if(txt, conds, *pids):
        held = tu.test_pid_conds(conds, *pids)
        record("print_if", held, txt, sys._getframe(1))
        if held:
            print(txt)

    def breakpoint_if(conds, *pids):
        held = tu.test_pid_conds(conds, *pids)
        frame = sys._getframe(1)
        record("breakpoint_if", held, None, frame)
        if held and os.environ.get("PYTHONBREAKPOINT") != "0":
            pdb.Pdb().set_trace(frame)       # as the real breakpoint_if: in the kernel's frame

    spies = {"print_if": print_if, "test_pid_conds": test_pid_conds, "breakpoint_if": breakpoint_if}
    names = fn.__globals__
    saved = {name: names.get(name, _MISSING) for name in HELPERS}
    names.update(spies)
    try:
        run()
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                names.pop(name, None)
            else:
                names[name] = value
    return calls


def _calls_of(calls, helper):
    mine = [c for c in calls if c["helper"] == helper]
    assert mine, f"the kernel never called {helper}: add one {helper} call to it"
    return mine


def _held_in(calls) -> list:
    return sorted({c["program"] for c in calls if c["held"]})


def check_mask_diagnostic(kernel) -> None:
    """5a.1: print_if shows `keep` in program 0 only (it holds row 0, the worst row), on a 12 x 12 input."""
    s = _rand(12, 12, seed=1)
    calls = _calls_of(watch_helpers(kernel, lambda: run_causal_softmax(kernel, s)), "print_if")
    held = [p[0] for p in _held_in(calls)]
    assert held, "print_if printed in no program: its condition never held (the grid has programs 0 and 1)"
    assert held == [0], (f"print_if printed in program(s) {held}: the worst row, row 0, is in program 0 alone; "
                         "print there only")
    shown = [c for c in calls if c["held"]][0]
    keep = shown["locals"].get("keep")
    assert keep is not None, "print_if ran before `keep` was computed: put it after that line"
    value = shown["value"]
    assert hasattr(value, "shape") and value.shape == keep.shape and (value == keep).all(), \
        "print_if printed something other than the mask `keep`: pass the tensor itself as its first argument"


def check_tile_diagnostic(kernel) -> None:
    """5a.3: `selected` = test_pid_conds(...) holds in program (1, 0) alone, on a 20 x 50 input (grid 3 x 4)."""
    x, w = _rand(20, 50, seed=2), _rand(20, seed=3)
    calls = _calls_of(watch_helpers(kernel, lambda: run_scale_rows(kernel, x, w)), "test_pid_conds")
    held = _held_in(calls)
    assert held, "test_pid_conds held in no program of the 3 x 4 grid"
    assert held == [(1, 0)], (f"test_pid_conds held in program(s) {held}: select (pid_m, pid_n) = (1, 0) alone, "
                              "one condition per grid axis")


def check_rescale_diagnostic(kernel) -> None:
    """5a.5: print_if shows `alpha` in program 0 only, once per column block (16 rows x 48 columns: 2 programs,
    3 blocks)."""
    s = _rand(16, 48, seed=4) * torch.linspace(1, 4, 48)
    calls = _calls_of(watch_helpers(kernel, lambda: run_softmax_dot(kernel, s, _rand(48, seed=5))), "print_if")
    shown = [c for c in calls if c["held"]]
    held = [p[0] for p in _held_in(calls)]
    assert held == [0], f"print_if printed in program(s) {held or 'none'}: print in program 0 only"
    assert len(shown) == 3, (f"print_if printed {len(shown)} time(s); the loop runs 3 column blocks: "
                             "put the call inside the loop")
    for step, call in enumerate(shown):
        alpha = call["locals"].get("alpha")
        assert alpha is not None, "print_if ran before `alpha` was computed: put it after that line"
        value = call["value"]
        assert hasattr(value, "shape") and value.shape == alpha.shape and (value == alpha).all(), \
            f"at column block {step} print_if printed something other than `alpha`: pass the tensor itself"


def gqa_inputs():
    """The diagnostic's input: 4 query heads over 2 K/V heads, 16 rows (grid: 1 block x 4 heads)."""
    return (_rand(4, 16, ATT_DIM, seed=6), _rand(2, 16, ATT_DIM, seed=7), _rand(2, 16, ATT_DIM, seed=8))


def check_head_diagnostic(kernel) -> None:
    """5a.7: breakpoint_if stops in a program of query head 1 only, after `kv_head` is computed; prints what
    `p h, kv_head` would show there."""
    calls = _calls_of(watch_helpers(kernel, lambda: run_gqa_attention(kernel, *gqa_inputs())), "breakpoint_if")
    held = _held_in(calls)
    assert held, "breakpoint_if would stop in no program (grid: 1 block of rows x 4 heads)"
    heads = sorted({p[1] for p in held})
    assert set(heads) <= {1, 2}, (f"breakpoint_if would stop in query head(s) {heads}: with 4 heads over 2 K/V "
                                  "heads the report names heads 1 and 2; stop in one of those only (axis 1 of "
                                  "the grid is the head)")
    stop = [c for c in calls if c["held"]][0]
    assert "kv_head" in stop["locals"], "breakpoint_if would stop before `kv_head` is computed: move it after"
    local = stop["locals"]
    shown = ", ".join(f"{name} = {int(torch.as_tensor(local[name]).reshape(-1)[0])}"
                      for name in ("h", "kv_head") if name in local)
    print(f"breakpoint_if stops in program {stop['program']}, where pdb's `p` shows {shown}")
