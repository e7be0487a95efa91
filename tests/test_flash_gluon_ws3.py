"""utils.explicit.forward_ws3 (three consumer warpgroups, issue 78): validation on CPU, its ring protocol
replayed with three consumers, its compile for sm_90 on this machine (register split, no spills), and on an
sm_90 GPU the kernel against float64 on odd shapes with every tile."""
import itertools
import re
import shutil
import subprocess

import pytest
import torch

from utils import gpu
from utils.explicit import forward_ws as ws, forward_ws3 as ws3

on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")
KERNEL_PARITY = lambda tile, stages: ((tile // stages) & 1) ^ 1   # noqa: E731  the producer's `free`
SHAPES_64 = [(1, 1, 1, 1, 1, 64), (1, 4, 2, 200, 333, 64), (2, 3, 3, 256, 256, 64), (1, 2, 2, 129, 1500, 64),
             (1, 2, 1, 385, 100, 64), (1, 2, 2, 1000, 1000, 64)]


def test_inputs_are_checked_before_anything_is_built():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q is on cpu"):
        ws3.flash_attention_forward(q, q, q)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ws3.flash_attention_forward(q, q, q, causal=1)


@pytest.mark.parametrize("config,error,match", [
    ((128, 2, 160), TypeError, "must be a utils.explicit.forward_ws.Config"),
    (ws3.Config(32, 2, 160), ValueError, "block_n must be 64 or 128"),
    (ws3.Config(128, 5, 160), ValueError, "stages 1 to 4"),
    (ws3.Config(128, 2, 162), ValueError, "multiple of 8 from 24 to 256"),
])
def test_bad_tiles_are_named(config, error, match):
    with pytest.raises(error, match=match):
        ws3.check_config(config, 64)


def test_every_tile_fits_head_dim_64():
    assert ws3.HEAD_DIMS == (64,) and ws3.BLOCK_M == 192
    for config in ws3.WS3_TILES:
        assert ws3.check_config(config, 64) is config


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_protocol_with_three_consumers_never_hangs_nor_refills_a_slot_still_read(stages):
    for n_tiles, seed in itertools.product(range(0, 8), range(30)):
        ws.replay_protocol(n_tiles, stages, KERNEL_PARITY, seed, consumers=3)


def test_a_wrong_parity_is_caught_with_three_consumers():
    """The producer waiting with parity 1 at every lap: right on the first lap only, then early or never."""
    with pytest.raises(AssertionError, match="refills slot|hang"):
        for stages, n_tiles, seed in itertools.product(range(1, 4), range(1, 8), range(20)):
            ws.replay_protocol(n_tiles, stages, lambda t, s: 1, seed, consumers=3)


COMPILE_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch
from utils.explicit import forward_ws3 as W
q, lse = torch.zeros(1, 2, 1024, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 1024)
for i, config in enumerate(W.WS3_TILES):
    (launch,) = _capture(lambda: W._launch(q, q, q, q, lse, i % 2 == 1, 0.1, config))
    kernel = compile_launch(launch, (9, 0))
    open(f"{DIR}/ws3_{i}.ptx", "w").write(kernel.asm["ptx"])
    print(i, kernel.metadata.num_warps, kernel.metadata.shared)
"""


@pytest.mark.full
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this Triton compiling for sm_90 from a CPU; on a GPU "
                    "the kernel runs")
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (the CUDA toolkit) for its register report")
def test_each_tile_compiles_for_sm90_with_its_register_split_and_no_spills(tmp_path):
    from utils.course.cross_compile import script_in_fresh_process

    out = script_in_fresh_process(COMPILE_PROBE.replace("{DIR}", str(tmp_path)))
    lines = [line.split() for line in out.splitlines() if line.strip()]
    assert len(lines) == len(ws3.WS3_TILES), out
    for i, warps, shared in lines:
        config = ws3.WS3_TILES[int(i)]
        ptx = (tmp_path / f"ws3_{i}.ptx").read_text()
        regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        assert int(warps) == 16 and 24 in regs and config.consumer_regs in regs, (config, warps, regs)
        report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / f"ws3_{i}.ptx"), "-o",
                                 str(tmp_path / f"ws3_{i}.cubin")], capture_output=True, text=True, check=True)
        assert "0 bytes spill stores" in report.stderr, (config, report.stderr)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config", ws3.WS3_TILES + ws3.PINGPONG_TILES,
                         ids=lambda c: ws3.label(c).removeprefix("gluon_ws3 "))
def test_every_tile_matches_the_reference(config, dtype, causal):
    from utils.course.testing import assert_matches_on_odd_shapes

    assert_matches_on_odd_shapes(ws3.variant(config, "gluon_ws3"), dtype=dtype, causal=causal, shapes=SHAPES_64)


@on_hopper
def test_head_dim_128_is_refused_with_a_pointer_to_the_two_consumer_kernel():
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 128 is not supported by the three-consumer kernel"):
        ws3.flash_attention_forward(q, q, q)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_is_the_log_sum_exp_and_minus_inf_for_rows_that_see_no_key(causal):
    from utils.course.testing import random_qkv, reference_lse

    q, k, v = random_qkv(2, 4, 300, 200, 64, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    _, lse = ws3.flash_attention_forward(q, k, v, causal=causal)   # causal: the first 100 rows see no key
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal), rtol=0, atol=2e-2)


def test_notebook_09_reads_the_tile_the_kernel_picks():
    from utils.course.references import FORWARD_RUNS

    assert FORWARD_RUNS["gluon_ws3"][1] == ws3.label(ws3.pick_config(64))
