"""Exercise checks for the notebooks.

A check runs a test function at once and reports one of three things:
- ✓ right;
- "not yet": the exercise still holds its stub (it raises NotImplementedError, possibly wrapped, as the Triton
  interpreter and compiler do for a stub inside a kernel), with the hint;
- ✗ wrong: the AssertionError's message and the hint, then the error is raised again so the cell fails.

Hints come in two levels, `check(title, hints=(first, second))`: a "not yet" or ✗ prints the first (what is wrong,
and the idea to look at); `hint(2)`, when the learner asks, prints the second (the formula, in words or math). No
hint holds code. `check(title, hint=...)`, one level, is what notebooks not yet moved to two levels still use
(tests/test_hints.py lists them).

In the committed notebooks, solutions sit between `# BEGIN SOLUTION` and `# END SOLUTION` lines.
"""
from __future__ import annotations

STUB_MESSAGE = "exercise: replace this line with your code"


def is_stub_error(err: BaseException | None) -> bool:
    """Whether `err`, or an exception it was raised from, comes from an exercise stub."""
    while err is not None:
        if isinstance(err, NotImplementedError) or STUB_MESSAGE in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


HINTS: dict[str, tuple[str, str]] = {}   # exercise number (the title's first word) -> (first hint, second)
RESULTS: dict[str, str] = {}             # exercise number -> what its check said last: "right", "not yet", "wrong"
_last_failed: list[str] = []             # the number of the exercise that said "not yet" or ✗ last


def solved(*numbers: str) -> bool:
    """Whether the check of each exercise in `numbers` ("10.2", ...) has run in this session and said right."""
    if not numbers or not all(isinstance(n, str) for n in numbers):
        raise TypeError(f"solved: give exercise numbers as strings, e.g. solved('10.2'), got {numbers!r}")
    return all(RESULTS.get(n) == "right" for n in numbers)


def check(title: str, *, hints: tuple[str, str] | None = None, hint: str | None = None):
    """Decorator: `@check("1.1 causal mask", hints=("what is wrong, the idea", "the formula"))` over a test function
    runs it and reports. `hint="..."` instead of `hints` gives a single level (the older form)."""
    if not isinstance(title, str) or not title.split():
        raise TypeError("check: title must be a string that starts with the exercise number")
    if (hints is None) == (hint is None):
        raise TypeError("check: pass hints=(first, second), or the older hint='...', not both or neither")
    if hints is not None:
        if not isinstance(hints, tuple) or len(hints) != 2 or not all(isinstance(h, str) and h for h in hints):
            raise TypeError("check: hints must be a tuple of two non-empty strings (what is wrong, the formula)")
        first = f"{hints[0]} (more: hint(2))"
    else:
        if not isinstance(hint, str):
            raise TypeError("check: hint must be a string")
        first = hint
    number = title.split()[0]
    if hints is not None:
        HINTS[number] = hints
    else:
        HINTS.pop(number, None)

    def run(test):
        RESULTS.pop(number, None)
        try:
            test()
        except Exception as err:
            failed = is_stub_error(err) or isinstance(err, AssertionError)
            if failed:
                _last_failed[:] = [number]
            if is_stub_error(err):
                RESULTS[number] = "not yet"
                print(f"… {title}: not yet. Hint: {first}")
                return "not yet"
            RESULTS[number] = "wrong"
            if isinstance(err, AssertionError):
                print(f"✗ {title}: {err or 'wrong answer'}. Hint: {first}")
            raise
        RESULTS[number] = "right"
        print(f"✓ {title}: right")
        return "right"

    return run


def hint(level: int = 2, exercise: str | None = None) -> None:
    """Print hint `level` (1 or 2) of `exercise` (e.g. "2.4"; default: the exercise that said "not yet" or ✗
    last)."""
    if level not in (1, 2):
        raise ValueError(f"hint: level must be 1 or 2, got {level!r}")
    if exercise is not None and not isinstance(exercise, str):
        raise TypeError(f"hint: exercise must be a string such as '2.4', got {type(exercise).__name__}")
    number = exercise or (_last_failed[0] if _last_failed else None)
    if number is None:
        raise ValueError("hint: no exercise has said 'not yet' or ✗ yet; name one, e.g. hint(2, '1.2')")
    if number not in HINTS:
        raise ValueError(f"hint: no exercise {number!r} with two hint levels; these have them: "
                         f"{', '.join(HINTS) or 'none yet'}")
    print(f"Hint {level} for {number}: {HINTS[number][level - 1]}")


def _spans(indices) -> str:
    """[0, 1, 2, 7, 9, 10] -> '0–2, 7, 9–10'."""
    out, start, prev = [], None, None
    for i in list(indices) + [None]:
        if start is not None and (i is None or i != prev + 1):
            out.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(out)


def assert_rows_close(actual, expected, *, atol: float, rtol: float, block_rows: int | None = None,
                      name: str = "output", max_heads: int = 3) -> None:
    """Raise an AssertionError that says *where* `actual` differs from `expected`, or return quietly.

    Both are tensors of shape (..., rows, cols), e.g. (batch, heads, seq, head_dim). The message names the
    wrong rows per leading index (batch, head), the blocks of `block_rows` rows they fall in (the Q blocks
    of a kernel: one program each), and the worst element, so a learner sees "rows 64–127 (block 1)" rather
    than "mismatch". NaN or inf where the expected value is finite always counts as wrong.
    """
    import torch

    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError("assert_rows_close compares two torch.Tensors")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (rows, cols), got shape {tuple(actual.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | (~torch.isfinite(a) & torch.isfinite(e))
    if not bad.any():
        return
    rows = bad.any(-1).reshape(-1, a.shape[-2])      # (leading index, row)
    lead_shape = a.shape[:-2]
    lines = []
    for flat in rows.any(-1).nonzero().flatten().tolist()[:max_heads]:
        idx = list(torch.unravel_index(torch.tensor(flat), lead_shape)) if lead_shape else []
        where = ", ".join(f"{n}={int(i)}" for n, i in zip(("batch", "head", "dim2"), idx)) or "rows"
        wrong = rows[flat].nonzero().flatten().tolist()
        text = f"{where}: rows {_spans(wrong)} wrong ({len(wrong)} of {a.shape[-2]})"
        if block_rows:
            text += f", in block(s) {_spans(sorted({r // block_rows for r in wrong}))} of {block_rows} rows"
        lines.append(text)
    more = int(rows.any(-1).sum()) - len(lines)
    if more > 0:
        lines.append(f"... and {more} more (batch, head) slice(s)")
    err = torch.where(bad, (a - e).abs().nan_to_num(float("inf")), torch.zeros_like(a))
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), a.shape))
    lines.append(f"worst at {worst}: got {a[worst].item():.4g}, expected {e[worst].item():.4g}")
    raise AssertionError(f"{name} is wrong in {int(bad.sum())} of {bad.numel()} elements:\n  " + "\n  ".join(lines))
