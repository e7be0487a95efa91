"""Attention sinks and sliding windows (notebook 11, utils/sinks): the float64 reference against the formula with an
explicit sink column, gradcheck, the Triton forward and backward against the reference (in the interpreter on a
CPU), the window's skipped key blocks, and the errors for bad arguments."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from utils.sinks import backward, forward
from utils.sinks.backward import sink_attention, sink_attention_backward
from utils.sinks.forward import key_blocks, key_tiles_read, sink_attention_forward
from utils.sinks.reference import sink_attention_reference, visible_keys

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL = forward.Config(16, 16, 4, 1)                        # several key blocks on small shapes: every loop runs
SMALL_BWD = backward.Config(16, 16, 4, 1, 16, 16, 4, 1)
FP32 = dict(atol=1e-4, rtol=1e-4)                           # exact ("ieee") fp32 dots; errors seen are ~1e-6


def inputs(b, h, hk, nq, nk, d, *, sinks=True, dtype=torch.float32, seed=0):
    """Standard-normal q (b, h, nq, d), k and v (b, hk, nk, d), and sinks (h,) of spread ±2 (or None)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEVICE, dtype)

    s = rand(h, std=2.0) if sinks else None
    return rand(b, h, nq, d), rand(b, hk, nk, d), rand(b, hk, nk, d), s


def as_double(*tensors):
    return [None if t is None else t.detach().double() for t in tensors]


# --- (a) the reference against the formula with the sink as an explicit column ---------------------------------


