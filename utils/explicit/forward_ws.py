"""FlashAttention-3's warp specialisation, written in Gluon (notebook 05b section 10; issue 22).

The forward of utils.explicit.forward keeps one warpgroup per program: with two (a 128-row tile), its CTA-wide barrier,
which frees the K/V ring's slots, made both warpgroups step together, and at head dim 128 the 64-row tile
reads every K/V tile for only 64 queries. This kernel keeps the 128-row tile and drops the barrier by giving
each job its own warps (`gl.warp_specialize`):

    producer (1 warp)        for each key tile t: wait until slot t % STAGES is empty, then TMA-copy K_t, V_t
    consumers (2 x 4 warps)  each 64 of the 128 query rows: forward.py's loop (S_j, P_{j-1}V_{j-1}, wait(1),
                             softmax, wait(0)), then arrive on the "empty" mbarriers of the slots it has read

A slot has two mbarriers. "full" completes a phase when its copy lands (the consumers wait on it, as in
forward.py); "empty" completes a phase when both consumers have arrived (count 2), and the producer waits on
it before refilling. Nothing makes the two consumers wait for each other, so the SM's schedulers are free to run
one's softmax while the other's products keep the tensor cores busy. The producer needs few registers: it gives
them to the consumers (`setmaxnreg`, the worker partitions' register counts).

Same conventions, limits and validation as utils.explicit.forward (fp16/bf16, head dims 64 and 128, sm_90 only, GQA,
ragged and unequal lengths with bottom-right causal alignment); measured in images/05b_gluon_ws_h200.json.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from utils.explicit import forward as fg
from utils.tiled.fast.launch import FastLauncher

SUB_M = 64                  # query rows per consumer warpgroup (the Q and O descriptors' tile)
BLOCK_M = 2 * SUB_M         # query rows per program


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
              b, h, h_kv, start_m, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_T: gl.constexpr = False,
              CONSUMERS: gl.constexpr = 2):
    """One warp: the consumers' Q tiles, then every K and V tile, each into a slot once every consumer left it.
    V_T: v_desc is over Vᵀ (batch, heads, head_dim, seq), as the FP8 kernel (utils.fp8.forward_ws) reads it.
    CONSUMERS: warpgroups of 64 query rows (three in utils.explicit.forward_ws3)."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[2]
    for w in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + w * SUB_M, 0], q_bar.index(w), q_smem.index(w))
    for t in range(n_tiles):
        slot = t % STAGES
        free = ((t // STAGES) & 1) ^ 1     # use u of a slot waits for u releases; a fresh slot passes at once
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, t * BLOCK_N, 0], k_full.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
        if V_T:
            tma.async_copy_global_to_shared(v_desc, [b, h_kv, 0, t * BLOCK_N], v_full.index(slot),
                                            v_smem.index(slot))
        else:
            tma.async_copy_global_to_shared(v_desc, [b, h_kv, t * BLOCK_N, 0], v_full.index(slot),
                                            v_smem.index(slot))


# Ping-pong's named barriers, one per consumer warpgroup (13 + WG; Triton's partitions use the low ids): the
# instruction that waits for a consumer's turn and the one that gives it its turn, each over 256 threads.
_TURN_WAIT = gl.constexpr(tuple(f"bar.sync {13 + wg}, 256; mov.b32 $0, 0;" for wg in range(3)))
_TURN_GIVE = gl.constexpr(tuple(f"bar.arrive {13 + wg}, 256; mov.b32 $0, 0;" for wg in range(3)))


@gluon.jit
def _turn_wait(x, WG: gl.constexpr):
    """Ping-pong (FlashAttention-3's scheduler barrier): wait on named barrier 13 + WG, over this consumer
    warpgroup and the one before it (256 threads), until that one has issued its products. `x` only gives the
    inline assembly a (scalar) operand."""
    gl.inline_asm_elementwise(_TURN_WAIT[WG], "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _turn_pass(x, WG: gl.constexpr, CONSUMERS: gl.constexpr):
    """Ping-pong: this consumer has issued its products; the next one (round robin) may issue its own."""
    gl.inline_asm_elementwise(_TURN_GIVE[(WG + 1) % CONSUMERS], "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _consumer_loop(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i, p, qk_scale, offs_m,
                   seqlen_k, causal_offset, n_unmasked, n_tiles, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, dtype: gl.constexpr, col_s: gl.constexpr,
                   row_o: gl.constexpr, p_layout: gl.constexpr, WG: gl.constexpr = 0, PINGPONG: gl.constexpr = False,
                   CONSUMERS: gl.constexpr = 2):
    """Key tiles 1 to n_tiles - 1 of one consumer: forward.py's _overlapped_loop, with an arrive on a slot's
    "empty" barrier once the product reading it has finished. Returns the new (acc, m_i, l_i, p). PINGPONG: the
    CONSUMERS warpgroups issue their products in turns, round robin (the last opens the first's first turn and
    does not pass on its own last one, so each barrier completes as often as it is waited on)."""
    if PINGPONG:
        if WG == CONSUMERS - 1:
            if n_tiles > 1:
                _turn_pass(n_tiles, WG, CONSUMERS)
    for j in range(1, n_tiles):
        k = fg._arrived(k_smem, k_full, j, BLOCK_N, HEAD_DIM, STAGES)
        if PINGPONG:
            v = fg._arrived(v_smem, v_full, j - 1, BLOCK_N, HEAD_DIM, STAGES)
            _turn_wait(j, WG)
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v, acc, is_async=True)
            if WG == CONSUMERS - 1:
                if j < n_tiles - 1:
                    _turn_pass(j, WG, CONSUMERS)
            else:
                _turn_pass(j, WG, CONSUMERS)
        else:
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            v = fg._arrived(v_smem, v_full, j - 1, BLOCK_N, HEAD_DIM, STAGES)
            acc = warpgroup_mma(p, v, acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(1, deps=(s, q, k))
        mbarrier.arrive(k_empty.index(j % STAGES))            # this warpgroup is done with K_j
        p32, alpha, l_i, m_i = fg._softmax(s, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, seqlen_k, causal_offset,
                                           j >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v))
        mbarrier.arrive(v_empty.index((j - 1) % STAGES))      # ... and with V_{j-1}
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(p32.to(dtype), p_layout)
    return acc, m_i, l_i, p


@gluon.jit
def _consumer(o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
              b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, PINGPONG: gl.constexpr = False, CONSUMERS: gl.constexpr = 2):
    """One warpgroup: rows [start_m + WG*64, +64) through forward.py's loop; an arrive frees each slot read.
    PINGPONG: the CONSUMERS warpgroups take turns to issue their products (_consumer_loop)."""
    SUB_M: gl.constexpr = o_desc.block_type.shape[2]
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row0 = start_m + WG * SUB_M
    causal_offset = seqlen_k - seqlen_q
    offs_m = row0 + gl.arange(0, SUB_M, layout=row_s)
    q = q_smem.index(WG).reshape([SUB_M, HEAD_DIM])
    mbarrier.wait(q_bar.index(WG), 0)

    s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([SUB_M], gl.float32, row_s)
    p = gl.zeros([SUB_M, BLOCK_N], dtype, p_layout)
    if n_tiles > 0:
        k = fg._arrived(k_smem, k_full, 0, BLOCK_N, HEAD_DIM, STAGES)
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=(s, q, k))
        mbarrier.arrive(k_empty.index(0))
        p32, alpha, l_i, m_i = fg._softmax(s, m_i, l_i, qk_scale, offs_m, 0, seqlen_k, causal_offset,
                                           0 >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        p = gl.convert_layout(p32.to(dtype), p_layout)
    acc, m_i, l_i, p = _consumer_loop(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, s_zero, acc, m_i, l_i, p,
                                      qk_scale, offs_m, seqlen_k, causal_offset, n_unmasked, n_tiles, HEAD_DIM,
                                      BLOCK_N, STAGES, CAUSAL, dtype, col_s, row_o, p_layout, WG, PINGPONG,
                                      CONSUMERS)
    if n_tiles > 0:
        v = fg._arrived(v_smem, v_full, n_tiles - 1, BLOCK_N, HEAD_DIM, STAGES)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v))
        mbarrier.arrive(v_empty.index((n_tiles - 1) % STAGES))

    seen = l_i > 0.0            # rows that saw no key: output 0 and lse = -inf, as in forward.py
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    acc = acc / gl.convert_layout(l_safe, row_o)[:, None]
    q.store(acc.to(dtype))          # this warpgroup's Q buffer is read no more: it takes the output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_smem.index(WG))
    tma.store_wait(0)


