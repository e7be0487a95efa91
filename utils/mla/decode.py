"""MLA decoding in Triton: split-KV attention of absorbed queries over the latent cache (notebook 11).

After absorption (utils/mla/reference.py) every head of a sequence attends the same cache: keys [c_j, k_r,j]
(r + d_rope dims) and values c_j (r dims), one tensor for keys and values, shared by all heads. So the kernel is
notebook 08's split-KV kernel (utils/decoding/single_path.py) with these changes:

- the rows of the Q tile are (head, new token) pairs of one sequence: every head is a row, as the query heads of a
  GQA group are there, so each tile of the cache is loaded once per program and serves every head;
- the tile loaded for the keys is also the tile of values: scores = q_c · c^T + q_r · k_r^T, then acc += p · c;
- there is no KV-head axis: grid (blocks of rows, splits, sequences), the row blocks first, so that programs
  that read the same slice of a cache (more than 64 rows: H = 128) are launched side by side and share L2.

The splits' partial outputs and log-sum-exps are merged by utils.decoding.split_kv.merge_partials.
The memory a step must read is the cache once, (r + d_rope) · 2 bytes per token in bf16 for all heads together
(1152 B at DeepSeek's 512 + 64), against (192 + 128) · 2 B per head and token for the expanded keys and values
of un-absorbed heads (80 KiB per token at H = 128).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils.checks import check_device
from utils.decoding.split_kv import DTYPES, LOG2E, MAX_SPLITS, check_seqlens, default_num_sms, merge_partials
from utils.mla.reference import DEEPSEEK_SM_SCALE, check_latent_shapes, check_mla_scale
from utils.tiled.forward import first_that_launches
from utils.triton_utils import cdiv

LATENT_DIMS = (16, 32, 64, 128, 256, 512)   # powers of two (tl.arange), at least 16 (tl.dot)
ROPE_DIMS = (16, 32, 64, 128)
MIN_SPLIT_TILES = 4   # a split shorter than this many tiles costs more in partials and merging than it saves


@triton.jit
def mla_decode_kernel(QC, QR, C, KR, O, LSE, SEQLENS,
                      sqcb, sqch, sqcn, sqrb, sqrh, sqrn, scb, scn, skb, skn, sob, soh, son, sos, slb, slh, sln, sls,
                      n_rows, n_q, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr):
    """One program per (block of (head, new token) rows, split, sequence): the online softmax of its rows over
    this split's slice of the sequence's latent cache; writes the slice's normalised latent output and its
    natural-log lse (-inf: no entry seen)."""
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)   # int64: b * stride passes 2**31 elements in a large cache
    num_splits = tl.num_programs(1)

    # Rows of the Q tile: (head, new token) pairs of sequence b. All heads read the same cache entries.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    h = rows // n_q
    i = rows % n_q
    r = tl.arange(0, LATENT)
    e = tl.arange(0, ROPE)

    # This split's slice of this sequence's cache: the same whole number of BLOCK_N tiles for every split.
    seqlen = tl.load(SEQLENS + b)
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), num_splits)
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen)

    q_c = tl.load(QC + b * sqcb + h[:, None] * sqch + i[:, None] * sqcn + r[None, :], mask=row_ok[:, None], other=0.0)
    q_r = tl.load(QR + b * sqrb + h[:, None] * sqrh + i[:, None] * sqrn + e[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        # The one load of this tile of the cache: c serves as the keys' latent part and as the values.
        c = tl.load(C + b * scb + cols[:, None] * scn + r[None, :], mask=col_ok[:, None], other=0.0)
        k_r = tl.load(KR + b * skb + cols[:, None] * skn + e[None, :], mask=col_ok[:, None], other=0.0)
        # ieee: fp32 inputs get exact fp32 products, not TF32; fp16/bf16 dots are the same either way
        s = tl.dot(q_c, tl.trans(c), input_precision="ieee") + tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        s = s * qk_scale                                     # base 2: qk_scale holds log2(e)
        # new token i sees entries j <= i + L - n_q: causal among the new tokens, which come last
        visible = col_ok[None, :] & (cols[None, :] <= i[:, None] + seqlen - n_q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet: keep p = 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        m = m_new

    l_safe = tl.where(l == 0.0, 1.0, l)   # rows that saw no entry in this slice: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(O + b * sob + h[:, None] * soh + i[:, None] * son + split * sos + r[None, :], o, mask=row_ok[:, None])
    tl.store(LSE + b * slb + h * slh + i * sln + split * sls, lse, mask=row_ok)


class Layout(NamedTuple):
    """How `mla_decode` cuts a problem into programs."""
    grid: tuple[int, int, int]   # (row blocks, splits, batch)
    block_m: int                 # rows of the Q tile: (head, new token) pairs
    block_n: int                 # cache entries per tile
    row_blocks: int              # Q tiles per sequence: how many times each cache entry is loaded
    num_splits: int
    num_warps: int
    num_stages: int              # cache tiles in flight (software pipelining)


class Tiles(NamedTuple):
    """The cache tiles of a launch: `block_n` entries per tile, `num_stages` of them in flight, `num_warps`
    warps per program (None: `decode_layout`'s choice)."""
    block_n: int
    num_warps: int
    num_stages: int


def check_tiles(tiles) -> Tiles | None:
    """`tiles` (a Tiles or None), or a TypeError/ValueError naming the field: block_n a power of two of at least
    16 (a dot's minimum), num_warps a power of two up to 16, num_stages 1 to 6."""
    if tiles is None:
        return None
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a utils.mla.decode.Tiles or None, got {type(tiles).__name__}")
    for name, value in tiles._asdict().items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"tiles.{name} must be a positive int, got {value!r}")
    if tiles.block_n < 16 or tiles.block_n & (tiles.block_n - 1):
        raise ValueError(f"tiles.block_n must be a power of two of at least 16, got {tiles.block_n}")
    if tiles.num_warps > 16 or tiles.num_warps & (tiles.num_warps - 1):
        raise ValueError(f"tiles.num_warps must be 1, 2, 4, 8 or 16, got {tiles.num_warps}")
    if tiles.num_stages > 6:
        raise ValueError(f"tiles.num_stages must be at most 6, got {tiles.num_stages}")
    return tiles