def concat_formula(q, k, v, sinks, *, causal, window, sm_scale=None):
    """softmax over [scores | sink] times [V ; 0]: the sink written as a key whose value is a zero row. The mask is
    written out here from the definition, not taken from utils.sinks."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * (sm_scale or 1 / math.sqrt(d))
    seen = torch.ones(nq, nk, dtype=torch.bool)
    for i in range(nq):
        pos = i + nk - nq
        for j in range(nk):
            seen[i, j] = not causal or (j <= pos and (window is None or j > pos - window))
    scores = scores.masked_fill(~seen.to(q.device), float("-inf"))
    sink_col = (torch.full((h,), float("-inf"), dtype=q.dtype, device=q.device) if sinks is None else sinks)
    scores = torch.cat([scores, sink_col[None, :, None, None].expand(b, h, nq, 1)], dim=-1)
    values = torch.cat([v, torch.zeros(b, h, 1, d, dtype=v.dtype, device=v.device)], dim=2)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # a row with neither key nor sink: 0
    return probs @ values, torch.logsumexp(scores, dim=-1)


def test_window_semantics_by_hand():
    """Window 2, Nq = Nk = 4: each query sees itself and the key before it; Nq = 2 < Nk = 4: bottom-right."""
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible_keys(4, 4, causal=True, window=2), expected)
    assert torch.equal(visible_keys(2, 4, causal=True, window=2), expected[2:])
    assert torch.equal(visible_keys(2, 4, causal=True), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))


# (b, h, hk, nq, nk, d, causal, window, sinks)
REFERENCE_CASES = [(2, 4, 2, 9, 9, 8, False, None, True), (1, 2, 1, 6, 11, 8, True, 3, True),
                   (1, 2, 2, 11, 6, 8, True, 2, True), (1, 2, 2, 11, 6, 8, True, None, False),
                   (1, 2, 1, 7, 7, 8, True, 1, False)]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_matches_the_concat_formula(case):
    *shape, causal, window, with_sinks = case
    q, k, v, s = as_double(*inputs(*shape, sinks=with_sinks))
    o, lse = sink_attention_reference(q, k, v, s, causal=causal, window=window, sm_scale=0.4)
    o_cat, lse_cat = concat_formula(q, k, v, s, causal=causal, window=window, sm_scale=0.4)
    torch.testing.assert_close(o, o_cat, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_cat, atol=1e-12, rtol=1e-12)
    if causal and shape[3] > shape[4]:   # Nq > Nk: the first queries see no key
        unseen = slice(0, shape[3] - shape[4])
        assert (o[:, :, unseen] == 0).all()
        expected = s[None, :, None].expand_as(lse[:, :, unseen]) if with_sinks else torch.full_like(
            lse[:, :, unseen], float("-inf"))
        torch.testing.assert_close(lse[:, :, unseen], expected, atol=0, rtol=0)


def test_a_sink_takes_attention_from_the_keys():
    """A sink at -inf is no sink; a very large one takes all the attention (o -> 0, lse -> s)."""
    q, k, v, _ = as_double(*inputs(1, 2, 2, 8, 8, 8, sinks=False))
    o, lse = sink_attention_reference(q, k, v, causal=True)
    def sinks(value):
        return torch.full((2,), value, dtype=torch.float64, device=q.device)

    o_inf, lse_inf = sink_attention_reference(q, k, v, sinks(-math.inf), causal=True)
    torch.testing.assert_close(o_inf, o)        # float64 rounding: a GPU may sum the extra column in another order
    torch.testing.assert_close(lse_inf, lse)
    o_big, lse_big = sink_attention_reference(q, k, v, sinks(60.0), causal=True)
    assert o_big.abs().max() < 1e-15 and torch.allclose(lse_big, torch.full_like(lse_big, 60.0))


# --- (b) gradcheck of the reference --------------------------------------------------------------------------


@pytest.mark.parametrize("causal, window, nq, nk", [(False, None, 4, 5), (True, 2, 5, 5), (True, None, 6, 3)])
def test_reference_gradcheck(causal, window, nq, nk):
    """float64, GQA, sinks always (so no lse is -inf); the third case has rows that see no key (Nq > Nk)."""
    tensors = [t.requires_grad_() for t in as_double(*inputs(1, 2, 1, nq, nk, 4, seed=3))]

    def fn(q, k, v, s):
        return sink_attention_reference(q, k, v, s, causal=causal, window=window)

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-7)


# --- (c) the Triton forward against the reference ------------------------------------------------------------

# A covering selection, not the product: every value of each axis appears at least once (lengths 37/37, 5/70,
# 70/5; heads 2/2, 4/2, 2/1; head dims 16 and 64; non-causal, causal, windows 1, 16 = a block, 100 > N; with and
# without sinks), and so does each pairing that changes the kernel's loop bounds or its first state: window with
# sinks and without, window with Nq < Nk (decoding-like: the first blocks are skipped) and Nq > Nk (rows that see
# no key: output 0, lse = the sink), window with GQA, sinks without causal.
# (b, h, hk, nq, nk, d, causal, window, sinks)
FORWARD_CASES = [
    (1, 2, 2, 37, 37, 16, False, None, True),
    (1, 4, 2, 37, 37, 64, True, None, False),
    (1, 4, 2, 37, 37, 16, True, 1, True),
    (2, 2, 2, 37, 37, 64, True, 16, True),
    (1, 4, 2, 37, 37, 16, True, 100, True),
    (1, 4, 2, 5, 70, 16, True, 16, True),
    (1, 2, 2, 5, 70, 64, True, 16, False),
    (1, 2, 2, 5, 70, 64, False, None, True),
    (1, 2, 1, 70, 5, 16, True, 3, True),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_matches_reference(case):
    *shape, causal, window, with_sinks = case
    q, k, v, s = inputs(*shape, sinks=with_sinks)
    o, lse = sink_attention_forward(q, k, v, s, causal=causal, window=window, config=SMALL)
    o_ref, lse_ref = sink_attention_reference(*as_double(q, k, v, s), causal=causal, window=window)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, **FP32)
    torch.testing.assert_close(lse.double(), lse_ref, **FP32)   # equal infinities count as close
    if causal and shape[3] > shape[4]:   # rows that see no key: the sink takes everything
        unseen = slice(0, shape[3] - shape[4])
        assert (o[:, :, unseen] == 0).all()
        torch.testing.assert_close(lse[:, :, unseen], s[None, :, None].expand_as(lse[:, :, unseen]), **FP32)


@pytest.mark.skipif(CUDA, reason="the CPU (interpreter) path for bf16")
def test_bf16_on_cpu_is_computed_in_fp32():
    q, k, v, s = inputs(1, 2, 2, 20, 28, 32, dtype=torch.bfloat16)
    o, lse = sink_attention_forward(q, k, v, s, causal=True, window=8)
    o32, lse32 = sink_attention_forward(q.float(), k.float(), v.float(), s, causal=True, window=8)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    tensors = [t.requires_grad_() for t in (q, k, v, s)]
    grads = torch.autograd.grad(sink_attention(*tensors, causal=True, window=8), tensors, torch.ones_like(q))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 4


# --- (d) the Triton backward against the reference's autograd ------------------------------------------------


def reference_grads(q, k, v, s, do, *, causal, window, sm_scale=None):
    tensors = [None if t is None else t.requires_grad_() for t in as_double(q, k, v, s)]
    o, _ = sink_attention_reference(*tensors, causal=causal, window=window, sm_scale=sm_scale)
    wrt = [t for t in tensors if t is not None]
    grads = torch.autograd.grad(o, wrt, do.double())
    return (*grads, None) if s is None else grads


def assert_grads_close(actual, expected):
    """Each gradient within 2e-4 (fp32) of its largest entry."""
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), actual, expected, strict=True):
        if e is None:
            assert a is None, f"{name} should be None without sinks"
            continue
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        scale = max(1.0, e.abs().max().item())
        torch.testing.assert_close(a.double(), e, atol=2e-4 * scale, rtol=2e-4, msg=lambda m, n=name: f"{n}: {m}")


# Every window size, both directions of Nq != Nk, GQA and MQA, both head dims, sinks with and without causal.
BACKWARD_CASES = [
    (1, 2, 2, 37, 37, 16, False, None, True),
    (1, 4, 2, 37, 37, 64, True, 16, True),
    (1, 2, 1, 37, 37, 16, True, 1, True),
    (1, 4, 2, 5, 70, 16, True, 100, True),
    (1, 2, 1, 70, 5, 16, True, 3, True),
    (1, 2, 2, 40, 70, 16, True, 16, False),
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=str)
def test_backward_matches_reference(case):
    *shape, causal, window, with_sinks = case
    q, k, v, s = inputs(*shape, sinks=with_sinks)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    o, lse = sink_attention_forward(q, k, v, s, causal=causal, window=window)
    grads = sink_attention_backward(do, q, k, v, s, o, lse, causal=causal, window=window, config=SMALL_BWD)
    assert_grads_close(grads, reference_grads(q, k, v, s, do, causal=causal, window=window))


@pytest.mark.gpu
def test_backward_tries_smaller_tiles_where_the_first_are_too_big(monkeypatch, refusing):
    """As the lesson backward: Triton's "out of resource: shared memory" for the first tiles, the next ones.
    The first tiles' launch is made to fail as Triton's does (the lesson's test compiles truly oversized tiles;
    the sink kernels take minutes to compile at that size)."""
    too_big = backward.Config(64, 128, 8, 3, 128, 64, 8, 3)
    tried = []
    monkeypatch.setattr(backward, "candidate_configs", lambda d, dtype, smem=None: [too_big, SMALL_BWD])
    monkeypatch.setattr(backward, "check_config", refusing(too_big, tried, lambda config, kind: config))
    q, k, v, s = inputs(1, 4, 2, 70, 70, 128)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    o, lse = sink_attention_forward(q, k, v, s, causal=True, window=16)
    grads = sink_attention_backward(do, q, k, v, s, o, lse, causal=True, window=16)
    assert tried == [too_big, SMALL_BWD]
    assert_grads_close(grads, reference_grads(q, k, v, s, do, causal=True, window=16))


def test_autograd_with_a_custom_scale():
    q, k, v, s = inputs(1, 4, 2, 30, 40, 32)
    tensors = [t.requires_grad_() for t in (q, k, v, s)]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = sink_attention(*tensors, causal=True, window=12, sm_scale=0.3)
    grads = torch.autograd.grad(out, tensors, do)
    assert [g.dtype for g in grads] == [torch.float32] * 4
    assert_grads_close(grads, reference_grads(q, k, v, s, do, causal=True, window=12, sm_scale=0.3))


# --- (e) the window's key loop starts where the window does --------------------------------------------------


@pytest.mark.parametrize("nq, nk, window", [(37, 37, 1), (37, 37, 16), (37, 37, 20), (5, 70, 16), (70, 5, 3),
                                            (45, 90, 33), (40, 40, None)])
def test_key_blocks_cover_exactly_the_visible_keys(nq, nk, window):
    """For every Q tile (block 16): the range read starts at the block of the first key any row sees and ends after
    the last; the unmasked blocks are seen by every row; the ranges are in order and block-aligned."""
    seen = visible_keys(nq, nk, causal=True, window=window)
    for start_m in range(0, nq, 16):
        n_lo, n_mid, n_full, n_end = key_blocks(start_m, block_m=16, block_n=16, seqlen_q=nq, seqlen_k=nk,
                                                causal=True, window=window)
        assert n_lo <= n_mid <= n_full <= n_end and n_lo % 16 == n_mid % 16 == n_full % 16 == 0
        rows = seen[start_m:start_m + 16]
        cols = rows.any(0).nonzero().flatten()
        if len(cols):
            assert n_lo == cols.min() // 16 * 16 and n_end == cols.max() + 1
        else:
            assert n_end <= n_lo   # nothing read
        assert rows[:, n_mid:n_full].all()


def test_key_tiles_read_counts_blocks():
    """Nq = Nk = 256, blocks 32: each Q tile reads 8 key blocks; causal, tile t reads t + 1; window 16, at most 2."""
    config = forward.Config(32, 32, 4, 1)
    assert key_tiles_read(256, 256, config=config) == 64
    assert key_tiles_read(256, 256, causal=True, config=config) == 36
    assert key_tiles_read(256, 256, causal=True, window=16, config=config) == 1 + 7 * 2


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")   # the interpreter's max over NaN rows
def test_forward_never_reads_keys_outside_the_window():
    """Keys 0-63 are NaN. With window 8 and blocks of 16, the tile of queries 80-95 starts at key block 64 (query 80
    sees keys 73-80): its output is finite and right. Reading a NaN block, even masked, would give NaN (0 · NaN in
    P·V), as it does without the window, where the same tile reads every key."""
    q, k, v, s = inputs(1, 2, 2, 96, 96, 16)
    o_ref, _ = sink_attention_reference(*as_double(q, k, v, s), causal=True, window=8)
    k[:, :, :64], v[:, :, :64] = float("nan"), float("nan")
    o, _ = sink_attention_forward(q, k, v, s, causal=True, window=8, config=SMALL)
    torch.testing.assert_close(o[:, :, 80:].double(), o_ref[:, :, 80:], **FP32)
    assert o[:, :, :64].isnan().all()   # these queries see NaN keys
    o_causal, _ = sink_attention_forward(q, k, v, s, causal=True, config=SMALL)
    assert o_causal[:, :, 80:].isnan().all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_backward_never_reads_outside_the_window():
    """dQ of queries 80-95 with keys 0-63 NaN (window 8); dK, dV of keys 0-15 with queries and dO 32-95 NaN (key 15
    is seen by queries up to 22, in Q blocks 0 and 1): finite and equal to the clean inputs' gradients."""
    q, k, v, s = inputs(1, 2, 2, 96, 96, 16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    dq_ref, dk_ref, dv_ref, _ = reference_grads(q, k, v, s, do, causal=True, window=8)

    def grads(q, k, v, do):
        o, lse = sink_attention_forward(q, k, v, s, causal=True, window=8, config=SMALL)
        return sink_attention_backward(do, q, k, v, s, o, lse, causal=True, window=8, config=SMALL_BWD)

    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :64], v_nan[:, :, :64] = float("nan"), float("nan")
    dq = grads(q, k_nan, v_nan, do)[0]
    torch.testing.assert_close(dq[:, :, 80:].double(), dq_ref[:, :, 80:], atol=2e-4, rtol=2e-4)
    q_nan, do_nan = q.clone(), do.clone()
    q_nan[:, :, 32:], do_nan[:, :, 32:] = float("nan"), float("nan")
    _, dk, dv, _ = grads(q_nan, k, v, do_nan)
    torch.testing.assert_close(dk[:, :, :16].double(), dk_ref[:, :, :16], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(dv[:, :, :16].double(), dv_ref[:, :, :16], atol=2e-4, rtol=2e-4)
    assert dk[:, :, 16:].isnan().any()   # keys that NaN queries see do get NaN


def test_the_forward_does_not_import_the_backward():
    """The autograd entry lives with the backward (tests/test_layout.py's rule for forward/backward pairs)."""
    tree = ast.parse(Path(forward.__file__).read_text())
    names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "utils.sinks.backward" not in names
    assert "utils.tiled.forward" in names   # the reader sees imports: the lesson's pieces are imported


# --- (f) bad arguments ---------------------------------------------------------------------------------------


def call_reference(q, k, v, s, **kw):
    return sink_attention_reference(q, k, v, s, **kw)


def call_forward(q, k, v, s, **kw):
    return sink_attention_forward(q, k, v, s, **kw)


def call_autograd(q, k, v, s, **kw):
    return sink_attention(q, k, v, s, **kw)


def call_backward(q, k, v, s, **kw):
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], device=q.device)
    return sink_attention_backward(o, q, k, v, s, o, lse, **kw)


