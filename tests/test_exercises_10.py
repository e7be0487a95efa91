"""Notebook 10's exercises (a per-batch prefix-LM mask_mod in PyTorch and Triton, the tile-state builder, soft-capping
and its derivative in Triton): each check says "not yet" on the learner's stub, fails with a message that names
what is wrong on plausible wrong answers, and passes on the solution. The exercise cells run as a learner sees
them; Triton functions run in the interpreter on a CPU."""
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from utils.course.exercises import check
from utils.course.exercises import flex as checks
from utils.course.learner import code_cell, exec_cell

NB = Path(__file__).resolve().parents[1] / "notebooks" / "10_flex_attention.ipynb"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRELUDE = """
import torch
import triton
import triton.language as tl
from utils.flex import EMPTY, FULL, PARTIAL
"""


def namespace(marker, *, learner=False, replace=()):
    """The exercise cell run in a fresh namespace: stubbed (learner), or with `replace`'s (old, new) edits."""
    ns = {"triton": triton, "tl": tl}
    exec_cell(PRELUDE, ns, "prelude")
    exec_cell(code_cell(NB, marker, learner=learner, replace=replace), ns, marker)
    return ns


def outcome(test):
    try:
        return check("exercise", hint="test")(test)
    except AssertionError as err:
        return f"wrong: {err}"


TORCH = "# Exercise 10.1a:"
TRITON = "# Exercise 10.1b:"
STATES = "# Exercise 10.2:"
SOFTCAP = "# Exercise 10.3:"


def run_torch(ns):
    return outcome(lambda: checks.check_prefix_mask_torch(ns["make_prefix_mask"]))


def run_triton(ns):
    return outcome(lambda: checks.check_prefix_mask_triton(ns["prefix_mask"], device=DEVICE))


def run_states(ns):
    return outcome(lambda: checks.check_block_states(ns["block_states"]))


def run_softcap(ns):
    return outcome(lambda: checks.check_softcap(ns["softcap_score"], ns["softcap_grad"], device=DEVICE))


EXERCISES = {TORCH: run_torch, TRITON: run_triton, STATES: run_states, SOFTCAP: run_softcap}


@pytest.mark.parametrize("marker", EXERCISES, ids=lambda m: m.split()[2].rstrip(":"))
def test_stub_is_not_yet_and_solution_is_right(marker, capsys):
    assert EXERCISES[marker](namespace(marker, learner=True)) == "not yet"
    assert EXERCISES[marker](namespace(marker)) == "right"


@pytest.mark.parametrize("old, new, says", [
    ("(kv_idx <= q_idx) | (kv_idx < prefix_lens[b])", "(kv_idx <= q_idx)",                       # no prefix
     "masked but should be visible: (q=0, kv=1)"),
    ("(kv_idx < prefix_lens[b])", "(kv_idx <= prefix_lens[b])", "visible but should be masked"),  # off by one
    ("(kv_idx < prefix_lens[b])", "(q_idx < prefix_lens[b])", "visible but should be masked"),    # query's prefix
    ("(kv_idx < prefix_lens[b])", "(kv_idx < prefix_lens[0])", "batch 1, prefix 10"),             # batch 0's prefix
    ("(kv_idx <= q_idx) | (kv_idx < prefix_lens[b])", "(kv_idx <= q_idx) or (kv_idx < prefix_lens[b])",
     "combine the conditions with | and &"),                                                       # Python `or`
    ("(kv_idx <= q_idx) | (kv_idx < prefix_lens[b])", "(kv_idx <= q_idx) | (kv_idx < prefix_lens[b]).any()",
     "is wrong at"),
], ids=["no-prefix", "off-by-one", "query-prefix", "batch-0-prefix", "python-or", "reduced"])
def test_torch_mask_wrong_answers_name_pairs(old, new, says):
    result = run_torch(namespace(TORCH, replace=[(old, new)]))
    assert result.startswith("wrong: ") and says in result, result


@pytest.mark.parametrize("old, new, says", [
    ("return (kv_idx <= q_idx) | (kv_idx < prefix)", "return kv_idx <= q_idx", "masked but should be visible"),
    ("(kv_idx < prefix)", "(kv_idx <= prefix)", "visible but should be masked"),
    ("tl.load(args[0] + b)", "tl.load(args[0] + h)", "batch 1, prefix 10"),                       # wrong index
    ("tl.load(args[0] + b)", "tl.load(args[0])", "batch 1, prefix 10"),                           # one prefix
    ("(kv_idx <= q_idx)", "(kv_idx < q_idx)", "masked but should be visible: (q=3, kv=3)"),       # the diagonal
], ids=["no-prefix", "off-by-one", "head-index", "first-prefix", "diagonal"])
def test_triton_mask_wrong_answers_name_pairs(old, new, says):
    result = run_triton(namespace(TRITON, replace=[(old, new)]))
    assert result.startswith("wrong: ") and says in result, result


