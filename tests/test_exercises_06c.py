"""Notebook 06c's exercises: each check says "not yet" on the learner's stub, fails on a plausible wrong answer
with a message naming what is wrong, and passes on the solution. The C++ ones compile for the CPU (a host
compiler, no nvcc needed); on an H100/H200 the checks also run the GEMM with the learner's function inside."""
from pathlib import Path

import pytest

from utils.course.exercises import check
from utils.course.exercises.cuda_kernels import host_compiler
from utils.course.exercises.hopper import (EXERCISE_STEPS, check_accumulator_layout, check_gemm_desc,
                                           check_tile_chunk, check_tile_needs_mask, exercise_sources)
from utils.course.learner import code_cell
from utils.native.build import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "06c_hopper_wgmma.ipynb"
needs_compiler = pytest.mark.skipif(host_compiler() is None, reason="needs a host C++ compiler")
EXERCISES = {
    "6c.1": ("# Exercise 6c.1", "TILE_CHUNK_CUDA", check_tile_chunk),
    "6c.2": ("# Exercise 6c.2", "GEMM_DESC_CUDA", check_gemm_desc),
    "6c.3": ("# Exercise 6c.3", "accumulator_element", check_accumulator_layout),
    "6c.4": ("# Exercise 6c.4", "TILE_NEEDS_MASK_CUDA", check_tile_needs_mask),
}


def answer(exercise: str, *, learner: bool = False, replace=()):
    marker, name, _ = EXERCISES[exercise]
    namespace: dict = {}
    exec(code_cell(NOTEBOOK, marker, learner=learner, replace=replace), namespace)
    return namespace[name]


def run_check(exercise: str, value):
    return check(exercise, hint="test")(lambda: EXERCISES[exercise][2](value))


@needs_compiler
@pytest.mark.parametrize("exercise", EXERCISES)
def test_solution_passes(exercise):
    assert run_check(exercise, answer(exercise)) == "right"


@needs_compiler
@pytest.mark.parametrize("exercise", EXERCISES)
def test_stub_says_not_yet(exercise):
    stub = answer(exercise, learner=True)
    if isinstance(stub, str):
        assert '#error "exercise: replace this line with your code"' in stub
    assert run_check(exercise, stub) == "not yet"


WRONG = [
    ("6c.1", "Swizzle::k128B", "Swizzle::k64B", r"256 of 512 chunks land in the wrong place.*thread 32, i = 0 copies "
     r"row 4, column 0 to byte 512; the 128-byte swizzle puts it at 4 \* 128 \+ \(0 \^ 4\) \* 16 = 576"),
    ("6c.1", "tid + 128 * i", "tid + 64 * i", r"192 chunks are copied more than once, e\.g\. row 8, column 0"),
    ("6c.1", "swizzle(row * 128 + col * 16, Swizzle::k128B)", "row * 128 + col * 16",
     r"rows with wrong bytes: 1–7, 9–15"),
    ("6c.2", "32 * k_step", "16 * k_step", r"gemm_desc\(0x0, 1\): start address 0x10, expected 0x20"),
    ("6c.2", "8 * 128", "128", r"stride offset 128 bytes, expected 1024"),
    ("6c.2", "Swizzle::k128B", "Swizzle::kNone", r"swizzle mode 0 bytes, expected 128"),
    ("6c.3", "8 * (r // 2)", "8 * (r % 2)", r"thread 0 \(warp 0, lane 0\), register 1: you say \(row, col\) = "
     r"\(8, 1\), the tensor cores put \(0, 1\) there"),
    ("6c.3", "16 * warp + g", "g", r"in warps \[1, 2, 3\]"),
    ("6c.4", "keys * (tile + 1) - 1", "keys * (tile + 1)", r"48 of 5444 tiles need no mask but you mask them .*"
     r"Nq = 1024, Nk = 1024, not causal, rows 0-63, tile 15 of 64 keys: every key is below Nk"),
    ("6c.4", "last_key >= seqlen_k", "last_key > seqlen_k", r"tiles would go unmasked: .*you skip its mask, but key "
     r"\d+ is past the last key"),
    ("6c.4", "first_row + seqlen_k - seqlen_q", "first_row", r"tiles would go unmasked: e\.g\. Nq = 700, Nk = 300, "
     r"causal, rows 64-127, tile 0 of 64 keys \(keys 0-63\): you skip its mask, but key 0 comes after row 64's "
     r"diagonal \(it sees keys up to -336\)"),
    ("6c.4", "(causal && ", "(", r"need no mask but you mask them .*not causal"),
]


@needs_compiler
@pytest.mark.parametrize("exercise, old, new, message", WRONG, ids=[f"{w[0]}-{w[2][:24]}" for w in WRONG])
def test_wrong_answer_fails_and_says_where(exercise, old, new, message, capsys):
    with pytest.raises(AssertionError, match=message):
        run_check(exercise, answer(exercise, replace=[(old, new)]))
    assert "✗" in capsys.readouterr().out


# Exercise 6c.5 runs on any machine: the trip is a list of events, replayed against a model of the wgmma groups in
# flight, the K/V stages and the accumulators. Each planted mistake must be named: its tile, its event, and what
# it does to which stage or accumulator.
TRIP = "exercise-6c.5"
TRIP_ANSWER = ('["wait full i", "issue S i", "commit", "issue PV i-1", "commit", "wait 1", "softmax i", "wait 0",\n'
               '            "arrive empty i-1", "rescale"]')
