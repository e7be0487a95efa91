"""Ring attention: sequence-parallel attention over W processes with torch.distributed, forward and backward.

Each rank holds a chunk of the sequence: its queries, keys and values. The K/V chunks travel around a ring,
rank r sending to r+1 and receiving from r-1, so after W steps every rank has seen every key; each step's partial
result is merged into the running one by log-sum-exp (`utils.softmax.merge_attention`, notebook 02). The next
transfer is posted before the current chunk is computed on, so communication hides behind computation. No rank
ever holds more than its own chunk plus one chunk in flight: memory per rank falls as 1/W.

The backward runs a second ring. The forward's final output O and log-sum-exp are saved; with the *global* lse,
P = exp(S - lse) of one block is that block's slice of the whole row's softmax, so each block's terms of dQ, dK
and dV simply add up (`block_gradients`). dQ stays with its queries; dK and dV accumulators travel with their
K/V chunk, each rank adding its share, and end at their owner. `ring_attention` is differentiable
(a `torch.autograd.Function`), so a model trains with it.

Causal attention with contiguous chunks leaves rank 0 idle after the first step (every other key is in its
future) while rank W-1 works at every step. The zigzag layout gives rank r chunks r and 2W-1-r of 2W: one early
and one late, and every rank does the same work at every step (`step_work`), backward as forward.

`simulate_ring_attention` runs the same steps for all ranks in one process (no communication): for teaching and
fast tests; it is differentiable too, its backward being `simulate_ring_backward`. `run_ring_check` starts W
processes (torch.multiprocessing, spawn) on gloo (CPU) or NCCL (one GPU per rank) and compares the output and
the gradients with single-device attention. On 2 GPUs: `python -m utils.ring_attention --backend nccl
--world-size 2`. Its launch (`spawn_ranks`, `rank_group`) and the exchange (`_post_exchange`) also serve
`utils.course.bench.ring_comm`, which times the exchange alone.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import numbers
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from utils import gpu
from utils.checks import check_attention_inputs, resolve_scale
from utils.flash_pytorch_bwd import _compute_dtype, _expand_kv, _safe_lse, _sum_groups, check_backward_inputs
from utils.reference import causal_mask
from utils.softmax import attention_with_lse, merge_attention
from utils.course.testing import random_qkv, tolerances

LAYOUTS = ("contiguous", "zigzag")
PARTS = {"all", "first", "second"}


# --- layouts --------------------------------------------------------------------------------------------

def _check_layout_args(seqlen, world_size, rank, layout):
    for name, x in (("seqlen", seqlen), ("world_size", world_size), ("rank", rank)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    chunks = 2 * world_size if layout == "zigzag" else world_size
    if seqlen <= 0 or seqlen % chunks:
        raise ValueError(f"seqlen {seqlen} must be a positive multiple of {chunks} "
                         f"({'2 × ' if layout == 'zigzag' else ''}world_size) for the {layout} layout")


def zigzag_chunks(world_size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·world_size) that rank holds in the zigzag layout: one early, one late."""
    _check_layout_args(2 * world_size, world_size, rank, "zigzag")
    return rank, 2 * world_size - 1 - rank


def shard_indices(seqlen: int, world_size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Positions in the sequence held by `rank`, in the order it holds them."""
    _check_layout_args(seqlen, world_size, rank, layout)
    if layout == "contiguous":
        n = seqlen // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    c = seqlen // (2 * world_size)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in zigzag_chunks(world_size, rank)])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The part of `x` (the full sequence along `dim`) that `rank` holds: a contiguous copy."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    idx = shard_indices(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, idx).contiguous()


def unshard(parts, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Reassemble the full sequence from the parts of ranks 0..W-1 (the inverse of `shard`)."""
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty list of tensors, one per rank")
    world_size = len(parts)
    shape = list(parts[0].shape)
    if any(p.shape != parts[0].shape for p in parts):
        raise ValueError("every rank's part must have the same shape")
    seqlen = shape[dim] * world_size
    shape[dim] = seqlen
    full = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, shard_indices(seqlen, world_size, rank, layout).to(part.device), part)
    return full


