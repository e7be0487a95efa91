"""Notebook 10's attention functions: `flex_attention` (modifiers and block sparsity) and `flash_varlen` (packed
sequences), differentiable, on the kernels of utils.flex.kernels."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from utils.checks import check_bool
from utils import gpu
from utils.tiled.fast.forward import launch_config, check_inputs
from utils.tiled.forward import Config, smem_estimate
from utils.tiled.fast.backward import Config as BackwardConfig, _bwd_preprocess, pick_config as pick_backward_config
from utils.tiled.fast.backward import smem_estimate as bwd_smem_estimate
from utils.flex.sparsity import BlockMask, block_mask as build_block_mask
from utils.flex.kernels import flex_bwd_kernel, flex_fwd_kernel
from utils.flex.mods import Modifier, causal as causal_modifier

LOG2E = 1.4426950408889634


class _Problem(NamedTuple):
    """What the kernels need besides the tensors: sizes, scale, modifier, block mask (None: packed sequences)."""
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int          # the longest sequence when packed
    seqlen_k: int
    head_dim: int
    scale: float
    modifier: Modifier | None
    block_mask: BlockMask | None
    causal: bool = False   # packed sequences only (block masks carry causality in their modifier)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None


def _strides(t: torch.Tensor, packed: bool) -> tuple:
    """(batch, head, row, dim) strides: (B, H, N, D) tensors as they are; packed (T, H, D) ones with batch stride
    0 (the kernel finds each sequence's first row through cu_seqlens)."""
    return (0, t.stride(1), t.stride(0), t.stride(2)) if packed else t.stride()


def _mask_args(p: _Problem, transposed: bool) -> tuple:
    """The block-mask arguments of a kernel: counts, indices, (batch, head) strides and the tile counts."""
    bm = p.block_mask
    if bm is None:
        return (None,) * 4 + (0, 0, 1, 1)
    lists = (bm.q_count, bm.q_index, bm.full_q_count, bm.full_q_index) if transposed else \
        (bm.kv_count, bm.kv_index, bm.full_kv_count, bm.full_kv_index)
    bm_, hm_, rows, _ = lists[1].shape
    qb, kb = bm.kv_index.shape[-2:]
    return (*lists, (hm_ * rows) if bm_ > 1 else 0, rows if hm_ > 1 else 0, qb, kb)


def _mod_args(p: _Problem, like: torch.Tensor) -> tuple:
    m = p.modifier
    tensor = m.tensor if m is not None and m.tensor is not None else None
    tensor = like if tensor is None else tensor.to(like.device)
    return (p.cu_q, p.cu_k, tensor, m.int_arg if m else 0, m.float_arg if m else 0.0)


def _mod_fns(p: _Problem) -> dict:
    m = p.modifier
    return dict(SCORE_MOD=m.score_mod if m else None, MASK_MOD=m.mask_mod if m and p.block_mask else None)


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _even(p: _Problem) -> bool:
    """Whether every tile is whole (the kernels then load without masks): the lengths are multiples of the block
    mask's tiles (the kernels walk each listed tile to its end); never for packed sequences (no block mask),
    whose tiles start inside a sequence."""
    bm = p.block_mask
    return bm is not None and p.seqlen_q % bm.block_m == 0 and p.seqlen_k % bm.block_n == 0


def _tiles(size: int, sparse: int | None) -> int:
    """A kernel tile no larger than the block mask's, so that it divides it."""
    return size if sparse is None else min(size, sparse)


# Tiles for 16-bit inputs with a block mask, the fastest of sweeps on an H200 (bf16, B=2, H=16, sliding window 1k
# at N=8k-32k and 8 to 32 documents at N=16k; `python -m utils.course.bench.flex` times the D=128 choice): as small as the
# block mask's 64 x 64 tiles (a kernel tile never spans two of them), smaller than notebook 05's and 07's, since
# sparse rows of tiles are short. At D=64 the forward's 2 stages beat 3 by 7-30%. Since the kernels load whole tiles
# without masks (EVEN), 64 x 64 tiles with 4 warps and 2 stages won the backward at both head dims; its two passes
# share warps and stages, so they run as one launch. Other cases take notebook 05's and 07's choices.
SPARSE_TILES = {64: (Config(64, 64, 4, 2), BackwardConfig(64, 64, 4, 2, 64, 64, 4, 2)),
                128: (Config(64, 64, 4, 3), BackwardConfig(64, 64, 4, 2, 64, 64, 4, 2))}


def pick_configs(p: _Problem, dtype, device) -> tuple:
    """(forward Config, BackwardConfig) for one problem, within the GPU's shared memory per block."""
    smem = gpu.shared_memory_per_block(device) if device.type == "cuda" else None
    return _configs(p.head_dim, p.block_mask is not None, dtype, device, smem)


@functools.lru_cache(maxsize=None)   # asked at every call: at small N the host's time per call is on the clock
def _configs(head_dim: int, masked: bool, dtype, device, smem: int | None) -> tuple:
    fwd, bwd = launch_config(head_dim, dtype, device), pick_backward_config(head_dim, dtype, True, smem)
    d = 64 if head_dim <= 64 else 128 if head_dim <= 128 else None
    if device.type != "cuda" or dtype == torch.float32 or d is None or not masked:
        return fwd, bwd
    tuned_fwd, tuned_bwd = SPARSE_TILES[d]
    if smem is None or smem_estimate(tuned_fwd, head_dim, 2) <= smem:
        fwd = tuned_fwd
    if smem is None or bwd_smem_estimate(tuned_bwd, head_dim, 2) <= smem:
        bwd = tuned_bwd
    return fwd, bwd


def _forward(q, k, v, p: _Problem, config: Config):
    packed = p.cu_q is not None
    sm, sn = (p.block_mask.block_m, p.block_mask.block_n) if p.block_mask else (None, None)
    block_m, block_n = _tiles(config.block_m, sm), _tiles(config.block_n, sn)
    o = torch.empty_like(q)
    rows = q.shape[0] if packed else p.seqlen_q
    lse = torch.empty((p.batch, p.heads, rows) if not packed else (p.heads, rows), device=q.device,
                      dtype=torch.float32)
    lse_sb, lse_sh = (0, rows) if packed else (p.heads * rows, rows)
    flex_fwd_kernel[(triton.cdiv(p.seqlen_q, block_m), p.batch * p.heads)](
        q, k, v, o, lse, *_strides(q, packed), *_strides(k, packed), *_strides(v, packed), *_strides(o, packed),
        p.heads, p.seqlen_q, p.seqlen_k, p.scale, p.scale * LOG2E, lse_sb, lse_sh,
        *_mask_args(p, transposed=False), *_mod_args(p, q), **_mod_fns(p), CAUSAL=p.causal,
        GROUP=p.heads // p.kv_heads, HEAD_DIM=p.head_dim, BLOCK_D=max(16, triton.next_power_of_2(p.head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, SPARSE_M=sm or block_m, SPARSE_N=sn or block_n,
        PRECISION=_precision(q.dtype), EVEN=_even(p), num_warps=config.num_warps, num_stages=config.num_stages)
    return o, lse


def _backward(do, q, k, v, o, lse, p: _Problem, config: BackwardConfig):
    packed = p.cu_q is not None
    sm, sn = (p.block_mask.block_m, p.block_mask.block_n) if p.block_mask else (None, None)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rows = q.shape[0] if packed else p.seqlen_q
    lse_sb, lse_sh = (0, rows) if packed else (p.heads * rows, rows)
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    block_d = max(16, triton.next_power_of_2(p.head_dim))
    pre_b = 1 if packed else p.batch   # packed: one "batch" of `rows` rows per head
    _bwd_preprocess[(triton.cdiv(rows, 64), pre_b * p.heads)](
        o, do, lse, delta, lse2, *_strides(o, packed), *_strides(do, packed), p.heads, rows, p.head_dim, 0.0,
        BLOCK_M=64, BLOCK_D=block_d, ACC=tl.float32)
    block_m1, block_n1 = _tiles(config.block_m1, sm), _tiles(config.block_n1, sn)
    block_m2, block_n2 = _tiles(config.block_m2, sm), _tiles(config.block_n2, sn)
    n_kv, n_q = triton.cdiv(p.seqlen_k, block_n1), triton.cdiv(p.seqlen_q, block_m2)
    group = p.heads // p.kv_heads

    by_q, by_kv = _mask_args(p, transposed=False), _mask_args(p, transposed=True)

    def launch(part, n_kv_programs, n_programs, warps, stages):
        flex_bwd_kernel[(n_programs, p.batch * p.kv_heads)](
            q, k, v, do, lse2, delta, dq, dk, dv,
            *(s for t in (q, k, v, do, dq, dk, dv) for s in _strides(t, packed)),
            p.kv_heads, p.seqlen_q, p.seqlen_k, p.scale, p.scale * LOG2E, lse_sb, lse_sh,
            *by_q[:6], *by_kv[:6], *by_q[6:], n_kv_programs, n_q, *_mod_args(p, q), **_mod_fns(p),
            SCORE_GRAD=p.modifier.score_grad if p.modifier else None, CAUSAL=p.causal, GROUP=group,
            HEAD_DIM=p.head_dim, BLOCK_D=block_d, BLOCK_M1=block_m1, BLOCK_N1=block_n1, BLOCK_M2=block_m2,
            BLOCK_N2=block_n2, SPARSE_M=sm or block_m1, SPARSE_N=sn or block_n1, PRECISION=_precision(q.dtype),
            PART=part, EVEN=_even(p), num_warps=warps, num_stages=stages)

    # One launch when both kinds of programs want the same warps and stages, else one launch each.
    if (config.warps1, config.stages1) == (config.warps2, config.stages2):
        launch(0, n_kv, n_kv + n_q * group, config.warps1, config.stages1)
    else:
        launch(1, n_kv, n_kv, config.warps1, config.stages1)
        launch(2, 0, n_q * group, config.warps2, config.stages2)
    return dq, dk, dv


class _FlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem):
        cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16   # the interpreter has no bf16 arithmetic
        qf, kf, vf = (t.float() for t in (q, k, v)) if cpu_bf16 else (q, k, v)
        fwd_config, ctx.config = pick_configs(problem, qf.dtype, qf.device)
        o, lse = _forward(qf, kf, vf, problem, fwd_config)
        ctx.save_for_backward(qf, kf, vf, o, lse)
        ctx.problem, ctx.dtype = problem, q.dtype
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: without this, autograd would fill a tensor of zeros for it at every backward
        ctx.set_materialize_grads(False)
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:   # nothing downstream of o gave it a gradient (lse never has one)
            return None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        grads = _backward(do.to(q.dtype).contiguous(), q, k, v, o, lse, ctx.problem, ctx.config)
        return (*(g.to(ctx.dtype) for g in grads), None)


