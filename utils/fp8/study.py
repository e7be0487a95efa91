"""How accurate is FP8 attention? The FP8 kernel's arithmetic emulated in PyTorch, and a table of its error against
a float64 reference for bf16, FP8 with one scale per tensor, one scale per block, and per block after a random
Hadamard rotation (notebook 11). Runs on the CPU.

The emulation follows utils.fp8.forward's kernel step by step, in float64 apart from the roundings the kernel
makes on purpose:
- Q and K are rounded to e4m3 with one scale per tensor, or one per block of `block` rows of each (batch, head)
  (utils.fp8.quant); with `rotate`, after multiplying both by the same random Hadamard matrix H (QHᵀ(KH)ᵀ = QKᵀ).
- V is rounded to e4m3 with one scale per tensor, in both schemes: its scale varies along the P·V product's
  reduction (the keys), so a scale per key block would have to match the kernel's key tile. V's error also
  reaches the output linearly, while an error in a score is amplified by the exponential.
- Scores are the dequantised Q·Kᵀ, times the softmax scale, in base 2 (exp2, as the kernel).
- P = exp2(s - m) is rounded to e4m3 with a fixed scale of 1 before P·V, as FlashAttention-3 does: after
  subtracting the row's running max, P lies in [0, 1], the top of e4m3's range is not needed, and a fixed scale
  costs nothing in the inner loop. (Probabilities under 2^-6 fall into e4m3's subnormals; under 2^-10, to 0.)
- The row sum l adds P before its rounding, in fp32 in the kernel (FlashAttention-3 does the same).
- With `block_n`, keys are folded in blocks of block_n with a running max, as the kernel's online softmax does:
  P is then rounded relative to the max so far, not the row's final max, which changes which value each p
  rounds to. To compare with the kernel, pass its block_n; None treats the whole row as one block.

What the table shows (outlier_inputs' defaults: 4 channels of 64 five times larger, N(0, 1) elsewhere; on a CPU,
seeds 0-4): FP8 per tensor is about 16x bf16's RMSE; per-block scales take off about 10%; the Hadamard rotation
then brings it to about 0.37x per-tensor (FlashAttention-3 reports 2.6x lower RMSE for both together). Most of
the gain is the rotation's: e4m3 keeps its 2^-3 relative spacing from 448 down to 2^-6 of the scale, so a scale
set by a larger block only costs precision where a block's values are ~10^4 times smaller than the largest
(then they fall into the subnormals) - one head or token far larger than the rest. An outlier channel costs
precision in every tensor: the rounding error of a dot product grows with sqrt(sum_c q_c^2 k_c^2), largest
when Q and K put their weight on the same few channels, and the rotation spreads it over all of them.
"""
from __future__ import annotations

import math

import torch

from utils.checks import check_attention_inputs, check_bool, check_int, positive_int, resolve_scale
from utils.eager.reference import causal_mask, reference_attention
from utils.fp8 import quant

LOG2E = 1.4426950408889634
SCALINGS = ("tensor", "block")
METHODS = ("bf16", "fp8 per-tensor", "fp8 per-block", "fp8 per-block + Hadamard")


def attention_fp8_emulated(q, k, v, *, scaling: str = "block", rotate: bool = False, block: int = 64,
                           causal: bool = False, sm_scale=None, block_n: int | None = None,
                           seed: int = 0) -> torch.Tensor:
    """The FP8 kernel's output computed in float64 from the same e4m3 roundings (see the module docstring):
    (batch, heads, seqlen_q, head_dim), float64. `scaling`: "tensor" (one scale for all of Q, one for K) or
    "block" (one per `block` rows of each (batch, head)); `rotate`: multiply Q and K by a random Hadamard matrix
    from `seed` first; `block_n`: fold keys in blocks of this size with a running max (None: one block)."""
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    check_bool("rotate", rotate)
    positive_int("block", block)
    if block_n is not None:
        positive_int("block_n", block_n)
    check_int("seed", seed)
    if rotate and shape.head_dim & (shape.head_dim - 1):
        raise ValueError(f"rotate needs a power-of-two head_dim (a Hadamard matrix), got {shape.head_dim}")
    if rotate:
        q, k = quant.rotate(q, k, quant.hadamard(shape.head_dim, seed=seed, device=q.device))
    if scaling == "tensor":
        qd, kd = (quant.dequantize_per_tensor(*quant.quantize_per_tensor(x), dtype=torch.float64) for x in (q, k))
    else:
        qd, kd = (quant.dequantize_per_block(*quant.quantize_per_block(x, block), block, dtype=torch.float64)
                  for x in (q, k))
    vd = quant.dequantize_per_tensor(*quant.quantize_per_tensor(v), dtype=torch.float64)
    p_to_fp8 = lambda p: p.to(quant.FP8).to(torch.float64)   # noqa: E731 (fixed scale 1: P is in [0, 1])
    return _attend(qd, kd, vd, shape, scale, causal, p_to_fp8, block_n)


