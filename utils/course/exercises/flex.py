"""Checks of notebook 10's exercises: a mask_mod written twice (PyTorch and Triton), the block-state builder, and
a score_mod with its derivative (soft-capping) in Triton.

Every expected answer is computed here from the rule it stands for (a mask from its definition, tile states by
looking at each tile of that mask, tanh and its derivative in float64), never by the library code of
`utils.flex`; the Triton functions run through small harness kernels defined here, in the interpreter on a CPU.
A failure names what is wrong: (query, key) pairs per batch entry, tiles by their rows and keys, scores.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from utils.course.exercises import _spans

EMPTY, PARTIAL, FULL = 0, 1, 2
STATE_NAMES = ("EMPTY", "PARTIAL", "FULL")

# Exercise 10.1: (prefix lengths per batch entry, Nq, Nk, heads). Prefixes of 0 (plain causal), inside the
# sequence, at its end and past it; Nq < Nk and Nq > Nk (bottom-right: the first rows sit before key 0).
PREFIX_CASES = [
    ([3, 10], 20, 20, 2),
    ([0, 37, 5], 40, 40, 1),
    ([12], 17, 29, 1),
    ([6, 20, 50], 33, 20, 1),
]


def prefix_rule(prefix_lens, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(B, Nq, Nk) bool from the rule itself: query row i sits at key position p = i + Nk - Nq and sees key j iff
    j <= p (causal) or j < prefix_lens[b] (the prompt of batch entry b is visible both ways)."""
    out = torch.zeros(len(prefix_lens), seqlen_q, seqlen_k, dtype=torch.bool)
    for b, prefix in enumerate(prefix_lens):
        for i in range(seqlen_q):
            p = i + seqlen_k - seqlen_q
            for j in range(seqlen_k):
                out[b, i, j] = j <= p or j < prefix
    return out


def describe_mask_errors(got: torch.Tensor, expected: torch.Tensor, *, what: str, prefix_lens=None,
                         max_pairs: int = 4) -> str:
    """'' if equal; otherwise which (batch, query row, key) pairs differ, both ways, for the first batch entries
    that differ. got/expected: (B, Nq, Nk) bool; rows are query rows, positions are bottom-right aligned."""
    bad = got != expected
    if not bad.any():
        return ""
    nq, nk = expected.shape[-2:]
    lines = [f"{what} is wrong at {int(bad.sum())} of {bad.numel()} (batch, query, key) pairs (Nq={nq}, Nk={nk})"]
    for b in bad.flatten(1).any(1).nonzero().flatten().tolist()[:2]:
        extra = f", prefix {prefix_lens[b]}" if prefix_lens is not None else ""
        rows = bad[b].any(1).nonzero().flatten().tolist()
        lines.append(f"batch {b}{extra}: query rows {_spans(rows)} (positions {rows[0] + nk - nq}–"
                     f"{rows[-1] + nk - nq})")
        for label, kind in (("visible but should be masked", got[b] & ~expected[b]),
                            ("masked but should be visible", ~got[b] & expected[b])):
            pairs = kind.nonzero().tolist()
            if pairs:
                shown = ", ".join(f"(q={i + nk - nq}, kv={j})" for i, j in pairs[:max_pairs])
                more = f" and {len(pairs) - max_pairs} more" if len(pairs) > max_pairs else ""
                lines.append(f"  {label}: {shown}{more}")
    return "\n  ".join(lines)


