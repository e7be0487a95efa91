"""utils.native.hopper: the swizzle and descriptor model (against hand-worked values and against hopper.cuh compiled by
nvcc for the host), validation on CPU, and on an sm_90 GPU the wgmma GEMM against float64."""
import re
import subprocess

import pytest
import torch

from utils import gpu
from utils.native import build as native_build, hopper
from utils.native.build import find_nvcc
from utils.course.exercises.cuda_kernels import host_compiler

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")


def test_swizzle_128_permutes_the_chunks_of_each_row_by_the_row():
    # Row r (128 bytes) of an 8-row block keeps its bytes but stores chunk c in slot c XOR r.
    for r in range(8):
        for c in range(8):
            for byte in (0, 5, 15):
                assert hopper.swizzle(r * 128 + c * 16 + byte, 128) == r * 128 + (c ^ r) * 16 + byte
    assert hopper.swizzle(1024 + 3 * 128 + 16, 128) == 1024 + 3 * 128 + 2 * 16  # the pattern repeats per 1 KB


def test_swizzle_64_and_32_use_fewer_bits():
    # 64-byte rows: row r sits at r * 64, so bits 7-8 are r // 2 (mod 4); 32-byte rows: bit 7 is r // 4 (mod 2).
    for r in range(16):
        for c in range(4):
            assert hopper.swizzle(r * 64 + c * 16, 64) == r * 64 + (c ^ (r // 2 % 4)) * 16
        for c in range(2):
            assert hopper.swizzle(r * 32 + c * 16, 32) == r * 32 + (c ^ (r // 4 % 2)) * 16
    assert [hopper.swizzle(x, 0) for x in range(0, 4096, 48)] == list(range(0, 4096, 48))


@pytest.mark.parametrize("mode", [0, 32, 64, 128])
def test_swizzle_is_a_permutation_of_each_kilobyte(mode):
    assert sorted(hopper.swizzle(x, mode) for x in range(2048)) == list(range(2048))


def test_chunk_layout_and_bank_conflicts():
    assert hopper.chunk_layout(8, 128, 128).tolist() == [[c ^ r for c in range(8)] for r in range(8)]
    assert hopper.chunk_layout(4, 128, 0).tolist() == [list(range(8))] * 4
    # Eight rows of 128 bytes read down one column of chunks: all in one group of banks without swizzling,
    # spread over all eight with 128-byte swizzling, over four (two each) with 64-byte swizzling.
    assert [hopper.bank_conflicts(8, 128, mode) for mode in (0, 32, 64, 128)] == [8, 4, 2, 1]
    assert hopper.bank_conflicts(8, 128, 128, column=5) == 1


def test_descriptor_fields():
    d = hopper.smem_descriptor(0x400, leading_bytes=16, stride_bytes=1024, mode=128)
    assert d == 0x40 | 1 << 16 | 64 << 32 | 1 << 62
    assert hopper.decode_descriptor(d) == dict(address=0x400, leading_bytes=16, stride_bytes=1024, base_offset=0,
                                               mode=128)
    for mode, bits in ((0, 0), (128, 1), (64, 2), (32, 3)):
        assert hopper.smem_descriptor(0, leading_bytes=0, stride_bytes=0, mode=mode) >> 62 == bits
    assert hopper.decode_descriptor(hopper.smem_descriptor(0x3FFF0, leading_bytes=0x3FFF0, stride_bytes=512,
                                                           mode=32))["address"] == 0x3FFF0


def test_validation():
    with pytest.raises(ValueError, match="mode must be one of"):
        hopper.swizzle(0, 16)
    with pytest.raises(TypeError, match="offset must be an int"):
        hopper.swizzle(1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        hopper.smem_descriptor(8, leading_bytes=16, stride_bytes=1024)
    with pytest.raises(ValueError, match="stride_bytes must be in"):
        hopper.smem_descriptor(0, leading_bytes=16, stride_bytes=1 << 18)
    with pytest.raises(ValueError, match="column must be in"):
        hopper.bank_conflicts(8, 128, 128, column=8)
    with pytest.raises(ValueError, match="descriptor must be in"):
        hopper.decode_descriptor(-1)


@pytest.mark.skipif(host_compiler() is None, reason="no host C++ compiler")
def test_the_cuda_header_computes_what_the_model_does(tmp_path):
    """hopper_layout.h is plain C++ too: compile a tiny program with the host compiler and compare."""
    cases = [(a, l, s, m) for a in (0, 0x400, 0x3FFF0) for l in (16, 4096) for s in (256, 1024)
             for m in (0, 32, 64, 128)]
    codes = {0: "kNone", 128: "k128B", 64: "k64B", 32: "k32B"}
    lines = [f'printf("%llu %u\\n", (unsigned long long)smem_desc({a}u, {l}u, {s}u, Swizzle::{codes[m]}), '
             f'swizzle({a + l + s}u, Swizzle::{codes[m]}));' for a, l, s, m in cases]
    source = tmp_path / "check.cpp"
    source.write_text('#include <cstdio>\n#include "hopper_layout.h"\nusing namespace course_hopper;\n'
                      "int main() {\n" + "\n".join(lines) + "\n}\n")
    subprocess.run([host_compiler(), "-std=c++17", f"-I{native_build.CUDA_DIR}", str(source), "-o", str(tmp_path / "a")],
                   check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "a")], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(out) == len(cases)
    for (a, l, s, m), line in zip(cases, out, strict=True):
        desc = hopper.smem_descriptor(a, leading_bytes=l, stride_bytes=s, mode=m)
        expected = f"{desc} {hopper.swizzle(a + l + s, m)}"
        assert line == expected, (a, l, s, m)


@needs_nvcc
def test_the_wgmma_kernel_compiles_for_sm90a_only():
    results = native_build.compile_check("wgmma_gemm")
    assert {(r.arch, r.kernel) for r in results} == {
        ("sm_90a", f"wgmma_gemm_kernel<{t}, {tma}>") for t in ("__half", "__nv_bfloat16") for tma in ("false", "true")}
    assert all(r.spill_stores == r.spill_loads == 0 and r.registers <= 168 for r in results)
    with pytest.raises(ValueError, match="compiles for 'sm_90a' only"):
        native_build.compile_check("wgmma_gemm", "sm_90")
    with pytest.raises(ValueError, match="only .* are written for it"):
        native_build.compile_check("softmax", "sm_90a")


def test_check_hopper_capability():
    native_build.check_hopper_capability((9, 0))
    for other in ((8, 0), (8, 9), (10, 0), (7, 5)):
        with pytest.raises(RuntimeError, match="need an sm_90 GPU"):
            native_build.check_hopper_capability(other)
    with pytest.raises(TypeError):
        native_build.check_hopper_capability("sm_90")


def test_wgmma_gemm_validates_before_building():
    a = torch.randn(64, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        hopper.wgmma_gemm(a.numpy, a)
    with pytest.raises(ValueError, match="b must have 2 dims"):
        hopper.wgmma_gemm(a, a[None])
    with pytest.raises(TypeError, match="a must be float16 or bfloat16"):
        hopper.wgmma_gemm(a.float(), a)
    with pytest.raises(ValueError, match="multiples of 64"):
        hopper.wgmma_gemm(a[:32], a)
    with pytest.raises(TypeError, match="a is torch.bfloat16 but b is torch.float16"):
        hopper.wgmma_gemm(a, a.half())
    with pytest.raises(ValueError, match="K = 128 but b has K = 64"):
        hopper.wgmma_gemm(a, a[:, :64])
    with pytest.raises(ValueError, match="one CUDA device"):
        hopper.wgmma_gemm(a, a)
    with pytest.raises(ValueError, match="step must be one of"):
        hopper.wgmma_gemm(a, a, step="cp_async")


def test_wgmma_gemm_refuses_more_row_tiles_than_a_grid_has():
    """A row of blocks per 64 rows of a, on the grid's y dimension: at most 65,535 of them."""
    b = torch.empty(64, 64, dtype=torch.float16)
    too_tall = torch.empty(1, 64, dtype=torch.float16).expand(65536 * 64, 64)  # one row's memory
    with pytest.raises(ValueError, match=r"a has 4194304 rows, .*at most 65535 rows \(gridDim.y\)"):
        hopper.wgmma_gemm(too_tall, b)
    with pytest.raises(ValueError, match="one CUDA device"):  # the limit itself: on the CPU, the device error
        hopper.wgmma_gemm(too_tall[:65535 * 64], b)


def _tile_report(out: torch.Tensor, ref: torch.Tensor, tol: float) -> str:
    """Which 64 x 64 tiles of C are wrong, and in the first, which rows and columns: what a learner needs."""
    bad = (out - ref).abs() > tol
    tiles = [(i, j) for i in range(0, out.shape[0], 64) for j in range(0, out.shape[1], 64)
             if bad[i:i + 64, j:j + 64].any()]
    if not tiles:
        return "all tiles match"
    i, j = tiles[0]
    first = bad[i:i + 64, j:j + 64]
    rows = first.any(1).nonzero().flatten().tolist()
    cols = first.any(0).nonzero().flatten().tolist()
    return f"{len(tiles)} wrong tiles, first at rows {i}+, cols {j}+: rows {rows[:16]}, cols {cols[:16]}"


@on_hopper
@pytest.mark.parametrize("step", hopper.GEMM_STEPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (128, 192, 256), (256, 128, 1024)])
def test_wgmma_gemm_matches_float64(step, dtype, m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype)
    out = hopper.wgmma_gemm(a, b, step=step)
    ref = (a.double() @ b.double().T).float()
    tol = 1e-4 * k ** 0.5
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.allclose(out, ref, rtol=0, atol=tol), _tile_report(out, ref, tol)


@on_hopper
@pytest.mark.parametrize("step", hopper.GEMM_STEPS)
def test_wgmma_gemm_copies_what_it_cannot_read(step):
    flat = torch.randn(1 + 128 * 64, device="cuda", dtype=torch.bfloat16)[1:]
    a = flat.view(128, 64)  # contiguous, 2 bytes past a 16-byte boundary
    b = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)[:, 64:128]  # a column slice: not contiguous
    ref = (a.double() @ b.double().T).float()
    torch.testing.assert_close(hopper.wgmma_gemm(a, b, step=step), ref, rtol=0, atol=1e-3)


def test_the_dispatch_names_every_step_of_the_table_in_order():
    """hopper_attention_dispatch.h maps step N to the table's N-th struct, for the launcher and the wrapper alike."""
    from utils.course import flatten

    text = (native_build.CUDA_DIR / "hopper_attention_dispatch.h").read_text()
    named = [int(n) for n in re.findall(r"case (\d+): return f\(StepTag<HopperStep\1\w*>\{\}\);", text)]
    named += [int(n) for n in re.findall(r"default: return f\(StepTag<HopperStep(\d+)\w*>\{\}\);", text)]
    structs = [s.struct for s in flatten.steps("06c")]
    assert [int(re.match(r"HopperStep(\d+)", s).group(1)) for s in structs] == named == list(
        range(1, len(hopper.ATTENTION_STEPS) + 1))
    assert all(f"StepTag<{s}>" in text for s in structs)
    assert f"constexpr int kHopperSteps = {len(hopper.ATTENTION_STEPS)};" in text


# ---- the attention kernel (notebook 06c) -------------------------------------------------------------------------

@needs_nvcc
@pytest.mark.full   # every step of the 06c kernel, compiled for sm_90a
@pytest.mark.long
def test_the_attention_kernel_compiles_without_spills_or_serialized_wgmma():
    results = native_build.compile_check("hopper_attention")
    cases = [(t, d, c) for t in ("__half", "__nv_bfloat16") for d in (64, 128) for c in ("false", "true")]
    # the step is a struct of hopper_attention_steps.cuh: HopperStep15TmaStore for "tma_store"
    structs = [f"course_hopper::HopperStep{n}" + name.title().replace("_", "")
               for n, name in enumerate(hopper.ATTENTION_STEPS, 1)]
    assert {r.kernel for r in results} == (
        {f"hopper_attention_kernel<{t}, {d}, {c}, {s}>" for t, d, c in cases for s in structs[:2]}
        | {f"hopper_attention_ws_kernel<{t}, {d}, {c}, {s}>" for t, d, c in cases for s in structs[2:]})
    step_of = lambda kernel: int(re.search(r"HopperStep(\d+)", kernel).group(1))
    # 128-key tiles on three consumers at D = 64 fill the consumers' 160 registers (setmaxnreg): under the mask
    # ptxas spills a few bytes in steps 18, 19 (06cw section 6), 22, 25 and 26. With the warpgroup index uniform,
    # steps 28 and 30 (step 19's code) do not.
    wide64 = lambda r: ", 64, true, " in r.kernel and step_of(r.kernel) in (18, 19, 22, 25, 26)
    assert all(r.arch == "sm_90a" for r in results)
    # Step 29's vote before the rescale (and that of steps 31, 33 and 35-37, on it) leaves the ragged-edge tile's
    # mask bits packed into registers at D = 64: a few dozen bytes spill in that path (a tile only at the end of a
    # row that is not a multiple of 128 keys).
    lazy64 = lambda r: ", 64, " in r.kernel and step_of(r.kernel) in (29, 31, 33, 35, 36, 37)
    assert [r.kernel for r in results if (r.spill_stores or r.spill_loads) and not (wide64(r) or lazy64(r))] == []
    assert all(r.spill_stores <= 16 and r.spill_loads <= 32 for r in results if wide64(r))
    assert all(r.spill_stores <= 48 and r.spill_loads <= 64 for r in results if lazy64(r))
    # ptxas serialises the wgmmas (each waits for the one before) of three measured steps, and says why (06cw
    # section 6): step 17 under the mask (C7520, a compiler-inserted arrive on a divergent path), and steps 18 and
    # 19 at D = 64, which lack registers (C7512), as do steps 28, 30, 32 and 34 there (step 19's code). No other
    # kernel.
    expected = {r.kernel: "C7520" if step_of(r.kernel) == 17 else "C7512" for r in results
                if (step_of(r.kernel) == 17 and ", true, " in r.kernel)
                or (step_of(r.kernel) in (18, 19, 28, 30, 32, 34) and ", 64, " in r.kernel)}
    assert {r.kernel: r.wgmma_serialized_why[:5] for r in results if r.wgmma_serialized} == expected
    # 384 threads, one block per SM: the compiler's cap is 168, and setmaxnreg moves the producer's to consumers;
    # three consumers at D = 64 (steps 11-15 and from 18; "wide_v_direct" goes back to two): 512 threads, a cap of 128
    three = {*range(hopper.ATTENTION_STEPS.index("three_consumers") + 1, hopper.ATTENTION_STEPS.index("tma_store") + 2),
             *range(18, len(hopper.ATTENTION_STEPS) + 1)}
    assert all(r.registers <= (128 if ", 64, " in r.kernel and step_of(r.kernel) in three else 168)
               for r in results if "_ws_" in r.kernel)
    # Notebook 06c's reading of steps 1-2: blocks of 128 threads whose registers let four fit on an SM at D = 128
    # (at most 128 a thread) and five at D = 64 (at most 96), so shared memory sets step 2's limit at D = 128
    assert all(r.registers <= (128 if ", 128, " in r.kernel else 96)
               for r in results if r.kernel.startswith("hopper_attention_kernel<"))


def test_flash_hopper_validates_before_building():
    q = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        hopper.flash_hopper(q, q, q)
    with pytest.raises(ValueError, match="head_dim 32"):
        hopper.flash_hopper(q[..., :32], q[..., :32], q[..., :32])
    with pytest.raises(TypeError, match="dtype torch.float32"):
        hopper.flash_hopper(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="step must be one of"):
        hopper.flash_hopper(q, q, q, step="fastest")


def test_default_step_is_one_step_per_head_dim_and_names_a_bad_one():
    assert set(hopper.DEFAULT_STEPS) == {64, 128}
    assert all(hopper.default_step(d) in hopper.ATTENTION_STEPS for d in (64, 128))
    for bad in (96, True, "128", [64]):
        with pytest.raises(ValueError, match="head_dim must be one of"):
            hopper.default_step(bad)


def test_flash_hopper_refuses_more_batch_heads_than_its_grid_has():
    """Steps with a row of blocks per (batch, head) (gridDim.y, at most 65,535) refuse more before any build; the
    steps that lay their blocks out in one line (persistent ones, those in head-group order) take them."""
    one_line = {64: ("persistent", "head_groups", "own_diagonal", "one_p_persistent", "one_p_head_groups"),
                128: ("persistent", "head_groups", "own_diagonal", "one_p_head_groups")}
    for d in (64, 128):
        many = torch.empty(1, 1, 1, d, dtype=torch.bfloat16).expand(65536, 1, 1, d)
        for step in hopper.ATTENTION_STEPS:
            expected = ("needs CUDA tensors" if step in one_line[d]
                        else r"batch x heads = 65536 x 1 = 65536 .*at most 65535")
            with pytest.raises(ValueError, match=expected):
                hopper.flash_hopper(many, many, many, step=step)
    with pytest.raises(ValueError, match="at most 65535"):
        hopper.block_timeline(many, many, many)


def test_the_one_line_steps_are_the_tables():
    """ONE_LINE_STEPS is what the steps table says (persistent<D>() or kHeadGroups), step by step and head dim by
    head dim: the wrapper reads the table itself (step_layout), the Python check before it reads this copy."""
    from utils.course import flatten

    table = {s.name: tuple(d for d in (64, 128) if s.value("persistent", d) or s.value("kHeadGroups"))
             for s in flatten.steps("06c")}
    assert {name: dims for name, dims in table.items() if dims} == hopper.ONE_LINE_STEPS


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("step", ["one_p", "one_p_lazy", "one_p_tree", "one_p_desc", "desc_heavy_first", "wait_suspend",
                                  "wide_stages", "wide_lazy", "wide_tree", "wide_desc"])
@pytest.mark.parametrize("d", [64, 128])
def test_a_maximum_that_keeps_growing_is_followed(step, d, causal):
    """Scores that rise along the keys, faster in some rows than others, slower than 2^8 a tile in a few, falling
    in others: the lazy steps (29-31, 33, 34) must rescale O whenever a row of the warp moved its maximum, and
    only then; steps 31 and 32 keep each row's maximum and sum in four partial chains, 33 and 34 step each wgmma
    descriptor by an addition, 36 stops each consumer at its own diagonal and 37 suspends its waits."""
    from functools import partial

    from utils.course.testing import assert_attention_matches_reference

    gen = torch.Generator().manual_seed(d)
    q = torch.randn(1, 2, 512, d, generator=gen) * 0.1
    k = torch.randn(1, 2, 1024, d, generator=gen) * 0.1
    q[..., 0] = torch.linspace(-1.0, 1.0, 512)  # the row's slope along the keys, in both directions
    # at slope 1 a score grows by 0.11 a key: 20 in exp2's units a tile of 128 keys; at slope 0.3, 6
    k[..., 0] = torch.arange(1024) * 0.11 * d ** 0.5
    v = torch.randn(1, 2, 1024, d, generator=gen)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    assert_attention_matches_reference(partial(hopper.flash_hopper, step=step), q, k, v, causal=causal)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("step", hopper.ATTENTION_STEPS)
def test_flash_hopper_matches_reference(step, dtype, causal):
    from functools import partial

    from utils.course.testing import assert_matches_on_odd_shapes

    assert_matches_on_odd_shapes(partial(hopper.flash_hopper, step=step), dtype=dtype, causal=causal)
