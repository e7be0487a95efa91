"""Launching Triton kernels without Triton's per-call dispatch (notebook 05b, step 3: the host).

`kernel[grid](*args, **meta)` does four things in Python on every call: it binds the arguments, derives each
one's specialization (a tensor's dtype and 16-byte alignment; an int's type and whether it is 1 or divisible by
16), hashes those into a key of its cache of compiled kernels, and launches the one found. At N <= 1k the GPU
finishes an attention forward sooner than the CPU issues the call, so every microsecond of that is the GPU
waiting (images/host_h200.json, read in notebook 05b section 7, has the host time of both paths).

`FastLauncher(kernel)` keeps each compiled kernel that Triton returns under a key it computes more cheaply from
the same facts, and later calls launch it directly (`CompiledKernel.run`, what Triton itself calls last). The
key is never coarser than Triton's specialization, so a call never reaches a kernel compiled for other
arguments; a call it has not seen goes through `kernel[grid]` (which compiles or finds the kernel) and is then
remembered. It steps aside, so everything behaves as `kernel[grid]` does, when:
  - the kernel runs in the interpreter (TRITON_INTERPRET=1): there is no compiled kernel;
  - the installed Triton's `CompiledKernel.run` takes other arguments than this module passes (`runs_directly`;
    a RuntimeWarning says so, once);
  - a launch hook is installed (the proton profiler installs one) or Triton's debug mode is on;
  - `dispatch_by_triton()` is active (notebook 05b times both paths with it).

A caller that makes the same kinds of call again and again (the Triton forward of utils.tiled.fast.forward, the
backwards of utils.tiled.fast.backward and utils.explicit.backward) goes one step further.
`launcher.bind(grid, args, meta, head=n)` launches once and returns a `Bound` launch whose grid, trailing
arguments (all but the first n) and constexprs are fixed, so a later call passes only the first n (its fresh
tensors) and the stream. `Kind` keeps a caller's checked choices and bound launches for one kind of call
(`kind_key`: shapes, strides, dtypes, devices, alignment, options and the GPU profile emulated); `kind_of`
finds a call's Kind, or checks the call and keeps a new one. A Kind also keeps the host TMA descriptors of its
first call as templates: a later call copies them onto its own tensors (`rebase`) instead of constructing and
checking each one again (notebook 05b section 7 times both; the Gluon backward passes nine descriptors).
A caller's kinds live in a `kind_cache()`, which keeps the MAX_KINDS used most recently.
"""
from __future__ import annotations

import inspect
import os
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from utils.gpu import EMULATE_VAR

_INT32 = (-2**31, 2**31)
_triton_dispatch = 0   # > 0 inside dispatch_by_triton()
MAX_KINDS = 128        # kinds of call a kind_cache() keeps: a program whose shapes vary does not grow it without end
# What this module passes CompiledKernel.run before the kernel's arguments, named as Triton 3.7 names them
# (older launchers take the same values, unnamed, in *args).
RUN_PARAMETERS = ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                  "launch_enter_hook", "launch_exit_hook")
_warned_run = False    # runs_directly has warned


def specialization_key(args) -> tuple:
    """What Triton specializes a kernel on, for positional `args`, as a hashable tuple that separates at least
    every pair of argument lists Triton separates: tensors by dtype and 16-byte alignment of the data pointer;
    ints by 32/64-bit, equality to 1 and divisibility by 16; host tensor descriptors (Triton's and Gluon's) by
    their tensor's dtype and alignment, rank, tile shape, padding options and, for Gluon's, shared layout;
    other values (floats, bools, None) by type."""
    key = []
    for a in args:
        if type(a) is int or (isinstance(a, int) and not isinstance(a, bool)):  # the common case first
            key.append((a % 16 == 0) + 2 * (a == 1) + 4 * (not _INT32[0] <= a < _INT32[1]))  # 3 bits, one int
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, TensorDescriptor):
            key.append((TensorDescriptor, a.base.dtype, a.base.data_ptr() % 16 == 0, len(a.shape),
                        tuple(a.block_shape), a.padding, getattr(a, "round_f32_to_tf32", False)))
        elif hasattr(a, "layout") and hasattr(a, "block_shape"):  # a Gluon descriptor: its shared layout is typed
            key.append((type(a), a.base.dtype, a.base.data_ptr() % 16 == 0, len(a.shape), tuple(a.block_shape),
                        a.padding, a.layout))  # Gluon's layouts are frozen dataclasses: hashed and compared by value
        else:
            key.append(type(a))
    return tuple(key)


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps None or a function, 3.7 a HookChain of `calls`."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct() -> bool:
    """Whether launches may skip Triton's dispatch now: not the interpreter's kernels (FastLauncher checks that),
    no launch hook, no debug mode, not inside dispatch_by_triton()."""
    return not (_triton_dispatch or knobs.runtime.debug or _hooked(knobs.runtime.launch_enter_hook)
                or _hooked(knobs.runtime.launch_exit_hook))


