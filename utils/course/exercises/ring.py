"""Check of notebook 08's ring exercise (8.7): one step of the simulated ring, played for every rank.

The learner's `ring_step(step, q_chunks, kv_held, o_acc, lse_acc, causal)` is given, for each rank r, its query
chunk, the K/V chunk it holds at `step`, and its running (o, lse). It attends the queries to the chunk held (for
causal attention with contiguous chunks: all keys of an earlier rank's chunk, the causal diagonal of its own,
nothing of a later rank's), merges that partial (o, lse) into the running one by log-sum-exp, and returns
(o_acc, lse_acc, what each rank holds at the next step). The check plays the whole ring and, after every step,
compares each rank's accumulator with attention over the chunks it has met so far, computed here from scratch in
float64, and what each rank holds with the chunk it must have received from rank r − 1.
"""
from __future__ import annotations

import math

import torch

RING_CASES = [
    # (world size, causal, what the case adds)
    (3, False, "full attention: each rank attends to every chunk it is handed and merges it in"),
    (4, True, "causal, contiguous chunks: a later rank's chunk is skipped, the rank's own is the causal diagonal"),
]
RING_CHUNK, RING_HEADS, RING_DIM = 4, 2, 8
RING_HINTS = (
    "read the rank, the step and the chunk named; at step s rank r holds the chunk that started s ranks before "
    "it on the ring, and hands it to the next rank; its partial result joins the running one by notebook 02's "
    "log-sum-exp merge, each side weighted by its share of the total",
    "the chunk held: (r − s) modulo W. Causal with contiguous chunks: a chunk from an earlier rank is wholly in "
    "the past (all keys), the rank's own needs the causal mask, a later rank's is skipped. Merge: m, the larger "
    "of the two lse; weights e^(lse − m); o is the weighted sum of the two outputs over the sum of the weights, "
    "and lse is m plus the log of that sum. Pass on: rank r + 1 receives what rank r held, the last rank's going "
    "to rank 0.",
)


def ring_problem(world_size: int, seed: int):
    """Float64 q, k, v (1, RING_HEADS, world_size · RING_CHUNK, RING_DIM), the logits spread so merges matter."""
    gen = torch.Generator().manual_seed(seed)
    n = world_size * RING_CHUNK
    q, k, v = (torch.randn(1, RING_HEADS, n, RING_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    return 3.0 * q, k, v


def ring_expected(q, k, v, world_size: int, rank: int, step: int, causal: bool):
    """(o, lse) of rank's queries after `step`: attention over the chunks (rank − t) mod W, t <= step."""
    c = RING_CHUNK
    rows = torch.arange(rank * c, (rank + 1) * c)
    cols = torch.arange(world_size * c)
    met = torch.zeros(world_size * c, dtype=torch.bool)
    for t in range(step + 1):
        src = (rank - t) % world_size
        met[src * c:(src + 1) * c] = True
    visible = met[None, :] & ((cols[None, :] <= rows[:, None]) if causal else True)
    s = (q[:, :, rows] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def _which_chunk(held, k_chunks, v_chunks) -> str:
    """'chunk j' if `held` is rank j's (k, v), else a description of what it is."""
    if not (isinstance(held, (tuple, list)) and len(held) == 2 and all(isinstance(t, torch.Tensor) for t in held)):
        return f"a {type(held).__name__}, not a (k, v) pair"
    for j, (kc, vc) in enumerate(zip(k_chunks, v_chunks)):
        if held[0].shape == kc.shape and held[1].shape == vc.shape and torch.equal(held[0], kc) \
                and torch.equal(held[1], vc):
            return f"chunk {j}"
    return "no chunk of the sequence (its k or v was changed)"


def _rows_wrong(got, expected, tol=1e-9) -> list[int]:
    bad = ~torch.isclose(got.double(), expected, atol=tol, rtol=tol) | (~torch.isfinite(got) & torch.isfinite(expected))
    return bad.reshape(-1, *bad.shape[2:]).any(0).reshape(bad.shape[2], -1).any(-1).nonzero().flatten().tolist()


def check_ring_step(ring_step) -> None:
    """Exercise 8.7: play the ring with the learner's `ring_step` on RING_CASES; a failure names the case, the
    rank and step (with the chunk held), and the query rows that are wrong, or what a rank holds after a step.
    The course's ring and merge are refused."""
    from utils.course.exercises.refuse import refusing
    from utils.eager.softmax import merge_attention
    from utils.ring import attention as ring

    if not callable(ring_step):
        raise TypeError(f"ring_step must be a function, got {type(ring_step).__name__}")
    for number, (w, causal, adds) in enumerate(RING_CASES, 1):
        q, k, v = ring_problem(w, number)
        c = RING_CHUNK
        q_chunks, k_chunks, v_chunks = ([t[:, :, r * c:(r + 1) * c].clone() for r in range(w)] for t in (q, k, v))
        held = [(k_chunks[r].clone(), v_chunks[r].clone()) for r in range(w)]
        o_acc = [torch.zeros_like(x) for x in q_chunks]
        lse_acc = [torch.full(x.shape[:3], -math.inf, dtype=torch.float64) for x in q_chunks]
        where = f"case {number} ({w} ranks, chunks of {c} positions{', causal' if causal else ''}), the first to add {adds}"
        for step in range(w):
            with refusing(merge_attention, ring.simulate_ring_attention, ring._simulate_forward, ring._accumulate,
                          ring.step_work, ring.ring_attention):
                got = ring_step(step, [x.clone() for x in q_chunks], list(held), list(o_acc), list(lse_acc), causal)
            if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(x, list) and len(x) == w for x in got)):
                raise AssertionError(f"{where}: ring_step must return a tuple of three lists of {w} entries, one per "
                                     f"rank (o_acc, lse_acc, the K/V each rank holds next)")
            o_acc, lse_acc, held_next = got
            for rank in range(w):
                src = (rank - step) % w
                o_ref, lse_ref = ring_expected(q, k, v, w, rank, step, causal)
                for name, x, ref in (("o", o_acc[rank], o_ref), ("lse", lse_acc[rank], lse_ref[..., None])):
                    x = x[..., None] if name == "lse" and isinstance(x, torch.Tensor) else x
                    if not isinstance(x, torch.Tensor) or x.shape != ref.shape:
                        raise AssertionError(f"{where}: rank {rank}'s {name} after step {step} must be a tensor of "
                                             f"shape {tuple(ref.shape)}")
                    rows = _rows_wrong(x, ref)
                    if rows:
                        raise AssertionError(
                            f"{where}:\n  rank {rank} at step {step} (holding K/V chunk {src}): its running {name} "
                            f"is wrong in query rows {rows} of its chunk; after this step it must be attention over "
                            f"chunks {sorted({(rank - t) % w for t in range(step + 1)})}"
                            f"{', causal' if causal else ''}")
            if step < w - 1:
                for rank in range(w):
                    want = (rank - step - 1) % w
                    has = _which_chunk(held_next[rank], k_chunks, v_chunks)
                    if has != f"chunk {want}":
                        raise AssertionError(f"{where}:\n  after step {step}, rank {rank} holds {has} for step "
                                             f"{step + 1}; expected chunk {want}, the one rank {(rank - 1) % w} "
                                             f"held at step {step}")
            held = held_next
