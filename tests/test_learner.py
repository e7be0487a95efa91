import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import retrying
from utils.course.learner import CUDA_STUB, STUB, generate, learner_version, strip_solutions, was_edited

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def is_worklog(path):
    """A worklog notebook (issue 72) holds a lesson's measurements, not its exercises."""
    first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    return "Worklog (optional)" in "".join(first["source"])


LESSONS = [p for p in NOTEBOOKS if not is_worklog(p)]


def test_strip_solutions_keeps_indentation_and_counts_blocks():
    src = ("def f(x):\n    # BEGIN SOLUTION\n    y = x + 1\n    return y\n    # END SOLUTION\n\n"
           "# BEGIN SOLUTION\nz = 3\n# END SOLUTION\nprint(z)\n")
    out, count = strip_solutions(src)
    assert count == 2
    assert out == f"def f(x):\n    {STUB}\n\n{STUB}\nprint(z)\n"


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx = 1\n", "x = 1\n# END SOLUTION\n"])
def test_strip_solutions_rejects_unbalanced_markers(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        strip_solutions(src)


def _notebook(*sources):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def test_learner_version_clears_outputs_and_records_a_fingerprint():
    nb = _notebook("# BEGIN SOLUTION\nx = 1\n# END SOLUTION")
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1")]
    nb.cells[0].execution_count = 3
    learner, count = learner_version(nb)
    assert count == 1 and learner["cells"][0]["outputs"] == [] and learner["cells"][0]["execution_count"] is None
    assert learner["metadata"]["course"]["learner_fingerprint"]


def test_generate_never_overwrites_a_learners_edits(tmp_path):
    src = tmp_path / "01_demo.ipynb"
    src.write_text(json.dumps(_notebook("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION")))
    out = tmp_path / "learner"
    [first] = generate([src], out)
    assert first == out / "01_demo.ipynb" and not was_edited(first)
    assert generate([src], out) == [first]           # untouched: regenerated in place
    nb = json.loads(first.read_text())
    nb["cells"][0]["source"] = "def f():\n    return 1  # my answer"
    first.write_text(json.dumps(nb))
    [second] = generate([src], out)
    assert second == out / "01_demo.new.ipynb"
    assert "my answer" in first.read_text()          # the learner's work is intact
    with pytest.raises(ValueError, match="not a notebook"):
        generate([tmp_path / "missing.ipynb"], out)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_each_lesson_has_at_least_three_exercises(path):
    _, count = learner_version(json.loads(path.read_text()))
    assert count >= 3, f"{path.name} has {count} solution blocks"


# make test on a CPU runs three learner versions whole, one per kind of exercise (PyTorch, a Triton kernel in the
# interpreter, CUDA source); the GPU suite and `pytest --full` run every notebook's, each as on a CPU (CUDA hidden
# from its kernel): exercises are checked on a CPU, and a GPU would only add the notebook's GPU work again.
SAMPLED = {"02_softmax.ipynb", "05_triton_flash_attention.ipynb", "06_cuda_load_inline.ipynb"}


def cell_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.long   # a notebook run each
@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=() if p.name in SAMPLED else pytest.mark.full)
                                  for p in NOTEBOOKS])
