"""utils.native.backward: the tensor-core backward of notebook 06bw. Its steps, inputs and stored run on any machine;
its gradients against float64 autograd on an sm_80+ GPU (the registry's gradient test covers the default step)."""
import json
import math
import re
from functools import partial

import pytest
import torch

from utils import gpu
from utils.native import build as native_build, kernels as native_kernels, backward as native_backward
from utils.course.bench.backward import CUDA_BACKENDS, ratios
from utils.native.backward import (BWD_DEFAULT_STEP, BWD_STEPS, backward_inputs, flash_mma_attention,
                                 flash_mma_backward, flash_mma_forward)
from utils.course.testing import ODD_SHAPES_64_128, assert_gradients_match_reference, random_qkv

CUDA = torch.cuda.is_available()
MMA_GPU = CUDA and gpu.capability() >= (8, 0)
needs_mma = pytest.mark.skipif(not MMA_GPU, reason="needs an sm_80+ GPU (mma.sync with bf16)")
STEPS_TABLE = (native_build.CUDA_DIR / "flash_mma_bwd_steps.cuh").read_text()
STORED = native_build.ROOT / "images" / "06b_cuda_backward_h200.json"          # steps 1-9
STORED_1012 = native_build.ROOT / "images" / "06b_bwd_steps1012_h200.json"  # steps 10-12 beside step 9
STORED_1315 = native_build.ROOT / "images" / "06b_bwd_steps1315_h200.json"  # steps 13-15 beside step 11
STORED_1619 = native_build.ROOT / "images" / "06b_bwd_steps1619_h200.json"  # steps 16-19 beside step 14


def test_steps_are_the_kernel_structs_in_order():
    """BWD_STEPS[i] is launched as `case i + 1`, and each step's struct derives from one before it."""
    source = native_build.kernel_source("flash_mma_bwd")
    launched = dict(re.findall(r"case (\d+): return launch_flash_mma_bwd<(\w+)>", source))
    structs = [launched[str(i + 1)] for i in range(len(BWD_STEPS))]
    assert len(launched) == len(BWD_STEPS) and CUDA_BACKENDS == tuple(f"cuda_{s}" for s in BWD_STEPS)
    for index, struct in enumerate(structs[1:], start=1):
        parent = re.search(rf"struct {struct} : (\w+) {{", STEPS_TABLE).group(1)
        assert parent in structs[:index], f"step {index + 1} ({struct}) builds on {parent}"
    assert f"step <= {len(BWD_STEPS)}" in source  # the wrapper's check of the step number


def test_backward_inputs_pad_and_mark_rows_without_keys():
    do, o = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    lse = torch.randn(2, 3, 5)
    lse[0, 1, 2] = -math.inf  # a query that saw no key
    lse2, delta = backward_inputs(do, o, lse)
    assert lse2.shape == delta.shape == (6, native_backward.LSE_PAD) and lse2.dtype == delta.dtype == torch.float32
    torch.testing.assert_close(delta[:, :5], (do * o).sum(-1).reshape(6, 5))
    assert lse2[1, 2] == math.inf and torch.isinf(lse2[:, 5:]).all() and (delta[:, 5:] == 0).all()
    torch.testing.assert_close(lse2[0, :5], lse[0, 0] * native_backward.LOG2E)


def test_validation_before_any_build():
    q, k, v = random_qkv(1, 2, 16, 16, 64, dtype=torch.bfloat16)
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="step must be one of"):
        flash_mma_backward(q, q, k, v, o, lse, step="fast")
    with pytest.raises(ValueError, match="step must be one of"):
        flash_mma_attention(q, k, v, step=3)
    with pytest.raises(TypeError, match="dtype torch.float32"):
        flash_mma_backward(q.float(), q.float(), k.float(), v.float(), o.float(), lse)
    with pytest.raises(ValueError, match="head_dim 32"):
        flash_mma_forward(*(t[..., :32] for t in (q, k, v)))
    with pytest.raises(ValueError, match="do has shape"):
        flash_mma_backward(q[:, :1], q, k, v, o, lse)
    if not CUDA:
        with pytest.raises(ValueError, match="cuda"):
            flash_mma_backward(q, q, k, v, o, lse)
    with pytest.raises(TypeError, match="takes float16 or bfloat16"):  # the registry's cuda, fp32 with a gradient
        native_backward.flash_attention_cuda(*(t.float().requires_grad_() for t in (q, k, v)))


