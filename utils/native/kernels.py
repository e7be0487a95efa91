"""The Python entry points of the course's CUDA kernels: each validates its inputs, then builds its extension on
first use (utils.native.build.load) and launches it.

- `softmax` (notebook 06's four softmax kernels), `flash_naive` and `flash_tiled` (notebook 06's FlashAttention
  forwards on CUDA cores), `flash_mma` (the tensor-core kernel of notebook 06b, one build per step of its worklog);
- `check_mma_capability`: whether a GPU runs the tensor-core kernels.

They validate their inputs before any compile or launch (the TORCH_CHECKs in the .cu files are the second line of
defence). The registry's "cuda", `flash_attention_cuda`, is differentiable and so lives with the backward, in
utils.native.backward.
"""
from __future__ import annotations

import torch

from utils import gpu
from utils.checks import CUDA_GRID_Y, check_attention_inputs, check_capability, check_device, resolve_scale
from utils.native import build
from utils.native.build import MMA_DEFAULT_STEP, mma_kernel_name

MMA_HEAD_DIMS = (64, 128)
# The registry's "cuda" takes every multiple of 16 up to 128: a head dim between the kernels' own is zero-padded to
# the next one (zero columns add nothing to Q Kᵀ, and V's give output columns that are cut off).
CUDA_HEAD_DIMS = tuple(range(16, 129, 16))
MMA_DTYPES = (torch.float16, torch.bfloat16)
SOFTMAX_VARIANTS = ("smem", "warp", "float4", "row_per_warp")
# Multiples of 8; the kernels pad the head dim to 32/64/128(/256) internally. The naive kernel keeps two rows
# of D floats per thread in registers and stops at 128.
NAIVE_HEAD_DIMS = tuple(range(8, 129, 8))
TILED_HEAD_DIMS = tuple(range(8, 257, 8))
FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def softmax(x, variant: str = "warp"):
    """Softmax over the last dim of a float32 CUDA tensor with one of the SOFTMAX_VARIANTS kernels."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if variant not in SOFTMAX_VARIANTS:
        raise ValueError(f"variant must be one of {SOFTMAX_VARIANTS}, got {variant!r}")
    if x.dtype != torch.float32:
        raise TypeError(f"x has dtype {x.dtype}; these kernels take float32")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x must have at least one dim and one element, got shape {tuple(x.shape)}")
    if not x.is_cuda:
        raise ValueError(f"x is on {x.device}; the CUDA kernels need a CUDA tensor")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return build.load("softmax").softmax_forward(rows, SOFTMAX_VARIANTS.index(variant)).view(x.shape)


def _flash(name, q, k, v, causal, sm_scale, head_dims):
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=head_dims, dtypes=FLASH_DTYPES,
                                   max_batch_heads=CUDA_GRID_Y)
    scale = resolve_scale(sm_scale, shape.head_dim)
    check_device("q", q, "cuda")
    # Any strides work except along head_dim, where the kernels read consecutive elements.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return getattr(build.load(name), f"{name}_forward")(q, k, v, causal, scale)


def flash_naive(q, k, v, *, causal=False, sm_scale=None):
    """FlashAttention forward in CUDA, one thread per query row (utils/native/src/flash_naive.cu)."""
    return _flash("flash_naive", q, k, v, causal, sm_scale, NAIVE_HEAD_DIMS)


def flash_tiled(q, k, v, *, causal=False, sm_scale=None):
    """FlashAttention-2 forward in CUDA, tiled over queries and keys (utils/native/src/flash_tiled.cu)."""
    return _flash("flash_tiled", q, k, v, causal, sm_scale, TILED_HEAD_DIMS)


def check_mma_capability(capability) -> None:
    """Raise a RuntimeError that explains why, unless a GPU of this (major, minor) can run the mma kernels."""
    if check_capability(capability) < (8, 0):
        raise RuntimeError(
            f"the tensor-core kernels need compute capability 8.0 or newer (mma.sync.m16n8k16 with bf16 inputs, "
            f"ldmatrix, cp.async); this GPU is sm_{capability[0]}{capability[1]}. flash_tiled runs on it (CUDA "
            f"cores), and so does the registry's \"cuda\" entry, which falls back to it.")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy unless every row starts on 16 bytes (the kernels copy rows in 16-byte chunks).
    A copy, not .contiguous(): that returns a contiguous view at an odd address unchanged."""
    ok = t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
    return t if ok else t.clone(memory_format=torch.contiguous_format)


_MMA_FORWARD: dict = {}


def flash_mma(q, k, v, *, causal=False, sm_scale=None, step: str = MMA_DEFAULT_STEP):
    """FlashAttention-2 forward on tensor cores, as of `step` of notebooks 06b (steps 1-7) and 06bw (8-15) (default:
    MMA_DEFAULT_STEP, the fastest measured).

    fp16 or bf16 inputs with fp32 accumulation, head dims 64 and 128, any lengths, GQA, causal aligned
    bottom-right. Needs an sm_80+ GPU; on a T4 (sm_75) it refuses with a RuntimeError (flash_tiled runs there).
    """
    name = mma_kernel_name(step)
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=MMA_HEAD_DIMS, dtypes=MMA_DTYPES,
                                   max_batch_heads=CUDA_GRID_Y)
    scale = resolve_scale(sm_scale, shape.head_dim)
    check_device("q", q, "cuda")
    capability = gpu.capability(q.device)
    check_mma_capability(capability)
    if (name, capability) not in _MMA_FORWARD:  # load() once: its check for edited sources costs ~30 µs a call
        _MMA_FORWARD[name, capability] = getattr(build.load(name), f"{name}_forward")
    return _MMA_FORWARD[name, capability](_aligned(q), _aligned(k), _aligned(v), causal, scale)