@gluon.jit
def _ring(q_desc, k_desc, v_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """The shared memory the producer fills: the consumers' Q tiles and the K and V rings of STAGES slots, with
    their mbarriers initialised: a slot's "full" completes when its copy lands, its "empty" when every consumer
    has arrived (count CONSUMERS)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)    # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty


@gluon.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k"])
def gluon_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, heads, group, seqlen_q, seqlen_k, qk_scale,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False):
    """One program: 128 queries of one (batch, head), longest causal rows first. Grid (cdiv(seqlen_q, 128),
    batch * heads); launched with 4 warps (the first consumer) plus the worker partitions' 4 + 1."""
    BLOCK_M: gl.constexpr = 2 * q_desc.block_type.shape[2]
    pid_bh, b, h, h_kv, start_m = fg._program_rows(heads, group, BLOCK_M, CAUSAL)
    # Both consumers walk the program's tiles (a fully masked one is a no-op).
    _, n_unmasked, n_tiles = fg._key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty = _ring(q_desc, k_desc, v_desc, STAGES)
    gl.warp_specialize([(_consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
                                     b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                                     0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG)),
                        (_consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
                                     b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k, qk_scale,
                                     1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG)),
                        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty,
                                     v_full, v_empty, b, h, h_kv, start_m, n_tiles, BLOCK_N, STAGES))],
                       [4, 1], [CONSUMER_REGS, 24])


