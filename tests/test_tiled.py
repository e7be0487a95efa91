"""The teaching kernels of utils/tiled (notebooks 05 and 07) against the float64 reference, in the interpreter on
a CPU; and a check that they stay single-path: no switches, no caches."""
import inspect
import math

import pytest
import torch

from utils.eager.reference import reference_attention
from utils.course.testing import (assert_close, assert_gradients_close, assert_gradients_match_reference, random_qkv,
                           reference_gradients, reference_lse)
from utils.tiled import attention, backward, forward
from utils.tiled.attention import flash_attention
from utils.tiled.backward import flash_attention_backward
from utils.tiled.forward import flash_attention_forward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL = forward.Config(16, 16, 4, 1)                        # several key blocks on small shapes: both loops run
SMALL_BWD = backward.Config(16, 16, 4, 1, 16, 16, 4, 1)
# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim): GQA with Nq < Nk and a padded head dim (80); MQA with
# Nq > Nk (causal rows that see no key); lengths off every block size.
SHAPES = [(1, 2, 1, 21, 50, 80), (2, 2, 1, 45, 19, 32)]


def qkv(shape, dtype=torch.float32, seed=0):
    b, h, hk, nq, nk, d = shape
    return random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=seed)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(shape, causal):
    q, k, v = qkv(shape)
    o, lse = flash_attention_forward(q, k, v, causal=causal, config=SMALL)
    assert_close(o, reference_attention(q, k, v, causal=causal))
    expected = reference_lse(q, k, causal=causal)
    torch.testing.assert_close(lse.double(), expected, atol=1e-4, rtol=1e-4)
    unseen = torch.isneginf(expected)   # causal, Nq > Nk: the first Nq - Nk queries see no key
    assert unseen.any() == (causal and shape[3] > shape[4])
    assert (o[unseen] == 0).all() and torch.isneginf(lse[unseen]).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_reference(shape, causal):
    q, k, v = qkv(shape)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, config=SMALL_BWD)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), torch.float32)


def test_autograd_and_custom_scale():
    q, k, v = qkv((1, 4, 2, 30, 40, 64))
    assert_gradients_match_reference(flash_attention, q, k, v, causal=True, sm_scale=0.3)
    o, lse = flash_attention(q, k, v, sm_scale=0.3, return_lse=True)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, sm_scale=0.3), atol=1e-4, rtol=1e-4)


def test_non_contiguous_inputs():
    """Views of a (batch, seq, heads, head_dim) buffer and a stride-0 batch run as they are, forward and back."""
    q, k, v = qkv((1, 2, 1, 24, 37, 32))
    views = [t.transpose(1, 2).contiguous().transpose(1, 2).expand(2, -1, -1, -1) for t in (q, k, v)]
    assert not any(t.is_contiguous() for t in views)
    assert_close(flash_attention(*views, causal=True), reference_attention(*views, causal=True))
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert_gradients_match_reference(flash_attention, q, k, v, causal=True)


@pytest.mark.skipif(CUDA, reason="the CPU (interpreter) path for bf16")
def test_bf16_on_cpu_is_computed_in_fp32():
    q, k, v = qkv((1, 2, 2, 20, 28, 32), dtype=torch.bfloat16)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    o32, lse32 = flash_attention_forward(q.float(), k.float(), v.float(), causal=True)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    do = torch.randn_like(q)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=True)
    grads32 = flash_attention_backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal=True)
    for g, g32 in zip(grads, grads32):
        assert g.dtype == torch.bfloat16 and torch.equal(g, g32.to(torch.bfloat16))


def test_fp16_forward():
    q, k, v = qkv((1, 2, 2, 33, 33, 64), dtype=torch.float16)
    assert_close(flash_attention(q, k, v, causal=True), reference_attention(q, k, v, causal=True))


