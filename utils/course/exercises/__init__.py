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
