"""FlashAttention-3's schedule on Hopper, written in Gluon (notebook 05b section 9; issue 22).

Triton's tile language decides by itself where a kernel waits for its asynchronous `wgmma` matrix products, and
notebook 05b measured what that costs: asking for the next tile's scores before this tile's softmax did not
pay, because the compiler waited for them at once. Gluon (`triton.experimental.gluon`, shipped inside the
Triton package) is Triton one level down: the programmer places the layouts, the shared-memory buffers, the
TMA copies with their mbarriers, and the `wgmma` waits. That is what FlashAttention-3's intra-warpgroup overlap
needs (Shah et al., 2024, Algorithm 2): in iteration j,

    S_j  = Q K_jᵀ          issued, not waited for
    O   += P_{j-1} V_{j-1} issued, not waited for
    wait until only one product is in flight   -> S_j is done, the P·V product still runs
    softmax(S_j) -> P_j, the rescale factor      (on the CUDA cores, while the tensor cores finish P·V)
    wait for the P·V product; O *= rescale

so the exponentials of tile j overlap the P·V product of tile j-1 -- in the PTX. In the machine code ptxas moves
the last wait above the exponentials (`python -m utils.course.cross_compile --schedule gluon --sass`); worklog
05bw section 6 measured the order restored, and it was slower. K and V arrive through a ring of STAGES
shared-memory buffers filled by TMA; buffer s is refilled once every warp has finished the products that read
it (one `thread_barrier` per iteration), which leaves a whole iteration to hide the copy's latency.

`flash_attention_forward(q, k, v, *, causal=False, sm_scale=None)` -> (o, lse) follows the course conventions
(utils.eager.reference): (batch, heads, seq, head_dim) tensors, GQA, any lengths, Nq != Nk with bottom-right causal
alignment and a zero output for a query that sees no key. fp16 and bf16, head dims 64 and 128, sm_90 only:
Gluon has no interpreter, so this kernel runs on an H100/H200 and nowhere else. The 4-D tensor descriptors
read rows past a head's end as zeros and clip the output's, as the Triton kernel's host descriptors do.

One warpgroup runs each program (64 query rows). Notebook 05b section 9 compares it with cuDNN and the Triton
kernel from images/05b_gluon_h200.json; at head dim 128 utils.explicit.forward_ws (warp-specialised, section 10) is
the one to use. Gluon is experimental: the kernel compiles with Triton 3.6 and 3.7, whose CTA barrier has two
names (`_cta_barrier`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from utils import gpu
from utils.checks import check_attention_inputs, resolve_scale
from utils.tiled.fast.launch import FastLauncher

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634
# Triton 3.6 (the device image) calls the CTA-wide barrier thread_barrier; 3.7 renamed it barrier.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _issue(desc, smem, bars, tile, b, h, BLOCK: gl.constexpr, STAGES: gl.constexpr, pred):
    """Start the TMA copy of rows [tile*BLOCK, (tile+1)*BLOCK) of head (b, h) into ring slot tile % STAGES."""
    slot = tile % STAGES
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [b, h, tile * BLOCK, 0], bars.index(slot), smem.index(slot), pred=pred)


@gluon.jit
def _arrived(smem, bars, tile, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Wait for tile's copy; return its slot as a (BLOCK, HEAD_DIM) matrix. A slot's barrier completes once per
    use, so use number tile // STAGES waits for phase (tile // STAGES) % 2."""
    slot = tile % STAGES
    mbarrier.wait(bars.index(slot), (tile // STAGES) & 1)
    return smem.index(slot).reshape([BLOCK, HEAD_DIM])


@gluon.jit
def _mask(s, offs_m, start_n, seqlen_k, causal_offset, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
          col_layout: gl.constexpr):
    """The tile of scores s from key start_n with -inf past the last key and, when causal, right of each query's
    diagonal (bottom-right alignment: query i sees keys j <= i + causal_offset)."""
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
    keep = offs_n[None, :] < seqlen_k
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, offs_m, start_n, seqlen_k, causal_offset, masked,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, col_layout: gl.constexpr):
    """One tile of scores s (fp32, unscaled) against the running max m_i and sum l_i (base 2): returns the
    probabilities P, the factor alpha that rescales what came before, and the new l_i, m_i."""
    if masked:  # the ragged last tile and, when causal, the tiles that cross the diagonal
        s = _mask(s, offs_m, start_n, seqlen_k, causal_offset, BLOCK_N, CAUSAL, col_layout)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)   # a row that has seen no key yet: avoid -inf - -inf
    p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _program_rows(heads, group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch·heads index, batch, head, K/V head, first query row) of this program; causal programs take the
    longest rows first, so that the last wave is short."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    h = pid_bh % heads
    return pid_bh, pid_bh // heads, h, h // group, pid_m * BLOCK_M


