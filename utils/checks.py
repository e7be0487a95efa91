"""Input validation shared by every attention implementation: a bad argument gets a clear error naming it."""
from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple

import torch


class AttentionShape(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The most blocks a CUDA grid has along y (and z); along x it is 2**31 - 1.
CUDA_GRID_Y = 65535


def check_attention_inputs(q, k, v, *, causal=False, head_dims=None, dtypes=FLOAT_DTYPES,
                           runs_on: str = "any", max_batch_heads: int | None = None) -> AttentionShape:
    """Validate `(batch, heads, seq, head_dim)` tensors q, k, v and return their sizes.

    K and V may have fewer heads than Q (grouped-query / multi-query attention) if that number divides Q's.
    `head_dims` is a collection of supported head dims (None: any); `dtypes` the supported dtypes; `runs_on`
    where the implementation runs, as in the registry: "any" device, "cuda" tensors only, or "triton" (CUDA
    tensors, or CPU tensors while the Triton interpreter is on). `max_batch_heads`: the most batch x heads the
    kernels take (`check_batch_heads`; None: no limit).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
        if t.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {names}")
    check_bool("causal", causal)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match")
    b, h, hk, nq, nk, d = check_query_key_shapes(q, k, kv_names="k and v")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"head_dim {d} is not supported here; supported: {sorted(head_dims)}")
    if max_batch_heads is not None:
        check_batch_heads(b, h, max_batch_heads)
    check_device("q", q, runs_on)  # last: an argument that is wrong everywhere is named first
    return AttentionShape(b, h, hk, nq, nk, d)


def check_query_key_shapes(q, k, *, kv_names: str = "k") -> tuple[int, int, int, int, int, int]:
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim) of 4-dim q and k, or a ValueError naming what does
    not match: batch, head dim, or heads of q that are not a multiple of k's (`kv_names`: how the message names
    k's heads)."""
    (b, h, nq, d), (bk, hk, nk, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"k has batch {bk} but q has {b}; they must match")
    if dk != d:
        raise ValueError(f"k has head_dim {dk} but q has {d}; they must match")
    if h % hk != 0:
        raise ValueError(f"q has {h} heads, not a multiple of the {hk} heads of {kv_names}")
    return b, h, hk, nq, nk, d


def check_batch_heads(batch: int, heads: int, limit: int = CUDA_GRID_Y) -> None:
    """A ValueError unless batch x heads <= `limit`. A CUDA kernel that launches a row of blocks per (batch, head)
    puts them on its grid's y dimension, which holds at most CUDA_GRID_Y."""
    if batch * heads > limit:
        fix = (f"split the batch into chunks of at most {limit // heads}" if heads <= limit
               else f"use at most {limit} heads")
        raise ValueError(f"batch x heads = {batch} x {heads} = {batch * heads} is more than these CUDA kernels "
                         f"take: they launch a row of blocks per (batch, head), and a grid has at most {limit} "
                         f"rows (gridDim.y); {fix}")


def check_device(name: str, t: torch.Tensor, runs_on: str) -> None:
    """A ValueError naming `name` unless tensor `t` is on a device where code that `runs_on` ("any", "cuda",
    "triton": CUDA or the Triton interpreter on the CPU) can read it."""
    if runs_on not in ("any", "cuda", "triton"):
        raise ValueError(f"runs_on must be 'any', 'cuda' or 'triton', got {runs_on!r}")
    if runs_on == "any" or t.device.type == "cuda":
        return
    if runs_on == "triton" and t.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return
        raise ValueError(f"{name} is on the CPU, but Triton kernels need CUDA tensors ({name}.cuda()); to run "
                         f"them on the CPU, set TRITON_INTERPRET=1 before the kernels are defined")
    raise ValueError(f"{name} is on {t.device}, but this implementation needs CUDA tensors ({name}.cuda())")


def check_bool(name: str, x) -> bool:
    """`x`, or a TypeError naming `name` unless it is a bool."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def check_int(name: str, x, low: int | None = None, high: int | None = None) -> int:
    """`x` as an int, or a TypeError/ValueError naming `name` unless it is an integer (not a bool) within
    [low, high] (either bound may be left open)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if (low is not None and x < low) or (high is not None and x > high):
        bounds = (f"in [{low}, {high}]" if low is not None and high is not None
                  else f">= {low}" if low is not None else f"<= {high}")
        raise ValueError(f"{name} must be {bounds}, got {x}")
    return int(x)


def positive_int(name: str, x) -> int:
    """`x` as an int, or a TypeError/ValueError naming `name` unless it is a positive integer (not a bool)."""
    if check_int(name, x) <= 0:
        raise ValueError(f"{name} must be positive, got {x}")
    return int(x)


def check_capability(capability, *, optional: bool = False):
    """A GPU's (major, minor) as a tuple of two non-negative ints, or a TypeError; None too when `optional`."""
    if capability is None and optional:
        return None
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in capability)):
        raise TypeError(f"capability must be {'None or ' if optional else ''}a (major, minor) tuple of ints, "
                        f"got {capability!r}")
    return capability


def resolve_scale(sm_scale, head_dim: int) -> float:
    """`sm_scale`, or 1/sqrt(head_dim) when it is None."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and positive, got {sm_scale}")
    return float(sm_scale)
