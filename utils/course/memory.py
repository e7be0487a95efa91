"""Peak memory of a function call: the CUDA allocator's counter on a GPU, a dispatch-level tracker on a CPU.

The CPU has no allocator statistics, so `AllocationTracker` intercepts every operator (TorchDispatchMode),
records each tensor an operator returns in new memory, and notices through weak references when Python frees
it: the running total of live bytes, and its peak. That is the part of `torch.cuda.max_memory_allocated` made
of returned tensors. It does not see memory an operator allocates for itself and frees before returning (a
workspace: CPU SDPA's, for instance; `torch.profiler` with `profile_memory=True` does), nor the allocator's
rounding to 512-byte blocks. Tensors that existed before (the inputs) and views of existing storage are not
counted. Memory a kernel keeps outside PyTorch tensors (the Triton interpreter's NumPy scratch, for instance,
which stands for on-chip SRAM on a GPU) is not seen either.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    """Live bytes of the tensors allocated while active, their peak, and a log of every allocation."""

    def __init__(self):
        super().__init__()
        self.live = {}   # storage address -> (bytes, weak references to the tensors using it)
        self.current = self.peak = 0
        self.log = []    # (operator, shape, dtype, bytes, live bytes after it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._forget_dead()
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.live:                 # a view of a tensor we already count
                self.live[key][1].append(weakref.ref(t))
            elif key not in inputs:              # new memory (not a view or in-place update of an input)
                nbytes = t.untyped_storage().nbytes()
                self.live[key] = (nbytes, [weakref.ref(t)])
                self.current += nbytes
                self.log.append((func.__name__.split(".")[0], tuple(t.shape), t.dtype, nbytes, self.current))
        self.peak = max(self.peak, self.current)
        return out

    def _forget_dead(self):
        for key, (nbytes, refs) in list(self.live.items()):
            if all(r() is None for r in refs):
                del self.live[key]
                self.current -= nbytes


def peak_memory(fn, *args, **kwargs) -> int:
    """Peak bytes allocated by `fn(*args, **kwargs)` beyond what was live before the call.

    On a GPU (any CUDA tensor among the arguments) this is the caching allocator's counter; elsewhere the
    `AllocationTracker`, which counts returned tensors and misses operators' internal workspaces. Runs under no_grad: the forward's working memory, not what autograd would save.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in tree_leaves((args, kwargs))):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            fn(*args, **kwargs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with torch.no_grad(), AllocationTracker() as tracker:
        fn(*args, **kwargs)
    return tracker.peak