@gluon.jit
def _key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(causal_offset, n_unmasked, n_tiles): the keys the BLOCK_M queries from start_m see, in tiles of BLOCK_N:
    [0, n_unmasked) whole unmasked tiles, then masked ones up to n_tiles. Bottom-right alignment: query i sees
    keys j <= i + causal_offset."""
    causal_offset = seqlen_k - seqlen_q
    if CAUSAL:
        n_keys = gl.minimum(gl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)
        n_unmasked = gl.minimum(gl.maximum(start_m + causal_offset + 1, 0), seqlen_k) // BLOCK_N
    else:
        n_keys = seqlen_k
        n_unmasked = seqlen_k // BLOCK_N
    return causal_offset, n_unmasked, gl.cdiv(n_keys, BLOCK_N)


@gluon.jit
def _overlapped_loop(q, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, s_zero, acc, m_i, l_i, p, qk_scale, offs_m,
                     seqlen_k, causal_offset, n_unmasked, n_tiles, b, h_kv, HEAD_DIM: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, dtype: gl.constexpr,
                     col_s: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr):
    """Key tiles 1 to n_tiles - 1 (Algorithm 2 of FlashAttention-3): S_j, then P_{j-1}·V_{j-1}, issued; the
    softmax of S_j is written to run while the second product finishes (ptxas waits for it first: see the
    module's docstring). Returns the new (acc, m_i, l_i, p)."""
    for j in range(1, n_tiles):
        k = _arrived(k_smem, k_bars, j, BLOCK_N, HEAD_DIM, STAGES)
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        v = _arrived(v_smem, v_bars, j - 1, BLOCK_N, HEAD_DIM, STAGES)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(1, deps=(s, q, k))         # S_j done; P_{j-1}·V_{j-1} may still run
        p32, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, seqlen_k, causal_offset,
                                        j >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(p32.to(dtype), p_layout)
        _cta_barrier()   # every warpgroup is done with K_j and V_{j-1}: their slots may be refilled
        _issue(k_desc, k_smem, k_bars, j + STAGES, b, h_kv, BLOCK_N, STAGES, j + STAGES < n_tiles)
        _issue(v_desc, v_smem, v_bars, j - 1 + STAGES, b, h_kv, BLOCK_N, STAGES, j - 1 + STAGES < n_tiles)
    return acc, m_i, l_i, p


@gluon.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k"])
def gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, heads, group, seqlen_q, seqlen_k, qk_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One program: BLOCK_M queries of one (batch, head). Grid (cdiv(seqlen_q, BLOCK_M), batch * heads);
    causal programs run the longest rows first."""
    pid_bh, b, h, h_kv, start_m = _program_rows(heads, group, BLOCK_M, CAUSAL)
    dtype: gl.constexpr = q_desc.dtype

    # Register layouts: the wgmma accumulators of S (BLOCK_M x BLOCK_N) and O (BLOCK_M x HEAD_DIM), one warp per
    # 16 rows; P enters the P·V product from registers, in the layout of a wgmma A operand.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    causal_offset, n_unmasked, n_tiles = _key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _issue(k_desc, k_smem, k_bars, i, b, h_kv, BLOCK_N, STAGES, i < n_tiles)
        _issue(v_desc, v_smem, v_bars, i, b, h_kv, BLOCK_N, STAGES, i < n_tiles)
    q = q_smem.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_bar, 0)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    p = gl.zeros([BLOCK_M, BLOCK_N], dtype, p_layout)

    if n_tiles > 0:  # tile 0: its scores, waited for, and its softmax (nothing to overlap yet)
        k = _arrived(k_smem, k_bars, 0, BLOCK_N, HEAD_DIM, STAGES)
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=(s, q, k))
        p32, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, offs_m, 0, seqlen_k, causal_offset,
                                        0 >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        p = gl.convert_layout(p32.to(dtype), p_layout)
        _cta_barrier()        # every warpgroup is done with K_0: its slot takes tile STAGES
        _issue(k_desc, k_smem, k_bars, STAGES, b, h_kv, BLOCK_N, STAGES, STAGES < n_tiles)
    acc, m_i, l_i, p = _overlapped_loop(q, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, s_zero, acc, m_i, l_i, p,
                                        qk_scale, offs_m, seqlen_k, causal_offset, n_unmasked, n_tiles, b, h_kv,
                                        HEAD_DIM, BLOCK_N, STAGES, CAUSAL, dtype, col_s, row_o, p_layout)
    if n_tiles > 0:
        v = _arrived(v_smem, v_bars, n_tiles - 1, BLOCK_N, HEAD_DIM, STAGES)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, v))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # Rows that saw no key (causal with Nq > Nk) have l = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    acc = acc / gl.convert_layout(l_safe, row_o)[:, None]
    _cta_barrier()       # every warpgroup's last product has read Q: its buffer takes the output
    q.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, start_m, 0], q_smem)
    tma.store_wait(0)


_launcher = FastLauncher(gluon_fwd_kernel)   # Gluon's own dispatch costs ~30 µs a call (notebook 05b step 3)


def ring_schedule(n_tiles: int, stages: int) -> list[tuple[str, str, int]]:
    """The kernel's copies and waits on its K and V rings, in program order, as (event, ring, tile) with event
    "issue" (a TMA copy into slot tile % stages) or "wait" (mbarrier.wait before a product reads the tile). A
    model of gluon_fwd_kernel's loop for exercise 5b.5 and the tests: every wait must find its tile's copy
    issued, and no slot may be refilled before the wait for its previous tile."""
    events = []
    for t in range(min(stages, n_tiles)):                  # the prologue fills every slot of both rings
        events += [("issue", "K", t), ("issue", "V", t)]
    if n_tiles > 0:
        events.append(("wait", "K", 0))
        if stages < n_tiles:
            events.append(("issue", "K", stages))
    for j in range(1, n_tiles):
        events += [("wait", "K", j), ("wait", "V", j - 1)]
        for ring, tile in (("K", j + stages), ("V", j - 1 + stages)):   # the slots those two products freed
            if tile < n_tiles:
                events.append(("issue", ring, tile))
    if n_tiles > 0:
        events.append(("wait", "V", n_tiles - 1))
    return events


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    stages: int     # K and V buffers in each ring


# The tiles `python -m utils.course.bench.forward --gluon-tiles` times (notebook 05b section 9). One warpgroup per
# program (4 warps, 64 query rows) keeps the per-iteration barrier local to it and lets 2-3 programs share an SM,
# whose warp schedulers then interleave one program's softmax with another's products; two warpgroups (8 warps,
# 128 rows) halve the K/V traffic but step together at every barrier.
GLUON_TILES = (Config(64, 128, 4, 2), Config(64, 64, 4, 2), Config(64, 64, 4, 3), Config(128, 128, 8, 2))


def pick_config(head_dim: int) -> Config:
    """The tile per head dim, the same causal or not (the choice is made in images/05b_gluon_h200.json)."""
    return GLUON_TILES[0] if head_dim == 64 else GLUON_TILES[1]


SMEM_LIMIT = 227 * 1024     # shared memory one block may use on an H100/H200


def check_config(config, head_dim: int) -> Config:
    """`config`, or a TypeError/ValueError naming what the kernel cannot run: one warp per 16 query rows (4 or
    8 warps), key tiles of 64 or 128, 1 to 4 buffers per ring, and Q plus both rings within shared memory."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a utils.explicit.forward.Config, got {type(config).__name__}")
    if config.num_warps not in (4, 8) or config.block_m != 16 * config.num_warps:
        raise ValueError(f"config: block_m must be 16 * num_warps with 4 or 8 warps, got {config}")
    return check_rings(config, head_dim, config.block_m)