BAD_ARGUMENTS = [
    (dict(s=torch.zeros(3)), ValueError, "sinks"),                       # (heads,) is (2,)
    (dict(s=torch.zeros(1, 2)), ValueError, "sinks"),
    (dict(s=torch.zeros(2, dtype=torch.int64)), TypeError, "sinks"),
    (dict(s=[0.0, 0.0]), TypeError, "sinks"),
    (dict(s=torch.zeros(2, device="meta")), ValueError, "sinks"),        # another device than q's
    (dict(window=0, causal=True), ValueError, "window"),
    (dict(window=-4, causal=True), ValueError, "window"),
    (dict(window=2.5, causal=True), TypeError, "window"),
    (dict(window=True, causal=True), TypeError, "window"),
    (dict(window=4), ValueError, "window"),                              # without causal
]


@pytest.mark.parametrize("fn", [call_reference, call_forward, call_autograd, call_backward])
@pytest.mark.parametrize("kwargs, error, name", BAD_ARGUMENTS)
def test_bad_arguments_are_named(fn, kwargs, error, name):
    q, k, v, s = inputs(1, 2, 2, 8, 8, 16)
    kwargs = dict(kwargs)
    s = kwargs.pop("s", s)
    with pytest.raises(error, match=name):
        fn(q, k, v, s, **kwargs)
