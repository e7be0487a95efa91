"""The course's ring attention beside PyTorch's context parallelism on W GPUs (notebook 11): the same full
sequence, split over the same GPUs, outputs and gradients checked against one GPU, and the forward + backward
times side by side in one run.

    python -m utils.course.bench.context_parallel      # W = every GPU (at least 2); images/11_context_parallel_h200.json

PyTorch's `torch.distributed.tensor.experimental.context_parallel` shards the tensors it is given along their
sequence dimension and turns scaled_dot_product_attention inside its block into a ring over the device mesh,
with the backend SDPA would pick (here pinned, `--sdpa-backend`). The course's ring is `utils.ring.attention`
with its local kernel chosen as on one GPU (`pick_local_attention`). Both split causal attention so that every
rank does the same work (the course's zigzag layout; PyTorch's load balancer does the same by default), and
both unshard their results before the check. Every rank draws the same full tensors; rank 0 checks and writes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "11_context_parallel_h200.json"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.context_parallel",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=None, help="GPUs to use (default: all, at least 2)")
    for name, default in (("batch", 1), ("heads", 16), ("seq", 32768), ("head-dim", 128), ("iters", 10)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--not-causal", action="store_true", help="full attention (default: causal)")
    p.add_argument("--sdpa-backend", choices=tuple(SDPA_BACKENDS), default="flash")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("batch", "heads", "seq", "head_dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _context_parallel_unshard():
    # Public in recent PyTorch; in the private module before.
    try:
        from torch.distributed.tensor.experimental import context_parallel_unshard
    except ImportError:
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    return context_parallel_unshard


def _torch_context_parallel(q, k, v, do, *, causal, backend, device, world_size, iters):
    """(out, [dq, dk, dv], ms) of SDPA under context_parallel; out and gradients unsharded (full sequence)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from utils.course.ring_check import _time

    mesh = init_device_mesh("cuda", (world_size,))
    full = [t.to(device) for t in (q, k, v, do)]
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]), \
            context_parallel(mesh, buffers=full, buffer_seq_dims=[2] * 4, no_restore_buffers=set(full)):
        leaves = [t.detach().requires_grad_() for t in full[:3]]   # this rank's shards, now

        def step():
            for t in leaves:
                t.grad = None
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            out.backward(full[3])
            return out

        out = step()
        grads = [t.grad for t in leaves]
        ms = _time(step, device, iters)
    return *_unshard_all(mesh, [out.detach(), *grads]), ms


def _unshard_all(mesh, tensors):
    out, *grads = _context_parallel_unshard()(mesh, tensors, [2] * len(tensors))
    return out, grads


def _course_ring(q, k, v, do, *, causal, device, world_size, rank, iters):
    """(out, [dq, dk, dv], ms) of the course's ring (zigzag), unsharded on every rank."""
    from utils.course.ring_check import RingCase, _gather, _ring_gradients, _time
    from utils.ring.attention import ring_attention, shard, unshard

    case = RingCase(causal=causal, layout="zigzag")
    shards = [shard(t, world_size, rank, "zigzag").to(device) for t in (q, k, v)]
    do_loc = shard(do, world_size, rank, "zigzag").to(device)
    out = ring_attention(*shards, causal=causal, layout="zigzag")
    grads = _ring_gradients(shards, do_loc, case, overlap=True)
    ms = _time(lambda: _ring_gradients(shards, do_loc, case, overlap=True), device, iters)
    whole = [unshard(_gather(t, world_size), "zigzag") for t in (out, *grads)]
    return whole[0], whole[1:], ms


def _errors(out, grads, truth, truth_grads) -> dict:
    """Largest absolute error of the output, and of each gradient relative to its largest entry."""
    rel = [float((g.double().cpu() - t.double().cpu()).abs().max() / t.double().abs().max())
           for g, t in zip(grads, truth_grads)]
    return dict(max_abs_err=float((out.double().cpu() - truth.double().cpu()).abs().max()), grad_rel_err=max(rel))


def _worker(rank: int, world_size: int, backend: str, port: int, args, results) -> None:
    from utils.course.ring_check import _reference, _reference_gradients, rank_group
    from utils.course.testing import random_qkv

    causal = not args.not_causal
    with rank_group(rank, world_size, backend, port) as device:
        q, k, v = random_qkv(args.batch, args.heads, args.seq, args.seq, args.head_dim, dtype=torch.bfloat16,
                             seed=0)
        do = random_qkv(args.batch, args.heads, args.seq, args.seq, args.head_dim, dtype=torch.bfloat16,
                        seed=1)[0]
        ring = _course_ring(q, k, v, do, causal=causal, device=device, world_size=world_size, rank=rank,
                            iters=args.iters)
        try:
            cp = _torch_context_parallel(q, k, v, do, causal=causal, backend=args.sdpa_backend, device=device,
                                         world_size=world_size, iters=args.iters)
            cp_error = None
        except Exception as err:   # a PyTorch without the API, or a backend it refuses: recorded, not hidden
            cp, cp_error = None, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
        if rank != 0:
            return
        truth = _reference(q, k, v, causal, device)
        truth_grads = _reference_gradients(q, k, v, do, causal, device)
        rows = [dict(implementation="course ring (zigzag)", ms=round(ring[2], 4),
                     **_errors(ring[0], ring[1], truth, truth_grads))]
        if cp_error is None:
            rows.append(dict(implementation=f"torch context_parallel ({args.sdpa_backend})", ms=round(cp[2], 4),
                             **_errors(cp[0], cp[1], truth, truth_grads)))
        else:
            rows.append(dict(implementation=f"torch context_parallel ({args.sdpa_backend})", error=cp_error))
        results.put(rows)


def main(argv=None) -> dict:
    import torch.multiprocessing as mp

    from utils import gpu
    from utils.course.ring_check import spawn_ranks

    args = parse_args(argv)
    gpus = torch.cuda.device_count()
    world_size = args.world_size or gpus
    if world_size < 2 or gpus < world_size:
        raise SystemExit(f"the context-parallel comparison needs at least 2 CUDA GPUs (asked {world_size}, "
                         f"found {gpus})")
    if args.seq % (2 * world_size):
        raise SystemExit(f"--seq ({args.seq}) must split into 2 × {world_size} equal chunks (the zigzag layout)")
    results = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(_worker, world_size, "nccl", args, results)
    command = "python -m utils.course.bench.context_parallel" + (f" {' '.join(argv)}" if argv else "")
    data = dict(environment=dict(gpu.environment(command), gpus=world_size),
                settings=dict(batch=args.batch, heads=args.heads, seq=args.seq, head_dim=args.head_dim,
                              causal=not args.not_causal, dtype="bfloat16", sdpa_backend=args.sdpa_backend,
                              iters=args.iters),
                rows=results.get())
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    for row in data["rows"]:
        print(row)
    return data


if __name__ == "__main__":
    main()
