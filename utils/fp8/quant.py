"""FP8 (e4m3) quantisation for attention, in PyTorch: per-tensor and per-block scales, and the random Hadamard
rotation of FlashAttention-3's "incoherent processing" (notebook 11).

float8_e4m3fn has 4 exponent bits and 3 mantissa bits: normal numbers from 2^-6 to 448 with 2^-3 relative
spacing, subnormals down to 2^-9, no infinity. A tensor x is stored as x_fp8 = round(x / scale) with
scale = amax(x) / 448, so that its largest magnitude lands on the largest fp8 number; x ≈ x_fp8 · scale. Every
function here runs on the CPU as well as on a GPU (PyTorch casts to float8_e4m3fn on both).
"""
from __future__ import annotations

import math

import torch

from utils.checks import check_int, positive_int

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # torch.finfo(torch.float8_e4m3fn).max
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(name: str, x, min_dims: int = 1) -> torch.Tensor:
    """`x`, or a TypeError/ValueError naming `name` unless it is a non-empty floating tensor of >= `min_dims` dims."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in INPUT_DTYPES)
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {names}")
    if x.dim() < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dims, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    return x


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to float8_e4m3fn (to nearest, ties to even). The clamp saturates at ±448 as the GPU's
    cvt.rn.satfinite does: x / scale can land a rounding error above 448, and e4m3fn has no infinity."""
    return (x.detach().float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_tensor(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, scale): one fp32 scale for the whole tensor, amax / 448 (1 for an all-zero tensor); x ≈ x_fp8 · scale.
    The scale stays a 0-dim tensor on x's device: no copy to the host."""
    check_float_tensor("x", x)
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_fp8(x, scale), scale


def quantize_per_block(x, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, scales) for x of shape (..., seq, head_dim): one fp32 scale per `block` rows along seq, for each index
    of the leading dims (each batch and head). scales has shape (..., ceil(seq / block)); the last block may be
    short. A block's scale is its own amax / 448 (1 for an all-zero block), so a large value in one block does
    not coarsen the others."""
    check_float_tensor("x", x, min_dims=2)
    positive_int("block", block)
    *lead, n, d = x.shape
    blocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(x.detach().float(), (0, 0, 0, blocks * block - n))   # zeros: amax unchanged
    amax = padded.reshape(*lead, blocks, block * d).abs().amax(-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_fp8(x, expand_block_scales(scales, block, n)), scales


def expand_block_scales(scales: torch.Tensor, block: int, seq: int) -> torch.Tensor:
    """Per-block scales (..., blocks) as one scale per row, (..., seq, 1), to broadcast over head_dim."""
    return scales.repeat_interleave(block, dim=-1)[..., :seq, None]


def dequantize_per_tensor(x_fp8: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """x_fp8 · scale in `dtype`."""
    return x_fp8.to(dtype) * scale.to(dtype)


def dequantize_per_block(x_fp8: torch.Tensor, scales: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """x_fp8 · (its block's scale), in `dtype`: the inverse of quantize_per_block up to fp8 rounding."""
    return x_fp8.to(dtype) * expand_block_scales(scales.to(dtype), block, x_fp8.shape[-2])


def hadamard(d: int, *, seed: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """A random orthonormal d×d Hadamard matrix, H·Hᵀ = I: Sylvester's ±1 matrix (H₂ₙ = [[Hₙ, Hₙ], [Hₙ, -Hₙ]]) with
    its columns' signs flipped by a random ±1 diagonal (from `seed`), divided by sqrt(d). d: a power of two.

    Every entry has magnitude 1/sqrt(d), so x·H spreads each channel of x over all d channels: a few large
    channels (outliers) become many moderate ones."""
    check_int("d", d, low=1)
    if d & (d - 1):
        raise ValueError(f"d must be a power of two, got {d}")
    check_int("seed", seed)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).to(torch.float64) * 2 - 1
    return (h * signs / math.sqrt(d)).to(device=device, dtype=dtype)


def rotate(q, k, h) -> tuple[torch.Tensor, torch.Tensor]:
    """(q·H, k·H) over the head dim. H orthonormal: (qH)(kH)ᵀ = q·H·Hᵀ·kᵀ = q·kᵀ, so attention's scores are unchanged
    (V is not rotated: the output stays in V's basis). Computed in fp32 at least, returned in that dtype."""
    check_float_tensor("q", q)
    check_float_tensor("k", k)
    check_float_tensor("h", h, min_dims=2)
    d = q.shape[-1]
    if h.dim() != 2 or h.shape != (d, d):
        raise ValueError(f"h must be a ({d}, {d}) matrix for q's head_dim {d}, got shape {tuple(h.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has {d}; they must match")
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    h = h.to(device=q.device, dtype=dtype)
    return q.to(dtype) @ h, k.to(dtype) @ h