def step_work(rank: int, src: int, world_size: int, *, causal: bool, layout: str = "zigzag"):
    """What rank computes when it holds the K/V chunk of rank `src`: None (nothing visible) or
    (query part, key part, causal) with parts "all", "first" or "second" half of the local rows.

    Zigzag, rank r holds chunks (r, 2W-1-r). With src < r: chunk src precedes both query chunks and chunk
    2W-1-src follows both: all queries see the first half of the keys. With src > r: both key chunks follow
    chunk r and precede chunk 2W-1-r: the second half of the queries sees all keys. Either way half the work.
    """
    _check_layout_args(2 * world_size, world_size, rank, layout)
    if not (isinstance(src, numbers.Integral) and 0 <= src < world_size):
        raise ValueError(f"src must be a rank in [0, {world_size}), got {src!r}")
    if not causal:
        return "all", "all", False
    if src == rank:  # the diagonal: an ordinary causal mask (with zigzag too: see the notebook)
        return "all", "all", True
    if layout == "contiguous":
        return ("all", "all", False) if src < rank else None
    return ("all", "first", False) if src < rank else ("second", "all", False)


def work_per_step(world_size: int, *, causal: bool, layout: str) -> list[list[float]]:
    """[rank][step] fraction of a full (local Q × local K) block computed, counting a causal diagonal as 1/2."""
    size = {"all": 1.0, "first": 0.5, "second": 0.5}
    table = []
    for rank in range(world_size):
        row = []
        for step in range(world_size):
            task = step_work(rank, (rank - step) % world_size, world_size, causal=causal, layout=layout)
            row.append(0.0 if task is None else size[task[0]] * size[task[1]] * (0.5 if task[2] else 1.0))
        table.append(row)
    return table


# --- the computation shared by the simulation and the distributed version ------------------------------

