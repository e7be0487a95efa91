"""Ring attention on paper (notebook 08): memory per rank, bytes and FLOPs per ring step, and whether the
transfer hides under the compute, counted the way `utils.ring.attention` runs the ring.

Sizes: one sequence of N tokens (batch 1), H query heads, Hkv K/V heads (GQA), head dim D, W ranks holding
c = N/W tokens each (zigzag: two chunks of c/2). b bytes per element of Q, K, V, O (2 for bf16) and a = 4 for
what the ring keeps in fp32: the forward's output accumulator and lse, and in the backward dQ, delta and the
travelling dK/dV accumulators. Throughputs (TFLOP/s, link GB/s) are the caller's: measured ones are in
images/*.json. Plain arithmetic, no GPU; tests/test_ring_scale.py checks it against counts done by hand.
"""
from __future__ import annotations

import math
import numbers

from utils.checks import positive_int

BWD_FLOPS = 2.5   # backward / forward FLOPs: five matrix products per block instead of two (utils.course.bench)


def _rate(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be positive and finite, got {x}")
    return float(x)


def _check_heads(heads, kv_heads) -> tuple[int, int]:
    heads, kv_heads = positive_int("heads", heads), positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return heads, kv_heads


def tokens_per_rank(tokens: int, world_size: int) -> int:
    """c = N / W, the tokens each rank holds; N must split into the zigzag layout's 2W equal chunks."""
    tokens, world_size = positive_int("tokens", tokens), positive_int("world_size", world_size)
    if tokens % (2 * world_size):
        raise ValueError(f"tokens ({tokens}) must be a multiple of 2 × world_size ({2 * world_size}): "
                         "the zigzag layout's chunks")
    return tokens // world_size


def rank_memory(tokens: int, heads: int, kv_heads: int, head_dim: int, world_size: int, *, training=False,
                dtype_bytes: int = 2, acc_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank holds for one attention layer at the peak of the forward ring (or, with `training`, of
    the backward ring, which holds more), by part. What the loops of `_ring_forward` / `_ring_backward` keep
    alive: the rank's shards; the stacked K/V chunk in hand and the one arriving (both b); and in the backward
    four fp32 dK/dV accumulators (its own share, the one it adds to, the one leaving, the one arriving).
    Not counted: the local kernel's and the merge's temporaries, weights, the rest of the model."""
    heads, kv_heads = _check_heads(heads, kv_heads)
    d, b = positive_int("head_dim", head_dim), positive_int("dtype_bytes", dtype_bytes)
    a = positive_int("acc_bytes", acc_bytes)
    c = tokens_per_rank(tokens, world_size)
    rows, kv = c * heads, 2 * c * kv_heads * d   # query rows; elements of one K/V chunk
    if not training:
        return {"Q": rows * d * b, "K, V": kv * b, "K/V in hand": kv * b, "K/V arriving": kv * b,
                "O accumulator (fp32)": rows * d * a, "lse": rows * a}
    return {"Q": rows * d * b, "K, V": kv * b, "O": rows * d * b, "lse": rows * a, "dO": rows * d * b,
            "delta": rows * a, "dQ accumulator (fp32)": rows * d * a, "K/V in hand": kv * b,
            "K/V arriving": kv * b, "dK/dV accumulators (4, fp32)": 4 * kv * a}


def step_bytes(tokens: int, kv_heads: int, head_dim: int, world_size: int, *, backward=False,
               dtype_bytes: int = 2, acc_bytes: int = 4) -> int:
    """Bytes each rank sends per ring step: its K/V chunk (2·c·Hkv·D·b); in the backward also the chunk's dK/dV
    accumulator, kept in fp32 (2·c·Hkv·D·a). A pass has W − 1 such sends of each."""
    c = tokens_per_rank(tokens, world_size)
    kv = 2 * c * positive_int("kv_heads", kv_heads) * positive_int("head_dim", head_dim)   # elements of K and V
    b, a = positive_int("dtype_bytes", dtype_bytes), positive_int("acc_bytes", acc_bytes)
    return kv * b + (kv * a if backward else 0)


def step_flops(tokens: int, heads: int, head_dim: int, world_size: int, *, causal=True, backward=False) -> float:
    """FLOPs of one rank in one ring step: a block of c queries × c keys is 4·c²·H·D (two matrix products);
    causal with zigzag, every rank does half a block at every step (`utils.ring.attention.step_work`); the backward
    2.5×. GQA does not change it: every query head still meets every key."""
    c = tokens_per_rank(tokens, world_size)
    flops = 4.0 * c * c * positive_int("heads", heads) * positive_int("head_dim", head_dim)
    return flops * (0.5 if causal else 1.0) * (BWD_FLOPS if backward else 1.0)


def compute_ms(flops: float, tflops: float) -> float:
    """Milliseconds to do `flops` at `tflops` TFLOP/s."""
    return _rate("flops", flops) / (_rate("tflops", tflops) * 1e12) * 1e3


def transfer_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to send `nbytes` over a link of `gbps` GB/s (1e9 bytes/s) in one direction."""
    return _rate("nbytes", nbytes) / (_rate("gbps", gbps) * 1e9) * 1e3


def break_even_tokens_per_rank(heads: int, kv_heads: int, *, tflops: float, gbps: float, causal=True,
                               backward=False, dtype_bytes: int = 2, acc_bytes: int = 4) -> float:
    """The chunk c* at which a step's compute equals its transfer; beyond it the transfer hides.

    Compute grows as c² (k·c²·H·D FLOPs), the transfer as c (2·c·Hkv·D·bytes): equal at
    c* = 2·Hkv·bytes·F / (k·H·β), with k = 4 (× 1/2 causal, × 2.5 backward). D cancels."""
    heads, kv_heads = _check_heads(heads, kv_heads)
    b, a = positive_int("dtype_bytes", dtype_bytes), positive_int("acc_bytes", acc_bytes)
    per_token = 2 * kv_heads * (b + (a if backward else 0))   # bytes per token sent, per unit of D
    k = 4.0 * (0.5 if causal else 1.0) * (BWD_FLOPS if backward else 1.0)
    return per_token * _rate("tflops", tflops) * 1e12 / (k * heads * _rate("gbps", gbps) * 1e9)


def slowest_hop(world_size: int, gpus_per_node: int, intra_gbps: float, inter_gbps: float) -> tuple[float, int]:
    """(GB/s of the ring's slowest hop, hops between nodes). Ranks fill nodes in order, so a ring over n > 1
    nodes crosses a node boundary n times (the wrap-around W−1 → 0 included). All hops run at once and a step
    ends when the last chunk lands: one slow hop sets the pace of the whole ring."""
    world_size, per_node = positive_int("world_size", world_size), positive_int("gpus_per_node", gpus_per_node)
    intra, inter = _rate("intra_gbps", intra_gbps), _rate("inter_gbps", inter_gbps)
    nodes = -(-world_size // per_node)
    return (min(intra, inter), nodes) if nodes > 1 else (intra, 0)


def pass_ms(compute: float, kv: float, world_size: int, *, dkv: float | None = None) -> float:
    """Milliseconds of one ring pass from per-step compute and transfer times (ms), with the transfers
    overlapped as `ring_attention` posts them.

    Forward (dkv None): W − 1 steps of max(compute, kv), then a last step with nothing to send.
    Backward: step 0 sends K/V only; steps 1..W−2 send K/V and the previous step's dK/dV over the same link;
    step W−1 sends dK/dV only; the last accumulator's hop home follows the last compute, exposed."""
    compute, w = _rate("compute", compute), positive_int("world_size", world_size)
    kv = _rate("kv", kv)
    if w == 1:
        return compute
    if dkv is None:
        return (w - 1) * max(compute, kv) + compute
    dkv = _rate("dkv", dkv)
    return max(compute, kv) + (w - 2) * max(compute, kv + dkv) + max(compute, dkv) + dkv


def ring_step(tokens: int, heads: int, kv_heads: int, head_dim: int, world_size: int, *, tflops: float,
              gbps: float, backward=False, causal=True, dtype_bytes: int = 2, acc_bytes: int = 4) -> dict:
    """Everything about one ring step (forward, or with `backward` the backward ring of a training step) at
    `tflops` TFLOP/s and a link of `gbps` GB/s: tokens per rank, the rank's memory (bytes), bytes sent, compute
    and transfer ms, their ratio (compute / transfer; hidden when >= 1), the pass's ms, and the break-even c*."""
    sizes = dict(dtype_bytes=dtype_bytes, acc_bytes=acc_bytes)
    c = tokens_per_rank(tokens, world_size)
    memory = sum(rank_memory(tokens, heads, kv_heads, head_dim, world_size, training=backward, **sizes).values())
    kv_bytes = step_bytes(tokens, kv_heads, head_dim, world_size, **sizes)
    nbytes = step_bytes(tokens, kv_heads, head_dim, world_size, backward=backward, **sizes)
    compute = compute_ms(step_flops(tokens, heads, head_dim, world_size, causal=causal, backward=backward), tflops)
    comm = transfer_ms(nbytes, gbps)
    dkv = transfer_ms(nbytes - kv_bytes, gbps) if backward else None
    total = pass_ms(compute, transfer_ms(kv_bytes, gbps), world_size, dkv=dkv)
    return dict(tokens_per_rank=c, memory_bytes=memory, bytes=nbytes, compute_ms=compute, comm_ms=comm,
                ratio=compute / comm, hidden=compute >= comm, pass_ms=total,
                break_even=break_even_tokens_per_rank(heads, kv_heads, tflops=tflops, gbps=gbps, causal=causal,
                                                      backward=backward, **sizes))