TRIP_WRONG = {
    "stage freed under P V": (['"softmax i", "wait 0",\n            "arrive empty i-1"',
                               '"softmax i", "arrive empty i-1",\n            "wait 0"'],
                              r"tile 1, 'arrive empty i-1': releases stage 0 while the wgmma 'PV 0' still reads it"),
    "softmax before S is done": (['"commit", "wait 1", "softmax i"', '"commit", "softmax i", "wait 1"'],
                                 r"tile 1, 'softmax i': reads S while the wgmma writing tile 1's scores is in flight"),
    "P V committed first": (['"issue S i", "commit", "issue PV i-1"', '"issue PV i-1", "commit", "issue S i"'],
                            r"tile 1, 'softmax i': reads S while the wgmma writing tile 1's scores is in flight"),
    "rescale under P V": (['"wait 0",\n            "arrive empty i-1", "rescale"',
                           '"rescale", "wait 0",\n            "arrive empty i-1"'],
                          r"tile 1, 'rescale': rescales O while the P V of tile 0 still accumulates into it"),
    "no wait for the copy": (['"wait full i", "issue S i"', '"issue S i"'],
                             r"tile 1, 'issue S i': reads tile 1's K in stage 1 before waiting for its copy to land"),
    "stage freed a trip late": (['"arrive empty i-1"', '"arrive empty i-2"'],
                                r"tile 1, 'arrive empty i-2': there is no tile -1"),
    "stage never freed": (['"wait 0",\n            "arrive empty i-1", "rescale"', '"wait 0",\n            "rescale"'],
                          r"2 tiles, 2 stages: tile 0's stage is never released: the producer waits forever"),
    "stage freed before its P V": (['"arrive empty i-1"', '"arrive empty i"'],
                                   r"tile 1, 'arrive empty i': releases stage 1 before tile 1's wgmmas have read it"),
    "no overlap": (['"issue S i", "commit", "issue PV i-1", "commit", "wait 1", "softmax i", "wait 0",\n'
                    '            "arrive empty i-1", "rescale"',
                    '"issue S i", "commit", "wait 0", "softmax i", "rescale", "issue PV i", "commit", '
                    '"wait 0", "arrive empty i"'],
                   r"tile 1, 'softmax i': no wgmma is in flight while the softmax runs"),
}


def trip_answer(*, learner=False, replace=()):
    namespace: dict = {}
    exec(code_cell(NOTEBOOK, "# Exercise 6c.5", learner=learner, replace=replace), namespace)
    return namespace["consumer_trip"]


def run_trip_check(fn):
    from utils.course.exercises.wgmma_replay import check_consumer_trip
    return check("6c.5", hint="test")(lambda: check_consumer_trip(fn))


def test_trip_solution_passes_and_stub_says_not_yet():
    assert TRIP_ANSWER in code_cell(NOTEBOOK, "# Exercise 6c.5")
    assert run_trip_check(trip_answer()) == "right"
    assert run_trip_check(trip_answer(learner=True)) == "not yet"


@pytest.mark.parametrize("mistake", TRIP_WRONG)
def test_trip_mistake_is_named(mistake, capsys):
    (old, new), message = TRIP_WRONG[mistake]
    with pytest.raises(AssertionError, match=message):
        run_trip_check(trip_answer(replace=[(old, new)]))
    assert "✗" in capsys.readouterr().out


def test_trip_the_courses_order_is_refused():
    from utils.course.exercises import wgmma_replay
    with pytest.raises(AssertionError, match=r"refuses the course's own `utils\.course\.exercises\.wgmma_replay"
                                             r"\.kernel_trip`"):
        run_trip_check(wgmma_replay.kernel_trip)
    wgmma_replay.replay_trip(wgmma_replay.kernel_trip(), 5, 2)   # outside the check it runs, and is right


def test_trip_bad_input_is_named():
    from utils.course.exercises.wgmma_replay import replay_trip
    with pytest.raises(TypeError, match="list of event strings"):
        replay_trip("commit", 3, 2)
    with pytest.raises(ValueError, match="stages"):
        replay_trip([], 3, 0)
    with pytest.raises(AssertionError, match="unknown event 'issue QK i'"):
        replay_trip(["wait full i", "issue QK i"], 3, 2)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_the_mask_checks_build_holds_only_the_steps_it_runs():
    # the check on an H100/H200 rebuilds hopper_attention.cu with the learner's function: two steps, in seconds,
    # not the minutes of every step
    from utils.native import hopper
    from utils.native.build import compile_source

    assert [hopper.ATTENTION_STEPS.index(s) + 1 for s in EXERCISE_STEPS] == [4, 6]
    _, cuda = exercise_sources("hopper_attention", {"tile_needs_mask": answer("6c.4")})
    kernels = [r.kernel for r in compile_source(cuda, "sm_90a")]
    assert len(kernels) == 4, kernels   # two steps, causal or not
    for step in ("HopperStep4Softmax", "HopperStep6Overlap"):
        assert sum(step in k and "__nv_bfloat16" in k and "128" in k for k in kernels) == 2, kernels


def test_exercise_sources_names_a_bad_argument():
    with pytest.raises(ValueError, match="kernel must be"):
        exercise_sources("flash_naive", {})
    with pytest.raises(ValueError, match="no exercise named 'tile'"):
        exercise_sources("hopper_attention", {"tile": ""})
