"""Two kernel-core exercises checked in the Triton interpreter (issue 73, item 5): 05b's TMA load path (5b.2) and
10's varlen block ranges (10.4). Each check says "not yet" on the learner's stub, names the wrong heads, blocks or
programs of a plausible wrong answer, refuses the course's own code, and passes on the solution. Both have the
learner write a print_if call."""
from pathlib import Path

import pytest

from utils.course.exercises import check
from utils.course.exercises.flex import check_varlen_blocks
from utils.course.exercises.refuse import RefusedAnswer
from utils.course.exercises.triton_tma import check_tma_attention
from utils.course.learner import code_cell, exec_cell
from utils.triton_utils import interpreting

ROOT = Path(__file__).resolve().parents[1]
NB05B = ROOT / "notebooks" / "05b_triton_fast.ipynb"
NB10 = ROOT / "notebooks" / "10_flex_attention.ipynb"
PRELUDE = """
import torch
import triton
import triton.language as tl
from utils.triton_utils import print_if
"""
# Both checks run the learner's kernels, print_if included, in the interpreter; on a GPU the notebook cells print
# how to run them with TRITON_INTERPRET=1 instead (CPU CI runs these tests).
pytestmark = pytest.mark.skipif(not interpreting(), reason="the checks run in the Triton interpreter")
TMA = "# Exercise 5b.2:"
VARLEN = "# Exercise 10.4:"


def namespace(path, marker, *, learner=False, replace=(), prelude=""):
    ns = {}
    exec_cell(PRELUDE + prelude, ns, "prelude")
    exec_cell(code_cell(path, marker, learner=learner, replace=replace), ns, marker)
    return ns


def run_tma(**kwargs):
    ns = namespace(NB05B, TMA, **kwargs)
    return check_tma_attention(ns["tma_attention"])


def run_varlen(**kwargs):
    ns = namespace(NB10, VARLEN, **kwargs)
    return check_varlen_blocks(ns["varlen_blocks"], ns["show_blocks"])


@pytest.mark.parametrize("run", [run_tma, run_varlen], ids=["5b.2", "10.4"])
def test_solution_passes_and_stub_is_not_yet(run, capsys):
    assert check("t", hint="h")(lambda: run()) == "right"
    assert check("t", hint="h")(lambda: run(learner=True)) == "not yet"


TMA_WRONG = [
    # a K/V head per query head, as without GQA: the grouped heads are named
    ([("kv_first = (pid_h // GROUP) * seqlen_k", "kv_first = pid_h % GROUP * seqlen_k")],
     r"query head 1 \(its K/V head is 0\): rows 0–39 wrong, in Q block\(s\) 0–2"),
    # the tile's index instead of its first row
    ([("k = k_tiles.load([start_n, 0])", "k = k_tiles.load([start_n // BLOCK_N, 0])")],
     r"O is wrong for 4 heads over 2 K/V heads, Nq=40, Nk=37.*query head 0"),
    # the print in another program
    ([('"=0,=3"', '"=0,=0"')], r"printed in program\(s\) \[\(0, 0\)\]: print in program \(0, 3\) only"),
    # the V tile printed instead of the K tile
    ([("print_if(k, ", "print_if(v, ")], r"at key tile 0 print_if printed a \(16, 16\) block that is not K/V head 1"),
]


@pytest.mark.parametrize("replace,match", TMA_WRONG, ids=["kv head", "tile index", "print program", "print V"])
def test_tma_wrong_answer_is_named(replace, match, capsys):
    with pytest.raises(AssertionError, match=match):
        run_tma(replace=replace)


def test_tma_without_descriptors_fails():
    """Pointer loads give the right output but are not the exercise."""
    pointer = ("tl.load(K + kv_first + (start_n + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM + offs_d[None, :], "
               "mask=(start_n + tl.arange(0, BLOCK_N))[:, None] < seqlen_k, other=0.0)")
    replace = [("tl.make_tensor_descriptor(K + kv_first", "dict(base=K + kv_first"),
               ("tl.make_tensor_descriptor(V + kv_first", "dict(base=V + kv_first")]
    ns = namespace(NB05B, TMA, replace=replace + [
                                                  ("k = k_tiles.load([start_n, 0])", f"k = {pointer}"),
                                                  ("v = v_tiles.load([start_n, 0])", f"v = {pointer.replace('K +', 'V +')}")])
    with pytest.raises(AssertionError, match="builds no tensor descriptor"):
        check_tma_attention(ns["tma_attention"])


