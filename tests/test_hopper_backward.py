"""utils.native.hopper_backward.flash_hopper_backward: the backward on wgmma and TMA (utils/native/src/hopper_backward.cu), and
the forward's log-sum-exp it starts from. Validation on any machine, the compile for sm_90a where nvcc is, and on an
sm_90 GPU the log-sum-exp of every forward step and the gradients against float64 autograd."""
import math

import pytest
import torch

from utils import gpu
from utils.course.testing import (ODD_SHAPES_64_128, assert_gradients_close, assert_gradients_match_reference,
                                  random_qkv, reference_gradients)
from utils.native import build as native_build
from utils.native.build import find_nvcc
from utils.native.hopper import ATTENTION_STEPS, flash_hopper, flash_hopper_forward
from utils.native.hopper_backward import (BWD_DEFAULT_STEPS, BWD_STEPS, bwd_default_step, flash_hopper_attention,
                                          flash_hopper_backward)

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")


def forward_with_lse(q, k, v, *, causal, sm_scale=None):
    """(o, lse) in float64, o cast to q's dtype: lse natural-log fp32 (B, H, Nq), -inf where a row sees no key."""
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-2, -1) * (sm_scale or 1 / math.sqrt(d))
    if causal:  # bottom-right: key j hidden from query i when j > i + nk - nq
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no key: all 0
    return (p @ vv).to(q.dtype), lse.float()


def test_inputs_are_validated_before_any_gpu_work():
    q, k, v = random_qkv(1, 2, 16, 16, 64, dtype=torch.float16, device="cpu")
    o, lse = forward_with_lse(q, k, v, causal=False)
    with pytest.raises(ValueError, match="cuda"):
        flash_hopper_backward(torch.randn_like(q), q, k, v, o, lse)
    with pytest.raises(TypeError, match="float16 or bfloat16|dtype"):
        flash_hopper_backward(*(t.float() for t in (q, q, k, v, o)), lse)
    with pytest.raises(ValueError, match="head_dim|head dim"):
        q96 = torch.randn(1, 2, 16, 96, dtype=torch.float16)
        flash_hopper_backward(q96, q96, q96, q96, q96, lse)
    with pytest.raises(ValueError, match="do has shape"):
        flash_hopper_backward(q[:, :1], q, k, v, o, lse)
    for bad in ("atomic", 1, True):
        with pytest.raises(ValueError, match="step must be one of"):
            flash_hopper_backward(torch.randn_like(q), q, k, v, o, lse, step=bad)


def test_each_head_dim_has_a_default_step_of_the_kernel():
    assert set(BWD_DEFAULT_STEPS) == {64, 128} and set(BWD_DEFAULT_STEPS.values()) <= set(BWD_STEPS)
    assert [bwd_default_step(d) for d in (64, 128)] == [BWD_DEFAULT_STEPS[64], BWD_DEFAULT_STEPS[128]]
    for bad in (96, True, "64", None, [64]):
        with pytest.raises(ValueError, match="head_dim must be one of"):
            bwd_default_step(bad)


@needs_nvcc
def test_the_backward_compiles_for_sm_90a_with_wgmma_in_flight():
    """A kernel for each of fp16, bf16; D = 64, 128; causal or not; each step of BWD_STEPS, wgmma serialised in one
    step only, 06bw's prepare and finish passes and frag_dq's finish pass. At D = 64 the consumers hold Sᵀ, dPᵀ
    (64 registers each), Pᵀ's fragments, dV and dK at once: ptxas spills a few loop invariants; "dv_late", which
    packs Pᵀ after dSᵀ, does not, nor "late_prefetch" on it, nor "rows80" (at D = 128: Sᵀ, dPᵀ and dQᵀ of 80
    queries, 40 registers each), nor "late_dq_first", "frag_dq", "early_lse", "dq_writer", "stagger" or "rows64";
    "frag_dq_first" spills one address at D = 64 without the mask (4 bytes, reloaded once a tile)."""
    results = native_build.compile_check("hopper_backward")
    types = ("__half", "__nv_bfloat16")
    assert {r.kernel for r in results} == (
        {f"hopper_backward_kernel<{t}, {d}, {c}, {s}>" for t in types for d in (64, 128) for c in ("false", "true")
         for s in range(len(BWD_STEPS))}
        | {f"flash_bwd_{p}_kernel<{t}, {d}>" for p in ("prepare", "finish") for t in types for d in (64, 128)}
        | {f"hopper_bwd_finish_fragments_kernel<{t}, {d}>" for t in types for d in (64, 128)})
    results = [r for r in results if r.kernel.startswith("hopper_backward_kernel")]
    assert all(r.arch == "sm_90a" and r.registers <= 168 for r in results)  # 384 threads: setmaxnreg moves the rest
    # ptxas serialises the wgmmas of one measured step, "prefetch_s", and says why (06cw section 7): an ordinary
    # instruction writes a wgmma's accumulator inside the pipeline (C7515). No other step: not "late_prefetch".
    prefetch = f", {BWD_STEPS.index('prefetch_s')}>"
    assert {r.kernel: r.wgmma_serialized_why[:5] for r in results if r.wgmma_serialized} == {
        r.kernel: "C7515" for r in results if r.kernel.endswith(prefetch)}
    assert all(max(r.spill_stores, r.spill_loads) == 0 for r in results if ", 128, " in r.kernel)
    # steps 1-4 stage dQ in shared memory with all three accumulators live: a few more at D = 64
    assert all(max(r.spill_stores, r.spill_loads) <= (48 if r.kernel.endswith(", 0>") else 72) for r in results)
    late = tuple(f", {BWD_STEPS.index(s)}>" for s in ("dv_late", "late_prefetch", "late_group", "rows80",
                                                        "rows80_group", "late_dq_first", "frag_dq",
                                                        "early_lse", "dq_writer", "stagger", "rows64"))
    assert [r.kernel for r in results if r.kernel.endswith(late) and (r.spill_stores or r.spill_loads)] == []
    fa4_order = [r for r in results if r.kernel.endswith(f", {BWD_STEPS.index('frag_dq_first')}>")]
    assert all(max(r.spill_stores, r.spill_loads) <= (4 if ", 64, false," in r.kernel else 0) for r in fa4_order)


