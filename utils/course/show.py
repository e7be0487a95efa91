"""Show a notebook's reader a piece of C++ by its name: a function, a struct or a named lambda of a CUDA source.

    show_cpp("flash_tiled", "flash_tiled_kernel")   # utils/native/src/flash_tiled.cu, the whole kernel
    show_cpp(path_or_text, "block_reduce")

A lesson names what it shows, so editing a comment or a line of the kernel never breaks the lesson (issue 71:
no cutting at text anchors). The definition comes with the comment block right above it and the file's line
numbers. Python objects and Triton kernels are shown by `utils.triton_utils.show_source`; a Python function
read from a file without importing it (a Gluon kernel on a Triton too old to import it) by `show_python`:

    show_python(path_or_text, "_arrived")
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[1] / "native" / "src"
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _code_mask(text: str) -> list[bool]:
    """For each character: True where it is code, False inside a comment, a string or a character literal."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two in ("//", "/*"):
            close = "\n" if two == "//" else "*/"
            found = text.find(close, i + 2)
            end = n if found < 0 else found + len(close)
            for j in range(i, end):
                mask[j] = False
            i = end
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i]:
                j += 2 if text[j] == "\\" else 1
            for k in range(i, min(j + 1, n)):
                mask[k] = False
            i = j + 1
        else:
            i += 1
    return mask


def _read(source) -> tuple[str, str]:
    """(text, label) of `source`: a kernel name of utils/native/src (its .cu), a path, or C++ text (with a newline)."""
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source):
        path = Path(source)
        if not path.suffix:
            path = CUDA_DIR / f"{source}.cu"
        if not path.is_file():
            raise ValueError(f"no C++ source {source!r} (a utils/native/src kernel name, a path, or C++ text)")
        return path.read_text(), path.name
    if isinstance(source, str):
        return source, "source"
    raise TypeError(f"source must be a kernel name, a path or C++ text, got {type(source).__name__}")


def _definition_span(text: str, name: str) -> tuple[int, int]:
    """Character offsets [begin, end) of the first definition of `name`: the name followed by a parameter list
    and a body (a function), by a body (a struct or class), or by `= [...](...) {` (a named lambda)."""
    code = _code_mask(text)
    for match in re.finditer(rf"\b{re.escape(name)}\b", text):
        if not code[match.start()]:
            continue
        rest = match.end()
        before = text[max(0, match.start() - 40):match.start()]
        if re.search(r"\b(struct|class)\s+$", before):
            body = _first_code(text, code, rest, "{;")
        elif re.match(r"\s*=\s*\[", text[rest:]):
            body = _first_code(text, code, rest, "{;")
        elif re.match(r"\s*(<[^;{}()]*>)?\s*\(", text[rest:]):
            close = _matching(text, code, text.index("(", rest))
            body = _first_code(text, code, close + 1, "{;")
        else:
            continue
        if body is None or text[body] != "{":
            continue   # a declaration or a call, not the definition
        end = _matching(text, code, body) + 1
        if re.match(r"\s*;", text[end:]):
            end = text.index(";", end) + 1
        return _start_of(text, match.start()), end
    raise ValueError(f"no definition of {name!r} in the source")


def _first_code(text, code, start, chars):
    return next((i for i in range(start, len(text)) if code[i] and text[i] in chars), None)


def _matching(text, code, open_at):
    pairs = {"(": ")", "{": "}", "[": "]"}
    opener, closer, depth = text[open_at], pairs[text[open_at]], 0
    for i in range(open_at, len(text)):
        if code[i] and text[i] == opener:
            depth += 1
        elif code[i] and text[i] == closer:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {opener!r} at offset {open_at}")


def _start_of(text: str, at: int) -> int:
    """The first line of the definition around offset `at`: its own line, a `template <...>` line above it, and
    the comment block right above those."""
    lines = text[:at].split("\n")
    first = len(lines) - 1
    while first > 0 and re.match(r"\s*template\s*<", lines[first - 1]):
        first -= 1
    while first > 0 and re.match(r"\s*(//|/\*|\*)", lines[first - 1]):
        first -= 1
    return sum(len(line) + 1 for line in lines[:first])


def cpp_definition(source, name: str) -> str:
    """The text of `name`'s definition in `source` (see the module doc), with the comments right above it."""
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        raise ValueError(f"name must be a C++ identifier, got {name!r}")
    text, _ = _read(source)
    begin, end = _definition_span(text, name)
    return text[begin:end]


def show_cpp(source, name: str) -> None:
    """Print `name`'s definition in `source` with the file's line numbers."""
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        raise ValueError(f"name must be a C++ identifier, got {name!r}")
    text, label = _read(source)
    begin, end = _definition_span(text, name)
    first = text.count("\n", 0, begin) + 1
    lines = text[begin:end].split("\n")
    print(f"// {label}, {name}")
    print("\n".join(f"{first + i:4d}  {line}" for i, line in enumerate(lines)))


def _python_text(source) -> tuple[str, str]:
    """(text, label) of `source`: a path to a .py file, or Python text (with a newline)."""
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"no Python source {str(source)!r} (a path or Python text)")
        return path.read_text(), path.name
    if isinstance(source, str):
        return source, "source"
    raise TypeError(f"source must be a path or Python text, got {type(source).__name__}")


def _python_span(text: str, name: str) -> tuple[int, int]:
    """1-based first and last line of the first function or class named `name` (outer ones first, then nested
    ones), its decorators included."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier, got {name!r}")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno
    raise ValueError(f"no function or class {name!r} in the source")


def python_definition(source, name: str) -> str:
    """The text of the function or class `name` in `source` (a path or Python text), decorators included: a
    definition read by name, without importing its module."""
    text, _ = _python_text(source)
    first, last = _python_span(text, name)
    return "\n".join(text.splitlines()[first - 1:last])


def show_python(source, name: str) -> None:
    """Print the function or class `name` of `source` (a path or Python text) with the file's line numbers."""
    text, label = _python_text(source)
    first, last = _python_span(text, name)
    lines = text.splitlines()
    print(f"# {label}, {name}")
    print("\n".join(f"{i:4d}  {lines[i - 1]}" for i in range(first, last + 1)))