def runs_directly(compiled) -> bool:
    """Whether `compiled.run`, Triton's private launcher, takes what FastLauncher and Bound pass it: positional
    parameters named as the first of RUN_PARAMETERS, then *args (and no keyword-only one without a default).
    If not (another Triton), a RuntimeWarning, once per process; the caller then launches through `kernel[grid]`."""
    global _warned_run
    try:
        signature = inspect.signature(compiled.run)
    except (TypeError, ValueError):   # a callable whose signature Python cannot read
        signature = None
    if signature is not None and hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
        params = signature.parameters.values()
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        if (positional == RUN_PARAMETERS[:len(positional)] and any(p.kind is p.VAR_POSITIONAL for p in params)
                and all(p.default is not p.empty for p in params if p.kind is p.KEYWORD_ONLY)):
            return True
    if not _warned_run:
        _warned_run = True
        warnings.warn(f"this Triton's CompiledKernel.run{signature or '(?)'} differs from what "
                      f"utils.tiled.fast.launch passes ({', '.join(RUN_PARAMETERS)}, *args): its kernels launch through kernel[grid]",
                      RuntimeWarning, stacklevel=3)
    return False


@contextmanager
def dispatch_by_triton():
    """Inside this block every FastLauncher launches through `kernel[grid]`, Triton's own dispatch."""
    global _triton_dispatch
    _triton_dispatch += 1
    try:
        yield
    finally:
        _triton_dispatch -= 1


