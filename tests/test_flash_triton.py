"""What is specific to the Triton FlashAttention-2 forward (utils.tiled.fast.forward) and the worklog's copy with its
experiments (utils.course.worklogs.triton_forward); tests/test_attention.py covers the shared correctness grid
through the registry's "triton" entry."""
import math

import pytest
import torch
import triton
import triton.language as tl

from utils.tiled.fast import forward as fast_forward, backward as fast_backward, launch
from utils.course.worklogs import triton_forward as worklog
from utils.tiled.fast.forward import Config, Steps, flash_attention_forward, launch_config, tma_supported, tunable
from utils.tiled.fast.backward import flash_attention   # the registry's "triton": this forward, made differentiable
from utils.eager.reference import reference_attention
from utils.course.testing import assert_close, misaligned, random_qkv, reference_lse

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def qkv(b=1, h=2, nq=40, nk=None, d=32, hk=None, dtype=torch.float32, seed=0):
    return random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=seed)


@pytest.mark.parametrize("nq,nk,causal", [(40, 40, False), (40, 40, True), (19, 70, True), (70, 19, True),
                                          (70, 19, False), (1, 33, True)])
def test_lse_matches_torch_logsumexp(nq, nk, causal):
    q, k, v = qkv(nq=nq, nk=nk, hk=1)
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    expected = reference_lse(q, k, causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert torch.equal(torch.isinf(lse), torch.isinf(expected))  # -inf exactly where a query sees no key
    finite = torch.isfinite(expected)
    torch.testing.assert_close(lse[finite].double(), expected[finite], atol=1e-4, rtol=1e-4)
    o2, lse2 = flash_attention_forward(q, k, v, causal=causal)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("nq,nk", [(5, 12), (12, 5), (37, 64), (64, 37)])
def test_causal_is_bottom_right_against_an_explicit_mask(nq, nk):
    """Build the mask by hand (query i sees key j iff j - i <= nk - nq) and attend with it in float64."""
    q, k, v = qkv(nq=nq, nk=nk, dtype=torch.float32)
    mask = torch.ones(nq, nk, dtype=torch.bool, device=DEVICE).tril(diagonal=nk - nq)
    scores = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ v.double()
    out = flash_attention(q, k, v, causal=True)
    assert_close(out, expected)
    if nq > nk:
        assert out[:, :, : nq - nk].abs().max() == 0  # queries that see no key give exactly 0
    # A key no query may see cannot change the output: perturb the last key, recompute, compare the rows.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 100
    v2[:, :, -1] -= 100
    out2 = flash_attention(q, k2, v2, causal=True)
    blind = ~mask[:, -1]
    assert torch.equal(out[:, :, blind], out2[:, :, blind])


@pytest.mark.parametrize("config", [Config(16, 16, 4, 1), Config(16, 32, 4, 1), Config(32, 16, 4, 1),
                                    Config(64, 16, 4, 1)])
@pytest.mark.parametrize("nq,nk", [(50, 50), (23, 81), (81, 23), (1, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sizes_and_the_causal_split(config, nq, nk, causal):
    """Several key blocks on each side of the diagonal, ragged last blocks, BLOCK_M smaller and larger than
    BLOCK_N: the split into unmasked and masked blocks must not change the result."""
    q, k, v = qkv(nq=nq, nk=nk, d=48)
    o, lse = fast_forward._launch(q, k, v, causal, 0.2, config)
    assert_close(o, reference_attention(q, k, v, causal=causal, sm_scale=0.2))


@pytest.mark.parametrize("nq,nk,hk", [(50, 50, 2), (23, 81, 1), (81, 23, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_tensor_descriptors_keep_the_result(nq, nk, hk, causal):
    """Notebook 05b's TMA path (tensor descriptors, zero-filled past the last row) gives the pointer path's answer:
    ragged last blocks, Nq != Nk, GQA. In the interpreter the descriptors run too (on fp32 data)."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v = qkv(h=4, hk=hk, nq=nq, nk=nk, d=32, dtype=dtype)
    if CUDA and not tma_supported(q, k, v):
        pytest.skip("this GPU has no TMA")
    config = Config(64, 32, 4, 2) if CUDA else Config(16, 16, 4, 1)
    o_ref, lse_ref = fast_forward._launch(q, k, v, causal, 0.2, config, Steps(tma=False))
    assert_close(o_ref, reference_attention(q, k, v, causal=causal, sm_scale=0.2), dtype=dtype)
    for _ in range(2):  # on a GPU the second call takes utils.tiled.fast.launch's direct path, descriptors included
        o, lse = fast_forward._launch(q, k, v, causal, 0.2, config, Steps(tma=True))   # made by the host
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)  # the same arithmetic, other loads
    # The worklog's: descriptors made per program (TMA=1), and by the host with section 5's overlapped loop (the
    # same tiles in the same order, the next tile's scores asked for earlier).
    o, lse = worklog._launch(q, k, v, causal, 0.2, config, worklog.Steps(tma=True))
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    o, lse = worklog._launch(q, k, v, causal, 0.2, config,
                             worklog.Steps(tma=True, host_descriptors=True, overlap=True))
    assert_close(o, o_ref, dtype=dtype)
    torch.testing.assert_close(lse, lse_ref)


@triton.jit
def _exp2_fma_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, worklog.exp2_fma(tl.load(X + offs)))


def test_exp2_fma_is_exp2_to_a_tenth_of_a_permille():
    """Section 5's exponential on the FMA units: 2^x within 1.1e-4 (relative) down to 2^-125; below that, and
    at -inf, a tiny positive (never nan, never negative)."""
    x = torch.cat([torch.linspace(-130.0, 0.0, 4093), torch.tensor([-float("inf"), -0.5, -126.4])])
    x = x.to(DEVICE)
    y = torch.empty_like(x)
    _exp2_fma_kernel[(1,)](x, y, N=4096)
    exact = torch.exp2(x.double())
    normal = x > -125
    assert ((y.double() - exact) / exact)[normal].abs().max() < 1.1e-4
    assert y[~normal].min() > 0 and y[~normal].max() < 1e-37 and not y.isnan().any()


def test_exp2_coefficients_fit_two_to_the_f():
    f = torch.linspace(-0.5, 0.5, 10001, dtype=torch.float64)
    c0, c1, c2, c3 = worklog._exp2_coefficients()
    assert ((((c3 * f + c2) * f + c1) * f + c0) / torch.exp2(f) - 1).abs().max() < 1.1e-4
    assert len(worklog._exp2_coefficients(4)) == 5


@pytest.mark.parametrize("share", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_exp2_fma_keeps_the_result(share, causal):
    """1 in 2 or 1 in 4 exponentials of the unmasked tiles on the FMA units: the output stays within 16-bit
    tolerance (ragged blocks, Nq != Nk, GQA); the switch takes 0, 2 or 4 and needs 16-bit inputs."""
    for dtype in (torch.float16, torch.bfloat16) if CUDA else (torch.float16,):
        q, k, v = qkv(h=4, hk=2, nq=150, nk=181, d=64, dtype=dtype)
        config = Config(64, 32, 4, 2) if CUDA else Config(32, 32, 4, 1)
        o_ref, lse_ref = worklog._launch(q, k, v, causal, 0.2, config, worklog.Steps())
        host = worklog.Steps(tma=True, host_descriptors=True, exp2_fma=share)
        for steps in (worklog.Steps(exp2_fma=share), *((host,) if CUDA and worklog.tma_supported(q, k, v) else ())):
            o, lse = worklog._launch(q, k, v, causal, 0.2, config, steps)
            assert_close(o, reference_attention(q, k, v, causal=causal, sm_scale=0.2), dtype=dtype)
            assert not torch.equal(o, o_ref)   # the switch reached the kernel
            torch.testing.assert_close(lse, lse_ref, rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match="exp2_fma computes P to 16-bit accuracy"):
        worklog.variant(None, worklog.Steps(exp2_fma=share), "bad")(*qkv(nq=8, nk=8, d=16))
    for bad in (True, 3, 8):
        with pytest.raises(ValueError, match="exp2_fma is 0, 2 or 4"):
            worklog.variant(None, worklog.Steps(exp2_fma=bad), "bad")(*qkv(nq=8, nk=8, d=16, dtype=torch.float16))


def test_host_descriptors_cover_strided_views_and_gqa():
    """The host's descriptors describe the (B, H, N, D) tensors as they are: a head-major view (strides not in
    B, H, N order) and K/V with fewer heads read the right rows; the tile shapes follow the config."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v = qkv(b=2, h=4, hk=2, nq=40, nk=72, d=32, dtype=dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory, viewed as (B, H, N, D)
    if CUDA and not tma_supported(q, k, v):
        pytest.skip("this GPU has no TMA")
    config = Config(64, 32, 4, 2) if CUDA else Config(16, 32, 4, 1)
    descs = fast_forward.host_descriptors(q, k, v, q, config.block_m, config.block_n)
    assert [d.block_shape for d in descs] == [[1, 1, config.block_m, 32], [1, 1, config.block_n, 32],
                                              [1, 1, config.block_n, 32], [1, 1, config.block_m, 32]]
    assert list(descs[0].strides) == list(q.stride()) and list(descs[1].shape) == list(k.shape)
    for causal in (False, True):
        o, _ = fast_forward._launch(q, k, v, causal, 0.2, config, Steps(tma=True))
        assert_close(o, reference_attention(q, k, v, causal=causal, sm_scale=0.2), dtype=dtype)


def test_tma_mode_names_the_kernel_switch():
    Steps = worklog.Steps
    assert [s.tma_mode for s in (Steps(), Steps(tma=True), Steps(tma=True, host_descriptors=True),
                                 Steps(host_descriptors=True))] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="needs tma=True"):
        worklog.variant(None, worklog.Steps(host_descriptors=True), "bad")(*qkv(nq=8, nk=8, d=16))


def test_overlap_needs_the_host_descriptors_and_fixed_tiles():
    q, k, v = qkv(nq=8, nk=8, d=16)
    for steps in (worklog.Steps(overlap=True), worklog.Steps(tma=True, overlap=True),
                  worklog.Steps(autotune=True, tma=True, host_descriptors=True, overlap=True)):
        with pytest.raises(ValueError, match="overlap skews the host-descriptor loop"):
            worklog.variant(None, steps, "bad")(q, k, v)
    assert not worklog.Steps.fastest(q, k, v).overlap


def test_fastest_steps_follow_the_inputs():
    q, k, v = qkv(d=64)
    if not CUDA:  # the interpreter: nothing to tune, no TMA unit
        assert Steps.fastest(q, k, v) == Steps() and not tma_supported(q, k, v)
    assert Steps.fastest(*qkv(nq=100, nk=2047, d=64, dtype=torch.float16)) == Steps()  # short: launch-bound
    q16, k16, v16 = qkv(d=64, dtype=torch.float16)
    assert not tma_supported(q16[..., :48], k16[..., :48], v16[..., :48])  # not a power of two
    assert not tma_supported(q16[..., ::2], k16[..., ::2], v16[..., ::2])  # head dim not contiguous
    assert not Steps.fastest(q, k, v).autotune  # fp32: fixed tiles


def test_worklog_variants_compute_attention_or_refuse_clearly():
    from utils.course.worklogs.triton_forward import WORKLOG, variant, worklog_variant
    with pytest.raises(ValueError, match="unknown worklog step 'nope'"):
        worklog_variant("nope")
    with pytest.raises(TypeError, match="config must be a Config"):
        variant((128, 64, 8, 3), worklog.Steps())
    with pytest.raises(TypeError, match="steps must be a Steps"):
        variant(None, True)
    q, k, v = qkv(nq=40, nk=40, d=32)
    for name, (config, steps) in WORKLOG.items():
        fn = worklog_variant(name)
        if steps is None:  # the final kernel, worklog.Steps.fastest per call: runs on any input
            assert_close(fn(q, k, v, causal=True), reference_attention(q, k, v, causal=True))
        elif CUDA:  # in fp16; a step that needs TMA (sm90+) or the autotuner (sm80+) refuses on older GPUs
            q16, k16, v16 = (t.half() for t in (q, k, v))
            if ((steps.tma and not worklog.tma_supported(q16, k16, v16))
                    or (steps.autotune and not worklog.tunable(q16))):
                with pytest.raises(ValueError, match="needs TMA|autotunes"):
                    fn(q16, k16, v16, causal=True)
            else:
                assert_close(fn(q16, k16, v16, causal=True), reference_attention(q, k, v, causal=True),
                             dtype=torch.float16)
        else:  # the interpreter (fp32) has neither TMA through this path nor an autotuner
            if steps.tma or steps.autotune:
                with pytest.raises(ValueError, match="needs TMA|autotunes"):
                    fn(q, k, v)
            else:
                assert_close(fn(q, k, v, causal=True), reference_attention(q, k, v, causal=True))
        with pytest.raises(TypeError, match="causal must be a bool"):
            fn(q, k, v, causal=1)


def test_worklog_final_step_runs_what_flash_attention_runs():
    """Like with like: the worklog's last entry is the registry's kernel (worklog.Steps.fastest) through `variant`."""
    from utils.course.worklogs.triton_forward import WORKLOG, worklog_variant
    assert list(WORKLOG)[-1] == "triton 1+2+4 (final)" and WORKLOG["triton 1+2+4 (final)"] == (None, None)
    q, k, v = qkv(nq=33, nk=70, d=32, hk=1)
    assert torch.equal(worklog_variant("triton 1+2+4 (final)")(q, k, v, causal=True),
                       flash_attention(q, k, v, causal=True))


def test_autotuned_config_is_asked_once_per_shape_class_then_launched_directly(monkeypatch):
    """The autotuner runs on the first call of a shape class; its winner is remembered and later calls (other
    lengths in the same power-of-two bucket) launch the plain kernel with it."""
    import triton

    calls, launched = [], []
    plain = fast_forward.flash_fwd_kernel

    class FakeAutotuner:  # stands in for triton.autotune (which needs a GPU): runs the winner, records the call
        best_config = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "TMA": 0}, num_warps=4, num_stages=1)
        configs = [best_config]

        def __getitem__(self, grid):
            def run(*args, seqlen_bucket, **switches):
                calls.append(seqlen_bucket)
                meta = {k: v for k, v in self.best_config.kwargs.items() if k != "TMA"}
                plain[grid(meta)](*args, **switches, **meta, TMA=0, seqlen_bucket=seqlen_bucket, num_warps=4,
                                  num_stages=1)
            return run

    monkeypatch.setattr(fast_forward, "_tuners", {mode: FakeAutotuner() for mode in (0, 1, 2)})
    monkeypatch.setattr(fast_forward, "_tuned_configs", {})
    monkeypatch.setattr(fast_forward, "_progress_total", fast_forward._progress_total)  # restored afterwards
    monkeypatch.setattr(fast_forward, "_fwd_launcher", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), plain[grid])[1]})())
    for nq in (20, 30, 17, 40):  # buckets 32, 32, 32, 64
        q, k, v = qkv(nq=nq, nk=nq, d=32, dtype=torch.float16)
        o, _ = fast_forward._launch(q, k, v, True, 0.25, None, Steps(autotune=True))
        assert_close(o, reference_attention(q, k, v, causal=True, sm_scale=0.25), dtype=torch.float16)
    assert calls == [32, 64], calls
    assert len(launched) == 2 and launched[0] == (2, 2)  # nq=30 and 17 went straight to the kernel, 16-row blocks
    assert fast_forward._tuned_configs[(q.device, torch.float16, 32, True, 0, 64)] == (Config(16, 32, 4, 1), 0)


