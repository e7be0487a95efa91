"""Ring attention: sequence-parallel attention over W processes with torch.distributed, forward and backward.

Each rank holds a chunk of the sequence: its queries, keys and values. The K/V chunks travel around a ring,
rank r sending to r+1 and receiving from r-1, so after W steps every rank has seen every key; each step's partial
result is merged into the running one by log-sum-exp (`utils.eager.softmax.merge_attention`, notebook 02). The next
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
fast tests; it is differentiable too, its backward being `simulate_ring_backward`. The check over W real
processes (`run_ring_check`, `python -m utils.course.ring_check`) is course tooling: utils.course.ring_check.
The exchange (`_post_exchange`) also serves `utils.course.bench.ring_comm`, which times it alone.
"""
from __future__ import annotations

import functools
import numbers

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from utils.checks import check_attention_inputs, resolve_scale
from utils.eager.backward import _compute_dtype, _expand_kv, _safe_lse, _sum_groups, check_backward_inputs
from utils.eager.reference import causal_mask
from utils.eager.softmax import attention_with_lse, merge_attention

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

    "torch": `utils.eager.softmax.attention_with_lse` (scores in memory; any device); "flash_triton": notebook 05's
    Triton forward; "flash_decoding": this course's split-KV kernel with one split. "auto": on a GPU the first
    Triton kernel that is there, on the CPU "torch" (the interpreter would make the ring crawl).
    """
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return _torch_attention
    if name in ("auto", "flash_triton"):
        try:
            from utils.tiled.fast.forward import flash_attention_forward
            return flash_attention_forward
        except ImportError:
            if name == "flash_triton":
                raise
    if name in ("auto", "flash_decoding"):
        from utils.decoding.split_kv import flash_decode

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
        from utils.tiled.fast.backward import flash_attention_backward
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