def check_rings(config, head_dim: int, block_m: int):
    """The checks both Gluon forwards share: key tiles of 64 or 128, 1 to 4 buffers per ring, and a Q tile of
    block_m rows plus both rings within shared memory. Returns `config`."""
    if config.block_n not in (64, 128) or config.stages not in (1, 2, 3, 4):
        raise ValueError(f"config: block_n must be 64 or 128 and stages 1 to 4, got {config}")
    smem = 2 * head_dim * (block_m + 2 * config.stages * config.block_n)
    if smem > SMEM_LIMIT:
        raise ValueError(f"config: {smem // 1024} KiB of shared memory at head_dim {head_dim} exceeds the "
                         f"{SMEM_LIMIT // 1024} KiB of a block; use fewer stages or smaller tiles ({config})")
    return config


def variant(config: Config, name: str):
    """fn(q, k, v, *, causal=False, sm_scale=None) running the kernel with fixed tiles (the benchmark's lines)."""
    return fixed_tiles(flash_attention_forward, config, name)


def fixed_tiles(forward, config, name: str):
    """fn(q, k, v, *, causal=False, sm_scale=None) returning `forward(..., config=config)`'s output alone, named
    `name`: a Gluon forward with fixed tiles as the benchmark and the tests call an attention function."""
    def attention(q, k, v, *, causal=False, sm_scale=None):
        return forward(q, k, v, causal=causal, sm_scale=sm_scale, config=config)[0]
    attention.__name__ = name
    return attention


