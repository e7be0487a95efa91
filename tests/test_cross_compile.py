"""utils.course.cross_compile: launches captured instead of run, compiled for a GPU this machine does not have; and the
course's kernels, as configured for a T4, within its 64 KiB of shared memory per block; and the order of the
Hopper instructions of the forward's and the backward's loops."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from utils.course import cross_compile
from utils.course.cross_compile import LESSONS, check
from utils.tiled.fast.backward import SMALL_SMEM_CONFIGS, Config, pick_config, smem_estimate
from utils.gpu import PROFILES

ROOT = Path(__file__).resolve().parents[1]


def _copy(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = None):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, x * scale, mask=offs < n)


# A JITFunction even here, where conftest set TRITON_INTERPRET=1 (triton.jit would give an interpreted one).
copy_kernel = JITFunction(_copy)


def test_capture_records_launches_instead_of_running_them():
    x, y = torch.ones(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16)
    original = JITFunction.run
    with cross_compile.capture_launches() as launches:
        copy_kernel[(1,)](x, y, 8, 0.5, BLOCK=16, num_warps=2)
        copy_kernel[(1,)](x, y.float(), 1, 2.0, 32)
    assert torch.equal(y, torch.zeros(8, dtype=torch.float16))      # nothing ran
    first, second = launches
    assert first.name == "_copy"
    assert first.signature == {"X": "*fp16", "Y": "*fp16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr",
                               "FLAG": "constexpr"}
    assert first.constexprs == {"BLOCK": 16, "FLAG": None} and first.options == {"num_warps": 2}
    # The integer 1 is a constant, as Triton specialises it; positional constexprs bind like keywords.
    assert second.signature["Y"] == "*fp32" and second.constexprs == {"n": 1, "BLOCK": 32, "FLAG": None}
    assert JITFunction.run is original   # restored
    with pytest.raises(TypeError, match="argument scale: cannot type a str"):
        with cross_compile.capture_launches():
            copy_kernel[(1,)](x, y, 8, "half", BLOCK=16)


SHARED_MEMORY_SCRIPT = """
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction
from utils.course import cross_compile
from utils.course.cross_compile import LESSONS, check

def _copy(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)

x = torch.ones(8)
with cross_compile.capture_launches() as launches:
    JITFunction(_copy)[(1,)](x, x, 8, BLOCK=64)
