"""Notebook 05's kernel exercises (and 05a's debugging lab): each check fails on the learner's stub ("not yet"),
fails on a plausible wrong answer, and passes on the solution."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.course.exercises import check
from utils.course.exercises import debug_lab, triton_forward
from utils.course.learner import code_cell, exec_cell

ROOT = Path(__file__).resolve().parents[1]
NB05 = ROOT / "notebooks" / "05_triton_flash_attention.ipynb"
NB05A = ROOT / "notebooks" / "05a_triton_debugging.ipynb"
PRELUDE = """
import torch
import triton
import triton.language as tl
from utils.triton_utils import mask_1d, mask_2d, offsets_1d, offsets_2d, print_if, test_pid_conds
"""
# Cells each exercise needs after its own: the kernel that calls the helper the learner writes.
# Step kernels call 5.1's online_update, so 5.2 and 5.3 also need its (solved) cell.
KERNEL_05 = {"5.2": ["# Exercise 5.1:", "def fa_step3("], "5.3": ["# Exercise 5.1:", "def fa_step4("]}


def namespace(path, marker, *, learner, replace=(), extra=()):
    """Run an exercise's cell (stubbed when `learner`, with `replace` applied) and `extra` cells in a fresh dict."""
    ns = {}
    exec_cell(PRELUDE, ns, "prelude")
    exec_cell(code_cell(path, marker, learner=learner, replace=replace), ns, marker)
    for other in extra:
        exec_cell(code_cell(path, other), ns, other)
    return ns


def run_check(test):
    return check("test", hint="hint")(test)


EXERCISES_05 = {
    # exercise: (kernel name, check, plausible wrong answers as line replacements)
    "5.1": ("fa_step1", triton_forward.check_online_softmax, [
        [("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")],                 # no rescale of acc
        [("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")],              # no rescale of l
        [("p = tl.math.exp2(qk * qk_scale - m_ij[:, None])", "p = tl.math.exp2(qk - m_ij[:, None])")],
    ]),
    "5.2": ("fa_step3", triton_forward.check_ragged, [
        [("qk = tl.where(in_range[None, :], tl.dot(q, tl.trans(k)), float(\"-inf\"))",
          "qk = tl.dot(q, tl.trans(k))")],                                                # unmasked tail
        [("in_range = mask_1d(cols, seqlen_k)", "in_range = mask_1d(cols, seqlen_k + 1)")],  # off by one
    ]),
    "5.3": ("fa_step4", triton_forward.check_causal, [
        [("(cols[None, :] <= offs_m[:, None] + causal_offset)",
          "(cols[None, :] < offs_m[:, None] + causal_offset)")],                         # off-by-one diagonal
        [("keep = in_range[None, :]\n", "keep = in_range[None, :] | True\n")],            # unmasked tail
        [("m_sub = tl.where(m_ij == float(\"-inf\"), 0.0, m_ij)", "m_sub = m_ij")],        # nan for unseen rows
    ]),
}


def _extra(number):
    return KERNEL_05.get(number, [])


@pytest.mark.parametrize("number", EXERCISES_05)
def test_05_stub_is_not_yet(number, capsys):
    name, check_fn, _ = EXERCISES_05[number]
    ns = namespace(NB05, f"# Exercise {number}:", learner=True, extra=_extra(number))
    assert run_check(lambda: check_fn(ns[name])) == "not yet"


@pytest.mark.parametrize("number,wrong", [(n, i) for n, (_, _, w) in EXERCISES_05.items() for i in range(len(w))])
def test_05_wrong_answer_fails(number, wrong, capsys):
    name, check_fn, wrongs = EXERCISES_05[number]
    ns = namespace(NB05, f"# Exercise {number}:", learner=False, replace=wrongs[wrong], extra=_extra(number))
    with pytest.raises(AssertionError, match="wrong|lse"):
        check_fn(ns[name])


