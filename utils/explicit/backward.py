"""The whole FlashAttention backward in ONE warp-specialised Gluon kernel (worklog 07w, section 5).

Notebook 07's Triton backward runs two kernels: dK, dV per key block, then a dQ pass per query block that
recomputes S and dP. That is seven matrix products per tile where five would do, and 07w's section 4 measured the
five-product versions (dQ added atomically) slower still: the adds sat on the critical path. This kernel takes
FlashAttention-3's division of labour (Shah et al. 2024, section 3.3 and appendix B) and writes it for this
course:

    one program per (block of 128 keys, batch, K/V head), four partitions:
    producer (1 warp)     K, V once; then, per tile of query rows, Q, dO, lse2 and D by TMA into a ring of
                          STAGES slots (full/empty mbarriers; a slot is free when both consumers are done)
    consumer W = 0, 1     64 of the 128 keys each: dK, dV in registers; per tile
    (a warpgroup each)      Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together; Pᵀ = exp2(Sᵀ·scale - lse2);
                            dV += Pᵀ dO; dSᵀ = Pᵀ ∘ (dPᵀ - D); dK += dSᵀ Q; dSᵀ to shared memory;
                            both consumers meet (named barrier 15, 256 threads), then consumer W computes
                            its half of the tile's dQ = dS K over all 128 keys (rows [64W, 64W + 64) of a
                            128-row tile, else columns [W·D/2, (W+1)·D/2)) and adds it to an fp32
                            accumulator in global memory with TMA bulk reduce-adds
                            (cp.reduce.async.bulk.tensor): one instruction per 64 × 32 box, off the warps

Choices in the schedule (worklog 07w section 5 measures each one from its stored run):
  - each consumer adds its own half of dQ rather than a partial sum over its 64 keys: half the reduce
    traffic into L2 and no partials to add;
  - that half is one 64 × 64 block, computed by one chain of N = 64 products, so each product reads a
    whole 64 × 16 tile of dS from shared memory (narrower slices read it for half the work);
  - at head dim 64 (`prefetch_s`) the next tile's Sᵀ is issued as soon as dQ is staged, so the tensor cores
    work through the reduce, the release of the ring slot and the loop's turn; at 128 there are no registers
    to spare for it;
  - the reduce is issued from shared memory and waited for one tile later (the builtin below: Gluon 3.6 has no
    wrapper for it; a register-to-global reduce waits for its own staging copy every time); with
    `Config.dq_writer` a fourth partition, one warp, issues it and waits for it instead, as FlashAttention-3
    does, and the consumers only stage dQ and hand it over (a dq_full and a dq_empty barrier per consumer);
  - lse2 and D arrive by TMA with Q and dO and are read from shared memory when needed, so they hold no
    registers across the wgmma waits;
  - causal, the programs are launched a group of (batch, K/V head)s at a time, key block by key block
    (Config.bh_group), not head by head: programs of about the same length run side by side. A group's key
    blocks make about one wave of programs, at least four heads at head dim 128;
  - at head dim 64, and causal at 128 (`ds_first`), dSᵀ is formed before dV's product is issued, as
    FlashAttention-3 orders them (06c's CUDA backward: step dv_late). A running product holds its register
    operand (Pᵀ); at 64, with Pᵀ held while dSᵀ forms, the consumers' loops reload about twice as many spilled
    registers per tile. Without a mask at 128 dV's product running beside dSᵀ measured faster.
  - at head dim 64 (`scaled_p`) the consumers compute P' = scale·P (the statistics kernel lowers lse₂ by
    log2(scale)), so dS' = P' ∘ (dP − D) carries the scale that dQ = scale·dS K and dK = scale·dSᵀ Q need: no
    multiply on dQ per tile, none on dK at the end, one on dV (Pᵀ'dO = scale·dV) at the end instead;
  - at head dim 64 (`dq_fragments`) each consumer stages its 64 × 64 dQ block in the accumulator's own register order
    (FlashAttention-3's): each thread writes 16-byte runs, a warp 512 contiguous bytes, so the stores meet no
    bank conflicts, and one reduce-add per consumer and tile adds the block as a [16, 256] box to an
    accumulator kept in that order; a small Triton kernel (`_dq_unpermute`) puts dQ back in row order as it
    casts it;
  - causal at head dim 64 (`mask_loop`) the tiles that need a mask (the diagonal's; a ragged key block's: all)
    run first, in a loop of their own, and the rest in a loop without the mask's test and branch (FlashAttention-3
    separates its masking steps so). At 128 the two loops spill registers and measured slower;
  - the mask is one compare per element: per key, the first query row that sees it (none past the last key),
    against the tile's column;
  - dK's product is issued before the consumers meet, not after the dQ block's as FlashAttention-3 and -4 order
    them (`dq_first`: dQ is then staged while dK runs). The two orders measured level;
  - at head dim 64 without a mask (`free_early`) a consumer frees its ring slot as soon as its dQ block is
    staged, before it issues the reduce-adds, and waits for the last tile's reduces in the one thread that issued
    them (the pair barrier holds the others) rather than across its warpgroup.

The reduce-adds from the programs of one head arrive in any order, so dQ's last bits vary from run to run
(notebook 07's dQ pass is deterministic); dK and dV do not. Gluon has no interpreter: the kernel runs on sm_90
(H100/H200) only; utils.course.cross_compile compiles it on a CPU, and replay_protocol replays its synchronisation.

The registry's differentiable entries live here, with the backward, so that no forward module imports it:
`flash_attention_gluon` (over utils.explicit.forward), `flash_attention_gluon_ws` (over utils.explicit.forward_ws) and
`flash_attention_gluon_ws3` (over utils.explicit.forward_ws3).
"""
from __future__ import annotations

import functools
import math
import random
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from utils.explicit import forward as fg
from utils.tiled.fast import backward as tb
from utils.explicit import forward_ws as fws, forward_ws3 as fws3
from utils.checks import check_device
from utils.eager.backward import KernelPair, check_backward_inputs, wants_grad
from utils.tiled.fast import launch
from utils.tiled.fast.launch import FastLauncher

SUB_N = 64              # keys per consumer warpgroup
BLOCK_N = 2 * SUB_N     # keys per program
WAVE = 128              # programs in about one wave: one per SM of an H100/H200 (132 SMs)
DQ_ROWS = 64            # rows of a dQ reduce box
DQ_COLS = 32            # columns of a dQ reduce box: an fp32 TMA box row of 128 bytes (the 128-byte swizzle)
_barrier = fg._cta_barrier
# Config.dq_fragments: where a consumer's 64 × 64 dQ block lies in its 4096 floats. Bit i of an offset adds
# FRAGMENT_BASES[i] to (row, column): the column's low bit, the row's 8, the column's 2 and 4, the row's 1, 2, 4,
# 16, 32, the column's 8, 16, 32. That is the wgmma accumulator's register order: each thread's values of a
# (row pair, column pair) in one 16-byte run, a warp's 32 runs side by side, so the stores meet no bank conflicts.
FRAGMENT_BASES = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0), (0, 8), (0, 16), (0, 32))
_FRAGMENT_SMEM = gl.constexpr(gl.SharedLinearLayout(offset_bases=[list(b) for b in FRAGMENT_BASES]))


