"""Helpers of the backward benchmark (notebook 07); the measurement itself needs a GPU."""
import json

import pytest
import torch

from utils.course.bench import backward_tiles
from utils.course.bench.backward import (COLORS, KNOWN, TRITON_LOADS, format_ratios, format_table, load_results,
                                         plot_backward_benchmark, ratios, run_backward_benchmark, save_results,
                                         triton_loads, triton_tiles)
from utils.tiled.fast.backward import Config, _fitted_config

ROWS = [dict(backend=b, seqlen=n, head_dim=64, causal=c, ms=1.0, tflops=t, error=None)
        for n in (2048, 4096) for c in (False, True)
        for b, t in (("triton", 300.0), ("sdpa_flash", 250.0), ("sdpa_cudnn", 400.0))]


def test_ratios_and_table():
    r = ratios(ROWS)
    assert r[(2048, 64, False)] == pytest.approx(1.2) and len(r) == 4
    assert ratios(ROWS, "triton", "sdpa_cudnn")[(4096, 64, True)] == pytest.approx(0.75)
    table = format_table(ROWS)
    assert "1.20x" in table and table.count("\n") == 4
    with pytest.raises(ValueError):
        ratios(ROWS, "nope")


def test_save_load_and_plot(tmp_path):
    path = save_results(ROWS, tmp_path / "r.json", gpu="test")
    meta, rows = load_results(path)
    assert meta == {"gpu": "test"} and rows == ROWS
    fig = plot_backward_benchmark(ROWS, title="t")
    assert len(fig.axes) == 1
    with pytest.raises(ValueError):
        plot_backward_benchmark([])


def test_every_backend_has_a_colour_in_the_plot():
    assert set(KNOWN) <= set(COLORS), sorted(set(KNOWN) - set(COLORS))
    rows = [dict(r, backend=b) for r in ROWS[:1] for b in KNOWN]
    assert len(plot_backward_benchmark(rows).axes[0].lines) == len(KNOWN)


