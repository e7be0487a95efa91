"""The backward pass (notebook 07): formulas, the tiled PyTorch backward and the Triton kernels against autograd.

On a CPU the Triton kernels run in the interpreter on small shapes; on a GPU larger shapes and fp16/bf16 join.
"""
import functools
import math

import pytest
import torch

from utils.eager.backward import (FlashAttentionPyTorch, KernelPair, attention_gradients, flash_attention_pytorch,
                                          flash_backward_pytorch, saved_tensor_bytes, wants_grad)
from utils.eager.forward import flash2_attention
from utils.eager.reference import naive_attention, reference_attention
from utils.course.testing import (ATTENTION_SHAPES, assert_gradients_close, assert_gradients_match_reference,
                                  misaligned, pairwise, random_qkv, reference_gradients)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

SHAPES = list(ATTENTION_SHAPES)  # the registry's shapes (utils.course.testing); larger ones on a GPU
if CUDA:
    SHAPES += [(2, 8, 2, 1000, 1000, 64), (1, 4, 4, 300, 1100, 128), (1, 4, 1, 1100, 300, 64),
               (2, 4, 4, 1024, 1024, 128), (1, 2, 2, 200, 200, 256)]


def ids(shape):
    return "x".join(map(str, shape))


def forward_lse(q, k, v, causal, sm_scale=None):
    """(o, lse) in float64 by the formula: the saved state a forward kernel hands to the backward."""
    o = reference_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    scale = sm_scale or 1 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    s = scale * q.double() @ k.double().repeat_interleave(group, 1).transpose(-2, -1)
    if causal:
        from utils.eager.reference import causal_mask
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    return o, torch.logsumexp(s, dim=-1)


# --- the formulas --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:6], ids=ids)
def test_formulas_match_autograd(shape, causal):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=torch.float64, seed=1)
    do = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o, lse = forward_lse(q, k, v, causal)
    grads = attention_gradients(do, q, k, v, o, lse, causal=causal)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), torch.float64)


def test_rows_without_keys_get_zero_gradients():
    q, k, v = random_qkv(1, 2, 9, 4, 16, dtype=torch.float64)   # causal, Nq > Nk: rows 0..4 see no key
    do = torch.randn_like(q)
    o, lse = forward_lse(q, k, v, True)
    assert torch.isneginf(lse[:, :, :5]).all()
    for fn in (attention_gradients, flash_backward_pytorch):
        dq, dk, dv = fn(do, q, k, v, o, lse, causal=True)
        assert torch.isfinite(dq).all() and (dq[:, :, :5] == 0).all()
        assert_gradients_close((dq, dk, dv), reference_gradients(q, k, v, do, causal=True), torch.float64)


# --- the tiled PyTorch backward ------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (64, 7)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:6], ids=ids)
def test_tiled_pytorch_backward(shape, causal, blocks):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=torch.float64, seed=3)
    do = torch.randn_like(q)
    o, lse = flash2_attention(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1], return_lse=True)
    o_ref, lse_ref = forward_lse(q, k, v, causal)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    grads = flash_backward_pytorch(do, q, k, v, o, lse, causal=causal, block_q=blocks[0], block_k=blocks[1])
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiled_pytorch_low_precision(dtype):
    q, k, v = random_qkv(1, 4, 50, 70, 32, kv_heads=2, dtype=dtype)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = flash_attention_pytorch(*(t.requires_grad_() for t in (q, k, v)), causal=True, sm_scale=0.3)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert all(g.dtype == dtype for g in grads)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True, sm_scale=0.3), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_pytorch_gradcheck(causal):
    q, k, v = random_qkv(1, 2, 6, 5, 4, kv_heads=1, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention_pytorch(q, k, v, causal=causal, block_q=4, block_k=2), (q, k, v))


def test_tiled_backward_saves_no_score_matrix():
    q, k, v = random_qkv(1, 2, 256, 256, 32)
    q.requires_grad_()
    naive = saved_tensor_bytes(naive_attention, q, k, v, causal=True)
    tiled = saved_tensor_bytes(flash_attention_pytorch, q, k, v, causal=True)
    # Tiled: o (B·H·N·D floats) and lse (B·H·N): O(N·D). Naive: at least one B·H·N·N matrix.
    assert tiled == (2 * 256 * 32 + 2 * 256) * 4
    assert naive >= 2 * 256 * 256 * 4 > 4 * tiled