class Config(NamedTuple):
    block_m: int               # query rows per tile (the N of the Sᵀ, dPᵀ products)
    stages: int                # ring slots for Q, dO, lse2, D
    consumer_regs: int         # registers per consumer thread (setmaxnreg); the producer keeps 24
    prefetch_s: bool = False   # issue the next tile's Sᵀ once dQ is staged (waits for that tile: stages >= 2)
    bh_group: int = 0          # > 0: launched key block by key block over groups of this many (batch, K/V head)s
    dq_writer: bool = False    # a warp of its own issues dQ's reduce-adds (FlashAttention-3's), not the consumers
    ds_first: bool = False     # dSᵀ formed before dV's product is issued (FlashAttention-3's order), not after
    scaled_p: bool = False     # P computed as scale·P, so dSᵀ carries dQ's and dK's scale (no multiply per tile)
    dq_fragments: bool = False  # dQ staged and accumulated in register order (one reduce-add a tile), not by rows
    mask_loop: bool = False    # the tiles that need a mask run in a loop of their own, the rest without its branch
    dq_first: bool = False     # dK's product issued after dQ's, so that dQ is staged while dK runs
    free_early: bool = False   # the ring slot freed once dQ is staged, before its reduce-adds are issued; the
                               # last tile's reduces waited for by the thread that issued them only
    dq_buffers: int = 1        # dQ staging buffers per consumer: with 2, tile t waits for tile t-2's reduces


# Config's switches (the fields whose default is a bool), which check_config holds to bool
_BOOL_FIELDS = tuple(name for name, default in Config._field_defaults.items() if isinstance(default, bool))


def pick_config(head_dim: int, causal: bool = False, seqlen_k: int | None = None) -> Config:
    """128-row tiles and Sᵀ prefetched at head dim 64; at 128 the registers of dK, dV (64 keys × 128 fp32
    each) leave room for 64-row tiles only, and none for a prefetched Sᵀ beside the dQ block. Causal, the
    programs are launched in groups of (batch, K/V head)s (`bh_group`) whose key blocks make about one wave
    (WAVE programs) for `seqlen_k` keys, at least four at head dim 128 (`seqlen_k` None: four at 128, none at
    64). dSᵀ formed before dV's product is issued (`ds_first`) at 64 and causal at 128; P scaled (`scaled_p`)
    and dQ staged in register order (`dq_fragments`) at 64; the masked tiles in a loop of their own
    (`mask_loop`) causal at 64; the ring slot freed before dQ's reduce-adds (`free_early`) at 64 without a mask.
    Worklog 07w section 5 has the runs."""
    if seqlen_k is not None:
        if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, int):
            raise TypeError(f"seqlen_k must be an int or None, got {type(seqlen_k).__name__}")
        if seqlen_k < 1:
            raise ValueError(f"seqlen_k must be >= 1, got {seqlen_k}")
    least = 4 if head_dim == 128 else 0   # at 128 grouping paid at every length probed
    group = least if seqlen_k is None else max(WAVE // triton.cdiv(seqlen_k, BLOCK_N), least)
    group = group if causal and group > 1 else 0   # a group of one head is the launch head by head
    if head_dim == 64:
        return Config(128, 2, 240, True, bh_group=group, ds_first=True, scaled_p=True, dq_fragments=True,
                      mask_loop=causal, free_early=not causal)
    return Config(64, 2, 240, False, bh_group=group, ds_first=causal)


def check_config(config, head_dim: int) -> Config:
    """`config` as a Config, or a ValueError/TypeError naming what does not fit `head_dim`."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a utils.explicit.backward.Config, got {type(config).__name__}")
    if config.block_m not in (64, 128):
        raise ValueError(f"config.block_m must be 64 or 128, got {config.block_m}")
    if head_dim == 128 and config.block_m != 64:
        raise ValueError("config.block_m must be 64 at head dim 128: Sᵀ, dPᵀ of 128 rows do not fit the "
                         "registers beside dK, dV")
    if config.stages not in (1, 2, 3):
        raise ValueError(f"config.stages must be 1, 2 or 3, got {config.stages}")
    if config.consumer_regs not in range(160, 241, 8):
        raise ValueError(f"config.consumer_regs must be a multiple of 8 in [160, 240], got {config.consumer_regs}")
    for field in _BOOL_FIELDS:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise TypeError(f"config.{field} must be a bool, got {type(value).__name__}")
    if type(config.bh_group) is not int:
        raise TypeError(f"config.bh_group must be an int, got {type(config.bh_group).__name__}")
    if config.bh_group < 0:
        raise ValueError(f"config.bh_group must be >= 0, got {config.bh_group}")
    if type(config.dq_buffers) is not int:
        raise TypeError(f"config.dq_buffers must be an int, got {type(config.dq_buffers).__name__}")
    if config.dq_buffers not in (1, 2):
        raise ValueError(f"config.dq_buffers must be 1 or 2, got {config.dq_buffers}")
    if config.dq_buffers == 2 and config.dq_writer:
        raise ValueError("config.dq_buffers = 2 does not go with dq_writer: the writer waits for each block's reduces")
    if config.free_early and (config.dq_writer or config.dq_first):
        raise ValueError("config.free_early goes with neither dq_writer nor dq_first: with the writer the consumers "
                         "do not issue the reduce-adds, and with dq_first dK's product still reads Q when dQ is staged")
    if config.dq_fragments and head_dim == 64 and config.block_m != 128:
        raise ValueError("config.dq_fragments needs a 64 × 64 dQ block per consumer: block_m 128 at head dim 64")
    if config.dq_fragments and config.dq_writer:
        raise ValueError("config.dq_fragments and config.dq_writer do not go together: the writer adds row boxes")
    if config.prefetch_s and config.stages < 2:
        raise ValueError("config.prefetch_s needs stages >= 2: a consumer waits for the next tile before it frees "
                         "the slot of this one")
    return config


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """Add shared-memory tile `src` into global memory at `coord` of `desc` (cp.reduce.async.bulk.tensor, its own
    bulk group: tma.store_wait(n) waits for it to have READ `src`)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _pair_barrier(x):
    """bar.sync over both consumer warpgroups (256 threads). Barrier 15: Triton's partitions use the low ids.
    `x` only gives the inline assembly a (scalar) operand."""
    gl.inline_asm_elementwise("bar.sync 15, 256; mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False,
                              pack=1)


@builtin
def _bulk_wait_read(x, pending, _semantic=None):
    """cp.async.bulk.wait_group.read `pending` (a constexpr count) in this thread alone: all but its last
    `pending` bulk groups have read their shared memory (tma.store_wait also syncs the warpgroup). `x` only gives
    the inline assembly a (scalar) operand."""
    pending = tl.core._unwrap_if_constexpr(pending)
    if isinstance(pending, bool) or not isinstance(pending, int) or not 0 <= pending <= 7:
        raise ValueError(f"pending must be an int from 0 to 7, got {pending!r}")
    return gl.inline_asm_elementwise(f"cp.async.bulk.wait_group.read {pending}; mov.b32 $0, 0;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1, _semantic=_semantic)


@gluon.jit
def _masked_tiles(ragged, last_key, first_m, n_m, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """How many of a query head's n_m tiles (row blocks from first_m on) need the mask: all in a ragged key
    block; under the causal mask those whose first row does not see `last_key` (key0 + SUB - 1 - (Nk - Nq))."""
    n_mask = n_m
    if not ragged:
        n_mask = 0
        if CAUSAL:   # tile i needs it while (first_m + i) · BLOCK_M < last_key
            n_mask = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(last_key, 0), BLOCK_M) - first_m, 0), n_m)
    return n_mask


