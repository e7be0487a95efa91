"""Exercise checks of notebook 11: the sink's gradient (11.1), the first key block of a sliding window (11.2), the
log-sum-exp merge of two partial results in a Triton kernel (11.3) and per-block FP8 scales (11.4).

Each check builds its expected answer here from the definitions (float64 attention written out, the window's rule
key by key, amax over each block), never from the course's finished functions, and refuses those while the
learner's code runs (utils.course.exercises.refuse). Messages name the case and the heads, tiles, rows or blocks
that are wrong.
"""
from __future__ import annotations

import math

import torch
from triton.compiler.errors import CompilationError

from utils.course.exercises import _spans, assert_rows_close
from utils.course.exercises.refuse import refusing

FP8_MAX = 448.0   # the largest float8_e4m3fn number
FP32_EXP_LIMIT = 88.7


def _fmt(values) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in values) + "]"


# --- 11.1 the sink's gradient ------------------------------------------------------------------------------------

# (batch, heads, kv_heads, Nq, Nk, causal, window, sinks): GQA; Nq > Nk with a window, so some rows see no key,
# and a head without a sink (-inf) among them; a sink large enough to take most of a row's attention.
SINK_CASES = [(2, 4, 2, 9, 12, True, None, (0.5, -1.0, 2.0, 0.0)),
              (1, 3, 3, 10, 6, True, 4, (0.5, -math.inf, 2.0)),
              (2, 2, 1, 5, 7, False, None, (6.0, -3.0))]


def _sink_attention(q, k, v, sinks, causal, window):
    """Float64 attention with one extra softmax column per head (the sink, value 0): (o, lse). Written out here
    from the definition; rows with neither a visible key nor a sink give o = 0, lse = -inf."""
    nq, nk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    pos = torch.arange(nq)[:, None] + nk - nq
    keys = torch.arange(nk)[None, :]
    seen = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        seen = keys <= pos
        if window is not None:
            seen = seen & (keys > pos - window)
    scores = scores.masked_fill(~seen, -math.inf)
    column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    safe = torch.where(torch.isneginf(lse), math.inf, lse)
    return torch.exp(scores - safe[..., None]) @ v, lse


def _sink_case_name(b, h, hk, nq, nk, causal, window, sinks):
    shape = f"batch {b}, {h} heads ({hk} K/V), Nq={nq}, Nk={nk}"
    mask = ("causal" + (f", window {window}" if window else "")) if causal else "not causal"
    return f"{shape}, {mask}, sinks {_fmt(sinks)}"