FRAGMENT_CHECK = r"""
#include "hopper_backward_kernel.cuh"
#include <cstdio>
using namespace course_hopper;
// Every register of both consumers' dQ accumulators, as wgmma lays them out, staged at dq_frag_float and read back
// by dq_frag_place: the same row and column, and each of the tile's BM x D places exactly once.
template <int D> int check() {
  constexpr int BM = D == 64 ? 128 : 80, kRun = BM * D / 2, kRegs = D == 64 ? 32 : 40;
  static int seen[128 * 128];
  int bad = 0;
  for (int W = 0; W < 2; ++W)
    for (int wtid = 0; wtid < 128; ++wtid)
      for (int r = 0; r < kRegs; ++r) {
        const int j = r / 4, h = r % 4 / 2, e = r % 2;
        const int m = 16 * (wtid / 32) + wtid % 32 / 4 + 8 * h, n = 8 * j + 2 * (wtid % 4) + e;
        const int row = D == 64 ? 64 * W + m : n, col = D == 64 ? n : 64 * W + m;  // dQ (D 64) or dQT (D 128)
        const int f = W * kRun + dq_frag_float(j, wtid, h, e);
        const DqPlace at = dq_frag_place<D>(f);
        if (f < 0 || f >= BM * D || at.row != row || at.col != col) ++bad;
        else ++seen[row * D + col];
      }
  for (int i = 0; i < BM * D; ++i) bad += seen[i] != 1, seen[i] = 0;
  std::printf("D = %d: %d misplaced\n", D, bad);
  return bad;
}
int main() { return check<64>() + check<128>() ? 1 : 0; }
"""


@needs_nvcc
def test_frag_dq_reads_back_each_dq_value_where_it_belongs(tmp_path):
    """Step frag_dq stages dQ in register order (dq_frag_float) and its finish pass puts it back (dq_frag_place):
    checked on the host for both head dims, as a program nvcc builds from the kernel's header."""
    import subprocess

    source = tmp_path / "frag_check.cu"
    source.write_text(FRAGMENT_CHECK)
    exe = tmp_path / "frag_check"
    build = subprocess.run([find_nvcc(), "-std=c++17", f"-I{native_build.CUDA_DIR}", str(source), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == "D = 64: 0 misplaced D = 128: 0 misplaced".split(), run.stdout


@on_hopper
@pytest.mark.parametrize("step", BWD_STEPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64_autograd(causal, dtype, step):
    for b, h, hk, nq, nk, d in ODD_SHAPES_64_128:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device="cuda", seed=nq + nk)
        do = torch.randn(q.shape, generator=torch.Generator().manual_seed(nq)).to("cuda", dtype)
        o, lse = forward_with_lse(q, k, v, causal=causal)
        grads = flash_hopper_backward(do, q, k, v, o, lse, causal=causal, step=step)
        assert [g.dtype for g in grads] == [dtype] * 3
        assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), dtype)