_launcher = FastLauncher(gluon_ws_kernel)


class Config(NamedTuple):
    block_n: int          # keys per tile
    stages: int           # K and V buffers in each ring
    consumer_regs: int    # registers per thread of the second consumer (setmaxnreg); the producer keeps 24
    pingpong: bool = False  # the consumers issue their products in turns (FlashAttention-3's scheduler barrier)


# The tiles `python -m utils.course.bench.forward --ws-tiles` times (notebook 05b section 10).
WS_TILES = (Config(128, 2, 232), Config(128, 2, 240), Config(128, 3, 232), Config(64, 3, 232))
# ... and with --ws-pingpong, the fastest of them in turns (FlashAttention-3 and -4 turn them on up to head dim 128)
PINGPONG_TILES = (Config(128, 2, 232, True), Config(128, 3, 232, True))


def label(config: Config) -> str:
    return f"gluon_ws n{config.block_n} s{config.stages} r{config.consumer_regs}{' pp' if config.pingpong else ''}"


def pick_config(head_dim: int) -> Config:
    """The tile per head dim, the fastest over N >= 4k in images/05b_gluon_ws_h200.json."""
    return WS_TILES[0]


def check_config(config, head_dim: int, block_m: int = BLOCK_M) -> Config:
    """`config`, or a TypeError/ValueError naming what the kernel cannot run: key tiles of 64 or 128, 1 to 4
    buffers per ring, Q plus both rings within shared memory for `block_m` query rows, and a register count
    setmaxnreg takes (a multiple of 8 from 24 to 256)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a utils.explicit.forward_ws.Config, got {type(config).__name__}")
    if not 24 <= config.consumer_regs <= 256 or config.consumer_regs % 8:
        raise ValueError(f"config: consumer_regs must be a multiple of 8 from 24 to 256, got {config}")
    return fg.check_rings(config, head_dim, block_m)


def variant(config: Config, name: str):
    """fn(q, k, v, *, causal=False, sm_scale=None) running the kernel with fixed tiles (the benchmark's lines)."""
    return fg.fixed_tiles(flash_attention_forward, config, name)


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None, config: Config | None = None):
    """(o, lse) as utils.explicit.forward.flash_attention_forward; `config`: fixed tiles (default:
    pick_config's)."""
    return forward_with(q, k, v, causal, sm_scale, config, pick_config, check_config, _launch)