def _check_modifier(modifier):
    if modifier is not None and not isinstance(modifier, Modifier):
        raise TypeError(f"modifier must be a utils.flex.Modifier or None, got {type(modifier).__name__}")


def _check_modifier_data(modifier, batch, heads, seqlen_q, seqlen_k):
    """A modifier's table must cover what the kernels index it by: every key (document ids; and no more queries
    than keys), or every head (ALiBi slopes); and have a row per batch entry when it has rows."""
    if modifier is None or modifier.tensor is None:
        return
    table, name = modifier.tensor, modifier.name
    if modifier.indexed_by == "position" and (table.shape[-1] != seqlen_k or seqlen_q > seqlen_k):
        raise ValueError(f"modifier {name!r} has ids for {table.shape[-1]} positions; it needs one per key "
                         f"({seqlen_k}) and no more queries than keys (got {seqlen_q})")
    if modifier.indexed_by == "head" and table.shape[-1] < heads:
        raise ValueError(f"modifier {name!r} has values for {table.shape[-1]} heads; q has {heads}")
    if modifier.per_batch and table.shape[0] != batch:
        raise ValueError(f"modifier {name!r} has ids for {table.shape[0]} batch entries, q has {batch}")


def _check_block_mask(bm, modifier, shape):
    if not isinstance(bm, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (utils.flex.block_mask) or None, got {type(bm).__name__}")
    name = modifier.name if modifier is not None else ""
    if bm.modifier != name:
        raise ValueError(f"block_mask was built for {bm.modifier or 'no mask'!r}, not {name or 'no mask'!r}")
    if (bm.seqlen_q, bm.seqlen_k) != (shape.seqlen_q, shape.seqlen_k):
        raise ValueError(f"block_mask was built for Nq={bm.seqlen_q}, Nk={bm.seqlen_k}; q and k have "
                         f"{shape.seqlen_q} and {shape.seqlen_k}")
    bm_, hm_ = bm.kv_count.shape[:2]
    if bm_ not in (1, shape.batch) or hm_ not in (1, shape.heads):
        raise ValueError(f"block_mask has (batch, heads) = ({bm_}, {hm_}); q has ({shape.batch}, {shape.heads})")


def flex_attention(q, k, v, modifier=None, *, block_mask=None, causal=False, sm_scale=None, return_lse=False):
    """Attention with a score/mask modifier (utils.flex.mods), skipping the tiles its block mask leaves empty.

    q (B, H, Nq, D), k and v (B, Hkv, Nk, D) with Hkv dividing H; fp16, bf16, fp32 (bf16 is computed in fp32 on
    a CPU); head dims 16 to 256. `causal=True` is `modifier=causal()`. `block_mask`: `utils.flex.block_mask(...)`
    for this modifier and shape, built once and reused (None: built here, every call). Differentiable. Returns O
    like q, or (O, lse) with return_lse (lse fp32 (B, H, Nq), natural log, -inf where a query sees no key).
    """
    shape, scale = check_inputs(q, k, v, causal, sm_scale)
    check_bool("return_lse", return_lse)
    _check_modifier(modifier)
    if causal and modifier is not None:
        raise ValueError("give causality through the modifier (most have causal=True), not with causal=True too")
    modifier = causal_modifier() if causal else modifier
    _check_modifier_data(modifier, shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)
    if block_mask is None:
        block_mask = build_block_mask(modifier, shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k,
                                      device=q.device)
    _check_block_mask(block_mask, modifier, shape)
    problem = _Problem(*shape, scale, modifier, block_mask)
    o, lse = _FlexFunction.apply(q, k, v, problem)
    return (o, lse) if return_lse else o


def _check_cu_seqlens(name, cu, total, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-d int32/int64 tensor of batch + 1 offsets, got {cu.dtype} "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; they must match")
    lengths = cu.diff()
    if cu[0].item() != 0 or (lengths < 0).any().item() or cu[-1].item() != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}; got "
                         f"{cu.tolist() if cu.numel() <= 16 else '...'}")
    return cu.to(torch.int32).contiguous(), int(lengths.max().item())