def test_autotuner_timer_shows_one_progress_bar_per_tuning(monkeypatch):
    """The autotuner times each of its configs through _time_with_progress: one bar per tuning, closed after
    the last config; a config that fails (the timer raises) still advances the bar."""
    import triton.testing
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(kw) or [1.0, 0.9, 1.1])
    n = 4
    monkeypatch.setattr(fast_forward, "_progress_total", n)
    for _ in range(2):
        for i in range(n):
            assert fast_forward._time_with_progress(lambda: None, (0.5, 0.2, 0.8)) == [1.0, 0.9, 1.1]
            bar = fast_forward._progress
            assert (bar is None) == (i == n - 1) and (bar is None or bar.disable or bar.n == i + 1)
    assert len(calls) == 2 * n and calls[0]["quantiles"] == (0.5, 0.2, 0.8)
    import tqdm.auto
    real = tqdm.auto.tqdm   # a disabled bar (TQDM_DISABLE=1) counts nothing: the tuning still ends its bar
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda **kw: real(**{**kw, "disable": True}))
    for i in range(n):
        fast_forward._time_with_progress(lambda: None, None)
        assert (fast_forward._progress is None) == (i == n - 1)
    monkeypatch.setattr(tqdm.auto, "tqdm", real)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fast_forward._time_with_progress(lambda: None, None)
    assert fast_forward._progress_left == n - 1   # the failed config counted
    fast_forward._progress.close()
    monkeypatch.setattr(fast_forward, "_progress", None)


