"""Split-KV decoding with a sink and a window (utils/sinks/decode.py): `sink_decode` against the float64 reference
over ragged caches, the splits dividing only the window's range, keys before the window never read, the sink
counted once however many splits, `decode_traffic` against hand counts, and the errors for bad arguments."""
from __future__ import annotations

import inspect

import pytest
import torch

from utils.decoding.single_path import split_kv_contiguous
from utils.sinks import decode
from utils.sinks.decode import decode_traffic, sink_decode, split_kv_window
from utils.sinks.reference import sink_attention_reference, visible_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (1, 37, 100)      # ragged: one entry (shorter than two new tokens), a partial tile, several tiles
CAPACITY = 112              # entries past each length are in the cache but not the sequence's
HEADS, KV_HEADS, HEAD_DIM, BLOCK_N = 4, 2, 16, 16
# fp32 inputs: exact products in the interpreter (errors seen ~1e-6), TF32 on a GPU, as notebook 08's kernel
TOL = dict(atol=5e-3, rtol=5e-3) if DEVICE == "cuda" else dict(atol=1e-4, rtol=1e-4)


def inputs(n_q, *, sinks=True, seed=0):
    """q (3, 4, n_q, 16), caches (3, 2, 112, 16), sinks (4,) of spread ±2 or None, and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(LENGTHS), HEADS, n_q, HEAD_DIM, generator=gen)
    k, v = (torch.randn(len(LENGTHS), KV_HEADS, CAPACITY, HEAD_DIM, generator=gen) for _ in range(2))
    s = 2 * torch.randn(HEADS, generator=gen) if sinks else None
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    return [None if t is None else t.to(DEVICE) for t in (q, k, v, s, lengths)]


def reference(q, k, v, s, *, window):
    """The float64 reference, one sequence at a time over the first seqlens[b] entries of its cache: (o, lse)."""
    outs = [sink_attention_reference(q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(),
                                     None if s is None else s.double(), causal=True, window=window)
            for b, n in enumerate(LENGTHS)]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def first_visible(n, n_q, window):
    """The first cache entry any new token of a sequence of n entries sees, read off the reference's mask."""
    seen = visible_keys(n_q, n, causal=True, window=window).any(0).nonzero()
    return int(seen.min()) if len(seen) else n


# A covering selection of new tokens {1, 2} × window {None, 1, 16, 200 > the cache} × sinks {no, yes} × splits
# {1, 3}, not the product of 32: every value of each axis meets every value of each other axis in some case.
# Every case has the three ragged lengths and GQA 4:2. n_q = 2 on the one-entry sequence gives a row that sees no key (output 0, lse = the sink or -inf);
# window 1 leaves each row one key; window 16 starts the range inside a tile (the load mask's case), two tiles.
# (n_q, window, sinks, splits)
CASES = [(1, None, False, 1), (2, None, True, 3),
         (1, 1, True, 3), (2, 1, False, 1),
         (1, 16, False, 3), (2, 16, True, 1), (2, 16, False, 3),
         (1, 200, True, 1), (2, 200, False, 3)]


@pytest.mark.parametrize("n_q, window, with_sinks, splits", CASES, ids=str)
def test_sink_decode_matches_reference(n_q, window, with_sinks, splits):
    q, k, v, s, lengths = inputs(n_q, sinks=with_sinks)
    o, lse = sink_decode(q, k, v, s, seqlens=lengths, window=window, num_splits=splits, block_n=BLOCK_N)
    o_ref, lse_ref = reference(q, k, v, s, window=window)
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and o.shape == q.shape
    torch.testing.assert_close(o.double(), o_ref, **TOL)
    torch.testing.assert_close(lse.double(), lse_ref, **TOL)   # equal infinities count as close
    if n_q == 2:   # the one-entry sequence: its first new token sees nothing
        assert (o[0, :, 0] == 0).all()
        expected = s if with_sinks else torch.full((HEADS,), float("-inf"), device=DEVICE)
        torch.testing.assert_close(lse[0, :, 0], expected, atol=0, rtol=0)


