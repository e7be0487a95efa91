"""Block masks (notebook 10): which tiles of the score matrix a mask leaves empty, full or partial.

A kernel that walks tiles of BLOCK_M queries by BLOCK_N keys can do three things with a tile:
skip it (EMPTY: the mask hides every score), compute it without evaluating the mask (FULL: every score is
visible), or compute it and mask element by element (PARTIAL). Classifying the tiles once per mask, and handing
each row of tiles the list of its partial and full tiles, is the idea behind FlexAttention's BlockMask
(Dong et al., 2024); here it is built from scratch.

Convention: a tile holding keys past the end of the sequence is never FULL (the kernels then mask them); query
rows past the end do not count (their outputs are not written).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils.checks import positive_int

EMPTY, PARTIAL, FULL = 0, 1, 2


def block_states(mask_fn, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int) -> torch.Tensor:
    """The readable version: (cdiv(Nq, block_m), cdiv(Nk, block_n)) int8 states of one (batch, head) from
    `mask_fn(q_idx, kv_idx) -> bool tensor`, given broadcast index tensors (q_idx bottom-right aligned). It
    materialises the whole Nq x Nk mask; the Triton builder below evaluates it tile by tile instead."""
    nq, nk = positive_int("seqlen_q", seqlen_q), positive_int("seqlen_k", seqlen_k)
    bm, bn = positive_int("block_m", block_m), positive_int("block_n", block_n)
    qb, kb = triton.cdiv(nq, bm), triton.cdiv(nk, bn)
    q = torch.arange(qb * bm).view(-1, 1)
    kv = torch.arange(kb * bn).view(1, -1)
    inside = (q < nq) & (kv < nk)
    visible = torch.as_tensor(mask_fn(q.clamp(max=nq - 1) + nk - nq, kv.clamp(max=nk - 1)))
    visible = visible.broadcast_to(inside.shape) & inside
    tiles = visible.reshape(qb, bm, kb, bn).sum((1, 3))
    rows = (nq - torch.arange(qb) * bm).clamp(max=bm).view(-1, 1)       # query rows inside each tile row
    states = torch.full((qb, kb), PARTIAL, dtype=torch.int8)
    states[tiles == 0] = EMPTY
    states[tiles == rows * bn] = FULL
    return states


@triton.jit
def _block_states_kernel(STATES, MOD_T, mod_i, mod_f, heads_m, seqlen_q, seqlen_k, n_kv_blocks,
                         MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (tile row, batch|0, head|0): evaluates the mask on each tile of its row and stores the
    tile's state."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_m
    h = bh % heads_m
    args = (MOD_T, mod_i, mod_f)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = tl.minimum(offs_m, seqlen_q - 1) + (seqlen_k - seqlen_q)
    rows = tl.minimum(seqlen_q - qb * BLOCK_M, BLOCK_M)
    out = STATES + (bh.to(tl.int64) * tl.num_programs(0) + qb) * n_kv_blocks
    for kb in range(0, n_kv_blocks):
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        visible = inside & MASK_MOD(b, h, q_pos[:, None], tl.minimum(offs_n, seqlen_k - 1)[None, :], args)
        count = tl.sum(tl.sum(visible.to(tl.int32), 1), 0)
        state = tl.where(count == 0, 0, tl.where(count == rows * BLOCK_N, 2, 1))
        tl.store(out + kb, state.to(tl.int8))


class BlockMask(NamedTuple):
    """Per (batch|1, heads|1, tile row): the partial and the full tiles, counts then indices (the first `count`
    entries of each index row are meaningful); the q_* fields are the same per tile column (the backward's
    dK/dV pass walks columns)."""
    kv_count: torch.Tensor
    kv_index: torch.Tensor
    full_kv_count: torch.Tensor
    full_kv_index: torch.Tensor
    q_count: torch.Tensor
    q_index: torch.Tensor
    full_q_count: torch.Tensor
    full_q_index: torch.Tensor
    block_m: int
    block_n: int
    seqlen_q: int
    seqlen_k: int
    modifier: str = ""      # the name of the modifier it was built for

    def states(self) -> torch.Tensor:
        """(batch|1, heads|1, tile rows, tile columns) int8: EMPTY, PARTIAL or FULL."""
        states = torch.zeros(self.kv_index.shape, dtype=torch.int8, device=self.kv_index.device)
        for index, count, state in ((self.kv_index, self.kv_count, PARTIAL),
                                    (self.full_kv_index, self.full_kv_count, FULL)):
            used = torch.arange(index.shape[-1], device=index.device) < count[..., None]
            states.scatter_add_(-1, index.long(), torch.where(used, state, 0).to(torch.int8))  # unused add 0
        return states

    def sparsity(self) -> float:
        """Fraction of tiles skipped (EMPTY)."""
        return (self.states() == EMPTY).float().mean().item()

    def __str__(self):
        s = self.states()[0, 0]
        picture = "\n".join("".join(" ░█"[x] for x in row.tolist()) for row in s)
        return (f"BlockMask({self.modifier or 'no mask'}: {self.block_m}x{self.block_n} tiles, shape "
                f"{tuple(self.states().shape)}, {self.sparsity():.0%} skipped; █ full, ░ partial)\n{picture}")


def _lists(states: torch.Tensor, state: int):
    """Count and indices (ascending, those with `state` first) of each row's tiles in `state`."""
    hit = states == state
    count = hit.sum(-1, dtype=torch.int32)
    index = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), index.contiguous()


