"""What GPU the course runs on, or pretends to run on, and the environment record every stored result carries.

Every branch on compute capability in the course asks `capability()`, never torch directly, so that one
switch exercises the older-GPU paths on any CUDA machine:

    COURSE_EMULATE_GPU=t4 make test        # or: python -m utils.course.gpu_suite --emulate t4

With `COURSE_EMULATE_GPU=t4` the course makes the choices it makes on Colab's T4 (sm_75): capability (7, 5),
fp16 instead of bf16, no TMA tensor descriptors, 64 KiB of shared memory per block, the registry's `cuda`
running `cuda_tiled`, and CUDA extensions built as sm_75 PTX (so sm_80+ instructions fail to build, as on a
T4). The GPU underneath still executes everything: emulation checks the course's decisions, not a T4's speed.
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
import sys
from typing import NamedTuple

import torch

EMULATE_VAR = "COURSE_EMULATE_GPU"


class Profile(NamedTuple):
    name: str
    capability: tuple[int, int]
    shared_memory_per_block: int    # bytes a block may opt in to


PROFILES = {"t4": Profile("Tesla T4", (7, 5), 64 * 1024)}


def emulated() -> Profile | None:
    """The GPU profile named by COURSE_EMULATE_GPU (None when unset); a ValueError names unknown profiles."""
    value = os.environ.get(EMULATE_VAR, "").strip().lower()
    if not value:
        return None
    if value not in PROFILES:
        raise ValueError(f"{EMULATE_VAR}={value!r} is not a known GPU profile; known: {', '.join(PROFILES)}")
    return PROFILES[value]


def _index(device) -> int | None:
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return device.index


def capability(device=None) -> tuple[int, int] | None:
    """(major, minor) of the GPU (or of the emulated one); None without a CUDA GPU. `device`: index, name,
    torch.device or a tensor on it."""
    if not _has_cuda(device):
        return None
    index, profile = _index(device), emulated()
    if profile:
        return profile.capability
    return tuple(torch.cuda.get_device_capability()) if index is None else _capability(index)


def shared_memory_per_block(device=None) -> int | None:
    """Bytes of shared memory one block may use (opt-in limit) on the GPU or the emulated one."""
    if not _has_cuda(device):
        return None
    index, profile = _index(device), emulated()
    return profile.shared_memory_per_block if profile else _optin_smem(torch.cuda.current_device() if index is None
                                                                       else index)


def _has_cuda(device) -> bool:
    """A CUDA tensor, or CUDA already initialised, says so; asking the driver costs microseconds at every launch."""
    return ((isinstance(device, torch.Tensor) and device.is_cuda) or torch.cuda.is_initialized()
            or torch.cuda.is_available())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:  # cached: kernels ask at every launch
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def _optin_smem(index: int) -> int:  # cached: kernels ask at every launch
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def name(device=None) -> str | None:
    """The GPU's name, with the emulated profile named too: 'Tesla T4 (emulated on NVIDIA H200)'."""
    if not torch.cuda.is_available():
        return None
    real = torch.cuda.get_device_name(_index(device))
    profile = emulated()
    return f"{profile.name} (emulated on {real})" if profile else real


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(command: str | None = None) -> dict:
    """Where a result was measured: GPU, capability, driver, CUDA, cuDNN, torch, Triton, Python, date and the
    command that made it (default: this process's command line)."""
    import triton

    gpu = torch.cuda.is_available()
    cudnn = torch.backends.cudnn.version() if gpu and torch.backends.cudnn.is_available() else None
    return dict(
        gpu=name(), capability=list(capability()) if gpu else None, emulated=os.environ.get(EMULATE_VAR) or None,
        driver=_driver_version() if gpu else None, cuda=torch.version.cuda, cudnn=cudnn,
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command if command is not None else command_line(),
    )


def command_line() -> str:
    """This process's command line as it was typed: `python -m utils.course.bench.forward --impls triton` for a module
    run with -m (whose sys.argv[0] is the module's file path), else `python script.py ...`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return " ".join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    return " ".join([os.path.basename(sys.executable), *sys.argv])