def _rows(part: str, n: int) -> slice:
    return {"all": slice(0, n), "first": slice(0, n // 2), "second": slice(n // 2, n)}[part]


def _torch_attention(q, k, v, *, causal, sm_scale):
    return attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale)


def pick_local_attention(device, name: str = "auto"):
    """Attention inside a rank, `fn(q, k, v, *, causal, sm_scale) -> (o, lse)` with a natural-log lse.

    "torch": `utils.softmax.attention_with_lse` (scores in memory; any device); "flash_triton": notebook 05's
    Triton forward; "flash_decoding": this course's split-KV kernel with one split. "auto": on a GPU the first
    Triton kernel that is there, on the CPU "torch" (the interpreter would make the ring crawl).
    """
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return _torch_attention
    if name in ("auto", "flash_triton"):
        try:
            from utils.flash_triton import flash_attention_forward
            return flash_attention_forward
        except ImportError:
            if name == "flash_triton":
                raise
    if name in ("auto", "flash_decoding"):
        from utils.flash_decoding import flash_decode

        def decoding_attention(q, k, v, *, causal, sm_scale):
            return flash_decode(q, k, v, causal=causal, sm_scale=sm_scale, num_splits=1, return_lse=True)
        return decoding_attention
    raise ValueError(f"local attention must be 'auto', 'torch', 'flash_triton' or 'flash_decoding', got {name!r}")


def _check_rows(name, t, shape, q):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")


def block_gradients(q, k, v, do, lse, delta, *, causal=False, sm_scale=None):
    """One block's share of (dq, dk, dv), queries q against keys k and values v, from the *global* lse and delta.

    lse (natural log) and delta = rowsum(dO ∘ O) belong to whole rows of the final output O, not to this block.
    With them P = exp(scale·S − lse) is this block's slice of the full softmax, and

        dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ − delta),   dQ = scale · dS K,   dK = scale · dSᵀ Q

    are this block's terms of the full sums over keys (dQ) and over queries (dK, dV): blocks' results just add.
    q, do (B, H, Nq, D); k, v (B, Hkv, Nk, D), dk and dv summed over each K/V head's group of query heads (GQA);
    lse, delta (B, H, Nq). `causal`: the bottom-right mask inside the block. Computed and returned in float32
    (float64 for float64 inputs), for the caller to accumulate.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    _check_rows("do", do, q.shape, q)
    _check_rows("lse", lse, q.shape[:3], q)
    _check_rows("delta", delta, q.shape[:3], q)
    ct = _compute_dtype(q.dtype)
    q, do, delta = q.to(ct), do.to(ct), delta.to(ct)
    k, v = _expand_kv(k.to(ct), v.to(ct), shape.heads)
    s = scale * q @ k.transpose(-2, -1)
    if causal:
        s = s.masked_fill(~causal_mask(shape.seqlen_q, shape.seqlen_k, q.device), float("-inf"))
    p = torch.exp(s - _safe_lse(lse.to(ct))[..., None])                      # a row seeing no key: 0
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])
    dq, dk, dv = scale * ds @ k, scale * ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do
    return dq, _sum_groups(dk, shape.kv_heads), _sum_groups(dv, shape.kv_heads)


def _torch_backward(q, k, v, do, o, lse, delta, *, causal, sm_scale):
    return block_gradients(q, k, v, do, lse, delta, causal=causal, sm_scale=sm_scale)


def pick_local_backward(device, name: str = "auto"):
    """Gradients inside a rank, `fn(q, k, v, do, o, lse, delta, *, causal, sm_scale) -> (dq, dk, dv)`: one block's
    share, given the rows of the final output o, its lse and delta = rowsum(dO ∘ O).

    `name` is the forward's local attention. "torch": `block_gradients` (any device). "flash_triton": notebook
    07's Triton backward, `flash_attention_backward(do, q, k, v, o, lse)`; fed the final o and lse, its
    preprocess computes the global delta itself, so it returns exactly the block's share (in q's dtype). "auto"
    and "flash_decoding" (a forward-only kernel): the Triton backward on a GPU if it is there, else "torch".
    """
    device = torch.device(device)
    if name not in ("auto", "torch", "flash_triton", "flash_decoding"):
        raise ValueError(f"local attention must be 'auto', 'torch', 'flash_triton' or 'flash_decoding', "
                         f"got {name!r}")
    if name == "torch" or (name != "flash_triton" and device.type != "cuda"):
        return _torch_backward
    try:
        from utils.flash_triton_bwd import flash_attention_backward
    except ImportError:
        if name == "flash_triton":
            raise
        return _torch_backward

    def triton_backward(q, k, v, do, o, lse, delta, *, causal, sm_scale):
        return flash_attention_backward(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)
    return triton_backward


def _accumulate(out, lse, q, k, v, task, attention, scale):
    """Attend the `task`'s part of the local queries to the part of this K/V chunk, merge into (out, lse)."""
    if task is None:
        return
    q_part, kv_part, causal = task
    rows, cols = _rows(q_part, q.shape[2]), _rows(kv_part, k.shape[2])
    o_step, lse_step = attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=causal, sm_scale=scale)
    out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows], o_step, lse_step)


def _accumulate_grads(dq, dkv, q, kv, do, o, lse, delta, task, backward, scale):
    """Add the `task`'s block gradients: dq into the local query rows, dk and dv into dkv = (dK, dV) of the K/V
    chunk kv = (K, V) in hand."""
    if task is None:
        return
    q_part, kv_part, causal = task
    rows, cols = _rows(q_part, q.shape[2]), _rows(kv_part, kv.shape[3])
    dq_b, dk_b, dv_b = backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], do[:, :, rows],
                                o[:, :, rows], lse[:, :, rows], delta[:, :, rows], causal=causal, sm_scale=scale)
    dq[:, :, rows] += dq_b
    dkv[0][:, :, cols] += dk_b
    dkv[1][:, :, cols] += dv_b


def _delta(do, o):
    """D = rowsum(dO ∘ O): one number per query row, computed once and used at every step of the backward."""
    acc = _compute_dtype(o.dtype)
    return (do.to(acc) * o.to(acc)).sum(-1)