def forward_with(q, k, v, causal, sm_scale, config, pick, check, launch):
    """A forward call of this kernel's shape: inputs checked, the tiles picked or checked (`pick(head_dim)`,
    `check(config, head_dim)`), then `launch(q, k, v, o, lse, causal, scale, config)`; returns (o, lse)."""
    scale = fg.check_inputs(q, k, v, causal, sm_scale)
    config = pick(q.shape[-1]) if config is None else check(config, q.shape[-1])
    q, k, v, o, lse = fg.tma_buffers(q, k, v)
    launch(q, k, v, o, lse, causal, scale, config)
    return o, lse


def _launch(q, k, v, o, lse, causal: bool, scale: float, config: Config, launcher=None, block_m: int = BLOCK_M):
    """The kernel on checked inputs (utils.course.cross_compile captures this launch to compile it on a CPU);
    `launcher`, `block_m`: another kernel of the same arguments (utils.explicit.forward_ws3's)."""
    batch, heads, seqlen_q, head_dim = q.shape
    grid = (triton.cdiv(seqlen_q, block_m), batch * heads)
    (launcher or _launcher)[grid](
        fg._descriptor(q, SUB_M), fg._descriptor(k, config.block_n), fg._descriptor(v, config.block_n),
        fg._descriptor(o, SUB_M), lse, heads, heads // k.shape[1], seqlen_q, k.shape[2], scale * fg.LOG2E,
        HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, CAUSAL=causal,
        CONSUMER_REGS=config.consumer_regs, PINGPONG=config.pingpong, num_warps=4)


def replay_protocol(n_tiles: int, stages: int, empty_parity, seed: int = 0, consumers: int = 2) -> None:
    """Replay the kernel's ring protocol in one random interleaving of the producer, the `consumers` consumers
    (three in utils.explicit.forward_ws3) and the copies' landing, with `empty_parity(tile, stages)` as the
    parity of the producer's wait on a slot's "empty" barrier (the kernel's `free`). An mbarrier wait with
    parity p blocks while the barrier's completed phases are p modulo 2. Raises AssertionError naming the tile if
    the producer refills a slot that a consumer still reads, or if every agent waits and no copy is in flight (a
    hang). For exercise 5b.7 and the tests."""
    rng = random.Random(seed)
    full = {(r, s): 0 for r in "KV" for s in range(stages)}      # phases completed: copies landed
    released = {(r, s): 0 for r in "KV" for s in range(stages)}  # consumers' arrives on "empty" (`consumers` per phase)
    holds = {(r, s): None for r in "KV" for s in range(stages)}  # the tile whose copy landed last
    landing = []                                                 # copies in flight: (ring, slot, tile)

    def producer():
        for t in range(n_tiles):
            for r in "KV":
                s = t % stages
                while (released[r, s] // consumers) % 2 == empty_parity(t, stages) % 2:
                    yield f"the producer waits to copy {r} tile {t} into slot {s}"
                assert released[r, s] >= consumers * (t // stages), (
                    f"{r} tile {t} with {stages} stages: the producer refills slot {s} while a consumer still "
                    f"reads tile {t - stages} from it")
                landing.append((r, s, t))
                yield None

    def consumer():
        order = [("K", 0)] + [x for j in range(1, n_tiles) for x in (("K", j), ("V", j - 1))] + [("V", n_tiles - 1)]
        for r, t in order if n_tiles else []:
            s = t % stages
            while full[r, s] % 2 == (t // stages) % 2:
                yield f"a consumer waits for {r} tile {t}"
            assert holds[r, s] == t, f"{r} tile {t} with {stages} stages: slot {s} holds tile {holds[r, s]}"
            released[r, s] += 1
            yield None

    def land():
        r, s, t = landing.pop(rng.randrange(len(landing)))
        holds[r, s], full[r, s] = t, full[r, s] + 1

    fg.interleave([producer(), *(consumer() for _ in range(consumers))], lambda: [land] if landing else [], rng,
                  f"hang with {n_tiles} tiles and {stages} stages")