def test_tma_refuses_the_course_kernels(capsys):
    from utils.course.worklogs import triton_forward as worklog
    with pytest.raises(RefusedAnswer, match="course's own kernel"):
        check_tma_attention(worklog.flash_fwd_kernel)
    # a tma_attention whose loop calls the library's online softmax: the library does the step
    ns = namespace(NB05B, TMA, prelude="from utils.tiled.fast import forward as fast_forward\n",
                   replace=[("m_new = tl.maximum(m_i, tl.max(qk, 1))",
                             "m_new = tl.maximum(m_i, tl.max(qk, 1))\n        fast_forward._online_softmax")])
    with pytest.raises(RefusedAnswer, match="_online_softmax"):
        check_tma_attention(ns["tma_attention"])


VARLEN_WRONG = [
    # top-left causal: wrong only where the key and query lengths of a sequence differ
    ([("shift = seqlen_k - seqlen_q", "shift = 0")],
     r"sequence 1 \(Nq = 30, Nk = 7, causal\), Q block 0 \(rows 0–15\): n_end = 7 \(expected 0\)"),
    # n_full not rounded down to whole key blocks
    ([("n_full = tl.maximum(first_row + shift + 1, 0) // BLOCK_N * BLOCK_N",
       "n_full = tl.maximum(first_row + shift + 1, 0)")],
     r"sequence 0 \(Nq = 37, Nk = 37, causal\), Q block 1 \(rows 16–31\): n_full = 17 \(expected 16\)"),
    # blocks past a sequence's end still visit keys
    ([("tl.where(inside, n_full, 0), tl.where(inside, n_end, 0)", "n_full, n_end")],
     r"sequence 0 \(Nq = 37, Nk = 37, causal\), Q block 3 \(rows 48–63\): n_full = 48 \(expected 0\)"),
    # the print in the transposed program
    ([('"=1,=3"', '"=3,=1"')], r"printed in program\(s\) \[\(3, 1\)\]: print in program \(1, 3\) only"),
]


@pytest.mark.parametrize("replace,match", VARLEN_WRONG, ids=["top-left", "not rounded", "idle", "print program"])
def test_varlen_wrong_answer_is_named(replace, match, capsys):
    with pytest.raises(AssertionError, match=match):
        run_varlen(replace=replace)


def test_varlen_refuses_the_course_device_functions(capsys):
    """A varlen_blocks that calls utils.flex.kernels' _sequence (or _key_range) is refused before it runs."""
    with pytest.raises(RefusedAnswer, match=r"utils\.flex\.kernels\._sequence"):
        run_varlen(prelude="from utils.flex import kernels\n",
                   replace=[("    q_start = tl.load(CU_Q + b)\n",
                             "    q_start, seqlen_q = kernels._sequence(CU_Q, b, 0)\n")])
    from utils.flex import kernels
    with pytest.raises(RefusedAnswer, match="course's own"):
        check_varlen_blocks(kernels._key_range, None)


def test_the_debug_helpers_are_used_in_exercises_of_three_notebooks():
    """Issue 73: the learner writes a print_if, breakpoint_if or test_pid_conds call in at least three notebooks."""
    import json
    import re

    from test_learner_solutions import solutions

    helper = re.compile(r"\b(print_if|breakpoint_if|test_pid_conds)\(")
    using = sorted(path.stem for path in (ROOT / "notebooks").glob("*.ipynb")
                   if any(helper.search(line) for _, block in solutions(json.loads(path.read_text()))
                          for line in block))
    assert len(using) >= 3, f"the debug helpers are written in exercises of {using} only"