class _RingFunction(torch.autograd.Function):
    """A ring made differentiable. `forward_ring(q, k, v) -> (o, lse)` runs in the forward; o (in q's dtype) and
    lse are saved for `backward_ring(do, q, k, v, o, lse) -> (dq, dk, dv)`, the second ring."""

    @staticmethod
    def forward(ctx, q, k, v, forward_ring, backward_ring):
        o, lse = forward_ring(q, k, v)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.backward_ring = backward_ring
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_ring(do, q, k, v, o, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_ring_inputs(q, k, v, causal, sm_scale, layout, world_size):
    shape = check_attention_inputs(q, k, v, causal=causal)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if shape.seqlen_q != shape.seqlen_k:
        raise ValueError(f"q and k must hold the same positions (a rank's chunk), got {shape.seqlen_q} and "
                         f"{shape.seqlen_k} rows")
    if causal and layout == "zigzag" and shape.seqlen_q % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: the local length must be even, "
                         f"got {shape.seqlen_q}")
    return resolve_scale(sm_scale, shape.head_dim)


def _empty_state(q):
    out = torch.zeros(q.shape, dtype=_compute_dtype(q.dtype), device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=_compute_dtype(q.dtype), device=q.device)
    return out, lse


def _check_simulation(q, k, v, world_size, causal, sm_scale, layout) -> float:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    scale = _check_ring_inputs(q, k, v, causal, sm_scale, layout, 1)
    _check_layout_args(q.shape[2], world_size, 0, layout)
    return scale


def _simulate_forward(q, k, v, *, world_size, causal, scale, layout, attention):
    qs, ks, vs = ([shard(t, world_size, r, layout) for r in range(world_size)] for t in (q, k, v))
    outs, lses = [], []
    for rank in range(world_size):
        out, lse = _empty_state(qs[rank])
        for step in range(world_size):
            src = (rank - step) % world_size
            task = step_work(rank, src, world_size, causal=causal, layout=layout)
            _accumulate(out, lse, qs[rank], ks[src], vs[src], task, attention, scale)
        outs.append(out)
        lses.append(lse)
    return unshard(outs, layout), unshard(lses, layout)


def simulate_ring_attention(q, k, v, *, world_size: int, causal=False, sm_scale=None, layout="zigzag",
                            local_attention="torch"):
    """Ring attention with every rank played in turn by this process; q, k, v hold the full sequence.

    The same steps as `ring_attention`, with the ring's transfer replaced by indexing: rank r at step s holds
    the K/V shard of rank (r - s) mod W. Returns the full output, reassembled from the ranks' shards.
    Differentiable: the gradients come from `simulate_ring_backward`, the backward ring played the same way.
    """
    scale = _check_simulation(q, k, v, world_size, causal, sm_scale, layout)
    attention = pick_local_attention(q.device, local_attention)
    forward = functools.partial(_simulate_forward, world_size=world_size, causal=causal, scale=scale,
                                layout=layout, attention=attention)
    backward = functools.partial(simulate_ring_backward, world_size=world_size, causal=causal, sm_scale=scale,
                                 layout=layout, local_attention=local_attention)
    return _RingFunction.apply(q, k, v, forward, backward)


def simulate_ring_backward(do, q, k, v, o, lse, *, world_size: int, causal=False, sm_scale=None,
                           layout="zigzag", local_attention="torch"):
    """The backward ring with every rank played in turn; returns the full (dq, dk, dv), in float32 (float64 for
    float64 inputs).

    do, q, k, v, the forward's output o and its lse (natural log) hold the full sequence. Rank r keeps its dq.
    At step s it holds the K/V shard of rank (r − s) mod W and, from step 1 on, that chunk's travelling dK/dV
    accumulator, to which it adds its share; then every accumulator hops to the next rank, as in `ring_attention`.
    The owner's own share (step 0) stays at home; after the last hop each accumulator is home too.
    """
    check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale)
    scale = _check_simulation(q, k, v, world_size, causal, sm_scale, layout)
    backward = pick_local_backward(q.device, local_attention)
    acc, w = _compute_dtype(q.dtype), world_size
    qs, dos, os_, lses, deltas = ([shard(t, w, r, layout) for r in range(w)] for t in (q, do, o, lse, _delta(do, o)))
    kvs = [shard(torch.stack([k, v]), w, r, layout, dim=3) for r in range(w)]
    dqs = [torch.zeros(x.shape, dtype=acc, device=q.device) for x in qs]
    home, travelling = [None] * w, [None] * w
    for step in range(w):
        for rank in range(w):
            src = (rank - step) % w
            dkv = torch.zeros(kvs[src].shape, dtype=acc, device=q.device)  # this rank's share for chunk src
            task = step_work(rank, src, w, causal=causal, layout=layout)
            _accumulate_grads(dqs[rank], dkv, qs[rank], kvs[src], dos[rank], os_[rank], lses[rank], deltas[rank],
                              task, backward, scale)
            if step == 0:
                home[rank] = dkv
            else:
                travelling[rank] = dkv if step == 1 else travelling[rank] + dkv
        if step > 0:
            travelling = travelling[-1:] + travelling[:-1]  # the hop: rank r now holds what rank r-1 held
    dkvs = home if w == 1 else [mine + arrived for mine, arrived in zip(home, travelling)]
    dk, dv = unshard(dkvs, layout, dim=3).unbind(0)
    return unshard(dqs, layout), dk, dv