def from_states(states: torch.Tensor, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                modifier: str = "") -> BlockMask:
    """A BlockMask from (batch|1, heads|1, tile rows, tile columns) states."""
    cols = states.transpose(-1, -2)
    return BlockMask(*_lists(states, PARTIAL), *_lists(states, FULL), *_lists(cols, PARTIAL), *_lists(cols, FULL),
                     block_m, block_n, seqlen_q, seqlen_k, modifier)


def default_blocks(device) -> tuple[int, int]:
    """64 x 64 tiles on a GPU, the kernels' own tiles (utils.flex.attention.SPARSE_TILES): inside a coarser
    tile that is partial, some kernel tiles are empty, yet computed (worklog 10w, section 5); 32 x 32 in the
    interpreter."""
    return (64, 64) if torch.device(device).type == "cuda" else (32, 32)


def block_mask(modifier, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, device,
               block_m: int | None = None, block_n: int | None = None) -> BlockMask:
    """The BlockMask of `modifier` (a utils.flex.Modifier or None: no mask) for this shape, built on `device` by a
    Triton kernel that evaluates the mask tile by tile (interpreted on a CPU)."""
    from utils.flex.mods import Modifier

    if modifier is not None and not isinstance(modifier, Modifier):
        raise TypeError(f"modifier must be a Modifier or None, got {type(modifier).__name__}")
    batch, heads = positive_int("batch", batch), positive_int("heads", heads)
    seqlen_q, seqlen_k = positive_int("seqlen_q", seqlen_q), positive_int("seqlen_k", seqlen_k)
    device = torch.device(device)
    default_m, default_n = default_blocks(device)
    block_m = positive_int("block_m", block_m) if block_m is not None else default_m
    block_n = positive_int("block_n", block_n) if block_n is not None else default_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    qb, kb = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    if modifier is None or modifier.mask_mod is None:   # every tile full but the ragged last column
        states = torch.full((1, 1, qb, kb), FULL, dtype=torch.int8, device=device)
        if seqlen_k % block_n:
            states[..., -1] = PARTIAL
        return from_states(states, block_m, block_n, seqlen_q, seqlen_k, getattr(modifier, "name", ""))
    bm_, hm_ = (batch if modifier.per_batch else 1), (heads if modifier.per_head else 1)
    states = torch.empty((bm_, hm_, qb, kb), dtype=torch.int8, device=device)
    tensor = modifier.tensor.to(device) if modifier.tensor is not None else states
    _block_states_kernel[(qb, bm_ * hm_)](states, tensor, modifier.int_arg, modifier.float_arg, hm_, seqlen_q,
                                         seqlen_k, kb, MASK_MOD=modifier.mask_mod, BLOCK_M=block_m,
                                         BLOCK_N=block_n, num_warps=8 if block_m * block_n >= 8192 else 4)
    return from_states(states, block_m, block_n, seqlen_q, seqlen_k, modifier.name)
