"""Helpers of the backward benchmark (notebook 07); the measurement itself needs a GPU."""
import pytest
import torch

from utils.bench.backward import (format_table, load_results, plot_backward_benchmark, ratios,
                                  run_backward_benchmark, save_results)

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_run_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA"):
        run_backward_benchmark()


@pytest.mark.gpu
def test_run_small_on_gpu():
    rows = run_backward_benchmark(seqlens=(512,), head_dims=(64,), causal=(True,), batch=1, heads=2,
                                  backends=("triton", "sdpa_flash"))
    assert all(r["tflops"] and r["tflops"] > 0 for r in rows), rows
    with pytest.raises(ValueError):
        run_backward_benchmark(backends=("nope",))
