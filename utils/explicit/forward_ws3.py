"""The warp-specialised Gluon forward with three consumer warpgroups: 192 query rows a program (issue 78).

utils.explicit.forward_ws (notebook 05b section 10) gives each program 128 query rows, two consumer warpgroups
of 64. FlashAttention-3 and -4 run 192-row programs at head dims up to 64 on Hopper: each K/V tile that the
producer copies then serves 192 queries instead of 128, and three warpgroups take turns on the tensor cores.
The diff against forward_ws is small:

- the ring holds three Q tiles, and a slot's "empty" barrier waits for three arrivals (`CONSUMERS=3`);
- a third `_consumer` partition, rows [start_m + 128, +64);
- the register split: four consumer warps per partition and a one-warp producer share the 64K registers of an
  SM, so each consumer thread gets fewer than in forward_ws (CONSUMER_REGS; the producer keeps 24).

Same conventions, limits and validation as utils.explicit.forward_ws (fp16/bf16, sm_90 only, GQA, ragged and
unequal lengths with bottom-right causal alignment), but head dim 64 only: at 128 three consumers' scores and
outputs do not fit the registers an SM has for them.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from utils.explicit import forward as fg, forward_ws as fws
from utils.tiled.fast.launch import FastLauncher

SUB_M = fws.SUB_M            # query rows per consumer warpgroup
CONSUMERS = 3
BLOCK_M = CONSUMERS * SUB_M  # query rows per program


@gluon.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k"])
def gluon_ws3_kernel(q_desc, k_desc, v_desc, o_desc, LSE, heads, group, seqlen_q, seqlen_k, qk_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False):
    """One program: 192 queries of one (batch, head), longest causal rows first. Grid (cdiv(seqlen_q, 192),
    batch * heads); launched with 4 warps (the first consumer) plus the worker partitions' 4 + 4 + 1."""
    BLOCK_M: gl.constexpr = 3 * q_desc.block_type.shape[2]
    pid_bh, b, h, h_kv, start_m = fg._program_rows(heads, group, BLOCK_M, CAUSAL)
    _, n_unmasked, n_tiles = fg._key_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty = fws._ring(q_desc, k_desc, v_desc, STAGES, 3)
    gl.warp_specialize([(fws._consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                                         v_empty, b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k,
                                         qk_scale, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, 3)),
                        (fws._consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                                         v_empty, b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k,
                                         qk_scale, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, 3)),
                        (fws._consumer, (o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                                         v_empty, b, h, pid_bh, start_m, n_tiles, n_unmasked, seqlen_q, seqlen_k,
                                         qk_scale, 2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, 3)),
                        (fws._producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty,
                                         v_full, v_empty, b, h, h_kv, start_m, n_tiles, BLOCK_N, STAGES, False, 3))],
                       [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


_launcher = FastLauncher(gluon_ws3_kernel)


Config = fws.Config   # the same fields: keys per tile, ring depth, the consumers' registers (setmaxnreg)


# To be timed on the H200; the first is the starting point. Compiled for sm_90 (Triton 3.7.1), these spill no
# registers at head dim 64; 152 registers a consumer spilled 32 bytes, and 168 left the first consumer 152.
WS3_TILES = (Config(128, 2, 160), Config(128, 3, 160), Config(64, 3, 160), Config(64, 2, 160))
# ... and in turns, round robin over the three consumers (FlashAttention-3 and -4 at head dim 64: 192 x 128)
PINGPONG_TILES = (Config(128, 2, 160, True),)
HEAD_DIMS = (64,)   # at 128, a consumer's output and scores do not fit its share of registers (ptxas spills)


def label(config: Config) -> str:
    return f"gluon_ws3 n{config.block_n} s{config.stages} r{config.consumer_regs}{' pp' if config.pingpong else ''}"


def _supported(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the three-consumer kernel: it takes "
                         f"{HEAD_DIMS}; use utils.explicit.forward_ws at larger head dims")


def pick_config(head_dim: int) -> Config:
    """The starting point, until a measured sweep picks one; a ValueError for a head dim it does not take."""
    _supported(head_dim)
    return WS3_TILES[0]


def check_config(config, head_dim: int) -> Config:
    """utils.explicit.forward_ws.check_config for 192-row programs, at a head dim the kernel takes."""
    _supported(head_dim)
    return fws.check_config(config, head_dim, BLOCK_M)


def variant(config: Config, name: str):
    """fn(q, k, v, *, causal=False, sm_scale=None) running the kernel with fixed tiles (a benchmark's lines)."""
    return fg.fixed_tiles(flash_attention_forward, config, name)


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None, config: Config | None = None):
    """(o, lse) as utils.explicit.forward.flash_attention_forward, head dim 64; `config`: fixed tiles (default:
    pick_config's)."""
    return fws.forward_with(q, k, v, causal, sm_scale, config, pick_config, check_config, _launch)


def _launch(q, k, v, o, lse, causal: bool, scale: float, config: Config) -> None:
    """The kernel on checked inputs (utils.course.cross_compile captures this launch to compile it on a CPU)."""
    fws._launch(q, k, v, o, lse, causal, scale, config, _launcher, BLOCK_M)