def test_saved_tensor_bytes_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        saved_tensor_bytes(42)


def test_pytorch_backward_validates_inputs():
    q, k, v = random_qkv(1, 2, 8, 8, 16)
    o, lse = flash2_attention(q, k, v, return_lse=True)
    do = torch.randn_like(q)
    with pytest.raises(ValueError, match="do has shape"):
        flash_backward_pytorch(do[:, :1], q, k, v, o, lse)
    with pytest.raises(TypeError, match="o has dtype"):
        flash_backward_pytorch(do, q, k, v, o.double(), lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_backward_pytorch(do, q, k, v, o, lse[..., :3])
    with pytest.raises(TypeError, match="lse must be a floating"):
        flash_backward_pytorch(do, q, k, v, o, lse.long())
    with pytest.raises(TypeError, match="block_q must be an int"):
        flash_backward_pytorch(do, q, k, v, o, lse, block_q=1.5)
    with pytest.raises(ValueError, match="block_k must be positive"):
        flash_attention_pytorch(q, k, v, block_k=0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention_gradients(do, q, k, v, o, lse, causal=1)
    with pytest.raises(ValueError, match="sm_scale"):
        flash_backward_pytorch(do, q, k, v, o, lse, sm_scale=-1.0)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_pair_joins_a_forward_and_its_backward(causal):
    """KernelPair (the Gluon and Hopper registry entries' autograd) with the PyTorch tiled pair: its gradients are
    the reference's, GQA and Nq != Nk; the forward's o is what it returns."""
    forward = functools.partial(flash2_attention, return_lse=True)

    def fn(q, k, v, *, causal=False, sm_scale=None):
        return KernelPair.apply(q, k, v, causal, sm_scale, forward, flash_backward_pytorch)

    q, k, v = random_qkv(1, 4, 70, 90, 32, kv_heads=2, dtype=torch.float64)
    assert_gradients_match_reference(fn, q, k, v, causal=causal)
    torch.testing.assert_close(fn(q, k, v, causal=causal), forward(q, k, v, causal=causal)[0])
    assert not wants_grad(q, k, v) and wants_grad(q, k.requires_grad_(), v)
    with torch.no_grad():
        assert not wants_grad(q, k, v)


def test_autograd_function_is_exposed():
    assert issubclass(FlashAttentionPyTorch, torch.autograd.Function)


# --- the Triton kernels --------------------------------------------------------------------------------------

from utils import gpu  # noqa: E402
from utils.tiled.fast.backward import Config, pick_config, use_tma, flash_attention_backward  # noqa: E402
from utils.course.worklogs import triton_backward as worklog  # noqa: E402  (the switches 07w measures)
from utils.course.testing import ODD_SHAPES_64_128  # noqa: E402

# Small tiles in the interpreter so that every shape crosses several blocks and both loop kinds run.
SMALL = Config(16, 16, 4, 1, 16, 16, 4, 1)
CONFIGS = [None] if CUDA else [SMALL, None]


def triton_dtypes():
    return (torch.float32, torch.float16, torch.bfloat16) if CUDA else (torch.float32,)


# A covering design of strength 2 (as tests/test_attention.py explains): every pair of shape, causal, dtype and
# tile configuration at least once, rather than their full product.
@pytest.mark.parametrize("shape,causal,dtype,config", [
    pytest.param(r["shape"], r["causal"], r["dtype"], r["config"],
                 id=f"{ids(r['shape'])}-{r['causal']}-{r['dtype']}-{'default' if r['config'] is None else 'small'}")
    for r in pairwise(dict(shape=SHAPES, causal=[False, True], dtype=triton_dtypes(), config=CONFIGS))])
def test_triton_backward_matches_autograd(shape, causal, dtype, config):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=7)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    o, lse = forward_lse(q, k, v, causal)
    grads = flash_attention_backward(do, q, k, v, o.to(dtype), lse.float(), causal=causal, config=config)
    assert all(g.dtype == dtype and g.device == q.device for g in grads)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), dtype)


