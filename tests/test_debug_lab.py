"""Notebook 05a, the debugging lab: the checks of the learner's diagnostics (a print_if, test_pid_conds or
breakpoint_if call in a copy of a buggy kernel) fail on a stub ("not yet"), fail on a call that looks in the wrong
program, at the wrong value or in the wrong place, and pass on the solution; the tiered hints; the learner version
of the whole notebook runs, every check saying "not yet". The fixes are tested in tests/test_exercises_05.py."""
import ast
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from utils.course.exercises import check, debug_lab
from utils.course.learner import code_cell, exec_cell, strip_solutions
from utils.triton_utils import breakpoint_if, interpreting, print_if, test_pid_conds

ROOT = Path(__file__).resolve().parents[1]
NB05A = ROOT / "notebooks" / "05a_triton_debugging.ipynb"
PRELUDE = """
import torch
import triton
import triton.language as tl
from utils.triton_utils import (breakpoint_if, mask_1d, mask_2d, offsets_1d, offsets_2d, print_if,
                                test_pid_conds)
"""
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the lab's kernels run in the Triton interpreter")

DIAGNOSTICS = {
    # exercise: (kernel name, check, wrong diagnostics as line replacements, what the failure must say)
    "5a.1": ("causal_softmax_debug", debug_lab.check_mask_diagnostic, [
        ([('"=0", pid', '"=1", pid')], r"program\(s\) \[1\]"),                       # the wrong program
        ([('"=0", pid', '"", pid')], r"program\(s\) \[0, 1\]"),                       # every program
        ([("print_if(keep.to(tl.int8)", "print_if(rows")], "other than the mask"),    # the wrong value
        ([("print_if(keep.to(tl.int8)", "print_if(f'{keep}'")], "other than the mask"),  # text, not the tensor
    ]),
    "5a.3": ("scale_rows_debug", debug_lab.check_tile_diagnostic, [
        ([('"=1,=0", pid_m, pid_n', '"=0,=1", pid_m, pid_n')], r"\[\(0, 1\)\]"),        # the transposed program
        ([('"=1,=0", pid_m, pid_n', '"=1,=0", pid_n, pid_m')], r"\[\(0, 1\)\]"),        # pids swapped
        ([('"=1,=0", pid_m, pid_n', '"=1", pid_m')], r"\[\(1, 0\), \(1, 1\)"),           # no condition on axis 1
        ([('"=1,=0", pid_m, pid_n', '"=5,=0", pid_m, pid_n')], "in no program"),
    ]),
    "5a.5": ("softmax_dot_debug", debug_lab.check_rescale_diagnostic, [
        ([('"=0", pid', '">=0", pid')], r"program\(s\) \[0, 1\]"),
        ([("print_if(alpha,", "print_if(m_new,")], "other than `alpha`"),
        ([('        print_if(alpha, "=0", pid)\n', ""),                                  # after the loop: once
          ("        m = m_new", '        m = m_new\n    print_if(alpha, "=0", pid)')], "printed 1 time"),
    ]),
    "5a.7": ("gqa_attention_debug", debug_lab.check_head_diagnostic, [
        ([('",=1", pid_m, h', '",=0", pid_m, h')], r"head\(s\) \[0\]"),                 # a right head
        ([('",=1", pid_m, h', '"", pid_m, h')], r"head\(s\) \[0, 1, 2, 3\]"),          # every head
        ([('",=1", pid_m, h', '"=1", pid_m')], "in no program"),                         # the wrong axis
        ([("    kv_head = h % n_kv_heads\n", ""),                                       # before kv_head exists
          ("    # END SOLUTION", "    # END SOLUTION\n    kv_head = h % n_kv_heads")], "before `kv_head`"),
    ]),
}


