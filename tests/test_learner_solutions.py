"""The learner versions give no answer away (issue 73): no line of an exercise's solution appears in the generated
learner notebook, and no hint holds one.

A solution line is a line between `# BEGIN SOLUTION` and `# END SOLUTION` (or `//`), its comment cut, unless it
is trivial: shorter than MIN_CHARS, a comment, a signature or decorator, `pass`. A line the notebook gives in code
*before* the exercise (outside every solution) is scaffolding the learner already has, not an answer: the whole
kernel of a capstone reuses the loads and offsets of the exercises before it. Every other occurrence in the learner
version (in a later kernel, a later stub, prose, an earlier reference) gives the answer away.
"""
import json
import re
from pathlib import Path

import pytest

from test_hints import checks
from utils.course.learner import BEGIN, END, learner_version

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MIN_CHARS = 20
COMMENT = re.compile(r"\s+(?:#|//).*$")

# (notebook, solution line) the learner version still shows after the exercise. Empty now; it may only shrink
# (see the last test), so a new leak is fixed, not listed.
KNOWN: set[tuple[str, str]] = set()


def norm(line: str) -> str:
    return COMMENT.sub("", line).strip()


def trivial(line: str) -> bool:
    return (len(line) < MIN_CHARS or line.startswith(("#", "//", "def ", "class ", "@", "template", "__global__"))
            or line in ("pass", "return"))


def solutions(nb: dict) -> list[tuple[int, list[str]]]:
    """(cell index, its non-trivial solution lines) for each solution block of the notebook."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        block = None
        for line in "".join(cell["source"]).splitlines():
            if block is not None and END.match(line):
                found.append((index, [n for n in map(norm, block) if n and not trivial(n)]))
                block = None
            elif block is not None:
                block.append(line)
            elif BEGIN.match(line):
                block = []
    return found


def leaks(nb: dict) -> list[tuple[str, int, int]]:
    """(solution line, the exercise's cell, the cell of the learner version that shows it) for each line of a
    solution that the learner version shows anywhere in a cell's text (code, comment, prose), apart from
    scaffolding given in code before the exercise."""
    learner, _ = learner_version(nb)
    shown = ["\n".join(map(norm, "".join(cell["source"]).splitlines())) for cell in learner["cells"]]
    given = [text if cell["cell_type"] == "code" else "" for cell, text in zip(learner["cells"], shown)]
    found = []
    for index, lines in solutions(nb):
        before = "\n".join(given[:index])
        for line in lines:
            if line in before:
                continue
            found += [(line, index, where) for where, text in enumerate(shown) if line in text]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_learner_version_shows_no_solution_line(path):
    found = [(line, exercise, where) for line, exercise, where in leaks(json.loads(path.read_text()))
             if (path.stem, line) not in KNOWN]
    assert not found, "\n".join(f"{path.name}: cell {where} of the learner version shows line {line!r} of the "
                                f"solution in cell {exercise}" for line, exercise, where in found)


def test_no_hint_holds_a_solution_line_of_any_notebook():
    lines = {line for path in NOTEBOOKS for _, block in solutions(json.loads(path.read_text())) for line in block}
    for path in NOTEBOOKS:
        for title, _, value in checks(path):
            for text in (value if isinstance(value, tuple) else (value,)):
                held = sorted(line for line in lines if line in text)
                assert not held, f"{path.name}, {title}: a hint holds the solution line {held[0]!r}"


def fake_notebook(*sources: str) -> dict:
    return {"metadata": {}, "nbformat": 4, "nbformat_minor": 5,
            "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                       "source": source} for source in sources]}


def test_a_planted_solution_line_is_found_and_scaffolding_is_not():
    exercise = ("def f(x):\n    # BEGIN SOLUTION\n    total = sum(v * v for v in x)   # why\n"
                "    return total\n    # END SOLUTION\n")
    nb = fake_notebook("values = [1, 2, 3]\n", exercise, "print(f([1]))\n")
    assert leaks(nb) == []
    nb = fake_notebook("values = [1, 2, 3]\n", exercise, "total = sum(v * v for v in x)\n")   # a later reveal
    assert leaks(nb) == [("total = sum(v * v for v in x)", 1, 2)]
    nb = fake_notebook("total = sum(v * v for v in x)  # given\n", exercise)                  # scaffolding
    assert leaks(nb) == []


def test_a_line_planted_in_a_real_learner_notebook_is_found():
    path = ROOT / "notebooks" / "07_backward.ipynb"
    nb = json.loads(path.read_text())
    index, lines = next((i, b) for i, b in solutions(nb) if "dk += tl.dot(tl.trans(ds), q) * sm_scale" in b)
    nb["cells"][index + 1]["source"] = ["# dk += tl.dot(tl.trans(ds), q) * sm_scale\n"] + nb["cells"][index + 1]["source"]
    assert ("dk += tl.dot(tl.trans(ds), q) * sm_scale", index, index + 1) in leaks(nb)


def test_known_leaks_only_shrink():
    by_notebook = {path.stem: {line for line, _, _ in leaks(json.loads(path.read_text()))} for path in NOTEBOOKS}
    for stem, line in KNOWN:
        assert line in by_notebook.get(stem, set()), f"{stem} no longer shows {line!r}: take it off KNOWN"
