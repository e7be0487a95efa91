"""The kernel exercises of notebooks 07 (the dQ and dK/dV loops of the Triton backward) and 08 (the log-sum-exp merge inside
the merge kernel, and in PyTorch): each check says "not yet" on the learner's stub, fails on a plausible wrong
answer, and passes on the solution. The exercise cells run as a learner sees them, in the Triton interpreter on
the CPU."""
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from utils.course.exercises import check
from utils.course.exercises.decoding import check_merge_kernel, check_merge_splits, decode_partials, split_bounds
from utils.course.exercises.triton_backward import attention_grads_float64, check_dkdv_kernel, check_dq_kernel
from utils.course.learner import code_cell, exec_cell

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_from(notebook, marker, name, *, learner=False, replace=()):
    """The exercise cell's kernel, stubbed (learner) or with `replace`'s (old, new) edits: a wrong answer."""
    namespace = {"triton": triton, "tl": tl}
    exec_cell(code_cell(NOTEBOOKS / notebook, marker, learner=learner, replace=replace), namespace, marker)
    return namespace[name]


def outcome(check_fn, kernel):
    try:
        return check("exercise", hint="test")(lambda: check_fn(kernel, device=DEVICE))
    except AssertionError as err:
        return f"wrong: {err}"


DQ = ("07_backward.ipynb", "# Exercise 7.5", "dq_kernel")
DKDV = ("07_backward.ipynb", "# Exercise 7.6", "dkdv_kernel")
MERGE = ("08_decoding_and_ring.ipynb", "# Exercise 8.3", "merge_kernel")


def test_dq_exercise_stub_solution():
    assert outcome(check_dq_kernel, kernel_from(*DQ, learner=True)) == "not yet"
    assert outcome(check_dq_kernel, kernel_from(*DQ)) == "right"


@pytest.mark.parametrize("old, new", [
    ("ds = p * (dp - delta[:, None])", "ds = p * dp"),                               # forgot D
    ("dq += tl.dot(ds, k) * sm_scale", "dq += tl.dot(ds, k)"),                      # forgot the scale
    ("dq += tl.dot(ds, k) * sm_scale", "dq += tl.dot(ds, k) * qk_scale"),           # the base-2 scale
    ("ds = p * (dp - delta[:, None])", "ds = p * dp - delta[:, None]"),             # P ∘ dP − D
    ("ds = p * (dp - delta[:, None])", "ds = p * (dp - delta)"),                    # D along the keys
], ids=["no-delta", "no-scale", "qk-scale", "precedence", "delta-axis"])
def test_dq_exercise_wrong_answers_fail_and_name_rows(old, new):
    result = outcome(check_dq_kernel, kernel_from(*DQ, replace=[(old, new)]))
    assert result.startswith("wrong: ") and "dQ is wrong" in result and "block(s)" in result, result


def test_dkdv_capstone_stub_solution():
    assert outcome(check_dkdv_kernel, kernel_from(*DKDV, learner=True)) == "not yet"
    assert outcome(check_dkdv_kernel, kernel_from(*DKDV)) == "right"