# --- the distributed version --------------------------------------------------------------------------

def _post_exchange(send: torch.Tensor, recv: torch.Tensor, world_size: int, rank: int):
    """Post send-to-next and receive-from-previous; returns the requests to wait on."""
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world_size)]
    return dist.batch_isend_irecv(ops)


def _wait(requests):
    for request in requests:
        request.wait()


def _pass_on(x: torch.Tensor, world_size: int, rank: int, *, wait: bool):
    """Send x to the next rank and receive the previous rank's counterpart: (its buffer, requests to wait on).
    With `wait` the transfer completes before returning (no overlap)."""
    received = torch.empty_like(x)
    requests = _post_exchange(x, received, world_size, rank)
    if wait:
        _wait(requests)
        requests = []
    return received, requests


def _ring_forward(q, k, v, *, causal, scale, layout, overlap, attention):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    kv = torch.stack([k, v]).contiguous()  # one message per step instead of two
    out, lse = _empty_state(q)
    for step in range(world_size):
        src = (rank - step) % world_size
        last = step == world_size - 1
        if not last:  # posted before computing, so the transfer runs during the compute
            next_kv, requests = _pass_on(kv, world_size, rank, wait=not overlap)
        task = step_work(rank, src, world_size, causal=causal, layout=layout)
        _accumulate(out, lse, q, kv[0], kv[1], task, attention, scale)
        if not last:
            _wait(requests)
            kv = next_kv
    return out, lse