@pytest.mark.parametrize("number", EXERCISES_05)
def test_05_solution_passes(number, capsys):
    name, check_fn, _ = EXERCISES_05[number]
    ns = namespace(NB05, f"# Exercise {number}:", learner=False, extra=_extra(number))
    assert run_check(lambda: check_fn(ns[name])) == "right"


def test_05_failure_names_rows_and_blocks():
    name, check_fn, wrongs = EXERCISES_05["5.3"]
    ns = namespace(NB05, "# Exercise 5.3:", learner=False, replace=wrongs[0], extra=_extra("5.3"))
    with pytest.raises(AssertionError, match=r"rows .* in block\(s\)"):
        check_fn(ns[name])


def test_reference_is_independent_of_the_course_kernels():
    """The checks' reference is float64 torch math, with GQA and the bottom-right causal mask built here."""
    import torch
    q, k, v = triton_forward._qkv(1, 4, 2, 5, 3, 8, False, seed=0)
    o, lse = triton_forward.reference(q, k, v, causal=True)
    assert torch.isinf(lse[..., :2]).all() and (o[..., :2, :] == 0).all()   # Nq > Nk: 2 rows see no key
    expected = torch.softmax(q[0, 0].double() @ k[0, 0].double().T / 8 ** 0.5, -1) @ v[0, 0].double()
    o_full, _ = triton_forward.reference(q, k, v)
    torch.testing.assert_close(o_full[0, 0], expected)


# Notebook 05a runs its kernels in the interpreter on every machine; here they need conftest's interpreter (CPU).
LAB = {
    # exercise: (kernel name, check, the planted bug as a line replacement); the diagnostics 5a.1, 5a.3, 5a.5 and
    # 5a.7 are tested in tests/test_debug_lab.py
    "5a.2": ("causal_softmax_fixed", debug_lab.check_causal_softmax,
             ("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")),
    "5a.4": ("scale_rows_fixed", debug_lab.check_scale_rows,
             ("rows = offsets_1d(BLOCK_M, pid_m)\n    cols = offsets_1d(BLOCK_N, pid_n)",
              "rows = offsets_1d(BLOCK_M, pid_n)\n    cols = offsets_1d(BLOCK_N, pid_m)")),
    "5a.6": ("softmax_dot_fixed", debug_lab.check_softmax_dot,
             ("acc = acc * alpha + tl.sum", "acc = acc + tl.sum")),
    "5a.8": ("gqa_attention_fixed", debug_lab.check_gqa_attention,
             ("kv_head = h // (n_heads // n_kv_heads)", "kv_head = h % n_kv_heads")),
}
needs_interpreter = pytest.mark.skipif(not __import__("utils.triton_utils").triton_utils.interpreting(),
                                       reason="the lab's kernels run in the Triton interpreter")


@needs_interpreter
@pytest.mark.parametrize("number", LAB)
def test_lab_stub_bug_and_fix(number, capsys):
    name, check_fn, bug = LAB[number]
    stub = namespace(NB05A, f"# Exercise {number}:", learner=True)
    assert run_check(lambda: check_fn(stub[name])) == "not yet"
    buggy = namespace(NB05A, f"# Exercise {number}:", learner=False, replace=[bug])
    with pytest.raises(AssertionError, match=r"rows .* in block\(s\)"):
        check_fn(buggy[name])
    fixed = namespace(NB05A, f"# Exercise {number}:", learner=False)
    assert run_check(lambda: check_fn(fixed[name])) == "right"


def test_lab_planted_bugs_are_the_ones_the_exercises_fix():
    """The kernel handed over in each lab is the exercise's solution with exactly the planted bug."""
    import json
    import re
    flat = lambda text: re.sub(r"\s+", " ", text)  # noqa: E731 (comments may be aligned differently)
    cells = [flat("".join(c["source"])) for c in json.loads(NB05A.read_text())["cells"] if c["cell_type"] == "code"]
    for number, (name, _, (good, bad)) in LAB.items():
        fixed = code_cell(NB05A, f"# Exercise {number}:")
        body = "\n".join(line for line in fixed.splitlines()[1:] if "SOLUTION" not in line)
        buggy = body.replace(good, bad).replace(name, name.replace("_fixed", "_buggy"))
        assert any(cell.startswith(flat(buggy)) for cell in cells), f"lab {number}: the buggy kernel is not the fix's twin"


