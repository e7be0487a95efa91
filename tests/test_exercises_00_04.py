"""Exercises of notebooks 00-04: each check says "not yet" on the learner's stub, fails on a plausible wrong
answer (bypasses included: calling the answer, logaddexp, exp), and passes on the notebook's solution."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from einops import rearrange

from utils.course.exercises import check
from utils.course.exercises.naive_attention import check_causal_attention, check_split_merge_heads
from utils.course.exercises.online_softmax import check_lse_merge, check_probs_exp2, check_running_max_and_sum
from utils.course.exercises.refuse import RefusedAnswer, refusing
from utils.course.exercises.pytorch_flash import (check_block_sizes, check_fa1_accesses, check_fa2_accesses,
                                           check_flash2_block, check_keys_to_visit)
from utils.course.exercises.triton_basics import check_condition_string
from utils.eager.forward import LOG2E, flash2_kv_end
from utils.course.learner import code_cell
from utils.eager.reference import naive_attention
from utils.triton_utils import cdiv

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# (notebook, cell marker, the check applied to the cell's namespace)
EXERCISES = {
    "0.1": ("00_setup", "# Exercise 0.1", lambda ns: check_condition_string(ns["first_row_from_col_2"]())),
    "1.1": ("01_naive_attention", "# Exercise 1.1",
            lambda ns: check_split_merge_heads(ns["split_heads"], ns["merge_heads"])),
    "2.1": ("02_softmax", "# Exercise 2.1", lambda ns: check_running_max_and_sum(ns["running_max_and_sum"])),
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


def run(exercise, *, learner=False, replace=None, before="", after=""):
    """Run an exercise's cell and its check; `before` is code run first in the same namespace (an earlier
    cell's imports: `from utils.x import f` binds f before the check starts), `after` code run after it."""
    notebook, marker, apply_check = EXERCISES[exercise]
    src = code_cell(NOTEBOOKS / f"{notebook}.ipynb", marker, learner=learner)
    for old, new in ([replace] if replace and isinstance(replace[0], str) else replace or []):
        assert old in src, f"{old!r} is not in exercise {exercise}"
        src = src.replace(old, new)
    ns = {"math": math, "torch": torch, "F": F, "cdiv": cdiv, "LOG2E": LOG2E, "flash2_kv_end": flash2_kv_end,
          "naive_attention": naive_attention, "check": check, "check_lse_merge": check_lse_merge,   # what earlier
          "check_probs_exp2": check_probs_exp2, "check_causal_attention": check_causal_attention,   # cells import
          "rearrange": rearrange}
    exec(before, ns)
    exec(src, ns)   # a cell that holds its own check runs it here too
    exec(after, ns)
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


# Issue 73's bypasses: each answered its exercise with a course function and passed the check. Now the check
# refuses the function while the learner's code runs. (exercise, replacements, code run before the cell, the
# refused function's name). Imports sit in `before` (bound in the namespace before the check) or in the body.
PADDED_CALL = """
    q = torch.zeros(seqlen_q, d, dtype=q_blk.dtype)
    q[start_m:start_m + rows] = q_blk
    o, lse = flash2_attention(q[None, None], k[None, None], v[None, None], causal=True, sm_scale=sm_scale,
                              block_m=16, block_n=BLOCK_N, return_lse=True)
    return o[0, 0, start_m:start_m + rows], lse[0, 0, start_m:start_m + rows]
"""
BYPASSES = {
    "1.1-split": ("1.1", [('return rearrange(x, "b n (h d) -> b h n d", h=num_heads)',
                           "return MultiHeadAttention(x.shape[-1], num_heads).split_heads(torch.cat([x, x, x], -1))[0]")],
                  "from utils.eager.mha import MultiHeadAttention", "MultiHeadAttention.split_heads"),
    "1.1-merge": ("1.1", [('return rearrange(x, "b h n d -> b n (h d)")', "return MultiHeadAttention.merge_heads(x)")],
                  "from utils.eager.mha import MultiHeadAttention", "MultiHeadAttention.merge_heads"),
    "1.2": ("1.2", [("nq, nk = q.shape[-2], k.shape[-2]",
                     "return naive_attention(q[None], k[None], v[None], causal=True)[0]")],
            "from utils.eager.reference import naive_attention", "utils.eager.reference.naive_attention"),
    "1.2-module": ("1.2", [("nq, nk = q.shape[-2], k.shape[-2]",
                            "import utils.eager.softmax as S; return S.attention_with_lse(q[None], k[None], v[None], "
                            "causal=True)[0][0]")], "", "utils.eager.softmax.attention_with_lse"),
    "2.1": ("2.1", [("m, l = -math.inf, 0.0", "m, l = softmax_state(x); return m.item(), l.item()")],
            "from utils.eager.softmax import softmax_state", "utils.eager.softmax.softmax_state"),
    "2.2": ("2.2", [("m = torch.maximum(a, b)", "return logsumexp(torch.stack([a, b]), 0)")],
            "from utils.eager.softmax import logsumexp", "utils.eager.softmax.logsumexp"),
    "3.1": ("3.1", [("B_c = math.ceil(M / (4 * d))", "return flash1_block_sizes(M, d)")],
            "from utils.eager.forward import flash1_block_sizes", "utils.eager.forward.flash1_block_sizes"),
    "3.3": ("3.3", [("B_c = math.ceil(M / (4 * d))", "return flash1_hbm_accesses(N, N, d, M)")],
            "from utils.eager.forward import flash1_hbm_accesses", "utils.eager.forward.flash1_hbm_accesses"),
    "3.3-measured": ("3.3", [("B_c = math.ceil(M / (4 * d))",
                              "c = HBMCounter(); flash1_attention(*random_qkv(1, 1, N, N, d), sram_bytes=4 * M, "
                              "counter=c); return c.accesses")],
                     "from utils.eager.forward import HBMCounter, flash1_attention\n"
                     "from utils.course.testing import random_qkv", "utils.eager.forward.flash1_attention"),
    "4.1": ("4.1", [("last_row = min((pid_m + 1) * BLOCK_M, seqlen_q) - 1",
                     "return max(0, flash2_kv_end(pid_m, BLOCK_M, seqlen_q, seqlen_k, True))")],
            "from utils.eager.forward import flash2_kv_end", "utils.eager.forward.flash2_kv_end"),
    "4.3": ("4.3", [("keys = 0", "return flash2_hbm_accesses(seqlen_q, seqlen_k, d, BLOCK_M, BLOCK_N, causal=causal)")],
            "from utils.eager.forward import flash2_hbm_accesses", "utils.eager.forward.flash2_hbm_accesses"),
    "4.4": ("4.4", [("    n_end = min(seqlen_k, start_m + rows + seqlen_k - seqlen_q)", PADDED_CALL)],
            "from utils.eager.forward import flash2_attention", "utils.eager.forward.flash2_attention"),
}


