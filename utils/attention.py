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

    def available(self, device: torch.device) -> bool:
        if self.runs_on == "any":
            return True
        if self.runs_on == "triton":
            return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
        return device.type == "cuda"

    def load(self):
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


REGISTRY = {impl.name: impl for impl in [
    Implementation("sdpa", "utils.reference:sdpa_attention", "any",
                   "torch.nn.functional.scaled_dot_product_attention (PyTorch picks the backend)", "01"),
    Implementation("naive", "utils.reference:naive_attention", "any",
                   "matmul, explicit mask, softmax, matmul: the N×N matrices in memory", "01"),
]}


def implementations(device=None) -> dict:
    """{name: fn} for every registered implementation that can run on `device` (default: cuda if available)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    device = torch.device(device)
    return {name: impl.load() for name, impl in REGISTRY.items() if impl.available(device)}