def _strided_views(q, k, v, kind):
    if kind == "bnhd":      # views of (batch, seq, heads, head_dim) buffers
        return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    if kind == "every_other_dim":  # last-dim stride 2
        return [torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2] for t in (q, k, v)]
    if kind == "head_slice":  # every other head of a bigger tensor
        return [torch.cat([t, t], dim=1)[:, ::2] for t in (q, k, v)]
    if kind == "expanded_batch":  # stride 0 over the batch
        return [t[:1].expand(3, -1, -1, -1) for t in (q, k, v)]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["bnhd", "every_other_dim", "head_slice", "expanded_batch"])
def test_arbitrary_strides(kind):
    q, k, v = _strided_views(*qkv(b=3, nq=33, nk=45, d=64, hk=1), kind)
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, causal=True)
    assert_close(out, reference_attention(q, k, v, causal=True))


def test_gqa_reads_kv_in_place(monkeypatch):
    """K/V reach the kernel as they are: the same storage, with fewer heads than Q (no repeat_interleave)."""
    seen = []
    launch = fast_forward._launch
    monkeypatch.setattr(fast_forward, "_launch",
                        lambda q, k, v, *a, **kw: seen.append((k, v)) or launch(q, k, v, *a, **kw))
    q, k, v = qkv(h=8, hk=2, nq=20, d=32)
    out = flash_attention(q, k, v)
    assert_close(out, reference_attention(q, k, v))
    (k_seen, v_seen), = seen
    assert k_seen.data_ptr() == k.data_ptr() and v_seen.data_ptr() == v.data_ptr() and k_seen.shape[1] == 2