def test_sink_is_counted_once_however_many_splits():
    """Seven splits, large sinks (so that a sink counted more than once would show): right against the reference.
    The cases above run one and three splits with sinks."""
    q, k, v, s, lengths = inputs(1, seed=1)
    s = s.abs() + 2.0
    o_ref, lse_ref = reference(q, k, v, s, window=None)
    o, lse = sink_decode(q, k, v, s, seqlens=lengths, num_splits=7, block_n=BLOCK_N)
    torch.testing.assert_close(o.double(), o_ref, **TOL)
    torch.testing.assert_close(lse.double(), lse_ref, **TOL)


def test_the_splits_divide_only_the_window(monkeypatch):
    """Window 16, three splits: the visible range of each sequence spans T tiles of 16 (1, 2, 2), so splits 0 to
    T - 1 see keys and the rest none; the sink is the last partial. Splits dividing the whole cache would leave
    split 0 of the 37- and 100-entry sequences before the window, with no key (lse -inf)."""
    captured, merge = {}, decode.merge_partials

    def capture(o_parts, lse_parts, **kwargs):
        captured["lse"] = lse_parts.clone()
        return merge(o_parts, lse_parts, **kwargs)

    monkeypatch.setattr(decode, "merge_partials", capture)
    q, k, v, s, lengths = inputs(1, seed=2)
    sink_decode(q, k, v, s, seqlens=lengths, window=16, num_splits=3, block_n=BLOCK_N)
    lse = captured["lse"]                                     # (3, 4, 1, 3 splits + the sink)
    assert lse.shape == (3, HEADS, 1, 4)
    torch.testing.assert_close(lse[..., 3], s[None, :, None].expand(3, HEADS, 1), atol=0, rtol=0)
    for b, n in enumerate(LENGTHS):
        tiles = (n - 1) // BLOCK_N - first_visible(n, 1, 16) // BLOCK_N + 1
        saw_keys = torch.isfinite(lse[b, :, 0, :3])
        expected = torch.tensor([split < tiles for split in range(3)], device=DEVICE)
        assert (saw_keys == expected).all(), f"sequence {b}: splits that saw keys {saw_keys[0].tolist()}"


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")   # the interpreter's max over NaN rows
def test_keys_before_the_window_are_never_read():
    """Each cache's entries before its window (two new tokens, window 16) and past its length are NaN. The output
    is finite and right: no program reads them, even in the tile where the window starts. Without the window the
    same entries are read, and the output is NaN."""
    q, k, v, s, lengths = inputs(2, seed=3)
    o_ref, _ = reference(q, k, v, s, window=16)
    for b, n in enumerate(LENGTHS):
        first = first_visible(n, 2, 16)
        for cache in (k, v):
            cache[b, :, :first] = float("nan")
            cache[b, :, n:] = float("nan")
    assert k[2].isnan().any() and k[1].isnan().any()          # the 37- and 100-entry caches have such entries
    for splits in (1, 3):
        o, _ = sink_decode(q, k, v, s, seqlens=lengths, window=16, num_splits=splits, block_n=BLOCK_N)
        assert o.isfinite().all()
        torch.testing.assert_close(o.double(), o_ref, **TOL)
    o_all, _ = sink_decode(q, k, v, s, seqlens=lengths, num_splits=3, block_n=BLOCK_N)
    assert o_all[1:].isnan().all()


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU (interpreter) path for bf16")
def test_bf16_on_cpu_is_computed_in_fp32():
    q, k, v, s, lengths = inputs(2, seed=4)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    o, lse = sink_decode(q, k, v, s, seqlens=lengths, window=16, num_splits=3)
    o32, lse32 = sink_decode(q.float(), k.float(), v.float(), s, seqlens=lengths, window=16, num_splits=3)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(lse, lse32)


def test_the_kernel_is_notebook_08s_plus_the_window():
    """Beyond its docstring, the kernel differs from `split_kv_contiguous` in its signature, the range the splits
    divide, the load mask and the window's mask, and nothing else: the notebook shows it as that diff."""
    old, new = (inspect.getsource(kernel.fn) for kernel in (split_kv_contiguous, split_kv_window))
    old_body, new_body = (set(src.split('"""')[2].splitlines()) for src in (old, new))
    changed = old_body ^ new_body
    assert len(changed) <= 18, f"more than the window changed: {sorted(changed)}"
    assert "CAUSAL" not in new and "WINDOW" not in new   # one path: always causal, no window is a long window