def run_lab_gpu(**env) -> subprocess.CompletedProcess:
    """`python -m utils.course.exercises.debug_lab_gpu`, as 05a runs it: its own process, its output captured."""
    return subprocess.run([sys.executable, "-m", "utils.course.exercises.debug_lab_gpu"], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=600)


@pytest.mark.gpu
def test_lab_gpu_kernel_prints_from_one_program_and_its_assert_holds():
    done = run_lab_gpu(TRITON_INTERPRET="0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows of program (1, 0)" in done.stdout and "the assert held" in done.stdout


def test_lab_gpu_module_says_it_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run_lab_gpu()
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr


# Notebook 05b's exercises whose checks are notebook cells, each against its stub, plausible wrong answers and its
# solution. 5b.8 (2^x on the FMA units) counts a shortcut through torch.exp2, the special-function unit's answer
# the exercise is about avoiding, as wrong; 5b.5 (the ring's phases) must name the tile whose wait goes wrong, and
# 5b.7 (the producer's parity) the tile copied over data still read, or the hang.
NB05B = ROOT / "notebooks" / "05b_triton_fast.ipynb"
NB05BW = ROOT / "notebooks" / "05bw_triton_fast_worklog.ipynb"   # 5b.8 sits beside the measurement it is about
RING_ANSWER = "return tile % stages, (tile // stages) % 2"
PARITY_ANSWER = "return (tile // stages + 1) % 2"
EXERCISES_05B = {
    "5b.8": dict(notebook=NB05BW, cell="def exp2_poly(", right="5b.8 2^x on the FMA units", match=None, wrong={
        "not Horner": [("p = p * f + c", "p = p + c * f")],
        "floor, not nearest": [("j = torch.round(x)", "j = torch.floor(x)")],
        "no clamp": [("    x = x.clamp(min=-126.0)\n", "")],
        "torch.exp2": [("    x = x.clamp(min=-126.0)\n", "    return torch.exp2(x)\n")]}),
    "5b.5": dict(cell="def slot_and_phase(", right="5b.5 the ring's phases", match=r"[KV] tile \d+ with \d stages?",
                 wrong={"parity off by one": [(RING_ANSWER, "return tile % stages, (tile // stages + 1) % 2")],
                        "parity of the tile": [(RING_ANSWER, "return tile % stages, tile % 2")],
                        "next slot": [(RING_ANSWER, "return (tile + 1) % stages, (tile // stages) % 2")]}),
    "5b.7": dict(cell="def producer_parity(", right="5b.7 the producer's parity",
                 match=r"refills slot \d|hang with \d+ tiles", wrong={
                     "the consumers' parity": [(PARITY_ANSWER, "return (tile // stages) % 2")],
                     "always 1": [(PARITY_ANSWER, "return 1")],
                     "parity of the tile": [(PARITY_ANSWER, "return (tile + 1) % 2")]}),
}


def run_05b(number, learner=False, replace=()):
    from utils.explicit import forward as gluon_forward, forward_ws as gluon_ws
    from utils.tiled.fast import forward as fast_forward
    from utils.course.worklogs import triton_forward as worklog_fwd
    ns = {"torch": torch, "check": check, "fast_forward": fast_forward, "worklog_fwd": worklog_fwd,
          "gluon_forward": gluon_forward, "gluon_ws": gluon_ws}
    notebook = EXERCISES_05B[number].get("notebook", NB05B)
    exec_cell(code_cell(notebook, EXERCISES_05B[number]["cell"], learner=learner, replace=replace), ns, number)
    return exec_cell(code_cell(notebook, f'@check("{number}'), ns, f"{number} check")


@pytest.mark.parametrize("number", EXERCISES_05B)
def test_05b_stub_is_not_yet_and_the_solution_right(number, capsys):
    run_05b(number, learner=True)
    assert f"{EXERCISES_05B[number]['right']}: not yet" in capsys.readouterr().out
    run_05b(number)
    assert f"{EXERCISES_05B[number]['right']}: right" in capsys.readouterr().out


@pytest.mark.parametrize("number,wrong", [(n, w) for n, e in EXERCISES_05B.items() for w in e["wrong"]])
def test_05b_wrong_answers_fail(number, wrong, capsys):
    exercise = EXERCISES_05B[number]
    with pytest.raises(AssertionError, match=exercise["match"]):
        run_05b(number, replace=exercise["wrong"][wrong])


# Issue 73: kernel checks accepted any kernel with the step's signature. Each now confirms the kernel is the
# learner's own step kernel. (exercise, how the namespace is built, what is passed, the refusal's words)
ONLINE_SOFTMAX_CALL = ("acc, l_i, m_ij = fast_forward._online_softmax(qk, v, acc, l_i, m_i, qk_scale, False, "
                       "\"ieee\")\n    return acc, l_i")


def _first_solution_line(number):
    src = code_cell(NB05, f"# Exercise {number}:")
    return src.split("# BEGIN SOLUTION\n", 1)[1].splitlines()[0].strip()


def test_05_later_step_kernel_is_refused():
    """check_online_softmax(fa_step2) passed: fa_step2 is step 1 plus the lse."""
    ns = namespace(NB05, "# Exercise 5.1:", learner=False, extra=["def fa_step2("])
    with pytest.raises(AssertionError, match="for your kernel `fa_step1`, not `fa_step2`"):
        triton_forward.check_online_softmax(ns["fa_step2"])


def test_05_later_step_kernel_renamed_fails_by_what_it_writes():
    """fa_step2 under step 1's name still writes LSE, which step 1's kernel never stores."""
    ns = {}
    exec_cell(PRELUDE, ns, "prelude")
    exec_cell(code_cell(NB05, "# Exercise 5.1:"), ns, "5.1")       # fa_step2 calls its online_update
    exec_cell(code_cell(NB05, "def fa_step2(").replace("def fa_step2(", "def fa_step1("), ns, "fa_step2 renamed")
    with pytest.raises(AssertionError, match="wrote LSE, which step 1's fa_step1 never stores"):
        triton_forward.check_online_softmax(ns["fa_step1"])


def test_05_kernel_calling_the_course_online_softmax_is_refused():
    """fa_step1 whose loop calls utils.tiled.fast.forward's _online_softmax: the library does the step."""
    first = _first_solution_line("5.1")
    ns = {}
    exec_cell(PRELUDE + "from utils.tiled.fast import forward as fast_forward\n", ns, "prelude")
    src = code_cell(NB05, "# Exercise 5.1:").replace(first, ONLINE_SOFTMAX_CALL, 1)
    exec_cell(src, ns, "5.1 through the library")
    with pytest.raises(AssertionError, match=r"calls the course's own `utils.tiled.fast.forward._online_softmax`"):
        triton_forward.check_online_softmax(ns["fa_step1"])


@pytest.mark.parametrize("check_fn", [triton_forward.check_online_softmax, triton_forward.check_ragged,
                                      triton_forward.check_causal])
def test_05_course_kernel_is_refused(check_fn):
    from utils.tiled.fast import forward as fast_forward
    with pytest.raises(AssertionError, match="refuses the course's own kernel `utils.tiled.fast.forward.flash_fwd_kernel`"):
        check_fn(fast_forward.flash_fwd_kernel)


BLOCK_KINDS_PRELUDE = PRELUDE + """
import numpy as np
from utils.eager.reference import causal_mask
from utils.triton_utils import cdiv
"""
HELPER_BYPASSES = {
    # exercise: (cell of the learner's function, its name, the check, replacements, code before, refused name)
    "5.6-notebook": ("# Exercise 5.6:", "causal_key_range", triton_forward.check_causal_key_range,
                     [("offset = seqlen_k - seqlen_q",
                       "return kernel_key_ranges(start_m // block_m, seqlen_q, seqlen_k, block_m, 1)")],
                     ["def block_kinds("], "`kernel_key_ranges`"),
    "5.6-library": ("# Exercise 5.6:", "causal_key_range", triton_forward.check_causal_key_range,
                    [("offset = seqlen_k - seqlen_q",
                      "return (max(0, flash2_kv_end(start_m, 1, seqlen_q, seqlen_k, True)), "
                      "max(0, flash2_kv_end(start_m // block_m, block_m, seqlen_q, seqlen_k, True)))")],
                    ["from utils.eager.forward import flash2_kv_end"], "`utils.eager.forward.flash2_kv_end`"),
    "5.7": ("# Exercise 5.7:", "merge_halves", triton_forward.check_merge_halves,
            [("lse = torch.logaddexp(lse1, lse2)", "return merge_attention(o1, lse1, o2, lse2)[0]")],
            ["from utils.eager.softmax import merge_attention"], "`utils.eager.softmax.merge_attention`"),
}


def helper_namespace(marker, *, learner=False, replace=(), extra=()):
    ns = {}
    exec_cell(BLOCK_KINDS_PRELUDE, ns, "prelude")
    for other in extra:   # an earlier cell: the notebook's own helper, or an import
        exec_cell(code_cell(NB05, other) if other.startswith("def ") else other, ns, other)
    exec_cell(code_cell(NB05, marker, learner=learner, replace=replace), ns, marker)
    return ns


@pytest.mark.parametrize("bypass", HELPER_BYPASSES)
def test_05_helper_bypass_is_refused(bypass):
    marker, name, check_fn, replace, extra, refused = HELPER_BYPASSES[bypass]
    ns = helper_namespace(marker, replace=replace, extra=extra)
    with pytest.raises(AssertionError, match=rf"the check refuses the course's own {re.escape(refused)}"):
        check_fn(ns[name])


@pytest.mark.parametrize("number", ["5.6", "5.7"])
def test_05_helper_checks_solution_right_stub_not_yet(number, capsys):
    marker, name, check_fn, *_ = next(v for k, v in HELPER_BYPASSES.items() if k.startswith(number))
    assert run_check(lambda: check_fn(helper_namespace(marker)[name])) == "right"
    assert run_check(lambda: check_fn(helper_namespace(marker, learner=True)[name])) == "not yet"


def test_05_launch_counts_that_the_kernel_passed_is_what_ran():
    """A kernel object of the right name and module whose launch runs another kernel (here fa_step2) fails: the
    check counts the launches of the kernel it was given."""
    import copy
    ns = namespace(NB05, "# Exercise 5.1:", learner=False, extra=["def fa_step2("])
    step1, step2 = ns["fa_step1"], ns["fa_step2"]

    class Sneaky(type(step1)):
        def __getitem__(self, grid):
            return step2[grid]

    sneaky = copy.copy(step1)
    sneaky.__class__ = Sneaky
    with pytest.raises(AssertionError, match="one launch ran the kernel you passed 0 times"):
        triton_forward.check_online_softmax(sneaky)
    assert not step1.pre_run_hooks, "the launch must take its counting hook off the kernel again"


# Exercise 5.4, the capstone: the whole forward kernel from its signature. Each wrong kernel fails in the first case
# that adds what it gets wrong, and the message names that case and the wrong rows and Q blocks.
CAPSTONE_05 = "# Exercise 5.4:"
CAPSTONE_05_WRONG = {
    "no rescale": ([("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")], "case 1"),
    "diagonal off by one": ([("(cols[None, :] <= offs_m[:, None] + causal_offset)",
                              "(cols[None, :] < offs_m[:, None] + causal_offset)")], "case 4"),
    "wrong GQA head": ([("h_kv = h // GROUP", "h_kv = h % (n_heads // GROUP)")], "case 2"),
    "contiguous rows": ([("offs_m[:, None] * stride_qm", "offs_m[:, None] * HEAD_DIM")], "case 3"),
    "nan for rows that see no key": ([('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new")],
                                     "case 5"),
    "lse in base 2": ([("(m_i + tl.math.log2(l_safe)) * 0.6931471805599453", "(m_i + tl.math.log2(l_safe))")],
                      "case 1"),
}


def test_05_capstone_solution_right_stub_not_yet(capsys):
    solved = namespace(NB05, CAPSTONE_05, learner=False)
    assert run_check(lambda: triton_forward.check_flash_forward(solved["flash_forward"])) == "right"
    stub = namespace(NB05, CAPSTONE_05, learner=True)
    assert run_check(lambda: triton_forward.check_flash_forward(stub["flash_forward"])) == "not yet"


@pytest.mark.parametrize("wrong", CAPSTONE_05_WRONG)
def test_05_capstone_wrong_kernel_fails_naming_its_case_rows_and_blocks(wrong):
    replace, case = CAPSTONE_05_WRONG[wrong]
    ns = namespace(NB05, CAPSTONE_05, learner=False, replace=replace)
    with pytest.raises(AssertionError, match=rf"(?s){case} .*the first to add.*batch=\d, head=\d: rows .* in "
                                             rf"block\(s\)"):
        triton_forward.check_flash_forward(ns["flash_forward"])


@pytest.mark.parametrize("kernel", ["utils.tiled.forward.flash_fwd_kernel", "utils.tiled.fast.forward.flash_fwd_kernel"])
def test_05_capstone_refuses_course_kernels(kernel):
    import importlib
    module, name = kernel.rsplit(".", 1)
    with pytest.raises(AssertionError, match=f"refuses the course's own kernel `{re.escape(kernel)}`"):
        triton_forward.check_flash_forward(getattr(importlib.import_module(module), name))


def test_05_capstone_refuses_another_kernel_and_counts_its_launch():
    """fa_step4 is not the capstone; a flash_forward object whose launch runs another kernel fails its count."""
    import copy
    steps = namespace(NB05, "# Exercise 5.3:", learner=False, extra=["def fa_step4("])
    with pytest.raises(AssertionError, match="for your kernel `flash_forward`, not `fa_step4`"):
        triton_forward.check_flash_forward(steps["fa_step4"])
    mine = namespace(NB05, CAPSTONE_05, learner=False)["flash_forward"]
    other = namespace(NB05, CAPSTONE_05, learner=False)["flash_forward"]

    class Sneaky(type(mine)):
        def __getitem__(self, grid):
            return other[grid]

    sneaky = copy.copy(mine)
    sneaky.__class__ = Sneaky
    with pytest.raises(AssertionError, match="one launch ran the kernel you passed 0 times"):
        triton_forward.check_flash_forward(sneaky)


def test_05_capstone_comes_before_the_library_kernel_is_shown():
    import json
    sources = ["".join(c["source"]) for c in json.loads(NB05.read_text())["cells"]]
    capstone = next(i for i, s in enumerate(sources) if s.startswith(CAPSTONE_05))
    library = next(i for i, s in enumerate(sources) if "show_source(fwd.flash_fwd_kernel)" in s)
    assert capstone < library


@pytest.mark.skipif(not __import__("utils.triton_utils").triton_utils.interpreting(),
                    reason="an interpreted kernel's body is Python, so it could call a course function")
def test_05_capstone_refuses_a_kernel_body_that_calls_the_library():
    ns = {}
    exec_cell(PRELUDE + "from utils.tiled.forward import flash_attention_forward\n", ns, "prelude")
    first = "    pid_m = tl.program_id(0)\n"
    src = code_cell(NB05, CAPSTONE_05, replace=[(first, "    flash_attention_forward(Q, K, V)\n" + first)])
    exec_cell(src, ns, "capstone through the library")
    with pytest.raises(AssertionError, match="refuses the course's own `utils.tiled.forward.flash_attention_forward`"):
        triton_forward.check_flash_forward(ns["flash_forward"])
