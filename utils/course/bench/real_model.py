"""Training-step time of a small decoder with the course's attention operator against SDPA: eager, compiled
by Inductor, and compiled with CUDA graphs (notebook 07b).

    python -m utils.course.bench.real_model            # writes images/07b_real_model_h200.json

The model is utils.ops.model.Decoder in bf16 on one GPU. A step is the forward, the cross-entropy loss and the
backward; the optimizer's update is left out (the same for every attention). Every row is measured in one run,
side by side, with triton.testing.do_bench (median, gradients reset between calls). Each row also records the
loss of its first step: the same weights and tokens give the same loss with any attention, up to bf16 rounding.

SDPA runs three ways: its own choice of backend (`sdpa`), and pinned to FlashAttention-2 (`sdpa_flash`) or
cuDNN (`sdpa_cudnn`) with torch.nn.attention.sdpa_kernel. Each SDPA row records the backend whose kernels one
profiled step launched. A pinned row whose backend refuses the shape, or that torch.compile does not keep (it
may choose its own), gives its reason instead of a time.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ATTENTIONS = ("sdpa", "sdpa_flash", "sdpa_cudnn", "triton", "triton_lesson")
# names in SDPBackend; each row's name past "sdpa_" is the backend's name in BACKEND_MARKERS
SDPA_PINNED = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
# A backend by the names of the CUDA kernels it launches (torch 2.11's flash and cuDNN, the memory-efficient one)
BACKEND_MARKERS = {"flash": ("pytorch_flash::",), "cudnn": ("cudnn", "sdpa"), "efficient": ("fmha_cutlass",)}

# torch.compile's options per mode; None: eager
MODES = {"eager": None, "compiled": dict(fullgraph=True), "cuda_graphs": dict(fullgraph=True, mode="reduce-overhead")}
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "images" / "07b_real_model_h200.json"


def backend_of(kernel_names) -> str:
    """flash, cudnn or efficient: the SDPA backend among these CUDA kernel names; unknown if none is (the math
    backend, or kernels the profiler did not see)."""
    for backend, markers in BACKEND_MARKERS.items():
        if any(all(m in name for m in markers) for name in kernel_names):
            return backend
    return "unknown"


def attention_function(name: str):
    """The attend(q, k, v) of `name`: SDPA, or the operator of one of the course's kernels."""
    from utils.ops import attention as ops
    from utils.ops.model import sdpa_causal

    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {name!r}")
    if name.startswith("sdpa"):
        return sdpa_causal   # pinned backends: measure() holds the choice for the whole step
    return partial(ops.attention, causal=True, kernel=name)


def measure(attention: str, mode: str, *, batch: int, seq: int, dim: int, heads: int, kv_heads: int, layers: int,
            vocab: int, rep: int) -> dict:
    """One row: the median step time in ms of `attention` in `mode`, and the loss of its first step. A pinned
    SDPA backend that cannot run the shape gives a row with its `error` instead."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    pinned = SDPA_PINNED.get(attention)
    shape = dict(batch=batch, seq=seq, dim=dim, heads=heads, kv_heads=kv_heads, layers=layers, vocab=vocab, rep=rep)
    if pinned is None:
        return _measure(attention, mode, **shape)
    with sdpa_kernel([getattr(SDPBackend, pinned)]):
        try:
            row = _measure(attention, mode, **shape)
        except RuntimeError as err:   # "No available kernel": the backend refused the inputs
            return dict(attention=attention, mode=mode, error=str(err).strip().splitlines()[0][:300])
    if row["backend"] not in (attention.removeprefix("sdpa_"), "unknown"):   # torch.compile chose its own backend
        return dict(attention=attention, mode=mode, error=f"not kept: this mode ran {row['backend']}")
    return row


def _measure(attention: str, mode: str, *, batch, seq, dim, heads, kv_heads, layers, vocab, rep) -> dict:
    import triton

    from utils.ops.model import Decoder

    torch.manual_seed(0)   # the same weights and tokens for every row
    model = Decoder(attention_function(attention), vocab, dim, heads, kv_heads, layers).to("cuda", torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
    forward = model if MODES[mode] is None else torch.compile(model, **MODES[mode])

    def step():
        model.zero_grad(set_to_none=True)   # under CUDA graphs last step's gradients live in memory it reuses
        if mode == "cuda_graphs":
            torch.compiler.cudagraph_mark_step_begin()   # a new step: the graphs' outputs of the last may be reused
        logits = forward(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return loss

    first = step().item()
    for _ in range(2):   # compiled modes: compile and record before timing
        step()
    ms = triton.testing.do_bench(step, rep=rep)
    row = dict(attention=attention, mode=mode, ms=round(ms, 4), first_loss=first)
    if attention.startswith("sdpa"):
        row["backend"] = backend_of(_kernels_of(step))
    return row


def _kernels_of(step) -> set:
    """The names of the CUDA kernels one call of `step` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type.name == "CUDA"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.real_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    for name, default in (("batch", 4), ("seq", 2048), ("dim", 1024), ("heads", 16), ("kv-heads", 4),
                          ("layers", 4), ("vocab", 32000), ("rep", 200)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from utils import gpu

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the real-model benchmark needs a CUDA GPU")
    shape = dict(batch=args.batch, seq=args.seq, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads,
                 layers=args.layers, vocab=args.vocab)
    data = dict(environment=gpu.environment(), settings=dict(shape, dtype="bfloat16", rep_ms=args.rep), rows=[])
    for mode in args.modes:
        for attention in args.attentions:
            torch._dynamo.reset()
            row = measure(attention, mode, **shape, rep=args.rep)
            data["rows"].append(row)
            if "error" in row:
                print(f"{mode:12} {attention:14} refused: {row['error']}", flush=True)
            else:
                print(f"{mode:12} {attention:14} {row['ms']:8.2f} ms   first loss {row['first_loss']:.4f}   "
                      f"{row.get('backend', '')}", flush=True)
            args.out.write_text(json.dumps(data, indent=1) + "\n")   # after each row: a cut run keeps its rows
    return data


if __name__ == "__main__":
    main()
