"""The FP8 forward, warp-specialised, in Gluon: the fast kernel beside utils.fp8.forward (notebook 11; issue 77).

utils.explicit.forward_ws (notebook 05b section 10) with both products in FP8 (e4m3), as utils.fp8.forward
computes them in Triton. Its producer warp (the bf16 kernel's, reading Vᵀ) copies Q, K and Vᵀ tiles by TMA into
a ring of shared-memory slots; two consumer warpgroups take 64 query rows each and overlap one tile's softmax with
the other's products.
The differences from the bf16 kernel:

- Vᵀ, (batch, kv_heads, head_dim, seq), is what arrives: Hopper's FP8 `wgmma` reads both operands with the
  reduction dim contiguous, the keys for the P·V product;
- each score gets its key's block scale, then the row max, then its query's block scale in the multiply-add that
  subtracts the max (the scales are positive);
- P is cast to e4m3 with a scale of 1 and stored to shared memory, where `wgmma` reads it (Gluon's wait on an
  asynchronous product cannot hold 8-bit registers, and P in registers must live until the product is done);
- O accumulates inside the tensor cores, as in the bf16 kernel. Hopper sums FP8 products with fewer bits than
  float32 (notebook 11), but adding each P·V to O in float32, as the Triton kernel does, took 64 more registers
  a thread and was slower on the H200, with no gain in the accuracy table (images/11_fp8_h200.json);
- the output has its own shared-memory tile (in bf16 it is twice the size of the FP8 Q tile it would reuse).

`fp8_attention_ws` takes what utils.fp8.forward.fp8_attention_quantized takes (the same checks) and returns
(o, lse). Head dims 64 and 128, bf16 or fp16 output, sm_90 only (Gluon has no interpreter).
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

from utils.checks import resolve_scale
from utils.explicit import forward as fg, forward_ws as fws
from utils.fp8.forward import check_quantized_inputs
from utils.tiled.forward import LOG2E

SUB_M = 64                  # query rows per consumer warpgroup
BLOCK_M = 2 * SUB_M         # query rows per program
HEAD_DIMS = (64, 128)
OUT_DTYPES = (torch.bfloat16, torch.float16)
TMA_ALIGN = 16              # bytes: TMA wants 16-byte aligned rows, so Vᵀ's key count is padded to 16


@gluon.jit
def _softmax(s, k_scale, q_scale, m_i, l_i, offs_m, start_n, seqlen_k, causal_offset, masked,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, col_layout: gl.constexpr):
    """utils.explicit.forward's softmax with per-key and per-query scales: (P fp32, alpha, l_i, m_i), base 2."""
    t = s * k_scale[None, :]
    if masked:
        t = fg._mask(t, offs_m, start_n, seqlen_k, causal_offset, BLOCK_N, CAUSAL, col_layout)
    m_new = gl.maximum(m_i, gl.max(t, 1) * q_scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(t * q_scale[:, None] - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _key_scales(KS, ks_base, start_n, seqlen_k, scale_block, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    cols = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
    return gl.load(KS + ks_base + cols // scale_block, mask=cols < seqlen_k, other=1.0)


@gluon.jit
def _consumer(o_desc, LSE, QS, KS, VS, q_smem, k_smem, v_smem, o_smem, p_smem, q_bar, k_full, k_empty, v_full, v_empty,
              b, h, h_kv, pid_bh, heads, group, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k, q_blocks,
              k_blocks, scale_block, qk_scale, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One warpgroup: rows [start_m + WG*64, +64). In iteration j: S_j issued, P_{j-1}·V_{j-1} issued, wait for
    S_j, softmax, wait for the product (which adds P·V into O), then O *= alpha; an arrive frees each slot read."""
    SUB_M: gl.constexpr = o_desc.block_type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    fp8: gl.constexpr = k_smem.dtype
    row0 = start_m + WG * SUB_M
    causal_offset = seqlen_k - seqlen_q
    offs_m = row0 + gl.arange(0, SUB_M, layout=row_s)
    # Each query's block scale with the softmax scale and log2(e); rows past the end take 1 (their q is 0).
    q_scale = gl.load(QS + pid_bh.to(gl.int64) * q_blocks + offs_m // scale_block, mask=offs_m < seqlen_q,
                      other=1.0) * qk_scale
    ks_base = (b * (heads // group) + h_kv).to(gl.int64) * k_blocks
    q = q_smem.index(WG).reshape([SUB_M, HEAD_DIM])
    mbarrier.wait(q_bar.index(WG), 0)

    s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([SUB_M], gl.float32, row_s)
    p = p_smem.index(WG)
    if n_tiles > 0:
        k = fg._arrived(k_smem, k_full, 0, BLOCK_N, HEAD_DIM, STAGES)
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=(s, q, k))
        mbarrier.arrive(k_empty.index(0))
        k_scale = _key_scales(KS, ks_base, 0, seqlen_k, scale_block, BLOCK_N, col_s)
        p32, alpha, l_i, m_i = _softmax(s, k_scale, q_scale, m_i, l_i, offs_m, 0, seqlen_k, causal_offset,
                                        0 >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        p.store(p32.to(fp8))
        fence_async_shared()
    for j in range(1, n_tiles):
        # K_j's scales first: the load lands while the tensor cores work, before the softmax needs it
        k_scale = _key_scales(KS, ks_base, j * BLOCK_N, seqlen_k, scale_block, BLOCK_N, col_s)
        k = fg._arrived(k_smem, k_full, j, BLOCK_N, HEAD_DIM, STAGES)
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        vt = fg._arrived(v_smem, v_full, j - 1, HEAD_DIM, BLOCK_N, STAGES)
        pv = warpgroup_mma(p, vt.permute((1, 0)), acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(1, deps=(s, q, k))
        mbarrier.arrive(k_empty.index(j % STAGES))            # this warpgroup is done with K_j
        p32, alpha, l_i, m_i = _softmax(s, k_scale, q_scale, m_i, l_i, offs_m, j * BLOCK_N, seqlen_k,
                                        causal_offset, j >= n_unmasked, BLOCK_N, CAUSAL, col_s)
        pv, _, _ = warpgroup_mma_wait(0, deps=(pv, p, vt))
        mbarrier.arrive(v_empty.index((j - 1) % STAGES))      # ... and with Vᵀ_{j-1}
        acc = pv * gl.convert_layout(alpha, row_o)[:, None]
        p.store(p32.to(fp8))                                  # P_{j-1}·V_{j-1} has read the last P
        fence_async_shared()
    if n_tiles > 0:
        vt = fg._arrived(v_smem, v_full, n_tiles - 1, HEAD_DIM, BLOCK_N, STAGES)
        acc = warpgroup_mma(p, vt.permute((1, 0)), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p, vt))
        mbarrier.arrive(v_empty.index((n_tiles - 1) % STAGES))

    seen = l_i > 0.0            # rows that saw no key: output 0 and lse = -inf
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    acc = acc * gl.convert_layout(gl.load(VS) / l_safe, row_o)[:, None]     # V's scale, once, with the 1/l
    out = o_smem.index(WG)
    out.reshape([SUB_M, HEAD_DIM]).store(acc.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], out)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k", "q_blocks", "k_blocks", "scale_block"])
def fp8_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, QS, KS, VS, heads, group, seqlen_q, seqlen_k, q_blocks,
                  k_blocks, scale_block, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """One program: 128 queries of one (batch, head), longest causal rows first. Grid (cdiv(seqlen_q, 128),
    batch * heads); launched with 4 warps (the first consumer) plus the worker partitions' 4 + 1."""
    BLOCK_M: gl.constexpr = 2 * q_desc.block_type.shape[2]
    pid_bh, b, h, h_kv, start_m = fg._program_rows(heads, group, BLOCK_M, CAUSAL)
    _, n_unmasked, n_tiles = fg._key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty = fws._ring(q_desc, k_desc, v_desc, STAGES)
    # Beside the bf16 kernel's ring: each consumer's output tile, and its P for the second product
    fp8: gl.constexpr = q_desc.dtype
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    p_smem = gl.allocate_shared_memory(fp8, [2, BLOCK_M // 2, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, BLOCK_N], fp8))
    gl.warp_specialize([(_consumer, (o_desc, LSE, QS, KS, VS, q_smem, k_smem, v_smem, o_smem, p_smem, q_bar, k_full,
                                     k_empty, v_full, v_empty, b, h, h_kv, pid_bh, heads, group, start_m, n_tiles,
                                     n_unmasked, seqlen_q, seqlen_k, q_blocks, k_blocks, scale_block, qk_scale,
                                     0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
                        (_consumer, (o_desc, LSE, QS, KS, VS, q_smem, k_smem, v_smem, o_smem, p_smem, q_bar, k_full,
                                     k_empty, v_full, v_empty, b, h, h_kv, pid_bh, heads, group, start_m, n_tiles,
                                     n_unmasked, seqlen_q, seqlen_k, q_blocks, k_blocks, scale_block, qk_scale,
                                     1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
                        (fws._producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty,
                                         v_full, v_empty, b, h, h_kv, start_m, n_tiles, BLOCK_N, STAGES, True))],
                       [4, 1], [CONSUMER_REGS, 24])


class Config(NamedTuple):
    block_n: int          # keys per tile
    stages: int           # K and Vᵀ buffers in each ring
    consumer_regs: int    # registers per thread of the second consumer (setmaxnreg); the producer keeps 24


# Fastest first, by the H200 sweep (images/11_fp8_sweep_h200.json).
WS_TILES = (Config(64, 3, 240), Config(128, 2, 240), Config(128, 3, 240))


def pick_config(head_dim: int) -> Config:
    """The fastest of WS_TILES in the stored H200 sweep."""
    return WS_TILES[0]


def smem_bytes(config: Config, head_dim: int, out_bytes: int = 2) -> int:
    """Shared memory of a program: Q (1 byte a value), P and the output for both consumers, and both rings."""
    return head_dim * (BLOCK_M * (1 + out_bytes) + 2 * config.stages * config.block_n) + BLOCK_M * config.block_n


def check_config(config) -> Config:
    """`config`, or a TypeError/ValueError: key tiles of 64 or 128, 1 to 4 slots per ring, a register count
    setmaxnreg takes (a multiple of 8 from 24 to 256)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a utils.fp8.forward_ws.Config, got {type(config).__name__}")
    if config.block_n not in (64, 128) or config.stages not in (1, 2, 3, 4):
        raise ValueError(f"config: block_n must be 64 or 128 and stages 1 to 4, got {config}")
    if not 24 <= config.consumer_regs <= 256 or config.consumer_regs % 8:
        raise ValueError(f"config: consumer_regs must be a multiple of 8 from 24 to 256, got {config}")
    return config   # within shared memory: at most 192 KiB (smem_bytes at 128 keys, 4 slots, head dim 128)


@functools.lru_cache(maxsize=None)
def _shared_layout(block_shape: tuple, dtype: torch.dtype):
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)


def _descriptor(x: torch.Tensor, block_shape: tuple) -> TensorDescriptor:
    """A host TMA descriptor over the whole 4-D tensor x, read or written in tiles of `block_shape`."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block_shape), _shared_layout(block_shape, x.dtype))


def _tma_layout(q, k, vt):
    """q, k and vt as TMA reads them: contiguous, and vt's keys padded to a multiple of 16 (16-byte rows)."""
    q, k = q.contiguous(), k.contiguous()
    nk = vt.shape[-1]
    padded = triton.cdiv(nk, TMA_ALIGN) * TMA_ALIGN
    if vt.is_contiguous() and padded == nk:
        return q, k, vt
    out = torch.zeros(*vt.shape[:-1], padded, dtype=vt.dtype, device=vt.device)
    out[..., :nk] = vt
    return q, k, out[..., :nk]   # a view: shape (.., nk), row stride `padded`


def fp8_attention_ws(q, k, vt, q_scale, k_scale, v_scale, *, scale_block: int, causal: bool = False,
                     sm_scale=None, out_dtype=torch.bfloat16, config: Config | None = None):
    """(o, lse) as utils.fp8.forward.fp8_attention_quantized, by the warp-specialised Gluon kernel: o
    (batch, heads, seqlen_q, head_dim) in out_dtype (bf16 or fp16), lse fp32, natural log. `config`: fixed tiles
    (default: pick_config's)."""
    (b, h, nq, hk, nk, d), q_scale, k_scale, v_scale = check_quantized_inputs(
        q, k, vt, q_scale, k_scale, v_scale, scale_block, causal, out_dtype)
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported by the Gluon FP8 kernel: one of {HEAD_DIMS}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16 for the Gluon FP8 kernel, got {out_dtype}")
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}: the Gluon FP8 kernel runs on an sm_90 GPU only")
    fg.check_sm90(q, "fp8_attention_ws")
    scale = resolve_scale(sm_scale, d)
    config = pick_config(d) if config is None else check_config(config)
    q, k, vt = _tma_layout(q, k, vt)
    o = torch.empty((b, h, nq, d), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    _launch(q, k, vt, q_scale, k_scale, v_scale, o, lse, scale_block, causal, scale, config)
    return o, lse


def _launch(q, k, vt, q_scale, k_scale, v_scale, o, lse, scale_block: int, causal: bool, scale: float,
            config: Config) -> None:
    """The kernel on checked inputs (utils.course.cross_compile can capture this launch to compile it on a CPU)."""
    batch, heads, seqlen_q, head_dim = q.shape
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * heads)
    fp8_ws_kernel[grid](
        _descriptor(q, (1, 1, SUB_M, head_dim)), _descriptor(k, (1, 1, config.block_n, head_dim)),
        _descriptor(vt, (1, 1, head_dim, config.block_n)), _descriptor(o, (1, 1, SUB_M, head_dim)), lse,
        q_scale, k_scale, v_scale, heads, heads // k.shape[1], seqlen_q, k.shape[2], q_scale.shape[-1],
        k_scale.shape[-1], scale_block, scale * LOG2E, HEAD_DIM=head_dim, BLOCK_N=config.block_n,
        STAGES=config.stages, CAUSAL=causal, CONSUMER_REGS=config.consumer_regs,
        num_warps=4)