def test_bad_arguments_raise_errors_naming_them():
    q, k, v = qkv((1, 2, 2, 8, 8, 32))
    cases = [
        (lambda: flash_attention(q[..., :8], k[..., :8], v[..., :8]), ValueError, "head_dim 8 is not supported"),
        (lambda: flash_attention(q.double(), k.double(), v.double()), TypeError, "q has dtype torch.float64"),
        (lambda: flash_attention(q, k, v, causal=1), TypeError, "causal must be a bool"),
        (lambda: flash_attention(q, k, v, sm_scale=-1.0), ValueError, "sm_scale must be finite and positive"),
        (lambda: flash_attention(q, k, v, return_lse="yes"), TypeError, "return_lse must be a bool"),
        (lambda: flash_attention_forward(q, k, v, config=(16, 16, 4, 1)), TypeError, "config must be a"),
        (lambda: flash_attention_forward(q, k, v, config=forward.Config(24, 16, 4, 1)), ValueError,
         "config.block_m must be a power of two"),
        (lambda: flash_attention_forward(q, k, v, config=forward.Config(16, 16, 0, 1)), ValueError,
         "config.num_warps must be positive"),
        (lambda: flash_attention_backward(q, q, k, v, q, torch.zeros(1, 2, 9, device=q.device)), ValueError, "lse must have shape"),
        (lambda: flash_attention_backward(q, q, k, v, q[:, :1], torch.zeros(1, 2, 8, device=q.device)), ValueError, "o has shape"),
        (lambda: flash_attention_backward(q, q, k, v, q, torch.zeros(1, 2, 8, device=q.device), config=SMALL), TypeError,
         "config must be a utils.tiled.backward.Config"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def _constexprs(kernel) -> set:
    """The names of a @triton.jit function's compile-time (tl.constexpr) parameters."""
    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


def test_the_teaching_kernels_have_no_switches():
    """Compile-time parameters are the tile sizes, the head dim, causal, precision and (inside the loops) the
    masked/unmasked copy: nothing that picks another path (TMA, overlap, atomics, statistics)."""
    shape = {"HEAD_DIM", "BLOCK_D", "CAUSAL"}
    assert _constexprs(forward.flash_fwd_kernel) == shape | {"BLOCK_M", "BLOCK_N", "DOT_PRECISION"}
    assert _constexprs(forward._attend_blocks) == shape | {"BLOCK_N", "MASKED", "DOT_PRECISION"}
    kernels = {"GROUP", "CAUSAL", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "BLOCK_D", "PRECISION", "ACC"}
    assert _constexprs(backward._bwd_dkdv) == _constexprs(backward._bwd_dq) == kernels
    assert _constexprs(backward._dkdv_inner) == {"BLOCK_M", "MASKED", "PRECISION"}
    assert _constexprs(backward._dq_inner) == {"BLOCK_N", "MASKED", "CAUSAL", "PRECISION"}
    assert _constexprs(backward._bwd_preprocess) == {"BLOCK_M", "BLOCK_D", "ACC"}
    for kernel in (forward.flash_fwd_kernel, backward._bwd_dkdv, backward._bwd_dq):
        assert not getattr(kernel, "do_not_specialize", ()), kernel


def test_the_teaching_modules_keep_no_state():
    """No module-level caches: no dicts, lists or sets, no lru_cache'd functions, no launchers kept between calls."""
    for module in (forward, backward, attention):
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            assert not isinstance(value, (dict, list, set)), f"{module.__name__}.{name}"
            assert not hasattr(value, "cache_info"), f"{module.__name__}.{name} is cached"
            assert "Launcher" not in type(value).__name__, f"{module.__name__}.{name}"


@pytest.mark.parametrize("module", [forward, backward])
def test_pick_config_fits_the_shared_memory_it_is_given(module):
    for d in (32, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.float32):
            preferred = module.pick_config(d, dtype)
            assert module.pick_config(d, dtype, 10 ** 6) == preferred
            for smem in (48 * 1024, 64 * 1024, 99 * 1024):   # older GPUs' shared memory per block
                config = module.pick_config(d, dtype, smem)
                fits = module.smem_estimate(config, d, dtype.itemsize) <= smem
                smallest = config == (module.SMALL_SMEM_TILES if module is forward else module.SMALL_SMEM_CONFIGS)[-1]
                assert fits or smallest, (d, dtype, smem, config)


def test_first_that_launches_tries_the_next_tiles_only_after_out_of_resource(refusing):
    from triton.runtime.errors import OutOfResources

    tried = []
    launch = refusing("a", tried, lambda tiles: f"ran with {tiles}")
    assert forward.first_that_launches(launch, ["a", "c", "d"]) == "ran with c" and tried == ["a", "c"]
    assert forward.first_that_launches(launch, ["c"]) == "ran with c"
    with pytest.raises(OutOfResources):   # nothing left: the last one's error
        forward.first_that_launches(launch, ["a", "a"])

    def broken(tiles):
        raise ValueError("not a shared-memory problem")

    with pytest.raises(ValueError, match="not a shared-memory"):   # other errors are not retried
        forward.first_that_launches(broken, ["a", "b"])


@pytest.mark.parametrize("module, candidates", [(forward, "candidate_tiles"), (backward, "candidate_configs")])
def test_the_tiles_tried_start_with_pick_config_and_one_stage_fewer(module, candidates):
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float32):
            for smem in (64 * 1024, 99 * 1024, 163 * 1024, 227 * 1024):
                tried = getattr(module, candidates)(d, dtype, smem)
                assert tried[0] == module.pick_config(d, dtype, smem) and len(set(tried)) == len(tried)
                assert all(module.smem_estimate(c, d, dtype.itemsize) <= smem for c in tried) or len(tried) == 1
    h200 = forward.candidate_tiles(128, torch.bfloat16, 227 * 1024)
    assert h200[:2] == [forward.H200_TILES, forward.H200_TILES._replace(num_stages=2)]


@pytest.mark.gpu
def test_forward_tries_the_next_tiles_where_triton_refuses_the_first(monkeypatch, refusing):
    """Triton's "out of resource: shared memory" for the first tiles (made to happen here, as a GPU with less
    shared memory or another Triton gives it), then the next ones."""
    too_big, fits = forward.Config(128, 64, 8, 3), forward.Config(64, 32, 4, 2)
    tried = []
    monkeypatch.setattr(forward, "candidate_tiles", lambda d, dtype, smem=None: [too_big, fits])
    monkeypatch.setattr(forward, "check_config", refusing(too_big, tried, lambda config, kind=None: config))
    q, k, v = random_qkv(1, 4, 300, 300, 128, kv_heads=2, dtype=torch.bfloat16, device=DEVICE, seed=2)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    assert tried == [too_big, fits]
    assert_close(o, reference_attention(q, k, v, causal=True), dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 16, 4, 2048, 2048, 128), (1, 8, 8, 1000, 1777, 64), (1, 4, 1, 517, 1024, 80)])
def test_large_shapes_on_gpu(dtype, shape):
    q, k, v = qkv(shape, dtype=dtype)
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        assert_close(out, reference_attention(q, k, v, causal=causal))
        expected = reference_lse(q, k, causal=causal, sm_scale=1 / math.sqrt(shape[-1]))
        finite = torch.isfinite(expected)
        torch.testing.assert_close(lse[finite].double(), expected[finite], atol=2e-3, rtol=2e-3)
    if dtype != torch.float32 and shape[3] <= 1024:   # the float64 reference gradients of the largest shape are slow
        assert_gradients_match_reference(flash_attention, q, k, v, causal=True)