# Exercise 7.6, the capstone: the whole dK/dV kernel. Each wrong kernel fails in the first case that adds what it
# gets wrong, and the message names that case, the gradient and the wrong key rows and K/V blocks.
@pytest.mark.parametrize("old, new, says, case", [
    ("dv += tl.dot(tl.trans(p), do)", "dv = tl.dot(tl.trans(p), do)", "dV is wrong", 1),      # last tile only
    ("dk += tl.dot(tl.trans(ds), q) * sm_scale", "dk += tl.dot(tl.trans(ds), q)", "dK is wrong", 1),
    ("ds = p * (dp - delta[:, None])", "ds = p * dp", "dK is wrong", 1),                        # forgot D
    ("dv += tl.dot(tl.trans(p), do)", "dv += tl.dot(p, do)", "dV is wrong", 1),                 # P, not Pᵀ
    ("* GROUP + g", "+ g", "dV is wrong", 3),                                                  # wrong query heads
    ("(offs_n[None, :] <= offs_m[:, None] + N_K - N_Q)", "(offs_n[None, :] < offs_m[:, None] + N_K - N_Q)",
     "dV is wrong", 4),                                                                        # diagonal off by one
    ("bh = bhk // (H // GROUP) * H", "bh = bhk // (H // GROUP) * (H // GROUP)", "dV is wrong", 5),  # batch offset
], ids=["dv-assigned", "no-scale", "no-delta", "untransposed", "gqa-heads", "causal-diagonal", "batch-offset"])
def test_dkdv_capstone_wrong_kernel_fails_naming_case_and_blocks(old, new, says, case):
    result = outcome(check_dkdv_kernel, kernel_from(*DKDV, replace=[(old, new)]))
    assert result.startswith(f"wrong: case {case} ") and "the first to add" in result, result
    assert says in result and "K/V blocks" in result and re.search(r"rows .* in block\(s\) [0-9]", result), result


def test_dkdv_capstone_refuses_course_kernels_and_other_kernels():
    from utils.tiled.fast import backward as fast_backward
    from utils.tiled import backward as bwd

    for kernel, name in ((bwd._bwd_dkdv, "utils.tiled.backward._bwd_dkdv"),
                         (fast_backward._bwd_dkdv, "utils.tiled.fast.backward._bwd_dkdv")):
        with pytest.raises(AssertionError, match=f"refuses the course's own kernel `{re.escape(name)}`"):
            check_dkdv_kernel(kernel)
    with pytest.raises(AssertionError, match="for your kernel `dkdv_kernel`, not `dq_kernel`"):
        check_dkdv_kernel(kernel_from(*DQ))


def test_dkdv_capstone_refuses_a_kernel_that_calls_a_course_device_function():
    namespace = {"triton": triton, "tl": tl}
    exec_cell("from utils.tiled.backward import _dkdv_inner\n", namespace, "import")
    first = "    pid_n, bhk = tl.program_id(0), tl.program_id(1)"
    src = code_cell(NOTEBOOKS / DKDV[0], DKDV[1], replace=[(first, "    _dkdv_inner\n" + first)])
    exec_cell(src, namespace, "capstone through the library's loop")
    with pytest.raises(AssertionError, match="calls the course's own `utils.tiled.backward._dkdv_inner`"):
        check_dkdv_kernel(namespace["dkdv_kernel"])


@pytest.mark.skipif(not __import__("utils.triton_utils").triton_utils.interpreting(),
                    reason="an interpreted kernel's body is Python, so it could call a course function")
@pytest.mark.parametrize("call", ["utils.tiled.backward.flash_attention_backward",
                                  "utils.eager.backward.attention_gradients"])
def test_dkdv_capstone_refuses_a_kernel_body_that_calls_the_library(call):
    module, name = call.rsplit(".", 1)
    namespace = {"triton": triton, "tl": tl}
    exec_cell(f"from {module} import {name}\n", namespace, "import")
    first = "    pid_n, bhk = tl.program_id(0), tl.program_id(1)"
    src = code_cell(NOTEBOOKS / DKDV[0], DKDV[1], replace=[(first, f"    {name}(Q, K, V, DO, LSE2, DELTA)\n" + first)])
    exec_cell(src, namespace, "capstone through the library")
    with pytest.raises(AssertionError, match=f"refuses the course's own `{re.escape(call)}`"):
        check_dkdv_kernel(namespace["dkdv_kernel"])


def test_dkdv_capstone_comes_before_the_library_kernel_is_shown():
    import json
    sources = ["".join(c["source"]) for c in json.loads((NOTEBOOKS / DKDV[0]).read_text())["cells"]]
    capstone = next(i for i, s in enumerate(sources) if s.startswith(DKDV[1]))
    library = next(i for i, s in enumerate(sources) if "show_source(bwd._dkdv_inner)" in s)
    assert capstone < library
    learner = code_cell(NOTEBOOKS / DKDV[0], DKDV[1], learner=True)
    assert "tl.dot" not in learner and "tl.load" not in learner, "the capstone's stub must hold no kernel code"


