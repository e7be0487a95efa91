"""The CUDA exercises of notebooks 06, 06b and 06bw, on the CPU: each check says "not yet" on the learner's stub,
fails on a plausible wrong answer with a message naming the lanes, and passes on the solution."""
from pathlib import Path

import numpy as np
import pytest

from utils.native.build import find_nvcc
from utils.course.exercises import check
from utils.course.exercises.cuda_kernels import (check_backward_ds, check_load_b_v, check_online_softmax_fragments,
                                                 check_warp_reductions, host_compiler)
from utils.course.exercises.refuse import RefusedAnswer
from utils.course.learner import code_cell

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(find_nvcc() is None or host_compiler() is None,
                                reason="the CUDA exercises' checks need nvcc and a host C++ compiler")

EXERCISES = {
    "6.5": ("06_cuda_load_inline.ipynb", "# Exercise 6.5", "WARP_REDUCE_CUDA", check_warp_reductions),
    "6b.3": ("06b_cuda_tensor_cores.ipynb", "# Exercise 6b.3", "LOAD_B_V_CUDA", check_load_b_v),
    "6b.5": ("06b_cuda_tensor_cores.ipynb", "# Exercise 6b.5", "SOFTMAX_STEP_CUDA", check_online_softmax_fragments),
    "6b.8": ("06bw_cuda_worklog.ipynb", "# Exercise 6b.8", "BWD_DS_CUDA", check_backward_ds),
}


def exercise_source(exercise: str, *, learner: bool) -> str:
    notebook, marker, variable, _ = EXERCISES[exercise]
    namespace: dict = {}
    exec(code_cell(ROOT / "notebooks" / notebook, marker, learner=learner), namespace)
    return namespace[variable]


def run_check(exercise: str, source: str):
    return check(exercise, hint="test")(lambda: EXERCISES[exercise][3](source))


@pytest.mark.parametrize("exercise", EXERCISES)
def test_solution_passes(exercise):
    assert run_check(exercise, exercise_source(exercise, learner=False)) == "right"


@pytest.mark.parametrize("exercise", EXERCISES)
def test_stub_says_not_yet(exercise):
    source = exercise_source(exercise, learner=True)
    assert '#error "exercise: replace this line with your code"' in source
    assert run_check(exercise, source) == "not yet"


# Plausible wrong answers, and what the message must say about them.
WRONG = [
    ("6.5", "__shfl_xor_sync", "__shfl_down_sync", "lanes 1–31 wrong.*Only lane 0 has the result"),
    ("6.5", "offset = 16", "offset = 8", "warp_max, test case 0: lanes 0–15 wrong"),
    ("6.5", "for (int offset = 16; offset > 0; offset /= 2) v +=",
     "for (int offset = 16; offset > 0; offset /= 2) if (threadIdx.x % 32 < 16) v +=", "hung"),
    ("6b.3", "lane / 8 % 2 * 8, col = n0 + lane / 16 * 8", "lane / 16 * 8, col = n0 + lane / 8 % 2 * 8",
     r"b\[0\]\[1\] wrong in lanes 0–31; lane 0 \(g=0, t=0\) holds \(V\[0\]\[8\], V\[1\]\[8\]\), "
     r"expected \(V\[8\]\[0\], V\[9\]\[0\]\)"),
    ("6b.3", "ldmatrix_x4_trans(", "ldmatrix_x4(", r"b\[0\]\[0\] wrong in lanes 0–31.*holds \(V\[0\]\[0\], V\[0\]\[1\]\)"),
    ("6b.3", "smem_offset<D, kSwizzle>(row, col)", "row * D + col", "swizzled tile"),
    # the forward's frame: lse2 by the accumulator's row (a key here)
    ("6b.8", "-lse2[col]", "-lse2[key - key0 + (key0 % 8)]",
     r"Pᵀ \(probs_t\) \(keys 0..15, queries 0..31.*lane 0 \(g=0, t=0\) s\[0\]\[1\] holds key 0, query 1.*"
     r"lse2 indexed by the key"),
    ("6b.8", "key > q0 + col + offset", "key > q0 + col",   # top-left causal alignment
     r"keys 16..31, queries 0..63, Nq=40, Nk=45, causal\): wrong at keys 16–31.*key 16, query 11: got 0.*visible"),
    ("6b.8", "key >= p.seqlen_k || ", "", r"keys 112..127.*Nk=120.*wrong at keys 120–127.*must be 0"),
    ("6b.8", "delta[n * 8 + 2 * t + e % 2]", "delta[e / 2 * 8]", r"dSᵀ \(ds_t\).*wrong at keys 0–15"),
    # 6b.5: no quad reduction of the max; no rescale of l, of o; the scale not folded; the max not carried; no guard
    # for a row that sees no key yet; the row sum reduced over the quad at every tile
    ("6b.5", "    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));\n"
             "    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));\n", "",
     r"tile 0 of 4.*row 0 \(lanes 0–3, r=0\): lane 0 m\[0\] holds .*max of this lane's own entries"),
    ("6b.5", "l[r] = l[r] * alpha + sum;", "l[r] = l[r] + sum;",
     r"tile 2 of 4.*row 0 \(lanes 0–3, r=0\): the four lanes' l\[0\] add up to .*max of this row grew"),
    ("6b.5", "o[n][2 * r] *= alpha, o[n][2 * r + 1] *= alpha;", ";",
     r"tile 2 of 4.*row 0 \(lanes 0–3, r=0\): O \(after O \+= P V\) wrong; lane 0 o\[0\]\[0\].*max of this row grew"),
    ("6b.5", "fmaf(s[n][e], scale_log2, -ref_log2)", "s[n][e] - ref_log2 / scale_log2",
     r"tile 0 of 4.*row 0 \(lanes 0–3, r=0\): P wrong .*lane 0 s\[0\]\[0\].*without the softmax scale"),
    ("6b.5", "fmaxf(m[r], tile_max)", "tile_max",
     r"tile 1 of 4.*row 0 \(lanes 0–3, r=0\): lane 0 m\[0\] holds .*this tile's max"),
    ("6b.5", "(m_new == -INFINITY ? 0.f : m_new)", "m_new", r"tile 0 of 4.*row 3 \(lanes 12–15, r=0\).*NaN"),
    ("6b.5", "l[r] = l[r] * alpha + sum;",
     "sum += __shfl_xor_sync(0xffffffffu, sum, 1); sum += __shfl_xor_sync(0xffffffffu, sum, 2); "
     "l[r] = l[r] * alpha + sum;",
     r"tile 0 of 4.*row 0.*4 times the row sum"),
]


