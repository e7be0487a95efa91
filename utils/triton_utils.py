"""Triton debug helpers the notebooks build on.

Host-side helpers (`cdiv`, `test_pid_conds`, `print_if`, `breakpoint_if`, `check_tensors_gpu_ready`) are plain
Python. In the interpreter (TRITON_INTERPRET=1) a kernel body is plain Python too, so `print_if` and
`breakpoint_if` can be called from inside a kernel with `tl.program_id(...)` values to debug one program.
`show_source` and `show_diff` print part of a function's source, or what changed between two versions of a
kernel (the notebooks' step-by-step kernels).

The offset and mask helpers at the bottom are `@triton.jit` functions: import this module after
TRITON_INTERPRET is decided (the notebooks' bootstrap cell does that).
"""
from __future__ import annotations

import difflib
import inspect
import numbers
import os
import pdb
import re
import sys

import numpy as np
import torch
import triton
import triton.language as tl

_OPS = {
    "=": lambda a, b: a == b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
_COND = re.compile(r"^\s*(==|!=|<=|>=|=|<|>)\s*(-?\d+)\s*$")


def cdiv(a: int, b: int) -> int:
    """Ceiling division, e.g. how many blocks of size `b` cover `a` elements."""
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"cdiv: {name} must be an int, got {type(x).__name__}")
    if b == 0:
        raise ValueError("cdiv: b must not be zero")
    return -(-int(a) // int(b))


def interpreting() -> bool:
    """Whether Triton kernels defined from now on run in the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fix_interpreter_scalars() -> bool:
    """Make `range(0, n, BLOCK)` over a kernel argument work in the interpreter of Triton < 3.7 with NumPy >= 2.4.

    That interpreter turns a scalar into an index with `int()` of a one-element array, which NumPy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.7 squeezes the array first
    (triton-lang/triton#9171). On an older Triton this does the same. Returns whether it changed anything."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "course_fixed", False) or "squeeze" in inspect.getsource(original):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.course_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def require_interpreter() -> None:
    """Raise a RuntimeError that says what to do unless kernels run in the interpreter *and* Triton was imported
    with it on. Triton reads TRITON_INTERPRET whenever `@triton.jit` runs, its own library (tl.sum, tl.max, ...)
    included: set after `import triton`, the flag makes your kernels interpreted but leaves those compiled, and an
    interpreted kernel that calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    if not interpreting():
        raise RuntimeError("the Triton interpreter is off: set os.environ['TRITON_INTERPRET'] = '1' before "
                           "`import triton` (and before defining any kernel)")
    from triton.runtime.interpreter import InterpretedFunction

    stale = [name for name, fn in (("tl.sum", tl.sum), ("utils.triton_utils.offsets_1d", offsets_1d))
             if not isinstance(fn, InterpretedFunction)]
    if stale:
        raise RuntimeError(f"{' and '.join(stale)} were compiled for the GPU: Triton (or this module) was imported "
                           "before TRITON_INTERPRET=1 was set. Restart the kernel and run the notebook from the top.")
    fix_interpreter_scalars()


def _pid_value(pid, name: str) -> int:
    """A program id as an int: ints, one-element tensors (the interpreter's `tl.program_id`) and lists."""
    value = pid
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{name} must have exactly one element, got {len(value)}")
        value = value[0]
    handle = getattr(value, "handle", None)  # a tl.tensor in the interpreter wraps a numpy array
    if handle is not None and hasattr(handle, "data"):
        value = handle.data
    if isinstance(value, (torch.Tensor, np.ndarray)):
        count = value.size if isinstance(value, np.ndarray) else value.numel()
        if count != 1:
            raise ValueError(f"{name} must have exactly one element, got shape {tuple(value.shape)}")
        value = value.reshape(-1)[0].item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, a one-element tensor or a one-element list, got {pid!r}")
    return int(value)


_NO_PID = object()  # default of pid_0..2: a condition on an axis whose pid was not passed is an error


def test_pid_conds(conds: str, pid_0=_NO_PID, pid_1=_NO_PID, pid_2=_NO_PID) -> bool:
    """Whether program ids satisfy `conds`, e.g. "=0,>1" or ">=2,,!=3".

    Entry i (comma-separated) applies to pid_i; an empty entry always holds; all entries must hold.
    Operators: = == != < <= > >=. A condition on an axis needs that pid passed: it raises ValueError
    rather than silently comparing a missing pid against 0.
    """
    if not isinstance(conds, str):
        raise TypeError(f"conds must be a string such as '=0,>1', got {type(conds).__name__}")
    entries = conds.split(",")
    if len(entries) > 3:
        raise ValueError(f"conds {conds!r} has {len(entries)} entries; at most 3 (one per program axis)")
    for axis, (entry, pid) in enumerate(zip(entries, (pid_0, pid_1, pid_2))):
        if entry.strip() == "":
            continue
        match = _COND.match(entry)
        if match is None:
            raise ValueError(
                f"condition {entry!r} in {conds!r} is not an operator ({' '.join(_OPS)}) followed by an integer")
        if pid is _NO_PID:
            raise ValueError(f"conds {conds!r} has a condition on axis {axis}, but pid_{axis} was not passed")
        op, value = match.groups()
        if not _OPS[op](_pid_value(pid, f"pid_{axis}"), int(value)):
            return False
    return True


test_pid_conds.__test__ = False  # a debug helper, not a pytest test, despite its (conventional) name


def print_if(txt, conds: str, pid_0=_NO_PID, pid_1=_NO_PID, pid_2=_NO_PID) -> None:
    """Print `txt` only in the programs whose ids satisfy `conds` (see `test_pid_conds`)."""
    if test_pid_conds(conds, pid_0, pid_1, pid_2):
        print(txt)


def breakpoint_if(conds: str, pid_0=_NO_PID, pid_1=_NO_PID, pid_2=_NO_PID) -> None:
    """Open pdb in the *caller's* frame (the kernel body, in the interpreter) only in the programs whose ids
    satisfy `conds`, so `p offs` works at once. PYTHONBREAKPOINT=0 turns every such call off, as it does for
    the builtin `breakpoint()`."""
    if test_pid_conds(conds, pid_0, pid_1, pid_2) and os.environ.get("PYTHONBREAKPOINT") != "0":
        pdb.Pdb().set_trace(sys._getframe(1))


def check_tensors_gpu_ready(*tensors) -> None:
    """Raise unless every tensor is contiguous and on one CUDA device (CPU tensors are fine in the interpreter,
    except bf16: the interpreter computes with NumPy, which has no bfloat16, so it would give wrong numbers
    without an error)."""
    allow_cpu = interpreting()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument {i} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"argument {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous; "
                             "call .contiguous() first")
        if t.device.type != "cuda" and not (allow_cpu and t.device.type == "cpu"):
            hint = "" if allow_cpu else " (set TRITON_INTERPRET=1 before defining kernels to run them on the CPU)"
            raise ValueError(f"argument {i} is on {t.device}, not on a CUDA device{hint}")
        if allow_cpu and t.dtype == torch.bfloat16:
            raise TypeError(f"argument {i} is bfloat16: the Triton interpreter has no bf16 arithmetic (wrong "
                            "numbers, no error); use .float() on the CPU")
        if t.device != tensors[0].device:
            raise ValueError(f"argument {i} is on {t.device} but argument 0 is on {tensors[0].device}: "
                             "one kernel reads one device's memory")


def _source_lines(obj) -> list[str]:
    """Source lines of a function, a @triton.jit kernel (its .fn) or a string."""
    if isinstance(obj, str):
        return obj.splitlines()
    fn = getattr(obj, "fn", obj)
    if not callable(fn):
        raise TypeError(f"expected a function, a @triton.jit kernel or a string, got {type(obj).__name__}")
    return inspect.getsource(fn).splitlines()


def show_source(obj, start: str | None = None, end: str | None = None) -> None:
    """Print the source of `obj` from the first line containing `start` up to, not including, the next line
    containing `end` (None: from the top / to the bottom), with line numbers: the part the text discusses."""
    lines = _source_lines(obj)
    first = 0 if start is None else next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"no line contains {start!r}")
    last = len(lines) if end is None else next((i for i in range(first + 1, len(lines)) if end in lines[i]), None)
    if last is None:
        raise ValueError(f"no line after {start!r} contains {end!r}")
    print("\n".join(f"{i + 1:4d}  {lines[i]}" for i in range(first, last)))


def show_diff(old, new, context: int = 2) -> None:
    """Print a unified diff between two versions of a kernel (functions, @triton.jit kernels or strings):
    what one step of a notebook changes. Lines starting with - are removed, + added."""
    a, b = _source_lines(old), _source_lines(new)
    names = [getattr(getattr(x, "fn", x), "__name__", "old" if x is old else "new") for x in (old, new)]
    print("\n".join(difflib.unified_diff(a, b, *names, n=context, lineterm="")))


# --- Offsets and masks for 1-D and 2-D tiles, used inside kernels ---------------------------------------

@triton.jit
def offsets_1d(size: tl.constexpr, block_index):
    """Offsets of block `block_index` of `size` elements: block_index*size + [0, size)."""
    return block_index * size + tl.arange(0, size)


@triton.jit
def offsets_2d(offs_0, offs_1, stride_0, stride_1=1):
    """Element offsets of the tile with rows `offs_0` and columns `offs_1`, for the given strides."""
    return tl.expand_dims(offs_0, 1) * stride_0 + tl.expand_dims(offs_1, 0) * stride_1


@triton.jit
def mask_1d(offs, limit):
    return offs < limit


@triton.jit
def mask_2d(offs_0, offs_1, limit_0, limit_1):
    return (tl.expand_dims(offs_0, 1) < limit_0) & (tl.expand_dims(offs_1, 0) < limit_1)