def test_merge_exercise_stub_solution():
    assert outcome(check_merge_kernel, kernel_from(*MERGE, learner=True)) == "not yet"
    assert outcome(check_merge_kernel, kernel_from(*MERGE)) == "right"


@pytest.mark.parametrize("edits, says", [
    ([("w = tl.exp(lse_parts - m_safe)", "w = tl.exp(lse_parts)"),
      ("m_safe + tl.log(total_safe)", "tl.log(total_safe)")], "4 of the 4 rows whose lse passes"),   # no max
    ([("o_parts = tl.where(w[:, None] > 0.0, o_parts, 0.0)", "")], "rows with an empty split"),      # NaN leaks
    ([('m_safe = tl.where(m == float("-inf"), 0.0, m)', "m_safe = m")], "rows with an empty split"),  # all empty
], ids=["no-max", "empty-split-unmasked", "all-empty-nan"])
def test_merge_exercise_wrong_answers_fail_and_say_why(edits, says):
    result = outcome(check_merge_kernel, kernel_from(*MERGE, replace=edits))
    assert result.startswith("wrong: ") and says in result, result


MERGE_SPLITS = ("08_decoding_and_ring.ipynb", "def merge_splits(")
# exercise 8.2's solution before issue 74: an empty split's weight is 0, but 0 · NaN is NaN
OLD_MERGE_SPLITS = [("    o_parts = torch.where(weights.unsqueeze(-1) > 0, o_parts, 0.0)   # an empty split's "
                     "output is garbage\n", "")]


def merge_splits_from(*, learner=False, replace=()):
    """Exercise 8.2's cell run as in the notebook (it runs its own check): (the check's outcome, merge_splits)."""
    namespace = {"torch": torch, "check": check, "check_merge_splits": check_merge_splits}
    try:
        exec_cell(code_cell(NOTEBOOKS / MERGE_SPLITS[0], MERGE_SPLITS[1], learner=learner, replace=replace),
                  namespace, "exercise 8.2")
    except AssertionError as err:
        return f"wrong: {err}", namespace["merge_splits"]
    return namespace["_"], namespace["merge_splits"]


def test_merge_splits_exercise_stub_solution():
    assert merge_splits_from(learner=True)[0] == "not yet"
    result, merge_splits = merge_splits_from()
    assert result == "right"
    check_merge_splits(merge_splits)


def test_merge_splits_check_fails_the_old_solution_that_lets_nan_through():
    """A split with no key has lse = -inf and an output nobody wrote (NaN here): weight 0 times NaN is NaN."""
    result, merge_splits = merge_splits_from(replace=OLD_MERGE_SPLITS)
    assert result.startswith("wrong: ") and "rows with an empty split" in result, result
    with pytest.raises(AssertionError, match="rows with an empty split"):
        check_merge_splits(merge_splits)
    o_parts, lse_parts, _, _ = decode_partials()
    assert merge_splits(o_parts, lse_parts)[0].isnan().any()       # what the old solution gave


def test_merge_splits_check_rejects_what_is_not_a_function():
    with pytest.raises(TypeError, match="merge_splits"):
        check_merge_splits(None)


def test_references_are_exact():
    """The checks' float64 references: dq against autograd through SDPA's math, merged partials by construction."""
    from utils.eager.reference import naive_attention

    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 4, 7, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse, dq, dk, dv = attention_grads_float64(q, k, v, do, causal=True, scale=0.3)
    assert torch.isinf(lse[0, :, :2]).all() and (dq[0, :, :2] == 0).all()
    assert not any(g.isnan().any() for g in (dq, dk, dv))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qq, kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1), causal=True, sm_scale=0.3)
    seen = slice(2, None)   # naive attention gives NaN for the rows that see no key
    assert torch.allclose(out[..., seen, :], ref[..., seen, :])
    expected = torch.autograd.grad(ref[..., seen, :], (qq, kk, vv), do[..., seen, :])
    assert torch.allclose(dq[..., seen, :], expected[0][..., seen, :])
    assert torch.allclose(dk, expected[1]) and torch.allclose(dv, expected[2])
    assert split_bounds(23, 16, 5) == [(0, 16), (16, 23), (23, 23), (23, 23), (23, 23)]
    o_parts, lse_parts, o, lse = decode_partials()
    assert (lse_parts == float("-inf")).any() and o_parts.isnan().any()                 # empty splits, garbage
    assert torch.isinf(lse[2]).all() and (o[2] == 0).all()                               # an empty sequence
    assert lse_parts.max() > 88.7                                                       # overflows without max