@pytest.fixture(autouse=True)
def breakpoints_off(monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")   # as in the notebook: a test never waits at pdb


def namespace(number, *, learner=False, replace=()):
    ns = exec_cell(PRELUDE, {}, "prelude")
    return exec_cell(code_cell(NB05A, f"# Exercise {number}:", learner=learner, replace=replace), ns, number)


def run_check(test):
    return check("test", hint="hint")(test)


@needs_interpreter
@pytest.mark.parametrize("number", DIAGNOSTICS)
def test_diagnostic_stub_is_not_yet_and_the_solution_right(number, capsys):
    name, check_fn, _ = DIAGNOSTICS[number]
    assert run_check(lambda: check_fn(namespace(number, learner=True)[name])) == "not yet"
    assert run_check(lambda: check_fn(namespace(number)[name])) == "right"


@needs_interpreter
@pytest.mark.parametrize("number,wrong", [(n, i) for n, (_, _, w) in DIAGNOSTICS.items() for i in range(len(w))])
def test_wrong_diagnostic_fails_and_says_why(number, wrong, capsys):
    name, check_fn, wrongs = DIAGNOSTICS[number]
    replace, message = wrongs[wrong]
    ns = namespace(number, replace=replace)
    with pytest.raises(AssertionError, match=message):
        check_fn(ns[name])
    # the spies are gone again: the kernel's globals hold the real helpers
    assert (ns["print_if"], ns["test_pid_conds"], ns["breakpoint_if"]) == (print_if, test_pid_conds, breakpoint_if)


@needs_interpreter
def test_a_diagnostic_without_the_helper_fails():
    ns = namespace("5a.1", replace=[('print_if(keep.to(tl.int8), "=0", pid)', "print(keep)")])
    with pytest.raises(AssertionError, match="never called print_if"):
        debug_lab.check_mask_diagnostic(ns["causal_softmax_debug"])


@needs_interpreter
def test_head_diagnostic_prints_what_pdb_would_show(capsys):
    debug_lab.check_head_diagnostic(namespace("5a.7")["gqa_attention_debug"])
    out = capsys.readouterr().out
    assert "program (0, 1)" in out and "h = 1, kv_head = 1" in out


@needs_interpreter
def test_with_breakpoints_on_the_spy_stops_in_the_kernels_frame(monkeypatch, capsys):
    """The spy keeps breakpoint_if's behaviour: pdb opens in the kernel's frame, in the selected program only."""
    monkeypatch.delenv("PYTHONBREAKPOINT")
    frames = []
    monkeypatch.setattr(debug_lab.pdb.Pdb, "set_trace", lambda self, frame=None: frames.append(frame))
    debug_lab.check_head_diagnostic(namespace("5a.7")["gqa_attention_debug"])
    assert len(frames) == 1 and frames[0].f_code.co_name == "gqa_attention_debug"
    assert int(frames[0].f_locals["h"].handle.data.reshape(-1)[0]) == 1


def test_watch_helpers_wants_a_kernel():
    with pytest.raises(TypeError, match="@triton.jit kernel"):
        debug_lab.watch_helpers(lambda: None, lambda: None)


# --- Hints ---------------------------------------------------------------------------------------------------

def notebook_hints() -> dict:
    """exercise number -> the two hints of its check, read from the notebook's check cells."""
    found = {}
    for cell in json.loads(NB05A.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or "@check(" not in source:
            continue
        call = ast.parse(source).body[0].decorator_list[0]
        title = ast.literal_eval(call.args[0])
        found[title.split()[0]] = ast.literal_eval(call.keywords[0].value)
    return found


def solution_lines() -> list[str]:
    lines = []
    for cell in json.loads(NB05A.read_text())["cells"]:
        inside = False
        for line in "".join(cell["source"]).splitlines():
            if "END SOLUTION" in line:
                inside = False
            if inside:
                lines.append(line.strip())
            if "BEGIN SOLUTION" in line:
                inside = True
    return lines


def test_exercises_are_numbered_in_order_each_with_two_hints():
    hints = notebook_hints()
    assert list(hints) == [f"5a.{i}" for i in range(1, 9)]
    markers = [m for c in json.loads(NB05A.read_text())["cells"] if c["cell_type"] == "code"
               for m in re.findall(r"^# Exercise (5a\.\d+):", "".join(c["source"]), re.M)]
    assert markers == list(hints)
    assert all(len(pair) == 2 and all(pair) for pair in hints.values())


def test_hints_contain_no_code():
    solutions = solution_lines()
    assert solutions
    for number, pair in notebook_hints().items():
        for text in pair:
            assert not re.search(r"\w\(|\"=|\[:", text), f"{number}'s hint reads like code: {text}"
            assert not any(line in text for line in solutions), f"{number}'s hint holds its solution: {text}"


def test_hint_levels(capsys):
    run = debug_lab.check("5a.99 a test exercise", hints=("what is wrong", "the formula"))
    run(lambda: (_ for _ in ()).throw(NotImplementedError()))
    assert "what is wrong (more: hint(2))" in capsys.readouterr().out
    debug_lab.hint(2)
    assert capsys.readouterr().out == "Hint 2 for 5a.99: the formula\n"
    debug_lab.hint(1, "5a.99")
    assert "what is wrong" in capsys.readouterr().out
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        debug_lab.hint(3)
    with pytest.raises(ValueError, match="no exercise '5a.0'"):
        debug_lab.hint(2, "5a.0")
    with pytest.raises(TypeError, match="two non-empty strings"):
        debug_lab.check("5a.98 x", hints=("only one",))
    debug_lab.HINTS.pop("5a.99")


# --- The notebook as a learner gets it ------------------------------------------------------------------------

@needs_interpreter
def test_learner_version_runs_and_every_check_says_not_yet():
    out = io.StringIO()
    ns = {}
    with contextlib.redirect_stdout(out):
        for i, cell in enumerate(json.loads(NB05A.read_text())["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and not source.startswith("%%gpu"):
                exec_cell(strip_solutions(source)[0], ns, f"cell {i}")
    text = out.getvalue()
    assert text.count(": not yet.") == 8 and "✓" not in text and "✗" not in text, text


def test_importing_the_gpu_module_leaves_the_mode_alone():
    """05a's %%gpu cell imports the GPU kernel to show it by name: the import must not turn the interpreter off
    in the notebook (only running the module as a program compiles for the GPU)."""
    import os
    import subprocess
    import sys
    code = ("import os; from utils.course.exercises.debug_lab_gpu import scale_rows_gpu; "
            "from utils.triton_utils import show_source; show_source(scale_rows_gpu); "
            "print(os.environ['TRITON_INTERPRET'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tl.device_print" in done.stdout and done.stdout.split()[-1] == "1"


@needs_interpreter
def test_gqa_fix_that_divides_by_the_kv_head_count_fails_naming_the_heads():
    """h // n_kv_heads is right for 4 heads over 2 (group 2 = 2 K/V heads) but not for 6 over 3: the check's
    shapes tell the two apart."""
    ns = exec_cell(PRELUDE, {}, "prelude")
    exec_cell(code_cell(NB05A, "# Exercise 5a.8:", replace=[("h // (n_heads // n_kv_heads)", "h // n_kv_heads")]),
              ns, "5a.8")
    with pytest.raises(AssertionError, match=r"6 heads, 3 K/V heads.*\n.*head=2"):
        debug_lab.check_gqa_attention(ns["gqa_attention_fixed"])