@functools.lru_cache(maxsize=None)
def _shared_layout(block: int, head_dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of one (block, head_dim) tile, which TMA writes and wgmma reads."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, block, head_dim],
                                                gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _descriptor(x: torch.Tensor, block: int) -> TensorDescriptor:
    """A host TMA descriptor over the whole (B, H, N, D) tensor; the kernel loads tile [b, h, row, 0]."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block, x.shape[-1]],
                            _shared_layout(block, x.shape[-1], x.dtype))


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """TMA needs a unit last stride and 16-byte aligned base and strides; copy otherwise."""
    aligned = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all((s * x.element_size()) % 16 == 0
                                                                     for s in x.stride()[:-1])
    return x if aligned else x.contiguous()


def check_inputs(q, k, v, causal, sm_scale) -> float:
    """The inputs' checks (utils.checks), then the GPU generation; returns the softmax scale."""
    check_attention_inputs(q, k, v, causal=causal, head_dims=HEAD_DIMS, dtypes=DTYPES, runs_on="cuda")
    check_sm90(q, "flash_attention_gluon")
    return resolve_scale(sm_scale, q.shape[-1])


def check_sm90(q: torch.Tensor, who: str) -> None:
    """A ValueError unless CUDA tensor q is on an sm_90 GPU, where `who`'s wgmma code runs."""
    if gpu.capability(q) != (9, 0):
        raise ValueError(f"q is on a GPU of compute capability {gpu.capability(q)}; {who}'s wgmma code runs on "
                         "sm_90 (H100/H200) only")


def interleave(agents, events, rng, hang: str, p_event: float = 0.5) -> None:
    """Run generator `agents` in a random order (the protocol replays of the warp-specialised kernels): a step
    yields None, or a string saying what the agent waits for. `events()` lists what may happen asynchronously
    now (callables: a copy lands, ...); one is taken with probability `p_event` while an agent can move, and
    always when none can. AssertionError `hang` with every agent's wait when nothing can happen."""
    live, blocked = list(agents), {}
    while live:
        movers = [a for a in live if a not in blocked]
        ready = events()
        if ready and (not movers or rng.random() < p_event):
            rng.choice(ready)()
            blocked.clear()
            continue
        if not movers:
            raise AssertionError(f"{hang}: {'; '.join(blocked.values())}")
        agent = rng.choice(movers)
        try:
            waits = next(agent)
        except StopIteration:
            live.remove(agent)
            continue
        if waits:
            blocked[agent] = waits
        else:
            blocked.clear()


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None, config: Config | None = None):
    """(o, lse): o like q, lse (batch, heads, seqlen_q) fp32 natural-log log-sum-exp. `config`: fixed tiles
    (default: pick_config's)."""
    scale = check_inputs(q, k, v, causal, sm_scale)
    config = pick_config(q.shape[-1]) if config is None else check_config(config, q.shape[-1])
    q, k, v, o, lse = tma_buffers(q, k, v)
    _launch(q, k, v, o, lse, causal, scale, config)
    return o, lse


def tma_buffers(q, k, v):
    """(q, k, v, o, lse) for a Gluon forward's launch: the inputs as TMA takes them (_tma_ready) and the empty
    outputs it writes, o like q and an fp32 lse per query row."""
    q, k, v = (_tma_ready(x) for x in (q, k, v))
    return q, k, v, torch.empty_like(q), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)


def _launch(q, k, v, o, lse, causal: bool, scale: float, config: Config) -> None:
    """The kernel on checked inputs (utils.course.cross_compile captures this launch to compile it on a CPU)."""
    batch, heads, seqlen_q, head_dim = q.shape
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * heads)
    _launcher[grid](_descriptor(q, config.block_m), _descriptor(k, config.block_n),
                    _descriptor(v, config.block_n), _descriptor(o, config.block_m), lse,
                    heads, heads // k.shape[1], seqlen_q, k.shape[2], scale * LOG2E,
                    HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                    STAGES=config.stages, CAUSAL=causal, num_warps=config.num_warps)