# --- decode_traffic against hand counts ----------------------------------------------------------------------

def first_visible_count(n, n_q, window):
    """The entries some new token sees, from the reference's mask: what decode_traffic calls keys."""
    return int(visible_keys(n_q, n, causal=True, window=window).any(0).sum())



def test_decode_traffic_by_hand():
    """Batch 2, 8 heads over 2 KV heads, 1000 entries, head dim 64, bf16. Without a window every entry is read:
    K and V 2·2·2·1000·64·2 = 1,024,000 bytes, q and o 2·2·8·64·2 = 4,096; FLOPs 4·2·8·1000·64 = 4,096,000. With
    window 128 and one new token, 128 entries; with three new tokens, 128 + 2 = 130; a window past the cache is
    none."""
    full = decode_traffic(2, 8, 2, 1000, 64)
    assert full == (1000, 4_096_000, 1_024_000 + 4_096)
    assert decode_traffic(2, 8, 2, 1000, 64, window=128) == (128, 4 * 2 * 8 * 128 * 64, 2 * 2 * 2 * 128 * 64 * 2 + 4_096)
    three = decode_traffic(2, 8, 2, 1000, 64, window=128, n_q=3, dtype_bytes=4)
    assert three == (130, 4 * 2 * 8 * 3 * 130 * 64, 2 * 2 * 2 * 130 * 64 * 4 + 2 * 2 * 8 * 3 * 64 * 4)
    assert decode_traffic(2, 8, 2, 1000, 64, window=5000) == full
    assert three.keys == first_visible_count(1000, 3, 128)


# --- bad arguments -------------------------------------------------------------------------------------------


BAD_ARGUMENTS = [
    (dict(q=torch.zeros(3, 4, 16)), ValueError, "q"),
    (dict(q=torch.zeros(3, 3, 1, 16)), ValueError, "heads"),                 # 3 query heads over 2 KV heads
    (dict(k_cache=torch.zeros(3, 2, 112, 16, dtype=torch.float16)), TypeError, "k has dtype"),
    (dict(q=torch.zeros(3, 4, 1, 24), k_cache=torch.zeros(3, 2, 112, 24), v_cache=torch.zeros(3, 2, 112, 24)),
     ValueError, "head_dim"),
    (dict(sinks=torch.zeros(2)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks"),
    (dict(seqlens=[1, 37, 100]), TypeError, "seqlens"),
    (dict(seqlens=torch.tensor([1.0, 37.0, 100.0])), TypeError, "seqlens"),
    (dict(seqlens=torch.tensor([1, 37], dtype=torch.int32)), ValueError, "seqlens"),
    (dict(seqlens=torch.tensor([1, 37, 113], dtype=torch.int32)), ValueError, "seqlens"),
    (dict(seqlens=torch.tensor([-1, 37, 100], dtype=torch.int32)), ValueError, "seqlens"),
    (dict(window=0), ValueError, "window"),
    (dict(window=2.5), TypeError, "window"),
    (dict(window=True), TypeError, "window"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=1.0), TypeError, "num_splits"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(block_n=24), ValueError, "block_n"),
]


@pytest.mark.parametrize("change, error, name", BAD_ARGUMENTS, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_arguments_are_named(change, error, name):
    q, k, v, s, lengths = inputs(1)
    args = dict(q=q, k_cache=k, v_cache=v, sinks=s, seqlens=lengths)
    args.update({key: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for key, x in change.items()})
    with pytest.raises(error, match=name):
        sink_decode(**args)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(heads=6, kv_heads=4), ValueError, "kv_heads"), (dict(seqlen=0), ValueError, "seqlen"),
    (dict(window=0), ValueError, "window"), (dict(n_q=1.5), TypeError, "n_q"),
    (dict(dtype_bytes=True), TypeError, "dtype_bytes")])
def test_decode_traffic_names_bad_arguments(kwargs, error, name):
    args = dict(batch=1, heads=8, kv_heads=2, seqlen=100, head_dim=64) | kwargs
    with pytest.raises(error, match=name):
        decode_traffic(**args)
