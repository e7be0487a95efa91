"""utils.course.bench.host: arguments and the host timer's loop (CPU, with a stand-in for the GPU); the records of a
small run on a GPU."""
import json

import pytest
import torch

from utils.course.bench import host


@pytest.mark.parametrize("argv,message", [(["--calls", "0"], "--calls must be positive"),
                                          (["--seqlens", "0"], "--seqlens must be positive"),
                                          (["--head-dims", "96"], "invalid choice: 96"),
                                          (["--dtype", "fp32"], "invalid choice: 'fp32'"),
                                          (["--name", "a/b"], "bare file name")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        host.parse_args(argv)
    assert message in capsys.readouterr().err


def test_host_time_is_the_fastest_loop_per_call(monkeypatch):
    """One call before the loops; each loop drains the GPU first; the fastest loop, per call, in µs."""
    clock = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.003])   # loops of 4, 2 and 3 ms
    events = []
    monkeypatch.setattr(host.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    us = host.host_us(lambda: events.append("call"), calls=2, reps=3)
    assert us == pytest.approx(1000.0)
    assert events == ["call"] + ["sync", "call", "call"] * 3 + ["sync"]


def test_implementations_are_the_four_then_registry_names_then_peers(tmp_path, capsys):
    fns = host.implementations(host.parse_args(["--impls", "naive", "flash2_pytorch"]))
    assert list(fns) == [*host.IMPLS, "naive", "flash2_pytorch"]
    assert fns["triton"] is fns[host.TRITON_DISPATCH]      # one kernel, launched two ways
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        host.implementations(host.parse_args(["--impls", "nope"]))
    missing = ["--peers", "triton-tutorial", "--tutorial", str(tmp_path / "absent.py")]
    assert list(host.implementations(host.parse_args(missing))) == list(host.IMPLS)   # skipped, and said so
    assert "skipping triton-tutorial" in capsys.readouterr().err


def test_records_are_in_the_chosen_dtype_and_a_refusal_is_recorded(monkeypatch):
    """Inputs in --dtype; an implementation that refuses them (the tutorial takes no bf16) gets its error in the
    record and the run goes on with the next one."""
    seen = []

    def measure_case(impl, attention, mode, q, k, v, causal, args):
        seen.append(q.dtype)
        if impl == "picky":
            raise TypeError("q has dtype torch.bfloat16; supported: float16")
        return dict(host_us=1.0, bench_us=2.0, gpu_us=0.5)

    monkeypatch.setattr(host, "measure_case", measure_case)
    args = host.parse_args(["--seqlens", "16", "--head-dims", "64", "--batch", "1", "--heads", "1"])
    records = host.measure(args, {"picky": None, "fine": None}, device="cpu")
    assert set(seen) == {torch.bfloat16} and len(records) == 2 * 2 * 2   # causal or not, fwd and bwd, two impls
    assert all(r["error"].startswith("TypeError: q has dtype") and r["host_us"] is None
               for r in records if r["impl"] == "picky")
    assert all("error" not in r and r["host_us"] == 1.0 for r in records if r["impl"] == "fine")
    seen.clear()
    host.measure(host.parse_args(["--seqlens", "16", "--head-dims", "64", "--dtype", "fp16"]), {"fine": None},
                 device="cpu")
    assert set(seen) == {torch.float16}


def test_kernel_time_is_the_profiled_kernels_per_call(monkeypatch):
    """One call before profiling; `calls` calls profiled; every kernel's device time summed, per call."""
    events = []

    class Profile:
        def __init__(self, activities):
            events.append("profile")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return [type("Event", (), dict(self_device_time_total=t))() for t in (30.0, 0.0, 12.0)]

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    assert host.kernel_us(lambda: events.append("call"), calls=3) == pytest.approx(14.0)
    assert events == ["call", "sync", "profile", "call", "call", "call", "sync"]


def test_without_a_gpu_main_says_what_it_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        host.main(["--out-dir", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.capability(8, 0)  # bf16 and SDPA's cuDNN backend
def test_a_small_run_records_every_implementation_and_pass(tmp_path):
    records = host.main(["--seqlens", "256", "--head-dims", "64", "--calls", "3", "--reps", "2",
                         "--out-dir", str(tmp_path), "--name", "h"])
    stored = json.loads((tmp_path / "h.json").read_text())
    assert stored["results"] == records and stored["environment"]["gpu"]
    assert {(r["impl"], r["mode"]) for r in records} == {(i, m) for i in host.IMPLS for m in ("fwd", "bwd")}
    assert len(records) == 2 * 2 * len(host.IMPLS)   # causal and not, forward and backward
    for r in records:
        assert r["host_us"] > 0 and r["bench_us"] > 0
        assert r["gpu_us"] > 0   # forward: a CUDA graph's replay; backward: its kernels, profiled
