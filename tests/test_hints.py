"""Tiered hints (issue 73): every exercise check in a notebook gives two levels, `check(title, hints=(first,
second))`. The first, printed on "not yet" or ✗, says what is wrong and points at the idea; the second, printed by
`hint(2)` when the learner asks, gives the formula in words or math. No hint holds code or a line of a solution."""
import ast
import json
import re
from pathlib import Path

import pytest

import utils.course.exercises as exercises
from utils.course.exercises import check, hint

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# Notebooks whose checks still give one hint, `hint="..."`. This list only shrinks: a notebook that moves to
# two levels must leave it (test_legacy_list_only_shrinks fails until it does).
LEGACY = set()

# Code in a hint: a call, indexing, a module's function, an operator of Python or C, backticks.
CODE = [(re.compile(r"\b[A-Za-z_]\w*\("), "a call"),
        (re.compile(r"\b\w+\["), "indexing"),
        (re.compile(r"\b(?:tl|torch|np|math|triton|F)\.\w"), "a library function"),
        (re.compile(r"::|->|\+=|-=|\*=|/=|==|!=|&&|\|\||//|\*\*|<<|>>"), "a code operator"),
        (re.compile(r"`"), "code in backticks"),
        (re.compile(r"(?<!\w)__\w+"), "a CUDA intrinsic"),
        # x = score / cap: an assignment of code (ASCII names and operators; math writes ·, −, ⌈⌉, e^…)
        (re.compile(r"\b[A-Za-z_]\w*\s*=\s*[A-Za-z_]\w*\s*[*/+%-]\s*[A-Za-z_0-9]"), "an assignment of code")]
# (exercise, what) a pattern finds in a notebook another branch is rewriting; only shrinks (see the test below).
PENDING = set()
SNAKE = re.compile(r"\b[A-Za-z]\w*_\w+\b")      # m_new, n_end: names a solution introduces
COMMENT = re.compile(r"\s+(?:#|//).*$")


def code_cells(path: Path) -> list[str]:
    """The code cells' sources, magic lines made harmless so that ast parses them."""
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            out.append("\n".join("pass" if re.match(r"\s*[%!]", line) else line
                                 for line in "".join(cell["source"]).splitlines()))
    return out


def checks(path: Path) -> list[tuple[str, str, object]]:
    """(title, "hints" or "hint", the value) of every `check(...)` call in the notebook's code."""
    found = []
    for source in code_cells(path):
        if "check(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                for kw in node.keywords:
                    if kw.arg in ("hints", "hint"):
                        found.append((node.args[0].value, kw.arg, hint_value(kw.value)))
    return found


def hint_value(node):
    """A hint argument's value: a literal, or a name the exercise modules define (a capstone's two levels)."""
    if isinstance(node, ast.Name):
        import importlib
        import pkgutil

        import utils.course.exercises as package

        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            if hasattr(module, node.id):
                return getattr(module, node.id)
        raise AssertionError(f"hint {node.id} is defined by no module of utils.course.exercises")
    return ast.literal_eval(node)


def solution_lines(path: Path) -> list[str]:
    """The lines between `# BEGIN SOLUTION` and `# END SOLUTION` (or `//`), stripped, comments cut."""
    lines = []
    for source in code_cells(path):
        inside = False
        for line in source.splitlines():
            if "END SOLUTION" in line:
                inside = False
            elif inside:
                lines.append(COMMENT.sub("", line).strip())
            elif "BEGIN SOLUTION" in line:
                inside = True
    return [line for line in lines if len(line) >= 8]


def solution_names(path: Path) -> set[str]:
    """snake_case names that appear in solutions and nowhere else in the notebook (prose, stubs, checks)."""
    cells = json.loads(path.read_text())["cells"]
    inside = " ".join(solution_lines(path))
    outside = []
    for cell in cells:
        keep = True
        for line in "".join(cell["source"]).splitlines():
            if "END SOLUTION" in line:
                keep = True
            elif "BEGIN SOLUTION" in line:
                keep = False
            elif keep:
                outside.append(line)
    return set(SNAKE.findall(inside)) - set(SNAKE.findall("\n".join(outside)))


TIERED = [p for p in NOTEBOOKS if p.stem not in LEGACY and checks(p)]


def test_legacy_list_only_shrinks():
    names = {p.stem for p in NOTEBOOKS}
    assert LEGACY <= names, f"not notebooks: {sorted(LEGACY - names)}"
    for path in NOTEBOOKS:
        kinds = {kind for _, kind, _ in checks(path)}
        if path.stem in LEGACY:
            assert "hint" in kinds, f"{path.name} gives two hint levels everywhere now: take it off LEGACY"
        else:
            assert "hint" not in kinds, f"{path.name} has a check with one hint: give it hints=(first, second)"


@pytest.mark.parametrize("path", TIERED, ids=lambda p: p.name)
def test_every_check_has_two_hint_levels(path):
    for title, kind, value in checks(path):
        assert kind == "hints", f"{path.name}, {title}: one hint level"
        assert isinstance(value, tuple) and len(value) == 2 and all(isinstance(h, str) and h.strip() for h in value), \
            f"{path.name}, {title}: hints must be two non-empty strings"
        assert value[0] != value[1], f"{path.name}, {title}: the two levels say the same"
    imported = {alias.name for source in code_cells(path) for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("utils.course.exercises")
                for alias in node.names}
    assert "hint" in imported, f"{path.name} does not import hint: the learner could not ask for level 2"


