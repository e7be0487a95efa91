"""How the course's CUDA kernels (utils/native/src/*.cu) are built: torch.utils.cpp_extension.load_inline on
first use, or nvcc alone for a compile check. The Python entry points that launch them are in utils.native.kernels.

- `load(name)` builds one .cu file into an extension for the GPU at hand and imports it; nothing is compiled
  at import time, and each build is cached (in this process, and on disk under build/torch_extensions/).
  `load_all(names)` runs several builds at once; `python -m utils.native.build build` builds every extension the
  GPU at hand runs (`buildable`), so that a workshop's first runs do not wait for them.
- A file that one nvcc run would take minutes over (`BUILD_PARTS`) is built as several sources that ninja
  compiles at once: the file with COURSE_PART defined to each part's number (`part_sources`).
- The extension's name carries a hash of everything that goes into the build (the .cu file, the headers it
  includes, the C++ declarations, the compiler flags), so a changed source can never pick up a stale build.
- `compile_check()` compiles the kernels alone with nvcc (no GPU, no CUDA build of torch needed) and returns
  the registers, shared memory and spills ptxas reports for every kernel. That works because each .cu file
  keeps its torch-facing wrapper behind `#ifdef COURSE_TORCH_WRAPPER`, compiled by the host compiler.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from utils import gpu
from utils.checks import check_capability

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "utils" / "native" / "src"
BUILD_DIR = ROOT / "build"

# name -> (the function Python calls, or a tuple of them, the headers the .cu file includes). Each .cu file is
# passed twice to load_inline: as cuda_sources (nvcc compiles the kernels and their plain launcher) and, with
# COURSE_TORCH_WRAPPER defined, as cpp_sources (the host compiler compiles the torch wrapper and its bindings).
KERNELS = {
    "softmax": ("softmax_forward", ("course_str.h",)),
    "flash_naive": ("flash_naive_forward", ("flash_params.h", "flash_common.cuh", "flash_torch.h", "course_str.h")),
    "flash_tiled": ("flash_tiled_forward", ("flash_params.h", "flash_common.cuh", "flash_torch.h", "course_str.h")),
}
# Notebook 06b: the tensor-core kernel, one extension per step of its worklog (utils/native/src/flash_mma_steps.cuh), so
# that the final step alone is built for the registry and the steps build in parallel. A step's source is
# MMA_STEP_TEMPLATE rendered for it (mma_step_source): it compiles the step's flattened kernel, steps/06b/sNN_<step>.cu,
# which a learner reads (utils.course.flatten generates it from flash_mma_kernel.cuh).
MMA_STEPS = ("mma", "ldmatrix", "swizzle", "cp_async", "tiles", "exp2", "causal_skip", "split_kv", "occupancy",
             "one_group", "warp_rows", "hoisted", "late_copy", "rare_rescale", "whole_tiles")
# The registry's "cuda" and flash_mma's default: the fastest step measured (images/06b_step15_h200.json).
MMA_DEFAULT_STEP = "whole_tiles"
MMA_HEADERS = ("flash_params.h", "flash_common.cuh", "flash_torch.h", "course_str.h", "flash_mma.cuh",
               "flash_mma_steps.cuh", "flash_mma_kernel.cuh", "flash_mma_torch.h")
MMA_STEP_TEMPLATE = "flash_mma_step.cu.in"


def mma_kernel_name(step: str) -> str:
    """'exp2' -> 'flash_mma_s6_exp2', the KERNELS name (and extension) of that step."""
    if step not in MMA_STEPS:
        raise ValueError(f"step must be one of {MMA_STEPS}, got {step!r}")
    return f"flash_mma_s{MMA_STEPS.index(step) + 1}_{step}"


def mma_step_file(step: str) -> str:
    """'exp2' -> 'steps/06b/s06_exp2.cu': the flattened kernel of that step, under utils/native/src."""
    mma_kernel_name(step)  # validates
    return f"steps/06b/s{MMA_STEPS.index(step) + 1:02d}_{step}.cu"


def mma_step_source(step: str) -> str:
    """The .cu source of a step's extension: MMA_STEP_TEMPLATE with the step's names filled in."""
    from string import Template

    return Template((CUDA_DIR / MMA_STEP_TEMPLATE).read_text()).substitute(
        number=MMA_STEPS.index(step) + 1, steps=len(MMA_STEPS), kernel=mma_kernel_name(step),
        file=mma_step_file(step).rsplit("/", 1)[1])


_MMA_STEP_OF = {mma_kernel_name(s): s for s in MMA_STEPS}
# A step's build: the template, the flattened kernel and what it includes (not flash_mma_kernel.cuh).
KERNELS.update({name: (f"{name}_forward", (*[h for h in MMA_HEADERS if h != "flash_mma_kernel.cuh"],
                                           MMA_STEP_TEMPLATE, mma_step_file(step)))
                for name, step in _MMA_STEP_OF.items()})
# Notebook 06bw, section 6: MMA_DEFAULT_STEP's forward with the log-sum-exp, and the backward (utils.native.backward).
KERNELS["flash_mma_bwd"] = (("flash_mma_bwd_forward", "flash_mma_bwd_backward", "flash_mma_bwd_prepare",
                             "flash_mma_bwd_finish"),
                            (*MMA_HEADERS, "flash_mma_bwd_steps.cuh", "flash_mma_bwd_kernel.cuh",
                             "flash_bwd_passes.cuh", "flash_bwd_host.h"))
# Notebook 06c: Hopper's wgmma and TMA exist only in sm_90a code, which runs on sm_90 GPUs (H100/H200) alone.
HOPPER_HEADERS = ("hopper.cuh", "hopper_layout.h", "hopper_host.h", "course_str.h")
KERNELS["wgmma_gemm"] = ("wgmma_gemm_forward", HOPPER_HEADERS)
KERNELS["hopper_attention"] = ("hopper_attention_forward",
                              (*HOPPER_HEADERS, "hopper_attention_steps.cuh", "hopper_attention_dispatch.h",
                               "hopper_attention_kernel.cuh"))
# ... and its backward (utils.native.hopper.flash_hopper_backward)
KERNELS["hopper_backward"] = ("hopper_attention_backward",
                             (*HOPPER_HEADERS, "hopper_attention_steps.cuh", "hopper_attention_kernel.cuh",
                              "hopper_backward_kernel.cuh", "flash_bwd_passes.cuh", "flash_bwd_host.h", "flash_torch.h",
                              "flash_mma.cuh", "flash_common.cuh", "flash_params.h"))
HOPPER_KERNELS = ("wgmma_gemm", "hopper_attention", "hopper_backward")
# Files that one nvcc run would take minutes over, built instead as this many parts at once (each part k's source
# is the file with COURSE_PART defined to k, 0 for the launcher; the file says which part instantiates what).
BUILD_PARTS = {"hopper_attention": 4, "flash_mma_bwd": 4}
WRAPPER_DEFINE = "#define COURSE_TORCH_WRAPPER\n"
# -lineinfo maps SASS back to source lines in Nsight Compute and costs nothing at run time.
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo")
ARCHS = ("sm_80", "sm_90")
HOPPER_ARCH = "sm_90a"


def _check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in KERNELS:
        raise ValueError(f"unknown kernel file {name!r}; known: {', '.join(KERNELS)}")
    return name


def kernel_source(name: str) -> str:
    """The text of utils/native/src/<name>.cu; for a step of notebook 06b, its rendered MMA_STEP_TEMPLATE."""
    if _check_name(name) in _MMA_STEP_OF:
        return mma_step_source(_MMA_STEP_OF[name])
    return (CUDA_DIR / f"{name}.cu").read_text()


def source_hash(name: str, flags=CUDA_FLAGS) -> str:
    """12 hex digits of SHA-256 over everything that determines the build of `name` with `flags`."""
    _check_name(name)
    function, headers = KERNELS[name]
    digest = hashlib.sha256()
    functions = (function,) if isinstance(function, str) else function
    for part in (kernel_source(name), *[(CUDA_DIR / h).read_text() for h in headers], *functions, WRAPPER_DEFINE,
                 *flags, *([f"parts {BUILD_PARTS[name]}"] if name in BUILD_PARTS else [])):
        digest.update(part.encode())
        digest.update(b"\0")  # separator: ("ab", "c") and ("a", "bc") must differ
    return digest.hexdigest()[:12]


_NAMES: dict = {}
_FILES: dict = {}
_LOOKED: dict = {}  # (name, flags, CUDA_DIR) -> (_clock() at the last look at the files, the name then)
# Every kernel call asks for its extension's name. A stat of each source file costs about 1.5 µs (14 files for
# hopper_backward), so the files are looked at again only once this many seconds have passed for a name: an edit
# saved by hand is seen at the next call after that.
RECHECK_SECONDS = 1.0
_clock = time.monotonic


def _source_files(name: str) -> tuple[str, ...]:
    """The paths whose edits change the build of `name`, as strings (os.stat on a str skips pathlib's cost)."""
    key = (CUDA_DIR, name)  # CUDA_DIR too: a test points it at a copy of the sources
    if key not in _FILES:
        own = [] if name in _MMA_STEP_OF else [CUDA_DIR / f"{name}.cu"]  # a step's template is one of its headers
        _FILES[key] = tuple(str(f) for f in (*own, *[CUDA_DIR / h for h in KERNELS[name][1]]))
    return _FILES[key]


def extension_name(name: str, flags=CUDA_FLAGS) -> str:
    """The load_inline name: `course_<name>_<hash>`, a new name whenever sources or flags change (an edited file
    is noticed within RECHECK_SECONDS)."""
    _check_name(name)
    flags = tuple(flags)
    now, seen = _clock(), _LOOKED.get((name, flags, CUDA_DIR))
    if seen is not None and now - seen[0] < RECHECK_SECONDS:
        return seen[1]
    # Hashing reads the files; their modification times are enough to notice an edit (the hash is then recomputed)
    key = (name, flags, tuple(os.stat(f).st_mtime_ns for f in _source_files(name)))
    if key not in _NAMES:
        _NAMES[key] = f"course_{name}_{source_hash(name, flags)}"
    _LOOKED[name, flags, CUDA_DIR] = (now, _NAMES[key])
    return _NAMES[key]


def gencode_flags(capability, *, ptx: bool = False) -> list[str]:
    """`-gencode` for one GPU, e.g. (9, 0) -> ['-gencode=arch=compute_90,code=sm_90'] (H100/H200).

    `ptx=True` embeds PTX instead of machine code (code=compute_75): the driver compiles it for the GPU at hand,
    which is how an emulated T4 (utils/gpu.py) builds sm_75 code that still runs on a newer GPU."""
    arch = "{}{}".format(*check_capability(capability))
    return [f"-gencode=arch=compute_{arch},code={'compute' if ptx else 'sm'}_{arch}"]


def arch_flags(name: str | None = None) -> list[str]:
    """`-gencode` for the GPU at hand; for an emulated one (COURSE_EMULATE_GPU=t4), its PTX, which the real GPU
    underneath can still run. The Hopper kernels (`name` in HOPPER_KERNELS) build for sm_90a, on an sm_90 GPU
    only: anywhere else, a RuntimeError that says so."""
    if name in HOPPER_KERNELS:
        check_hopper_capability(gpu.capability())
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return gencode_flags(gpu.capability(), ptx=gpu.emulated() is not None)


def check_hopper_capability(capability) -> None:
    """Raise a RuntimeError that explains why, unless a GPU of this (major, minor) runs sm_90a code (wgmma)."""
    if check_capability(capability) != (9, 0):
        raise RuntimeError(
            f"the Hopper kernels (wgmma, TMA) need an sm_90 GPU such as an H100 or H200; this GPU is "
            f"sm_{capability[0]}{capability[1]}. sm_90a code runs on sm_90 alone, not on older GPUs and not on "
            f"newer ones (Blackwell has its own tensor-core instructions).")


_LOADED: dict = {}
_FAILED: dict = {}


# torch's load_inline guards a build directory with a lock file and waits, without end, while it exists. A build
# killed half-way (a notebook interrupt, a restarted kernel) leaves the file behind, and every later build of that
# extension would hang. So our builds first take an OS lock (`build_lock`), which the OS drops when its process
# dies: under it, a lock file of load_inline's can only be a dead build's. Where there is no such lock (Windows),
# `wait_for_build_lock` removes a lock file once it is STALE_LOCK_S old: no build of ours takes that long.
STALE_LOCK_S = 600.0


@contextlib.contextmanager
def build_lock(build_directory, *, timeout_s: float | None = None, poll_s: float = 0.5, say=print):
    """Hold the build lock of `build_directory` (made if missing) for a `with` block.

    The lock is fcntl.flock on build_directory/course.lock, so a killed process never holds it. While another
    live process holds it, wait (saying so once), or after `timeout_s` raise a TimeoutError (None: wait as long
    as that build runs). Once held, remove load_inline's lock file if one is left, with a warning. Yields whether
    it removed one. Without fcntl (Windows), `wait_for_build_lock` instead."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s >= 0):
        raise ValueError(f"timeout_s must be None or a number of seconds >= 0, got {timeout_s!r}")
    if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not poll_s > 0:
        raise ValueError(f"poll_s must be a positive number of seconds, got {poll_s!r}")
    directory = Path(build_directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield wait_for_build_lock(directory, poll_s=poll_s, say=say)
        return
    path = directory / "course.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "?"
                if timeout_s is not None and time.monotonic() - start >= timeout_s:
                    raise TimeoutError(f"another build of {directory.name} (process {holder}) still holds {path} "
                                       f"after {timeout_s:g} s") from None
                if not told:
                    say(f"waiting for another build of {directory.name} (process {holder} holds {path})")
                    told = True
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for the message of a process that waits
        left = directory / "lock"
        removed = left.exists()
        if removed:
            warnings.warn(f"removed {left}: left by a build that did not finish (interrupted?); building again",
                          stacklevel=3)
            left.unlink(missing_ok=True)
        yield removed
    finally:
        os.close(fd)  # drops the lock, also on an exception or KeyboardInterrupt


def wait_for_build_lock(build_directory, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0,
                        say=print) -> bool:
    """Wait while `build_directory/lock` is held (another process may be building the same extension), saying so
    once; remove it once it is `stale_after_s` old, with a warning. Returns whether a stale lock was removed.
    `build_lock`'s fallback where there is no fcntl."""
    for arg, value in (("stale_after_s", stale_after_s), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{arg} must be a positive number of seconds, got {value!r}")
    lock = Path(build_directory) / "lock"
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s:
            warnings.warn(f"removed {lock}: left {age:.0f} s ago by a build that did not finish (interrupted?); "
                          "building again", stacklevel=2)
            lock.unlink(missing_ok=True)
            return True
        if not told:
            say(f"waiting for another build of {lock.parent.name} (its lock {lock} is {age:.0f} s old); a lock "
                f"left by an interrupted build is removed at {stale_after_s:.0f} s, or delete it yourself")
            told = True
        time.sleep(poll_s)


def load(name: str, *, verbose: bool = False):
    """Build (once) and import the extension of utils/native/src/<name>.cu for the current GPU. A build interrupted
    half-way is started again on the next call (`build_lock`)."""
    _check_name(name)
    if not torch.cuda.is_available():
        raise RuntimeError(f"building {name}.cu needs a CUDA GPU and a CUDA build of torch "
                           f"(compile_check() compiles the kernels without one)")
    flags = [*CUDA_FLAGS, *arch_flags(name)]
    ext = extension_name(name, flags)
    if ext in _LOADED:
        return _LOADED[ext]
    if ext in _FAILED:  # load_inline would not rebuild the same sources; say so instead of a confusing error
        raise RuntimeError(f"the build of {ext} failed earlier in this process (fix the source: a changed "
                           f"source gets a new name and a fresh build):\n{_FAILED[ext]}")
    from torch.utils.cpp_extension import load_inline, verify_ninja_availability

    verify_ninja_availability()  # a clear error if ninja is missing (pip install ninja)
    build_directory = BUILD_DIR / "torch_extensions" / ext
    function, _ = KERNELS[name]
    functions = [function] if isinstance(function, str) else list(function)
    source = kernel_source(name)
    with build_lock(build_directory):
        try:
            if name in BUILD_PARTS:
                module = _load_parts(ext, name, source, functions, flags, build_directory, verbose)
            else:
                module = load_inline(
                    name=ext,
                    cpp_sources=WRAPPER_DEFINE + source,  # host compiler: the torch wrapper; bindings generated here
                    cuda_sources=source,                  # nvcc: the kernels and their launcher
                    functions=functions,
                    extra_cuda_cflags=flags,
                    extra_include_paths=[str(CUDA_DIR)],  # for #include "flash_common.cuh"
                    build_directory=str(build_directory),
                    verbose=verbose,
                )
        except Exception as err:
            _FAILED[ext] = str(err)
            raise
    _LOADED[ext] = module
    return module


def part_sources(name: str, source: str, functions) -> dict[str, str]:
    """{file name: text} of a build in parts (BUILD_PARTS): main.cpp (the torch wrapper and its bindings, for the
    host compiler) and part<k>.cu for k = 0 (the launcher) to BUILD_PARTS[name], each for its own nvcc run."""
    bindings = "\n".join(f'  m.def("{f}", torch::wrap_pybind_function({f}), "{f}");' for f in functions)
    files = {"main.cpp": f"#include <torch/extension.h>\n{WRAPPER_DEFINE}{source}\n"
                         f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{bindings}\n}}\n"}
    for k in range(BUILD_PARTS[name] + 1):
        files[f"part{k}.cu"] = f"#define COURSE_PART {k}\n{source}"
    return files


def _load_parts(ext, name, source, functions, flags, build_directory, verbose):
    """load_inline's build, with the CUDA source compiled as parts that ninja runs at once."""
    from torch.utils.cpp_extension import load as load_sources

    paths = []
    for file, text in part_sources(name, source, functions).items():
        path = Path(build_directory) / file
        if not path.is_file() or path.read_text() != text:  # unchanged files keep ninja's earlier objects
            path.write_text(text)
        paths.append(str(path))
    return load_sources(name=ext, sources=paths, extra_cuda_cflags=flags, extra_include_paths=[str(CUDA_DIR)],
                        build_directory=str(build_directory), verbose=verbose)


def load_all(names, *, progress: bool = True, say=None) -> dict:
    """`load` each of `names`, several builds at a time, started in the order given: a build is mostly one nvcc
    and one host compiler run over torch's headers, single-threaded, so notebook 06b's ten steps build in about
    the time of a few. `say`, if given, is called with a line as each build ends (its name and seconds).
    Returns {name: module}; a failed build raises after the others finish, naming the file."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of kernel file names, got {names!r}")
    names = [_check_name(n) for n in dict.fromkeys(names)]
    if names and not torch.cuda.is_available():
        load(names[0])  # raises the RuntimeError that explains
    from tqdm.auto import tqdm

    workers = max(1, min(len(names), (os.cpu_count() or 2) // 2))  # two compiles per build
    with ThreadPoolExecutor(max_workers=workers) as pool, \
            tqdm(total=len(names), desc="building CUDA extensions", disable=not progress, leave=False) as bar:
        def timed(name):
            start = time.perf_counter()
            module = load(name)
            if say is not None:
                say(f"{name}: {time.perf_counter() - start:.0f} s")
            return module

        futures = {name: pool.submit(timed, name) for name in names}
        for future in futures.values():
            future.add_done_callback(lambda _: bar.update())
        errors = {name: f.exception() for name, f in futures.items() if f.exception() is not None}
    if errors:
        name, err = next(iter(errors.items()))
        raise RuntimeError(f"building {name}.cu failed ({len(errors)} of {len(names)} builds failed): {err}") from err
    return {name: future.result() for name, future in futures.items()}


# The builds that take longest (one nvcc run over many template instantiations) start first, so that the
# last build to finish is a short one.
LONGEST_BUILDS = ("hopper_attention", "flash_mma_bwd", "wgmma_gemm")


def buildable(capability) -> list[str]:
    """The kernel files a GPU of this (major, minor) runs, longest build first: the Hopper ones on sm_90 only,
    the tensor-core ones (notebook 06b) from sm_80."""
    capability = check_capability(capability)
    mma = [mma_kernel_name(s) for s in MMA_STEPS] + ["flash_mma_bwd"]
    order = [*LONGEST_BUILDS, *(name for name in KERNELS if name not in LONGEST_BUILDS)]
    return [name for name in order
            if (name not in HOPPER_KERNELS or capability == (9, 0)) and (name not in mma or capability >= (8, 0))]


# ---- compile-only checks -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel compiled for one architecture."""

    file: str
    arch: str
    kernel: str
    registers: int
    smem_bytes: int       # static shared memory; dynamic shared memory is chosen at launch and not shown
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    wgmma_serialized: bool = False  # ptxas made the kernel's wgmmas wait for each other (C7512, C7513, C7520, ...)
    wgmma_serialized_why: str = ""  # its reason, as ptxas gives it: "insufficient register resources", ...


def find_nvcc() -> str | None:
    """Path of nvcc, from PATH or CUDA_HOME; None if there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate and candidate.is_file() else None


def _demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt") or shutil.which("cu++filt")
    if not cxxfilt or not names:
        return names
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    return lines if out.returncode == 0 and len(lines) == len(names) else names


def short_kernel_name(demangled: str) -> str:
    """'void ns::kernel<float, 64>(ns::Params)' -> 'kernel<float, 64>': template arguments kept, rest dropped."""
    if not isinstance(demangled, str):
        raise TypeError(f"demangled must be a str, got {type(demangled).__name__}")
    name = demangled.removeprefix("void ").split("(")[0]
    head, _, tail = name.partition("<")
    head = head.split("::")[-1]
    return f"{head}<{tail}" if tail else head


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
# Every code ptxas gives this message under (C7512: too few registers; C7513: a non-wgmma instruction writes a wgmma's
# input inside the pipeline; C7520: a compiler-inserted arrive on a divergent path), with its reason.
_SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized"
                         r" due to (.*?),? (?:for|in) the function '([^']+)'")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str, file: str = "") -> list[KernelResources]:
    """Parse `nvcc -Xptxas -v` output into one KernelResources per (kernel, arch), in order of appearance."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    found, current = [], None
    serialized = {kernel: f"{code}: {why}" for code, why, kernel in _SERIALIZED.findall(text)}
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = dict(kernel=m.group(1), arch=m.group(2), stack=0, stores=0, loads=0)
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), stores=int(m.group(2)), loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            found.append((current, int(m.group(1)), int(smem.group(1)) if smem else 0))
            current = None
    names = _demangle([c["kernel"] for c, _, _ in found])
    return [KernelResources(file, c["arch"], short_kernel_name(n), regs, smem, c["stack"], c["stores"], c["loads"],
                            c["kernel"] in serialized, serialized.get(c["kernel"], ""))
            for (c, regs, smem), n in zip(found, names)]