@pytest.mark.skipif(CUDA, reason="the CPU (interpreter) path for bf16")
def test_bf16_on_cpu_is_computed_in_fp32():
    q, k, v = qkv(nq=30, nk=50, dtype=torch.bfloat16)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    o32, lse32 = flash_attention_forward(q.float(), k.float(), v.float(), causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, o32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    assert_close(out, reference_attention(q, k, v, causal=True))


@pytest.mark.parametrize("dtype,q_scale,k_scale", [(torch.float16, 20.0, 40.0), (torch.float32, 60.0, 8.0)])
def test_huge_logits_are_finite_and_right(dtype, q_scale, k_scale):
    """Logits of order 1e4 (fp16 inputs up to ~1e3, products summed in fp32): the online softmax must subtract
    the running maximum, never exponentiate a raw score."""
    q, k, v = qkv(nq=48, nk=48, d=64, dtype=dtype)
    q = (q.float() * q_scale).to(dtype)
    k = (k.float() * k_scale).to(dtype)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    logits = reference_lse(q, k, causal=False, sm_scale=1.0)
    assert logits.abs().max() > 1e4
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, sm_scale=1.0, return_lse=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_close(out, reference_attention(q, k, v, causal=causal, sm_scale=1.0))


@pytest.mark.parametrize("d", [16, 24, 80, 96, 160, 256])
def test_head_dims_padded_to_a_power_of_two(d):
    q, k, v = qkv(nq=20, nk=20, d=d)
    assert_close(flash_attention(q, k, v, causal=True), reference_attention(q, k, v, causal=True))


@pytest.mark.parametrize("change,error,match", [
    (dict(d=8), ValueError, "head_dim 8 is not supported by the Triton kernel; supported: 16 to 256"),
    (dict(d=264), ValueError, "head_dim 264 is not supported"),
    (dict(dtype=torch.float64), TypeError, "q has dtype torch.float64; supported: float16, bfloat16, float32"),
])
def test_unsupported_inputs_raise(change, error, match):
    q, k, v = qkv(**{"nq": 8, "nk": 8, **change})
    with pytest.raises(error, match=match):
        flash_attention(q, k, v)


def test_bad_arguments_raise():
    q, k, v = qkv(nq=8, nk=8)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attention(q, k, v, return_lse=1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="sm_scale must be finite and positive"):
        flash_attention(q, k, v, sm_scale=-1.0)
    with pytest.raises(ValueError, match="v has shape"):
        flash_attention_forward(q, k, v[:, :, :4])


def test_launch_config():
    cpu = torch.device("cpu")
    assert launch_config(64, torch.float32, cpu).block_m >= 16
    for d in (16, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            c = launch_config(d, dtype, torch.device("cuda"))
            assert c.block_m >= 16 and c.block_n >= 16 and c.num_warps in (4, 8) and c.num_stages >= 1


def test_backward_calls_the_notebook_07_module_with_the_saved_tensors(monkeypatch):
    calls = []

    def fake_backward(kind, do, q, k, v, o, lse, *, causal, sm_scale):
        calls.append(dict(kind=kind, do=do, q=q, o=o, lse=lse, causal=causal, sm_scale=sm_scale))
        return 2 * q, 3 * k, 4 * v

    monkeypatch.setattr(fast_backward, "backward_for_forward", fake_backward)
    q, k, v = (t.requires_grad_() for t in qkv(nq=16, nk=24, hk=1))
    o, lse = flash_attention(q, k, v, causal=True, sm_scale=0.3, return_lse=True)
    o.sum().backward()
    (call,) = calls
    assert call["causal"] is True and call["sm_scale"] == 0.3 and torch.equal(call["lse"], lse)
    assert isinstance(call["kind"], launch.Kind) and call["kind"].choices.scale == 0.3   # the forward's kind
    assert torch.equal(call["o"], o.detach()) and torch.equal(call["do"], torch.ones_like(o))
    assert torch.equal(q.grad, 2 * q.detach()) and torch.equal(k.grad, 3 * k.detach())


def test_gradients_match_the_reference():
    q, k, v = (t.requires_grad_() for t in qkv(nq=24, nk=40, hk=1))
    flash_attention(q, k, v, causal=True).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(q2, k2, v2, causal=True).sum().backward()
    for g, g2 in zip(grads, (q2.grad, k2.grad, v2.grad)):
        assert_close(g, g2, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 16, 4, 2048, 2048, 128), (1, 8, 8, 3000, 1777, 64), (1, 4, 1, 517, 4096, 80)])