@pytest.mark.gpu
def test_tiles_whose_compiled_kernel_is_too_big_are_dropped(monkeypatch):
    """Where Triton allocates more shared memory than smem_estimate says (3.7 at head dim 128 on sm_90), the
    launch's "out of resource" makes the backward drop those tiles and pick again, once."""
    from utils.tiled.fast import backward as fast_bwd

    huge = Config(128, 256, 8, 4, 256, 128, 8, 4)   # far beyond any GPU's shared memory per block
    monkeypatch.setattr(fast_bwd, "_TOO_BIG", set())
    monkeypatch.setattr(fast_bwd, "_candidates", lambda preferred: (huge, *fast_bwd.SMALL_SMEM_CONFIGS))
    monkeypatch.setattr(fast_bwd, "smem_estimate", lambda *args: 0)
    fast_bwd._fitted_config.cache_clear()
    fast_bwd._KINDS.clear()
    try:
        q, k, v = random_qkv(1, 2, 300, 300, 128, dtype=torch.bfloat16, device=DEVICE, seed=3)
        do = torch.randn_like(q)
        o, lse = forward_lse(q, k, v, True)
        for _ in range(2):   # the second call finds the kind chosen again, with the tiles that fit
            grads = flash_attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal=True)
            assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True), torch.bfloat16)
        assert fast_bwd._TOO_BIG == {(gpu.shared_memory_per_block(q.device), huge)}
        with pytest.raises(Exception, match="out of resource|OutOfResources"):   # tiles the caller chose: Triton's error
            flash_attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal=True, config=huge)
    finally:
        fast_bwd._fitted_config.cache_clear()
        fast_bwd._KINDS.clear()


@pytest.mark.gpu
def test_lesson_backward_tries_smaller_tiles_where_the_first_are_too_big(monkeypatch):
    """The lesson kernel's retry after "out of resource: shared memory": the same call with the next tiles."""
    from utils.tiled import backward as lesson_bwd

    huge = lesson_bwd.Config(128, 256, 8, 4, 256, 128, 8, 4)   # far beyond any GPU's shared memory per block
    monkeypatch.setattr(lesson_bwd, "candidate_configs", lambda d, dtype, smem=None: [huge, *lesson_bwd.SMALL_SMEM_CONFIGS])
    q, k, v = random_qkv(1, 2, 300, 300, 128, dtype=torch.bfloat16, device=DEVICE, seed=3)
    do = torch.randn_like(q)
    o, lse = forward_lse(q, k, v, True)
    grads = lesson_bwd.flash_attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal=True)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True), torch.bfloat16)
    with pytest.raises(Exception, match="out of resource|OutOfResources"):   # tiles the caller chose: Triton's error
        lesson_bwd.flash_attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal=True, config=huge)


def test_triton_backward_non_contiguous_and_scale():
    """Views of (batch, seq, heads, dim) buffers, as a model's reshaped projections are."""
    q, k, v = random_qkv(1, 4, 37, 45, 32, kv_heads=2, device=DEVICE)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    do = torch.randn(1, 37, 4, 32, device=DEVICE).transpose(1, 2)
    o, lse = forward_lse(q, k, v, True, sm_scale=0.2)
    grads = flash_attention_backward(do, q, k, v, o.float(), lse.float(), causal=True, sm_scale=0.2, config=SMALL)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True, sm_scale=0.2), torch.float32)


def test_triton_backward_bf16_in_interpreter_or_gpu():
    q, k, v = random_qkv(1, 2, 20, 20, 16, dtype=torch.bfloat16, device=DEVICE)
    do = torch.randn_like(q)
    o, lse = forward_lse(q, k, v, True)
    grads = flash_attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal=True)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True), torch.bfloat16)


