"""The registry of every attention implementation the course builds.

Each entry names a function `fn(q, k, v, *, causal=False, sm_scale=None) -> Tensor` on `(batch, heads, seq,
head_dim)` tensors by "module:function"; it is imported only when asked for, so importing this module
compiles and defines nothing. Tests, benchmarks and the summary notebook iterate over `implementations()`.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Implementation:
    name: str
    target: str             # "module:function"
    runs_on: str            # "any": torch code; "triton": CUDA or the interpreter; "cuda": CUDA only
    summary: str
    notebook: str
    head_dims: tuple | None = None  # None: any head dim
    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    causal: bool = True             # supports causal=True
    gqa: bool = True                # supports K/V with fewer heads than Q
    capability: tuple | None = None  # the one GPU generation it runs on (sm_90a code: (9, 0)); None: any
    grad_dtypes: tuple = ()          # the dtypes it is differentiable in (a backward pass); (): forward only

    def available(self, device: torch.device) -> bool:
        if self.runs_on == "any":
            return True
        if self.runs_on == "triton":
            return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
        if self.capability is not None and device.type == "cuda":
            from utils import gpu

            return gpu.capability(device) == self.capability
        return device.type == "cuda"

    def load(self):
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


REGISTRY = {impl.name: impl for impl in [
    Implementation("sdpa", "utils.eager.reference:sdpa_attention", "any",
                   "torch.nn.functional.scaled_dot_product_attention (PyTorch picks the backend)", "01",
                   grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
    Implementation("naive", "utils.eager.reference:naive_attention", "any",
                   "matmul, explicit mask, softmax, matmul: the N×N matrices in memory", "01", grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
    Implementation("flash1_pytorch", "utils.eager.forward:flash1_attention", "any",
                   "FlashAttention Algorithm 1: outer loop over K/V blocks, O, l, m updated in HBM per block", "03"),
    Implementation("flash2_pytorch", "utils.eager.forward:flash2_attention", "any",
                   "FlashAttention-2 order: one program per Q block, delayed normalisation, log-sum-exp", "04"),
    Implementation("flash_decoding", "utils.decoding.split_kv:flash_decoding_attention", "triton",
                   "split-KV flash-decoding: partial outputs per slice of the keys, merged by log-sum-exp", "08"),
    Implementation("triton", "utils.tiled.fast.backward:flash_attention", "triton",
                   "FlashAttention-2 forward in Triton (interpreted on a CPU; bf16 there computed in fp32), backward "
                   "of notebook 07", "05", head_dims=tuple(range(16, 257)), grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
    Implementation("triton_lesson", "utils.tiled.attention:flash_attention", "triton",
                   "notebook 05's FlashAttention-2 forward and notebook 07's backward as taught: one path, one "
                   "launch (interpreted on a CPU; bf16 there computed in fp32)", "05", head_dims=tuple(range(16, 257)),
                   grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
    Implementation("flex_triton", "utils.flex:flex_attention", "triton",
                   "notebook 05/07's kernels with score/mask modifiers and block sparsity (here: no mask or causal)",
                   "10", head_dims=tuple(range(16, 257)), grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
    Implementation("cuda_naive", "utils.native.kernels:flash_naive", "cuda",
                   "CUDA via load_inline, one thread per query row, K/V tiles in shared memory", "06",
                   head_dims=tuple(range(8, 129, 8))),
    Implementation("cuda_tiled", "utils.native.kernels:flash_tiled", "cuda",
                   "CUDA via load_inline, FlashAttention-2 tiling on CUDA cores (fp32 accumulation)", "06",
                   head_dims=tuple(range(8, 257, 8))),
    Implementation("cuda", "utils.native.backward:flash_attention_cuda", "cuda",
                   "CUDA FlashAttention-2 on tensor cores (mma.sync, ldmatrix, swizzle, cp.async; fp32 inputs and "
                   "pre-sm_80 GPUs run cuda_tiled), its backward on tensor cores too; head dims other than 64 and 128 "
                   "padded to them", "06b", head_dims=tuple(range(16, 129, 16)),
                   grad_dtypes=(torch.float16, torch.bfloat16)),
    Implementation("cuda_hopper", "utils.native.hopper_backward:flash_hopper_attention", "cuda",
                   "CUDA FlashAttention-2 on Hopper: TMA copies, wgmma from shared memory and from registers; "
                   "backward: the Gluon backward's schedule in CUDA (H100/H200 only)", "06c", head_dims=(64, 128),
                   dtypes=(torch.float16, torch.bfloat16), capability=(9, 0),
                   grad_dtypes=(torch.float16, torch.bfloat16)),
    Implementation("gluon", "utils.explicit.backward:flash_attention_gluon", "cuda",
                   "FlashAttention-3's intra-warpgroup overlap in Gluon (Triton's lower level): explicit wgmma "
                   "waits, a TMA ring with mbarriers (H100/H200 only); backward: one warp-specialised Gluon "
                   "kernel (07)",
                   "05b", head_dims=(64, 128), dtypes=(torch.float16, torch.bfloat16), capability=(9, 0),
                   grad_dtypes=(torch.float16, torch.bfloat16)),
    Implementation("gluon_ws", "utils.explicit.backward:flash_attention_gluon_ws", "cuda",
                   "the Gluon forward warp-specialised: a producer warp issues the TMA copies, two consumer "
                   "warpgroups share a 128-row tile, per-slot full/empty mbarriers (H100/H200 only); backward as "
                   "gluon's",
                   "05b", head_dims=(64, 128), dtypes=(torch.float16, torch.bfloat16), capability=(9, 0),
                   grad_dtypes=(torch.float16, torch.bfloat16)),
    Implementation("gluon_ws3", "utils.explicit.backward:flash_attention_gluon_ws3", "cuda",
                   "gluon_ws with three consumer warpgroups: 192 query rows a program, each K/V tile read for "
                   "192 queries (head dim 64; H100/H200 only); backward as gluon's",
                   "05b", head_dims=(64,), dtypes=(torch.float16, torch.bfloat16), capability=(9, 0),
                   grad_dtypes=(torch.float16, torch.bfloat16)),
    Implementation("flash2_pytorch_autograd", "utils.eager.backward:flash_attention_pytorch", "any",
                   "differentiable tiled PyTorch: online-softmax forward, FA2-order tiled backward", "07",
                   grad_dtypes=(torch.float16, torch.bfloat16, torch.float32)),
]}


def implementations(device=None) -> dict:
    """{name: fn} for every registered implementation that can run on `device` (default: cuda if available)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    device = torch.device(device)
    return {name: impl.load() for name, impl in REGISTRY.items() if impl.available(device)}
