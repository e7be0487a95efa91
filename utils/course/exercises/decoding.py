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
    from utils.decoding.single_path import decode_contiguous, decode_paged
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
        with refusing(flash_decode, flash_decode_paged, merge_partials, decode_contiguous,
                      decode_paged):                                   # interpreted kernels are Python
            o, lse = launch_split_kv(kernel, q, k, v, seqlens, splits, causal)
        o_ref, lse_ref = split_reference(q.cpu(), k.cpu(), v.cpu(), seqlens, splits, causal)
        report = (_split_report(o, o_ref, seqlens, splits, "o", tol)
                  or _split_report(lse[..., None], lse_ref[..., None], seqlens, splits, "lse", tol))
        if report:
            raise AssertionError(f"case {number} (lengths {list(seqlens)}, H={h}, H_kv={h_kv}, new tokens={nq}, "
                                 f"d={d}, {splits} split(s){', causal' if causal else ''}), the first to add "
                                 f"{adds}:\n  {report}")


# Exercise 8.6: the page look-up of the paged decode, for a query with a sliding window.
LOOKUP_PAGE_SIZE, LOOKUP_BLOCK = 16, 64
LOOKUP_CASES = [
    # (window, query positions, what the case adds)
    (64, (5, 30, 47), "a window longer than the sequence: it starts at key 0, in block-table entry 0"),
    (24, (37, 40, 79, 47, 10), "a window that starts inside a page, after pages that fell out of it (freed: -1)"),
    (1, (0, 16, 31), "a window of one key: the query's own position, at a page's first and last row"),
]
LOOKUP_HINTS = (
    "read the case, the sequence and the key position named; the window keeps the last w keys up to the query's "
    "position p, never a position below 0; the block table maps a page-sized run of positions to a page of the "
    "pool, so a key's page is looked up, and its row in that page is what is left over",
    "the first key is the larger of 0 and p − w + 1; its block-table entry is that key over the page size, "
    "rounded down; the j-th visible key is the first key plus j, for as long as it is at most p; its page is the "
    "block table's entry at its position over the page size, rounded down, in this sequence's row; its row in "
    "the page is its position modulo the page size. Positions past p are left as they are.",
)


def lookup_table(positions, *, page_size=LOOKUP_PAGE_SIZE, window=None, seed=0):
    """(block_table (B, pages) int32, the pool's size): scattered page ids, -1 for the pages wholly before the
    window (a server frees them) and past each sequence's last page."""
    gen = torch.Generator().manual_seed(seed)
    width = max(p // page_size for p in positions) + 1
    pool = 2 * len(positions) * width
    ids = torch.randperm(pool, generator=gen)[:len(positions) * width].reshape(len(positions), width)
    table = torch.full((len(positions), width), -1, dtype=torch.int32)
    for b, p in enumerate(positions):
        first = max(0, p - window + 1) // page_size if window else 0
        table[b, first:p // page_size + 1] = ids[b, first:p // page_size + 1].to(torch.int32)
    return table, pool


def lookup_reference(table, positions, window, page_size=LOOKUP_PAGE_SIZE, block=LOOKUP_BLOCK):
    """(first entry (B,), page (B, block), offset (B, block)) of exercise 8.6, -1 past each last visible key."""
    first = torch.empty(len(positions), dtype=torch.int32)
    page = torch.full((len(positions), block), -1, dtype=torch.int32)
    offset = torch.full_like(page, -1)
    for b, p in enumerate(positions):
        start = max(0, p - window + 1)
        first[b] = start // page_size
        for j, key in enumerate(range(start, p + 1)):
            page[b, j], offset[b, j] = table[b, key // page_size], key % page_size
    return first, page, offset


def _lookup_report(got, expected, table, positions, window, page_size=LOOKUP_PAGE_SIZE) -> str | None:
    """None if the look-up is right; otherwise the first wrong sequence: its window, then its first entry or the
    first key position whose page or row in the page is wrong."""
    for b, p in enumerate(positions):
        start = max(0, p - window + 1)
        where = f"sequence {b} (query at position {p}, window {window}: keys {start} to {p})"
        if int(got[0][b]) != int(expected[0][b]):
            return (f"{where}: the first visible key's block-table entry is {int(got[0][b])}, expected "
                    f"{int(expected[0][b])}")
        for j in range(LOOKUP_BLOCK):
            g, e = (int(got[1][b, j]), int(got[2][b, j])), (int(expected[1][b, j]), int(expected[2][b, j]))
            if g == e:
                continue
            key = start + j
            if key > p:
                return (f"{where}: slot {j} lies past the query (position {key}) and must stay -1, got page "
                        f"{g[0]}, row {g[1]}")
            entry = key // page_size
            return (f"{where}: key position {key} (slot {j}) is in block-table entry {entry}, page {e[0]}, row "
                    f"{e[1]}; got page {g[0]}, row {g[1]}")
    return None


def check_window_lookup(kernel, *, device="cpu") -> None:
    """Exercise 8.6: `window_lookup` writes, per sequence, the block-table entry of the first key a sliding window
    keeps, and the page and row in the page of each visible key. Run on LOOKUP_CASES; a failure names the case,
    what it adds, the sequence and the first wrong key position with its page. The paged decode is refused."""
    from utils.course.exercises.refuse import refusing
    from utils.course.exercises.triton_forward import counted_launch, learner_kernel
    from utils.decoding.single_path import decode_paged
    from utils.decoding.split_kv import _decode, flash_decode_paged

    learner_kernel(kernel, "window_lookup")
    for number, (window, positions, adds) in enumerate(LOOKUP_CASES, 1):
        table, _ = lookup_table(positions, window=window, seed=number)
        b = len(positions)
        first = torch.full((b,), -1, dtype=torch.int32, device=device)
        page = torch.full((b, LOOKUP_BLOCK), -1, dtype=torch.int32, device=device)
        offset = torch.full_like(page, -1)
        pos = torch.tensor(positions, dtype=torch.int32, device=device)
        with refusing(flash_decode_paged, _decode, decode_paged):
            counted_launch(kernel, (b,), table.to(device), pos, first, page, offset, table.stride(0), window,
                           PAGE_SIZE=LOOKUP_PAGE_SIZE, BLOCK=LOOKUP_BLOCK)
        got = (first.cpu(), page.cpu(), offset.cpu())
        report = _lookup_report(got, lookup_reference(table, positions, window), table, positions, window)
        if report:
            raise AssertionError(f"case {number} (window {window}, pages of {LOOKUP_PAGE_SIZE}, block table "
                                 f"{table.tolist()}), the first to add {adds}:\n  {report}")