@pytest.mark.skipif(CUDA, reason="fp64 dots: checked in the interpreter (NumPy); slow and uncommon on GPUs")
@pytest.mark.parametrize("causal", [False, True])
def test_triton_gradcheck_float64(causal):
    q, k, v = random_qkv(1, 2, 5, 9, 16, kv_heads=1, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o, lse = flash2_attention(q, k, v, causal=causal, return_lse=True)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            return flash_attention_backward(do, *ctx.saved_tensors, causal=causal, config=SMALL)

    assert torch.autograd.gradcheck(Attention.apply, (q, k, v), fast_mode=True)


def test_triton_backward_validates_inputs():
    q, k, v = random_qkv(1, 2, 8, 8, 16, device=DEVICE)
    do = torch.randn_like(q)
    o, lse = forward_lse(q, k, v, False)
    o, lse = o.float(), lse.float()
    with pytest.raises(ValueError, match="head_dim 8 is not supported"):
        q8, k8, v8 = random_qkv(1, 2, 8, 8, 8, device=DEVICE)
        flash_attention_backward(torch.randn_like(q8), q8, k8, v8, torch.randn_like(q8), lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_attention_backward(do, q, k, v, o, lse[:, :1])
    with pytest.raises(TypeError, match="do has dtype"):
        flash_attention_backward(do.half(), q, k, v, o, lse)
    with pytest.raises(TypeError, match="config must be a utils.tiled.fast.backward.Config"):
        flash_attention_backward(do, q, k, v, o, lse, config=(16, 16))
    with pytest.raises(ValueError, match="not a multiple"):
        flash_attention_backward(do, q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), o, lse)
    with pytest.raises(TypeError, match="sm_scale"):
        flash_attention_backward(do, q, k, v, o, lse, sm_scale="0.1")
    with pytest.raises(ValueError, match="block_m1 must be a power of two"):
        Config(block_m1=24)
    with pytest.raises(ValueError, match="warps2 must be a positive int"):
        Config(warps2=0)


def test_tma_argument_is_checked():
    """The worklog's forced loads: tma and tma_stats are checked, and say why they cannot run."""
    q, k, v = random_qkv(1, 2, 8, 8, 16, device=DEVICE)
    do = torch.randn_like(q)
    o, lse = (t.float() for t in forward_lse(q, k, v, False))
    with pytest.raises(TypeError, match="tma must be a bool or None, got str"):
        worklog.flash_attention_backward(do, q, k, v, o, lse, tma="yes")
    with pytest.raises(ValueError, match="tma=True needs an sm_90"):  # fp32: TMA takes 16-bit inputs only
        worklog.flash_attention_backward(do, q, k, v, o, lse, tma=True)
    with pytest.raises(TypeError, match="tma_stats must be a bool or None, got int"):
        worklog.flash_attention_backward(do, q, k, v, o, lse, tma_stats=1)
    with pytest.raises(ValueError, match="tma_stats=True needs the TMA loads"):
        worklog.flash_attention_backward(do, q, k, v, o, lse, tma=False, tma_stats=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_atomic_dq_matches_autograd(shape, causal):
    """The worklog's dQ added with atomics by the dK/dV pass (no dQ pass; worklog 07w): GQA, Nq != Nk, ragged
    ends, rows that see no key (their dQ stays 0), and on a Hopper GPU with the TMA loads too; dK and dV are
    unchanged."""
    b, h, hk, nq, nk, d = shape
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=11)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    o, lse = forward_lse(q, k, v, causal)
    args = (do, q, k, v, o.to(dtype), lse.float())
    truth = reference_gradients(q, k, v, do, causal=causal)
    reduce = [(False, "tma"), (None, "tma")] if worklog.tma_reduce_supported(q) else []
    ways = [(False, True), (None, True)] + reduce
    for tma, dq_atomic in ways:   # "tma": one bulk reduce-add per tile, with pointer loads and with TMA loads
        grads = worklog.flash_attention_backward(*args, causal=causal, config=None if CUDA else SMALL, tma=tma,
                                                 dq_atomic=dq_atomic)
        assert all(g.dtype == dtype and g.shape == t.shape for g, t in zip(grads, (q, k, v)))
        assert_gradients_close(grads, truth, dtype)


def test_dq_atomic_is_checked():
    """dq_atomic takes False, True or "tma"; "tma" needs an sm_90+ GPU and 16-bit inputs, and says so."""
    q, k, v = random_qkv(1, 2, 16, 16, 32, dtype=torch.float32, seed=3)
    o, lse = forward_lse(q, k, v, False)
    args = (torch.randn_like(q), q, k, v, o.to(q.dtype), lse.float())
    with pytest.raises(TypeError, match='dq_atomic must be a bool or "tma", got NoneType'):
        worklog.flash_attention_backward(*args, dq_atomic=None)
    with pytest.raises(ValueError, match='dq_atomic must be False, True or "tma", got \'reduce\''):
        worklog.flash_attention_backward(*args, dq_atomic="reduce")
    with pytest.raises(ValueError, match='dq_atomic="tma" needs an sm_90\\+ GPU and fp16/bf16 inputs'):
        worklog.flash_attention_backward(*args, dq_atomic="tma")   # fp32 (and on CPU, no GPU at all)
    assert not worklog.tma_reduce_supported(q.half())


def test_use_tma_only_where_it_paid():
    """The whole dK/dV loop through TMA (tiles, lse₂ and D) beat pointer loads on the H200 at head dim 128, causal
    or not, and TMA lost at 64 (notebook 07, sections 8 and 9)."""
    assert use_tma(128, False) and use_tma(128, True)
    assert not any(use_tma(d, c) for d in (16, 32, 64, 80, 96, 256) for c in (False, True))


HOPPER = CUDA and gpu.capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA needs an sm_90+ GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backward_tma_matches_autograd(causal, dtype):
    """Both load paths (forced, through the worklog's copy) on odd shapes (ragged ends read as zeros through the
    descriptors), GQA, causal or not."""
    for b, h, hk, nq, nk, d in ODD_SHAPES_64_128:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=nq + d)
        do = torch.randn_like(q)
        o, lse = forward_lse(q, k, v, causal)
        truth = reference_gradients(q, k, v, do, causal=causal)
        for tma, stats in ((False, False), (True, False), (True, None)):  # None: lse₂ and D too where allowed
            grads = worklog.flash_attention_backward(do, q, k, v, o.to(dtype), lse.float(), causal=causal,
                                                     tma=tma, tma_stats=stats)
            assert_gradients_close(grads, truth, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA needs an sm_90+ GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_tma_stats_backward_matches_pointer_loads(causal):
    """lse₂ and D through descriptors compute what the pointer loads do, on GQA, a ragged end (N = 300, a multiple
    of 4 but not of the tiles), both head dims and 4-warp tiles; N = 302 falls back (None) or says why (True)."""
    four = Config(32, 64, 4, 3, 64, 32, 4, 3)
    for b, h, hk, n, d, config in ((2, 4, 4, 1024, 128, None), (1, 4, 2, 300, 128, None), (1, 4, 2, 300, 64, None),
                                   (1, 2, 2, 256, 128, four)):
        q, k, v = random_qkv(b, h, n, n, d, kv_heads=hk, dtype=torch.bfloat16, device=DEVICE, seed=n + d)
        do = torch.randn_like(q)
        o, lse = forward_lse(q, k, v, causal)
        args = (do, q, k, v, o.to(q.dtype), lse.float())
        stats = worklog.flash_attention_backward(*args, causal=causal, config=config, tma=True, tma_stats=True)
        pointer = worklog.flash_attention_backward(*args, causal=causal, config=config, tma=False)
        for name, got, want in zip(("dq", "dk", "dv"), stats, pointer):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2,
                                       msg=lambda m, name=name, d=d, n=n: f"{name} (d={d}, N={n}): {m}")
    q, k, v = random_qkv(1, 2, 302, 302, 128, dtype=torch.bfloat16, device=DEVICE)
    o, lse = forward_lse(q, k, v, causal)
    args = (torch.randn_like(q), q, k, v, o.to(q.dtype), lse.float())
    truth = reference_gradients(q, k, v, args[0], causal=causal)
    assert_gradients_close(worklog.flash_attention_backward(*args, causal=causal, tma=True), truth, torch.bfloat16)
    with pytest.raises(ValueError, match="seqlen_q a multiple of 4"):
        worklog.flash_attention_backward(*args, causal=causal, tma_stats=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA needs an sm_90+ GPU")
def test_default_loads_follow_use_tma(monkeypatch):
    """The backward makes descriptors exactly where use_tma says so (4 tiles, and lse₂ and D for the dK/dV
    loops); unaligned inputs fall back to pointers."""
    import utils.tiled.fast.backward as bwd

    made = []
    real = bwd.TensorDescriptor.from_tensor
    monkeypatch.setattr(bwd.TensorDescriptor, "from_tensor", lambda t, block: made.append(block) or real(t, block))
    for d in (64, 128):
        for causal in (False, True):
            made.clear()
            q, k, v = random_qkv(1, 2, 256, 256, d, dtype=torch.bfloat16, device=DEVICE)
            o, lse = forward_lse(q, k, v, causal)
            flash_attention_backward(torch.randn_like(q), q, k, v, o.to(q.dtype), lse.float(), causal=causal)
            assert len(made) == (6 if use_tma(d, causal) else 0), (d, causal, made)
    made.clear()
    q, k, v = (t[..., 1:129] for t in random_qkv(1, 2, 256, 256, 130, dtype=torch.bfloat16, device=DEVICE))
    o, lse = forward_lse(q, k, v, False)
    flash_attention_backward(torch.randn_like(q), q, k, v, o.to(q.dtype), lse.float())  # 2-byte offset: no TMA
    assert made == []


def test_checks_and_choices_are_kept_for_cuda_calls_only():
    """On the CPU (the interpreter) every call is checked: there is no key to keep its choices under."""
    import utils.tiled.fast.backward as bwd

    q, k, v = random_qkv(1, 2, 8, 8, 16)
    o, lse = (t.float() for t in forward_lse(q, k, v, False))
    assert bwd._call_key(torch.randn_like(q), q, k, v, o, lse, False, None, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the checks and choices are kept for CUDA calls only")
def test_a_kind_of_call_is_checked_once_and_others_apart(monkeypatch):
    """A second call of a kind (shapes, strides, dtypes, device, alignment, options) reuses the first one's checks,
    choices and bound launches (bitwise the same gradients); a call that differs in alignment, strides or options
    gets its own, and a bad argument is still refused after good calls of the same shapes."""
    import utils.tiled.fast.backward as bwd
    from utils.tiled.fast.launch import Bound, dispatch_by_triton

    q, k, v = random_qkv(2, 4, 200, 200, 64, dtype=torch.float16, device=DEVICE)
    do = torch.randn_like(q)
    o, lse = forward_lse(q, k, v, True)
    args = (do, q, k, v, o.to(q.dtype), lse.float())
    truth = reference_gradients(q, k, v, do, causal=True)
    bwd._KINDS.clear()
    first = flash_attention_backward(*args, causal=True)
    calls, run = [], Bound.__call__

    def counted(self, stream, *head):
        calls.append(len(head))
        run(self, stream, *head)

    monkeypatch.setattr(Bound, "__call__", counted)
    again = flash_attention_backward(*(t.clone() for t in args), causal=True)
    assert len(bwd._KINDS) == 1 and calls == [5, 12, 9]   # the three launches bound by the first call
    with dispatch_by_triton():                             # Triton's own dispatch: the same kernels
        through_triton = flash_attention_backward(*args, causal=True)
    assert len(calls) == 3
    for a, b, c in zip(first, again, through_triton):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    others = {"alignment": ([misaligned(t) for t in args], True),
              "strides": ([t.transpose(1, 2).contiguous().transpose(1, 2) for t in args[:5]] + [args[5]], True)}
    for n, (what, (other, causal)) in enumerate(others.items(), start=2):
        assert_gradients_close(flash_attention_backward(*other, causal=causal), truth, torch.float16)
        assert len(bwd._KINDS) == n, what
    flash_attention_backward(*args, causal=True, sm_scale=0.5)
    assert len(bwd._KINDS) == 4
    with pytest.raises(TypeError, match="config must be a utils.tiled.fast.backward.Config"):
        flash_attention_backward(*args, causal=True, config=(16, 16))
    with pytest.raises(TypeError, match="sm_scale"):
        flash_attention_backward(*args, causal=True, sm_scale="0.1")
    with pytest.raises(TypeError, match="do has dtype"):
        flash_attention_backward(args[0].float(), *args[1:], causal=True)
    assert len(bwd._KINDS) == 4


def test_backward_for_forward_gives_flash_attention_backwards_gradients():
    """Called as utils.tiled.fast.forward's autograd Function calls it: bitwise the gradients of
    flash_attention_backward, and a kind kept in the forward's only where the call has a key (CUDA; a CPU call
    in the interpreter has none)."""
    import utils.tiled.fast.backward as bwd
    from utils.tiled.fast.launch import Kind

    q, k, v = random_qkv(1, 2, 24, 40, 16, kv_heads=1, seed=6, device=DEVICE)
    do = torch.randn_like(q)
    o, lse = (t.float() for t in forward_lse(q, k, v, True))
    forward_kind = Kind(None)
    got = bwd.backward_for_forward(forward_kind, do, q, k, v, o, lse, causal=True, sm_scale=0.3)
    expected = flash_attention_backward(do, q, k, v, o, lse, causal=True, sm_scale=0.3)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert len(forward_kind.derived) == (1 if CUDA else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="kinds are kept for CUDA calls only")
def test_autograd_keeps_the_backward_kinds_in_the_forward_kind():
    """Through autograd the backward's kinds of call live in the forward's, keyed by dO alone: the second call
    of a dO layout takes the kept kind (bitwise the gradients of flash_attention_backward), and a dO of other
    strides or another alignment gets a kind of its own."""
    from utils.tiled.fast import forward as fast_forward
    from utils.tiled.fast.backward import flash_attention

    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4, 200, 200, 64, dtype=torch.float16, device=DEVICE,
                                                        seed=5))
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    forward_kind = fast_forward._KINDS[fast_forward._call_key(q, k, v, True, None)]
    forward_kind.derived.clear()
    do = torch.randn_like(o)
    layouts = {"contiguous": do, "strides": do.transpose(1, 2).contiguous().transpose(1, 2),
               "alignment": misaligned(do)}
    for n, (what, g) in enumerate(layouts.items(), start=1):
        expected = flash_attention_backward(g, *(t.detach() for t in (q, k, v, o)), lse, causal=True)
        for _ in range(2):   # the first call checks and keeps the kind, the second takes it
            got = torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert len(forward_kind.derived) == n, what


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="kinds are kept for CUDA calls only")
def test_the_kinds_of_call_kept_stay_at_the_bound(monkeypatch):
    """Under autograd with shapes and dO layouts that vary, the forward's kinds, the backward's and the ones kept
    in each forward kind stay at launch.MAX_KINDS (here 2), and the gradients stay right."""
    import utils.tiled.fast.backward as bwd
    from utils.tiled.fast import forward as fast_forward, launch

    monkeypatch.setattr(launch, "MAX_KINDS", 2)
    monkeypatch.setattr(fast_forward, "_KINDS", launch.kind_cache())
    monkeypatch.setattr(bwd, "_KINDS", launch.kind_cache())
    for n in (64, 72, 80, 88):
        q, k, v = (t.requires_grad_() for t in random_qkv(1, 2, n, n, 64, dtype=torch.float16, device=DEVICE,
                                                            seed=n))
        o = bwd.flash_attention(q, k, v, causal=True)
        do = torch.randn_like(o)
        for g in (do, do.transpose(1, 2).contiguous().transpose(1, 2), misaligned(do)):
            got = torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
            assert_gradients_close(got, reference_gradients(q, k, v, g, causal=True), torch.float16)
        forward_kind = fast_forward._KINDS[fast_forward._call_key(q, k, v, True, None)]
        assert len(forward_kind.derived) == 2
    assert len(fast_forward._KINDS) == len(bwd._KINDS) == 2


