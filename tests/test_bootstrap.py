import os

import pytest
import torch

from utils.course import bootstrap
from utils.course.bootstrap import Env, default_dtype, misspelt_interpret_vars, run_gpu_cell


@pytest.mark.parametrize("capability,dtype", [(None, torch.float32), ((7, 5), torch.float16),
                                              ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_default_dtype(capability, dtype):
    assert default_dtype(capability) is dtype


def test_misspelt_interpret_vars():
    env = {"TRITON_INTERPRETER": "1", "TRITON_INTERPRET": "1", "TRITON_INTERPETER": "1", "TRITON_CACHE_DIR": "x"}
    assert misspelt_interpret_vars(env) == ["TRITON_INTERPETER", "TRITON_INTERPRETER"]


def test_setup_on_this_machine(capsys):
    env = bootstrap.setup()
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and f"device={env.device}" in line
    assert env.on_gpu == torch.cuda.is_available()
    if not env.on_gpu:
        assert os.environ["TRITON_INTERPRET"] == "1" and env.interpret
        assert env.dtype is torch.float32
    assert env.pick(cpu=1, gpu=2) == (2 if env.on_gpu else 1)


def test_pick():
    cpu = Env(torch.device("cpu"), torch.float32, None, None, True, False)
    gpu = Env(torch.device("cuda"), torch.bfloat16, "H200", (9, 0), False, False)
    assert cpu.pick(cpu=64, gpu=4096) == 64 and gpu.pick(cpu=64, gpu=4096) == 4096


def test_colab_installs_only_missing_extras(monkeypatch):
    """With Colab detected, setup() pip-installs only the extras that cannot be imported, never torch."""
    calls = []
    monkeypatch.setattr(bootstrap, "in_colab", lambda: True)
    monkeypatch.setattr(bootstrap, "COLAB_EXTRAS", {"einops": "einops", "surely_not_installed_xyz": "xyz-pkg"})
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda cmd, check: calls.append(cmd))
    env = bootstrap.setup(quiet=True)
    assert env.colab
    assert len(calls) == 1 and calls[0][-1] == "xyz-pkg" and "torch" not in calls[0]


def test_run_gpu_cell_skips_without_gpu(capsys):
    ns = {}
    assert run_gpu_cell("x = 1\nx + 1", ns, gpu=False) is None
    assert "x" not in ns and "skipped" in capsys.readouterr().out


def test_run_gpu_cell_runs_and_returns_last_expression():
    ns = {}
    assert run_gpu_cell("x = 20\nx + 1", ns, gpu=True) == 21 and ns["x"] == 20
    assert run_gpu_cell("y = 3", ns, gpu=True) is None and ns["y"] == 3


def test_run_gpu_cell_raises_errors():
    with pytest.raises(ZeroDivisionError):
        run_gpu_cell("1 / 0", {}, gpu=True)


def test_gpu_magic_outside_ipython():
    assert bootstrap.register_gpu_magic() is False


def test_supports_says_in_one_line_what_needs_a_newer_gpu(capsys):
    h200 = Env(torch.device("cuda"), torch.bfloat16, "H200", (9, 0), False, False)
    t4 = Env(torch.device("cuda"), torch.float16, "T4", (7, 5), False, False)
    cpu = Env(torch.device("cpu"), torch.float32, None, None, True, False)
    assert h200.supports((9, 0), "TMA") and capsys.readouterr().out == ""
    assert not t4.supports((8, 0), "the tensor-core kernels")
    assert capsys.readouterr().out == "skipped: the tensor-core kernels: needs an sm_80+ GPU; this GPU is sm_75\n"
    assert not cpu.supports((8, 0), "the autotuner") and "no GPU here" in capsys.readouterr().out


def test_run_gpu_cell_gives_what_it_defines_a_source():
    """`@triton.jit` reads a kernel's source to compile it for a GPU: a function defined in a %%gpu cell has one."""
    import inspect

    ns = {}
    run_gpu_cell("def twice(x):\n    return 2 * x\n", ns, gpu=True)
    assert inspect.getsource(ns["twice"]) == "def twice(x):\n    return 2 * x\n"


def test_setup_on_a_gpu_leaves_triton_unimported():
    """A notebook may turn the interpreter on after setup() and before its first `import triton` (05a does)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"   # as on a GPU machine, where setup() leaves the interpreter off
            "torch.cuda.is_available = lambda: True\n"
            "torch.cuda.get_device_name = lambda *a: 'a GPU'\n"
            "torch.cuda.get_device_capability = lambda *a: (9, 0)\n"
            "from utils.course.bootstrap import setup\nsetup()\nprint('triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=bootstrap.ROOT, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0 and done.stdout.strip().endswith("False"), done.stdout + done.stderr[-2000:]


def test_run_after_cell_waits_for_the_checks_it_names(capsys, monkeypatch):
    from utils.course import exercises
    from utils.course.bootstrap import run_after_cell

    for name, empty in (("RESULTS", {}), ("HINTS", {}), ("_last_failed", [])):
        monkeypatch.setattr(exercises, name, empty)
    ns = {}

    def right():
        pass

    def stub():
        raise NotImplementedError(exercises.STUB_MESSAGE)

    exercises.check("9.1 one", hints=("a", "b"))(right)
    exercises.check("9.2 two", hints=("a", "b"))(stub)
    assert exercises.RESULTS == {"9.1": "right", "9.2": "not yet"}
    assert exercises.solved("9.1") and not exercises.solved("9.1", "9.2") and not exercises.solved("9.3")
    capsys.readouterr()
    assert run_after_cell("9.1 9.2", "x = 1\nx + 1", ns) is None and "x" not in ns
    assert "skipped: this cell runs your answer to 9.2; run it again once that check says right" in \
        capsys.readouterr().out
    assert run_after_cell("9.1", "x = 20\nx + 1", ns) == 21 and ns["x"] == 20
    exercises.check("9.1 one", hints=("a", "b"))(stub)           # a check run again forgets its earlier right
    assert run_after_cell("9.1", "y = 1", ns) is None and "y" not in ns
    with pytest.raises(ValueError, match="name the exercises"):
        run_after_cell("  ", "x = 1", ns)
    with pytest.raises(TypeError, match="exercise numbers as strings"):
        exercises.solved(9.1)
