"""The pure parts of utils.course.bench.forward: arguments, the records, the JSON, the table and the plot (fake timings)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from utils.course.bench import forward as bm
from utils.course.bench import attention_flops, error_line, median_rows, rotated


def test_defaults_are_the_course_benchmark():
    args = bm.parse_args([])
    assert args.impls == ["triton"] and args.sdpa == ["flash", "cudnn", "efficient"]
    assert (args.batch, args.heads, args.dtype) == (4, 16, "bf16") and args.head_dims == [64, 128]
    assert args.seqlens == [1024, 2048, 4096, 8192, 16384] and args.causal == "both"
    assert len(bm.configurations(args)) == 2 * 2 * 5


def test_parse_args_options():
    args = bm.parse_args(["--impls", "triton", "naive", "--sdpa", "flash", "--seqlens", "128", "256",
                          "--head-dims", "64", "--causal", "yes", "--name", "quick"])
    assert args.impls == ["triton", "naive"] and args.sdpa == ["flash"] and args.name == "quick"
    assert bm.configurations(args) == [(64, True, 128), (64, True, 256)]


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--seqlens", "-1"], ["--sdpa", "math"], ["--impls", "--sdpa"],
                                  ["--name", "a/b"], ["--dtype", "int8"]])
def test_parse_args_rejects_bad_values(argv):
    with pytest.raises(SystemExit):
        bm.parse_args(argv)


def test_candidates_names_unknown_implementations():
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        bm.candidates(SimpleNamespace(impls=["nope"], sdpa=[]))
    fns = bm.candidates(SimpleNamespace(impls=["naive"], sdpa=["flash", "cudnn"]))
    assert list(fns) == ["naive", "sdpa-flash", "sdpa-cudnn"] and all(map(callable, fns.values()))


def test_worklog_adds_notebook_05b_steps_between_impls_and_sdpa():
    from utils.course.worklogs.triton_forward import WORKLOG
    args = bm.parse_args(["--worklog", "--sdpa", "cudnn"])
    fns = bm.candidates(args)
    assert list(fns) == ["triton", *WORKLOG, "sdpa-cudnn"] and all(map(callable, fns.values()))
    assert not bm.parse_args([]).worklog


def test_sweep_adds_each_tile_config_with_and_without_tma():
    from utils.course.worklogs.triton_forward import SWEEP_CONFIGS
    fns = bm.candidates(bm.parse_args(["--sweep", "--impls", "--sdpa", "flash"]))
    assert len(fns) == 2 * len(SWEEP_CONFIGS) + 1 and "tiles 128x64 w8 s3" in fns and "tiles 128x64 w8 s3 TMA" in fns
    assert fns["tiles 64x64 w4 s3 TMA"].__name__ == "tiles 64x64 w4 s3 TMA"


def test_overlap_adds_each_tuned_tile_in_order_and_overlapped():
    from utils.tiled.fast.forward import TUNE_TILES
    fns = bm.candidates(bm.parse_args(["--overlap", "--impls", "--sdpa", "cudnn"]))
    assert list(fns) == [*(bm.step_label(c, "overlap", o) for c in TUNE_TILES for o in (False, True)), "sdpa-cudnn"]
    assert "tiles 128x128 w8 s3 overlapped" in fns and "tiles 64x64 w4 s3 in order" in fns
    assert fns["tiles 128x64 w8 s3 overlapped"].__name__ == "tiles 128x64 w8 s3 overlapped"


def test_gluon_tiles_adds_the_gluon_kernel_with_each_tile():
    from utils.explicit.forward import GLUON_TILES
    fns = bm.candidates(bm.parse_args(["--gluon-tiles", "--impls", "triton", "--sdpa", "cudnn"]))
    labels = [f"gluon {c.block_m}x{c.block_n} w{c.num_warps} s{c.stages}" for c in GLUON_TILES]
    assert list(fns) == ["triton", *labels, "sdpa-cudnn"]
    assert fns["gluon 64x128 w4 s2"].__name__ == "gluon 64x128 w4 s2"


def test_exp2_fma_adds_each_tuned_tile_with_each_share_of_exponentials_on_fma():
    from utils.tiled.fast.forward import TUNE_TILES
    fns = bm.candidates(bm.parse_args(["--exp2-fma", "--impls", "--sdpa", "cudnn"]))
    assert list(fns) == [*(bm.step_label(c, "exp2_fma", n) for c in TUNE_TILES for n in (0, 2, 4)), "sdpa-cudnn"]
    assert "tiles 128x64 w8 s3 exp2 1/4 on FMA" in fns and "tiles 64x64 w4 s3 exp2 on MUFU" in fns
    with pytest.raises(KeyError):
        bm.step_label(TUNE_TILES[0], "lazy_rescale", True)


def fake_records(tmp_path=None):
    args = bm.parse_args(["--seqlens", "64", "128", "--head-dims", "16", "--batch", "1", "--heads", "2",
                          "--sdpa", "flash", "--impls", "naive", "--dtype", "fp32"])
    speed = {"naive": 2.0, "sdpa-flash": 1.0}          # naive pretends to be twice as fast
    fail = {"naive": False, "sdpa-flash": True}

    def time_ms(fn, q, k, v, causal):
        assert q.shape == (1, 2, q.shape[2], 16) and q.dtype == torch.float32
        if fail[fn.label] and q.shape[2] == 128 and causal:
            raise RuntimeError("No available kernel.\nmore")
        return attention_flops(1, 2, q.shape[2], q.shape[2], 16, causal=causal) / speed[fn.label] / 1e9

    fns = {name: SimpleNamespace(label=name) for name in speed}
    return args, bm.run(args, fns, time_ms=time_ms, device="cpu", progress=False)


def test_run_records_tflops_and_failures():
    args, records = fake_records()
    assert len(records) == 2 * 2 * 2
    ok = [r for r in records if r["error"] is None]
    assert {round(r["tflops"], 6) for r in ok if r["impl"] == "naive"} == {2.0}
    (failed,) = [r for r in records if r["error"]]
    assert failed["impl"] == "sdpa-flash" and failed["tflops"] is None
    assert failed["error"] == "RuntimeError: No available kernel."


def test_rounds_rotate_the_order_and_keep_the_median(tmp_path):
    args = bm.parse_args(["--impls", "naive", "--sdpa", "flash", "--seqlens", "64", "--head-dims", "16",
                          "--causal", "no", "--batch", "1", "--heads", "2", "--rounds", "3"])
    times = {"naive": iter([5.0, 1.0, 2.0]), "sdpa-flash": iter([9.0, 2.0, 3.0])}  # an outlier each
    calls = []

    def time_ms(fn, q, k, v, causal):
        calls.append(fn.label)
        return next(times[fn.label])

    fns = {name: SimpleNamespace(label=name) for name in times}
    records = bm.run(args, fns, time_ms=time_ms, device="cpu", progress=False)
    assert calls == ["naive", "sdpa-flash", "sdpa-flash", "naive", "naive", "sdpa-flash"]
    assert {r["impl"]: r["ms"] for r in records} == {"naive": 2.0, "sdpa-flash": 3.0}
    data = json.loads(bm.write_json(records, args, tmp_path / "r.json").read_text())
    assert data["settings"]["rounds"] == 3
    assert "rounds" not in json.loads(bm.write_json(records, bm.parse_args([]), tmp_path / "s.json").read_text())[
        "settings"]
    with pytest.raises(SystemExit):
        bm.parse_args(["--rounds", "0"])


def test_ratio_table_and_format():
    _, records = fake_records()
    rows = bm.ratio_table(records, "naive", ["sdpa-flash"])
    assert len(rows) == 4
    assert all(r["vs sdpa-flash"] == pytest.approx(2.0) for r in rows if not (r["seqlen"] == 128 and r["causal"]))
    assert [r["vs sdpa-flash"] for r in rows if r["seqlen"] == 128 and r["causal"]] == [None]
    text = bm.format_table(records)
    assert "naive/sdpa-flash" in text and "2.00" in text and "—" in text and len(text.splitlines()) == 5


def test_json_and_plot_are_written(tmp_path):
    args, records = fake_records()
    path = bm.write_json(records, args, tmp_path / "b.json")
    data = json.loads(path.read_text())
    assert data["settings"]["batch"] == 1 and data["results"] == records and "torch" in data["environment"]
    png = bm.plot(records, tmp_path / "b.png", title="fake")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_small_run_on_gpu(tmp_path):
    records = bm.main(["--seqlens", "256", "--head-dims", "64", "--causal", "no", "--out-dir", str(tmp_path),
                       "--name", "t", "--rep", "5", "--warmup", "2"])
    assert all(r["tflops"] for r in records if r["impl"] in ("triton", "sdpa-flash"))
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.png").exists()


def test_benchmarks_write_into_the_repositorys_images_folder():
    from utils.course.bench import backward, summary

    root = Path(__file__).resolve().parents[1]
    assert bm.IMAGES == summary.IMAGES == root / "images"
    assert backward.DEFAULT_OUT.parent == root / "images"


def test_error_line_is_one_line_even_for_an_empty_message():
    assert error_line(ValueError("first\nsecond")) == "ValueError: first"
    assert error_line(RuntimeError()) == "RuntimeError: "
    assert error_line(RuntimeError("x" * 300)) == "RuntimeError: " + "x" * 200
    assert error_line(KeyError("abcdef"), limit=3) == "KeyError: 'ab"


def test_median_rows_fill_only_the_rows_that_ran():
    rows = {name: dict(name=name, ms=None, tflops=None, error=None) for name in ("a", "b", "c")}
    rows["c"]["error"] = "not supported: d=256"
    out = median_rows(rows, {"a": [3.0, 1.0, 2.0], "b": [], "c": [5.0]}, flops=4e9)
    assert [r["name"] for r in out] == ["a", "b", "c"]
    assert out[0]["ms"] == 2.0 and out[0]["tflops"] == pytest.approx(2.0)
    assert out[1]["ms"] is None and out[2]["ms"] is None and out[2]["tflops"] is None


def test_a_tile_that_does_not_fit_is_recorded_not_raised():
    """Section 5's overlapped 128x128 tiles ask an H200 for 256 KiB of shared memory: a result, not a crash."""
    from triton.runtime.errors import OutOfResources

    args = bm.parse_args(["--seqlens", "64", "--head-dims", "16", "--batch", "1", "--heads", "2", "--causal", "no",
                          "--sdpa", "--impls", "naive", "--dtype", "fp32"])

    def time_ms(fn, q, k, v, causal):
        raise OutOfResources(262168, 232448, "shared memory")

    (record,) = bm.run(args, {"naive": None}, time_ms=time_ms, device="cpu", progress=False)
    assert record["tflops"] is None and record["error"].startswith("OutOfResources: out of resource: shared memory")


def test_ws_tiles_adds_the_warp_specialised_kernel_with_each_tile():
    from utils.explicit.forward_ws import WS_TILES, label as ws_label
    fns = bm.candidates(bm.parse_args(["--ws-tiles", "--impls", "gluon_ws", "--sdpa", "cudnn"]))
    assert list(fns) == ["gluon_ws", *(ws_label(c) for c in WS_TILES), "sdpa-cudnn"]
    assert fns["gluon_ws n128 s2 r232"].__name__ == "gluon_ws n128 s2 r232"


def test_ws3_tiles_adds_the_three_consumer_kernel_with_each_tile():
    from utils.explicit.forward_ws3 import WS3_TILES, label as ws3_label
    fns = bm.candidates(bm.parse_args(["--ws3-tiles", "--impls", "gluon_ws", "--sdpa", "cudnn"]))
    assert list(fns) == ["gluon_ws", *(ws3_label(c) for c in WS3_TILES), "sdpa-cudnn"]
    assert fns["gluon_ws3 n128 s2 r160"].__name__ == "gluon_ws3 n128 s2 r160"


def test_rotated_starts_round_r_at_the_rth_item():
    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
