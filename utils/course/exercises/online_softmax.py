"""Checks for notebook 02's exercises that must not be answered by a library call.

The learner's function runs under `recording_ops`, a dispatch mode that sees every ATen operator however it
was called (`torch.exp(s)`, `s.exp()`, `torch.special.exp`), so a forbidden shortcut is caught by what it
runs, not by its spelling. The expected values are computed in float64 inside each check.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from utils.course.exercises.refuse import refusing


class recording_ops(TorchDispatchMode):
    """`with recording_ops() as ops:` ... `ops.names` is the set of ATen operators run inside the block."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__.rstrip("_"))   # exp_ and exp are the same shortcut
        return func(*args, **(kwargs or {}))


def run_without(fn, args, forbidden: dict[str, str]):
    """fn(*args), failing if it ran any operator of `forbidden` ({aten name: what to do instead})."""
    with recording_ops() as ops:
        out = fn(*args)
    used = sorted(ops.names & set(forbidden))
    if used:
        raise AssertionError(f"your function calls {used[0]}: {forbidden[used[0]]}")
    return out, ops.names


def course_lse() -> list:
    """The course's functions that compute a running (max, sum) or a log-sum-exp, or merge them."""
    from utils.decoding import split_kv as flash_decoding
    from utils.eager import softmax

    return [softmax.softmax_state, softmax.merge_states, softmax.lse_from_state, softmax.logsumexp,
            softmax.merge_attention, softmax.attention_with_lse, flash_decoding.merge_partials]


def check_running_max_and_sum(running_max_and_sum) -> None:
    """Exercise 2.1: running_max_and_sum(x) = (max x, sum exp(x - max x)) as Python floats, from the recurrence
    over a 1-D tensor; (-inf, 0.0) for an empty or all -inf row. The course's softmax states are refused."""
    x = 6 * torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    for row in (x, torch.cat([torch.full((3,), -math.inf, dtype=torch.float64), x])):
        with refusing(*course_lse()):
            m, l = running_max_and_sum(row)
        assert math.isclose(m, x.max().item()), f"m = {m}, expected the maximum {x.max().item()}"
        expected = torch.exp(x - x.max()).sum().item()
        assert math.isclose(l, expected, rel_tol=1e-9), f"l = {l}, expected {expected}"
    for row in (torch.full((4,), -math.inf), torch.zeros(0)):
        with refusing(*course_lse()):
            m, l = running_max_and_sum(row)
        assert m == -math.inf and l == 0.0, f"for {row.tolist()} got ({m}, {l}), expected (-inf, 0.0)"


def check_lse_merge(lse_merge) -> None:
    """Exercise 2.2: lse_merge(a, b) = log(e^a + e^b), stable, -inf where both are -inf, no logaddexp: neither
    PyTorch's (however spelt) nor the course's log-sum-exp functions."""
    a = torch.tensor([0.0, 1000.0, -math.inf, -math.inf, 3.0, -1e4, 88.0, -745.0], dtype=torch.float64)
    b = torch.tensor([0.0, 999.0, 2.0, -math.inf, -50.0, -1e4 + 1, 89.5, -746.0], dtype=torch.float64)
    forbidden = {name: "that is the answer; factor out the larger of the two instead"
                 for name in ("logaddexp", "logaddexp2", "logsumexp")}
    with refusing(*course_lse()):
        got, _ = run_without(lse_merge, (a.clone(), b.clone()), forbidden)
    if not isinstance(got, torch.Tensor) or got.shape != a.shape:
        raise AssertionError(f"return a tensor of shape {tuple(a.shape)}, got {got!r}")
    big = torch.maximum(a, b)
    small = torch.minimum(a, b)
    expected = torch.where(big == -math.inf, big, big + torch.log1p(torch.exp(small - big)))
    bad = ~torch.isclose(got.double(), expected, rtol=1e-12, atol=1e-12) & ~(got.isneginf() & expected.isneginf())
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"for a = {a[i].item()}, b = {b[i].item()} you return {got[i].item()}, "
                             f"expected {expected[i].item()} ({int(bad.sum())} of {len(a)} pairs wrong)")


def check_probs_exp2(probs_exp2) -> None:
    """Exercise 2.3: probs_exp2(s, m, sm_scale) = e^(sm_scale·(s - m)), computed with exp2 and no exp."""
    gen = torch.Generator().manual_seed(23)
    s = 20 * torch.randn(4, 64, dtype=torch.float64, generator=gen)
    m = s.amax(-1, keepdim=True)
    forbidden = {name: "use torch.exp2 with log2(e) folded into the scale"
                 for name in ("exp", "expm1", "pow", "softmax", "_softmax")}
    for sm_scale in (0.125, 0.3):
        got, ops = run_without(probs_exp2, (s.clone(), m.clone(), sm_scale), forbidden)
        if "exp2" not in ops:
            raise AssertionError("your function never calls torch.exp2")
        expected = torch.exp(sm_scale * (s - m))
        torch.testing.assert_close(got, expected, msg=lambda msg: f"sm_scale={sm_scale}: {msg}")