@pytest.mark.parametrize("edits, says", [
    ([("counted[:seqlen_q] = 1", "counted[:seqlen_q, :seqlen_k] = 1")],                 # ragged keys become FULL
     "got FULL, expected PARTIAL"),
    ([("counted[:seqlen_q] = 1", "counted[:, :] = 1")],                                  # padded rows count
     "rows 50–63 past the end: got PARTIAL, expected FULL"),
    ([("+ (seqlen_k - seqlen_q)", "")], "i + Nk − Nq"),                                  # top-left alignment
    ([("    return states\n", "    return states[:seqlen_q // block_m, :seqlen_k // block_n]\n")],
     "the last, ragged tiles count too"),                                                # ragged tiles dropped
    ([("states[n_visible == n_counted] = FULL", "states[n_visible == block_m * block_n] = FULL")],
     "got PARTIAL, expected FULL"),                                                      # ragged rows never FULL
    ([("states[n_visible == 0] = EMPTY\n", ""), ("states[n_visible == n_counted] = FULL", "")],
     "got PARTIAL, expected"),                                                           # everything partial
], ids=["ragged-keys-full", "padded-rows", "top-left", "floor", "ragged-rows", "all-partial"])
def test_block_states_wrong_answers_name_tiles(edits, says):
    result = run_states(namespace(STATES, replace=edits))
    assert result.startswith("wrong: ") and says in result, result


def test_block_states_refuses_the_library_and_out_of_range_positions():
    ns = namespace(STATES, replace=[("    rows, cols = triton.cdiv",
                                     "    from utils.flex import block_states as library\n"
                                     "    return library(mask_fn, seqlen_q, seqlen_k, block_m, block_n)\n"
                                     "    rows, cols = triton.cdiv")])
    result = run_states(ns)
    assert result.startswith("wrong: ") and "library's answer" in result, result
    import utils.flex
    assert utils.flex.block_states(lambda q, kv: kv <= q, 20, 20, 16, 16).shape == (2, 2)   # restored after
    padded = namespace(STATES, replace=[
        ("q_idx = torch.arange(seqlen_q)[:, None]", "q_idx = torch.arange(rows * block_m)[:, None]"),
        ("kv_idx = torch.arange(seqlen_k)[None, :]", "kv_idx = torch.arange(cols * block_n)[None, :]"),
        ("visible[:seqlen_q, :seqlen_k] = torch.as_tensor(mask_fn(q_idx, kv_idx)).float()",
         "visible[:] = torch.as_tensor(mask_fn(q_idx, kv_idx)).float()\n    visible[seqlen_q:] = 0\n"
         "    visible[:, seqlen_k:] = 0")])
    result = run_states(padded)
    assert result.startswith("wrong: ") and "was asked about" in result and "clamp" in result, result


@pytest.mark.parametrize("edits, says", [
    ([("e = tl.exp(-2.0 * tl.abs(score / args[2]))\n    t = (1.0 - e) / (1.0 + e)",
       "e = tl.exp(2.0 * score / args[2])\n    t = (e - 1.0) / (e + 1.0)")],                # overflows
     "score_grad is wrong at 6 of 64 scores (cap 1): score 45: got nan, expected 0"),
    ([("e = tl.exp(-2.0 * tl.abs(score / args[2]))", "e = tl.exp(-2.0 * tl.abs(score))")],  # no /cap in the grad
     "score_grad is wrong"),
    ([("return 1.0 - t * t", "return args[2] * (1.0 - t * t)")], "score_grad is wrong"),     # times the cap
    ([("return args[2] * tl.where(x < 0, -t, t)", "return tl.where(x < 0, -t, t)")],         # forgot the cap
     "score_mod is wrong"),
    ([("return args[2] * tl.where(x < 0, -t, t)", "return args[2] * t")],                   # lost the sign
     "score_mod is wrong at"),
], ids=["naive-tanh", "grad-no-cap", "grad-times-cap", "mod-no-cap", "no-sign"])
def test_softcap_wrong_answers_name_scores(edits, says):
    result = run_softcap(namespace(SOFTCAP, replace=edits))
    assert result.startswith("wrong: ") and says in result and "score " in result, result


def test_rules_are_independent_of_the_library():
    """The checks' expected answers, from the rules themselves, agree with utils.flex where both exist."""
    from utils.flex import block_states, prefix_lm, dense_mask

    expected = checks.prefix_rule([7, 7], 12, 20)
    assert torch.equal(expected[0], dense_mask(prefix_lm(7), 1, 1, 12, 20)[0, 0])
    assert expected[0, 0, 6] and not expected[0, 0, 9] and expected[0, 0, 8]   # prefix 7; row 0 at position 8
    for name, rule, nq, nk, bm, bn in checks._state_cases():
        mask = torch.as_tensor(rule(torch.arange(nq)[:, None] + nk - nq, torch.arange(nk)[None, :]))
        ours = checks.states_rule(mask.broadcast_to(nq, nk), bm, bn)
        lib = block_states(lambda q, kv: rule(q, kv), nq, nk, bm, bn)
        assert torch.equal(ours, lib.to(ours.dtype)), name
    assert checks.states_rule(torch.ones(20, 20, dtype=torch.bool), 16, 16).tolist() == [[2, 1], [2, 1]]
