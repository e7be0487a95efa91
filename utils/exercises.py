"""Exercise checks for the notebooks.

A check runs a test function at once and reports one of three things:
- ✓ right;
- "not yet": the exercise still holds its stub (it raises NotImplementedError, possibly wrapped, as the Triton
  interpreter and compiler do for a stub inside a kernel), with the hint;
- ✗ wrong: the AssertionError's message and the hint, then the error is raised again so the cell fails.

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


def check(title: str, *, hint: str):
    """Decorator: `@check("1.1 causal mask", hint="...")` over a test function runs it and reports."""
    if not isinstance(title, str) or not isinstance(hint, str):
        raise TypeError("check(title, hint=...) takes two strings")

    def run(test):
        try:
            test()
        except Exception as err:
            if is_stub_error(err):
                print(f"… {title}: not yet. Hint: {hint}")
                return "not yet"
            if isinstance(err, AssertionError):
                print(f"✗ {title}: {err or 'wrong answer'}. Hint: {hint}")
            raise
        print(f"✓ {title}: right")
        return "right"

    return run