def test_more_batch_heads_than_a_grid_has_is_refused_before_any_build():
    """The forward's and the dQ pass's grids have a row per (batch, head), at most 65,535 (gridDim.y)."""
    many = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16).expand(2, 32768, 1, 64)
    lse = torch.empty(1, 1, 1).expand(2, 32768, 1)
    limit = r"batch x heads = 2 x 32768 = 65536 .*at most 65535 rows"
    with pytest.raises(ValueError, match=limit):
        flash_mma_forward(many, many, many)
    with pytest.raises(ValueError, match=limit):
        flash_mma_attention(many, many, many)
    with pytest.raises(ValueError, match=limit):
        flash_mma_backward(many, many, many, many, many, lse)


@pytest.mark.parametrize("path, steps, n_shapes, best", [
    (STORED, BWD_STEPS[:9], 12, "hoisted"), (STORED_1012, BWD_STEPS[8:12], 16, "store_matrix"),
    (STORED_1315, (BWD_STEPS[10], *BWD_STEPS[12:15]), 16, "prepare"),
    (STORED_1619, (BWD_STEPS[13], *BWD_STEPS[15:19]), 16, BWD_DEFAULT_STEP)],
    ids=["steps1-9", "steps9-12", "steps11-15", "steps14-19"])
def test_stored_runs_back_the_default_step(path, steps, n_shapes, best):
    """Each stored H200 run has its steps beside SDPA's FlashAttention-2 and cuDNN backwards on each shape and its
    environment. The best geometric mean of each run is the step the next run starts from; the last run's best is
    the default step."""
    data = json.loads(path.read_text())
    env, rows = data["environment"], data["rows"]
    assert env["gpu"] == "NVIDIA H200" and env["torch"] and env["date"] and env["command"].startswith(
        "python -m utils.course.bench.backward")
    shapes = {(r["seqlen"], r["head_dim"], r["causal"]) for r in rows}
    assert len(shapes) == n_shapes
    backends = [f"cuda_{s}" for s in steps]
    for backend in (*backends, "sdpa_flash", "sdpa_cudnn"):
        assert {(r["seqlen"], r["head_dim"], r["causal"]) for r in rows if r["backend"] == backend
                and r["tflops"]} == shapes, backend
    assert {r["backend"] for r in rows} == {*backends, "sdpa_flash", "sdpa_cudnn"}
    geomean = {b: math.prod(ratios(rows, b).values()) ** (1 / len(shapes)) for b in backends}
    assert max(geomean, key=geomean.get) == f"cuda_{best}", geomean


# ---- on an sm_80+ GPU --------------------------------------------------------------------------------------

@needs_mma
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("step", BWD_STEPS)
def test_every_step_matches_float64_autograd(step, causal, dtype):
    fn = partial(flash_mma_attention, step=step)
    for b, h, hk, nq, nk, d in ODD_SHAPES_64_128:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device="cuda", seed=nq + nk)
        assert_gradients_match_reference(fn, q, k, v, causal=causal)
    q, k, v = random_qkv(1, 2, 300, 300, 64, dtype=dtype, device="cuda")
    assert_gradients_match_reference(fn, q * 20, k, v, causal=causal, sm_scale=0.3)  # scores ~1e3


