"""Every notebook's code, `%%gpu` cells included, checked by pyflakes on any machine.

CPU CI skips `%%gpu` cells, so an undefined name in one (a missing import, a typo, a variable renamed in an
earlier cell) would surface only on a learner's GPU. Here each notebook's code cells are joined, in order, into
one module with the IPython magics taken out, and pyflakes reports what a GPU run would trip over. A second
check finds the names a `%%gpu` cell rebinds that a later plain cell reads: on a CPU that cell sees the earlier
value, on a GPU the `%%gpu` cell's (notebook 07 once read a live benchmark's rows as the stored run's).
"""
import ast
import json
import re
import symtable
from pathlib import Path

import pytest
from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebook style, not bugs: a cell that imports for a later cell, redefines a function to show a new version,
# or binds a value to display it. Everything else pyflakes finds fails the test.
ALLOWED = (messages.UnusedImport, messages.RedefinedWhileUnused, messages.UnusedVariable,
           messages.UnusedAnnotation, messages.ImportShadowedByLoopVar)
IPYTHON_NAMES = {"display", "get_ipython"}   # defined by IPython in every notebook


def notebook_module(path: Path) -> str:
    """The notebook's code cells as one Python module: cell magics' first line and line magics / shell
    escapes dropped (a %%gpu cell's body is plain Python), each cell headed by a comment naming it."""
    return "\n".join(f"# --- code cell {number}\n{source}" for number, (_, source) in enumerate(code_cells(path), 1))


def code_cells(path: Path) -> list[tuple[bool, str]]:
    """(is it a %%gpu cell, its code with the magics taken out) for each code cell of a notebook."""
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            gpu = bool(lines) and lines[0].startswith("%%gpu")
            lines = lines[1:] if lines and lines[0].startswith("%%") else lines
            out.append((gpu, "\n".join("pass  # magic" if re.match(r"\s*[%!]", line) else line for line in lines)
                        + "\n"))
    return out


class Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        self.found.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"line {lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"unexpected error: {msg}")


def lint(source: str, name: str = "<notebook>") -> list[str]:
    """pyflakes' findings in `source` that are not notebook style (ALLOWED), as 'line N: message' strings."""
    collect = Collect()
    api.check(source, name, collect)
    problems = []
    for m in collect.found:
        if isinstance(m, str):
            problems.append(m)
        elif not isinstance(m, ALLOWED) and not (isinstance(m, messages.UndefinedName)
                                                 and m.message_args[0] in IPYTHON_NAMES):
            problems.append(f"line {m.lineno}: {m.message % m.message_args}")
    return problems


def cell_of(source: str, lineno: int) -> str:
    """'code cell N' for a line of the joined module."""
    heads = [line for line in source.splitlines()[:lineno] if line.startswith("# --- code cell ")]
    return heads[-1].removeprefix("# --- ") if heads else "?"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_has_no_undefined_names_or_other_pyflakes_errors(path):
    source = notebook_module(path)
    problems = [f"{cell_of(source, int(p.split()[1].rstrip(':')))}, {p}" if p.startswith("line ") else p
                for p in lint(source, path.name)]
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


def test_lint_finds_what_a_gpu_run_would_hit(tmp_path):
    """The check itself: an undefined name in a %%gpu cell fails; magics and notebook style pass."""
    nb = {"cells": [
        {"cell_type": "code", "source": "import torch\n%matplotlib inline\n!ls\nx = 1\n"},
        {"cell_type": "code", "source": "%%gpu\ny = torch.ones(2) + undefined_thing\n"},
        {"cell_type": "code", "source": "def f():\n    return 1\ndef f():\n    return 2\ndisplay(f())\n"},
        {"cell_type": "markdown", "source": "undefined_in_markdown"}]}
    path = tmp_path / "demo.ipynb"
    path.write_text(json.dumps(nb))
    source = notebook_module(path)
    assert "%%gpu" not in source and "pass  # magic" in source
    problems = lint(source)
    assert len(problems) == 1 and "undefined name 'undefined_thing'" in problems[0]
    assert cell_of(source, int(problems[0].split()[1].rstrip(":"))) == "code cell 2"
    assert lint("def f(:\n") and "syntax error" in lint("def f(:\n")[0]


def imported_from_two_places(source: str) -> list[str]:
    """Names that one notebook imports from two different places. pyflakes allows the second import (a cell
    that shows a new version), but a later cell then gets whichever ran last: a %%gpu cell that expects the
    first fails only on a GPU (notebook 07's `format_table`, from utils.course.bench.backward and backward_tiles)."""
    origins: dict[str, set] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                origins.setdefault(alias.asname or alias.name, set()).add(f"{node.module}.{alias.name}")
    return [f"{name}: {', '.join(sorted(where))}" for name, where in sorted(origins.items()) if len(where) > 1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_name_is_imported_from_two_places(path):
    assert not imported_from_two_places(notebook_module(path)), path.name


def test_two_origins_of_one_name_are_found():
    source = ("from utils.course.bench.backward import format_table\nfrom utils.course.bench.backward_tiles import format_table\n"
              "from a import x\nfrom a import x\nfrom b import y as x2\n")
    assert imported_from_two_places(source) == ["format_table: utils.course.bench.backward.format_table, "
                                                 "utils.course.bench.backward_tiles.format_table"]


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
          ast.DictComp, ast.GeneratorExp)