def pick_splits(batch: int, seqlen: int, *, row_blocks: int = 1, block_n: int = 32, num_sms: int = 132,
                per_sm: int = 1) -> int:
    """Slices of the cache per sequence: the most that keep the batch × row_blocks × splits programs within one
    wave of `per_sm` programs on each of `num_sms` SMs (a second, part-filled wave would leave SMs idle while it
    runs), but no slice shorter than MIN_SPLIT_TILES tiles of `block_n` entries of the `seqlen`-long cache, and
    at most MAX_SPLITS."""
    programs = batch * row_blocks
    return max(1, min(per_sm * num_sms // programs, seqlen // (MIN_SPLIT_TILES * block_n), MAX_SPLITS))


def candidate_tiles(latent_dim: int, block_m: int = 64) -> list[Tiles]:
    """decode_layout's tiles for programs of `block_m` rows first, then the ones `mla_decode` tries if Triton
    refuses them for want of shared memory (utils.tiled.forward.first_that_launches), fastest first.
    At r >= 256 a program's shared memory is mostly the c tiles in flight, plus the copies Triton makes to feed c
    to both products. From the H200 sweep (images/11_mla_sweep_h200.json): 64 rows (128 heads) are fastest with
    64-entry tiles, two in flight, 8 warps; 16 rows (16 heads) with 64-entry tiles, two in flight, 4 warps, and
    two programs per SM's worth of splits (decode_layout). Triton 3.7 asks more shared memory of the same tiles
    than 3.6: compiled for sm_90, 64 rows fit the H200's 227 KiB per block only with 32-entry tiles, two in
    flight, or smaller."""
    if latent_dim < 256:
        return [Tiles(64, 4, 3), Tiles(32, 4, 2)]
    wide = [Tiles(64, 8, 2), Tiles(32, 8, 3), Tiles(64, 8, 1), Tiles(32, 8, 2), Tiles(16, 8, 3), Tiles(16, 8, 1)]
    return [Tiles(64, 4, 2), *wide] if block_m <= 16 else wide   # 8 warps: threads for a 64 × r accumulator


def block_rows(rows: int) -> int:
    """Query rows (heads × new tokens) per program: padded to a dot's minimum of 16, capped at 64."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def decode_layout(batch: int, heads: int, n_q: int, seqlen: int, latent_dim: int, *, num_splits=None,
                  num_sms: int = 132, tiles: Tiles | None = None) -> Layout:
    """The grid and tiles `mla_decode` launches with (pure Python; tiles None: candidate_tiles' first). Rows are
    padded to a dot's minimum of 16 and capped at 64: the fp32 accumulator is BLOCK_M × r (128 KiB at 64 × 512),
    held in registers."""
    rows = heads * n_q
    block_m = block_rows(rows)
    block_n, num_warps, num_stages = tiles or candidate_tiles(latent_dim, block_m)[0]
    row_blocks = cdiv(rows, block_m)
    if num_splits is None:   # 16-row programs: the sweep found two per SM fastest
        num_splits = pick_splits(batch, seqlen, row_blocks=row_blocks, block_n=block_n, num_sms=num_sms,
                                 per_sm=2 if block_m <= 16 else 1)
    return Layout((row_blocks, num_splits, batch), block_m, block_n, row_blocks, num_splits, num_warps, num_stages)


def _check_dtype_and_device(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q_latent has {like.dtype}; they must match")
    check_device(name, t, "triton")


def check_mla_inputs(q_latent, q_rope, c, k_rope, *, names=("q_latent", "q_rope", "c", "k_rope")):
    """`check_latent_shapes` plus what the kernel needs: fp16/bf16/fp32 of one dtype, CUDA tensors (or the
    interpreter), a latent dim in LATENT_DIMS and a rope dim in ROPE_DIMS. Returns (B, H, Nq, N, r, d_rope)."""
    shape = check_latent_shapes(q_latent, q_rope, c, k_rope, names=names)
    for name, t in zip(names, (q_latent, q_rope, c, k_rope)):
        _check_dtype_and_device(name, t, q_latent)
    latent, rope = shape[4], shape[5]
    if latent not in LATENT_DIMS:
        raise ValueError(f"{names[0]}'s latent dim {latent} is not supported: one of {LATENT_DIMS}")
    if rope not in ROPE_DIMS:
        raise ValueError(f"{names[1]}'s rope dim {rope} is not supported: one of {ROPE_DIMS}")
    return shape


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return num_splits


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernel steps the last dim by 1. A view of a wider cache (c = kv[..., :r]) already does: not copied.
    return t if t.stride(-1) == 1 else t.contiguous()


def _decode(q_latent, q_rope, c, k_rope, seqlens, *, scale: float, num_splits, tiles=None):
    """Launch the kernel on validated inputs (seqlens: int32), then merge the splits: (o_latent, lse)."""
    out_dtype = q_latent.dtype
    if q_latent.device.type == "cpu" and out_dtype == torch.bfloat16:   # the interpreter has no bf16 arithmetic
        q_latent, q_rope, c, k_rope = (t.float() for t in (q_latent, q_rope, c, k_rope))
    q_latent, q_rope, c, k_rope = (_unit_stride(t) for t in (q_latent, q_rope, c, k_rope))
    batch, heads, n_q, latent = q_latent.shape

    def launch(tiles):
        layout = decode_layout(batch, heads, n_q, c.shape[1], latent, num_splits=num_splits,
                               num_sms=default_num_sms(q_latent.device), tiles=tiles)
        o_parts = torch.empty(batch, heads, n_q, layout.num_splits, latent, device=c.device, dtype=torch.float32)
        lse_parts = torch.empty(batch, heads, n_q, layout.num_splits, device=c.device, dtype=torch.float32)
        mla_decode_kernel[layout.grid](
            q_latent, q_rope, c, k_rope, o_parts, lse_parts, seqlens,
            *q_latent.stride()[:3], *q_rope.stride()[:3], *c.stride()[:2], *k_rope.stride()[:2],
            *o_parts.stride()[:4], *lse_parts.stride(), heads * n_q, n_q, scale * LOG2E,
            BLOCK_M=layout.block_m, BLOCK_N=layout.block_n, LATENT=latent, ROPE=q_rope.shape[3],
            num_warps=layout.num_warps, num_stages=layout.num_stages)
        return o_parts, lse_parts

    if tiles is None and c.is_cuda:   # the first tiles Triton can launch on this GPU
        o_parts, lse_parts = first_that_launches(launch, candidate_tiles(latent, block_rows(heads * n_q)))
    else:
        o_parts, lse_parts = launch(tiles)
    o, lse = merge_partials(o_parts, lse_parts, out_dtype=q_latent.dtype)
    return o.to(out_dtype), lse   # .to: a no-op except for bf16 on the CPU


def mla_decode(q_latent, q_rope, c, k_rope, seqlens=None, *, sm_scale=DEEPSEEK_SM_SCALE, num_splits=None,
               tiles=None):
    """MLA decoding over a latent cache: attention of absorbed queries, split over the cache.

    - q_latent (B, H, Nq, r): W_UK_h^T q_nope,h per head (`utils.mla.reference.absorb`); q_rope (B, H, Nq, d_rope);
    - c (B, N, r): the latent cache, keys' first part and values; k_rope (B, N, d_rope): the rope keys. Views
      of one (B, N, r + d_rope) cache, as servers keep it, are read in place;
    - seqlens (B,) int32/int64: valid entries per sequence, the Nq new tokens last (None: all N); new token i
      sees entries j <= i + L - Nq. Checked on the host at every call (on a GPU, a sync);
    - sm_scale: 1/sqrt(d_nope + d_rope) of the un-absorbed head dim (default DeepSeek's 1/sqrt(128 + 64));
    - num_splits: slices of the cache per sequence (None: `pick_splits`);
    - tiles: a Tiles (None: the first of `candidate_tiles` that Triton launches on this GPU).
    r in LATENT_DIMS, d_rope in ROPE_DIMS; fp16, bf16 or fp32 (bf16 computed in fp32 on the CPU interpreter).
    Returns (o_latent (B, H, Nq, r) in q_latent's dtype, lse (B, H, Nq) fp32, -inf where no entry was seen);
    W_UV_h o_latent,h is head h's output (`utils.mla.reference.up_project`).
    """
    batch, _, _, n_k, _, _ = check_mla_inputs(q_latent, q_rope, c, k_rope)
    scale = check_mla_scale(sm_scale)
    num_splits = _check_num_splits(num_splits)
    tiles = check_tiles(tiles)
    lengths = check_seqlens(seqlens, batch, n_k, q_latent.device, like="q_latent")
    return _decode(q_latent, q_rope, c, k_rope, lengths, scale=scale, num_splits=num_splits, tiles=tiles)