_CHECKED: dict = {}


def _ptxas_flags(arch: str) -> list[str]:
    # the -gencode form, because nvcc 13.0's -arch=sm_90a also runs a plain sm_90 pass, which rejects wgmma
    return [*CUDA_FLAGS, f"-gencode=arch=compute_{arch.removeprefix('sm_')},code={arch}", "-Xptxas", "-v"]


def compile_source(source: str, arch: str, *, nvcc: str | None = None,
                   file: str = "source.cu") -> list[KernelResources]:
    """Compile CUDA `source` (a .cu file's text; utils/native/src on the include path) for `arch` with nvcc, kernels
    only (COURSE_TORCH_WRAPPER undefined), and return ptxas's report: a KernelResources per kernel (`file` names
    the source in them), none if the source holds no kernel. A failed compile raises with nvcc's errors."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / file
        path.write_text(source)
        proc = subprocess.run([nvcc, "-c", *_ptxas_flags(arch), f"-I{CUDA_DIR}", str(path), "-o",
                               str(path.with_suffix(".o"))], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {file} for {arch}:\n{proc.stderr[-4000:]}")
    return parse_ptxas(proc.stdout + proc.stderr, file=file)


def _compile_one(nvcc: str, name: str, arch: str) -> list[KernelResources]:
    # v3: every C75xx
    key = hashlib.sha256(f"{nvcc}\0{source_hash(name, _ptxas_flags(arch))}\0v3".encode()).hexdigest()[:16]
    if key in _CHECKED:
        return _CHECKED[key]
    cache = BUILD_DIR / "compile_check" / f"{name}-{arch}-{key}.json"
    if cache.is_file():  # same nvcc, same sources, same flags: same answer (kept across processes)
        result = [KernelResources(**r) for r in json.loads(cache.read_text())]
    else:
        result = compile_source(kernel_source(name), arch, nvcc=nvcc, file=f"{name}.cu")
        if not result:
            raise RuntimeError(f"no ptxas report in the output of nvcc for {name}.cu ({arch})")
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")   # whole or absent for a parallel reader
        partial.write_text(json.dumps([asdict(r) for r in result]))
        os.replace(partial, cache)
    _CHECKED[key] = result
    return result


def kernel_archs(name: str) -> tuple[str, ...]:
    """The architectures `compile_check` builds `name` for by default: sm_90a for the Hopper kernels, else ARCHS."""
    return (HOPPER_ARCH,) if _check_name(name) in HOPPER_KERNELS else ARCHS


def compile_check(names=None, archs=None, *, nvcc: str | None = None) -> list[KernelResources]:
    """Compile utils/native/src/<name>.cu for each arch with nvcc, kernels only, and return ptxas's report.
    `archs` defaults to each kernel's own (`kernel_archs`); the Hopper kernels compile for sm_90a only.

    Needs nvcc, not a GPU: the torch-facing wrapper is left out (COURSE_TORCH_WRAPPER is not defined). Compiles run in
    parallel; results are cached per (nvcc, sources, flags), in this process and under build/compile_check/.
    """
    names = list(KERNELS) if names is None else [names] if isinstance(names, str) else list(names)
    for name in names:
        _check_name(name)
    given = None if archs is None else [archs] if isinstance(archs, str) else list(archs)
    for arch in given or ():
        if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+a?", arch):
            raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
        if arch.endswith("a") and not all(name in HOPPER_KERNELS for name in names):
            raise ValueError(f"arch {arch!r}: only {HOPPER_KERNELS} are written for it")
    for name in names:
        if name in HOPPER_KERNELS and given is not None and given != [HOPPER_ARCH]:
            raise ValueError(f"{name}.cu uses wgmma: it compiles for {HOPPER_ARCH!r} only, not {given}")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    jobs = [(name, arch) for name in names for arch in (given or kernel_archs(name))]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda job: _compile_one(nvcc, *job), jobs))
    return [r for result in results for r in result]



def cuda_include_dir(nvcc: str | None = None) -> str:
    """The CUDA toolkit's include folder, as nvcc itself passes it on (`nvcc --dryrun`): right where nvcc is a
    wrapper script or a link outside the toolkit."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.cu"
        empty.write_text("")
        dry = subprocess.run([nvcc, "--dryrun", "-c", str(empty)], capture_output=True, text=True)
    found = re.search(r'INCLUDES="-I([^"]+?)\s*"', dry.stdout + dry.stderr)
    if found is None:
        raise RuntimeError(f"nvcc --dryrun named no include folder:\n{(dry.stdout + dry.stderr)[-2000:]}")
    return found.group(1)


