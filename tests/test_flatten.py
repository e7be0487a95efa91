"""utils.course.flatten: the flattened sources of notebook 06b's forward and backward steps and 06c's Hopper steps
(utils/native/src/steps/06b, 06c) are current, fold every switch, refuse what the parser does not understand, and (with
nvcc) compile to the PTX of the templated steps they stand for."""
import re
import shutil

import pytest

from utils.native import backward as native_backward, build as native_build, hopper
from utils.course import flatten

LESSON = "06b"
STEPS = range(1, 16)
nvcc = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(nvcc is None, reason="nvcc not found: the PTX comparison needs it")
# make test compiles the step that changes the most; the full suite all 15.
SAMPLED = (12,)


@pytest.mark.parametrize("lesson", flatten.LESSONS)
def test_committed_files_are_what_the_generator_writes_now(lesson):
    assert flatten.check(lesson) == [], "run python -m utils.course.flatten"


def test_the_lesson_has_one_generated_file_per_step():
    names = sorted(p.name for p in (flatten.STEPS_DIR / LESSON).glob("s*.cu"))
    assert names == sorted(flatten.step_path(LESSON, n).name for n in STEPS)
    assert flatten.step_path(LESSON, 12).name == "s12_hoisted.cu"


def test_the_steps_are_the_extensions_steps_and_their_files_what_the_extensions_build():
    """utils.native.build builds step n from the file this module writes (through flash_mma_step.cu.in)."""
    assert [s.name for s in flatten.steps(LESSON)] == list(native_build.MMA_STEPS)
    for n, step in enumerate(native_build.MMA_STEPS, 1):
        path = flatten.step_path(LESSON, n)
        assert path.relative_to(native_build.CUDA_DIR).as_posix() == native_build.mma_step_file(step)
        assert f"cudaError_t launch_{native_build.mma_kernel_name(step)}(" in path.read_text()


@pytest.mark.parametrize("n", STEPS)
def test_every_switch_is_folded(n):
    source = flatten.step_source(LESSON, n)
    assert flatten.GENERATED in source
    code = re.sub(r"//[^\n]*", "", source)
    assert "Step::k" not in code
    assert not re.search(r"Step::template (?!block_cols<D>\(\))", code)  # only the keys per tile stay on Step
    assert not re.search(r"\b(true|false)\s*(\?|&&|\|\|)|(&&|\|\|)\s*(true|false)\b|if (constexpr )?\((true|false)\)",
                         code)


def test_a_step_keeps_only_its_own_lineage():
    s1, s11, s15 = (re.sub(r"//[^\n]*", "", flatten.step_source(LESSON, n)) for n in (1, 11, 15))
    assert "cp_async" not in s1 and "ldmatrix" not in s1 and "kRescaleLog2" not in s1
    assert "cp_async_wait<1>" not in s11 and "cp_async_wait<2>" not in s11  # 11 is built on 7, not on 8
    assert "// Step 8" not in flatten.step_source(LESSON, 11)
    assert "load_b_k" not in s15 and "copy_rows" in s15             # load_b_k is unreachable from step 12 on


def test_the_header_names_the_step_its_parent_and_its_shape():
    head = flatten.step_source(LESSON, 11).split("#include")[0]
    assert "Step11WarpRows" in head and "on step 7" in head
    assert "4 warps x 2 m16 row tiles = 128 query rows a block" in head
    assert "64 at D = 64, 64 at D = 128" in head


def test_parents_follow_the_structs_bases():
    assert flatten.parent(LESSON, 1) is None
    assert [flatten.parent(LESSON, n) for n in (2, 10, 11, 12, 15)] == [1, 9, 7, 11, 14]
    assert flatten.lineage(LESSON, 11) == [1, 2, 3, 4, 5, 6, 7, 11]