print(cross_compile.shared_memory(launches[0], (7, 5)), cross_compile.shared_memory(launches[0], (9, 0)))
"""


def test_shared_memory_of_a_compiled_launch(tmp_path):
    """A kernel without tl.dot needs no shared memory on any target; compiling needs no GPU. In a process of its
    own, as the command runs: Triton 3.7's interpreter patches triton.language when a jitted function is called
    outside a launch and does not undo it, and a compile in that process then fails."""
    script = tmp_path / "shared_memory.py"
    script.write_text(SHARED_MEMORY_SCRIPT)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["0", "0"]


def test_backward_tiles_shrink_to_the_gpus_shared_memory(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # the GPU's choices, not the interpreter's
    for d in (16, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for causal in (False, True):
                h200 = pick_config(d, dtype, causal, 227 * 1024)
                assert h200 == pick_config(d, dtype, causal), "an H200 keeps the measured tiles"
                t4 = pick_config(d, dtype, causal, 64 * 1024)
                assert t4 in (h200, *SMALL_SMEM_CONFIGS)
                if (d, dtype) == (256, torch.float32):   # 96 KiB even with 16 x 16 tiles: Triton's launch says
                    assert t4 == SMALL_SMEM_CONFIGS[-1]  # "out of resource: shared memory" on a T4
                    continue
                assert smem_estimate(t4, d, torch.finfo(dtype).bits // 8) <= 64 * 1024, (d, dtype, causal, t4)
    # sm_75's allocation (Triton 3.6): dK/dV 2 bytes x 128 x (2 x 32 + 4 x 64) for these tiles.
    assert smem_estimate(Config(32, 64, 4, 2, 64, 32, 4, 2), 128, 2) == 81920


def test_backward_tiles_a_compile_found_too_big_are_not_picked_again(monkeypatch):
    """The fast backward's fallback when Triton allocates more than smem_estimate says (Triton 3.7 at head dim 128
    on sm_90): the same tiles with one stage fewer come next, then the small ones; the last resort stays."""
    from utils.tiled.fast import backward as fast_bwd

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fast_bwd, "_TOO_BIG", set())
    fast_bwd._fitted_config.cache_clear()
    h200 = 227 * 1024
    preferred = pick_config(128, torch.bfloat16, False, h200)
    assert preferred.stages1 == preferred.stages2 == 3
    assert fast_bwd._drop_if_too_big(preferred, h200)
    fewer = pick_config(128, torch.bfloat16, False, h200)
    assert (fewer.block_m1, fewer.block_n1, fewer.stages1, fewer.stages2) == (preferred.block_m1,
                                                                             preferred.block_n1, 2, 2)
    assert pick_config(128, torch.bfloat16, False, 64 * 1024) == pick_config(128, torch.bfloat16, False, 64 * 1024)
    assert pick_config(128, torch.bfloat16, False), "without smem: the H200's tiles, whatever was dropped"
    assert fast_bwd._drop_if_too_big(fewer, h200)
    assert pick_config(128, torch.bfloat16, False, h200) == SMALL_SMEM_CONFIGS[0]
    assert not fast_bwd._drop_if_too_big(SMALL_SMEM_CONFIGS[-1], h200), "the last resort is never dropped"
    assert not fast_bwd._drop_if_too_big(preferred, None)
    fast_bwd._fitted_config.cache_clear()


def test_lesson_backward_tiles_to_try_when_the_first_are_too_big():
    """The lesson backward's tiles in the order it tries them: pick_config's, the same with one stage fewer
    (where Triton's buffers per stage are what outgrows the GPU), then the small ones that fit."""
    from utils.tiled import backward as lesson_bwd

    h200 = 227 * 1024
    tried = lesson_bwd.candidate_configs(128, torch.bfloat16, h200)
    assert tried[0] == lesson_bwd.pick_config(128, torch.bfloat16, h200) == lesson_bwd.pick_config(128, torch.bfloat16)
    assert tried[1] == tried[0]._replace(stages1=2, stages2=2)
    assert tried[2:] == list(lesson_bwd.SMALL_SMEM_CONFIGS)
    for d in (16, 64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            t4 = lesson_bwd.candidate_configs(d, dtype, 64 * 1024)
            assert len(set(t4)) == len(t4) and t4[-1] == lesson_bwd.SMALL_SMEM_CONFIGS[-1]
            assert all(lesson_bwd.smem_estimate(c, d, dtype.itemsize) <= 64 * 1024 for c in t4) or t4 == [t4[-1]]


T4_KERNELS = {"05": {"flash_fwd_kernel"}, "07": {"_bwd_dkdv", "_bwd_dq"}, "08": {"_split_kv_kernel"},
              "10": {"flex_fwd_kernel"}}


def test_t4_kernels_name_every_lesson_cross_compile_checks():
    assert set(T4_KERNELS) == set(LESSONS)


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
@pytest.mark.full   # every Triton kernel compiled for sm_75: minutes on two cores
@pytest.mark.long
@pytest.mark.parametrize("lesson", LESSONS)   # a run per notebook, so that pytest-xdist shares them out
def test_every_course_kernel_fits_a_t4(lesson):
    """Compiles a notebook's kernels (the forward, backward, decode or flex ones) for sm_75 as configured for a T4.
    Before the backward's tiles shrank, its dQ kernel asked for 160 KiB there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "utils.course.cross_compile", "--profile", "t4", "--lessons", lesson],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"Tesla T4, sm_75: {PROFILES['t4'].shared_memory_per_block // 1024} KiB")
    assert {line.split()[0] for line in lines[1:]} == {lesson}
    assert T4_KERNELS[lesson] <= {line.split()[-4] for line in lines[1:]}
    assert all(line.endswith("fits") for line in lines[1:]) and len(lines) > 4


def test_cross_compile_refuses_lessons_it_does_not_check():
    with pytest.raises(ValueError, match="lessons"):
        check(PROFILES["t4"], ("06",))
    with pytest.raises(ValueError, match="lessons"):
        check(PROFILES["t4"], "05")


H200_BACKWARD_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch
from utils.tiled import backward as lesson
from utils.tiled.fast import backward as fast
q, lse = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 256)
for name, module in (("lesson", lesson), ("fast", fast)):
    preferred = module.pick_config(128, torch.bfloat16)
    for stages in (preferred.stages1, preferred.stages1 - 1):
        config = module.Config(*preferred[:3], stages, *preferred[4:7], stages) if name == "lesson" else \\
            module.Config(**{**vars(preferred), "stages1": stages, "stages2": stages})
        sizes = [compile_launch(launch, (9, 0)).metadata.shared for launch in _capture(
            lambda: module.flash_attention_backward(q, q, q, q, q, lse, causal=True, config=config))[1:]]
        print(name, stages, *sizes, flush=True)
        if max(sizes) <= 227 * 1024:   # these fit: the fallback is not needed
            break
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a check of this machine's Triton compiling for sm_90; on a "
                    "GPU the backward's fallback tests run the kernels themselves")
@pytest.mark.full   # two to four kernels compiled for sm_90: minutes on two cores
@pytest.mark.long
def test_backward_tiles_fit_an_h200_at_most_one_stage_down():
    """Head dim 128, bf16, the H200's tiles: where this Triton asks more than the 227 KiB a block may have (3.7
    does, with a buffer per pipelined loop), the tiles with one stage fewer, which the backwards fall back to
    after Triton's "out of resource", fit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", H200_BACKWARD_PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-2000:]
    tried = {}
    for line in run.stdout.splitlines():
        name, stages, *sizes = line.split()
        assert len(sizes) == 2, line   # dK/dV and dQ
        tried.setdefault(name, []).append(max(map(int, sizes)))
    assert set(tried) == {"lesson", "fast"} and all(1 <= len(t) <= 2 for t in tried.values()), tried
    assert all(sizes[-1] <= 227 * 1024 for sizes in tried.values()), tried


def test_the_command_refuses_interpreted_kernels():
    run = subprocess.run([sys.executable, "-m", "utils.course.cross_compile"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr


def test_schedule_reads_the_order_of_tensor_core_exponential_and_copy_instructions():
    ptx = """
$L__BB0_1:
	mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	ex2.approx.f32 %f2, %f3;
	ex2.approx.f32 %f4, %f5;
	@%p2 cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r3], [%rd4, {%r4}], [%r5];
$L__BB0_2:
	ex2.approx.f32 %f6, %f7;
	ret;
"""
    assert cross_compile.schedule(ptx) == ["tile? wgmma×2 commit wait(1) ex2×2 tma"]
    assert cross_compile.schedule("\tret;") == []


def test_sass_schedule_reads_the_machine_code_in_blocks():
    sass = """Function:kernel
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT;
--:-:-:-:3\tHGMMA.64x64x16.F32.BF16 R88, R148, gdesc[UR8].tnspB, R88, gsb0;
--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x1;
--:-:-:-:5\t@!P0 BRA LBB3;
LBB2:
--:-:0:-:1\tMUFU.EX2 R12, R12;
LBB4:
--:-:-:-:1\tSYNCS.PHASECHK.TRANS64 P0, [UR4+0x8], R3 ;
LBB3:
--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x0;
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT;
        /*9e20*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*9e30*/                   MUFU.EX2 R13, R16 ;                                   /* 0x00000010000d7308 */
        /*9e40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                       /* 0x00008000000079c5 */
"""
    # the last three lines as `cuobjdump -sass` prints them (FlashAttention-4's dump): address, then encoding
    assert cross_compile.sass_schedule(sass) == ["wgmma×2 wait(1)", "ex2", "wait(0) wgmma wait(0) ex2 wait(1)"]


def test_local_memory_counts_spills_in_each_innermost_loop_that_issues_hgmma():
    sass = """Function:kernel
--:-:-:-:1\tSTL [R1+0x4], R2;
LBB1:
--:-:-:-:1\tLDL R3, [R1+0x4];
LBB2:
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT;
--:-:-:-:1\tLDL R5, [R1+0x8];
--:-:-:-:1\tLDL.LU R6, [R1+0xc];
--:-:-:-:1\tSTL [R1+0x8], R5;
--:-:-:-:5\t@P0 BRA LBB2;
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24;
--:-:-:-:5\t@P1 BRA LBB1;
LBB3:
--:-:-:-:1\tLDL R7, [R1+0x10];
--:-:-:-:5\tBRA LBB3;
LBB4:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R88, R148, gdesc[UR8].tnspB, R88, gsb0;
--:-:-:-:5\tBRA LBB4;
--:-:-:-:5\tBRA LBB5;
LBB5:
--:-:-:-:1\tEXIT;
"""
    # LBB1's loop holds LBB2's (not innermost); LBB3's issues no HGMMA; the branch to LBB5 goes forward
    assert cross_compile.local_memory(sass) == [(1, 2), (0, 0)]
    assert cross_compile.local_memory("--:-:-:-:1\tEXIT;") == []


def test_loop_instructions_counts_each_innermost_hgmma_loop_and_its_multiplies():
    sass = """Function:kernel
--:-:-:-:1\tFMUL R2, R2, R3;
LBB1:
--:-:-:-:1\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT;
--:-:-:-:1\tFMUL R5, R24, R4;
--:-:-:-:1\t@P0 FMUL.FTZ R6, R25, R4;
--:-:-:-:1\tFFMA R7, R26, R4, R5;
--:-:-:-:5\t@P0 BRA LBB1;
LBB2:
--:-:-:-:1\tFMUL R8, R8, R4;
--:-:-:-:5\tBRA LBB2;
"""
    # the label is not an instruction; a predicated FMUL is one; FFMA is not a multiply here; LBB2 issues no HGMMA
    assert cross_compile.loop_instructions(sass) == [(5, 2)]


def test_dq_staging_counts_shared_stores_and_reduce_adds_in_each_hgmma_loop():
    sass = """\
LBB1:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT;
--:-:-:-:1\tSTS.128 [R2], R24;
--:-:-:-:1\tSTS [R3], R5;
--:-:-:-:1\tUTMAREDG.2D.ADD [UR8], [UR10];
--:-:-:-:1\tLDS.128 R8, [R2];
--:-:-:-:5\tBRA LBB1;
LBB2:
--:-:-:-:1\tSTS.64 [R2], R24;
--:-:-:-:5\tBRA LBB2;
"""
    # both widths of STS count, a load does not; LBB2 issues no HGMMA
    assert cross_compile.dq_staging(sass) == [(2, 1)]


def test_mask_selects_counts_each_innermost_hgmma_loop_and_its_selects():
    sass = """\
LBB1:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT;
--:-:-:-:1\tISETP.GE.AND P0, PT, R2, R3, PT;
--:-:-:-:1\tFSEL R24, R24, -INF , P0;
--:-:-:-:1\tFSETP.GT.AND P1, PT, R5, RZ, PT;
--:-:-:-:1\tLDL R7, [R1+0x10];
--:-:-:-:5\tBRA LBB1;
LBB2:
--:-:-:-:1\tFSEL R2, R2, RZ, P0;
--:-:-:-:5\tBRA LBB2;
"""
    # FSETP is not a select; LBB2 issues no HGMMA
    assert cross_compile.mask_selects(sass) == [(6, 1, 1)]


def test_read_both_ways_reads_the_printed_counts_back():
    text = """Triton 3.7.1, sm_90: Gluon backward, d=64, bf16, picked tiles; per consumer's tile loop, instructions / FMUL:
  no mask  scale·P:   637 / 64   627 / 64
  causal   P:         1067 / 96   583 / 96   1125 / 96
  causal   two loops: 1036 / 128 / 8   549 / 0 / 9
"""
    assert cross_compile.read_both_ways(text) == {("no mask", "scale·P"): [(637, 64), (627, 64)],
                                                  ("causal", "P"): [(1067, 96), (583, 96), (1125, 96)],
                                                  ("causal", "two loops"): [(1036, 128, 8), (549, 0, 9)]}


@pytest.mark.parametrize("flag,other", [("--scaled-p", "--local-memory"), ("--dq-fragments", "--scaled-p"),
                                        ("--local-memory", "--mask-loop")])
def test_a_both_ways_count_goes_with_the_gluon_backward_alone(flag, other):
    said = f"{flag} goes with --schedule gluon_bwd"
    for args, said in ((["--schedule", "gluon", flag], said),
                       (["--schedule", "gluon_bwd", flag, other], f"{said}, without {other}")):
        run = subprocess.run([sys.executable, "-m", "utils.course.cross_compile", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert run.returncode == 2 and said in run.stderr, (args, run.stderr)


def test_the_gluon_backward_reloads_fewer_spills_at_d64_with_ds_first():
    """Worklog 07w section 5's reading of Config.ds_first: forming dSᵀ before dV's product is issued frees the
    registers the running product would hold, and at head dim 64 the consumers' tile loops (as pick_config
    compiles them) reload fewer spilled values, with and without a mask."""
    lines = cross_compile.in_fresh_process("--schedule", "gluon_bwd", "--local-memory", "--head-dim", "64")
    loops = cross_compile.read_both_ways(lines)
    # each consumer's loop, or (causal: mask_loop) its two
    assert all(len(pairs) == (4 if mask == "causal" else 2) for (mask, _), pairs in loops.items()), lines
    loads = {key: sum(stl_ldl[1] for stl_ldl in pairs) for key, pairs in loops.items()}
    assert set(loads) == {(m, o) for m in ("no mask", "causal") for o in ("dS first", "dV first")}, lines
    assert all(loads[m, "dS first"] < loads[m, "dV first"] for m in ("no mask", "causal")), lines


def test_the_gluon_backwards_mask_loop_leaves_the_mask_out_of_the_other_tiles_loop():
    """Worklog 07w section 5's reading of Config.mask_loop at head dim 64: in the one loop every consumer's loop
    holds the mask's selects (FSEL), behind a branch; with two loops, a loop without a select, shorter than the
    one loop, runs the tiles that need no mask."""
    lines = cross_compile.in_fresh_process("--schedule", "gluon_bwd", "--mask-loop", "--head-dim", "64")
    loops = cross_compile.read_both_ways(lines)
    assert set(loops) == {(m, w) for m in ("no mask", "causal") for w in ("two loops", "one loop")}, lines
    for mask in ("no mask", "causal"):
        one = loops[mask, "one loop"]
        assert len(one) == 2 and all(selects > 0 for _, selects, _ in one), lines
        plain = [n for n, selects, _ in loops[mask, "two loops"] if selects == 0]
        assert plain and max(plain) < min(n for n, _, _ in one), lines


def test_local_memory_goes_with_the_gluon_backward():
    run = subprocess.run([sys.executable, "-m", "utils.course.cross_compile", "--schedule", "gluon", "--local-memory"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 2 and "--local-memory goes with --schedule gluon_bwd" in run.stderr


GLUON_SASS_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch, sass_schedule
from utils.explicit import forward as G, forward_ws as W
for d in (64, 128):
    q, lse = torch.zeros(1, 2, 1024, d, dtype=torch.bfloat16), torch.zeros(1, 2, 1024)
    for causal in (False, True):
        for name, launch in (("gluon", lambda: G._launch(q, q, q, q, lse, causal, 0.1, G.pick_config(d))),
                             ("gluon_ws", lambda: W._launch(q, q, q, q, lse, causal, 0.1, W.pick_config(d)))):
            (captured,) = _capture(launch)
            print(name, d, causal, "|".join(sass_schedule(compile_launch(captured, (9, 0)).asm["sass"])))
"""


@pytest.mark.full   # eight Gluon kernels compiled for sm_90: about a minute on two cores
def test_ptxas_waits_for_p_v_before_the_gluon_loops_exponentials():
    """Worklog 05bw section 6's reading, under the pinned Triton: the PTX of each Gluon forward loop runs the softmax
    after wait(1), but in the machine code the wait(0) for P_{j-1}·V_{j-1} comes first. If a Triton update changes
    this, the worklog's section must change with it."""
    out = cross_compile.script_in_fresh_process(GLUON_SASS_PROBE)
    lines = [line for line in out.splitlines() if line.count("|")]
    assert len(lines) == 8, out
    for line in lines:
        events = re.findall(r"wait\(\d\)|ex2", line.split(" ", 3)[3])
        after_wait1 = [events[i + 1] for i, e in enumerate(events[:-1]) if e == "wait(1)"]
        assert after_wait1 and all(e == "wait(0)" for e in after_wait1), line


def test_schedule_reads_other_kinds_when_asked():
    ptx = """
$L__BB0_1:
	wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
	bar.sync 	0;
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};
	@%p1 atom.global.gpu.relaxed.add.f32 %f9, [%rd9], %f8;
	cp.async.bulk.wait_group.read 	0;
	@%p2 cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.bulk_group [%rd1, {%r1, %r2, %r3, %r4}], [%r5];
"""
    assert cross_compile.schedule(ptx) == ["wgmma"]
    assert cross_compile.schedule(ptx, cross_compile.DQ_EVENTS) == ["wgmma bar mma atomic reduce-wait reduce"]


def test_each_way_of_getting_dq_compiles_to_what_notebook_07_reads():
    """Section 10: at d = 64 the dK/dV pass's added dQ product (32 query rows, under a warpgroup's 64) runs on
    mma.sync; the atomic adds are 16 per thread and tile, the bulk reduce one per tile after a wait and barriers;
    at d = 128 the product is a wgmma. Every product of the loop is waited for at once (wait(0))."""
    for d in (64, 128):
        lines = cross_compile.in_fresh_process("--schedule", "backward_dq", "--head-dim", str(d)).splitlines()[1:]
        loops = {name.strip(): events.split() for name, events in (line.split(":", 1) for line in lines)}
        assert set(loops) == {"dQ pass", "atomic adds", "bulk reduce"}, lines
        assert not any(e.startswith(("mma", "atomic", "reduce")) for e in loops["dQ pass"]), lines
        assert loops["atomic adds"].count("wait(0)") == loops["bulk reduce"].count("wait(0)"), lines
        assert " reduce-wait bar×2 reduce" in " ".join(loops["bulk reduce"]), lines
        assert not any(e.startswith("atomic") for e in loops["bulk reduce"]), lines
        if d == 64:
            assert "mma×32" in loops["atomic adds"] and "atomic×16" in loops["atomic adds"], lines
        else:
            assert not any(e.startswith("mma") for e in loops["atomic adds"]), lines
            assert "atomic×32" in loops["atomic adds"], lines
            assert loops["atomic adds"].count("wait(0)") == loops["dQ pass"].count("wait(0)") + 1, lines


def test_the_forward_waits_for_its_scores_before_the_exponentials_in_both_loop_orders():
    """Notebook 05b, section 5: compiled for sm_90, every loop of the forward, in order or overlapped by one
    tile, waits for all its wgmmas (wait(0)) before the first exponential; the skew buys no overlap."""
    out = cross_compile.in_fresh_process("--schedule", "--head-dim", "64")
    blocks = [[part.strip() for part in line.split(":", 1)] for line in out.splitlines()[1:]]
    assert {name for name, _ in blocks} == {"in order", "overlapped"}
    loops = [events for _, events in blocks if "ex2" in events and "wgmma" in events]
    assert len(loops) >= 4
    for events in loops:
        before = events.split(" ex2")[0].split()
        assert "wait(0)" in before and not any(e.startswith("wgmma") for e in before[before.index("wait(0)"):]), events


def test_exp2_fma_moves_a_share_of_the_unmasked_loops_exponentials_off_mufu():
    """Notebook 05b, section 5: with 1 in 2 (1 in 4) exponentials on the FMA units, the unmasked loop issues
    half (a quarter) fewer ex2 for the tile's 64 scores per thread (the 2 others rescale); the masked loop keeps
    all of them, and the wait before the exponentials stays."""
    out = cross_compile.in_fresh_process("--schedule", "exp2", "--head-dim", "64")
    blocks = [[part.strip() for part in line.split(":", 1)] for line in out.splitlines()[1:]]
    ex2 = {}
    for name, events in blocks:
        assert "wait(0) ex2" in events, events
        ex2.setdefault(name, []).append(int(re.search(r"ex2×(\d+)", events).group(1)))
    assert ex2 == {"MUFU only": [66, 66], "1/2 on FMA": [34, 66], "1/4 on FMA": [50, 66]}


def test_the_backward_keeps_its_accumulating_products_in_flight_only_with_tma():
    """Worklog 07w, section 2: compiled for sm_90, the backward's passes with pointer loads wait for every
    product at once (a wait after each commit); with TMA the accumulating products run on (fewer waits)."""
    out = cross_compile.in_fresh_process("--schedule", "backward", "--head-dim", "64")
    blocks = [[part.strip() for part in line.split(":", 1)] for line in out.splitlines()[1:]]
    assert {name for name, _ in blocks} == {"pointer loads, dkdv", "pointer loads, dq", "TMA, dkdv", "TMA, dq"}
    for name, events in blocks:
        commits, waits = events.split().count("commit"), len(re.findall(r"wait\(0\)", events))
        assert (waits == commits) == name.startswith("pointer"), (name, events)
        assert "wait(0) ex2" in events, f"{name}: the S product is waited for before the exponentials: {events}"
