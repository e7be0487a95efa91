"""The warp-specialised Gluon FP8 forward (utils.fp8.forward_ws): its checks on any machine, its sm_90 compile
from a CPU, and on an H100/H200 its outputs against exact attention and the Triton FP8 kernel."""
from __future__ import annotations

import math

import pytest
import torch

from utils import gpu
from utils.eager.reference import reference_attention
from utils.fp8 import forward, forward_ws

CUDA = torch.cuda.is_available()
SM90 = CUDA and gpu.capability() == (9, 0)


def quantized(b, h, hk, nq, nk, d, *, device="cuda", seed=0, block=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=gen)
    k, v = (torch.randn(b, hk, nk, d, generator=gen) for _ in range(2))
    q, k, v = (t.to(device) for t in (q, k, v))
    return (q, k, v), forward.quantize_inputs(q, k, v, block=block)


def test_every_listed_config_passes_its_checks():
    for d in forward_ws.HEAD_DIMS:
        for config in forward_ws.WS_TILES:
            assert forward_ws.check_config(config) == config
            assert forward_ws.smem_bytes(config, d) <= 227 * 1024
    assert forward_ws.smem_bytes(forward_ws.Config(128, 4, 240), 128) <= 192 * 1024   # the largest
    assert forward_ws.pick_config(128) in forward_ws.WS_TILES


@pytest.mark.parametrize("config, error, message", [
    ((128, 2, 240), TypeError, "config must be a utils.fp8.forward_ws.Config"),
    (forward_ws.Config(96, 2, 240), ValueError, "block_n must be 64 or 128"),
    (forward_ws.Config(128, 5, 240), ValueError, "stages 1 to 4"),
    (forward_ws.Config(128, 2, 250), ValueError, "consumer_regs must be a multiple of 8"),
])
def test_bad_configs_are_named(config, error, message):
    with pytest.raises(error, match=message):
        forward_ws.check_config(config)


def test_bad_inputs_are_named_before_any_launch():
    _, inputs = quantized(1, 2, 2, 70, 70, 64, device="cpu")
    with pytest.raises(ValueError, match="runs on an sm_90 GPU only"):
        forward_ws.fp8_attention_ws(*inputs, scale_block=64)
    with pytest.raises(TypeError, match="bf16 or fp16 .*|torch.bfloat16 or torch.float16"):
        forward_ws.fp8_attention_ws(*inputs, scale_block=64, out_dtype=torch.float32)
    _, narrow = quantized(1, 2, 2, 70, 70, 32, device="cpu")
    with pytest.raises(ValueError, match="head_dim 32 is not supported by the Gluon FP8 kernel"):
        forward_ws.fp8_attention_ws(*narrow, scale_block=64)
    q, k, vt, q_scale, k_scale, v_scale = inputs
    with pytest.raises(TypeError, match="q has dtype torch.float32"):   # the shared checks of the Triton kernel
        forward_ws.fp8_attention_ws(q.float(), k, vt, q_scale, k_scale, v_scale, scale_block=64)
    with pytest.raises(ValueError, match="vt must be V transposed"):
        forward_ws.fp8_attention_ws(q, k, vt.transpose(-2, -1), q_scale, k_scale, v_scale, scale_block=64)


def test_vt_is_padded_to_whole_tma_rows():
    vt = torch.zeros(1, 1, 64, 70, dtype=torch.float8_e4m3fn)
    _, _, padded = forward_ws._tma_layout(vt, vt, vt)
    assert padded.shape == vt.shape and padded.stride(-2) == 80 and padded.stride(-1) == 1
    aligned = torch.zeros(1, 1, 64, 96, dtype=torch.float8_e4m3fn)
    assert forward_ws._tma_layout(aligned, aligned, aligned)[2] is aligned


COMPILE_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch
from utils.fp8 import forward_ws as W
for d in W.HEAD_DIMS:
    q = torch.zeros(1, 2, 1024, d, dtype=torch.float8_e4m3fn)
    vt = torch.zeros(1, 2, d, 1024, dtype=torch.float8_e4m3fn)
    scales, v_scale = torch.ones(1, 2, 16), torch.ones(())
    o, lse = torch.empty(1, 2, 1024, d, dtype=torch.bfloat16), torch.empty(1, 2, 1024)
    for i, config in enumerate(W.WS_TILES):
        (launch,) = _capture(lambda: W._launch(q, q, vt, scales, scales, v_scale, o, lse, 64, i % 2 == 1, 0.1, config))
        kernel = compile_launch(launch, (9, 0))
        print(d, i, kernel.metadata.shared, kernel.asm["ptx"].count("wgmma.mma_async.sync.aligned") > 0,
              "e4m3" in kernel.asm["ptx"])
"""


@pytest.mark.full
@pytest.mark.skipif(CUDA, reason="checks this Triton compiling for sm_90 from a CPU; on a GPU the kernel runs")
def test_each_config_compiles_for_sm90_with_fp8_wgmma():
    from utils.course.cross_compile import script_in_fresh_process

    out = script_in_fresh_process(COMPILE_PROBE)
    lines = [line.split() for line in out.splitlines() if line.strip()]
    assert len(lines) == len(forward_ws.HEAD_DIMS) * len(forward_ws.WS_TILES)
    for d, i, shared, wgmma, e4m3 in lines:
        config = forward_ws.WS_TILES[int(i)]
        assert int(shared) <= 227 * 1024 and wgmma == e4m3 == "True", (d, config, shared)
        assert int(shared) >= forward_ws.smem_bytes(config, int(d)), (d, config, "smem_bytes counts too little")


def rmse(a, b) -> float:
    return math.sqrt((a.double() - b.double()).square().mean().item())


@pytest.mark.skipif(not SM90, reason="the Gluon FP8 kernel runs on an sm_90 GPU")
@pytest.mark.parametrize("config", forward_ws.WS_TILES, ids=lambda c: f"n{c.block_n}s{c.stages}")
@pytest.mark.parametrize("shape", [(2, 4, 2, 200, 200, 128, False), (1, 4, 4, 333, 333, 128, True),
                                   (1, 2, 1, 129, 517, 64, True), (1, 2, 2, 517, 129, 64, True),
                                   (1, 2, 2, 1024, 1024, 64, False)],
                         ids=lambda s: "b{}h{}hk{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_matches_exact_attention_as_the_triton_fp8_kernel_does(config, shape):
    """GQA, odd lengths, Nq != Nk with bottom-right causal alignment (rows that see no key: 0 and -inf)."""
    b, h, hk, nq, nk, d, causal = shape
    (q, k, v), inputs = quantized(b, h, hk, nq, nk, d, seed=nq + d)
    o, lse = forward_ws.fp8_attention_ws(*inputs, scale_block=64, causal=causal, config=config)
    o_triton, lse_triton = forward.fp8_attention_quantized(*inputs, scale_block=64, causal=causal)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=causal)
    assert o.dtype == torch.bfloat16 and o.shape == (b, h, nq, d) and lse.shape == (b, h, nq)
    assert torch.isfinite(o).all()
    assert rmse(o, exact) <= 1.25 * rmse(o_triton, exact) + 1e-4, (rmse(o, exact), rmse(o_triton, exact))
    seen = torch.isfinite(lse_triton)
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key"
    assert (o[~seen] == 0).all()
    torch.testing.assert_close(lse[seen], lse_triton[seen], atol=2e-2, rtol=0)
    worst = (o.float() - o_triton.float()).abs().amax(dim=(0, 1, 3))
    assert worst.max() < 0.15, f"rows {worst.topk(3).indices.tolist()} differ from the Triton kernel by {worst.max()}"
