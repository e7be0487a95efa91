"""Checks of notebook 08's merge exercises: the log-sum-exp merge of split-KV partials, in PyTorch (8.2) and
inside a Triton kernel (8.3).

The learner's `merge_splits` (8.2) takes S normalised partial outputs and their log-sum-exps per (batch, head,
query) row and returns the merged output and log-sum-exp; `merge_kernel` (8.3) does the same in one program per
row. The checks build the partials themselves, in float64, from a decode problem with ragged cache lengths (one
of them empty), GQA, a causal mask over the new tokens and large logits, and compare with attention over all
keys computed here from scratch.
"""
from __future__ import annotations

import math

import torch

from utils.course.exercises import assert_rows_close

FP32_EXP_LIMIT = 88.7   # exp(x) overflows float32 above this


def split_bounds(seqlen: int, block_n: int, num_splits: int) -> list[tuple[int, int]]:
    """The key range of each split, as flash-decoding cuts it: the same whole number of tiles per split."""
    per_split = math.ceil(math.ceil(seqlen / block_n) / num_splits) * block_n
    return [(min(s * per_split, seqlen), min((s + 1) * per_split, seqlen)) for s in range(num_splits)]


def _attend(q, k, v, visible):
    """(out, lse) of q against the visible keys, float64; rows that see nothing: out NaN, lse -inf."""
    s = (q @ k.transpose(-2, -1)).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def decode_partials(*, seqlens=(65, 23, 0), heads=4, kv_heads=2, new_tokens=2, head_dim=32, num_splits=5,
                    block_n=16, seed=0):
    """A float64 decode problem cut into splits: (o_parts (B, H, Nq, S, d), lse_parts (B, H, Nq, S), o, lse).

    Causal over the new tokens (token i sees cache entries j <= i + L - Nq: with L = 65 the last split holds
    key 64 only, which token 0 does not see); the short sequence leaves splits with no key at all; head 1's queries are scaled so that
    its log-sum-exps pass fp32's exp limit. A split with no visible key has lse -inf and an output of NaN,
    like memory nobody wrote: the merge must give it no weight at all. A sequence of length 0 merges to o = 0,
    lse = -inf.
    """
    gen = torch.Generator().manual_seed(seed)
    b, n = len(seqlens), max(seqlens)
    q = torch.randn(b, heads, new_tokens, head_dim, generator=gen, dtype=torch.float64) / math.sqrt(head_dim)
    q[:, 1] *= 80.0
    k, v = (torch.randn(b, kv_heads, n, head_dim, generator=gen, dtype=torch.float64).repeat_interleave(
        heads // kv_heads, dim=1) for _ in range(2))
    o_parts = torch.empty(b, heads, new_tokens, num_splits, head_dim, dtype=torch.float64)
    lse_parts = torch.empty(b, heads, new_tokens, num_splits, dtype=torch.float64)
    o = torch.zeros(b, heads, new_tokens, head_dim, dtype=torch.float64)
    lse = torch.empty(b, heads, new_tokens, dtype=torch.float64)
    for i, length in enumerate(seqlens):
        cols = torch.arange(n)
        causal = cols[None, :] <= torch.arange(new_tokens)[:, None] + length - new_tokens
        for s, (lo, hi) in enumerate(split_bounds(length, block_n, num_splits)):
            in_split = causal & (cols[None, :] >= lo) & (cols[None, :] < hi)
            o_parts[i, :, :, s], lse_parts[i, :, :, s] = _attend(q[i], k[i], v[i], in_split)
        full, lse[i] = _attend(q[i], k[i], v[i], causal & (cols[None, :] < length))
        o[i] = full.nan_to_num(0.0)
    return o_parts, lse_parts, o, lse


def run_merge_kernel(kernel, o_parts, lse_parts, *, device="cpu"):
    """Launch a learner's `merge_kernel` on fp32 copies (contiguous, one program per row); returns (o, lse)."""
    *lead, splits, d = o_parts.shape
    rows = math.prod(lead)
    parts = o_parts.float().reshape(rows, splits, d).contiguous().to(device)
    lses = lse_parts.float().reshape(rows, splits).contiguous().to(device)
    o = torch.zeros(rows, d, device=device)
    lse = torch.zeros(rows, device=device)
    kernel[(rows,)](parts, lses, o, lse, splits, HEAD_DIM=d, BLOCK_S=max(2, 1 << (splits - 1).bit_length()))
    return o.reshape(*lead, d).cpu(), lse.reshape(lead).cpu()


def _assert_merged(o, lse, lse_parts, o_ref, lse_ref, tol_o, tol_lse) -> None:
    """Assert that the merged (o, lse) match the reference; the message names the wrong (batch, head) query rows
    and what their splits have in common (an empty split, log-sum-exps beyond fp32's exp range)."""
    empty = (lse_parts == -math.inf).any(-1)
    large = lse_parts.max(-1).values > FP32_EXP_LIMIT
    for got, expected, name, tol in ((o, o_ref, "merged o", tol_o), (lse[..., None], lse_ref[..., None],
                                                                    "merged lse", tol_lse)):
        try:
            assert_rows_close(got, expected, atol=tol, rtol=tol, name=name)
        except AssertionError as err:
            bad = ~torch.isclose(got.double(), expected, atol=tol, rtol=tol).all(-1) | ~torch.isfinite(got).all(-1)
            notes = [f"{int((bad & empty).sum())} of the {int(empty.sum())} rows with an empty split (lse = -inf)",
                     f"{int((bad & large).sum())} of the {int(large.sum())} rows whose lse passes {FP32_EXP_LIMIT} "
                     "(exp overflows fp32)", f"{int((bad & ~empty & ~large).sum())} other rows"]
            raise AssertionError(f"{err}\n  wrong: " + "; ".join(notes)) from None


def check_merge_splits(merge_splits) -> None:
    """Assert that `merge_splits(o_parts, lse_parts)` (exercise 8.2) returns the merged (o, lse). The partials
    are `decode_partials`': an empty split's output is NaN and must get no weight (0 · NaN is NaN), and a
    sequence with no key must merge to o = 0, lse = -inf."""
    if not callable(merge_splits):
        raise TypeError(f"merge_splits must be a function, got {type(merge_splits).__name__}")
    o_parts, lse_parts, o_ref, lse_ref = decode_partials()
    got = merge_splits(o_parts.clone(), lse_parts.clone())
    assert isinstance(got, tuple) and len(got) == 2, "merge_splits must return a tuple (o, lse)"
    o, lse = got
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor), "o and lse must be tensors"
    _assert_merged(o, lse, lse_parts, o_ref, lse_ref, 1e-8, 1e-8)


def check_merge_kernel(kernel, *, device="cpu") -> None:
    """Assert that `kernel` merges split-KV partials; the message names the wrong (batch, head) query rows and
    what their splits have in common (an empty split, log-sum-exps beyond fp32's exp range)."""
    o_parts, lse_parts, o_ref, lse_ref = decode_partials()
    o, lse = run_merge_kernel(kernel, o_parts, lse_parts, device=device)
    _assert_merged(o, lse, lse_parts, o_ref, lse_ref, 1e-4, 1e-5)


# Exercise 8.5, the capstone: the split-KV kernel that writes one split's partial output and lse.
SPLIT_BLOCK_M = SPLIT_BLOCK_N = 16
SPLIT_CASES = [
    # (cache lengths, capacity, H, H_kv, new tokens, d, splits, causal, what the case adds)
    ((40, 25), 48, 2, 2, 1, 16, 1, False, "the online softmax over one split (the whole cache), a ragged last tile"),
    ((70, 23, 0), 80, 2, 2, 1, 16, 3, False, "several splits, each its own slice [lo, hi); a cache of length 0 "
                                             "and splits past the end (no key: o = 0, lse = -inf)"),
    ((65, 33), 72, 4, 2, 1, 16, 5, False, "grouped-query attention: query head h reads K/V head h // GROUP"),
    ((65, 23, 1), 72, 4, 2, 3, 16, 4, True, "3 causal new tokens: token i sees cache entries j <= i + L - Nq"),
]
SPLIT_HINTS = (
    "read which case failed first and what it adds, and the (batch, head, split) named with its key range; each "
    "program owns one split of one (batch, head): its slice of this sequence's cache, as in exercise 8.4, and "
    "the online softmax of notebook 05 over that slice only.",
    "program (first id, split): batch b is the first id over n_heads, rounded down, head h the remainder, K/V "
    "head ⌊h / GROUP⌋, and L the length SEQLENS holds for b; each split gets ⌈⌈L / BLOCK_N⌉ / num_splits⌉ "
    "tiles of BLOCK_N keys, from lo, the split times that many keys, to hi, the smaller of the next split's lo "
    "and L. Rows are the n_q new tokens. Per tile of keys j from lo to hi: scores q·kᵀ·qk_scale, −∞ where "
    "j ≥ hi or, causal, j > i + L − n_q; m, l, acc updated as in notebook 05 (0 in place of an m that is still "
    "−∞). Write o, which is acc / l, and lse, (m + log₂ l)·ln 2, into this split's slot; o is 0 and lse −∞ "
    "where l is 0.",
)


def split_reference(q, k, v, seqlens, num_splits: int, causal: bool, block_n: int = SPLIT_BLOCK_N):
    """Float64 partials (o_parts (B, H, Nq, S, d), lse_parts (B, H, Nq, S)) of each split's slice of each
    sequence's cache (`split_bounds`), GQA by repeating heads; a split with no visible key: o = 0, lse = -inf."""
    b, h, nq, d = q.shape
    group = h // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(d)
    cols, rows = torch.arange(k.shape[2]), torch.arange(nq)
    o_parts = torch.zeros(b, h, nq, num_splits, d, dtype=torch.float64)
    lse_parts = torch.full((b, h, nq, num_splits), -math.inf, dtype=torch.float64)
    for i, length in enumerate(seqlens):
        for s, (lo, hi) in enumerate(split_bounds(length, block_n, num_splits)):
            visible = (cols[None, :] >= lo) & (cols[None, :] < hi)
            if causal:
                visible = visible & (cols[None, :] <= rows[:, None] + length - nq)
            s_i = scores[i].masked_fill(~visible, -math.inf)
            lse = torch.logsumexp(s_i, -1)
            p = torch.exp(s_i - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
            o_parts[i, :, :, s], lse_parts[i, :, :, s] = p @ v[i], lse
    return o_parts, lse_parts


def launch_split_kv(kernel, q, k_cache, v_cache, seqlens, num_splits: int, causal: bool):
    """The capstone's launch: grid (B·H, num_splits); returns (o_parts (B, H, Nq, S, d), lse_parts
    (B, H, Nq, S)), both filled with NaN before the launch, so a slot the kernel never writes shows."""
    from utils.course.exercises.triton_forward import LOG2E, counted_launch

    b, h, nq, d = q.shape
    o_parts = torch.full((b, h, nq, num_splits, d), float("nan"), device=q.device, dtype=torch.float32)
    lse_parts = torch.full((b, h, nq, num_splits), float("nan"), device=q.device, dtype=torch.float32)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=q.device)
    strides = [*q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *o_parts.stride()[:4],
               *lse_parts.stride()[:3]]
    counted_launch(kernel, (b * h, num_splits), q, k_cache, v_cache, o_parts, lse_parts, lens, *strides, h, nq,
                   num_splits, LOG2E / math.sqrt(d), GROUP=h // k_cache.shape[1], CAUSAL=causal, HEAD_DIM=d,
                   BLOCK_M=SPLIT_BLOCK_M, BLOCK_N=SPLIT_BLOCK_N)
    return o_parts, lse_parts


def _split_report(got, expected, seqlens, num_splits, name, tol, max_items=3) -> str | None:
    """None if `got` matches; otherwise the wrong (batch, head, split) slots, each with its key range and rows.
    got, expected: (B, H, Nq, S, ...) with at least one trailing dim."""
    g, e = got.double().cpu(), expected.double().cpu()
    bad = ~torch.isclose(g, e, atol=tol, rtol=tol) | (~torch.isfinite(g) & torch.isfinite(e))
    bad = bad.flatten(4).any(-1)                              # (B, H, Nq, S)
    if not bad.any():
        return None
    slots = bad.any(2).nonzero().tolist()                     # (batch, head, split)
    lines = []
    for bi, hi_, s in slots[:max_items]:
        lo, hi = split_bounds(seqlens[bi], SPLIT_BLOCK_N, num_splits)[s]
        rows = bad[bi, hi_, :, s].nonzero().flatten().tolist()
        keys = f"keys [{lo}, {hi}) of {seqlens[bi]}" if lo < hi else f"no keys (cache of {seqlens[bi]})"
        at = (bi, hi_, rows[0], s)
        lines.append(f"batch={bi}, head={hi_}, split={s} ({keys}): rows {rows} wrong; row {rows[0]}: got "
                     f"{_first(g[at])}, expected {_first(e[at])}")
    if len(slots) > max_items:
        lines.append(f"... and {len(slots) - max_items} more (batch, head, split) slot(s)")
    return f"{name} is wrong in {len(slots)} (batch, head, split) slot(s):\n  " + "\n  ".join(lines)


def _first(t):
    t = t.flatten()
    return f"{t[0].item():.4g}" + (" ..." if t.numel() > 1 else "")


def check_split_kv(kernel, *, device="cpu") -> None:
    """Exercise 8.5, the capstone: `split_kv_partial` writes, for each (batch, head, split), the normalised
    partial output and natural-log lse of its slice of the cache. Run on SPLIT_CASES (ragged lengths, empty
    splits, GQA, causal new tokens), compared with float64 partials; a failure names the case, what it adds, and
    the wrong (batch, head, split) slots with their key ranges and rows. The course's decode kernels are refused,
    and the launch must run the kernel passed."""
    from utils.course.exercises.refuse import refusing
    from utils.course.exercises.triton_forward import learner_kernel
    from utils.decoding.split_kv import flash_decode, flash_decode_paged, merge_partials

    learner_kernel(kernel, "split_kv_partial")
    tol = 1e-4 if device == "cpu" else 1e-2
    dtype = torch.float32 if device == "cpu" else torch.float16
    for number, (seqlens, cap, h, h_kv, nq, d, splits, causal, adds) in enumerate(SPLIT_CASES, 1):
        gen = torch.Generator().manual_seed(number)
        q = torch.randn(len(seqlens), h, nq, d, generator=gen)
        k, v = (torch.randn(len(seqlens), h_kv, cap, d, generator=gen) for _ in range(2))
        k = k * torch.linspace(0.5, 3.0, cap)[:, None]         # the running max moves from tile to tile
        q, k, v = (t.to(device, dtype) for t in (q, k, v))
        with refusing(flash_decode, flash_decode_paged, merge_partials):   # interpreted kernels are Python
            o, lse = launch_split_kv(kernel, q, k, v, seqlens, splits, causal)
        o_ref, lse_ref = split_reference(q.cpu(), k.cpu(), v.cpu(), seqlens, splits, causal)
        report = (_split_report(o, o_ref, seqlens, splits, "o", tol)
                  or _split_report(lse[..., None], lse_ref[..., None], seqlens, splits, "lse", tol))
        if report:
            raise AssertionError(f"case {number} (lengths {list(seqlens)}, H={h}, H_kv={h_kv}, new tokens={nq}, "
                                 f"d={d}, {splits} split(s){', causal' if causal else ''}), the first to add "
                                 f"{adds}:\n  {report}")