def test_the_diff_of_step_13_moves_request_next_after_s(capsys):
    flatten.show_step_diff(LESSON, 13)
    out = capsys.readouterr().out
    assert out.startswith("--- steps/06b/s12_hoisted.cu\n+++ steps/06b/s13_late_copy.cu")
    changed = [ln for ln in out.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---", "+//", "-//"))]
    assert changed == ["-    request_next(j);", "+    request_next(j);  // Step 13: after S's mma, before the softmax",
                       "+"]


def test_show_step_prints_numbered_lines(capsys):
    flatten.show_step(LESSON, 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("   1  // Step 1 of 15")
    assert len(lines) == len(flatten.step_source(LESSON, 1).splitlines())


def test_show_step_hides_or_shows_only_a_marked_region(capsys):
    markers = ("// Online softmax", "// O += P V")
    flatten.show_step(LESSON, 1, "flash_mma_kernel")
    whole = capsys.readouterr().out.splitlines()
    flatten.show_step(LESSON, 1, "flash_mma_kernel", hide=markers)
    hidden = capsys.readouterr().out.splitlines()
    flatten.show_step(LESSON, 1, "flash_mma_kernel", only=markers)
    only = capsys.readouterr().out.splitlines()
    assert only[0].endswith(markers[0] + " on the fragments: row r (0: g, 1: g + 8) of tile i owns entries 2r, "
                                         "2r + 1 of every n8 tile.")
    assert "__shfl_xor_sync(0xffffffffu, tile_max, 1));" in "\n".join(only)
    assert not any(line in hidden for line in only)
    first, last = only[0].split()[0], only[-1].split()[0]
    assert f"      ... lines {first}-{last} hidden ..." in hidden
    assert len(hidden) == len(whole) - len(only) + 1 and markers[1] in hidden[hidden.index(
        f"      ... lines {first}-{last} hidden ...") + 1]


@pytest.mark.parametrize("call", [lambda: flatten.show_step("06d", 1),
                                  lambda: flatten.show_step("06c", len(hopper.ATTENTION_STEPS) + 1),
                                  lambda: flatten.show_step(LESSON, 1, hide=("no such line", "x")),
                                  lambda: flatten.show_step(LESSON, 1, hide=("a", "b"), only=("a", "b")),
                                  lambda: flatten.show_step(LESSON, 16),
                                  lambda: flatten.step_source(LESSON, True), lambda: flatten.step_diff(LESSON, 1),
                                  lambda: flatten.step_diff(LESSON, 3, against=0)])
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call()


def test_show_step_refuses_markers_that_are_not_a_pair():
    with pytest.raises(TypeError):
        flatten.show_step(LESSON, 1, hide="// Online softmax")


TABLE = """#pragma once

namespace course_flash {

// Step 1: base.
struct Step1A {
  static constexpr bool kX = false;
  template <int D> static constexpr int cols() { return D == 64 ? 64 : 128; }
};

struct Step2B : Step1A { %s };

}  // namespace course_flash
"""


def test_the_steps_table_parser_follows_inheritance():
    one, two = flatten.parse_steps(TABLE % "static constexpr bool kX = true;")
    assert one.members["kX"][1] == "false" and two.members["kX"][1] == "true"
    assert two.members["cols"] == ("int", "D == 64 ? 64 : 128", True) and two.parent == "Step1A"
    assert flatten._eval_d(two.members["cols"][1], 64) == 64 and flatten._eval_d("D == 64 ? 64 : 128", 128) == 128


@pytest.mark.parametrize("member, error", [
    ("static constexpr float kX = 1.f;", "cannot read member"),
    ("static constexpr bool kY = true;", "which step 1 does not have"),
    ("static constexpr bool kX = kY;", "cannot read member"),
    ("template <int D> static constexpr int cols() { return f(D); }", "uses more than D"),
])
def test_the_steps_table_parser_refuses_what_it_does_not_know(member, error):
    with pytest.raises(ValueError, match=error):
        flatten.parse_steps(TABLE % member)


def test_the_steps_table_parser_refuses_other_declarations():
    with pytest.raises(ValueError, match="expected a comment or `struct StepN"):
        flatten.parse_steps(TABLE.replace("struct Step2B", "using X = int;\nstruct Step2B") % "")


def test_substitute_refuses_an_unknown_use_of_step():
    step = flatten.steps(LESSON)[0]
    with pytest.raises(ValueError, match="has no member kNothing"):
        flatten.substitute("  if constexpr (Step::kNothing) f();\n", step)
    with pytest.raises(ValueError, match="does not understand"):
        flatten.substitute("  using S = typename Step::Inner;\n", step)


def test_fold_refuses_an_if_it_cannot_place():
    with pytest.raises(ValueError, match="does not start its line"):
        flatten.fold_ifs("\n  x = 1; if constexpr (true) y();\n")


@pytest.mark.parametrize("before, after", [
    ("a = true && p.causal ? x - 1 : y;", "a = p.causal ? x - 1 : y;"),
    ("a = false && p.causal ? x - 1 : y;", "a = y;"),
    ("cp_async_wait<true ? 1 : 0>();", "cp_async_wait<1>();"),
    ("c = p.causal && (!false || c0 + BC - 1 > q0);", "c = p.causal;"),
    ("c = p.causal && (!true || c0 + BC - 1 > q0);", "c = p.causal && (c0 + BC - 1 > q0);"),
    ("u[true ? R : 1][false ? D / 16 : 1];", "u[R][1];"),
    ("\n  static_assert(true, \"x\");\n  f();", "\n  f();"),
    ("i < (false ? D : kN) / 64;", "i < kN / 64;"),
])
def test_simplify_folds_the_literals_that_decide(before, after):
    assert flatten.simplify(before) == after


def test_a_template_argument_equal_to_its_default_reads_as_the_plain_call():
    headers = ("template <bool kSuspend = false>\n__device__ inline void wait(uint32_t bar, int phase) {}\n"
               "template <bool kFast = true> __device__ __forceinline__ int pick(int x) { return x; }\n")
    src = "wait<false>(a, 0); wait<true>(a, 1); pick<true>(2); pick<false>(3); waits<false>(4);"
    assert flatten.drop_default_template_args(src, headers) == (
        "wait(a, 0); wait<true>(a, 1); pick(2); pick<false>(3); waits<false>(4);")
    # the Hopper helpers declare the wait's suspend switch that way, so steps without it show mbarrier_wait(...)
    assert "mbarrier_wait<false>" not in flatten.step_source("06c", 3)


def test_fold_moves_a_kept_else_if_as_a_whole():
    src = "\n  if constexpr (false) {\n    a();\n  } else if (n > 0) {\n    b();\n  }\n"
    assert flatten.fold_ifs(src) == "\n  if (n > 0) {\n    b();\n  }\n"


def test_fold_keeps_the_taken_branch_dedented_with_its_comment():
    src = ("\n  if constexpr (false) {  // Step 9: no\n    a();\n  } else {  // Step 2: yes\n    b();\n  }\n"
           "  if (false) c();  // Step 8: gone\n  d();\n")
    assert flatten.fold_ifs(src) == "\n  // Step 2: yes\n  b();\n  d();\n"


@needs_nvcc
@pytest.mark.parametrize("n", [pytest.param(n, marks=() if n in SAMPLED else pytest.mark.full) for n in STEPS])
def test_a_flattened_step_compiles_to_the_ptx_of_the_templated_step(n):
    """Both files instantiate the launcher, so fp16 and bf16 at D = 64 and 128 (and HalfTile where it is taken)."""
    templated = flatten.normalised_ptx(flatten.templated_source(LESSON, n), nvcc)
    flat = flatten.normalised_ptx(flatten.step_path(LESSON, n), nvcc)
    entries = re.findall(r"\.entry (\w+)", flat)
    for dtype in ("6__half", "13__nv_bfloat16"):
        for d in (64, 128):
            assert any(f"{dtype}Li{d}E" in e for e in entries), (dtype, d, entries)
    assert flat == templated


# ---- 06c: hopper_attention_kernel.cuh and its steps table ----------------------------------------------------------

HOPPER_STEPS = range(1, len(hopper.ATTENTION_STEPS) + 1)
HOPPER_SAMPLED = (34, 36)  # the defaults (hopper.DEFAULT_STEPS); all in the full suite


def test_06c_has_one_generated_file_per_step_named_as_utils_hopper_names_them():
    assert [s.name for s in flatten.steps("06c")] == list(hopper.ATTENTION_STEPS)
    names = sorted(p.name for p in (flatten.STEPS_DIR / "06c").glob("*.cu"))
    assert names == sorted(f"s{n:02d}_{name}.cu" for n, name in enumerate(hopper.ATTENTION_STEPS, 1))
    assert {hopper.ATTENTION_STEPS.index(s) + 1 for s in hopper.DEFAULT_STEPS.values()} <= set(HOPPER_SAMPLED)


@pytest.mark.parametrize("n", HOPPER_STEPS)
def test_06c_every_switch_is_folded(n):
    code = re.sub(r"//[^\n]*", "", flatten.step_source("06c", n))
    assert "Step::" not in code
    assert not re.search(r"\b(true|false)\s*(\?|&&|\|\|)|(&&|\|\|)\s*(true|false)\b|if (constexpr )?\((true|false)\)",
                         code)


def test_06c_parents_follow_the_structs_bases():
    assert [flatten.parent("06c", n) for n in range(2, 18)] == [1, 2, 3, 4, 5, 6, 7, 8, 6, 10, 11, 11, 13, 11, 10, 15]
    assert flatten.lineage("06c", 15) == [1, 2, 3, 4, 5, 6, 10, 11, 15]


def test_06c_a_step_keeps_only_its_own_lineage():
    code = {n: re.sub(r"//[^\n]*", "", flatten.step_source("06c", n)) for n in (1, 3, 6, 7, 11, 15)}
    assert "hopper_attention_ws_kernel" not in code[1] and "hopper_attention_kernel(" not in code[3]
    assert "named_barrier_sync(1 + wg" not in code[6] and "named_barrier_sync(1 + wg" in code[7]
    assert "store_tile" not in code[11] and "store_rows" in code[11]
    assert "store_tile" in code[15] and "store_rows" not in code[15]
    assert "constexpr int kStages = 1;" in code[1]


def test_06c_step_3_is_a_new_kernel_shown_whole_by_its_diff(capsys):
    flatten.show_step_diff("06c", 3)
    out = capsys.readouterr().out
    assert out.startswith("--- steps/06c/s02_pipelined.cu\n+++ steps/06c/s03_specialised.cu")
    assert "+    hopper_attention_ws_kernel(" in out
    assert "-__global__ void __launch_bounds__(128) hopper_attention_kernel(" in out


def test_06c_the_diff_of_the_d64_default_step_swaps_the_epilogue(capsys):
    flatten.show_step_diff("06c", 15)
    changed = [ln for ln in capsys.readouterr().out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert "-    store_rows<T, D>(st, o, wk.bh, row, t, p.seqlen_q);" in changed
    assert "+    store_tile<T, D>(st, sq_wg, kQPanel, &map_o, q_lo, wk.bh, wg);" in changed


def test_06c_step_17_waits_for_k_and_v_apart(capsys):
    """Step 17's diff on 15: V's copies counted on barriers of their own, and waited for only before P V."""
    flatten.show_step_diff("06c", 17)
    changed = [ln[0] + ln[1:].strip() for ln in capsys.readouterr().out.splitlines()
               if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert "+mbarrier_arrive_expect(full(s), kTile);" in changed and "-mbarrier_arrive_expect(full(s), 2 * kTile);" in changed
    assert "+const uint32_t v_bar = v_full(s);  // step 17: V on a barrier of its own" in changed
    assert "+wait_v(i - 1);  // step 17: V only now, where P V reads it" in changed
    assert "+for (int s = 0; s < kStages; ++s) mbarrier_init(v_full(s), 1);" in changed


def test_06c_show_step_prints_a_function_by_name(capsys):
    flatten.show_step("06c", 15, "store_tile")
    out = capsys.readouterr().out
    assert "void store_tile(" in out and "hopper_attention_ws_kernel" not in out


def test_canonical_kernel_names_read_the_old_and_the_new_mangling_alike():
    old = ("_ZN13course_hopper26hopper_attention_ws_kernelI6__halfLi64ELb1ELi15EEEv14CUtensorMap_stS2_S2_S2_PT_"
           "NS_15AttentionParamsE_param_3 _ZZN13course_hopper23hopper_attention_kernelI13__nv_bfloat16Li128ELb0ELi2EEE"
           "v14CUtensorMap_stS2_S2_PT_NS_15AttentionParamsEE4bars")
    new = ("_ZN13course_hopper26hopper_attention_ws_kernelI6__halfLi64ELb1ENS_20HopperStep15TmaStoreEEEv14CUtensorMap"
           "_stS3_S3_S3_PT_NS_15AttentionParamsE_param_3 _ZZN13course_hopper23hopper_attention_kernelI13__nv_bfloat16"
           "Li128ELb0ENS_20HopperStep2PipelinedEEEv14CUtensorMap_stS3_S3_PT_NS_15AttentionParamsEE4bars")
    assert flatten.canonical_kernel_names(old) == flatten.canonical_kernel_names(new) == (
        "hopper_attention_ws_kernel<6__half,64,1,15>_param_3 hopper_attention_kernel<13__nv_bfloat16,128,0,2>E4bars")


@needs_nvcc
@pytest.mark.parametrize("n", [pytest.param(n, marks=() if n in HOPPER_SAMPLED else pytest.mark.full)
                               for n in HOPPER_STEPS])
def test_a_flattened_06c_step_compiles_to_the_ptx_of_the_templated_step(n):
    """Both files instantiate the step's launcher: fp16 and bf16, D = 64 and 128, causal and not, for sm_90a."""
    templated = flatten.step_ptx("06c", n, nvcc, flat=False)
    flat = flatten.step_ptx("06c", n, nvcc, flat=True)
    entries = re.findall(r"\.entry (\w+)", flat)
    assert len(entries) == 8 and all(f"HopperStep{n}" in e for e in entries), entries
    for dtype in ("6__half", "13__nv_bfloat16"):
        for d in (64, 128):
            for causal in (0, 1):
                assert any(f"{dtype}Li{d}ELb{causal}E" in e for e in entries), (dtype, d, causal, entries)
    assert flat == templated


# ---- 06b's backward: flash_mma_bwd_kernel.cuh and flash_mma_bwd_steps.cuh ------------------------------------------

BWD = "06b_bwd"
BWD_STEPS = range(1, len(native_backward.BWD_STEPS) + 1)
# make test compiles no backward step (nvcc takes 20 s for one, twice over); the GPU suite and --full compile all
# 17, the default (native_backward.BWD_DEFAULT_STEP) among them.
BWD_SAMPLED = ()


def test_the_backward_has_one_generated_file_per_step_named_as_utils_cuda_backward_names_them():
    assert [s.name for s in flatten.steps(BWD)] == list(native_backward.BWD_STEPS)
    names = sorted(p.name for p in (flatten.STEPS_DIR / "06b").glob("bwd_*.cu"))
    assert names == sorted(f"bwd_s{n:02d}_{name}.cu" for n, name in enumerate(native_backward.BWD_STEPS, 1))
    assert native_backward.BWD_DEFAULT_STEP in native_backward.BWD_STEPS


@pytest.mark.parametrize("n", BWD_STEPS)
def test_the_backward_every_switch_is_folded(n):
    source = flatten.step_source(BWD, n)
    assert flatten.GENERATED in source and f"Step {n} of {len(BWD_STEPS)} of the backward" in source
    code = re.sub(r"//[^\n]*", "", source)
    assert "Step::k" not in code
    assert not re.search(r"Step::template (?!(rows|min_blocks)<D>\(\))", code)  # kept: step 7's fallback reads them
    assert not re.search(r"\b(true|false)\s*(\?|&&|\|\|)|(&&|\|\|)\s*(true|false)\b|if (constexpr )?\((true|false)\)",
                         code)


def test_the_backward_parents_follow_the_structs_bases():
    assert [flatten.parent(BWD, n) for n in range(2, 20)] == [1, 1, 3, 4, 5, 5, 7, 8, 9, 10, 11, 11, 11, 14, 14, 16, 14,
                                                              18]
    assert flatten.lineage(BWD, 12) == [1, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    assert flatten.lineage(BWD, 15) == [1, 3, 4, 5, 7, 8, 9, 10, 11, 14, 15]
    assert flatten.lineage(BWD, 19) == [1, 3, 4, 5, 7, 8, 9, 10, 11, 14, 18, 19]


def test_a_backward_step_keeps_only_its_own_lineage():
    code = {n: re.sub(r"//[^\n]*", "", flatten.step_source(BWD, n)) for n in (1, 2, 7, 9)}
    assert "flash_bwd_dq_kernel" in code[2] and "flash_bwd_dq_kernel" not in code[1]  # step 2's dQ pass alone
    assert "flash_bwd_dkdv_tiled_kernel" not in code[7] and "flash_bwd_dkdv_tiled_kernel" in code[9]
    assert "launch_bwd_rows<BwdMaskAfter, T, D>" in code[9]  # where the warp tiles do not fit: step 7's kernel
    assert "// Step 8" not in flatten.step_source(BWD, 7)


def test_backward_steps_10_to_12_each_bring_their_one_change():
    code = {n: re.sub(r"//[^\n]*", "", flatten.step_source(BWD, n)) for n in (9, 10, 11, 12)}
    assert "rows<D>: 64 at D = 64" in flatten.step_source(BWD, 9)
    assert "rows<D>: 128 at D = 64, 64 at D = 128" in flatten.step_source(BWD, 10)
    assert "stmatrix_x4(" not in code[10] and "stmatrix_x4(" in code[11]
    assert "add_dq_pairs<D>(" not in code[11] and "add_dq_pairs<D>(bp, dq[mi]" in code[12]
    assert "add_dq_tile<D, kTilesQ, false>(bp, dq[mi]" in code[11] and "add_dq_tile<D, kTilesQ" not in code[12]


def test_backward_steps_13_to_15_each_bring_their_one_change():
    """13: dV, then dQ's product and atomics, then dK (two products where 11 has one loop); 14: step 11's kernel (its change,
    the prepare and finish passes, is in flash_bwd_passes.cuh); 15: the atomics without the row test."""
    def code_lines(n):  # without comments, blank lines and trailing spaces
        return "\n".join(ln.rstrip() for ln in re.sub(r"//[^\n]*", "", flatten.step_source(BWD, n)).splitlines()
                         if ln.strip())
    code = {n: code_lines(n) for n in (11, 13, 14, 15)}
    fused = "mma_16816<T>(dk[mi][n], sa[mi], qb[0]);"
    assert fused in code[11] and fused not in code[13] and code[13].count("mma_padded_a<kS, BR, T>(") == 2
    assert code[13].index("mma_padded_a<kS, BR, T>(dv,") < code[13].index("add_dq_tile<D, kTilesQ, false>(bp, dq[mi]") \
        < code[13].index("mma_padded_a<kS, BR, T>(dk,")
    assert code[14].replace("BwdPrepare", "BwdStoreMatrix").replace("s14_prepare", "s11_store_matrix") == code[11]
    assert "add_dq_tile<D, kTilesQ, true>(bp, dq[mi]" in code[15] and code[15].replace(
        "add_dq_tile<D, kTilesQ, true>", "add_dq_tile<D, kTilesQ, false>").replace("BwdPaddedDQ", "BwdPrepare").replace(
        "s15_padded_dq", "s14_prepare") == code[14]


def test_backward_steps_18_and_19_each_bring_their_one_change():
    """18: one accumulator of all D columns a warp, dV's or dK's, by one product where 14 has the fused loop; 19: the
    walk over the query blocks starts at a block of its own and ends when it is back there."""
    code = {n: re.sub(r"//[^\n]*", "", flatten.step_source(BWD, n)) for n in (14, 18, 19)}
    fused = "mma_16816<T>(dk[mi][n], sa[mi], qb[0]);"
    assert fused in code[14] and fused not in code[18] and "float acc[2][2][kTilesKV][4] = {};" in code[14]
    assert "float acc[1][2][kTilesKV][4] = {};" in code[18] and "kTilesKV = D / 8," in code[18]
    assert code[18].count("mma_padded_a<kS, BR, T>(acc[0], smem_address(is_dv ? Ps : dSs) + pad_at, rk,") == 1
    assert "store_rows<T, D>(bp, warp < 4 ? bp.dv : bp.dk, acc[0][mi]" in code[18]
    assert "const int m_start = m_first;" in code[18] and "(m + 1 == m_blocks) ? h + 1 : h;" in code[18]
    assert code[19].replace("m_first + blockIdx.x % kb.per_head", "m_first").replace(
        "(next_m == m_start) ? h + 1 : h;", "(m + 1 == m_blocks) ? h + 1 : h;").replace(
        "const int m_start = kb.per_head > 0 ? m_first : m_first;", "const int m_start = m_first;").replace(
        "BwdStagger", "BwdSplitKV").replace("s19_stagger", "s18_split_kv") == code[18]


def test_the_diff_of_backward_step_7_masks_after_the_exponentials(capsys):
    flatten.show_step_diff(BWD, 7)
    out = capsys.readouterr().out
    assert out.startswith("--- steps/06b/bwd_s05_per_head_dim.cu\n+++ steps/06b/bwd_s07_mask_after.cu")
    changed = [ln for ln in out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert "-    probs_t<kTilesS, false>(s, lse2, p, key0, q0, masked, offset, t);" in changed
    assert "+    probs_t<kTilesS, true>(s, lse2, p, key0, q0, masked, offset, t);" in changed


@needs_nvcc
@pytest.mark.parametrize("n", [pytest.param(n, marks=() if n in BWD_SAMPLED else pytest.mark.full)
                               for n in BWD_STEPS])
def test_a_flattened_backward_step_compiles_to_the_ptx_of_the_templated_step(n):
    """Both files instantiate the step's launcher: fp16 and bf16 at D = 64 and 128, each tile the GPU may get."""
    templated = flatten.step_ptx(BWD, n, nvcc, flat=False)
    flat = flatten.step_ptx(BWD, n, nvcc, flat=True)
    struct = flatten.steps(BWD)[n - 1].struct
    entries = re.findall(r"\.entry (\w+)", flat)
    for dtype in ("6__half", "13__nv_bfloat16"):
        for d in (64, 128):
            assert any(f"{struct}E{dtype}Li{d}E" in e for e in entries), (dtype, d, entries)
    assert flat == templated


def test_backward_step_16_reads_lse2_and_delta_by_thread_at_d_64():
    source = flatten.step_source(BWD, 16)
    assert "constexpr bool kLseByThread = D == 64;" in source and "cp_async_4(" in source
    assert "probs_t<kTilesS, true, kByThread>(" in source and "ds_t<kTilesS, kByThread>(" in source
    assert "probs_t<kTilesS, true, false>(" in flatten.step_source(BWD, 14)