def test_large_shapes_on_gpu(dtype, shape):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device="cuda")
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        assert_close(out, reference_attention(q, k, v, causal=causal))
        expected = reference_lse(q, k, causal=causal, sm_scale=1 / math.sqrt(d))
        finite = torch.isfinite(expected)
        torch.testing.assert_close(lse[finite].double(), expected[finite], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_mismatched_devices_on_gpu():
    q, k, v = random_qkv(1, 2, 8, 8, 32, device="cuda")
    with pytest.raises(ValueError, match="k is on cpu"):
        flash_attention(q, k.cpu(), v)


class _Replaying:
    """A FastLauncher stand-in for the kind path on any device: `bind` launches through the kernel itself (the
    interpreter on a CPU) and returns a bound launch that runs it again with fresh leading arguments."""

    def __init__(self, kernel):
        self.kernel, self.heads = kernel, []

    def bind(self, grid, args, meta, head):
        self.kernel[grid](*args, **meta)

        def bound(stream, *fresh):
            self.heads.append(fresh)
            self.kernel[grid](*fresh, *args[head:], **meta)
        return bound


class _OneDevice:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)


def test_a_kind_of_call_replays_its_first_launch_with_fresh_tensors(monkeypatch):
    """The forward's kind path with the GPU-only parts stood in (a key for any device, a launcher that replays):
    the second call of a kind skips `validate` and the choices, hands the bound launch q, k, v, O, lse and four
    (empty) descriptor slots, and gets the same output; another option is another kind, checked on its first
    call."""
    from utils.tiled.fast import launch

    monkeypatch.setattr(launch, "driver", _OneDevice)
    monkeypatch.setattr(launch, "kind_key", lambda tensors, options: (*options, *(
        (t.shape, t.stride(), t.dtype, t.device) for t in tensors)))
    replay = _Replaying(fast_forward._fwd_launcher.kernel)
    monkeypatch.setattr(fast_forward, "_fwd_launcher", replay)
    monkeypatch.setattr(fast_forward, "_KINDS", launch.kind_cache())
    q, k, v = qkv(nq=20, nk=30, d=32)
    first = flash_attention(q, k, v, causal=True)
    checked, validate = [], fast_forward.check_inputs
    monkeypatch.setattr(fast_forward, "check_inputs", lambda *a: checked.append(a) or validate(*a))
    fresh = [t.clone() for t in (q, k, v)]
    with monkeypatch.context() as m:   # nor are the steps and tiles chosen again
        m.setattr(fast_forward.Steps, "fastest", staticmethod(lambda *a: pytest.fail("the choices were made again")))
        again = flash_attention(*fresh, causal=True)
    (head,) = replay.heads
    assert not checked and len(fast_forward._KINDS) == 1 and len(head) == 9 and head[3] is not head[4]
    assert all(a is b for a, b in zip(head[:3], fresh)) and head[5:] == (None,) * 4
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert_close(again, reference_attention(q, k, v, causal=True))
    assert_close(flash_attention(q, k, v, causal=False), reference_attention(q, k, v))
    assert len(checked) == 1 and len(fast_forward._KINDS) == 2 and len(replay.heads) == 1