def _ring_backward(do, q, k, v, o, lse, *, causal, scale, layout, overlap, backward):
    """The second ring: K/V travel as in the forward, each chunk followed by its dK/dV accumulator; dq stays."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    delta = _delta(do, o)
    dq = torch.zeros(q.shape, dtype=_compute_dtype(q.dtype), device=q.device)
    kv = torch.stack([k, v]).contiguous()
    # How the accumulators get home without an extra hop: the owner keeps its own queries' share (step 0) at
    # home; a chunk's travelling accumulator starts at the next rank (step 1) and gains a share at every step;
    # after the last step rank r holds the accumulator of chunk r+1, so the ring's ordinary send is the way
    # home. W-1 hops, like K/V's (sending the owner's share along from step 0 would cost a W-th).
    home = arriving = None  # this rank's own share; the accumulator on its way in from rank-1
    dkv_requests = []
    for step in range(world_size):
        src = (rank - step) % world_size
        last = step == world_size - 1
        if not last:
            next_kv, kv_requests = _pass_on(kv, world_size, rank, wait=not overlap)
        dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=q.device)  # this rank's share for chunk src
        task = step_work(rank, src, world_size, causal=causal, layout=layout)
        _accumulate_grads(dq, dkv, q, kv, do, o, lse, delta, task, backward, scale)
        _wait(dkv_requests)
        if arriving is not None:  # chunk src's accumulator, sent by rank-1 while this step computed
            dkv += arriving
        if step == 0:
            home = dkv
        else:
            arriving, dkv_requests = _pass_on(dkv, world_size, rank, wait=not overlap)
        if not last:
            _wait(kv_requests)
            kv = next_kv
    _wait(dkv_requests)  # the last hop, home: nothing left to compute behind it
    if arriving is not None:
        home += arriving
    return dq, home[0], home[1]


def ring_attention(q, k, v, *, causal=False, sm_scale=None, layout="zigzag", overlap=True,
                   local_attention="auto"):
    """Attention of this rank's queries against the whole sequence, the K/V chunks passed around the ring.

    q, k, v: this rank's shard (`shard(x, world_size, rank, layout)`), the same shape on every rank; needs an
    initialised default process group. With `overlap` the next transfer is posted before computing on the
    current chunk; without, the ring waits for each transfer first (to measure what overlap buys). Returns this
    rank's shard of the output, in q's dtype. Differentiable: the backward is a second ring (K/V with their
    dK/dV accumulators), every rank calling it in step (a loss's backward does); dq, dk, dv come back for this
    rank's shard, in the inputs' dtype. `local_attention` also picks the backward (`pick_local_backward`).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised (dist.init_process_group)")
    world_size = dist.get_world_size()
    scale = _check_ring_inputs(q, k, v, causal, sm_scale, layout, world_size)
    common = dict(causal=causal, scale=scale, layout=layout, overlap=overlap)
    forward = functools.partial(_ring_forward, attention=pick_local_attention(q.device, local_attention), **common)
    backward = functools.partial(_ring_backward, backward=pick_local_backward(q.device, local_attention), **common)
    return _RingFunction.apply(q, k, v, forward, backward)


# --- a check with W processes -------------------------------------------------------------------------

@dataclass(frozen=True)
class RingCase:
    """One configuration to run in every rank: sizes of the *full* sequence, and how to check and time it."""

    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    seqlen: int = 64
    head_dim: int = 32
    causal: bool = False
    layout: str = "zigzag"
    dtype: str = "float32"
    seed: int = 0
    iters: int = 0            # timed repetitions (0: only check)
    local_attention: str = "auto"
    backward: bool = True     # check (and, with iters, time) the gradients too
    overlap: bool = True      # for the checks; timings measure the ring with and without overlap


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters):
    fn()  # warm-up (compiles the kernels)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    ms = torch.tensor((time.perf_counter() - start) / iters * 1e3, device=device)  # NCCL reduces GPU tensors only
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the ring is as slow as its slowest rank
    return float(ms)


def _reference(q, k, v, causal, device):
    """Single-device attention of the full sequence, and the ground truth it is compared with."""
    if device.type == "cpu":
        from utils.reference import reference_attention
        return reference_attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.to(device, torch.float32) for t in (q, k.repeat_interleave(group, 1),
                                                          v.repeat_interleave(group, 1)))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32, no N×N matrix
        return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)


def _reference_gradients(q, k, v, do, causal, device):
    """(dq, dk, dv) of `_reference` by autograd: in float64 on the CPU, fp32 on a GPU."""
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    _reference(*leaves, causal, device).backward(do.to(device, dtype))
    return [t.grad for t in leaves]


def _ring_gradients(shards, do, case: RingCase, overlap: bool):
    """This rank's (dq, dk, dv) through the differentiable ring: every rank calls it together."""
    leaves = [t.detach().requires_grad_() for t in shards]
    out = ring_attention(*leaves, causal=case.causal, layout=case.layout, overlap=overlap,
                         local_attention=case.local_attention)
    out.backward(do)
    return [t.grad for t in leaves]