@needs_mma
def test_forward_is_the_registry_step_and_writes_the_log_sum_exp():
    q, k, v = random_qkv(2, 4, 333, 200, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_mma_forward(q, k, v, causal=True)
    assert torch.equal(o, native_kernels.flash_mma(q, k, v, causal=True))
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-2, -1)) / math.sqrt(128)
    hidden = torch.ones(333, 200, dtype=torch.bool, device="cuda").triu(200 - 333 + 1)
    expected = torch.logsumexp(scores.masked_fill(hidden, -math.inf), -1)
    assert torch.isneginf(lse[:, :, :133]).all()  # queries before the diagonal's start see no key
    torch.testing.assert_close(lse[:, :, 133:].double(), expected[:, :, 133:], atol=1e-3, rtol=1e-4)


@needs_mma
def test_views_at_odd_addresses_and_determinism():
    """Inputs whose rows start off 16 bytes are copied, not faulted on; the dQ pass (step 2) is bitwise
    reproducible, the atomics' order is not."""
    buffer = torch.randn(4 * 2 * 200 * 64 + 1, device="cuda", dtype=torch.float16)
    q, k, v = (buffer[1:].view(4, 2, 200, 64)[i:i + 1] for i in range(3))
    assert q.data_ptr() % 16 != 0
    assert_gradients_match_reference(partial(flash_mma_attention, step="dq_pass"), q, k, v, causal=True)
    do = torch.randn_like(q)
    o, lse = flash_mma_forward(q, k, v)
    first, second = (flash_mma_backward(do, q, k, v, o, lse, step="dq_pass") for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ext = native_build.load("flash_mma_bwd")
    lse2, delta = backward_inputs(do, o, lse)
    with pytest.raises(RuntimeError, match="rows must start on 16 bytes"):
        ext.flash_mma_bwd_backward(do, q, k, v, lse2, delta, False, 0.125, 1)
    with pytest.raises(RuntimeError, match="step must be 1 to"):
        ext.flash_mma_bwd_backward(do, *(t.clone() for t in (q, k, v)), lse2, delta, False, 0.125,
                                  len(BWD_STEPS) + 1)


@needs_mma
@pytest.mark.parametrize("d", [64, 128])
def test_prepare_and_finish_passes_match_torch(d):
    """Steps 14 and 15: the prepare kernel writes backward_inputs' lse2 and delta (rows that see no key and the
    padding included, dO a strided view); the finish kernel scales and casts dQ's accumulator of either row count."""
    ext = native_build.load("flash_mma_bwd")
    q, k, v = random_qkv(2, 3, 333, 200, d, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_mma_forward(q, k, v, causal=True)
    assert torch.isneginf(lse).any()  # causal with fewer keys than queries: the first rows see none
    do = torch.randn(2, 333, 3, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # not contiguous
    lse2, delta = ext.flash_mma_bwd_prepare(do, o, lse)
    expected_lse2, expected_delta = backward_inputs(do, o, lse)
    assert lse2.shape == expected_lse2.shape == (6, 384)
    bad = (lse2 != expected_lse2).nonzero()[:, 1].unique().tolist()  # query rows
    assert torch.allclose(lse2, expected_lse2, rtol=1e-6, atol=0, equal_nan=False), f"lse2 differs at queries {bad}"
    torch.testing.assert_close(delta, expected_delta, rtol=1e-5, atol=1e-5)
    for rows in (333, 384):
        accum = torch.randn(2, 3, rows, d, device="cuda")
        torch.testing.assert_close(ext.flash_mma_bwd_finish(accum, q, 0.125),
                                   (accum[:, :, :333] * 0.125).to(torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="accum must be contiguous fp32"):
        ext.flash_mma_bwd_finish(torch.zeros(2, 3, 300, d, device="cuda"), q, 0.125)
    with pytest.raises(RuntimeError, match="lse must be contiguous fp32"):
        ext.flash_mma_bwd_prepare(do, o, lse[:, :, :100])
