"""The first cell of every notebook calls `setup()`.

It makes the course importable, turns on the Triton interpreter where there is no CUDA GPU (before any
kernel is defined, since Triton reads TRITON_INTERPRET when `@triton.jit` runs), picks a device, a dtype and
problem sizes, registers the `%%gpu` cell magic and prints one line about the environment.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import linecache
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[2]
COURSE_URL = "https://github.com/flash-attention-from-scratch/course"
# What a fresh Colab runtime may lack. Never torch or triton: Colab ships a matched pair.
COLAB_EXTRAS = {"einops": "einops", "tqdm": "tqdm", "ninja": "ninja", "matplotlib": "matplotlib"}


@dataclass(frozen=True)
class Env:
    """What a notebook needs to know about where it runs."""

    device: "torch.device"
    dtype: "torch.dtype"
    gpu_name: str | None
    capability: tuple[int, int] | None
    interpret: bool
    colab: bool
    root: Path = ROOT

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, cpu, gpu):
        """`cpu` on a machine without a CUDA GPU, else `gpu`: keeps CPU runs short, GPU runs meaningful."""
        return gpu if self.on_gpu else cpu

    def supports(self, capability: tuple[int, int], what: str) -> bool:
        """Whether the GPU (or the one COURSE_EMULATE_GPU emulates) is at least `capability`; if it is not, one
        line says that `what` needs a newer GPU, so a cell can skip its body instead of raising."""
        if self.on_gpu and self.capability >= capability:
            return True
        where = f"this GPU is sm_{self.capability[0]}{self.capability[1]}" if self.on_gpu else "no GPU here"
        print(f"skipped: {what}: needs an sm_{capability[0]}{capability[1]}+ GPU; {where}")
        return False

    def describe(self) -> str:
        import torch

        where = f"{self.gpu_name} (sm_{self.capability[0]}{self.capability[1]})" if self.on_gpu else "CPU"
        mode = "Triton interpreter" if self.interpret else "compiled Triton"
        colab = ", Colab" if self.colab else ""
        return (f"device={self.device} [{where}{colab}] dtype={str(self.dtype).removeprefix('torch.')} "
                f"{mode} | torch {torch.__version__}, triton {triton_version()}")


def triton_version() -> str:
    """Triton's version without importing it: a notebook may still turn the interpreter on before its first
    `import triton` (Triton's own jit library, tl.sum and tl.max among it, is built for one mode at import)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        import triton

        return triton.__version__


def in_colab() -> bool:
    return "google.colab" in sys.modules


def default_dtype(capability: tuple[int, int] | None):
    """bf16 where tensor cores support it (sm80+), fp16 on older GPUs (Colab's T4 is sm75), fp32 on the CPU,
    where the Triton interpreter has no bf16 arithmetic (it gives wrong numbers without an error)."""
    import torch

    if capability is None:
        return torch.float32
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def misspelt_interpret_vars(environ=os.environ) -> list[str]:
    """Names like TRITON_INTERPRETER or TRITON_INTERPETER: Triton silently ignores them."""
    return sorted(k for k in environ if k.startswith("TRITON_INT") and k != "TRITON_INTERPRET")


def missing_modules(modules: dict[str, str]) -> list[str]:
    """The pip names of the modules in {module: pip name} that cannot be imported."""
    return [pip for mod, pip in modules.items() if importlib.util.find_spec(mod) is None]


def install_colab_extras() -> list[str]:
    missing = missing_modules(COLAB_EXTRAS)
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
    return missing


def setup(*, quiet: bool = False) -> Env:
    """Prepare the notebook's process; call it before importing anything that defines Triton kernels."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    colab = in_colab()
    if colab:
        install_colab_extras()
    for name in misspelt_interpret_vars():
        print(f"warning: {name} is set but Triton only reads TRITON_INTERPRET (misspelt?)", file=sys.stderr)

    import torch

    from utils import gpu as gpu_info

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    capability = gpu_info.capability()  # the emulated GPU's under COURSE_EMULATE_GPU (utils/gpu.py)
    env = Env(
        device=torch.device("cuda" if gpu else "cpu"),
        dtype=default_dtype(capability),
        gpu_name=gpu_info.name(),
        capability=capability,
        interpret=interpret,
        colab=colab,
    )
    if interpret:
        from utils.triton_utils import fix_interpreter_scalars

        fix_interpreter_scalars()  # Triton < 3.7 with NumPy >= 2.4 (see there)
    register_gpu_magic()
    if not quiet:
        print(env.describe())
    return env


def run_gpu_cell(cell: str, namespace: dict, *, gpu: bool | None = None):
    """Body of the `%%gpu` cell magic: run `cell` in `namespace` only where CUDA is available.

    The value of a final expression is returned, so Jupyter displays it as it would for a plain cell.
    On a CPU the cell is skipped with a message (the test suite reports such cells as skipped).
    """
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    if not gpu:
        print("skipped: this cell needs a CUDA GPU")
        return None
    return run_body(cell, namespace, "gpu-cell")


def run_after_cell(line: str, cell: str, namespace: dict):
    """Body of the `%%after 10.1a 10.1b` cell magic: run `cell` in `namespace` only once the checks of the
    exercises named on the line have said right in this session, since the cell runs the learner's answers to
    them. Until then the cell is skipped with a message, so a notebook with exercises still open runs to its end."""
    from utils.course.exercises import solved

    numbers = line.split()
    if not numbers:
        raise ValueError("%%after: name the exercises whose answers the cell runs, e.g. %%after 10.2")
    waiting = [n for n in numbers if not solved(n)]
    if waiting:
        print(f"skipped: this cell runs your answer to {' and '.join(waiting)}; run it again once "
              f"{'that check says' if len(waiting) == 1 else 'those checks say'} right")
        return None
    return run_body(cell, namespace, "after-cell")


def run_body(cell: str, namespace: dict, name: str):
    """Run a cell's code in `namespace` as Jupyter would: the value of a final expression is returned."""
    filename = register_source(cell, name)
    tree = ast.parse(cell, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
    return None


def register_source(source: str, name: str) -> str:
    """Register `source` with linecache under a file name made from `name` and its hash, and return that name.
    Code compiled under it has a source, as a Jupyter cell's has: `inspect.getsource`, tracebacks and
    `@triton.jit` (which reads a kernel's source to compile it for a GPU) need one; `exec` of a bare string has none."""
    filename = f"<{name}-{hashlib.sha256(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return filename


def register_gpu_magic() -> bool:
    """Register `%%gpu` and `%%after` in the running IPython, if any. Returns whether they were registered."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False

    def gpu(line, cell):
        return run_gpu_cell(shell.transform_cell(cell), shell.user_ns)

    def after(line, cell):
        return run_after_cell(line, shell.transform_cell(cell), shell.user_ns)

    shell.register_magic_function(gpu, magic_kind="cell", magic_name="gpu")
    shell.register_magic_function(after, magic_kind="cell", magic_name="after")
    return True