# Exercise 8.5, the capstone: the split-KV kernel from its signature. Each wrong kernel fails in the first case that
# adds what it gets wrong, naming the (batch, head, split) slots, their key ranges and rows.
SPLIT = ("08_decoding_and_ring.ipynb", "# Exercise 8.5", "split_kv_partial")


def split_outcome(kernel):
    from utils.course.exercises.decoding import check_split_kv
    return outcome(check_split_kv, kernel)


def test_split_kv_capstone_stub_solution():
    assert split_outcome(kernel_from(*SPLIT, learner=True)) == "not yet"
    assert split_outcome(kernel_from(*SPLIT)) == "right"


@pytest.mark.parametrize("old, new, case", [
    ("for start in range(lo, hi, BLOCK_N):", "for start in range(0, seqlen, BLOCK_N):", "case 2"),   # whole cache
    ("hi = tl.minimum(lo + per_split, seqlen)", "hi = lo + per_split", "case 1"),                    # past the end
    ("h_kv = h // GROUP", "h_kv = h % (n_heads // GROUP)", "case 3"),                                # GQA head
    ("(cols[None, :] <= rows[:, None] + seqlen - n_q)", "(cols[None, :] < rows[:, None] + seqlen - n_q)", "case 4"),
    ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot", "case 1"),                         # no rescale
    ("+ split * stride_os + d[None, :]", "+ d[None, :]", "case 2"),                                  # one slot
    ('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new", "case 4"),         # -inf - -inf
], ids=["ignores-its-range", "past-the-length", "gqa-head", "diagonal-off-by-one", "no-rescale", "wrong-slot",
        "nan-for-unseen-rows"])
def test_split_kv_capstone_wrong_kernels_fail_naming_slots(old, new, case):
    result = split_outcome(kernel_from(*SPLIT, replace=[(old, new)]))
    assert result.startswith(f"wrong: {case} ") and "the first to add" in result, result
    assert re.search(r"batch=\d, head=\d, split=\d \((keys \[\d+, \d+\) of \d+|no keys .*)\): rows \[", result), result


def test_split_kv_capstone_refuses_course_kernels_and_others():
    import utils.decoding.split_kv as fd
    result = split_outcome(fd._split_kv_kernel)
    assert "refuses the course's own kernel `utils.decoding.split_kv._split_kv_kernel`" in result, result
    merge = kernel_from(*MERGE)
    assert "for your kernel `split_kv_partial`, not `merge_kernel`" in split_outcome(merge)


@pytest.mark.skipif(DEVICE != "cpu",
                    reason="an interpreted kernel's body is Python, so it could call a course function")
def test_split_kv_capstone_refuses_a_kernel_body_that_calls_the_library():
    namespace = {"triton": triton, "tl": tl}
    exec_cell("from utils.decoding.split_kv import flash_decode\n", namespace, "import")
    first = "    pid_bh = tl.program_id(0)\n"
    src = code_cell(NOTEBOOKS / SPLIT[0], SPLIT[1], replace=[(first, "    flash_decode(Q, K, V)\n" + first)])
    exec_cell(src, namespace, "split kernel through the library")
    result = split_outcome(namespace["split_kv_partial"])
    assert "refuses the course's own `utils.decoding.split_kv.flash_decode`" in result, result


def test_capstone_hints_are_two_tiers_without_code():
    """The first tier points at the idea (check() offers the second as hint(2)); the second gives formulas, never
    kernel code."""
    from utils.course.exercises.decoding import SPLIT_HINTS
    from utils.course.exercises.triton_backward import DKDV_HINTS
    from utils.course.exercises.triton_forward import FORWARD_HINTS
    for name, hints in (("FORWARD_HINTS", FORWARD_HINTS), ("SPLIT_HINTS", SPLIT_HINTS), ("DKDV_HINTS", DKDV_HINTS)):
        assert len(hints) == 2 and name not in hints[0], f"{name}: two tiers, the first not naming the second"
        for hint in hints:
            assert not re.search(r"\btl\.|tl\.load|tl\.store|\w\[:, None\]|range\(", hint), hint


# Exercise 7.7 (worklog 07w, section 5): the Gluon backward's synchronisation, written as steps per tile and
# replayed on the CPU by utils.explicit.backward.replay. Each planted mistake must be named: the partition, the
# tile and the slot or buffer it concerns.
PROTOCOL = ("07w_backward_worklog.ipynb", "# Exercise 7.7", "tile_protocol")
DQ_STEP = '("meet",),\n                ("dq", slot, t % 2), ("arrive empty", slot)]'
PROTOCOL_WRONG = {
    "producer waits on the consumers' parity": (
        ('("wait empty", slot, (lap + 1) % 2)', '("wait empty", slot, lap % 2)'),
        r"hang with 1 tiles and 1 stages: .*the producer waits for slot 0's empty barrier, parity 0 \(tile 0\)"),
    "producer never waits": (
        ('("wait empty", slot, (lap + 1) % 2)', '("wait empty", slot, 1)'),
        r"the producer, tile 1: refills slot 0 while tile 0 is still read \(the consumers released it 0 of 2"),
    "consumers wait on the wrong parity": (
        ('("wait full", slot, lap % 2)', '("wait full", slot, (lap + 1) % 2)'),
        r"consumer [01], tile 0: reads slot 0 before tile 0's copy landed \(it holds nothing yet\)"),
    "slot released before the dQ products": (
        (DQ_STEP, '("meet",), ("arrive empty", slot),\n                ("dq", slot, t % 2)]'),
        r"consumer [01], tile \d: reads slot \d, which already holds tile \d: refilled while tile \d was still read"),
    "one dS buffer": (
        ('t % 2), ("store_wait",)', '0), ("store_wait",)'),
        r"consumer [01], tile 1: dSᵀ buffer 1 of consumer [01] holds tile nothing yet"),
    "no wait for the TMA engine": (
        ('("store_wait",), ', ''),
        r"consumer [01], tile \d: staged dQ of tile \d overwritten before the TMA read it"),
    "consumers never meet": (
        ('("meet",),', ''), r"consumer [01], tile 0: dSᵀ buffer 0 of consumer [01] holds tile nothing yet"),
}


def protocol_outcome(fn):
    from utils.course.exercises.gluon_backward import check_backward_protocol
    try:
        return check("7.7", hint="test")(lambda: check_backward_protocol(fn))
    except AssertionError as err:
        return f"wrong: {err}"


# Exercise 8.6: the page look-up of the paged decode, with a sliding window. A wrong look-up fails in the first case
# that adds what it gets wrong, naming the sequence and the first wrong key position with its page.
LOOKUP = ("08_decoding_and_ring.ipynb", "# Exercise 8.6", "window_lookup")


def lookup_outcome(kernel):
    from utils.course.exercises.decoding import check_window_lookup
    return outcome(check_window_lookup, kernel)


def test_window_lookup_stub_solution():
    assert lookup_outcome(kernel_from(*LOOKUP, learner=True)) == "not yet"
    assert lookup_outcome(kernel_from(*LOOKUP)) == "right"


@pytest.mark.parametrize("old, new, case, says", [
    ("start = tl.maximum(p - window + 1, 0)", "start = tl.maximum(p - window, 0)", "case 2",
     "key position 14 (slot 0) is in block-table entry 0, page 48, row 14; got page 48, row 13"),  # one key more
    ("start = tl.maximum(p - window + 1, 0)", "start = p * 0", "case 2",
     "key position 14 (slot 0) is in block-table entry 0, page 48, row 14; got page 48, row 0"),  # no window
    ("page = tl.load(BLOCK_TABLE + b * stride_table + key // PAGE_SIZE, mask=seen, other=-1)",
     "page = key // PAGE_SIZE", "case 1", "got page 0, row 0"),                            # the entry, not the page
    ("key % PAGE_SIZE, mask=seen", "key, mask=seen", "case 1", "key position 16 (slot 16)"),  # row past the page
    ("seen = key <= p", "seen = key < p", "case 1", "key position 5 (slot 5)"),             # drops the query's own key
], ids=["window-off-by-one", "no-window", "logical-page", "row-not-modulo", "misses-own-key"])
def test_window_lookup_wrong_kernels_name_the_key_and_page(old, new, case, says):
    result = lookup_outcome(kernel_from(*LOOKUP, replace=[(old, new)]))
    assert result.startswith(f"wrong: {case} ") and "the first to add" in result and says in result, result
    assert re.search(r"sequence \d \(query at position \d+, window \d+: keys \d+ to \d+\)", result), result


def test_window_lookup_refuses_course_kernels():
    import utils.decoding.split_kv as fd
    assert "refuses the course's own kernel `utils.decoding.split_kv._split_kv_kernel`" in \
        lookup_outcome(fd._split_kv_kernel)


@pytest.mark.skipif(DEVICE != "cpu",
                    reason="an interpreted kernel's body is Python, so it could call a course function")
def test_window_lookup_refuses_a_kernel_body_that_calls_the_paged_decode():
    namespace = {"triton": triton, "tl": tl}
    exec_cell("from utils.decoding.split_kv import flash_decode_paged\n", namespace, "import")
    first = "    b = tl.program_id(0)\n"
    src = code_cell(NOTEBOOKS / LOOKUP[0], LOOKUP[1], replace=[(first, "    flash_decode_paged(BLOCK_TABLE)\n" + first)])
    exec_cell(src, namespace, "look-up through the library")
    result = lookup_outcome(namespace["window_lookup"])
    assert "refuses the course's own `utils.decoding.split_kv.flash_decode_paged`" in result, result


# Exercise 8.7: one step of the simulated ring for every rank. The check names the case, the rank, the step and the
# chunk it holds, or what a rank received.
RING = ("08_decoding_and_ring.ipynb", "# Exercise 8.7")


def ring_outcome(*, learner=False, replace=(), prefix=""):
    from utils.course.exercises.ring import check_ring_step
    from utils.eager.softmax import attention_with_lse, merge_attention
    from utils.ring.attention import simulate_ring_attention
    namespace = {"torch": torch, "attention_with_lse": attention_with_lse, "merge_attention": merge_attention,
                 "simulate_ring_attention": simulate_ring_attention}
    exec_cell(prefix + code_cell(NOTEBOOKS / RING[0], RING[1], learner=learner, replace=replace), namespace,
              "exercise 8.7")
    try:
        return check("exercise", hint="test")(lambda: check_ring_step(namespace["ring_step"]))
    except AssertionError as err:
        return f"wrong: {err}"


def test_protocol_exercise_stub_solution():
    assert protocol_outcome(kernel_from(*PROTOCOL, learner=True)) == "not yet"
    assert protocol_outcome(kernel_from(*PROTOCOL)) == "right"


@pytest.mark.parametrize("mistake", PROTOCOL_WRONG)
def test_protocol_exercise_names_each_planted_hazard(mistake):
    (old, new), message = PROTOCOL_WRONG[mistake]
    result = protocol_outcome(kernel_from(*PROTOCOL, replace=[(old, new)]))
    assert result.startswith("wrong: ") and re.search(message, result), result


def test_protocol_exercise_refuses_the_courses_protocol():
    from utils.explicit import backward as gbwd
    result = protocol_outcome(lambda t, stages: gbwd.kernel_protocol()(t, 9, stages))
    assert "refuses the course's own `utils.explicit.backward.kernel_protocol`" in result, result
    inner = gbwd.kernel_protocol()    # built before the check: its function is refused too
    result = protocol_outcome(lambda t, stages: inner(t, 9, stages))
    assert "refuses the course's own `utils.explicit.backward._kernel_tile`" in result, result


def test_protocol_steps_are_validated():
    from utils.explicit import backward as gbwd
    for steps, message in [(([("copy", 0, 1)], []), r"\('copy', 0, 1\) takes 1 int after its name"),
                           (([("meet",)], []), "is not a producer step"),
                           (([], [("wait full", 2, 0)]), "names slot 2; the ring has slots 0 to 1"),
                           (([], [("wait full", 0, 2)]), "a parity is 0 or 1"),
                           (([], [("products", 0, 2)]), "dSᵀ buffers 0 and 1")]:
        with pytest.raises(AssertionError, match=message):
            gbwd.replay(lambda t, n, s, steps=steps: steps, 1, 2)


def test_ring_step_stub_solution():
    assert ring_outcome(learner=True) == "not yet"
    assert ring_outcome() == "right"


@pytest.mark.parametrize("old, new, case, says", [
    ("kv_held = kv_held[-1:] + kv_held[:-1]", "kv_held = kv_held[1:] + kv_held[:1]", "case 1",
     "after step 0, rank 0 holds chunk 1 for step 1; expected chunk 2, the one rank 2 held"),   # the wrong way round
    ("kv_held = kv_held[-1:] + kv_held[:-1]", "kv_held = kv_held", "case 1",
     "after step 0, rank 0 holds chunk 0 for step 1; expected chunk 2"),                          # never passed on
    ("o_acc[rank] = (w_acc[..., None] * o_acc[rank] + w_part[..., None] * o_part) / total[..., None]",
     "o_acc[rank] = o_acc[rank] + o_part", "case 1",
     "rank 0 at step 1 (holding K/V chunk 2): its running o is wrong"),                           # no rescale
    ("lse_acc[rank] = m + torch.log(total)", "lse_acc[rank] = m", "case 1",
     "rank 0 at step 1 (holding K/V chunk 2): its running lse is wrong"),                          # lse not merged
    ("src = (rank - step) % W", "src = (rank + step) % W", "case 2",
     "rank 1 at step 1 (holding K/V chunk 0): its running o is wrong"),                            # the wrong chunk
    ("causal=causal and src == rank", "causal=False", "case 2",
     "rank 0 at step 0 (holding K/V chunk 0): its running o is wrong"),                            # no diagonal mask
], ids=["passes-backwards", "never-passes", "no-rescale", "lse-not-merged", "wrong-chunk", "no-diagonal-mask"])
def test_ring_step_wrong_steps_name_rank_and_step(old, new, case, says):
    result = ring_outcome(replace=[(old, new)])
    assert result.startswith(f"wrong: {case} ") and "the first to add" in result and says in result, result


@pytest.mark.parametrize("call", ["merge_attention", "simulate_ring_attention"])
def test_ring_step_refuses_the_course_merge_and_ring(call):
    first = "    W = len(q_chunks)\n"
    body = {"merge_attention": "    merge_attention(q_chunks[0], lse_acc[0], q_chunks[0], lse_acc[0])\n",
            "simulate_ring_attention": "    simulate_ring_attention(q_chunks[0], q_chunks[0], q_chunks[0], "
                                       "world_size=1)\n"}[call]
    result = ring_outcome(replace=[(first, first + body)])
    module = "utils.eager.softmax" if call == "merge_attention" else "utils.ring.attention"
    assert f"refuses the course's own `{module}.{call}`" in result, result


def test_split_kv_capstone_refuses_the_single_path_kernel_notebook_08_prints():
    from utils.decoding.single_path import split_kv_contiguous
    result = split_outcome(split_kv_contiguous)
    assert "refuses the course's own kernel `utils.decoding.single_path.split_kv_contiguous`" in result, result
