"""utils.gpu: the GPU profile switch (COURSE_EMULATE_GPU) and the environment record of stored results."""
import sys

import pytest
import torch

from utils import gpu
from utils.checks import check_device

CUDA = torch.cuda.is_available()


def test_no_emulation_by_default_and_t4_profile(monkeypatch):
    monkeypatch.delenv(gpu.EMULATE_VAR, raising=False)
    assert gpu.emulated() is None
    monkeypatch.setenv(gpu.EMULATE_VAR, "T4")
    assert gpu.emulated() == gpu.Profile("Tesla T4", (7, 5), 64 * 1024)
    monkeypatch.setenv(gpu.EMULATE_VAR, "a100")
    with pytest.raises(ValueError, match="COURSE_EMULATE_GPU='a100' is not a known GPU profile; known: t4"):
        gpu.emulated()


@pytest.mark.skipif(CUDA, reason="checks the answers without a GPU")
def test_without_a_gpu_there_is_no_capability(monkeypatch):
    monkeypatch.setenv(gpu.EMULATE_VAR, "t4")  # emulation never invents a GPU
    assert gpu.capability() is None and gpu.shared_memory_per_block() is None and gpu.name() is None


@pytest.mark.gpu
def test_emulated_t4_on_a_gpu(monkeypatch):
    monkeypatch.delenv(gpu.EMULATE_VAR, raising=False)
    real = gpu.capability()
    assert real == torch.cuda.get_device_capability() and gpu.shared_memory_per_block() > 0
    assert gpu.capability(torch.zeros(1, device="cuda")) == real
    monkeypatch.setenv(gpu.EMULATE_VAR, "t4")
    assert gpu.capability() == (7, 5) and gpu.shared_memory_per_block() == 64 * 1024
    assert gpu.name().startswith("Tesla T4 (emulated on ")
    with pytest.raises(ValueError, match="must be a CUDA device"):
        gpu.capability("cpu")


def test_environment_records_where_and_how(monkeypatch):
    monkeypatch.delenv(gpu.EMULATE_VAR, raising=False)
    env = gpu.environment("python -m utils.course.bench.summary")
    assert {"gpu", "capability", "emulated", "driver", "cuda", "cudnn", "torch", "triton", "python", "date",
            "command"} <= set(env)
    assert env["torch"] == torch.__version__ and env["command"] == "python -m utils.course.bench.summary"
    assert env["date"][:2] == "20" and (env["gpu"] is not None) == CUDA
    assert gpu.environment()["command"].startswith("python")  # default: this process's command line


def test_command_line_names_the_module_a_run_with_m_started(monkeypatch):
    import types

    monkeypatch.setattr(sys, "argv", ["/repo/utils/bench/forward.py", "--impls", "triton"])
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(
        name="utils.course.bench.forward")))
    assert gpu.command_line() == "python -m utils.course.bench.forward --impls triton"
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))  # python script.py
    assert gpu.command_line().endswith(" /repo/utils/bench/forward.py --impls triton")


def test_check_device(monkeypatch):
    t = torch.zeros(2)
    check_device("q", t, "any")
    with pytest.raises(ValueError, match="q is on cpu, but this implementation needs CUDA tensors"):
        check_device("q", t, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_device("q", t, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="q is on the CPU, but Triton kernels need CUDA tensors"):
        check_device("q", t, "triton")
    with pytest.raises(ValueError, match="runs_on must be"):
        check_device("q", t, "tpu")