def test_the_forward_keeps_its_kinds_of_call_up_to_the_bound(monkeypatch):
    """One kind per new shape, but never more than launch.MAX_KINDS (here 2): the least recently used goes."""
    monkeypatch.setattr(launch, "kind_key", lambda tensors, options: (*options, *(
        (t.shape, t.stride(), t.dtype, t.device) for t in tensors)))   # a key on the CPU too
    monkeypatch.setattr(launch, "MAX_KINDS", 2)
    monkeypatch.setattr(fast_forward, "_KINDS", launch.kind_cache())
    shapes = [qkv(nq=n, nk=n, d=16) for n in (8, 9, 10, 11)]
    for q, k, v in shapes:
        assert_close(flash_attention(q, k, v), reference_attention(q, k, v))
    assert list(fast_forward._KINDS) == [fast_forward._call_key(*shapes[i], False, None) for i in (2, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the checks and the launch are kept for CUDA calls only")
def test_a_kind_of_call_is_checked_once_and_others_apart(monkeypatch):
    """A second forward of a kind (shapes, strides, dtypes, device, alignment, options, emulated GPU) skips the
    checks and runs the launch bound by the first: bitwise the same output, as Triton's own dispatch gives.
    A call that differs in any of those gets its own kind, and a bad argument is still refused."""
    from utils import gpu
    from utils.tiled.fast.launch import Bound, dispatch_by_triton

    q, k, v = random_qkv(2, 4, 300, 300, 64, dtype=torch.float16, device="cuda")
    fast_forward._KINDS.clear()
    first = flash_attention(q, k, v, causal=True, return_lse=True)
    checked, calls, run, validate = [], [], Bound.__call__, fast_forward.check_inputs
    monkeypatch.setattr(fast_forward, "check_inputs", lambda *a: checked.append(a) or validate(*a))

    def counted(bound, stream, *head):
        calls.append(len(head))
        run(bound, stream, *head)

    monkeypatch.setattr(Bound, "__call__", counted)
    again = flash_attention(*(t.clone() for t in (q, k, v)), causal=True, return_lse=True)
    assert len(fast_forward._KINDS) == 1 and calls == [9] and not checked   # q, k, v, o, lse, 4 descriptors
    with dispatch_by_triton():                                              # Triton's own dispatch
        through_triton = flash_attention(q, k, v, causal=True, return_lse=True)
    assert calls == [9]
    for a, b, c in zip(first, again, through_triton):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    others = {"alignment": ([misaligned(t) for t in (q, k, v)], {}),
              "strides": ([t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)], {}),
              "causal": ((q, k, v), dict(causal=False)), "scale": ((q, k, v), dict(sm_scale=0.2))}
    for n, (what, (tensors, options)) in enumerate(others.items(), start=2):
        options = {"causal": True, **options}
        expected = reference_attention(*tensors, **options)
        assert_close(flash_attention(*tensors, **options), expected, dtype=torch.float16)
        assert len(fast_forward._KINDS) == n and len(checked) == n - 1, what
    monkeypatch.setenv(gpu.EMULATE_VAR, "t4")                               # the T4's tiles: another kind
    assert_close(flash_attention(q, k, v, causal=True), first[0], dtype=torch.float16)
    assert len(fast_forward._KINDS) == 6
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="sm_scale must be finite and positive"):
        flash_attention(q, k, v, causal=True, sm_scale=-1.0)
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attention(q, k.float(), v, causal=True)
    assert len(fast_forward._KINDS) == 6