def test_each_pinned_gluon_backend_replaces_fields_of_the_config():
    """GLUON_PINNED's backends time pick_config's Config with these fields replaced: each a field it has, and
    no two backends with the same replacement."""
    from utils.course.bench.backward import GLUON_PINNED
    from utils.explicit.backward import Config

    assert all(fields and set(fields) <= set(Config._fields) for fields in GLUON_PINNED.values()), GLUON_PINNED
    assert len({tuple(sorted(f.items())) for f in GLUON_PINNED.values()}) == len(GLUON_PINNED)
    assert set(GLUON_PINNED) <= set(KNOWN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_run_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA"):
        run_backward_benchmark()


@pytest.mark.parametrize("rounds", [0, 1.5, True])
def test_rounds_are_checked(rounds):
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        run_backward_benchmark(rounds=rounds)


@pytest.mark.gpu
def test_run_small_on_gpu():
    rows = run_backward_benchmark(seqlens=(512,), head_dims=(64,), causal=(True,), batch=1, heads=2,
                                  backends=("triton", "sdpa_flash"))
    assert all(r["tflops"] and r["tflops"] > 0 for r in rows), rows
    with pytest.raises(ValueError):
        run_backward_benchmark(backends=("nope",))


@pytest.mark.gpu
def test_pinned_loads_on_gpu():
    """triton_pointer, triton_tma and triton_tma_stats time the same backward with its loads pinned; TMA runs on
    sm_90+ only."""
    from utils import gpu

    rows = run_backward_benchmark(seqlens=(512,), head_dims=(128,), causal=(False,), batch=1, heads=2,
                                  backends=("triton", *TRITON_LOADS), rounds=2)
    by = {r["backend"]: r for r in rows}
    assert by["triton"]["tflops"] > 0 and by["triton_pointer"]["tflops"] > 0, rows
    if gpu.capability() >= (9, 0):
        assert by["triton_tma"]["tflops"] > 0 and by["triton_tma_stats"]["tflops"] > 0, rows
    else:
        for name in ("triton_tma", "triton_tma_stats"):
            assert by[name]["ms"] is None and "tma=True needs an sm_90" in by[name]["error"], rows


@pytest.mark.gpu
def test_dq_by_atomics_and_by_bulk_reduce_on_gpu():
    """triton_atomic_dq and triton_reduce_dq (worklog 07w, section 4): the bulk reduce-add needs sm_90+, and
    says so in the row elsewhere."""
    from utils import gpu

    rows = run_backward_benchmark(seqlens=(512,), head_dims=(64,), causal=(True,), batch=1, heads=2,
                                  backends=("triton", "triton_atomic_dq", "triton_reduce_dq"))
    by = {r["backend"]: r for r in rows}
    assert by["triton"]["tflops"] > 0 and by["triton_atomic_dq"]["tflops"] > 0, rows
    if gpu.capability() >= (9, 0):
        assert by["triton_reduce_dq"]["tflops"] > 0, rows
    else:
        assert by["triton_reduce_dq"]["ms"] is None and 'needs an sm_90+' in by["triton_reduce_dq"]["error"], rows


@pytest.mark.gpu
def test_the_gluon_backwards_launch_orders_on_gpu():
    """gluon_bwd_by_head and gluon_bwd_grouped (worklog 07w, section 5) time the Gluon backward with its launch
    order pinned: on sm_90 only, and the rows say so elsewhere."""
    from utils import gpu

    backends = ("gluon_bwd", "gluon_bwd_by_head", "gluon_bwd_grouped")
    rows = run_backward_benchmark(seqlens=(1024,), head_dims=(128,), causal=(True,), batch=2, heads=3,
                                  backends=backends)
    assert [r["backend"] for r in rows] == list(backends), rows
    for r in rows:
        if gpu.capability() == (9, 0):
            assert r["tflops"] > 0, rows
        else:
            assert r["ms"] is None and "sm_90" in r["error"], rows


def test_a_run_records_where_triton_uses_tma():
    assert triton_loads([64, 128]) == {"d64_full": False, "d64_causal": False, "d128_full": True,
                                       "d128_causal": True}


# ---- the tile sweep behind pick_config (utils.course.bench.backward_tiles) ----------------------------------------
TILE_ROWS = [dict(head_dim=64, causal=False, kernel="dq", tiles=[128, 64, 8, 3], ms=2.0, error=None),
             dict(head_dim=64, causal=False, kernel="dq", tiles=[64, 64, 4, 3], ms=1.0, error=None),
             dict(head_dim=64, causal=False, kernel="dq", tiles=[64, 128, 4, 2], ms=None, error="OutOfResources"),
             dict(head_dim=64, causal=False, kernel="dkdv", tiles=[32, 128, 4, 3], ms=3.0, error=None)]


def test_candidate_config_replaces_one_pass_only():
    base = Config()
    c = backward_tiles.candidate_config(base, "dq", (64, 32, 8, 2))
    assert (c.block_m2, c.block_n2, c.warps2, c.stages2) == (64, 32, 8, 2)
    assert (c.block_m1, c.block_n1, c.warps1, c.stages1) == (base.block_m1, base.block_n1, base.warps1, base.stages1)
    c = backward_tiles.candidate_config(base, "dkdv", (64, 128, 8, 3))
    assert (c.block_m1, c.block_n1, c.block_m2) == (64, 128, base.block_m2)
    with pytest.raises(ValueError, match="which must be one of"):
        backward_tiles.candidate_config(base, "dk", (64, 128, 8, 3))
    with pytest.raises(ValueError, match="tiles must be"):
        backward_tiles.candidate_config(base, "dq", (64, 128))
    with pytest.raises(ValueError, match="power of two"):   # Config's own check still applies
        backward_tiles.candidate_config(base, "dq", (48, 128, 4, 3))


def test_fastest_and_table_skip_failed_candidates():
    assert backward_tiles.fastest(TILE_ROWS, 64, False, "dq") == ((64, 64, 4, 3), 1.0)
    assert backward_tiles.fastest(TILE_ROWS, 64, False, "dkdv") == ((32, 128, 4, 3), 3.0)
    with pytest.raises(ValueError, match="no timed dq candidates for head_dim=128"):
        backward_tiles.fastest(TILE_ROWS, 128, False, "dq")
    table = backward_tiles.format_table(TILE_ROWS).splitlines()
    assert table[1] == "d=64  full   dq  : 128x64x8x3 2.00, 64x64x4x3 1.00, 64x128x4x2 failed"
    assert table[0].startswith("d=64  full   dkdv: 32x128x4x3 1.00")


def test_sweep_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the sweep runs (python -m utils.course.bench.backward_tiles)")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        backward_tiles.sweep()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_default_tiles_are_within_tolerance_of_the_stored_fastest(head_dim, causal):
    """pick_config's 16-bit tiles are what the stored H200 sweep measured fastest, give or take its noise."""
    rows = json.loads(backward_tiles.DEFAULT_OUT.read_text())["rows"]
    config = _fitted_config(head_dim, torch.bfloat16, causal, None)   # the H200's choice, even in the interpreter
    for which, fields in backward_tiles.PASSES.items():
        chosen = tuple(getattr(config, f) for f in fields)
        timed = backward_tiles.timings(rows, head_dim, causal, which)
        _, best = backward_tiles.fastest(rows, head_dim, causal, which)
        assert chosen in timed, f"{which} tiles {chosen} were not in the sweep"
        assert timed[chosen] <= best * (1 + backward_tiles.TOLERANCE), (which, chosen, timed[chosen] / best)


def test_a_run_records_the_tiles_it_measured():
    tiles = triton_tiles([64, 128], torch.bfloat16)
    assert sorted(tiles) == ["d128_causal", "d128_full", "d64_causal", "d64_full"]
    assert tiles["d128_full"] == dict(block_m1=64, block_n1=128, warps1=8, stages1=3,
                                      block_m2=128, block_n2=64, warps2=8, stages2=3)
    assert Config(**tiles["d64_full"]) == _fitted_config(64, torch.bfloat16, False, None)
    t4 = triton_tiles([128], torch.bfloat16, smem=64 * 1024)   # a T4's tiles shrink to fit its shared memory
    assert Config(**t4["d128_full"]) == _fitted_config(128, torch.bfloat16, False, 64 * 1024) != \
        Config(**tiles["d128_full"])


def test_format_ratios_divides_each_pair_at_the_shapes_that_have_all():
    row = lambda b, n, d, c, t: dict(backend=b, seqlen=n, head_dim=d, causal=c, tflops=t)
    rows = [row("cuda_hopper_dv_late", 4096, 64, False, 420.0), row("cuda_hopper_edge_mask", 4096, 64, False, 400.0),
            row("gluon_bwd", 4096, 64, False, 480.0),
            row("cuda_hopper_dv_late", 4096, 128, True, 300.0), row("cuda_hopper_edge_mask", 4096, 128, True, 330.0),
            row("gluon_bwd", 4096, 128, True, 400.0),
            row("cuda_hopper_dv_late", 16384, 64, False, 460.0)]   # no Gluon run there: no line
    pairs = [("cuda_hopper_dv_late", "cuda_hopper_edge_mask"), ("cuda_hopper_dv_late", "gluon_bwd")]
    lines = format_ratios(rows, pairs, tflops="cuda_hopper_dv_late").splitlines()
    assert lines[0].split() == ["D", "mask", "N", "dv_late", "TFLOP/s", "dv_late", "/", "edge_mask", "dv_late", "/",
                                "gluon"]
    assert [line.split() for line in lines[1:]] == [["64", "none", "4096", "420", "1.05", "0.88"],
                                                   ["128", "causal", "4096", "300", "0.91", "0.75"]]
    assert len(format_ratios(rows, pairs).splitlines()[1].split()) == 5   # no TFLOP/s column
    with pytest.raises(ValueError, match="unknown backend"):
        format_ratios(rows, [("cuda_hopper_dv_late", "no_such")])
    with pytest.raises(ValueError, match="no shape"):
        format_ratios(rows, [("cuda_hopper_dv_late", "sdpa_cudnn")])
    with pytest.raises(TypeError, match="pairs"):
        format_ratios(rows, ["cuda_hopper_dv_late"])