def test_pick_config_is_valid_for_every_case():
    for d in (16, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            for causal in (False, True):
                assert isinstance(pick_config(d, dtype, causal), Config)


# --- end to end: the differentiable Triton attention (forward of notebook 05, backward of notebook 07) --------

@pytest.mark.parametrize("dtype", triton_dtypes(), ids=str)
@pytest.mark.parametrize("shape,causal", [((1, 4, 2, 45, 45, 64), True), ((1, 2, 1, 33, 70, 96), False),
                                          ((1, 2, 2, 70, 33, 32), True)], ids=str)
def test_flash_attention_end_to_end(shape, causal, dtype):
    from utils.tiled.fast.backward import flash_attention

    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    flash_attention(q, k, v, causal=causal).backward(do)
    assert_gradients_close((q.grad, k.grad, v.grad), reference_gradients(q, k, v, do, causal=causal), dtype)


@pytest.mark.gpu
def test_flash_attention_matches_sdpa_gradients_on_gpu():
    """bf16 on a GPU: our gradients are as close to float64 truth as SDPA's own are (within 2x)."""
    from utils.tiled.fast.backward import flash_attention
    from utils.eager.reference import sdpa_attention

    q, k, v = random_qkv(2, 8, 2048, 2048, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=13)
    do = torch.randn_like(q)
    truth = reference_gradients(q, k, v, do, causal=True)
    errors = {}
    for name, fn in (("ours", flash_attention), ("sdpa", sdpa_attention)):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv, causal=True).backward(do)
        errors[name] = [(g.double() - t).abs().max().item() for g, t in zip((qq.grad, kk.grad, vv.grad), truth)]
    for ours, sdpa in zip(errors["ours"], errors["sdpa"]):
        assert ours <= 2 * sdpa + 1e-3, errors