@pytest.mark.parametrize("path", TIERED, ids=lambda p: p.name)
def test_no_hint_holds_code_or_a_solution_line(path):
    lines, names = solution_lines(path), solution_names(path)
    assert lines, f"{path.name} has no solution lines"
    for title, _, value in checks(path):
        for level, text in enumerate(value, 1):
            where = f"{path.name}, {title}, level {level}"
            for pattern, what in CODE:
                found = pattern.search(text)
                if (title.split()[0], what) not in PENDING:
                    assert not found, f"{where}: {what} ({found.group(0)!r}) in {text!r}"
            held = [line for line in lines if line in text]
            assert not held, f"{where} holds a solution line: {held[0]!r}"
            leaked = sorted(set(SNAKE.findall(text)) & names)
            assert not leaked, f"{where} names the solution's variables {leaked}"


def test_pending_list_only_shrinks():
    hints = {title.split()[0]: value for path in TIERED for title, _, value in checks(path)}
    patterns = dict((what, pattern) for pattern, what in CODE)
    for number, what in PENDING:
        assert number in hints and any(patterns[what].search(text) for text in hints[number]), \
            f"{number}'s hints hold no {what} now: take it off PENDING"


def test_the_code_patterns_catch_the_old_hints():
    """Old one-level hints of 01, 05, 06 and 10 held code; the patterns see it."""
    old = ["keep = in_range[None, :] & (cols[None, :] <= offs_m[:, None] + ",
           "x = score / args[2]; e = tl.exp(-2.0 * tl.abs(x)); ",
           "the pattern 'b n (h d) -> b h n d' needs h=num_heads; merge is its mirror",
           "N*N*element_size <= capacity; math.isqrt gives an exact integer square root",
           "five steps; __shfl_down_sync leaves the result only in lane 0",
           "c = sm_scale * log2e once"]
    for text in old:
        assert any(p.search(text) for p, _ in CODE), text


# --- The mechanism --------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_hints(monkeypatch):
    monkeypatch.setattr(exercises, "HINTS", {})
    monkeypatch.setattr(exercises, "_last_failed", [])


def stub():
    raise NotImplementedError(exercises.STUB_MESSAGE)


def test_a_failure_prints_the_first_level_only_and_hint_2_the_second(fresh_hints, capsys):
    assert check("9.91 a stub", hints=("rows 3-5 are off: mind the maximum", "the formula"))(stub) == "not yet"
    out = capsys.readouterr().out
    assert out == "… 9.91 a stub: not yet. Hint: rows 3-5 are off: mind the maximum (more: hint(2))\n"
    assert "the formula" not in out
    hint(2)
    assert capsys.readouterr().out == "Hint 2 for 9.91: the formula\n"
    hint(1)
    assert capsys.readouterr().out == "Hint 1 for 9.91: rows 3-5 are off: mind the maximum\n"


def test_hint_2_follows_the_last_failure(fresh_hints, capsys):
    def wrong():
        raise AssertionError("row 4 is NaN")

    with pytest.raises(AssertionError):
        check("9.92 wrong", hints=("first of 9.92", "second of 9.92"))(wrong)
    assert "✗ 9.92 wrong: row 4 is NaN. Hint: first of 9.92 (more: hint(2))" in capsys.readouterr().out
    assert check("9.93 right", hints=("first of 9.93", "second of 9.93"))(lambda: None) == "right"
    assert capsys.readouterr().out == "✓ 9.93 right: right\n"
    hint(2)                                       # a check that passes does not move hint(2)
    assert capsys.readouterr().out == "Hint 2 for 9.92: second of 9.92\n"
    hint(2, "9.93")                               # any exercise, by number
    assert capsys.readouterr().out == "Hint 2 for 9.93: second of 9.93\n"


def test_one_level_hint_still_works(fresh_hints, capsys):
    assert check("9.94 old", hint="one level")(stub) == "not yet"
    assert capsys.readouterr().out == "… 9.94 old: not yet. Hint: one level\n"
    with pytest.raises(ValueError, match="no exercise '9.94' with two hint levels"):
        hint(2)


def test_hint_and_check_refuse_bad_arguments(fresh_hints):
    with pytest.raises(ValueError, match="no exercise has said"):
        hint(2)
    with pytest.raises(TypeError, match="two non-empty strings"):
        check("9.95 x", hints=("only one",))
    with pytest.raises(TypeError, match="two non-empty strings"):
        check("9.95 x", hints=("first", ""))
    with pytest.raises(TypeError, match="not both or neither"):
        check("9.95 x", hints=("a", "b"), hint="c")
    with pytest.raises(TypeError, match="not both or neither"):
        check("9.95 x")
    with pytest.raises(TypeError, match="title"):
        check("", hints=("a", "b"))
    check("9.96 y", hints=("a", "b"))
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        hint(3, "9.96")
    with pytest.raises(TypeError, match="exercise must be a string"):
        hint(2, 9.96)


def test_the_debug_lab_uses_the_shared_check():
    from utils.course.exercises import debug_lab

    assert debug_lab.check is check and debug_lab.hint is hint
