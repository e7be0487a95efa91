"""Generate learner versions of the notebooks: solution blocks replaced by stubs.

    python -m utils.course.learner [--out learner] [notebooks ...]      (or: make learner)

In the committed notebooks each exercise's solution sits between a `# BEGIN SOLUTION` line and a
`# END SOLUTION` line; the learner version has, in their place, `raise NotImplementedError(...)` at the same
indentation, so the exercise's check cell reports "not yet". Outputs are cleared.

CUDA exercises keep their solution inside CUDA source (a Python string in a code cell), between
`// BEGIN SOLUTION` and `// END SOLUTION` lines; there the stub is `#error "<STUB_MESSAGE>"`, so the compiler
stops with the stub's message and the check reports "not yet" too.

A learner's work is never overwritten: each generated file records a fingerprint of its cells, and a file whose
cells no longer match it (the learner edited it) is left alone; the new version is written beside it as
`<name>.new.ipynb`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from utils.course.bootstrap import register_source
from utils.course.exercises import RESULTS, STUB_MESSAGE

ROOT = Path(__file__).resolve().parents[2]
BEGIN = re.compile(r"^(\s*)(#|//) BEGIN SOLUTION\s*$")
END = re.compile(r"^\s*(#|//) END SOLUTION\s*$")
STUB = f"raise NotImplementedError({STUB_MESSAGE!r})"
CUDA_STUB = f'#error "{STUB_MESSAGE}"'  # a compile error that carries the stub's message
STUBS = {"#": STUB, "//": CUDA_STUB}


def strip_solutions(source: str) -> tuple[str, int]:
    """`source` with each solution block replaced by a stub, and how many blocks were replaced.

    A `# BEGIN SOLUTION` block (Python) becomes STUB; a `// BEGIN SOLUTION` block (CUDA source in a string)
    becomes CUDA_STUB; each at the indentation of its BEGIN line.
    """
    out, open_marker, count = [], None, 0
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        end = END.match(line)
        if open_marker is None:
            match = BEGIN.match(line)
            if match:
                indent, open_marker = match.groups()
                count += 1
                out.append(f"{indent}{STUBS[open_marker]}\n")
            else:
                if end:
                    raise ValueError(f"line {number}: '{end.group(1)} END SOLUTION' without a BEGIN SOLUTION")
                out.append(line)
        elif end:
            if end.group(1) != open_marker:
                raise ValueError(f"line {number}: '{end.group(1)} END SOLUTION' closes a "
                                 f"'{open_marker} BEGIN SOLUTION'")
            open_marker = None
    if open_marker is not None:
        raise ValueError(f"'{open_marker} BEGIN SOLUTION' without '{open_marker} END SOLUTION'")
    return "".join(out), count


def fingerprint(cells: list) -> str:
    """Hash of the cells' types and sources: what a learner's edits change."""
    text = json.dumps([(c["cell_type"], "".join(c["source"])) for c in cells])
    return hashlib.sha256(text.encode()).hexdigest()


def learner_version(notebook: dict) -> tuple[dict, int]:
    """A copy of `notebook` (nbformat JSON) with solutions stubbed and outputs cleared."""
    nb = json.loads(json.dumps(notebook))
    total = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["source"], count = strip_solutions("".join(cell["source"]))
        cell["outputs"], cell["execution_count"] = [], None
        total += count
    nb["metadata"]["course"] = {"learner_fingerprint": fingerprint(nb["cells"])}
    return nb, total


def was_edited(path: Path) -> bool:
    """Whether a generated learner notebook no longer matches the fingerprint it was written with."""
    nb = json.loads(path.read_text())
    recorded = nb.get("metadata", {}).get("course", {}).get("learner_fingerprint")
    return recorded != fingerprint(nb["cells"])


def generate(notebooks, out_dir: Path) -> list[Path]:
    """Write learner versions of `notebooks` into `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for src in map(Path, notebooks):
        if src.suffix != ".ipynb" or not src.is_file():
            raise ValueError(f"not a notebook file: {src}")
        nb, count = learner_version(json.loads(src.read_text()))
        target = out_dir / src.name
        if target.exists() and was_edited(target):
            target = target.with_suffix(".new.ipynb")
            print(f"{out_dir / src.name} has your edits: left alone, new version written to {target.name}")
        target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
        print(f"{target}: {count} exercise(s) stubbed")
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    parser.add_argument("--out", default=str(ROOT / "learner"), help="output folder (default: learner/)")
    args = parser.parse_args(argv)
    generate(args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")), Path(args.out))


def code_cell(path, marker: str, *, learner: bool = False, replace=()) -> str:
    """The source of the one code cell of notebook `path` that contains `marker` (e.g. "# Exercise 5.2"),
    with solutions stubbed when `learner` is set: tests run an exercise's cell as a learner would see it.
    `replace`: (old, new) edits applied in turn, each `old` required to be there (tests make wrong answers so)."""
    if not isinstance(marker, str) or not marker:
        raise TypeError("marker must be a non-empty str")
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    found = [src for src in ("".join(c["source"]) for c in cells) if marker in src]
    if len(found) != 1:
        raise ValueError(f"{marker!r} is in {len(found)} code cells of {Path(path).name}, expected exactly 1")
    source = strip_solutions(found[0])[0] if learner else found[0]
    for old, new in replace:
        if old not in source:
            raise ValueError(f"{old!r} is not in the cell of {marker!r}")
        source = source.replace(old, new)
    return source


def exec_cell(source: str, namespace: dict, name: str = "cell") -> dict:
    """Run a notebook cell's `source` in `namespace` as Jupyter would, with its source registered (see
    `utils.course.bootstrap.register_source`) so a `@triton.jit` kernel it defines compiles for a GPU."""
    namespace.setdefault("__name__", "__main__")  # a module name, as in a notebook: Triton's compiler reads it
    filename = register_source(source, name)
    exec(compile(source, filename, "exec"), namespace)
    return namespace



def cell_outcome(path, marker: str, number: str, prelude: str, *, learner: bool = False, replace=()) -> str:
    """What the check of the exercise cell holding `marker` says when the cell runs after `prelude` (the
    notebook's imports): "wrong: <message>", or what it recorded for exercise `number` ("right", "not yet").
    `learner` and `replace` as for code_cell."""
    namespace: dict = {}
    exec_cell(prelude, namespace, "prelude")
    try:
        exec_cell(code_cell(path, marker, learner=learner, replace=replace), namespace, marker)
    except AssertionError as err:
        return f"wrong: {err}"
    return RESULTS[number]

if __name__ == "__main__":
    main()