def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, sm_scale=None, modifier=None,
                 return_lse=False):
    """Attention over packed sequences without padding: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1].

    q (total_q, H, D), k and v (total_k, Hkv, D); cu_seqlens_q, cu_seqlens_k int32/int64 (batch + 1,), starting
    at 0 (lengths 0 and 1 allowed). Causal masking is bottom-right within each sequence. `modifier`: a score
    modifier only (softcap, ALiBi); masks are what the sequences' boundaries already are. Differentiable.
    Returns O like q, or (O, lse) with lse fp32 (H, total_q).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total, heads, head_dim), got shape {tuple(t.shape)}")
    shape, scale = check_inputs(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal,
                            sm_scale)
    check_bool("return_lse", return_lse)
    _check_modifier(modifier)
    if modifier is not None and modifier.mask_mod is not None:
        raise ValueError(f"flash_varlen takes a score modifier only; {modifier.name!r} has a mask (use "
                         "causal=True, or flex_attention with a document mask over one packed sequence)")
    _check_modifier_data(modifier, 1, shape.heads, 1, 1)
    cu_q, max_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k, max_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences, cu_seqlens_k {cu_k.numel() - 1}")
    problem = _Problem(cu_q.numel() - 1, shape.heads, shape.kv_heads, max(max_q, 1), max(max_k, 1),
                       shape.head_dim, scale, modifier, None, causal, cu_q, cu_k)
    o, lse = _FlexFunction.apply(q, k, v, problem)
    return (o, lse) if return_lse else o
