"""utils.explicit.forward_ws (notebook 05b section 10): validation and tile checks on CPU, the ring protocol replayed
under random interleavings, the tile choice against the stored H200 benchmark, the compiled schedule (compiled for
sm_90 on this machine), and on an sm_90 GPU the kernel against float64 on odd shapes with every tile."""
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from utils.explicit import forward_ws as ws
from utils.explicit.backward import flash_attention_gluon_ws
from utils import gpu

on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")
BENCH = Path(__file__).resolve().parents[1] / "images" / "05b_gluon_ws_h200.json"
KERNEL_PARITY = lambda tile, stages: ((tile // stages) & 1) ^ 1   # noqa: E731  the producer's `free`


def test_inputs_are_checked_before_anything_is_built():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q is on cpu"):
        flash_attention_gluon_ws(q, q, q)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        flash_attention_gluon_ws(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="head_dim 32"):
        flash_attention_gluon_ws(q[..., :32], q[..., :32], q[..., :32])
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention_gluon_ws(q, q, q, causal=1)


@pytest.mark.parametrize("config,error,match", [
    ((128, 2, 232), TypeError, "must be a utils.explicit.forward_ws.Config"),
    (ws.Config(32, 2, 232), ValueError, "block_n must be 64 or 128"),
    (ws.Config(128, 5, 232), ValueError, "stages 1 to 4"),
    (ws.Config(128, 2, 230), ValueError, "multiple of 8 from 24 to 256"),
    (ws.Config(128, 2, 264), ValueError, "multiple of 8 from 24 to 256"),
    (ws.Config(128, 4, 232), ValueError, "exceeds the 227 KiB"),
])
def test_bad_tiles_are_named(config, error, match):
    with pytest.raises(error, match=match):
        ws.check_config(config, 128)


def test_every_benchmarked_tile_fits_both_head_dims():
    for config in ws.WS_TILES:
        for head_dim in (64, 128):
            assert ws.check_config(config, head_dim) is config


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_kernels_protocol_never_hangs_nor_refills_a_slot_still_read(stages):
    for n_tiles, seed in itertools.product(range(0, 10), range(40)):
        ws.replay_protocol(n_tiles, stages, KERNEL_PARITY, seed)


@pytest.mark.parametrize("parity,match", [
    (lambda t, s: (t // s) & 1, "hang with 1 tiles"),            # the consumers' parity: a fresh slot never frees
    (lambda t, s: 1, "refills slot|hang"),       # right on the first lap only: refills early, or waits forever
    (lambda t, s: (t & 1) ^ 1, "hang|refills"),                  # the tile's parity, not the lap's
], ids=["consumers' parity", "always 1", "tile parity"])
def test_a_wrong_parity_is_caught_and_named(parity, match):
    with pytest.raises(AssertionError, match=match):
        for stages, n_tiles, seed in itertools.product(range(1, 5), range(1, 10), range(20)):
            ws.replay_protocol(n_tiles, stages, parity, seed)


def test_the_picked_tile_is_the_fastest_of_the_stored_benchmark():
    """pick_config's tile per head dim is the one with the best geometric-mean TFLOP/s over N >= 4k, causal and
    not, in images/05b_gluon_ws_h200.json."""
    results = json.loads(BENCH.read_text())["results"]
    for head_dim in (64, 128):
        score = {}
        for c in ws.WS_TILES:
            rows = [r["tflops"] for r in results
                    if r["impl"] == ws.label(c) and r["head_dim"] == head_dim and r["seqlen"] >= 4096]
            assert len(rows) == 6, (c, head_dim)
            score[c] = math.fsum(math.log(t) for t in rows)
        assert ws.pick_config(head_dim) == max(score, key=score.get), (head_dim, score)


def test_the_stored_benchmark_says_how_it_was_made():
    data = json.loads(BENCH.read_text())
    env = data["environment"]
    assert env["gpu"] == "NVIDIA H200" and env["triton"] and env["torch"] and env["date"]
    assert env["command"].startswith("python -m utils.course.bench.forward") and "--ws-tiles" in env["command"]
    assert {"gluon", "gluon_ws", "triton", "sdpa-cudnn", "sdpa-flash"} <= {r["impl"] for r in data["results"]}
    assert all(r["error"] is None for r in data["results"])


def test_the_compiled_consumers_keep_one_product_in_flight_and_the_producer_gives_up_registers():
    """Compiled for sm_90 here, in a process without the interpreter: each tile's consumer loop issues both
    products before `wait(1)`, and the register split lowers some warps to 24 registers (the producer) and
    raises others to the tile's consumer_regs."""
    from utils.course.cross_compile import in_fresh_process

    printed = in_fresh_process("--schedule", "gluon_ws", "--head-dim", "128")
    schedules = {}
    for line in printed.splitlines()[1:]:
        tile, _, block = line.strip().partition(":")
        schedules.setdefault(tile, []).append(block.strip())
    assert list(schedules) == [ws.label(c).removeprefix("gluon_ws ") for c in ws.WS_TILES], printed
    for config, blocks in zip(ws.WS_TILES, schedules.values()):
        loops = [b for b in blocks if "wait(1)" in b]
        assert loops, blocks
        for loop in loops:
            events = loop.split()
            assert events.index("wait(1)") > max(i for i, e in enumerate(events) if e.startswith("wgmma"))
            assert sum(e == "commit" for e in events) == 2, loop
        regs = [int(r) for r in blocks[-1].removeprefix("setmaxnreg to ").split(", ")]
        assert 24 in regs and config.consumer_regs in regs, blocks[-1]


PINGPONG_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch
from utils.explicit import forward_ws as ws, forward_ws3 as ws3
mod, head_dim, plain = (ws, 128, ws.WS_TILES[0]) if {CONSUMERS} == 2 else (ws3, 64, ws3.WS3_TILES[0])
q, lse = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16), torch.zeros(1, 2, 1024)
for i, config in enumerate((plain, *mod.PINGPONG_TILES)):
    (launch,) = _capture(lambda: mod._launch(q, q, q, q, lse, True, 0.1, config))
    open(f"{DIR}/pp_{i}.ptx", "w").write(compile_launch(launch, (9, 0)).asm["ptx"])
    print(i)
"""


@pytest.mark.parametrize("consumers", [2, 3])
def test_the_pingpong_consumers_take_turns_around_their_products(consumers, tmp_path):
    """Compiled for sm_90 here, in a process without the interpreter: with `pingpong`, consumer w waits on named
    barrier 13 + w before its loop's two products and arrives on the next one's (round robin) after them, and the
    last consumer opens the first's first turn: 2 · consumers + 1 named-barrier instructions over 256 threads, none
    without `pingpong`."""
    import re
    from utils.course.cross_compile import script_in_fresh_process
    from utils.explicit import forward_ws3 as ws3

    mod = ws if consumers == 2 else ws3
    plain = (ws.WS_TILES if consumers == 2 else ws3.WS3_TILES)[0]
    configs = (plain, *mod.PINGPONG_TILES)
    out = script_in_fresh_process(PINGPONG_PROBE.replace("{CONSUMERS}", str(consumers)).replace("{DIR}",
                                                                                               str(tmp_path)))
    assert out.split() == [str(i) for i in range(len(configs))], out
    for i, config in enumerate(configs):
        ptx = (tmp_path / f"pp_{i}.ptx").read_text()
        turns = re.findall(r"bar\.(sync|arrive) (1[345]), 256;", ptx)
        if not config.pingpong:
            assert not turns, turns
            continue
        ids = [str(13 + w) for w in range(consumers)]
        expected = [("sync", b) for b in ids] + [("arrive", b) for b in ids] + [("arrive", ids[0])]
        assert sorted(turns) == sorted(expected), turns
        for b in ids:  # the products follow each wait
            at = ptx.index(f"bar.sync {b}, 256;")
            assert "wgmma.mma_async" in ptx[at:at + 20000] and ptx.index("wgmma.commit_group", at) < ptx.index(
                f"bar.arrive {str(13 + (int(b) - 12) % consumers)}, 256;", at), b


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config", ws.WS_TILES + ws.PINGPONG_TILES,
                         ids=lambda c: ws.label(c).removeprefix("gluon_ws "))
def test_every_tile_matches_the_reference(config, dtype, causal):
    from utils.course.testing import assert_matches_on_odd_shapes

    assert_matches_on_odd_shapes(ws.variant(config, "gluon_ws"), dtype=dtype, causal=causal)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_is_the_log_sum_exp_and_minus_inf_for_rows_that_see_no_key(causal):
    from utils.course.testing import random_qkv, reference_lse

    q, k, v = random_qkv(2, 4, 300, 200, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    _, lse = ws.flash_attention_forward(q, k, v, causal=causal)   # causal: the first 100 rows see no key
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal), rtol=0, atol=2e-2)
