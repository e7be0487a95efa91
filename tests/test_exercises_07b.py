"""Notebook 07b's exercises (the fake functions of the attention operator and of its backward, the transformers
adapter): each check says "not yet" on the learner's stub, fails with a message that names the case and what
is wrong on plausible wrong answers, refuses the course's own answers, and passes on the solution. The exercise
cells run as a learner sees them."""
import re
from pathlib import Path

import pytest

from utils.course.learner import cell_outcome

NB = Path(__file__).resolve().parents[1] / "notebooks" / "07b_real_model.ipynb"
PRELUDE = """
import torch
from utils.course.exercises import check
from utils.course.exercises.ops import check_attention_fake, check_backward_fake, check_transformers_adapter
from utils.ops import attention as ops, hf
"""
FAKE, BACKWARD, ADAPTER = "# Exercise 7b.1:", "# Exercise 7b.2:", "# Exercise 7b.3:"
NUMBER = {FAKE: "7b.1", BACKWARD: "7b.2", ADAPTER: "7b.3"}


def outcome(marker, *, learner=False, replace=()):
    """What the exercise cell's check says: "right", "not yet", or "wrong: <message>"."""
    return cell_outcome(NB, marker, NUMBER[marker], PRELUDE, learner=learner, replace=replace)


@pytest.mark.parametrize("marker", list(NUMBER))
def test_the_solution_is_right_and_the_stub_not_yet(marker):
    assert outcome(marker) == "right"
    assert outcome(marker, learner=True) == "not yet"


WRONG = [
    (FAKE, ("q.new_empty(q.shape)", "torch.empty_like(q)"), r"bnhd layout, not contiguous.*o has strides"),
    (FAKE, ("dtype=torch.float32)", "dtype=q.dtype)"), r"float16: lse has dtype torch.float16"),
    (FAKE, ("b, h, nq, _ = q.shape", "b, _, nq, _ = q.shape; h = k.shape[1]"), r"lse has shape \(1, 2, 40\)"),
    (FAKE, ("    b, h, nq, _ = q.shape\n    return q.new_empty(q.shape), q.new_empty((b, h, nq), dtype=torch.float32)",
            "    return torch.ops.course.triton_attention(q, k, v, causal, scale)"), r"calls the course's operator"),
    (BACKWARD, ("torch.empty_like(k), torch.empty_like(v)", "torch.empty_like(q), torch.empty_like(q)"),
     r"dk has shape \(1, 4, 40, 32\), expected k's \(1, 2, 72, 32\)"),
    (BACKWARD, ("return torch.empty_like(q)", "return q.new_empty(q.shape)"), r"dq has strides .*laid out like q"),
    (ADAPTER, (".transpose(1, 2), None", ", None"), r"module causal.*expected \(batch, seq, heads, head_dim\)"),
    (ADAPTER, ("causal = is_causal if is_causal is not None else module.is_causal", "causal = module.is_causal"),
     r"is_causal=False given: query positions 0–22 wrong"),
    (ADAPTER, ("sm_scale=scaling", "sm_scale=0.25"), r"scaling 0.3: query positions"),
    (ADAPTER, ("    if attention_mask is not None:\n        raise", "    if False:\n        raise"), "a padding mask"),
    (ADAPTER, ("    causal = is_causal", "    return hf.attention_function('triton')(module, query, key, value, "
                                         "attention_mask, dropout, scaling, is_causal)\n    causal = is_causal"),
     r"refuses the course's own `utils.ops.hf.attention_function`"),
]


@pytest.mark.parametrize("marker, edit, message", WRONG, ids=[f"{NUMBER[w[0]]}-{i}" for i, w in enumerate(WRONG)])
def test_a_wrong_answer_says_what_is_wrong(marker, edit, message):
    said = outcome(marker, replace=[edit])
    assert said.startswith("wrong: ")
    assert re.search(message, said, re.S), said