@on_hopper
@pytest.mark.parametrize("step", BWD_STEPS)
def test_large_scores_and_a_scale_of_its_own(step):
    q, k, v = random_qkv(1, 2, 300, 300, 64, dtype=torch.bfloat16, device="cuda")
    q = q * 20  # scores ~1e3
    do = torch.randn_like(q)
    o, lse = forward_with_lse(q, k, v, causal=True, sm_scale=0.3)
    grads = flash_hopper_backward(do, q, k, v, o, lse, causal=True, sm_scale=0.3, step=step)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True, sm_scale=0.3), torch.bfloat16)


@on_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("step", ATTENTION_STEPS)
def test_every_forward_step_writes_the_log_sum_exp(step, d):
    """Rows before the causal diagonal's start see no key: -inf; O is the same as without the log-sum-exp."""
    q, k, v = random_qkv(2, 4, 333, 200, d, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_hopper_forward(q, k, v, causal=True, step=step)
    assert torch.equal(o, flash_hopper(q, k, v, causal=True, step=step))
    _, expected = forward_with_lse(q, k, v, causal=True)
    assert lse.shape == (2, 4, 333) and lse.dtype == torch.float32
    assert torch.isneginf(lse[:, :, :133]).all()
    torch.testing.assert_close(lse[:, :, 133:], expected[:, :, 133:], atol=1e-3, rtol=1e-4)


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_the_registry_entry_differentiates_through_both_kernels(causal):
    for b, h, hk, nq, nk, d in ODD_SHAPES_64_128[2:5]:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=torch.float16, device="cuda", seed=d)
        assert_gradients_match_reference(flash_hopper_attention, q, k, v, causal=causal)
    q, k, v = random_qkv(1, 2, 64, 64, 64, dtype=torch.float16, device="cuda")
    assert torch.equal(flash_hopper_attention(q, k, v), flash_hopper(q, k, v))  # no grad asked: no log-sum-exp


@on_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_staggered_walks_reach_every_query_block_of_every_head_of_the_group(d):
    """Step stagger starts key block x's walk of each head at query block x mod their number, wraps past the last
    and goes on to the group's next head: 7 key blocks over 4 (D = 64) or 7 (D = 128) query blocks, three query
    heads a K/V head, each head's gradients checked on its own."""
    q, k, v = random_qkv(2, 6, 500, 900, d, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=d)
    do = torch.randn_like(q)
    o, lse = forward_with_lse(q, k, v, causal=False)
    grads = flash_hopper_backward(do, q, k, v, o, lse, step="stagger")
    expected = reference_gradients(q, k, v, do, causal=False)
    for b in range(2):
        for h in range(6):  # dk and dv per K/V head: checked with head h's group
            try:
                assert_gradients_close([grads[0][b, h], *(g[b, h // 3] for g in grads[1:])],
                                       [expected[0][b, h], *(e[b, h // 3] for e in expected[1:])], torch.bfloat16)
            except AssertionError as e:
                raise AssertionError(f"batch {b}, head {h}: {e}") from None


@on_hopper
def test_reduce_dq_leaves_no_row_past_the_end():
    """TMA clips the dQ boxes at the tensor's edge: with Nq = 65 the 64-row boxes of the last query block must not
    add into the next head's rows (each head's dQ checked on its own)."""
    q, k, v = random_qkv(2, 3, 65, 130, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    do = torch.randn_like(q)
    o, lse = forward_with_lse(q, k, v, causal=False)
    grads = flash_hopper_backward(do, q, k, v, o, lse, step="reduce_dq")
    expected = reference_gradients(q, k, v, do, causal=False)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(grads[0][b, h].float(), expected[0][b, h].float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m, b=b, h=h: f"dq of batch {b}, head {h}: {m}")


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("step", ["rows80", "rows80_group", "late_dq_first", "frag_dq", "early_lse",
                                  "dq_writer", "stagger", "frag_dq_first"])
def test_rows80_tiles_end_inside_each_head(causal, step):
    """Step rows80 takes 80 queries a tile at D = 128, and lse2 and delta are padded to 640 rows for it: Nq = 85
    leaves a last tile of 5 rows, whose dQ boxes TMA clips at the head's end, and Nq = 700 one past a whole 640
    (each head's dQ checked on its own)."""
    for nq in (85, 700):
        q, k, v = random_qkv(2, 3, nq, 130, 128, dtype=torch.bfloat16, device="cuda", seed=nq)
        do = torch.randn_like(q)
        o, lse = forward_with_lse(q, k, v, causal=causal)
        grads = flash_hopper_backward(do, q, k, v, o, lse, causal=causal, step=step)
        expected = reference_gradients(q, k, v, do, causal=causal)
        for b in range(2):
            for h in range(3):
                try:
                    assert_gradients_close([g[b, h] for g in grads], [e[b, h] for e in expected], torch.bfloat16)
                except AssertionError as e:
                    raise AssertionError(f"Nq = {nq}, batch {b}, head {h}: {e}") from None
