"""The ring's exchange benchmark (utils.course.bench.ring_comm): a real run of 2 gloo processes through the CLI (the
JSON it writes, environment and command included), argument checks, and how the notebook finds a stored run."""
import json

import pytest
import torch

from utils.course.bench.ring_comm import (MEASURE_COMMAND, _main, check_sizes, device_tag, large_message_gbps,
                                   measure_ring_exchange, result_path, stored_nccl)
from utils.course.references import REFERENCES

ENV_KEYS = ("gpu", "capability", "torch", "triton", "cuda", "cudnn", "driver", "date", "command")


@pytest.mark.full   # spawns gloo processes; make test keeps notebook 08's gloo rings and this file's other tests
def test_gloo_run_writes_the_json_the_notebook_reads(tmp_path):
    argv = ["--backend", "gloo", "--world-size", "2", "--sizes", "4096", "65536", "--repeats", "3",
            "--warmup", "1", "--out", str(tmp_path)]
    path = _main(argv)
    assert path == result_path(tmp_path, "cpu") and path.name == "ring_comm_cpu.json"
    result = json.loads(path.read_text())
    env = result["environment"]
    assert all(k in env for k in ENV_KEYS), env
    assert env["command"] == "python -m utils.course.bench.ring_comm " + " ".join(argv)
    assert env["torch"] == torch.__version__
    assert (result["backend"], result["world_size"], result["device"]) == ("gloo", 2, "CPU")
    assert [r["bytes"] for r in result["rows"]] == [4096, 65536]
    for r in result["rows"]:
        assert r["exchanges_per_timing"] == -(-2**20 // r["bytes"])   # the CLI's 1 MiB burst on gloo
        assert 0 < r["ms_min"] <= r["ms"]
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9)
    assert large_message_gbps(result) == result["rows"][1]["gbps"]
    assert stored_nccl(tmp_path) is None     # a gloo run is not a link measurement


def test_bad_arguments_are_named():
    for sizes, error in (([], ValueError), ([0], ValueError), ([1.5], TypeError), ("1024", TypeError),
                         (1024, TypeError), ([True], TypeError)):
        with pytest.raises(error, match="sizes"):
            check_sizes(sizes)
    assert check_sizes((1, 2**30)) == [1, 2**30]
    cases = [(dict(world_size=1), ValueError, "world_size"), (dict(world_size=2.0), TypeError, "world_size"),
             (dict(backend="mpi"), ValueError, "backend"), (dict(repeats=0), ValueError, "repeats"),
             (dict(warmup=-1), ValueError, "warmup"), (dict(burst_bytes=1.0), TypeError, "burst_bytes")]
    for kwargs, error, name in cases:   # all raised before any process starts
        with pytest.raises(error, match=name):
            measure_ring_exchange([1024], **kwargs)
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="GPUs"):
            measure_ring_exchange([1024], world_size=2, backend="nccl")


def test_device_tag():
    assert device_tag("NVIDIA H200") == "h200"
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert device_tag(None) == "cpu"


def test_stored_nccl_and_large_message_gbps(tmp_path):
    rows = [dict(bytes=2**20, gbps=90.0), dict(bytes=2**30, gbps=380.0), dict(bytes=2**28, gbps=395.0)]
    (tmp_path / "ring_comm_cpu.json").write_text(json.dumps(dict(backend="gloo", rows=rows)))
    assert stored_nccl(tmp_path) is None
    (tmp_path / "ring_comm_h200.json").write_text(json.dumps(dict(backend="nccl", rows=rows)))
    path, result = stored_nccl(tmp_path)
    assert path.name == "ring_comm_h200.json"
    assert large_message_gbps(result) == 380.0     # the largest message's rate, not the best one
    with pytest.raises(ValueError, match="row"):
        large_message_gbps(dict(rows=[]))


def test_registered_as_a_two_gpu_reference():
    gpus, command = REFERENCES["ring_comm"]
    assert gpus == 2 and "python -m " + " ".join(command) == MEASURE_COMMAND