def _wrong_cases():
    """make test builds the first wrong answer of each exercise (each build is a host compile of seconds); the
    full suite (--full, and the GPU suite) builds them all."""
    seen = set()
    for w in WRONG:
        yield pytest.param(*w, id=f"{w[0]}-{w[2][:20]}", marks=pytest.mark.full if w[0] in seen else ())
        seen.add(w[0])


@pytest.mark.parametrize("exercise, old, new, message", list(_wrong_cases()))
def test_wrong_answer_fails_and_says_where(exercise, old, new, message):
    source = exercise_source(exercise, learner=False)
    assert old in source
    with pytest.raises(AssertionError, match=message):
        run_check(exercise, source.replace(old, new))


def test_checks_refuse_a_non_string():
    with pytest.raises(TypeError):
        check_warp_reductions(None)
    with pytest.raises(TypeError):
        check_load_b_v(b"source")
    with pytest.raises(TypeError):
        check_online_softmax_fragments(None)
    with pytest.raises(TypeError):
        check_backward_ds(None)


@pytest.mark.skipif(host_compiler() is None, reason="needs a host C++ compiler")
def test_builds_of_one_program_at_once_all_get_a_whole_binary(tmp_path, monkeypatch):
    """Two notebooks (or two test runs) checking the same answer at once build the same program: each build
    writes its own files and renames the binary into place, so none runs or overwrites a half-written one; a
    failed build leaves nothing behind."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from utils.course.exercises import cuda_kernels

    monkeypatch.setattr(cuda_kernels, "BUILD_DIR", tmp_path)

    def build(program):
        return cuda_kernels.build_host(program, prefix="p", flags=["-std=c++17"], what="the test")

    with ThreadPoolExecutor(6) as pool:
        binaries = list(pool.map(lambda _: build("int main() { return 7; }"), range(6)))
    assert len(set(binaries)) == 1 and subprocess.run([binaries[0]]).returncode == 7
    assert [p.name for p in tmp_path.iterdir()] == [binaries[0].name]
    with pytest.raises(RuntimeError, match="^the test"):
        build("int main( {")
    assert [p.name for p in tmp_path.iterdir()] == [binaries[0].name]


@pytest.mark.parametrize("include", ['#include "flash_mma_kernel.cuh"', "#include <flash_mma.cuh>"])
def test_online_softmax_check_refuses_the_course_kernel(include):
    source = exercise_source("6b.5", learner=False)
    with pytest.raises(RefusedAnswer, match="refuses the course's own"):
        check_online_softmax_fragments(include + "\n" + source)
    with pytest.raises(RefusedAnswer, match="course_flash"):
        check_online_softmax_fragments(source.replace("fast_exp2(m[r]", "course_flash::fast_exp2(m[r]"))


def test_the_online_softmax_gpu_kernel_gives_the_emulations_records():
    """The one-warp kernel that the check runs on a GPU, run here in the emulated warp (`__shared__` as a static:
    one array for the 32 lane threads), must pass the same comparison; a planted mistake must fail it."""
    from utils.course.exercises import cuda_kernels as ck

    s, v = ck._frag_data()
    driver = f"""
int main() {{
  static const float S[] = {ck._frag_array(s)}, V[] = {ck._frag_array(v)};
  static float out[{ck._FRAG_TILES} * 32 * 28];
  warp_emulation::run_warp([&](int) {{
    exercise_softmax_step_kernel(S, V, out, {ck._FRAG_TILES}, {ck._FRAG_SCALE_LOG2!r}f);
  }});
  for (int i = 0; i < {ck._FRAG_TILES} * 32; ++i) {{
    std::printf("%d %d", i / 32, i % 32);
    for (int k = 0; k < 28; ++k) std::printf(" %.9g", out[i * 28 + k]);
    std::printf("\\n");
  }}
}}
"""
    def records(source):
        out = ck.run_emulated("#define __global__\n#define __shared__ static\n" + ck._FRAG_PRELUDE + source
                              + ck._FRAG_KERNEL + driver)
        return np.array([line.split() for line in out.split("\n") if line], dtype=np.float64)

    source = exercise_source("6b.5", learner=False)
    ck._frag_compare(records(source), s, v, "on the GPU: ")
    with pytest.raises(AssertionError, match=r"on the GPU: tile 2 of 4.*max of this row grew"):
        ck._frag_compare(records(source.replace("l[r] = l[r] * alpha + sum;", "l[r] += sum;")), s, v, "on the GPU: ")