def test_launch_config_fits_the_gpus_shared_memory(monkeypatch):
    """The H200's tiles where they fit; smaller ones on a GPU with 64 KiB per block (a T4, or its emulation)."""
    from utils.tiled.fast.forward import launch_config
    from utils.tiled.forward import H200_TILES, SMALL_SMEM_TILES, smem_estimate

    assert smem_estimate(Config(128, 64, 8, 3), 128, 2) == 2 * 128 * (128 + 3 * 2 * 64)
    cuda = torch.device("cuda")
    monkeypatch.setattr("utils.gpu.shared_memory_per_block", lambda device=None: 227 * 1024)  # H100/H200
    assert launch_config(128, torch.bfloat16, cuda) == H200_TILES
    assert launch_config(256, torch.bfloat16, cuda) == Config(64, 64, 8, 2)
    monkeypatch.setattr("utils.gpu.shared_memory_per_block", lambda device=None: 64 * 1024)   # T4
    for d in (16, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.float32):
            config = launch_config(d, dtype, cuda)
            assert smem_estimate(config, d, torch.finfo(dtype).bits // 8) <= 64 * 1024, (d, dtype, config)
    assert launch_config(128, torch.float16, cuda) in SMALL_SMEM_TILES
    assert launch_config(64, torch.float16, torch.device("cpu")) == Config(32, 32, 4, 1)  # the interpreter


def test_fixed_tiles_triton_refused_are_not_picked_again(monkeypatch):
    """The fast forward's fixed tiles (short sequences) after Triton's "out of resource": the next of
    utils.tiled.forward.candidate_tiles for GPUs of that size, remembered; a caller's tiles are not replaced."""
    monkeypatch.setattr(fast_forward, "_TOO_BIG", set())
    fast_forward._fitted_config.cache_clear()
    a100 = 163 * 1024
    first = fast_forward.pick_config(128, torch.bfloat16, a100)
    assert fast_forward._drop_if_too_big(first, 128, torch.bfloat16, a100)
    assert not fast_forward._drop_if_too_big(first, 128, torch.bfloat16, a100), "dropped once"
    assert fast_forward.pick_config(128, torch.bfloat16, a100) == first._replace(num_stages=first.num_stages - 1)
    assert fast_forward.pick_config(128, torch.bfloat16, 2 * a100) == first, "other GPUs keep them"
    assert not fast_forward._drop_if_too_big(first, 128, torch.bfloat16, None)
    fast_forward._fitted_config.cache_clear()


@pytest.mark.gpu
def test_fixed_tiles_too_big_for_the_gpu_give_way_to_the_next(monkeypatch):
    huge = Config(256, 128, 8, 4)   # far beyond any GPU's shared memory per block at head dim 128
    monkeypatch.setattr(fast_forward, "_TOO_BIG", set())
    monkeypatch.setattr(fast_forward, "tiled_candidate_tiles", lambda d, dtype, smem=None: [huge, Config(64, 32, 4, 2)])
    fast_forward._fitted_config.cache_clear()
    fast_forward._KINDS.clear()
    try:
        q, k, v = (torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(2):   # the second call: the kind chosen again, bound to the tiles that fit
            o, _ = flash_attention_forward(q, k, v, causal=True)
            torch.testing.assert_close(o.float(), reference_attention(q, k, v, causal=True).float(), atol=2e-2,
                                       rtol=2e-2)
        from utils import gpu
        assert fast_forward._TOO_BIG == {(gpu.shared_memory_per_block(q.device), huge)}
    finally:
        fast_forward._fitted_config.cache_clear()
        fast_forward._KINDS.clear()