def attention_bf16_emulated(q, k, v, *, causal: bool = False, sm_scale=None) -> torch.Tensor:
    """A bf16 kernel's output in float64: Q, K, V rounded to bf16, P rounded to bf16 before P·V (as notebook 05's
    kernel does), everything else exact. The baseline the FP8 rows are compared with."""
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    qd, kd, vd = (x.to(torch.bfloat16).to(torch.float64) for x in (q, k, v))
    p_to_bf16 = lambda p: p.to(torch.bfloat16).to(torch.float64)   # noqa: E731
    return _attend(qd, kd, vd, shape, scale, causal, p_to_bf16, None)


def _attend(qd, kd, vd, shape, scale, causal, round_p, block_n):
    """softmax(Q·Kᵀ·scale)·V in float64 with P rounded by `round_p` before P·V, keys folded in blocks of block_n."""
    group = shape.heads // shape.kv_heads
    kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
    s2 = (qd @ kd.transpose(-2, -1)) * (scale * LOG2E)            # base 2: exp2(s2) = exp(s · scale)
    if causal:
        s2 = s2.masked_fill(~causal_mask(shape.seqlen_q, shape.seqlen_k, s2.device), float("-inf"))
    step = shape.seqlen_k if block_n is None else block_n
    m = torch.full(s2.shape[:-1], float("-inf"), dtype=torch.float64, device=s2.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(*s2.shape[:-1], shape.head_dim, dtype=torch.float64, device=s2.device)
    for lo in range(0, shape.seqlen_k, step):
        s_blk = s2[..., lo:lo + step]
        m_new = torch.maximum(m, s_blk.amax(-1))
        m_sub = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
        p = torch.exp2(s_blk - m_sub[..., None])
        alpha = torch.exp2(m - m_sub)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + round_p(p) @ vd[..., lo:lo + step, :]
        m = m_new
    return torch.where(l[..., None] > 0, acc / torch.where(l > 0, l, 1.0)[..., None], 0.0)


def outlier_inputs(b: int, h: int, n: int, d: int, *, outlier_channels: int = 4, outlier_scale: float = 5.0,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), fp32, (b, h, n, d), N(0, 1) entries, except that Q and K have `outlier_channels` channels per head
    (the same ones in Q and K, chosen at random) `outlier_scale` times larger, as the query and key activations of
    trained LLMs have."""
    for name, x in (("b", b), ("h", h), ("n", n), ("d", d)):
        positive_int(name, x)
    check_int("outlier_channels", outlier_channels, low=0, high=d)
    if isinstance(outlier_scale, bool) or not isinstance(outlier_scale, (int, float)) or not outlier_scale > 0:
        raise ValueError(f"outlier_scale must be a positive number, got {outlier_scale!r}")
    check_int("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    channels = torch.rand(h, d, generator=gen).argsort(-1)[:, :outlier_channels]     # per head
    gain = torch.ones(h, d).scatter_(1, channels, float(outlier_scale))[None, :, None, :]
    return q * gain, k * gain, v


def accuracy_table(q, k, v, *, causal: bool = False, block: int = 64, seed: int = 0) -> list[dict]:
    """One row per method of METHODS: {method, rmse, max_abs}, the root-mean-square and largest absolute error of
    its output against reference_attention (float64)."""
    ref = reference_attention(q, k, v, causal=causal)
    outputs = {
        "bf16": attention_bf16_emulated(q, k, v, causal=causal),
        "fp8 per-tensor": attention_fp8_emulated(q, k, v, scaling="tensor", causal=causal),
        "fp8 per-block": attention_fp8_emulated(q, k, v, scaling="block", block=block, causal=causal),
        "fp8 per-block + Hadamard": attention_fp8_emulated(q, k, v, scaling="block", block=block, rotate=True,
                                                           causal=causal, seed=seed),
    }
    rows = []
    for method, out in outputs.items():
        err = (out - ref).abs()
        rows.append(dict(method=method, rmse=math.sqrt(err.square().mean().item()), max_abs=err.max().item()))
    return rows


def format_accuracy_table(rows: list[dict]) -> str:
    """The rows as text: method, RMSE, max abs error, and RMSE relative to the first FP8 row."""
    base = next((r["rmse"] for r in rows if r["method"].startswith("fp8")), None)
    lines = [f"{'method':32s} {'RMSE':>10s} {'max |err|':>10s} {'RMSE / per-tensor':>18s}"]
    for r in rows:
        ratio = f"{r['rmse'] / base:18.2f}" if base else f"{'—':>18s}"
        lines.append(f"{r['method']:32s} {r['rmse']:10.2e} {r['max_abs']:10.2e} {ratio}")
    return "\n".join(lines)
