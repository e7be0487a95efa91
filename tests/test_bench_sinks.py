"""The sinks benchmark (utils.course.bench.sinks): its counts and arguments on any machine, a small run on a GPU."""
from __future__ import annotations

import pytest
import torch

from utils.course.bench import sinks as bench
from utils.sinks.reference import visible_keys


@pytest.mark.parametrize("n", [1, 7, 64, 130])
def test_visible_pairs_counts_what_the_mask_keeps(n):
    for window in (None, 1, 3, 64, 129, 500):
        assert bench.visible_pairs(n, window) == int(visible_keys(n, n, causal=True, window=window).sum()), window


def test_flops_count_the_window():
    full = bench.step_flops(2, 16, 16384, 64, None, "fwd")
    assert full == 4 * 2 * 16 * 64 * 16384 * 16385 / 2
    windowed = bench.step_flops(2, 16, 16384, 64, 128, "fwd")
    assert windowed == 4 * 2 * 16 * 64 * (128 * 129 / 2 + (16384 - 128) * 128)
    assert bench.step_flops(2, 16, 16384, 64, 128, "bwd") == 2.5 * windowed
    with pytest.raises(ValueError, match="mode"):
        bench.step_flops(2, 16, 16384, 64, None, "train")
    with pytest.raises(ValueError, match="window must be positive"):
        bench.visible_pairs(100, 0)


def test_arguments():
    args = bench.parse_args([])
    assert args.out == bench.DEFAULT_OUT and args.out.name == "11_sinks_h200.json"
    assert args.impls == list(bench.IMPLS) and args.windows == [4096, 128] and args.head_dim == 64
    assert bench.parse_args(["--windows"]).windows == []
    for bad in (["--impls", "flex"], ["--seqlens", "0"], ["--windows", "-1"], ["--heads", "12", "--kv-heads", "8"],
                ["--rep", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_only_the_sink_kernels_run_a_window():
    assert bench._attention("triton", None, 128) is None and bench._attention("sdpa-cudnn", None, 128) is None
    assert callable(bench._attention("sinks", None, 128))
    with pytest.raises(ValueError, match="impl must be one of"):
        bench._attention("flex", None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_benchmark_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_small_run_writes_every_row(tmp_path):
    import json

    data = bench.main(["--seqlens", "512", "--tokens", "1024", "--heads", "4", "--kv-heads", "2", "--windows", "64",
                       "--decode-seqlens", "1024", "--decode-batch", "2", "--rep", "5", "--warmup", "1",
                       "--copy-mib", "16", "--out", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text()) == data
    ours = [r for r in data["results"] if r["impl"] == "sinks"]
    assert [(r["window"], r["mode"]) for r in ours] == [(None, "fwd"), (None, "bwd"), (64, "fwd"), (64, "bwd")]
    assert all(r["error"] is None and r["tflops"] > 0 for r in ours)
    assert {r["impl"] for r in data["results"] if r["window"] == 64} <= {"sinks", "flash-attn-4"}
    for row in data["results"]:
        if row["impl"] == "flash-attn-4" and row["mode"] == "fwd":
            assert row["max_err"] is not None
    assert [r["window"] for r in data["decode"]] == [None, 64]
    assert all(r["error"] is None and r["gbps"] > 0 and r["eager_ms"] > 0 for r in data["decode"])
    assert data["decode"][1]["keys"] == 64 and data["decode"][0]["keys"] == 1024