@gluon.jit
def _tile(t, hk, first_m, n_m, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query head, first row) of tile t: the query heads of the K/V head's group in turn, each its row blocks."""
    n = gl.maximum(n_m, 1)
    return hk * GROUP + t // n, (first_m + t % n) * BLOCK_M


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
              delta_smem, kv_bar, full, empty, b, hk, heads, first_m, n_m, n_tiles, start_n,
              GROUP: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    SUB: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, start_n + w * SUB, 0], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, hk, start_n + w * SUB, 0], kv_bar, v_smem.index(w))
    tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + delta_desc.block_type.nbytes)
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)   # a fresh slot passes at once
        h, row = _tile(t, hk, first_m, n_m, GROUP, BLOCK_M)
        bar = full.index(slot)
        mbarrier.expect(bar, tile_bytes)
        # Rows past seqlen_q read as zeros: Q = dO = 0, lse2 = D = 0 give P = 1 but dS = 0 and P dO = 0.
        tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], bar, q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], bar, do_smem.index(slot))
        tma.async_copy_global_to_shared(lse_desc, [b * heads + h, row], bar, lse_smem.index(slot))
        tma.async_copy_global_to_shared(delta_desc, [b * heads + h, row], bar, delta_smem.index(slot))


@gluon.jit
def _consumer(dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
              stage_smem, kv_bar, full, empty, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles, start_n,
              seqlen_q, seqlen_k, qk_scale, sm_scale, W: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PREFETCH_S: gl.constexpr,
              DQ_WRITER: gl.constexpr, DS_FIRST: gl.constexpr, SCALED_P: gl.constexpr,
              DQ_FRAGMENTS: gl.constexpr, MASK_LOOP: gl.constexpr, DQ_FIRST: gl.constexpr,
              FREE_EARLY: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    SUB: gl.constexpr = dk_desc.block_type.shape[2]
    dtype: gl.constexpr = dk_desc.dtype
    # This consumer's half of the tile's dQ: a (DQR × COLS) block at rows r0, columns c0; it leaves in NB boxes
    # of DQR × DQC (DQ_FRAGMENTS: a 64 × 64 block in one box).
    DQR: gl.constexpr = 64 if DQ_FRAGMENTS else dq_desc.block_type.shape[-2]
    DQC: gl.constexpr = 64 if DQ_FRAGMENTS else dq_desc.block_type.shape[-1]
    SPLIT_ROWS: gl.constexpr = BLOCK_M == 2 * DQR
    COLS: gl.constexpr = HEAD_DIM if SPLIT_ROWS else HEAD_DIM // 2
    r0: gl.constexpr = W * DQR if SPLIT_ROWS else 0
    c0: gl.constexpr = 0 if SPLIT_ROWS else W * COLS
    NB: gl.constexpr = COLS // DQC
    GROUPS: gl.constexpr = 1 if DQ_FRAGMENTS else NB   # bulk groups a consumer issues per tile
    # Sᵀ, dPᵀ: (keys × queries) accumulators; dK, dV: (keys × D); Pᵀ and dSᵀ enter the dV, dK products from
    # registers.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_st: gl.constexpr = gl.SliceLayout(0, st_layout)
    k = k_smem.index(W).reshape([SUB, HEAD_DIM])
    v = v_smem.index(W).reshape([SUB, HEAD_DIM])
    k0 = k_smem.index(0).reshape([SUB, HEAD_DIM])
    k1 = k_smem.index(1).reshape([SUB, HEAD_DIM])
    key0 = start_n + W * SUB
    offs_n = key0 + gl.arange(0, SUB, layout=gl.SliceLayout(1, st_layout))
    causal_offset = seqlen_k - seqlen_q
    ragged = key0 + SUB > seqlen_k
    # The mask as one compare per element: key n is hidden from the query rows before first_row[n] (causal: row
    # i sees key j <= i + seqlen_k - seqlen_q), and from every row when n is past the last key.
    if CAUSAL:
        first_row = gl.where(offs_n < seqlen_k, offs_n - causal_offset, 1 << 30)
    else:
        first_row = gl.where(offs_n < seqlen_k, 0, 1 << 30)
    st_zero = gl.zeros([SUB, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([DQR, COLS], gl.float32, dq_layout)
    if not DQ_FRAGMENTS:   # the staging boxes, seen as one (DQR × COLS) block per consumer and buffer (the
        # 128-byte swizzle lays a wider block out as its 32-column boxes one after the other)
        block_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    dk = gl.zeros([SUB, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([SUB, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)
    if PREFETCH_S:   # tile 0's Sᵀ (a program without tiles computes one on stale shared memory and drops it)
        mbarrier.wait(full.index(0), 0, pred=n_tiles > 0)
        st = warpgroup_mma(k, q_smem.index(0).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), st_zero,
                           use_acc=False, is_async=True)
        st, _ = warpgroup_mma_wait(0, deps=(st, k))
    # MASK_LOOP: per query head, the tiles that need a mask come first in a loop of their own (phase 0), then the
    # rest in a loop without the mask's branch (phase 1). Otherwise one loop that tests each tile.
    if MASK_LOOP:
        n_mask = _masked_tiles(ragged, key0 + SUB - 1 - causal_offset, first_m, n_m, CAUSAL, BLOCK_M)
    for g in range(GROUP if MASK_LOOP else 1):
        for phase in gl.static_range(2 if MASK_LOOP else 1):
            if not MASK_LOOP:
                lo = 0
                hi = n_tiles
            elif phase == 0:
                lo = g * n_m
                hi = g * n_m + n_mask
            else:
                lo = g * n_m + n_mask
                hi = (g + 1) * n_m
            for t in range(lo, hi):
                slot = t % STAGES
                if MASK_LOOP:
                    h = hk * GROUP + g
                    start_m = (first_m + t - g * n_m) * BLOCK_M
                else:
                    h, start_m = _tile(t, hk, first_m, n_m, GROUP, BLOCK_M)
                q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
                do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
                if not PREFETCH_S:
                    mbarrier.wait(full.index(slot), (t // STAGES) & 1)
                    st = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                if not PREFETCH_S:
                    st, _, _ = warpgroup_mma_wait(1, deps=(st, k, q))
                lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(col_st)
                if MASK_LOOP:
                    masked: gl.constexpr = phase == 0
                else:
                    masked = ragged
                    if CAUSAL:   # query i sees key j <= i + seqlen_k - seqlen_q; only the tiles on the diagonal need it
                        masked = masked | (start_m + causal_offset < key0 + SUB - 1)
                if masked:   # the tile's column j is query row start_m + j
                    cols = gl.arange(0, BLOCK_M, layout=col_st)
                    st = gl.where(cols[None, :] >= (first_row - start_m)[:, None], st, float("-inf"))
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                if DS_FIRST:   # Pᵀ's registers stay free while dSᵀ forms (a running product holds its operand)
                    dpt, _, _ = warpgroup_mma_wait(0, deps=(dpt, v, do))
                    delta = delta_smem.index(slot).reshape([BLOCK_M]).load(col_st)
                    dst = (pt * (dpt - delta[None, :])).to(dtype)
                    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
                else:          # dV's product runs while dSᵀ forms
                    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do, dv, is_async=True)
                    dpt, _, _ = warpgroup_mma_wait(1, deps=(dpt, v, do))
                    delta = delta_smem.index(slot).reshape([BLOCK_M]).load(col_st)
                    dst = (pt * (dpt - delta[None, :])).to(dtype)
                ds_op = gl.convert_layout(dst, op_layout)
                if not DQ_FIRST:
                    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
                buf = (t % 2) * 2       # dSᵀ double-buffered: the other consumer may still read the previous tile's
                ds_smem.index(buf + W).store(dst)
                fence_async_shared()
                if FREE_EARLY:      # only the issuing thread has bulk groups; the pair barrier holds the rest
                    _bulk_wait_read(t, (DQ_BUFFERS - 1) * GROUPS)
                elif not DQ_WRITER:     # the reduces of the tile that staged in this tile's buffer have read it
                    tma.store_wait((DQ_BUFFERS - 1) * GROUPS)
                _pair_barrier(t)        # both halves of dSᵀ are in place (and every thread of ours passed store_wait)
                if not DQ_FIRST:
                    dv, _ = warpgroup_mma_wait(1, deps=(dv, do))   # dV done, dK still running
                if SPLIT_ROWS:   # dS rows r0.. (dSᵀ columns), each key half
                    ds0 = ds_smem.index(buf).slice(r0, DQR, dim=1).permute((1, 0))
                    ds1 = ds_smem.index(buf + 1).slice(r0, DQR, dim=1).permute((1, 0))
                else:
                    ds0 = ds_smem.index(buf).permute((1, 0))
                    ds1 = ds_smem.index(buf + 1).permute((1, 0))
                # dQ block = dS K[:, c0:c0 + COLS] over both key halves
                acc = warpgroup_mma(ds0, k0.slice(c0, COLS, dim=1), dq_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(ds1, k1.slice(c0, COLS, dim=1), acc, is_async=True)
                if DQ_FIRST:   # dK runs while dQ is staged and handed over; waited for before the slot is freed
                    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
                    acc, dv, _, _, _ = warpgroup_mma_wait(1, deps=(acc, dv, do, ds0, ds1))
                else:          # dK was issued first: it is done too
                    acc, dk, _, _, _ = warpgroup_mma_wait(0, deps=(acc, dk, q, ds0, ds1))
                if DQ_WRITER:   # the writer has read the last tile's dQ (a fresh barrier passes at once)
                    mbarrier.wait(dq_empty.index(W), (t & 1) ^ 1)
                box = (t % DQ_BUFFERS) * 2 + W   # this consumer's staging block of this tile
                if DQ_FRAGMENTS:   # in register order (FRAGMENT_BASES)
                    dq_block = stage_smem.index(box)._reinterpret(gl.float32, [DQR, COLS], _FRAGMENT_SMEM)
                else:
                    dq_block = stage_smem._reinterpret(gl.float32, [2 * DQ_BUFFERS, DQR, COLS],
                                                       block_layout).index(box)
                if SCALED_P:   # dSᵀ carries the scale
                    dq_block.store(acc)
                else:
                    dq_block.store(acc * sm_scale)
                if PREFETCH_S:   # the next tile's Sᵀ runs while dQ leaves (past the last tile: as in the prologue)
                    nslot = (t + 1) % STAGES
                    mbarrier.wait(full.index(nslot), ((t + 1) // STAGES) & 1, pred=t + 1 < n_tiles)
                    st = warpgroup_mma(k, q_smem.index(nslot).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), st_zero,
                                       use_acc=False, is_async=True)
                fence_async_shared()
                if DQ_WRITER:
                    mbarrier.arrive(dq_full.index(W))          # a warpgroup barrier, then one arrive: dQ is staged
                else:
                    _barrier()                                 # every warp's part of dQ is staged
                    if FREE_EARLY:   # dK, dV and dQ's products are done with Q, dO: the producer may refill the slot
                        mbarrier.arrive(empty.index(slot))
                    row = (b * heads + h)
                    if DQ_FRAGMENTS:   # block (row, tile, W) of the accumulator: 16 of its [*, 256] rows
                        block = (row * gl.cdiv(seqlen_q, BLOCK_M) + start_m // BLOCK_M) * 2 + W
                        _tma_reduce_add(dq_desc, [block * 16, 0], stage_smem.index(box))
                    else:
                        for c in gl.static_range(NB):
                            _tma_reduce_add(dq_desc, [row, start_m + r0, c0 + c * DQC], stage_smem.index(box * NB + c))
                if DQ_FIRST:   # dK has read Q (the next tile's Sᵀ, prefetched, may still run)
                    dk, _ = warpgroup_mma_wait(1 if PREFETCH_S else 0, deps=(dk, q))
                if not FREE_EARLY:
                    mbarrier.arrive(empty.index(slot))         # done with Q, dO, lse2, D of this tile
                if PREFETCH_S:
                    st, _ = warpgroup_mma_wait(0, deps=(st, k))
    # dK and dV leave through this consumer's K and V buffers, once the other consumer's dQ products are done
    # with this K half.
    _pair_barrier(n_tiles)
    if SCALED_P:   # dK's scale came with dSᵀ; Pᵀ carried one into dV
        k.store(dk.to(dtype))
        v.store((dv * (1.0 / sm_scale)).to(dtype))
    else:
        k.store((dk * sm_scale).to(dtype))
        v.store(dv.to(dtype))
    fence_async_shared()
    _barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, key0, 0], k_smem.index(W))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, key0, 0], v_smem.index(W))
    tma.store_wait(0)


@gluon.jit
def _dq_writer(dq_desc, stage_smem, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles, GROUP: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Config.dq_writer: per tile, each consumer's staged dQ block added into the accumulator by TMA, then the
    staging block handed back once the TMA engine has read it."""
    DQR: gl.constexpr = dq_desc.block_type.shape[1]
    DQC: gl.constexpr = dq_desc.block_type.shape[2]
    SPLIT_ROWS: gl.constexpr = BLOCK_M == 2 * DQR
    COLS: gl.constexpr = HEAD_DIM if SPLIT_ROWS else HEAD_DIM // 2
    NB: gl.constexpr = COLS // DQC
    for t in range(n_tiles):
        h, start_m = _tile(t, hk, first_m, n_m, GROUP, BLOCK_M)
        row = b * heads + h
        for W in gl.static_range(2):   # consumer W's block: rows W·DQR.. (split rows), else columns W·COLS..
            mbarrier.wait(dq_full.index(W), t & 1)
            for c in gl.static_range(NB):
                _tma_reduce_add(dq_desc, [row, start_m + W * DQR * SPLIT_ROWS, W * COLS * (1 - SPLIT_ROWS) + c * DQC],
                                stage_smem.index(W * NB + c))
            tma.store_wait(0)                          # read: the consumer may stage its next block
            mbarrier.arrive(dq_empty.index(W))


@gluon.jit(do_not_specialize=["heads", "seqlen_q", "seqlen_k"])
def gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                     heads, seqlen_q, seqlen_k, qk_scale, sm_scale,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PREFETCH_S: gl.constexpr,
                     BH_GROUP: gl.constexpr, DQ_WRITER: gl.constexpr, DS_FIRST: gl.constexpr,
                     SCALED_P: gl.constexpr, DQ_FRAGMENTS: gl.constexpr, MASK_LOOP: gl.constexpr,
                     DQ_FIRST: gl.constexpr, FREE_EARLY: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    SUB: gl.constexpr = k_desc.block_type.shape[2]
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    # Causal programs differ in length (key block 0 sees every query, the last block a few). Launched head by
    # head, a head's long programs run beside the next heads' short ones. With BH_GROUP, program i of the grid
    # takes key block i // BH_GROUP of (batch, head) i % BH_GROUP of its group: residents of similar length.
    if BH_GROUP > 0:
        n_blocks = gl.num_programs(0)
        pid = pid_n + pid_bh * n_blocks
        base = pid // (BH_GROUP * n_blocks) * BH_GROUP
        size = gl.minimum(gl.num_programs(1) - base, BH_GROUP)
        r = pid - base * n_blocks
        pid_n = r // size
        pid_bh = base + r % size
    heads_kv = heads // GROUP
    b = pid_bh // heads_kv
    hk = pid_bh % heads_kv
    start_n = pid_n * (2 * SUB)
    if CAUSAL:   # the first query block that sees a key of this block (bottom-right aligned mask)
        first_m = gl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M
    else:
        first_m = 0
    n_m = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - first_m, 0)
    n_tiles = GROUP * n_m
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, SUB, BLOCK_M], ds_layout)      # [tile parity · 2 + consumer]
    if DQ_FRAGMENTS:   # the tile's dQ: a box per consumer (and buffer)
        stage_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS] + dq_desc.block_type.shape,
                                               dq_desc.layout)
    else:              # the tile's dQ, in reduce boxes (per buffer)
        DQ_BOX: gl.constexpr = dq_desc.block_type.shape[1] * dq_desc.block_type.shape[2]
        stage_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS * BLOCK_M * HEAD_DIM // DQ_BOX]
                                               + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())    # Config.dq_writer: a
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # pair per consumer
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)       # one arrive per consumer
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()
    # (Tuples written inline: a tuple kept in a variable turns its constexpr ints into tensors.)
    if DQ_WRITER:
        gl.warp_specialize([
            (_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         stage_smem, kv_bar, full, empty, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles,
                         start_n, seqlen_q, seqlen_k, qk_scale, sm_scale, 0, GROUP, HEAD_DIM, BLOCK_M, STAGES,
                         CAUSAL, PREFETCH_S, DQ_WRITER, DS_FIRST, SCALED_P, DQ_FRAGMENTS, MASK_LOOP,
                         DQ_FIRST, FREE_EARLY, DQ_BUFFERS)),
            (_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         stage_smem, kv_bar, full, empty, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles,
                         start_n, seqlen_q, seqlen_k, qk_scale, sm_scale, 1, GROUP, HEAD_DIM, BLOCK_M, STAGES,
                         CAUSAL, PREFETCH_S, DQ_WRITER, DS_FIRST, SCALED_P, DQ_FRAGMENTS, MASK_LOOP,
                         DQ_FIRST, FREE_EARLY, DQ_BUFFERS)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                         lse_smem, delta_smem, kv_bar, full, empty, b, hk, heads, first_m, n_m, n_tiles, start_n,
                         GROUP, BLOCK_M, STAGES)),
            (_dq_writer, (dq_desc, stage_smem, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles, GROUP,
                          HEAD_DIM, BLOCK_M))],
            [4, 1, 1], [CONSUMER_REGS, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         stage_smem, kv_bar, full, empty, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles,
                         start_n, seqlen_q, seqlen_k, qk_scale, sm_scale, 0, GROUP, HEAD_DIM, BLOCK_M, STAGES,
                         CAUSAL, PREFETCH_S, DQ_WRITER, DS_FIRST, SCALED_P, DQ_FRAGMENTS, MASK_LOOP,
                         DQ_FIRST, FREE_EARLY, DQ_BUFFERS)),
            (_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         stage_smem, kv_bar, full, empty, dq_full, dq_empty, b, hk, heads, first_m, n_m, n_tiles,
                         start_n, seqlen_q, seqlen_k, qk_scale, sm_scale, 1, GROUP, HEAD_DIM, BLOCK_M, STAGES,
                         CAUSAL, PREFETCH_S, DQ_WRITER, DS_FIRST, SCALED_P, DQ_FRAGMENTS, MASK_LOOP,
                         DQ_FIRST, FREE_EARLY, DQ_BUFFERS)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                         lse_smem, delta_smem, kv_bar, full, empty, b, hk, heads, first_m, n_m, n_tiles, start_n,
                         GROUP, BLOCK_M, STAGES))],
            [4, 1], [CONSUMER_REGS, 24])


_launcher = FastLauncher(gluon_bwd_kernel)


# The statistics' and dQ's shared layouts (unswizzled rows, also dQ's box in register order with
# Config.dq_fragments; DQ_COLS fp32 = 128-byte rows, 128-byte swizzle), built once: at N <= 1k the host's time per
# call is the time of the call.
_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_DQ_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)


def _row_descriptor(x: torch.Tensor, block_m: int) -> TensorDescriptor:
    """A TMA descriptor over a (B·H, N) fp32 tensor of per-row statistics; tile [bh, row] is `block_m` rows."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_m], _ROW_LAYOUT)


def _stats(o, do, lse, heads, shift):
    """(lse2, D) as (B·H, N') fp32, N' = N rounded up to 4 so that a row is 16-byte aligned (TMA): notebook 07's
    preprocess kernel (D = rowsum(dO ∘ O); lse2 = lse·log2(e) − shift, +inf where no key is visible)."""
    b, _, nq, d = o.shape
    delta = torch.empty((b * heads, nq), dtype=torch.float32, device=o.device)
    lse2 = torch.empty_like(delta)
    head, (launcher, grid, tail, meta) = _preprocess(o, do, lse, delta, lse2, heads, shift)
    launcher[grid](*head, *tail, **meta)
    if nq % 4:
        lse2, delta = (F.pad(x, (0, 4 - nq % 4)) for x in (lse2, delta))
    return lse2, delta


def _preprocess(o, do, lse, delta, lse2, heads, shift: float) -> tuple:
    """The preprocess launch: (its leading arguments, (launcher, grid, trailing arguments, constexprs))."""
    b, _, nq, d = o.shape
    return (o, do, lse, delta, lse2), (tb._launch_preprocess, (triton.cdiv(nq, 64), b * heads),
                                       (*o.stride(), *do.stride(), heads, nq, d, shift),
                                       dict(BLOCK_M=64, BLOCK_D=d, ACC=triton.language.float32))


_KINDS = launch.kind_cache()   # _call_key -> launch.Kind of (shape, scale, config): the MAX_KINDS used most recently


def _lse2_shift(scale: float, config: Config) -> float:
    """What the statistics kernel takes off lse₂: log2(scale) where the kernel computes scale·P (Config.scaled_p)."""
    return math.log2(scale) if config.scaled_p else 0.0


def _call_key(do, q, k, v, o, lse, causal, sm_scale, config):
    """What the checks, the config and the launches depend on (utils.tiled.fast.launch.kind_key), for CUDA tensors,
    options of the expected types and Nq a multiple of 4 (otherwise the statistics are padded between the two launches);
    None otherwise (such a call is checked every time)."""
    if not (type(causal) is bool and type(sm_scale) in (float, int, type(None))
            and type(config) in (Config, type(None)) and type(q) is torch.Tensor and q.dim() == 4
            and q.shape[2] % 4 == 0):
        return None
    return launch.kind_key((do, q, k, v, o, lse), (causal, sm_scale, config))


def _choose(do, q, k, v, o, lse, causal, sm_scale, config) -> tuple:
    """flash_attention_backward's checks (a ValueError or TypeError naming the argument) and its
    (shape, scale, config)."""
    shape, scale = check_backward_inputs(do, q, k, v, o, lse, causal=causal, sm_scale=sm_scale,
                                         head_dims=fg.HEAD_DIMS, dtypes=fg.DTYPES)
    check_device("q", q, "cuda")
    fg.check_sm90(q, "utils.explicit.backward.flash_attention_backward")
    return shape, scale, (pick_config(shape.head_dim, causal, k.shape[2]) if config is None
                          else check_config(config, shape.head_dim))


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, sm_scale=None,
                                   config: Config | None = None):
    """(dq, dk, dv) of softmax(Q Kᵀ · sm_scale) V for the forward's o and lse (natural log, (B, H, Nq)).

    fp16/bf16, head dim 64 or 128, GQA, Nq != Nk (bottom-right causal mask), on an sm_90 GPU. `config`: tiles
    (default: pick_config's). As the Triton backward (utils.tiled.fast.backward), the checks, the config and the
    launches (statistics, kernel, and with Config.dq_fragments the un-permute) are kept per kind of call
    (utils.tiled.fast.launch.Kind), so a later call of a kind passes only its tensors."""
    key = _call_key(do, q, k, v, o, lse, causal, sm_scale, config)
    kind = launch.kind_of(_KINDS, key, lambda: _choose(do, q, k, v, o, lse, causal, sm_scale, config))
    (b, h, _, nq, _, d), scale, config = kind.choices
    q, k, v, do = (fg._tma_ready(x) for x in (q, k, v, do))
    lse = lse.float().contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = _dq_accumulator(b, h, nq, d, config, q.device)
    if key is None:   # checked every time; the statistics may need padding between the launches
        lse2, delta = _stats(o, do, lse, h, _lse2_shift(scale, config))
        _launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, causal, scale, config)
        if not config.dq_fragments:
            return dq_acc.view(b, h, nq, d).to(q.dtype), dk, dv
        dq = torch.empty_like(q)
        launcher, grid, tail, meta = _unpermute(dq, config)
        launcher[grid](dq_acc, dq, *tail, **meta)
        return dq, dk, dv
    else:
        delta = torch.empty((b * h, nq), dtype=torch.float32, device=q.device)
        lse2 = torch.empty_like(delta)
        pre_head, pre = _preprocess(o, do, lse, delta, lse2, h, _lse2_shift(scale, config))
        tensors = (q, k, v, do, dk, dv, dq_acc, lse2, delta)
        head = kind.descriptors(tensors, lambda: _descriptors(*tensors, config))   # made once, then copied
        if not config.dq_fragments:
            kind.launch((pre_head, head), lambda: (pre, _main(q, k, causal, scale, config)), keep=True)
            return dq_acc.view(b, h, nq, d).to(q.dtype), dk, dv
        dq = torch.empty_like(q)
        kind.launch((pre_head, head, (dq_acc, dq)),
                    lambda: (pre, _main(q, k, causal, scale, config), _unpermute(dq, config)), keep=True)
    return dq, dk, dv


def _dq_accumulator(b: int, h: int, nq: int, d: int, config: Config, device) -> torch.Tensor:
    """dQ's fp32 accumulator, zeroed: (B·H, Nq, D) by rows, or with Config.dq_fragments a [16, 256] box per
    consumer and tile (a 64 × 64 block in register order: _dq_unpermute)."""
    if config.dq_fragments:
        return torch.zeros((b * h * triton.cdiv(nq, config.block_m) * 2 * 16, 256), dtype=torch.float32,
                           device=device)
    return torch.zeros((b * h, nq, d), dtype=torch.float32, device=device)


@triton.jit
def _dq_unpermute(ACC, DQ, s_b, s_h, s_m, s_d, H, N_Q, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ's rows of tile program_id(0), head program_id(1), cast to DQ's dtype, from the accumulator that
    Config.dq_fragments fills: each consumer's 64 × 64 block is a run of 4096 floats laid out by FRAGMENT_BASES,
    element (r, c) at k + 2i + 4(lane % 4) + 16(lane / 4) + 128 warp + 512 j for r = 16 warp + 8i + lane / 4 and
    c = 8j + 2(lane % 4) + k. A program reads its tile's two blocks and writes rows."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, HEAD_DIM)[None, :]
    if BLOCK_M == 128:   # consumer w: rows 64w.. of the tile, all 64 columns
        w = rows // 64
        r = rows % 64
        c = cols
    else:                # consumer w: columns 64w.. of the tile's 64 rows
        w = cols // 64
        r = rows
        c = cols % 64
    offset = (c % 2) + 2 * ((r // 8) % 2) + 4 * ((c // 2) % 4) + 16 * (r % 8) + 128 * (r // 16) + 512 * (c // 8)
    block = ((bh * tl.num_programs(0) + m) * 2 + w).to(tl.int64)
    x = tl.load(ACC + block * 4096 + offset)
    row = m * BLOCK_M + rows
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    tl.store(DQ + b * s_b + h * s_h + row * s_m + cols * s_d, x.to(DQ.dtype.element_ty), mask=row < N_Q)


_unpermute_launcher = FastLauncher(_dq_unpermute)


def _unpermute(dq: torch.Tensor, config: Config) -> tuple:
    """The launch of _dq_unpermute into `dq` (B, H, Nq, D) but its two leading arguments (accumulator, dq)."""
    b, h, nq, d = dq.shape
    return (_unpermute_launcher, (triton.cdiv(nq, config.block_m), b * h), (*dq.stride(), h, nq),
            dict(BLOCK_M=config.block_m, HEAD_DIM=d, num_warps=8))


def _descriptors(q, k, v, do, dk, dv, dq_acc, lse2, delta, config: Config) -> tuple:
    """The kernel's nine descriptor arguments, its leading ones."""
    if config.dq_fragments:
        dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [16, 256], _ROW_LAYOUT)
    else:
        dq_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, DQ_ROWS, DQ_COLS],
                                   _DQ_LAYOUT)
    return (fg._descriptor(q, config.block_m), fg._descriptor(k, SUB_N), fg._descriptor(v, SUB_N),
            fg._descriptor(do, config.block_m), fg._descriptor(dk, SUB_N), fg._descriptor(dv, SUB_N),
            dq_desc, _row_descriptor(lse2, config.block_m), _row_descriptor(delta, config.block_m))


def _main(q, k, causal: bool, scale: float, config: Config) -> tuple:
    """The kernel's launch on checked inputs but its descriptors: (launcher, grid, trailing arguments,
    constexprs and options)."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    return (_launcher, (triton.cdiv(nk, BLOCK_N), b * hk), (h, nq, nk, scale * fg.LOG2E, scale),
            dict(GROUP=h // hk, HEAD_DIM=d, BLOCK_M=config.block_m, STAGES=config.stages, CAUSAL=causal,
                 CONSUMER_REGS=config.consumer_regs, PREFETCH_S=config.prefetch_s, BH_GROUP=config.bh_group,
                 DQ_WRITER=config.dq_writer, DS_FIRST=config.ds_first, SCALED_P=config.scaled_p,
                 DQ_FRAGMENTS=config.dq_fragments, MASK_LOOP=config.mask_loop, DQ_FIRST=config.dq_first,
                 FREE_EARLY=config.free_early, DQ_BUFFERS=config.dq_buffers, num_warps=4))


def _launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, causal: bool, scale: float, config: Config) -> None:
    """The kernel on checked inputs (utils.course.cross_compile captures this launch to compile it on a CPU)."""
    launcher, grid, tail, meta = _main(q, k, causal, scale, config)
    launcher[grid](*_descriptors(q, k, v, do, dk, dv, dq_acc, lse2, delta, config), *tail, **meta)


def differentiable(forward, q, k, v, causal, sm_scale):
    """O = forward(q, k, v, ...)[0], with this module's backward (KernelPair) when a gradient is wanted."""
    if wants_grad(q, k, v):
        return KernelPair.apply(q, k, v, causal, sm_scale, forward, flash_attention_backward)
    return forward(q, k, v, causal=causal, sm_scale=sm_scale)[0]


def flash_attention_gluon(q, k, v, *, causal=False, sm_scale=None):
    """The registry's "gluon": the output of utils.explicit.forward.flash_attention_forward, differentiable
    (the backward is this module's kernel)."""
    return differentiable(fg.flash_attention_forward, q, k, v, causal, sm_scale)


def flash_attention_gluon_ws(q, k, v, *, causal=False, sm_scale=None):
    """The registry's "gluon_ws": the output of utils.explicit.forward_ws.flash_attention_forward,
    differentiable (the backward is this module's kernel)."""
    return differentiable(fws.flash_attention_forward, q, k, v, causal, sm_scale)


def flash_attention_gluon_ws3(q, k, v, *, causal=False, sm_scale=None):
    """The registry's "gluon_ws3" (head dim 64): the output of utils.explicit.forward_ws3.flash_attention_forward,
    differentiable (the backward is this module's kernel)."""
    return differentiable(fws3.flash_attention_forward, q, k, v, causal, sm_scale)


# The synchronisation as data: per tile t, the steps of the producer and of each consumer (both run the same
# steps, each with its own 64 keys). `replay` executes such a description; `kernel_protocol` is the kernel's.
#   ("wait empty", slot, parity)   producer: mbarrier.wait on the slot's empty barrier (2 arrives per phase)
#   ("copy", slot)                 producer: TMA copy of tile t's Q, dO, lse2, D into the slot, landing later on
#                                  the slot's full barrier
#   ("wait full", slot, parity)    consumer: mbarrier.wait on the slot's full barrier
#   ("products", slot, buf)        consumer: Sᵀ, dPᵀ, dV, dK from the slot's tile; its dSᵀ into dSᵀ buffer buf
#   ("store_wait"[, n])            consumer: wait until the TMA engine has read all but its last n staged dQs
#                                  (n = 0 when left out)
#   ("meet",)                      consumer: named barrier 15 with the other consumer
#   ("dq", slot, buf[, stage])     consumer: dQ = dS K from both halves of dSᵀ buffer buf (dK's product still
#                                  reads the slot's Q); dQ staged in staging buffer `stage` (0 when left out),
#                                  its reduce-adds issued
#   ("arrive empty", slot)         consumer: mbarrier.arrive on the slot's empty barrier (Config.free_early
#                                  arrives between dQ's staging and the reduce-adds' issue: the same order of steps)
# With Config.dq_writer the consumer's "dq" only stages dQ, and a writer warp issues the reduce-adds:
#   ("wait dq_empty", parity)      consumer: mbarrier.wait on its dq_empty barrier (the writer has read its dQ)
#   ("arrive dq_full",)            consumer: its staged dQ handed to the writer
#   ("wait dq_full", w, parity)    writer: mbarrier.wait on consumer w's dq_full barrier
#   ("reduce", w)                  writer: the reduce-adds of consumer w's staged dQ, issued
#   ("store_wait",)                writer: wait until the TMA engine has read every staged dQ it issued
#   ("arrive dq_empty", w)         writer: consumer w may stage again
STEPS = {"producer": ("wait empty", "copy"),
         "consumer": ("wait full", "products", "store_wait", "meet", "dq", "arrive empty", "wait dq_empty",
                      "arrive dq_full"),
         "writer": ("wait dq_full", "reduce", "store_wait", "arrive dq_empty")}


def _kernel_tile(t: int, n_tiles: int, stages: int, prefetch_s: bool, ds_buffers: int, wait_reduces: bool,
                 dq_writer: bool = False, writer_waits: bool = True, dq_buffers: int = 1, pending: int = 0):
    """(producer steps, consumer steps, writer steps) of tile t in the kernel's protocol (see kernel_protocol)."""
    slot, lap, buf = t % stages, t // stages, t % ds_buffers
    producer = [("wait empty", slot, (lap + 1) % 2), ("copy", slot)]
    consumer = [] if prefetch_s and t > 0 else [("wait full", slot, lap % 2)]   # prefetch: tile t-1 waited
    store_wait = ("store_wait", pending) if pending else ("store_wait",)
    consumer += [("products", slot, buf)] + [store_wait] * (wait_reduces and not dq_writer)
    consumer += [("meet",)] + [("wait dq_empty", (t + 1) % 2)] * (dq_writer and writer_waits)
    consumer += [("dq", slot, buf, t % dq_buffers) if dq_buffers > 1 else ("dq", slot, buf)]
    if prefetch_s and t + 1 < n_tiles:        # the next tile's Sᵀ is issued before this slot is freed
        consumer.append(("wait full", (t + 1) % stages, (t + 1) // stages % 2))
    consumer += [("arrive dq_full",)] * dq_writer
    writer = [step for w in (0, 1) for step in (("wait dq_full", w, t % 2), ("reduce", w), ("store_wait",),
                                                ("arrive dq_empty", w))] if dq_writer else []
    return producer, consumer + [("arrive empty", slot)], writer


def kernel_protocol(*, prefetch_s: bool = False, dq_writer: bool = False, dq_buffers: int = 1,
                    ds_buffers: int = 2, wait_reduces: bool = True, writer_waits: bool = True,
                    pending: int | None = None):
    """The kernel's synchronisation as a description for `replay`: a function (t, n_tiles, stages) ->
    (producer steps, consumer steps, writer steps) of tile t. The keyword arguments after `dq_buffers` break its
    rules on purpose (see replay_protocol)."""
    return functools.partial(_kernel_tile, prefetch_s=prefetch_s, ds_buffers=ds_buffers, wait_reduces=wait_reduces,
                             dq_writer=dq_writer, writer_waits=writer_waits, dq_buffers=dq_buffers,
                             pending=dq_buffers - 1 if pending is None else pending)


def _validate_step(step, who: str, t: int, stages: int):
    where = f"the {who}'s steps for tile {t}"
    if not isinstance(step, tuple) or not step or step[0] not in STEPS[who]:
        raise AssertionError(f"{where}: {step!r} is not a {who} step (its steps start with one of "
                             f"{', '.join(repr(s) for s in STEPS[who])})")
    # ("dq", slot, buf) stages in buffer 0 and ("store_wait",) leaves nothing unread: the one-buffer forms
    arity = {"wait empty": (3,), "wait full": (3,), "copy": (2,), "products": (3,), "dq": (3, 4),
             "arrive empty": (2,), "wait dq_empty": (2,), "wait dq_full": (3,), "reduce": (2,),
             "arrive dq_empty": (2,), "store_wait": (1, 2)}.get(step[0], (1,))
    if len(step) not in arity or not all(isinstance(x, int) for x in step[1:]):
        takes = " or ".join(f"{a - 1} int{'s' * (a > 2)}" for a in arity)
        raise AssertionError(f"{where}: {step!r} takes {takes} after its name")
    if step[0] in ("wait empty", "wait full", "copy", "products", "dq", "arrive empty") and not 0 <= step[1] < stages:
        raise AssertionError(f"{where}: {step!r} names slot {step[1]}; the ring has slots 0 to {stages - 1}")
    if step[0] in ("wait empty", "wait full", "wait dq_full") and step[2] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: a parity is 0 or 1")
    if step[0] == "wait dq_empty" and step[1] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: a parity is 0 or 1")
    if step[0] in ("wait dq_full", "reduce", "arrive dq_empty") and step[1] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: the consumers are 0 and 1")
    if step[0] in ("products", "dq") and step[2] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: the kernel has dSᵀ buffers 0 and 1 per consumer")
    if step[0] == "dq" and len(step) == 4 and step[3] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: the kernel has dQ staging buffers 0 and 1 per consumer")
    if step[0] == "store_wait" and len(step) == 2 and step[1] not in (0, 1):
        raise AssertionError(f"{where}: {step!r}: at most one staged dQ is left unread (two buffers)")


def replay(protocol, n_tiles: int, stages: int, seed: int = 0, *, last_meeting: bool = True,
           p_event: float = 0.4) -> None:
    """Replay `protocol` (a function (t, n_tiles, stages) -> (producer steps, consumer steps[, writer steps]), the
    vocabulary of STEPS) in one random interleaving of the producer, the two consumers, the dQ writer (when it has
    steps), the TMA copies landing and the TMA engine reading the staged dQ tiles. Shared buffers hold the tile
    they were last written for; every read checks it sees its own tile. After the loop each consumer meets the
    other (unless not `last_meeting`), then writes dK over its K half. `p_event`: how often an asynchronous event
    is taken while a partition can move (lower: the TMA engine lags further behind). Raises AssertionError naming
    the tile, the slot or buffer and the partition on a stale read, an early overwrite or a hang."""
    rng = random.Random(seed)
    steps = []
    for t in range(n_tiles):
        producer, consumer, *writer = protocol(t, n_tiles, stages)
        producer, consumer, writer = list(producer), list(consumer), list(writer[0]) if writer else []
        for who, part in (("producer", producer), ("consumer", consumer), ("writer", writer)):
            for step in part:
                _validate_step(step, who, t, stages)
        steps.append((producer, consumer, writer))
    with_writer = any(part[2] for part in steps)
    full, released, holds = [0] * stages, [0] * stages, [None] * stages   # the Q/dO/lse2/D ring
    ds = {}                                                              # (buffer, consumer) -> tile of its dSᵀ
    staged, reading = [{}, {}], [[], []]          # per consumer: staging buffer -> tile; (buffer, tile)s unread
    k_half = ["K", "K"]                                                  # K halves: "K", then "dK"
    met = [0, 0]                                                         # meetings reached per consumer
    dq_full, dq_empty = [0, 0], [0, 0]                                   # the writer's barriers' completions
    landing = []

    def producer():
        for t in range(n_tiles):
            for step in steps[t][0]:
                s = step[1]
                if step[0] == "wait empty":
                    while (released[s] // 2) % 2 == step[2]:
                        yield f"the producer waits for slot {s}'s empty barrier, parity {step[2]} (tile {t})"
                else:
                    assert released[s] >= 2 * (t // stages), (
                        f"the producer, tile {t}: refills slot {s} while tile {t - stages} is still read (the "
                        f"consumers released it {released[s] - 2 * (t // stages - 1)} of 2 times)")
                    landing.append((s, t))
                    yield None

    def meet(w, what):
        met[w] += 1
        while met[1 - w] < met[w]:
            yield f"consumer {w} waits for the other at {what}"

    def read_slot(w, t, s):
        if holds[s] is None or holds[s] < t:
            raise AssertionError(f"consumer {w}, tile {t}: reads slot {s} before tile {t}'s copy landed (it holds "
                                 f"{'nothing yet' if holds[s] is None else f'tile {holds[s]}'})")
        assert holds[s] == t, (f"consumer {w}, tile {t}: reads slot {s}, which already holds tile {holds[s]}: "
                               f"refilled while tile {t} was still read")

    def consumer(w):
        for t in range(n_tiles):
            for step in steps[t][1]:
                kind = step[0]
                if kind == "wait full":
                    s, parity = step[1:]
                    while full[s] % 2 == parity:
                        yield f"consumer {w} waits for slot {s}'s full barrier, parity {parity} (tile {t})"
                elif kind == "products":
                    read_slot(w, t, step[1])
                    ds[step[2], w] = t
                    yield None
                elif kind == "store_wait":
                    while len(reading[w]) > (step[1] if len(step) > 1 else 0):
                        yield f"consumer {w} waits for the TMA to read its staged dQ (tile {t})"
                elif kind == "meet":
                    yield from meet(w, f"tile {t}")
                elif kind == "dq":
                    s, buf, stage = (*step[1:], 0)[:3]
                    for _ in range(2):                                   # two chained products: both K halves
                        read_slot(w, t, s)
                        for half in (0, 1):
                            assert ds.get((buf, half)) == t, (
                                f"consumer {w}, tile {t}: dSᵀ buffer {buf} of consumer {half} holds tile "
                                f"{ds.get((buf, half), 'nothing yet')}")
                            assert k_half[half] == "K", f"consumer {w}, tile {t}: K half {half} already holds dK"
                        yield None
                    old = staged[w].get(stage)
                    assert (stage, old) not in reading[w], (f"consumer {w}, tile {t}: staged dQ of tile {old} "
                                                            f"overwritten before the TMA read it (buffer {stage})")
                    staged[w][stage] = t
                    if not with_writer:
                        reading[w].append((stage, t))                    # the reduce-adds, issued
                elif kind == "wait dq_empty":
                    while dq_empty[w] % 2 == step[1]:
                        yield f"consumer {w} waits for the writer to read its dQ, parity {step[1]} (tile {t})"
                elif kind == "arrive dq_full":
                    dq_full[w] += 1
                    yield None
                else:   # arrive empty
                    released[step[1]] += 1
                    yield None
        if last_meeting:
            yield from meet(w, "the end")
        k_half[w] = "dK"
        yield None

    def writer():
        for t in range(n_tiles):
            for step in steps[t][2]:
                kind = step[0]
                if kind == "wait dq_full":
                    w, parity = step[1:]
                    while dq_full[w] % 2 == parity:
                        yield f"the writer waits for consumer {w}'s dQ, parity {parity} (tile {t})"
                elif kind == "reduce":
                    w = step[1]
                    assert staged[w].get(0) == t, (f"the writer, tile {t}: consumer {w}'s staged dQ holds tile "
                                                   f"{staged[w].get(0)}")
                    reading[w].append((0, t))
                    yield None
                elif kind == "store_wait":
                    while reading[0] or reading[1]:
                        yield f"the writer waits for the TMA to read the staged dQ (tile {t})"
                else:   # arrive dq_empty
                    dq_empty[step[1]] += 1
                    yield None

    def land():
        s, t = landing.pop(rng.randrange(len(landing)))
        holds[s], full[s] = t, full[s] + 1

    def read(w):   # the TMA engine reads consumer w's oldest staged dQ
        stage, t = reading[w].pop(0)
        assert staged[w][stage] == t, (f"the TMA reads consumer {w}'s dQ of tile {t} in buffer {stage}, finds tile "
                                       f"{staged[w][stage]}")

    def events():
        return ([land] if landing else []) + [lambda w=w: read(w) for w in (0, 1) if reading[w]]

    fg.interleave([producer(), consumer(0), consumer(1)] + [writer()] * with_writer, events, rng,
                  f"hang with {n_tiles} tiles and {stages} stages", p_event=p_event)
    for s in range(stages):
        uses = len(range(s, n_tiles, stages))
        assert released[s] == 2 * uses, (f"slot {s} was released {released[s]} times for {uses} tile(s): each "
                                         "consumer releases each tile once")


def replay_protocol(n_tiles: int, stages: int, seed: int = 0, *, prefetch_s: bool = False, dq_writer: bool = False,
                    dq_buffers: int = 1, ds_buffers: int = 2, wait_reduces: bool = True, writer_waits: bool = True,
                    last_meeting: bool = True, pending: int | None = None, p_event: float = 0.4) -> None:
    """Replay the kernel's synchronisation (kernel_protocol) in one random interleaving (see `replay`). With
    `prefetch_s` the consumers wait for tile t+1 (whose Sᵀ they issue early) before they free tile t's slot, as
    the kernel does with Config.prefetch_s: with one stage that waits forever, which check_config forbids. With
    `dq_buffers` = 2 each consumer stages dQ in two buffers by turns (Config.dq_buffers).

    The kernel's rules, which the keyword arguments break on purpose (the tests plant each bug):
    `ds_buffers` = 2: dSᵀ alternates between two slots per consumer, so a consumer writing tile t+1's dSᵀ
    never overwrites tile t's while the other consumer's dQ products still read it; `wait_reduces`: before the
    consumers meet, each waits until the TMA engine has read its previous staged dQ (tma.store_wait(0)), or
    with two buffers the one before (`pending`: how many staged dQs it leaves unread, dq_buffers − 1);
    `last_meeting`: after the loop the consumers meet once more before dK overwrites the K half that the
    other consumer's dQ products read; `writer_waits` (with `dq_writer`): a consumer stages its next dQ only
    once the writer has seen the TMA read the last one. Raises AssertionError naming the tile and the buffer on
    a stale read, an early overwrite or a hang."""
    replay(kernel_protocol(prefetch_s=prefetch_s, dq_writer=dq_writer, dq_buffers=dq_buffers, ds_buffers=ds_buffers,
                           wait_reduces=wait_reduces, writer_waits=writer_waits, pending=pending),
           n_tiles, stages, seed, last_meeting=last_meeting, p_event=p_event)
