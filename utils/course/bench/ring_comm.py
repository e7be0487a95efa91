"""The ring's exchange alone (notebook 08): how fast each rank sends a K/V chunk to rank+1 while receiving one.

    python -m utils.course.bench.ring_comm --backend nccl --world-size 2 --out images   # images/ring_comm_<gpu>.json
    python -m utils.course.bench.ring_comm --backend gloo --world-size 2 --out /tmp     # CPU processes, small messages

W processes start as in `utils.course.ring_check` (`spawn_ranks`, `rank_group`) and post the very exchange of
`ring_attention`'s steps (`_post_exchange`: isend to rank+1, irecv from rank-1, every rank at once) for a sweep
of message sizes. A timing is the wall time of back-to-back exchanges, from a barrier until this rank's device
is done, over their number; the slowest rank's time counts (a ring step ends when the last chunk lands), and
the median over repeats is kept. GB/s is the bytes one rank sends per second, one direction of its link: the
number `utils.ring.scale` divides a step's bytes by. Notebook 08's "scale on paper" uses the stored NCCL run.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from utils.checks import check_int, positive_int
from utils.course.ring_check import check_launch, rank_group, spawn_ranks
from utils.ring.attention import _post_exchange, _wait

MEASURE_COMMAND = "python -m utils.course.bench.ring_comm --backend nccl --world-size 2 --out images"
GPU_SIZES = tuple(2**k for k in range(20, 31, 2))   # 1 MiB to 1 GiB: a 1M-token ring's chunks are 64 MiB-1 GiB
CPU_SIZES = tuple(2**k for k in range(14, 23, 2))   # 16 KiB to 4 MiB: gloo over loopback, seconds in all


def check_sizes(sizes) -> list[int]:
    """The message sizes in bytes as a list of ints, or a TypeError/ValueError naming `sizes`."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {type(sizes).__name__}")
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sizes must name at least one message size")
    return [positive_int("sizes", n) for n in sizes]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_exchange(nbytes: int, burst_bytes: int, warmup: int, repeats: int, device) -> dict:
    """One message size on this rank: the row rank 0 reports (every rank must call it, in step)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    send = torch.full((nbytes,), rank % 256, dtype=torch.uint8, device=device)  # tagged: who sent it
    recv = torch.empty_like(send)
    count = max(1, math.ceil(burst_bytes / nbytes))  # small messages in a burst, not one timer read each

    def exchange():
        for _ in range(count):
            _wait(_post_exchange(send, recv, world_size, rank))

    for _ in range(warmup):
        exchange()
    seconds = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()  # every rank starts together: a step waits for all of them
        start = time.perf_counter()
        exchange()
        _sync(device)   # NCCL returns before the bytes move: stop the clock when the device is done
        seconds.append((time.perf_counter() - start) / count)
    if not bool((recv == (rank - 1) % world_size % 256).all()):
        raise RuntimeError(f"rank {rank} did not receive rank {(rank - 1) % world_size}'s message")
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)  # NCCL reduces GPU tensors only
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_step = slowest.cpu().tolist()
    ms = statistics.median(per_step) * 1e3
    return dict(bytes=nbytes, exchanges_per_timing=count, ms=ms, ms_min=min(per_step) * 1e3,
                gbps=nbytes / ms / 1e6)


def _worker(rank, world_size, backend, port, sizes, burst_bytes, warmup, repeats, results) -> None:
    with rank_group(rank, world_size, backend, port) as device:
        rows = [_time_exchange(n, burst_bytes, warmup, repeats, device) for n in sizes]
        if rank == 0:
            results.put(rows)


def measure_ring_exchange(sizes, *, world_size: int = 2, backend: str = "gloo", repeats: int = 5,
                          warmup: int = 2, burst_bytes: int = 0) -> list[dict]:
    """Time the ring's exchange over `world_size` processes for each message size (bytes).

    Rows {bytes, exchanges_per_timing, ms, ms_min, gbps}: ms is the median over `repeats` timings (after
    `warmup` untimed ones) of one exchange on the slowest rank, gbps the bytes one rank sends per second (1e9).
    `burst_bytes`: a timing sends at least this many bytes in back-to-back exchanges, so that the barrier and
    the host's clock do not dominate small messages. gloo runs on CPUs; nccl needs one GPU per rank.
    """
    import torch.multiprocessing as mp

    sizes = check_sizes(sizes)
    if positive_int("world_size", world_size) < 2:
        raise ValueError(f"world_size must be at least 2 (a ring of one process sends nothing), got {world_size}")
    check_launch(world_size, backend)
    repeats = positive_int("repeats", repeats)
    for name, x in (("warmup", warmup), ("burst_bytes", burst_bytes)):
        check_int(name, x, 0)
    results = mp.get_context("spawn").SimpleQueue()  # one list of rows: the pipe never fills
    spawn_ranks(_worker, world_size, backend, sizes, burst_bytes, warmup, repeats, results)
    return results.get()


def device_tag(name: str | None) -> str:
    """A file-name tag for a device name: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3',
    None (no GPU) -> 'cpu'."""
    if name is None:
        return "cpu"
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower().removeprefix("nvidia").strip()).strip("_")
    return tag or "gpu"


def result_path(folder, tag: str) -> Path:
    """Where the exchange of a device tagged `tag` is kept: <folder>/ring_comm_<tag>.json."""
    return Path(folder) / f"ring_comm_{tag}.json"


def write_ring_comm(folder, *, backend: str, world_size: int, sizes, command: str, tag: str | None = None,
                    **kwargs) -> Path:
    """Measure (`measure_ring_exchange`; kwargs go to it) and write ring_comm_<tag>.json with the environment
    (`utils.gpu.environment(command)`); returns the path."""
    from utils import gpu

    rows = measure_ring_exchange(sizes, world_size=world_size, backend=backend, **kwargs)
    device = torch.cuda.get_device_name(0) if backend == "nccl" else None
    path = result_path(folder, tag or device_tag(device))
    path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(environment=gpu.environment(command), backend=backend, world_size=world_size,
                  device=device or "CPU", pattern="every rank: isend to rank+1, irecv from rank-1, at once "
                  "(utils.ring.attention._post_exchange)", rows=rows)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def stored_nccl(folder) -> tuple[Path, dict] | None:
    """The first (by name) images/ring_comm_*.json measured with NCCL, and its content; None if there is none."""
    for path in sorted(Path(folder).glob("ring_comm_*.json")):
        result = json.loads(path.read_text())
        if result.get("backend") == "nccl":
            return path, result
    return None


def large_message_gbps(result: dict) -> float:
    """GB/s of the largest message measured: the link's streaming rate, what a long sequence's chunks see."""
    rows = result.get("rows") if isinstance(result, dict) else None
    if not rows:
        raise ValueError("result must be a ring_comm result with at least one row")
    return max(rows, key=lambda r: r["bytes"])["gbps"]


def _main(argv=None):
    parser = argparse.ArgumentParser(description="Time the ring's exchange (send to rank+1, receive from rank-1)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="message sizes in bytes (default: 1 MiB-1 GiB on nccl, 16 KiB-4 MiB on gloo)")
    parser.add_argument("--repeats", type=int, default=None, help="timings per size (default: 20 nccl, 5 gloo)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="images", help="folder for ring_comm_<tag>.json")
    parser.add_argument("--tag", default=None, help="file-name tag (default: from the GPU's name, or 'cpu')")
    args = parser.parse_args(argv)
    gpu = args.backend == "nccl"
    command = "python -m utils.course.bench.ring_comm " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_ring_comm(args.out, backend=args.backend, world_size=args.world_size, command=command,
                           sizes=args.sizes or (GPU_SIZES if gpu else CPU_SIZES), tag=args.tag,
                           repeats=args.repeats or (20 if gpu else 5), warmup=args.warmup,
                           burst_bytes=2**28 if gpu else 2**20)
    result = json.loads(path.read_text())
    print(f"ring exchange, {args.backend}, {args.world_size} ranks on {result['device']}")
    for r in result["rows"]:
        print(f"{r['bytes'] / 2**20:10.3f} MiB {r['ms']:9.4f} ms {r['gbps']:8.3f} GB/s per rank, one direction")
    print("wrote", path)
    return path


if __name__ == "__main__":
    _main()