@pytest.mark.parametrize("bypass", BYPASSES)
def test_bypass_through_a_course_function_fails(bypass, capsys):
    exercise, replace, before, refused = BYPASSES[bypass]
    with pytest.raises(RefusedAnswer, match=rf"the check refuses the course's own `[\w.]*{refused}`.*your own code"):
        run(exercise, replace=replace, before=before)
    assert re.search(rf"✗ {exercise}[^\n]*: the check refuses the course's own", capsys.readouterr().out)


def test_refused_functions_work_again_after_the_check():
    from utils.eager.forward import flash1_block_sizes
    with pytest.raises(AssertionError):
        run("3.1", replace=BYPASSES["3.1"][1], before=BYPASSES["3.1"][2])
    assert flash1_block_sizes(4096, 64) == (16, 16)


def test_refusing_catches_a_swallowed_refusal_and_every_import_path():
    import utils.eager.softmax
    from utils.eager.mha import MultiHeadAttention
    from utils.eager.softmax import logsumexp as imported_before

    def swallowing(x):
        try:
            return imported_before(x)
        except Exception:
            return torch.tensor(0.0)

    with pytest.raises(RefusedAnswer, match="utils.eager.softmax.logsumexp"):
        with refusing(utils.eager.softmax.logsumexp):
            swallowing(torch.zeros(3))
    with pytest.raises(RefusedAnswer, match="split_heads"):
        with refusing(MultiHeadAttention.split_heads):
            MultiHeadAttention(8, 2).split_heads(torch.zeros(1, 3, 24))
    with pytest.raises(ZeroDivisionError):      # an error of the check's own passes through, and restores
        with refusing(imported_before):
            1 / 0
    assert imported_before(torch.zeros(2)).item() == pytest.approx(math.log(2))


def test_capstone_padded_over_the_whole_sequence_fails_by_its_work():
    """Issue 73's 4.4 bypass padded the Q block to the whole sequence and computed every block (by a call to
    flash2_attention): right rows, every block skipping its hidden keys. Done with the learner's own block code
    (nothing refused), it still fails: the block's matrix products cost more than its own rows need."""
    padded = """
def flash2_block(q_blk, k, v, start_m, seqlen_q, sm_scale, BLOCK_N):
    rows, d = q_blk.shape
    q = torch.zeros(seqlen_q, d, dtype=q_blk.dtype)
    q[start_m:start_m + rows] = q_blk
    parts = [one_block(q[s:s + 16], k, v, s, seqlen_q, sm_scale, BLOCK_N) for s in range(0, seqlen_q, 16)]
    o, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return o[start_m:start_m + rows], lse[start_m:start_m + rows]
"""
    with pytest.raises(AssertionError, match=r"rows 0–15 .* multiply-adds, more than .* compute only this block's"):
        run("4.4", replace=[("def flash2_block(", "def one_block(")], after=padded)


# The exercises whose check was written inline in the notebook: their check cell must call the check that refuses
# the course's answers. (notebook, exercise, the call its check cell must make)
CHECK_CALLS = [("01_naive_attention", "1.1", "check_split_merge_heads(split_heads, merge_heads)"),
               ("02_softmax", "2.1", "check_running_max_and_sum(running_max_and_sum)"),
               ("05_triton_flash_attention", "5.6", "check_causal_key_range(causal_key_range)"),
               ("05_triton_flash_attention", "5.7", "check_merge_halves(merge_halves)")]


@pytest.mark.parametrize("notebook, exercise, call", CHECK_CALLS)
def test_check_cell_calls_the_refusing_check(notebook, exercise, call):
    cells = ["".join(c["source"]) for c in json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    check_cell = next(src for src in cells if f'@check("{exercise} ' in src)
    assert call in check_cell, f"{notebook}: the check cell of {exercise} should call {call}"


def test_capstone_masking_that_hides_its_nan_fails_by_its_work():
    """A block that loops over every key block and masks, cleaning the NaN of hidden keys out of V, escapes the NaN
    test; it still visits the blocks past the diagonal, which the work bound counts."""
    with pytest.raises(AssertionError, match=r"multiply-adds, more than .* only up to its last key block"):
        run("4.4", replace=[("range(0, n_end, BLOCK_N)", "range(0, seqlen_k, BLOCK_N)"),
                            ("p @ v_j", "p @ v_j.nan_to_num()")])