def check_wrapper(name: str, *, cxx: str | None = None, nvcc: str | None = None) -> None:
    """Compile the torch-facing wrapper of utils/native/src/<name>.cu (COURSE_TORCH_WRAPPER defined, as the
    extension's main.cpp) with the host compiler `cxx` (default: $CXX or c++), syntax only. Needs no GPU and no CUDA
    build of torch: the one header a CPU build of torch lacks (c10/cuda/impl/cuda_cmake_macros.h, generated at
    torch's build) is stood in for by an empty one. Raises RuntimeError with the compiler's errors."""
    _check_name(name)
    from torch.utils import cpp_extension

    cxx = cxx or shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        raise RuntimeError("no host C++ compiler found (set CXX)")
    includes = [str(CUDA_DIR), cuda_include_dir(nvcc), sysconfig.get_paths()["include"],
                *cpp_extension.include_paths()]
    source = "#include <torch/extension.h>\n" + WRAPPER_DEFINE + kernel_source(name)
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("// stands in for the header a CUDA build of torch generates (none in a CPU build)\n")
        proc = subprocess.run([cxx, "-fsyntax-only", "-std=c++17", "-w", "-x", "c++", "-",
                               *[f"-I{d}" for d in includes], f"-I{tmp}"], input=source, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        raise RuntimeError(f"the host compiler rejects {name}.cu's torch wrapper:\n" + "\n".join(errors[:20]))


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m utils.native.build")
    parser.add_argument("what", choices=["compile-check", "build"],
                        help="build: every extension this GPU runs, into build/torch_extensions/ (before a workshop)")
    parser.add_argument("--out", type=Path, help="write the records as JSON here")
    args = parser.parse_args(argv)
    if args.what == "build":
        names = buildable(gpu.capability()) if torch.cuda.is_available() else list(KERNELS)
        modules = load_all(names, say=lambda line: print(line, flush=True))
        print(f"built {len(modules)} extensions under {BUILD_DIR / 'torch_extensions'}: {', '.join(modules)}")
        return list(modules)
    records = [asdict(r) for r in compile_check()]
    for r in records:
        print(r)
    payload = dict(results=records)
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1))
    return records


if __name__ == "__main__":
    main()


def excerpt(source: str, start: str, end: str) -> str:
    """The lines of `source` from the one containing `start` up to (not including) the first line after it
    containing `end`: the part of a kernel a notebook discusses, rather than the whole file."""
    if not all(isinstance(s, str) for s in (source, start, end)):
        raise TypeError("excerpt(source, start, end) takes three strings")
    if start not in source:
        raise ValueError(f"start {start!r} is not in the source")
    begin = source.rfind("\n", 0, source.index(start)) + 1
    after = source.find("\n", begin) + 1  # `end` is looked for from the next line on
    found = source.find(end, after) if after else -1
    stop = source.rfind("\n", begin, found)
    if found < 0 or stop < begin:
        raise ValueError(f"end {end!r} is not on a line after {start!r}")
    return source[begin:stop].rstrip()