def assigned(source: str) -> set[str]:
    """The names a cell assigns at module level (imports left out: they rebind to the same module object)."""
    return {s.get_name() for s in symtable.symtable(source, "cell", "exec").get_symbols() if s.is_assigned()}


def read_from_before(source: str) -> set[str]:
    """The names a cell takes from the cells before it: read at module level before it assigns them, or read
    in one of its functions, lambdas or comprehensions as globals it does not assign."""
    first = {}   # name -> (first load, first store) positions at module level
    stack = list(ast.parse(source).body)
    while stack:
        node = stack.pop()
        if isinstance(node, SCOPES):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Name):
            at, slot = (node.lineno, node.col_offset), 0 if isinstance(node.ctx, ast.Load) else 1
            pair = first.setdefault(node.id, [(1 << 30, 0), (1 << 30, 0)])
            pair[slot] = min(pair[slot], at)
    names = {name for name, (load, store) in first.items() if load < store}
    table, own = symtable.symtable(source, "cell", "exec"), assigned(source)
    stack = list(table.get_children())
    while stack:
        scope = stack.pop()
        stack.extend(scope.get_children())
        names |= {s.get_name() for s in scope.get_symbols()
                  if s.is_referenced() and s.is_global() and s.get_name() not in own}
    return names


def gpu_cells_change_what_later_cells_read(path: Path) -> list[str]:
    cells = code_cells(path)
    found = []
    for i, (gpu, source) in enumerate(cells):
        changed = assigned(source) if gpu else set()
        for j in range(i + 1, len(cells)):
            if changed and not cells[j][0]:
                found += [f"code cell {i + 1} (%%gpu) rebinds {name!r}, read by code cell {j + 1}"
                          for name in sorted(changed & read_from_before(cells[j][1]))]
                changed -= assigned(cells[j][1])
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_gpu_cells_leave_later_cells_the_values_a_cpu_run_gives_them(path):
    assert not gpu_cells_change_what_later_cells_read(path), path.name


def test_a_gpu_cell_that_rebinds_a_later_cells_input_is_found(tmp_path):
    cells = ["rows = load()\n", "%%gpu\nrows = run_live()\nlive = rows\nfor r in rows:\n    pass\n",
             "def f():\n    return rows\n", "x = [r for r in range(3)]\nlive = 1\nprint(live)\n",
             "rows = load()\nprint(rows)\n", "print(rows)\n"]
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells]}))
    assert gpu_cells_change_what_later_cells_read(notebook) == [
        "code cell 2 (%%gpu) rebinds 'rows', read by code cell 3"]


# Code is shown by name (a function, a kernel, a C++ definition: utils.course.show, utils.triton_utils.show_source),
# never cut out of a file at text anchors, which break when a comment is edited (issue 71). Notebooks that still
# cut would be listed here; the list only shrinks, and it is empty.
CUTS_AT_ANCHORS: set[str] = set()
ANCHOR_CUTS = (re.compile(r"\bexcerpt\("), re.compile(r"\bshow_source\([^()\n]*,\s*[\"']"),
               re.compile(r"\bshow_lines\("), re.compile(r"\.split\(\s*[\"']//"), re.compile(r"\.index\(\s*[\"']"))


def anchor_cuts(path: Path) -> list[str]:
    """The lines of a notebook's code that cut source text at an anchor."""
    return [line.strip() for _, source in code_cells(path) for line in source.splitlines()
            if any(p.search(line) for p in ANCHOR_CUTS)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_is_shown_by_name_not_cut_at_text(path):
    cuts = anchor_cuts(path)
    if path.stem in CUTS_AT_ANCHORS:
        assert cuts, f"{path.stem} no longer cuts at anchors: take it off CUTS_AT_ANCHORS"
    else:
        assert not cuts, f"{path.name} cuts source at text anchors; show it by name instead: {cuts}"


def test_anchor_cuts_are_found(tmp_path):
    nb = tmp_path / "x.ipynb"
    cells = ['show_source(kernel, "pid_m =", None)', "show_source(kernel)", 'print(excerpt(src, "a", "b"))',
             'src.split("// Step 9:")[1]', 'text[text.index("@triton.jit"):]', 'show_cpp("softmax", "block_reduce")']
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells]}))
    assert anchor_cuts(nb) == [cells[0], cells[2], cells[3], cells[4]]
