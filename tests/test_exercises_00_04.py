"""Exercises of notebooks 00-04: each check says "not yet" on the learner's stub, fails on a plausible wrong
answer (bypasses included: calling the answer, logaddexp, exp), and passes on the notebook's solution."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from utils.exercises import check
from utils.exercises.naive_attention import check_causal_attention
from utils.exercises.online_softmax import check_lse_merge, check_probs_exp2
from utils.exercises.pytorch_flash import (check_block_sizes, check_fa1_accesses, check_fa2_accesses,
                                           check_flash2_block, check_keys_to_visit)
from utils.exercises.triton_basics import check_condition_string
from utils.flash_pytorch import LOG2E, flash2_kv_end
from utils.learner import code_cell
from utils.reference import naive_attention
from utils.triton_utils import cdiv

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# (notebook, cell marker, the check applied to the cell's namespace)
EXERCISES = {
    "0.1": ("00_setup", "# Exercise 0.1", lambda ns: check_condition_string(ns["first_row_from_col_2"]())),
    "1.2": ("01_naive_attention", "# Exercise 1.2", lambda ns: check_causal_attention(ns["causal_attention"])),
    "2.2": ("02_softmax", "# Exercise 2.2", lambda ns: check_lse_merge(ns["lse_merge"])),
    "2.3": ("02_softmax", "# Exercise 2.3", lambda ns: check_probs_exp2(ns["probs_exp2"])),
    "3.1": ("03_flash_attention_1", "# Exercise 3.1", lambda ns: check_block_sizes(ns["block_sizes"])),
    "3.3": ("03_flash_attention_1", "# Exercise 3.3", lambda ns: check_fa1_accesses(ns["fa1_accesses"])),
    "4.1": ("04_flash_attention_2", "# Exercise 4.1", lambda ns: check_keys_to_visit(ns["keys_to_visit"])),
    "4.3": ("04_flash_attention_2", "# Exercise 4.3", lambda ns: check_fa2_accesses(ns["fa2_accesses"])),
    "4.4": ("04_flash_attention_2", "# Exercise 4.4", lambda ns: check_flash2_block(ns["flash2_block"])),
}

# plausible wrong answers: (exercise, line of the solution, its replacement)
WRONG = [
    ("0.1", 'return "=0,>=2"', 'return "=0,>=2,=0"'),                       # pins pid_2
    ("0.1", 'return "=0,>=2"', 'return "=0,>2"'),
    ("1.2", "j > i + nk - nq", "j > i"),                                          # top-left alignment
    ("1.2", ".nan_to_num(0.0) @ v", " @ v"),                                      # NaN rows when Nq > Nk
    ("1.2", "nq, nk = q.shape[-2], k.shape[-2]", "return naive_attention(q, k, v, causal=True)"),   # the answer
    ("1.2", "nq, nk = q.shape[-2], k.shape[-2]",
     "return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2]).tril("
     "k.shape[-2] - q.shape[-2]).bool())"),                                       # a fused kernel does the work
    ("2.2", "return shift + torch.log(", "return a.logaddexp(b)  # "),        # the answer, called
    ("2.2", "return shift + torch.log(", "return torch.log(torch.exp(a) + torch.exp(b))  # "),   # overflows
    ("2.3", "return torch.exp2(s * c - m * c)", "return (sm_scale * (s - m)).exp()"),         # exp, not exp2
    ("2.3", "return torch.exp2(s * c - m * c)", "return torch.exp2(sm_scale * (s - m))"),     # log2(e) missing
    ("3.1", "B_c = math.ceil(M / (4 * d))", "B_c = round(M / (4 * d))"),
    ("3.3", "N * (d + 2) + T_c", "N * d + T_c"),                               # forgets l and m at init
    ("4.1", "last_row + 1 + seqlen_k", "last_row + seqlen_k"),                   # off by one
    ("4.3", "keys += min(seqlen_k, cdiv(n_end, BLOCK_N) * BLOCK_N)", "keys += n_end"),   # masked loads counted
    ("4.4", "acc = alpha[:, None] * acc + p @ v_j", "acc = acc + p @ v_j"),   # missing rescale
    ("4.4", "cols[None, :] > offs_m[:, None]", "cols[None, :] >= offs_m[:, None]"),   # off-by-one causal
    ("4.4", "range(0, n_end, BLOCK_N)", "range(0, seqlen_k, BLOCK_N)"),       # masks instead of skipping
    ("4.4", "m_sub = torch.where(m_new == -math.inf, 0.0, m_new)", "m_sub = m_new"),   # NaN for rows with no key
]


def run(exercise, *, learner=False, replace=None):
    notebook, marker, apply_check = EXERCISES[exercise]
    src = code_cell(NOTEBOOKS / f"{notebook}.ipynb", marker, learner=learner)
    if replace:
        old, new = replace
        assert old in src, f"{old!r} is not in exercise {exercise}"
        src = src.replace(old, new)
    ns = {"math": math, "torch": torch, "F": F, "cdiv": cdiv, "LOG2E": LOG2E, "flash2_kv_end": flash2_kv_end,
          "naive_attention": naive_attention, "check": check, "check_lse_merge": check_lse_merge,   # what earlier
          "check_probs_exp2": check_probs_exp2, "check_causal_attention": check_causal_attention}   # cells import
    exec(src, ns)   # a cell that holds its own check runs it here too
    return check(exercise, hint="(test)")(lambda: apply_check(ns))


@pytest.mark.parametrize("exercise", EXERCISES)
def test_solution_passes(exercise):
    assert run(exercise) == "right"


@pytest.mark.parametrize("exercise", EXERCISES)
def test_stub_says_not_yet(exercise):
    assert run(exercise, learner=True) == "not yet"


@pytest.mark.parametrize("exercise, old, new", WRONG, ids=[f"{e}-{i}" for i, (e, *_) in enumerate(WRONG)])
def test_wrong_answer_fails(exercise, old, new):
    with pytest.raises(AssertionError):
        run(exercise, replace=(old, new))


def test_capstone_failure_names_rows_and_blocks():
    with pytest.raises(AssertionError, match=r"rows .* in block\(s\)"):
        run("4.4", replace=("acc = alpha[:, None] * acc + p @ v_j", "acc = acc + p @ v_j"))
    with pytest.raises(AssertionError, match="skip, don't mask"):
        run("4.4", replace=("range(0, n_end, BLOCK_N)", "range(0, seqlen_k, BLOCK_N)"))


# The library functions that answer an exercise must not be importable in the notebook before it.
ANSWERS = [("03_flash_attention_1", "# Exercise 3.1", "flash1_block_sizes"),
           ("03_flash_attention_1", "# Exercise 3.3", "flash1_hbm_accesses"),
           ("04_flash_attention_2", "# Exercise 4.1", "flash2_kv_end"),
           ("04_flash_attention_2", "# Exercise 4.3", "flash2_hbm_accesses")]


@pytest.mark.parametrize("notebook, marker, answer", ANSWERS)
def test_notebook_does_not_import_the_answer_before_the_exercise(notebook, marker, answer):
    cells = [("".join(c["source"])) for c in json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    before = next(i for i, src in enumerate(cells) if marker in src)
    assert not any(answer in src for src in cells[:before]), f"{notebook} uses {answer} before {marker}"
    assert any(answer in src for src in cells[before:]), f"{notebook} should still use {answer} after {marker}"
