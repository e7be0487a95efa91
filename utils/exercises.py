"""Exercise checks for the notebooks.

A check runs a test function at once and reports one of three things:
- ✓ right;
- "not yet": the exercise still holds its stub (it raises NotImplementedError), with the hint;
- ✗ wrong: the AssertionError's message and the hint, then the error is raised again so the cell fails.

In the committed notebooks, solutions sit between `# BEGIN SOLUTION` and `# END SOLUTION` lines.
"""
from __future__ import annotations


def check(title: str, *, hint: str):
    """Decorator: `@check("1.1 causal mask", hint="...")` over a test function runs it and reports."""
    if not isinstance(title, str) or not isinstance(hint, str):
        raise TypeError("check(title, hint=...) takes two strings")

    def run(test):
        try:
            test()
        except NotImplementedError:
            print(f"… {title}: not yet. Hint: {hint}")
            return "not yet"
        except AssertionError as err:
            print(f"✗ {title}: {err or 'wrong answer'}. Hint: {hint}")
            raise
        print(f"✓ {title}: right")
        return "right"

    return run