def test_learner_version_runs_whole_and_its_checks_say_not_yet(path, monkeypatch):
    """Every cell of the learner version runs: each check says "not yet" (or is skipped, where it needs something
    this run lacks), and each cell that runs an answer (`%%after`) is skipped, so nothing crashes."""
    learner, count = learner_version(json.loads(path.read_text()))
    nb = nbformat.from_dict(learner)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = retrying(lambda: NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                                          resources={"metadata": {"path": str(path.parent)}}).execute())
    run()   # a kernel that dies while starting is started again
    errors = [(i, o.ename, o.evalue[:200]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: cells that crash in the learner version (index, error): {errors}"
    checks = [(i, cell_text(c)) for i, c in enumerate(nb.cells) if c.cell_type == "code" and "@check(" in c.source]
    wrong = [(i, text[-300:]) for i, text in checks if "not yet" not in text and "skipped" not in text]
    assert not wrong, f"{path.name}: checks that did not say 'not yet' (index, output): {wrong}"
    assert not count or any("not yet" in text for _, text in checks), f"{path.name}: no check said 'not yet'"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.source.startswith("%%after"):
            assert cell_text(cell).startswith("skipped: this cell runs your answer"), (path.name, i)


def stubbed_names(nb) -> set:
    """Names of the functions and variables whose definition holds a stub, in a learner version."""
    import ast

    names = set()
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or (STUB not in source and CUDA_STUB not in source):
            continue
        for node in ast.parse(source).body:
            segment = ast.get_source_segment(source, node)
            if STUB in segment or CUDA_STUB in segment:
                if isinstance(node, ast.FunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_gpu_cell_runs_an_unfinished_answer(path):
    """The learner versions run whole on a CPU, where `%%gpu` cells are skipped; on a GPU those cells run, so none
    may call a stubbed function (a cell that must is an `%%after` cell instead)."""
    import re

    learner, _ = learner_version(json.loads(path.read_text()))
    names = stubbed_names(learner)
    for i, cell in enumerate(learner["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith("%%gpu"):
            used = sorted(n for n in names if re.search(rf"\b{re.escape(n)}\b", source))
            assert not used, f"{path.name} cell {i}: a %%gpu cell runs the exercise answers {used}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_after_cells_name_checks_that_run_before_them(path):
    """`%%after N` waits for exercise N's check: that check must come earlier in the notebook and run on every
    machine (a check inside an `if` might never say right, and the cell would never run)."""
    cells = json.loads(path.read_text())["cells"]
    seen = set()
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        if source.startswith("%%after"):
            numbers = source.splitlines()[0].split()[1:]
            assert numbers and set(numbers) <= seen, f"{path.name} cell {i}: %%after {numbers}, checks run: {seen}"
        for line in source.splitlines():
            if line.startswith('@check("'):
                seen.add(line.split('"')[1].split()[0])


def test_code_cell_finds_one_cell_and_stubs_it(tmp_path):
    from utils.course.learner import code_cell

    path = tmp_path / "demo.ipynb"
    path.write_text(json.dumps(_notebook("# Exercise 1\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION", "y = 2",
                                         "# twice\n", "# twice\n")))
    assert "x = 1" in code_cell(path, "# Exercise 1")
    assert code_cell(path, "# Exercise 1", learner=True) == f"# Exercise 1\n{STUB}\n"
    assert code_cell(path, "# Exercise 1", replace=[("x = 1", "x = 2")]).count("x = 2") == 1
    with pytest.raises(ValueError, match="'y = 3' is not in the cell of '# Exercise 1'"):
        code_cell(path, "# Exercise 1", replace=[("y = 3", "y = 4")])
    with pytest.raises(ValueError, match="0 code cells"):
        code_cell(path, "# Exercise 9")
    with pytest.raises(ValueError, match="2 code cells"):
        code_cell(path, "# twice")


def test_strip_solutions_stubs_cuda_source_with_an_error_directive():
    src = ('KERNEL = r"""\n__device__ float f(float v) {\n  // BEGIN SOLUTION\n  return v + 1;\n  // END SOLUTION\n}\n"""\n'
           "def g():\n    # BEGIN SOLUTION\n    return 2\n    # END SOLUTION\n")
    out, count = strip_solutions(src)
    assert count == 2
    assert f"  {CUDA_STUB}\n" in out and f"    {STUB}\n" in out and "v + 1" not in out
    assert CUDA_STUB == '#error "exercise: replace this line with your code"'


@pytest.mark.parametrize("src", ["// BEGIN SOLUTION\nx = 1;\n# END SOLUTION\n", "# BEGIN SOLUTION\nx = 1\n// END SOLUTION\n",
                                 "  // BEGIN SOLUTION\nx = 1;\n"])
def test_strip_solutions_rejects_mismatched_cuda_markers(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        strip_solutions(src)


def test_cuda_stub_fails_compilation_with_the_stub_message(tmp_path):
    """The stubbed source does not compile, and the compiler's message carries STUB_MESSAGE."""
    import shutil
    import subprocess

    from utils.course.exercises import STUB_MESSAGE

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source, _ = strip_solutions("int f(int v) {\n  // BEGIN SOLUTION\n  return v + 1;\n  // END SOLUTION\n}\n")
    (tmp_path / "stub.cpp").write_text(source)
    proc = subprocess.run([compiler, "-c", str(tmp_path / "stub.cpp"), "-o", str(tmp_path / "stub.o")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and STUB_MESSAGE in proc.stderr