def check_sink_gradient(fn) -> None:
    """`fn(sinks, lse, delta) -> dsinks`: sinks (H,), lse and delta (B, H, Nq), float64; returns ∂L/∂s_h, (H,).
    Compared with float64 autograd through attention with an explicit sink column. A head without a sink
    (s = -inf) gets 0, also on rows that see no key. The course's sink_gradient is refused while it runs."""
    from utils.sinks import backward

    if not callable(fn):
        raise TypeError(f"the sink gradient must be a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(11)
    with refusing(backward.sink_gradient, backward.sink_attention_backward, backward.SinkAttention.backward):
        for case in SINK_CASES:
            b, h, hk, nq, nk, causal, window, sink_values = case
            where = _sink_case_name(*case)
            q = torch.randn(b, h, nq, 8, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(b, hk, nk, 8, generator=gen, dtype=torch.float64) for _ in range(2))
            sinks = torch.tensor(sink_values, dtype=torch.float64, requires_grad=True)
            o, lse = _sink_attention(q, k, v, sinks, causal, window)
            do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            (expected,) = torch.autograd.grad((o * do).sum(), sinks)
            # A head with no sink has nothing to learn: 0 (autograd's logsumexp of -inf only gives NaN there).
            expected = torch.where(torch.isneginf(sinks.detach()), 0.0, expected)
            delta = (do * o).sum(-1).detach()
            got = fn(sinks.detach().clone(), lse.detach().clone(), delta.clone())
            assert isinstance(got, torch.Tensor), f"{where}: return a tensor, got {type(got).__name__}"
            assert tuple(got.shape) == (h,), \
                f"{where}: the gradient has shape {tuple(got.shape)}; expected ({h},), one number per head: " \
                "each sink is shared by every query and batch entry of its head"
            got = got.detach().double()
            bad = (~torch.isclose(got, expected, atol=1e-8, rtol=1e-6)).nonzero().flatten().tolist()
            if bad:
                notes = [f"head {i} has no sink (s = -inf): its gradient is 0, also where a row sees no key "
                         "(lse = -inf)" for i in bad if math.isinf(sink_values[i])]
                raise AssertionError(f"{where}: heads {_spans(bad)} wrong: got {_fmt(got[bad])}, expected "
                                     f"{_fmt(expected[bad])}" + "".join(f"; {n}" for n in notes))


# --- 11.2 the window's first key block ---------------------------------------------------------------------------

# (Nq, Nk, window, BLOCK_M, BLOCK_N): square; ragged; Nq < Nk; a window of 1; Nq > Nk (tiles whose first queries
# see no key); a window wider than the cache; one query (a decoding step).
WINDOW_CASES = [(64, 64, 17, 16, 16), (37, 37, 20, 16, 16), (5, 70, 16, 16, 16), (40, 100, 1, 8, 32),
                (70, 5, 3, 16, 16), (48, 96, 200, 16, 32), (1, 200, 32, 16, 32)]


def first_visible_keys(start_m, block_m, seqlen_q, seqlen_k, window) -> list[int]:
    """The keys any query of the tile [start_m, start_m + block_m) sees, key by key from the rule: the query at
    row i sits at position p = i + Nk - Nq and sees keys p - window < j <= p."""
    keys = set()
    for i in range(start_m, min(start_m + block_m, seqlen_q)):
        p = i + seqlen_k - seqlen_q
        keys.update(j for j in range(max(p - window + 1, 0), min(p + 1, seqlen_k)))
    return sorted(keys)


def check_first_key_block(fn) -> None:
    """`fn(start_m, block_n, seqlen_q, seqlen_k, window) -> int`: the first key of the block where the key loop of
    the Q tile starting at query `start_m` begins, a multiple of block_n: the block that holds the first key any
    query of the tile sees (0 for a tile that sees none). Checked on every tile of each case; key_blocks and
    key_tiles_read (utils.sinks.forward) are refused while it runs."""
    from utils.sinks import forward

    if not callable(fn):
        raise TypeError(f"first_key_block must be a function, got {type(fn).__name__}")
    with refusing(forward.key_blocks, forward.key_tiles_read):
        for nq, nk, window, block_m, block_n in WINDOW_CASES:
            where = f"Nq={nq}, Nk={nk}, window={window}, BLOCK_M={block_m}, BLOCK_N={block_n}"
            wrong = []
            for start_m in range(0, nq, block_m):
                keys = first_visible_keys(start_m, block_m, nq, nk, window)
                expected = keys[0] // block_n * block_n if keys else 0
                got = fn(start_m, block_n, nq, nk, window)
                assert isinstance(got, int) and not isinstance(got, bool), \
                    f"{where}: return an int, got {type(got).__name__} for the tile at query {start_m}"
                if got != expected:
                    p = start_m + nk - nq
                    sees = (f"its first query sits at position {p} and sees keys {max(p - window + 1, 0)}–{p}"
                            if p >= 0 else f"its first query sits at position {p}, before the first key")
                    first = f"; the first key any of its queries sees is {keys[0]}" if keys else "; none sees a key"
                    wrong.append(f"tile of queries {start_m}–{min(start_m + block_m, nq) - 1}: got {got}, "
                                 f"expected {expected} ({sees}{first})")
            if wrong:
                more = f"\n  ... and {len(wrong) - 3} more tile(s)" if len(wrong) > 3 else ""
                raise AssertionError(f"{where}: {len(wrong)} tile(s) start their key loop at the wrong block:\n  "
                                     + "\n  ".join(wrong[:3]) + more)


# --- 11.3 the merge of two partial results, in a Triton kernel --------------------------------------------------

MERGE_ROWS, MERGE_DIM, MERGE_BLOCK = 45, 32, 16   # three row blocks, the last one ragged
# Row groups of the merge problem: (first row, last row + 1, what they hold)
MERGE_GROUPS = [(0, 5, "the second side sees no key (lse2 = -inf, o2 is NaN)"),
                (5, 10, "the first side sees no key (lse1 = -inf, o1 is NaN)"),
                (10, 13, "neither side sees a key: o = 0, lse = -inf"),
                (13, 21, f"log-sum-exps above {FP32_EXP_LIMIT}, where exp overflows fp32"),
                (21, MERGE_ROWS, "both sides see keys, ordinary logits")]


def merge_problem(seed: int = 0):
    """Two float64 partial attention results over disjoint key sets A (20 keys) and B (13 keys) of the same
    queries, and attention over A ∪ B: (o1, lse1, o2, lse2, o, lse). A side that sees no key has lse = -inf and an
    output of NaN, like memory nobody wrote: it must get no weight at all."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(MERGE_ROWS, MERGE_DIM, generator=gen, dtype=torch.float64) / math.sqrt(MERGE_DIM)
    q[13:21] *= 120.0                                     # large logits: lse far above fp32's exp limit
    k = torch.randn(33, MERGE_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(33, MERGE_DIM, generator=gen, dtype=torch.float64)
    seen = torch.ones(MERGE_ROWS, 33, dtype=torch.bool)
    seen[0:5, 20:] = False                                 # side B empty
    seen[5:10, :20] = False                                # side A empty
    seen[10:13] = False                                    # both empty
    seen[21:30, 3:20] = False                              # a few keys of A only
    scores = (q @ k.T).masked_fill(~seen, -math.inf)

    def attend(cols):
        s = scores[:, cols]
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[:, None])
        return p @ v[cols] / torch.where(torch.isneginf(lse), math.nan, 1.0)[:, None], lse

    (o1, lse1), (o2, lse2) = attend(slice(0, 20)), attend(slice(20, 33))
    o, lse = attend(slice(0, 33))
    return o1, lse1, o2, lse2, o.nan_to_num(0.0), lse


def run_merge_two(kernel, o1, lse1, o2, lse2, *, device="cpu"):
    """Launch a learner's merge kernel on contiguous fp32 copies, grid (cdiv(rows, MERGE_BLOCK),), outputs filled
    with NaN first so that a row never written shows; returns (o, lse) as float64 on the CPU."""
    rows, d = o1.shape
    args = [t.float().contiguous().to(device) for t in (o1, lse1, o2, lse2)]
    o = torch.full((rows, d), math.nan, device=device)
    lse = torch.full((rows,), math.nan, device=device)
    kernel[(math.ceil(rows / MERGE_BLOCK),)](*args, o, lse, rows, D=d, BLOCK_R=MERGE_BLOCK)
    return o.cpu().double(), lse.cpu().double()


def check_merge_two(kernel, *, device="cpu") -> None:
    """`kernel(O1, LSE1, O2, LSE2, O, LSE, n_rows, D, BLOCK_R)` must merge two normalised partial attention results
    row by row, one program per block of BLOCK_R rows. Checked against float64 attention over both key sets;
    the message names the wrong rows, their row blocks and what those rows hold. merge_two (utils.mla.cascade)
    and merge_partials (utils.decoding.split_kv) are refused while it runs."""
    from utils.decoding import split_kv
    from utils.mla import cascade

    o1, lse1, o2, lse2, o_ref, lse_ref = merge_problem()
    try:
        with refusing(cascade.merge_two, split_kv.merge_partials):
            o, lse = run_merge_two(kernel, o1, lse1, o2, lse2, device=device)
    except (RuntimeError, CompilationError) as err:   # on a GPU: Triton's compiler refused the kernel
        raise AssertionError(f"the kernel does not compile: {str(err).strip().splitlines()[-1]}") from err
    for got, expected, name, atol, rtol in ((o, o_ref, "merged o", 1e-4, 1e-4),
                                            (lse[:, None], lse_ref[:, None], "merged lse", 1e-4, 1e-5)):
        try:
            assert_rows_close(got, expected, atol=atol, rtol=rtol, block_rows=MERGE_BLOCK, name=name)
        except AssertionError as err:
            bad = (~torch.isclose(got, expected, atol=atol, rtol=rtol) | (torch.isnan(got) & ~torch.isnan(expected))
                   | (torch.isinf(got) & ~torch.isinf(expected))).any(-1)
            notes = [f"rows {lo}–{hi - 1} ({what}): {int(bad[lo:hi].sum())} of {hi - lo} wrong"
                     for lo, hi, what in MERGE_GROUPS if bad[lo:hi].any()]
            raise AssertionError(f"{err}\n  " + "\n  ".join(notes)) from None


# --- 11.4 per-block FP8 scales ----------------------------------------------------------------------------------

SCALE_BLOCK = 32


def scales_problem(seed: int = 0) -> torch.Tensor:
    """x (2, 3, 70, 16), float32: three blocks of 32 rows per (batch, head), the last 6 rows long; one block all
    zeros (batch 1, head 2, rows 32-63) and one whose largest magnitude is a negative entry (batch 0, head 1,
    block 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 70, 16, generator=gen)
    x[1, 2, 32:64] = 0.0
    x[0, 1, 40, 5] = -500.0
    return x


def expected_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """amax(|x|) / 448 over each block of `block` rows (all of head_dim), per (batch, head); 1 for a block of
    zeros. Row by row, from the definition."""
    *lead, n, _ = x.shape
    blocks = math.ceil(n / block)
    out = torch.empty(*lead, blocks, dtype=torch.float64)
    for i in range(blocks):
        amax = x[..., i * block:(i + 1) * block, :].abs().double().amax(dim=(-2, -1))
        out[..., i] = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    return out


def check_block_scales(fn) -> None:
    """`fn(x, block) -> scales`: x (..., seq, head_dim); scales (..., ceil(seq / block)), one per block of `block`
    rows of each (batch, head): its largest magnitude over 448, or 1 for a block of zeros. The course's quantisers
    (utils.fp8.quant) are refused while it runs."""
    from utils.fp8 import quant

    if not callable(fn):
        raise TypeError(f"block_scales must be a function, got {type(fn).__name__}")
    x = scales_problem()
    expected = expected_scales(x, SCALE_BLOCK)
    with refusing(quant.quantize_per_block, quant.quantize_per_tensor):
        got = fn(x.clone(), SCALE_BLOCK)
    assert isinstance(got, torch.Tensor), f"return a tensor of scales, got {type(got).__name__}"
    assert tuple(got.shape) == tuple(expected.shape), \
        f"x of shape {tuple(x.shape)}, blocks of {SCALE_BLOCK} rows: scales of shape {tuple(got.shape)}, expected " \
        f"{tuple(expected.shape)}: one per block of rows of each (batch, head), the last block short (rows 64–69)"
    got = got.detach().double().cpu()
    bad = ~torch.isclose(got, expected, atol=0.0, rtol=1e-6) | ~torch.isfinite(got)
    if bad.any():
        lines = []
        for bi, hi, blk in bad.nonzero().tolist()[:4]:
            rows = f"rows {blk * SCALE_BLOCK}–{min((blk + 1) * SCALE_BLOCK, x.shape[2]) - 1}"
            lines.append(f"batch {bi}, head {hi}, block {blk} ({rows}): got {got[bi, hi, blk].item():.4g}, "
                         f"expected {expected[bi, hi, blk].item():.4g}")
        notes = []
        if bad[1, 2, 1]:
            notes.append("batch 1, head 2, block 1 is all zeros: its scale is 1, so that x / scale stays 0")
        signed = x[0, 1, SCALE_BLOCK:2 * SCALE_BLOCK].max().item() / FP8_MAX   # the largest value, not magnitude
        if bad[0, 1, 1] and math.isclose(got[0, 1, 1].item(), signed, rel_tol=1e-5):
            notes.append("batch 0, head 1, block 1's largest magnitude is a negative entry, -500: the scale is set "
                         "by magnitudes, whatever their sign")
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} scales wrong:\n  " + "\n  ".join(lines + notes))
