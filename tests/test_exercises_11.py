"""Notebook 11's exercises (the sink's gradient, the window's first key block, the merge of two partial results in
a Triton kernel, per-block FP8 scales): each check says "not yet" on the learner's stub, fails with a message that
names the case and the heads, tiles, rows or blocks that are wrong on plausible wrong answers, refuses the course's
own answers, and passes on the solution. The exercise cells run as a learner sees them."""
import re
from pathlib import Path

import pytest

from utils.course.learner import cell_outcome

NB = Path(__file__).resolve().parents[1] / "notebooks" / "11_attention_2026.ipynb"
PRELUDE = """
import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from utils.course.exercises import check
from utils.course.exercises.modern import (check_block_scales, check_first_key_block, check_merge_two,
                                           check_sink_gradient)

env = SimpleNamespace(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
"""
SINK, WINDOW, MERGE, SCALES = "# Exercise 11.1:", "# Exercise 11.2:", "# Exercise 11.3:", "# Exercise 11.4:"
NUMBER = {SINK: "11.1", WINDOW: "11.2", MERGE: "11.3", SCALES: "11.4"}


def outcome(marker, *, learner=False, replace=()):
    """What the exercise cell's check says: "right", "not yet", or "wrong: <message>"."""
    return cell_outcome(NB, marker, NUMBER[marker], PRELUDE, learner=learner, replace=replace)


@pytest.mark.parametrize("marker", list(NUMBER))
def test_the_solution_is_right_and_the_stub_not_yet(marker):
    assert outcome(marker) == "right"
    assert outcome(marker, learner=True) == "not yet"


BEGIN = "    # BEGIN SOLUTION\n"
WRONG = [
    # 11.1: a sign, a sum over the queries only, no guard for lse = -inf, the course's function
    (SINK, ("return -(", "return ("), r"batch 2, 4 heads.*heads 0–3 wrong"),
    (SINK, (".sum(dim=(0, 2))", ".sum(dim=2)"), r"shape \(2, 4\); expected \(4,\), one number per head"),
    (SINK, ("    lse = torch.where(torch.isneginf(lse), math.inf, lse)", "    pass"),
     r"window 4.*heads 1 wrong: got \[nan\], expected \[0\]; head 1 has no sink"),
    (SINK, (BEGIN, BEGIN + "    from utils.sinks.backward import sink_gradient\n"
                           "    return sink_gradient(sinks, lse, delta)\n"),
     r"refuses the course's own `utils.sinks.backward.sink_gradient`"),
    # 11.2: no bottom-right offset, the window's first key off by one, not a block boundary, below 0, key_blocks
    (WINDOW, ("start_m + seqlen_k - seqlen_q - window + 1", "start_m - window + 1"),
     r"Nq=5, Nk=70, window=16.*tile of queries 0–4: got 0, expected 48 \(its first query sits at position 65"),
    (WINDOW, ("window + 1", "window"), r"Nq=64, Nk=64, window=17.*tile of queries 32–47: got 0, expected 16"),
    (WINDOW, ("return max(left, 0) // block_n * block_n", "return max(left, 0)"),
     r"Nq=37, Nk=37, window=20.*queries 32–36: got 13, expected 0"),
    (WINDOW, ("max(left, 0)", "left"), r"Nq=64, Nk=64.*queries 0–15: got -16, expected 0"),
    (WINDOW, (BEGIN, BEGIN + "    from utils.sinks.forward import key_blocks\n"
                             "    return key_blocks(start_m, block_m=16, block_n=block_n, seqlen_q=seqlen_q, "
                             "seqlen_k=seqlen_k, causal=True, window=window)[0]\n"),
     r"refuses the course's own `utils.sinks.forward.key_blocks`"),
    # 11.3: no guard for two empty sides, an empty side's garbage weighted, no max subtracted, one row block only,
    # the course's merge
    (MERGE, ('m = tl.where(m == float("-inf"), 0.0, m)', "m = m"),
     r"rows 10–12 \(neither side sees a key: o = 0, lse = -inf\): 3 of 3 wrong"),
    (MERGE, (" & (w1[:, None] > 0.0)", ""), r"rows 5–9 \(the first side sees no key .*\): 5 of 5 wrong"),
    (MERGE, ("m = tl.maximum(lse1, lse2)", "m = tl.maximum(lse1, lse2) * 0.0"),
     r"rows 13–20 \(log-sum-exps above 88.7, where exp overflows fp32\): 8 of 8 wrong"),
    (MERGE, ("rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)", "rows = tl.arange(0, BLOCK_R)"),
     r"rows 16–44 wrong \(29 of 45\), in block\(s\) 1–2 of 16 rows"),
    (MERGE, [("@triton.jit\n", "from utils.mla.cascade import merge_two\n\n\n@triton.jit\n"),
             (BEGIN, BEGIN + "    merge_two(O1, LSE1, O2, LSE2)\n")],
     # interpreted, the call runs and is refused; compiled, Triton refuses a Python function in a kernel
     r"refuses the course's own `utils.mla.cascade.merge_two`|does not compile: Unsupported function.*merge_two"),
    # 11.4: no magnitude, no guard for zeros, the short block dropped, the scale upside down, the course's quantiser
    (SCALES, ("x.abs()", "x"), r"batch 0, head 1, block 1's largest magnitude is a negative entry"),
    (SCALES, ("torch.where(amax > 0, amax / 448.0, 1.0)", "amax / 448.0"),
     r"batch 1, head 2, block 1 \(rows 32–63\): got 0, expected 1.*all zeros: its scale is 1"),
    (SCALES, ("blocks = -(-n // block)", "blocks = n // block"), r"scales of shape \(2, 3, 2\), expected \(2, 3, 3\)"),
    (SCALES, ("amax / 448.0, 1.0", "448.0 / amax, 1.0"), r"17 of 18 scales wrong"),   # a block of zeros: 1 still
    (SCALES, (BEGIN, BEGIN + "    from utils.fp8.quant import quantize_per_block\n"
                             "    return quantize_per_block(x, block)[1]\n"),
     r"refuses the course's own `utils.fp8.quant.quantize_per_block`"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NumPy, in the interpreter, on the wrong kernels' NaN and inf
@pytest.mark.parametrize("marker, edit, message", WRONG, ids=[f"{NUMBER[w[0]]}-{i}" for i, w in enumerate(WRONG)])
def test_a_wrong_answer_says_what_is_wrong(marker, edit, message):
    said = outcome(marker, replace=edit if isinstance(edit, list) else [edit])
    assert said.startswith("wrong: ")
    assert re.search(message, said, re.S), said


def test_a_kernel_triton_cannot_compile_is_reported_as_wrong(monkeypatch):
    """On a GPU the learner's kernel is compiled; the compiler's complaint becomes the check's message."""
    from utils.course.exercises import modern

    def refuse(*args, **kwargs):
        raise RuntimeError("Unsupported function referenced: <function merge_two at 0x0>")

    monkeypatch.setattr(modern, "run_merge_two", refuse)
    with pytest.raises(AssertionError, match=r"the kernel does not compile: Unsupported function referenced"):
        modern.check_merge_two(object())