def _gather(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return [p.cpu() for p in parts]


def _run_case(case: RingCase, rank: int, world_size: int, device: torch.device) -> dict | None:
    dtype = getattr(torch, case.dtype)
    q, k, v = random_qkv(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, kv_heads=case.kv_heads,
                         dtype=dtype, seed=case.seed)  # every rank draws the same full tensors, keeps its shard
    q_loc, k_loc, v_loc = (shard(t, world_size, rank, case.layout).to(device) for t in (q, k, v))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def run(overlap=case.overlap):
        return ring_attention(q_loc, k_loc, v_loc, causal=case.causal, layout=case.layout, overlap=overlap,
                              local_attention=case.local_attention)
    out_loc = run()
    result = {"peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    if case.iters:
        result["ring_ms"] = _time(lambda: run(True), device, case.iters)
        result["ring_no_overlap_ms"] = _time(lambda: run(False), device, case.iters)
    parts = _gather(out_loc, world_size)
    if case.backward:
        do = random_qkv(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim, dtype=dtype,
                        seed=case.seed + 1)[0]  # the loss's gradient dO, like q
        do_loc = shard(do, world_size, rank, case.layout).to(device)
        shards = (q_loc, k_loc, v_loc)
        grad_parts = [_gather(g, world_size) for g in _ring_gradients(shards, do_loc, case, case.overlap)]
        if case.iters:
            for key, overlap in (("ring_fwd_bwd_ms", True), ("ring_fwd_bwd_no_overlap_ms", False)):
                result[key] = _time(lambda: _ring_gradients(shards, do_loc, case, overlap), device, case.iters)
    if rank != 0:
        return None
    out = unshard(parts, case.layout).to(device)
    truth = _reference(q, k, v, case.causal, device)
    result["max_abs_err"] = float((out.double() - truth.double()).abs().max())
    result["dtype_tolerance"] = tolerances(dtype)["atol"]
    if case.backward:  # each gradient's largest error, relative to its largest entry
        errors = [(unshard(g, case.layout).to(device).double() - expect.double()).abs().max() / expect.abs().max()
                  for g, expect in zip(grad_parts, _reference_gradients(q, k, v, do, case.causal, device))]
        result["grad_rel_err"] = float(max(errors))
    if case.iters:  # the same local kernel on the full sequence, on one device
        attention = pick_local_attention(device, case.local_attention)
        qd, kd, vd = (t.to(device) for t in (q, k, v))
        single = lambda: attention(qd, kd, vd, causal=case.causal, sm_scale=None)  # noqa: E731
        single()
        _sync(device)
        start = time.perf_counter()
        for _ in range(case.iters):
            single()
        _sync(device)
        result["single_device_ms"] = (time.perf_counter() - start) / case.iters * 1e3
        result["single_device_max_abs_err"] = float((single()[0].double() - truth.double()).abs().max())
    return {"case": asdict(case), "world_size": world_size, **result}


@contextlib.contextmanager
def rank_group(rank: int, world_size: int, backend: str, port: int):
    """Join the default process group as `rank` of `world_size` (127.0.0.1:`port`); yields this rank's device
    (GPU `rank` for nccl, the CPU for gloo) once every rank is in, and leaves the group on the way out."""
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    try:
        dist.barrier()
        yield device
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, backend: str, port: int, cases, results) -> None:
    """One rank: join the group, run every case, rank 0 puts one result per case on `results`."""
    with rank_group(rank, world_size, backend, port) as device:
        for case in cases:
            result = _run_case(case, rank, world_size, device)
            if rank == 0:
                results.put(result)


def check_launch(world_size: int, backend: str) -> None:
    """A clear error unless `world_size` processes can run on `backend` here (nccl: one GPU per rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with world_size {world_size} needs {world_size} GPUs, "
                           f"found {torch.cuda.device_count()}")


def spawn_ranks(worker, world_size: int, backend: str, *args) -> None:
    """Run `worker(rank, world_size, backend, port, *args)` in `world_size` fresh processes (spawn) and wait
    for all of them; an exception in one is raised here. `worker` must be importable (a module's function)."""
    import torch.multiprocessing as mp

    check_launch(world_size, backend)
    with _main_without_interpreter_file():
        mp.start_processes(worker, args=(world_size, backend, free_port(), *args), nprocs=world_size, join=True,
                           start_method="spawn")


def run_ring_check(cases, *, world_size: int, backend: str = "gloo") -> list[dict]:
    """Start `world_size` processes (spawn), run `cases` (RingCase) on each, return rank 0's results.

    gloo runs on the CPU; nccl needs one CUDA GPU per rank. Each result holds the maximum error against
    single-device attention of the full sequence (float64 on the CPU, fp32 SDPA on a GPU) and, if timed, ms.
    """
    import torch.multiprocessing as mp

    check_launch(world_size, backend)
    cases = list(cases)
    if not cases or not all(isinstance(c, RingCase) for c in cases):
        raise TypeError("cases must be a non-empty list of RingCase")
    for case in cases:
        _check_layout_args(case.seqlen, world_size, 0, case.layout)
    results = mp.get_context("spawn").SimpleQueue()  # results are a few numbers per case: the pipe never fills
    spawn_ranks(_worker, world_size, backend, cases, results)
    return [results.get() for _ in cases]


@contextlib.contextmanager
def _main_without_interpreter_file():
    """Hide a `__file__` that Triton's interpreter left in `__main__` while spawned children start.

    Running a kernel defined in a notebook, the interpreter copies its own module's globals, `__file__` included,
    into the notebook's namespace (`__main__`); spawn would then run triton/runtime/interpreter.py as every
    child's main script, and the children would die on its relative imports."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    stray = path is not None and Path(path).parts[-3:] == ("triton", "runtime", "interpreter.py")
    if stray:
        del main.__file__
    try:
        yield
    finally:
        if stray:
            main.__file__ = path


def _main(argv=None):
    parser = argparse.ArgumentParser(description="Ring attention over W processes, checked against one device.")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=None, help="full sequence (default: 65536 nccl, 256 gloo)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (default: 20 nccl, 3 gloo)")
    parser.add_argument("--json", default=None, help="write results here (default for nccl: images/ring_nccl.json)")
    args = parser.parse_args(argv)
    on_gpu = args.backend == "nccl"
    seqlen = args.seqlen or (65536 if on_gpu else 256)
    common = dict(batch=1, heads=args.heads, kv_heads=args.kv_heads or args.heads, seqlen=seqlen,
                  head_dim=args.head_dim, dtype="bfloat16" if on_gpu else "float32",
                  iters=args.iters if args.iters is not None else (20 if on_gpu else 3))
    cases = [RingCase(causal=False, **common), RingCase(causal=True, layout="zigzag", **common),
             RingCase(causal=True, layout="contiguous", **common)]
    results = run_ring_check(cases, world_size=args.world_size, backend=args.backend)
    name = gpu.name() if on_gpu else "CPU"  # gloo runs on the CPU even where there is a GPU
    print(f"ring attention, {args.backend}, {args.world_size} ranks on {name}; B=1 H={common['heads']} "
          f"Hkv={common['kv_heads']} N={seqlen} D={args.head_dim} {common['dtype']}")
    print(f"{'case':22s} {'max err':>9s} {'1-dev err':>9s} {'ring ms':>9s} {'no-ovl ms':>9s} {'1-dev ms':>9s} "
          f"{'speed-up':>8s} {'MiB/rank':>9s} {'grad err':>9s} {'f+b ms':>9s}")
    for r in results:
        c = r["case"]
        label = f"{'causal ' + c['layout'] if c['causal'] else 'full'}"
        mem = f"{r['peak_mem_mib']:9.0f}" if r["peak_mem_mib"] is not None else f"{'-':>9s}"
        print(f"{label:22s} {r['max_abs_err']:9.2e} {r.get('single_device_max_abs_err', math.nan):9.2e} "
              f"{r.get('ring_ms', math.nan):9.2f} {r.get('ring_no_overlap_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan):9.2f} "
              f"{r.get('single_device_ms', math.nan) / r.get('ring_ms', math.nan):8.2f} {mem} "
              f"{r.get('grad_rel_err', math.nan):9.2e} {r.get('ring_fwd_bwd_ms', math.nan):9.2f}")
        if r["max_abs_err"] > r["dtype_tolerance"]:
            print(f"  error above the {c['dtype']} tolerance {r['dtype_tolerance']}")
        if r.get("grad_rel_err", 0.0) > r["dtype_tolerance"]:
            print(f"  gradient error (relative to the largest gradient) above {r['dtype_tolerance']}")
    path = args.json or (str(Path(__file__).resolve().parents[1] / "images" / "ring_nccl.json") if on_gpu else None)
    if path:
        Path(path).write_text(json.dumps({"device": name, "backend": args.backend, "world_size": args.world_size,
                                          "environment": gpu.environment(), "results": results}, indent=1))
        print("wrote", path)
    return results


if __name__ == "__main__":
    _main()