def _positions(batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """Broadcast index tensors b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Nq,1) bottom-right, kv_idx (1,1,1,Nk)."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    q = (torch.arange(seqlen_q) + seqlen_k - seqlen_q).view(1, 1, -1, 1)
    kv = torch.arange(seqlen_k).view(1, 1, 1, -1)
    return b, h, q, kv


def _call_mask(mask_mod, *idx):
    """Call a PyTorch mask_mod; turn the errors of Python control flow on tensors into a message."""
    try:
        return mask_mod(*idx)
    except RuntimeError as err:
        if "ambiguous" in str(err):
            raise AssertionError("your mask_mod used Python `or`/`and`/`if` on index tensors ("
                                 f"{err}); combine the conditions with | and & instead") from None
        raise


def check_prefix_mask_torch(make_prefix_mask) -> None:
    """Exercise 10.1, PyTorch: `make_prefix_mask(prefix_lens)` returns mask_mod(b, h, q_idx, kv_idx) -> bool,
    evaluated here on broadcast index tensors (as the float64 reference does) and on 0-d tensors (as
    torch.nn.attention.flex_attention's vmap does), against the rule."""
    for prefix_lens, nq, nk, heads in PREFIX_CASES:
        mask_mod = make_prefix_mask(torch.tensor(prefix_lens))
        if not callable(mask_mod):
            raise AssertionError(f"make_prefix_mask should return a function, got {type(mask_mod).__name__}")
        got = _call_mask(mask_mod, *_positions(len(prefix_lens), heads, nq, nk))
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
            raise AssertionError(f"mask_mod should return a bool tensor, got "
                                 f"{getattr(got, 'dtype', type(got).__name__)}")
        try:
            got = got.broadcast_to(len(prefix_lens), heads, nq, nk)
        except RuntimeError:
            raise AssertionError(f"mask_mod returned shape {tuple(got.shape)}, which does not broadcast to "
                                 f"(B, H, Nq, Nk) = {(len(prefix_lens), heads, nq, nk)}") from None
        expected = prefix_rule(prefix_lens, nq, nk)
        for h in range(heads):
            message = describe_mask_errors(got[:, h], expected, what=f"mask (head {h})", prefix_lens=prefix_lens)
            assert not message, message
        # One pair at a time, as 0-d tensors: what flex_attention's vmap hands a mask_mod.
        b, i, j = len(prefix_lens) - 1, nq - 1, min(nk - 1, prefix_lens[-1])
        one = _call_mask(mask_mod, *(torch.tensor(x) for x in (b, 0, i + nk - nq, j)))
        assert isinstance(one, torch.Tensor) and one.dim() == 0 and bool(one) == bool(expected[b, i, j]), (
            f"on 0-d index tensors (b={b}, h=0, q_idx={i + nk - nq}, kv_idx={j}) mask_mod returned {one!r}, "
            f"expected tensor({bool(expected[b, i, j])})")


@triton.jit
def _mask_tile_kernel(OUT, MOD_T, mod_i, mod_f, heads, seqlen_q, seqlen_k, MASK_MOD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, key tile, batch * head): OUT[b, h, i, j] = MASK_MOD(b, h, q_idx, kv_idx, args),
    with q_idx (BLOCK_M, 1) and kv_idx (1, BLOCK_N) tiles as the attention kernels pass them."""
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = bh // heads
    h = bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
    args = (MOD_T, mod_i, mod_f)
    q_idx = tl.minimum(offs_m, seqlen_q - 1)[:, None] + (seqlen_k - seqlen_q)
    kv_idx = tl.minimum(offs_n, seqlen_k - 1)[None, :]
    visible = MASK_MOD(b, h, q_idx, kv_idx, args) & inside
    out = OUT + bh.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None] * seqlen_k + offs_n[None, :]
    tl.store(out, visible.to(tl.int8), mask=inside)


def run_triton_mask(mask_mod, tensor: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *,
                    int_arg: int = 0, float_arg: float = 0.0, device="cpu", block: int = 16) -> torch.Tensor:
    """(B, H, Nq, Nk) bool: a Triton mask_mod(b, h, q_idx, kv_idx, args) evaluated tile by tile, args =
    (tensor, int_arg, float_arg) as the course's kernels build it."""
    out = torch.full((batch, heads, seqlen_q, seqlen_k), 2, dtype=torch.int8, device=device)
    grid = (triton.cdiv(seqlen_q, block), triton.cdiv(seqlen_k, block), batch * heads)
    _mask_tile_kernel[grid](out, tensor.to(device), int_arg, float_arg, heads, seqlen_q, seqlen_k,
                            MASK_MOD=mask_mod, BLOCK_M=block, BLOCK_N=block)
    return out.cpu() == 1


def check_prefix_mask_triton(mask_mod, *, device="cpu") -> None:
    """Exercise 10.1, Triton: mask_mod(b, h, q_idx, kv_idx, args) with args[0] the int32 prefix lengths (B,),
    run tile by tile on every case, against the rule."""
    for prefix_lens, nq, nk, heads in PREFIX_CASES:
        table = torch.tensor(prefix_lens, dtype=torch.int32)
        got = run_triton_mask(mask_mod, table, len(prefix_lens), heads, nq, nk, device=device)
        expected = prefix_rule(prefix_lens, nq, nk)
        for h in range(heads):
            message = describe_mask_errors(got[:, h], expected, what=f"mask (head {h})", prefix_lens=prefix_lens)
            assert not message, message


# --- Exercise 10.2: tile states -----------------------------------------------------------------------------

def _document_ids(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _state_cases():
    """(name, mask_fn(q_idx, kv_idx), Nq, Nk, block_m, block_n): square and not, ragged ends, Nq > Nk."""
    docs = _document_ids([30, 7, 45, 18])                   # 100 tokens: a table read at each position
    return [
        ("causal", lambda q, kv: kv <= q, 64, 64, 16, 16),
        ("causal", lambda q, kv: kv <= q, 50, 70, 16, 32),
        ("causal", lambda q, kv: kv <= q, 70, 50, 32, 16),
        ("sliding window 8", lambda q, kv: (kv <= q) & (q - kv < 8), 100, 100, 16, 16),
        ("documents 30+7+45+18, causal", lambda q, kv: (docs[q] == docs[kv]) & (kv <= q), 100, 100, 32, 32),
        ("prefix-LM 40", lambda q, kv: (kv <= q) | (kv < 40), 90, 90, 16, 32),
        ("no mask", lambda q, kv: (q >= 0) | (kv >= 0), 33, 47, 16, 16),
        ("nothing visible", lambda q, kv: (q < -10**6) & (kv < 0), 20, 20, 16, 16),
        ("causal", lambda q, kv: kv <= q, 1, 1, 16, 16),
    ]


def states_rule(mask: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Tile states of a (Nq, Nk) bool mask, tile by tile: EMPTY if no real (query, key) pair of the tile is
    visible; FULL if all of them are and the tile holds no key past Nk (query rows past Nq do not count);
    PARTIAL otherwise."""
    nq, nk = mask.shape
    rows, cols = -(-nq // block_m), -(-nk // block_n)
    out = torch.empty(rows, cols, dtype=torch.int8)
    for r in range(rows):
        for c in range(cols):
            tile = mask[r * block_m:(r + 1) * block_m, c * block_n:(c + 1) * block_n]
            ragged_keys = (c + 1) * block_n > nk
            out[r, c] = EMPTY if not tile.any() else FULL if tile.all() and not ragged_keys else PARTIAL
    return out


def _tile_text(r, c, nq, nk, block_m, block_n, mask) -> str:
    q0, k0 = r * block_m, c * block_n
    q1, k1 = min(q0 + block_m, nq) - 1, min(k0 + block_n, nk) - 1
    tile = mask[q0:q1 + 1, k0:k1 + 1]
    text = (f"tile ({r}, {c}): query rows {q0}–{q1} (positions {q0 + nk - nq}–{q1 + nk - nq}), keys {k0}–{k1}: "
            f"{int(tile.sum())} of {tile.numel()} real pairs visible")
    if k0 + block_n > nk:
        text += f", keys {nk}–{k0 + block_n - 1} past the end"
    if q0 + block_m > nq:
        text += f", rows {nq}–{q0 + block_m - 1} past the end"
    return text


def _no_library(fn):
    """Run fn() with utils.flex's own block_states refusing to run: the exercise is to write it. (Its code object
    is swapped, so every name bound to the function refuses, however it was imported.)"""
    try:
        import utils.flex as library
    except ImportError:
        return fn()
    original = getattr(library, "block_states", None)
    if original is None or not hasattr(original, "__code__"):
        return fn()

    def refuse(*args, **kwargs):
        raise AssertionError("your block_states calls utils.flex's block_states, the library's answer: write "
                             "the classification yourself")

    saved = original.__code__
    original.__code__ = refuse.__code__
    try:
        return fn()
    finally:
        original.__code__ = saved


def check_block_states(block_states) -> None:
    """Exercise 10.2: block_states(mask_fn, Nq, Nk, block_m, block_n) -> (cdiv(Nq, block_m), cdiv(Nk, block_n))
    states, against the rule on every case; mask_fn may only be asked about real positions."""
    for name, rule, nq, nk, bm, bn in _state_cases():
        def mask_fn(q_idx, kv_idx, rule=rule, nq=nq, nk=nk):
            q_idx, kv_idx = torch.as_tensor(q_idx), torch.as_tensor(kv_idx)
            lo, hi = nk - nq, nk - 1
            if q_idx.numel() and (q_idx.min() < lo or q_idx.max() > hi):
                bad = int(q_idx.min() if q_idx.min() < lo else q_idx.max())
                past = (" A position past the end is no position: a mask may read a table of one entry per "
                        "position, so clamp the positions (or evaluate real ones only) and drop what is past the "
                        "end") if bad > hi else ""
                raise AssertionError(f"{name}, Nq={nq}, Nk={nk}: mask_fn was asked about query position {bad}; "
                                     f"the {nq} queries sit at {lo}..{hi} (query row i at i + Nk − Nq, "
                                     f"bottom-right).{past}")
            if kv_idx.numel() and (kv_idx.min() < 0 or kv_idx.max() > hi):
                bad = int(kv_idx.max() if kv_idx.max() > hi else kv_idx.min())
                raise AssertionError(f"{name}, Nq={nq}, Nk={nk}: mask_fn was asked about key {bad}, outside "
                                     f"0..{hi}: a mask may read a table of one entry per position, so clamp the "
                                     f"positions (or evaluate real ones only) and drop what is past the end")
            return rule(q_idx, kv_idx)

        mask = torch.as_tensor(rule(torch.arange(nq)[:, None] + nk - nq, torch.arange(nk)[None, :]))
        mask = mask.broadcast_to(nq, nk)
        expected = states_rule(mask, bm, bn)
        got = _no_library(lambda: block_states(mask_fn, nq, nk, bm, bn))
        where = f"{name}, Nq={nq}, Nk={nk}, {bm}x{bn} tiles"
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}: block_states should return a tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)} "
                                 f"(cdiv(Nq, block_m), cdiv(Nk, block_n)): the last, ragged tiles count too")
        got = got.to(torch.int64).cpu()
        wrong = (got != expected.to(torch.int64)).nonzero().tolist()
        if wrong:
            lines = [f"{where}: {len(wrong)} of {expected.numel()} tiles wrong"]
            for r, c in wrong[:5]:
                g = int(got[r, c])
                g = STATE_NAMES[g] if g in (0, 1, 2) else str(g)
                lines.append(f"{_tile_text(r, c, nq, nk, bm, bn, mask)}: got {g}, expected "
                             f"{STATE_NAMES[int(expected[r, c])]}")
            if len(wrong) > 5:
                lines.append(f"... and {len(wrong) - 5} more")
            raise AssertionError("\n  ".join(lines))


# --- Exercise 10.3: soft-capping and its derivative in Triton --------------------------------------------------

SOFTCAP_SCORES = [-1e4, -300.0, -89.0, -45.0, -20.0, -3.0, -1.0, -1e-3, 0.0, 1e-3, 0.5, 1.0, 3.0, 20.0, 45.0,
                  89.0, 300.0, 1e4]


@triton.jit
def _score_tile_kernel(S, OUT, GRAD, MOD_T, mod_i, mod_f, n, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: a (BLOCK_M, BLOCK_N) tile of scores through SCORE_MOD and SCORE_GRAD, as the kernels call
    them (b = h = 0, q_idx (BLOCK_M, 1), kv_idx (1, BLOCK_N))."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    flat = offs_m[:, None] * BLOCK_N + offs_n[None, :]
    s = tl.load(S + flat, mask=flat < n, other=0.0)
    args = (MOD_T, mod_i, mod_f)
    b = tl.program_id(0)
    h = tl.program_id(0)
    tl.store(OUT + flat, SCORE_MOD(s, b, h, offs_m[:, None], offs_n[None, :], args), mask=flat < n)
    tl.store(GRAD + flat, SCORE_GRAD(s, b, h, offs_m[:, None], offs_n[None, :], args), mask=flat < n)


def run_score_mod(score_mod, score_grad, scores: torch.Tensor, *, cap: float, device="cpu"):
    """(score_mod(scores), score_grad(scores)) of Triton functions, fp32, args = (unused, 0, cap)."""
    n = scores.numel()
    block = 16
    while block * block < n:
        block *= 2
    s = scores.float().contiguous().to(device)
    out, grad = torch.full_like(s, float("nan")), torch.full_like(s, float("nan"))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # the interpreter computes with NumPy
        _score_tile_kernel[(1,)](s, out, grad, s, 0, float(cap), n, SCORE_MOD=score_mod, SCORE_GRAD=score_grad,
                                 BLOCK_M=block, BLOCK_N=block)
    return out.cpu(), grad.cpu()


def _describe_scores(name, got, expected, scores, cap, ok) -> str:
    idx = (~ok).nonzero().flatten().tolist()
    shown = "; ".join(f"score {scores[i].item():g}: got {got[i].item():.6g}, expected {expected[i].item():.6g}"
                      for i in idx[:4])
    return f"{name} is wrong at {len(idx)} of {len(scores)} scores (cap {cap:g}): {shown}"


def check_softcap(score_mod, score_grad, *, device="cpu") -> None:
    """Exercise 10.3: score_mod = cap·tanh(score/cap) and score_grad = its derivative 1 − tanh²(score/cap), in
    Triton (args[2] is the cap), against float64, on scores from −1e4 to 1e4 (where e^x overflows fp32)."""
    gen = torch.Generator().manual_seed(10)
    scores = torch.cat([torch.tensor(SOFTCAP_SCORES), torch.randn(46, generator=gen) * 30]).double()
    for cap in (1.0, 20.0, 50.0):
        got, grad = run_score_mod(score_mod, score_grad, scores, cap=cap, device=device)
        t = torch.tanh(scores / cap)
        s = scores.clone().requires_grad_()
        (d,) = torch.autograd.grad((cap * torch.tanh(s / cap)).sum(), s)
        pairs = (("score_mod", got.double(), cap * t, 2e-6 * cap), ("score_grad", grad.double(), d, 2e-6))
        for name, g, e, atol in pairs:
            ok = torch.isclose(g, e, rtol=1e-5, atol=atol) & torch.isfinite(g)
            assert ok.all(), _describe_scores(name, g, e, scores, cap, ok)


# --- Exercise 10.4: the key blocks of a program of the varlen kernel ---------------------------------------------

VARLEN_BLOCK = 16
# (query lengths, key lengths, causal): self-attention with lengths 0 and 1, then cross lengths both ways
VARLEN_CASES = [([37, 0, 1, 70, 20], [37, 0, 1, 70, 20], True), ([5, 30, 16, 0], [12, 7, 16, 3], True),
                ([5, 30, 16, 0], [12, 7, 16, 3], False), ([37, 0, 1, 70, 20], [37, 0, 1, 70, 20], False)]
VARLEN_PRINT = (1, 3)    # the program whose range the learner prints: Q block 1 of sequence 3 (70 tokens)


@triton.jit
def _varlen_probe(CU_Q, CU_K, OUT, n_m, BLOCKS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Store what the learner's BLOCKS returns for program (pid_m, b): four integers per program."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    q_start, k_start, n_full, n_end = BLOCKS(CU_Q, CU_K, b, pid_m, CAUSAL, BLOCK_M, BLOCK_N)
    out = OUT + (b * n_m + pid_m) * 4
    tl.store(out, q_start)
    tl.store(out + 1, k_start)
    tl.store(out + 2, n_full)
    tl.store(out + 3, n_end)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def varlen_rule(q_lens, k_lens, causal: bool, block_m: int, block_n: int) -> dict:
    """{(b, pid_m): (q_start, k_start, n_full, n_end)} from the mask itself: causal bottom-right within each
    sequence, every one of a block's block_m rows counted (rows past the end are masked at the store)."""
    cu_q, cu_k = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    n_m = triton.cdiv(max(q_lens), block_m)
    rule = {}
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        for pid_m in range(n_m):
            rows = np.arange(pid_m * block_m, (pid_m + 1) * block_m)
            if rows[0] >= nq:
                rule[(b, pid_m)] = (cu_q[b], cu_k[b], 0, 0)
                continue
            keys = np.arange(nk)
            sees = (keys[None, :] <= rows[:, None] + nk - nq) if causal else np.ones((len(rows), nk), bool)
            every = int(sees.all(0).sum())              # keys every row sees: a prefix of the sequence
            some = int(np.nonzero(sees.any(0))[0].max()) + 1 if sees.any() else 0
            rule[(b, pid_m)] = (cu_q[b], cu_k[b], every // block_n * block_n, some)
    return rule


def _varlen_text(b, pid_m, nq, nk, causal, got, want) -> str:
    names = ("q_start", "k_start", "n_full", "n_end")
    wrong = ", ".join(f"{n} = {g} (expected {w})" for n, g, w in zip(names, got, want) if g != w)
    rows = f"rows {pid_m * VARLEN_BLOCK}–{pid_m * VARLEN_BLOCK + VARLEN_BLOCK - 1}"
    return f"sequence {b} (Nq = {nq}, Nk = {nk}{', causal' if causal else ''}), Q block {pid_m} ({rows}): {wrong}"


def check_varlen_blocks(varlen_blocks, show_blocks) -> None:
    """Exercise 10.4: varlen_blocks(CU_Q, CU_K, b, pid_m, CAUSAL, BLOCK_M, BLOCK_N) -> (q_start, k_start, n_full,
    n_end) for every program of four packed batches, against the rule from the mask; then show_blocks' print_if
    of program (1, 3). The course's own _sequence and _key_range (utils.flex.kernels) are refused."""
    from utils.course.exercises.debug_lab import _calls_of, _held_in, watch_helpers
    from utils.course.exercises.refuse import RefusedAnswer, refusing
    from utils.course.exercises.triton_forward import _course_kernels_called, _jit_function
    from utils.flex import flash_varlen

    fn = _jit_function(varlen_blocks)
    if fn is None:
        raise AssertionError(f"pass your @triton.jit function varlen_blocks, not a {type(varlen_blocks).__name__}")
    used = _course_kernels_called(fn)
    if used or (fn.__module__ or "").startswith("utils."):
        raise RefusedAnswer(f"the check refuses the course's own `{(used or [fn.__qualname__])[0]}`: it computes "
                            "the range for you; write varlen_blocks with your own code")
    block = VARLEN_BLOCK
    with refusing(flash_varlen):
        for q_lens, k_lens, causal in VARLEN_CASES:
            n_m = triton.cdiv(max(q_lens), block)
            out = torch.full((len(q_lens), n_m, 4), -1, dtype=torch.int32)
            _varlen_probe[(n_m, len(q_lens))](_cu(q_lens), _cu(k_lens), out, n_m, varlen_blocks, causal, block, block)
            rule = varlen_rule(q_lens, k_lens, causal, block, block)
            bad = [_varlen_text(b, m, q_lens[b], k_lens[b], causal, tuple(out[b, m].tolist()), want)
                   for (b, m), want in rule.items() if tuple(out[b, m].tolist()) != want]
            if bad:
                more = f" (and {len(bad) - 4} more programs)" if len(bad) > 4 else ""
                raise AssertionError("wrong key range: " + "; ".join(bad[:4]) + more)

    q_lens, k_lens, causal = VARLEN_CASES[0]
    n_m = triton.cdiv(max(q_lens), block)
    calls = _calls_of(watch_helpers(show_blocks, lambda: show_blocks[(n_m, len(q_lens))](
        _cu(q_lens), _cu(k_lens), causal, block, block)), "print_if")
    held = _held_in(calls)
    assert held == [VARLEN_PRINT], (f"print_if printed in program(s) {held or 'none'}: print in program "
                                    f"{VARLEN_PRINT} only, Q block 1 of sequence 3 (axis 0 is the Q block, axis 1 "
                                    "the sequence)")
    local = [c for c in calls if c["held"]][0]["locals"]
    assert "n_end" in local, "print_if ran before varlen_blocks returned the range: put it after that line"
    want = varlen_rule(q_lens, k_lens, causal, block, block)[(VARLEN_PRINT[1], VARLEN_PRINT[0])]
    print(f"program {VARLEN_PRINT} runs keys 0–{want[2] - 1} of its sequence without a mask and "
          f"{want[2]}–{want[3] - 1} with it, at rows {want[1]}+ of the packed K")
