"""utils.explicit.forward (notebook 05b section 9): validation and tile checks on CPU, the tile choice against the
stored H200 benchmark, the compiled schedule (compiled for sm_90 on this machine), and on an sm_90 GPU the kernel
against float64 on odd shapes with every tile."""
import json
import math
from pathlib import Path

import pytest
import torch

from utils.explicit import forward as fg
from utils.explicit.backward import flash_attention_gluon
from utils import gpu

on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")
BENCH = Path(__file__).resolve().parents[1] / "images" / "05b_gluon_h200.json"


def test_inputs_are_checked_before_anything_is_built():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q is on cpu"):
        flash_attention_gluon(q, q, q)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        flash_attention_gluon(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="head_dim 32"):
        flash_attention_gluon(q[..., :32], q[..., :32], q[..., :32])
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention_gluon(q, q, q, causal="yes")
    with pytest.raises(ValueError, match="k has batch"):
        flash_attention_gluon(q, torch.cat([q, q]), torch.cat([q, q]))


@pytest.mark.parametrize("config,error,match", [
    ((64, 128, 4, 2), TypeError, "must be a utils.explicit.forward.Config"),
    (fg.Config(128, 128, 4, 2), ValueError, "block_m must be 16 \\* num_warps"),
    (fg.Config(32, 128, 2, 2), ValueError, "4 or 8 warps"),
    (fg.Config(64, 32, 4, 2), ValueError, "block_n must be 64 or 128"),
    (fg.Config(64, 128, 4, 0), ValueError, "stages 1 to 4"),
    (fg.Config(128, 128, 8, 4), ValueError, "exceeds the 227 KiB"),
])
def test_bad_tiles_are_named(config, error, match):
    with pytest.raises(error, match=match):
        fg.check_config(config, 128)


def test_fixed_tiles_calls_the_forward_with_its_config_and_keeps_the_output():
    calls = []

    def forward(q, k, v, *, causal, sm_scale, config):
        calls.append((q, k, v, causal, sm_scale, config))
        return "o", "lse"

    fn = fg.fixed_tiles(forward, "tiles", "gluon x")
    assert fn.__name__ == "gluon x" and fn(1, 2, 3, causal=True) == "o"
    assert calls == [(1, 2, 3, True, None, "tiles")]
    assert fg.variant(fg.GLUON_TILES[0], "gluon").__name__ == "gluon"


def test_both_forwards_share_the_ring_checks():
    """check_rings: the key tile, the ring depth and shared memory, for a Q tile of any height (the
    warp-specialised forward's is 128 rows whatever its config)."""
    c = fg.Config(64, 128, 4, 2)
    assert fg.check_rings(c, 128, 64) is c
    with pytest.raises(ValueError, match="exceeds the 227 KiB"):
        fg.check_rings(fg.Config(64, 128, 4, 4), 128, 64)
    with pytest.raises(ValueError, match="block_n must be 64 or 128 and stages 1 to 4"):
        fg.check_rings(fg.Config(64, 32, 4, 2), 128, 64)


def test_every_benchmarked_tile_fits_both_head_dims():
    for config in fg.GLUON_TILES:
        for head_dim in fg.HEAD_DIMS:
            assert fg.check_config(config, head_dim) is config


def test_the_picked_tile_is_the_fastest_of_the_stored_benchmark():
    """pick_config's tile per head dim is the one with the best geometric-mean TFLOP/s over N >= 4k, causal
    and not, in images/05b_gluon_h200.json (N < 4k is bound by the host's launch, notebook 05b section 7)."""
    results = json.loads(BENCH.read_text())["results"]
    for head_dim in fg.HEAD_DIMS:
        score = {}
        for c in fg.GLUON_TILES:
            label = f"gluon {c.block_m}x{c.block_n} w{c.num_warps} s{c.stages}"
            rows = [r["tflops"] for r in results
                    if r["impl"] == label and r["head_dim"] == head_dim and r["seqlen"] >= 4096]
            assert len(rows) == 6, (label, head_dim)
            score[c] = math.fsum(math.log(t) for t in rows)
        best = max(score, key=score.get)
        assert fg.pick_config(head_dim) == best, (head_dim, score)


def test_the_stored_benchmark_says_how_it_was_made():
    data = json.loads(BENCH.read_text())
    env = data["environment"]
    assert env["gpu"] == "NVIDIA H200" and env["triton"] and env["torch"] and env["date"]
    assert env["command"].startswith("python -m utils.course.bench.forward") and "--gluon-tiles" in env["command"]
    impls = {r["impl"] for r in data["results"]}
    assert {"gluon", "triton", "sdpa-cudnn", "sdpa-flash"} <= impls
    assert all(r["error"] is None for r in data["results"])


def test_the_compiled_loop_keeps_one_product_in_flight_through_the_softmax():
    """Compiled for sm_90 here (no GPU needed), in a process without the interpreter: in every tile's loop the
    scores' wgmmas and the P·V wgmmas are both issued, then `wait(1)` lets the P·V product run on while the
    softmax starts."""
    from utils.course.cross_compile import in_fresh_process

    printed = in_fresh_process("--schedule", "gluon", "--head-dim", "64")
    schedules = {}
    for line in printed.splitlines()[1:]:
        tile, _, block = line.strip().partition(":")
        schedules.setdefault(tile, []).append(block.strip())
    assert len(schedules) == len(fg.GLUON_TILES), printed
    for tile, blocks in schedules.items():
        loop = [b for b in blocks if "wait(1)" in b]
        assert len(loop) == 1, (tile, blocks)
        events = loop[0].split()
        assert events.index("wait(1)") > max(i for i, e in enumerate(events) if e.startswith("wgmma"))
        assert sum(e == "commit" for e in events) == 2, (tile, loop)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("config", fg.GLUON_TILES, ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.stages}")
def test_every_tile_matches_the_reference(config, dtype, causal):
    from utils.course.testing import assert_matches_on_odd_shapes

    assert_matches_on_odd_shapes(fg.variant(config, "gluon"), dtype=dtype, causal=causal)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_is_the_log_sum_exp_and_minus_inf_for_rows_that_see_no_key(causal):
    from utils.course.testing import random_qkv, reference_lse

    q, k, v = random_qkv(2, 4, 300, 200, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    _, lse = fg.flash_attention_forward(q, k, v, causal=causal)   # causal: the first 100 rows see no key
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal=causal), rtol=0, atol=2e-2)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_ring_never_waits_for_a_copy_not_issued_nor_refills_a_slot_still_read(stages):
    """ring_schedule, the kernel's order of copies and waits: each tile is copied once, after the wait for the
    tile that last used its slot and before its own wait; every tile of K and V is waited for, in order."""
    for n_tiles in range(0, 12):
        issued, waited = {"K": [], "V": []}, {"K": [], "V": []}
        for event, ring, tile in fg.ring_schedule(n_tiles, stages):
            if event == "issue":
                assert tile not in issued[ring] and tile < n_tiles
                if tile >= stages:   # the slot's previous tile has been waited for (its product done)
                    assert tile - stages in waited[ring], (ring, tile, stages, n_tiles)
                issued[ring].append(tile)
            else:
                assert tile in issued[ring], (ring, tile, stages, n_tiles)
                waited[ring].append(tile)
        assert waited["K"] == waited["V"] == list(range(n_tiles))