class FastLauncher:
    """`FastLauncher(kernel)[grid](*args, **meta)` launches like `kernel[grid](*args, **meta)`.

    `args` are the kernel's runtime arguments, by position; `meta` its constexprs and launch options
    (num_warps, num_stages), by keyword. The grid is a tuple of 1 to 3 ints. The kernel's runtime parameters
    must come before its constexprs (the launcher takes all of them in signature order and skips constexprs)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}   # (device, meta, specialization) -> (CompiledKernel, constexpr values)
        self.interpreted = not hasattr(kernel, "device_caches")   # TRITON_INTERPRET=1: nothing is compiled
        self.by_triton = self.interpreted   # every launch through kernel[grid]: also when not runs_directly
        if self.interpreted:
            return
        params = kernel.params
        n_runtime = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[:n_runtime]):
            raise ValueError(f"{kernel.__name__}: FastLauncher needs the runtime parameters before the constexprs")
        self.n_runtime = n_runtime
        self.constexprs = [(p.name, p.default) for p in params[n_runtime:]]

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def bind(self, grid, args, meta, head: int) -> "Bound | None":
        """Launch as `self[grid](*args, **meta)` does and return that launch with everything but `args[:head]`
        fixed; None where there is no compiled kernel to bind (the interpreter, not direct(), or a Triton whose
        CompiledKernel.run differs: runs_directly)."""
        compiled = self.launch(grid, args, meta)
        if self.by_triton or compiled is None or not direct():
            return None
        grid = (*grid, 1, 1)
        constexprs = tuple(meta.get(name, default) for name, default in self.constexprs)
        return Bound(compiled, grid[0], grid[1], grid[2], (*args[head:], *constexprs))

    def launch(self, grid, args, meta):
        if self.by_triton or not direct():
            return self.kernel[grid](*args, **meta)
        device = driver.active.get_current_device()
        key = (device, tuple(meta.items()), specialization_key(args))
        entry = self.compiled.get(key)
        if entry is None:
            if len(args) != self.n_runtime:
                raise TypeError(f"{self.kernel.__name__} takes {self.n_runtime} runtime arguments by position, "
                                f"got {len(args)}")
            compiled = self.kernel[grid](*args, **meta)   # compiles, or finds the kernel in Triton's caches
            if compiled is None:  # JITFunction.run replaced (utils.course.cross_compile records launches): nothing to keep
                return None
            compiled._init_handles()
            if not runs_directly(compiled):
                self.by_triton = True
                return compiled
            self.compiled[key] = compiled, tuple(meta.get(name, default) for name, default in self.constexprs)
            return compiled
        compiled, constexprs = entry
        grid = (*grid, 1, 1)
        compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *constexprs)
        return compiled


def kind_key(tensors, options: tuple) -> tuple | None:
    """A key of everything a caller's checks and launches depend on: its `options` (hashable values whose types
    the caller has checked), each tensor's shape, strides, dtype, device and 16-byte alignment (what Triton
    specializes a pointer on), and the GPU profile emulated (utils.gpu: a T4's tiles and refusals). None unless
    every one is a CUDA tensor: a call on a CPU is checked every time."""
    if not all(type(t) is torch.Tensor and t.is_cuda for t in tensors):
        return None
    return (*options, os.environ.get(EMULATE_VAR),   # per-tensor tuples from one list: cheaper than 5 generators
            *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors])


def rebase(descriptor, base):
    """A copy of a host TMA descriptor (Triton's or Gluon's TensorDescriptor) over the tensor `base`, without the
    constructor's checks: for a tensor of the dtype, shape, strides and 16-byte alignment it was made for. None
    stays None."""
    if descriptor is None:
        return None
    copy = object.__new__(type(descriptor))
    copy.__dict__.update(descriptor.__dict__)
    copy.base = base
    return copy


class Kind:
    """What a caller keeps for one kind of call: its checked `choices`, once its first call has launched them
    its bound launches (and the device they were bound on), its descriptors' templates, and `derived`: the kinds
    of the calls that follow one of this kind (a forward's backward), under the key of what else they take (a
    `kind_cache()`)."""
    __slots__ = ("choices", "launches", "device", "templates", "derived")

    def __init__(self, choices):
        self.choices, self.launches, self.device, self.templates = choices, None, None, None
        self.derived = kind_cache()

    def descriptors(self, tensors, make) -> tuple:
        """This call's host TMA descriptors, one per tensor of `tensors` (None where there is none): `make()`'s
        at the kind's first call, kept as templates without their tensors (which are not kept alive); later
        calls copy each template onto their tensor (`rebase`). The caller vouches that the kind fixes each
        tensor's dtype, shape, strides and 16-byte alignment: its own inputs through kind_key, the tensors it
        allocates through their shapes."""
        if self.templates is None:
            made = tuple(make())
            if len(made) != len(tensors):
                raise ValueError(f"make() gave {len(made)} descriptors for {len(tensors)} tensors")
            self.templates = tuple(rebase(d, None) for d in made)
            return made
        return tuple(rebase(t, x) for t, x in zip(self.templates, tensors))

    def ready(self) -> bool:
        """Whether the bound launches may run now: bound, on the current device, and launches direct."""
        return self.launches is not None and self.device == driver.active.get_current_device() and direct()

    def run(self, heads) -> None:
        """Run the bound launches (where `ready()`), each with its leading arguments from `heads`."""
        stream = driver.active.get_current_stream(self.device)
        for bound, head in zip(self.launches, heads):
            bound(stream, *head)

    def launch(self, heads, specs, keep: bool) -> None:
        """Launch a call: `heads` holds each launch's leading arguments, made by this call. A kind seen before
        (on the current device, with launches direct) runs its bound launches; otherwise `specs()` gives each
        launch's (FastLauncher, grid, trailing arguments, constexprs and options), and with `keep` (a call
        with a kind_key) the launches are bound and kept: a launch on a CPU binds nothing."""
        if keep and self.ready():
            self.run(heads)
            return
        bound = [launcher.bind(grid, (*head, *tail), meta, head=len(head))
                 for (launcher, grid, tail, meta), head in zip(specs(), heads)]
        if keep and None not in bound:   # new launches: descriptor templates are made again from their choices
            self.launches, self.device, self.templates = bound, driver.active.get_current_device(), None


def kind_cache() -> OrderedDict:
    """An empty cache of kinds of call for kind_of, which keeps the MAX_KINDS used most recently."""
    return OrderedDict()


def keep(kinds: OrderedDict, key, kind: Kind) -> None:
    """Keep `kind` under `key` in `kinds` as the most recently used, forgetting the least recently used beyond
    MAX_KINDS (a forgotten kind's next call is checked and bound again)."""
    kinds[key] = kind
    kinds.move_to_end(key)
    while len(kinds) > MAX_KINDS:
        kinds.popitem(last=False)


def kind_of(kinds: OrderedDict, key, choose) -> Kind:
    """The Kind kept in `kinds` (a `kind_cache()`) under `key`, or a new Kind of `choose()` (the caller's checks
    and choices, which raise on a bad argument), kept under `key` unless it is None (a call that is checked every
    time)."""
    kind = kinds.get(key) if key is not None else None
    if kind is None:
        kind = Kind(choose())
        if key is not None:
            keep(kinds, key, kind)
    else:
        kinds.move_to_end(key)   # the least recently used go first
    return kind


class Bound(NamedTuple):
    """A compiled kernel with its grid and trailing arguments fixed: `bound(stream, *head)` launches it on `stream`
    (driver.active.get_current_stream(device)) with `head`, the leading runtime arguments. The caller vouches that
    `head` is specialized as the arguments it was bound with were (same dtypes and pointer alignment)."""
    compiled: Any
    x: int
    y: int
    z: int
    tail: tuple

    def __call__(self, stream, *head):
        c = self.compiled
        c.run(self.x, self.y, self.z, stream, c.function, c.packed_metadata, None, None, None, *head, *self.tail)
