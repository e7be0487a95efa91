"""utils.eager.softmax: the softmax variants, partial states and their merge, log-sum-exp, merged attention."""
import math
import random

import pytest
import torch

from utils.eager.reference import reference_attention
from utils.eager.softmax import (LOG2E, attention_with_lse, empty_state, logsumexp, lse_from_state, merge_attention,
                           merge_states, naive_softmax, online_softmax, safe_softmax, softmax_exp2, softmax_state)
from utils.course.testing import random_qkv

NEG_INF = float("-inf")
VARIANTS = [naive_softmax, safe_softmax, online_softmax,
            lambda x, dim=-1: online_softmax(x, dim, block_size=7), softmax_exp2]
STABLE = VARIANTS[1:]


def rows(*shape, scale=3.0, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("fn", VARIANTS)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_variants_match_torch_softmax(fn, dim):
    x = rows(5, 33, 4)
    torch.testing.assert_close(fn(x, dim=dim), torch.softmax(x, dim=dim))


@pytest.mark.parametrize("fn", VARIANTS)
def test_variants_keep_dtype(fn):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = fn(rows(3, 20, scale=1.0, dtype=dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), torch.softmax(rows(3, 20, scale=1.0), -1), atol=1e-2, rtol=5e-2)


def test_naive_softmax_overflows_where_safe_does_not():
    x = torch.tensor([10.0, 12.0], dtype=torch.float16)  # exp(12) = 162755 > 65504, fp16's largest value
    assert torch.isnan(naive_softmax(x)).any()
    for fn in STABLE:
        torch.testing.assert_close(fn(x).double(), torch.softmax(x.double(), -1), atol=1e-3, rtol=1e-3)
    big = torch.tensor([1000.0, 999.0])  # overflows in fp32 too
    assert torch.isnan(naive_softmax(big)).any() and torch.isfinite(safe_softmax(big)).all()


@pytest.mark.parametrize("block_size", [1, 2, 5, 64, 1000])
def test_online_softmax_any_block_size(block_size):
    x = rows(4, 64, scale=20.0)
    torch.testing.assert_close(online_softmax(x, block_size=block_size), torch.softmax(x, -1))


@pytest.mark.parametrize("fn", STABLE)
def test_rows_without_finite_entries_give_zeros(fn):
    x = rows(3, 8)
    x[0] = NEG_INF          # fully masked row
    x[1, :5] = NEG_INF      # partly masked row
    out = fn(x)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    torch.testing.assert_close(out[1:], torch.softmax(x[1:], -1))


@pytest.mark.parametrize("fn", STABLE)
def test_empty_dim(fn):
    assert fn(torch.zeros(3, 0)).shape == (3, 0)


def test_softmax_exp2_scale():
    x = rows(4, 16)
    torch.testing.assert_close(softmax_exp2(x, scale=0.125), torch.softmax(0.125 * x, -1))
    assert LOG2E == pytest.approx(1 / math.log(2))


def test_softmax_state_and_logsumexp():
    x = rows(6, 50, scale=30.0)
    m, l = softmax_state(x)
    torch.testing.assert_close(m, x.amax(-1))
    torch.testing.assert_close(l, torch.exp(x - m[:, None]).sum(-1))
    assert (l >= 1).all()  # the maximum contributes exp(0) = 1
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))
    torch.testing.assert_close(lse_from_state(m, l), torch.logsumexp(x, -1))
    torch.testing.assert_close(logsumexp(x, dim=0), torch.logsumexp(x, 0))


def test_empty_and_fully_masked_states():
    m, l = softmax_state(torch.zeros(3, 0))
    assert m.shape == l.shape == (3,) and (m == NEG_INF).all() and (l == 0).all()
    m, l = softmax_state(torch.full((2, 4), NEG_INF))
    assert (m == NEG_INF).all() and (l == 0).all()
    assert (lse_from_state(m, l) == NEG_INF).all()
    em, el = empty_state((2,), dtype=torch.float64)
    assert em.dtype == torch.float64 and (em == NEG_INF).all() and (el == 0).all()


def random_blocks(x, gen):
    """Split x's last dim at random cut points into 1..8 blocks (some may be empty)."""
    n = x.shape[-1]
    cuts = sorted(gen.randint(0, n) for _ in range(gen.randint(0, 7)))
    bounds = [0, *cuts, n]
    return [x[..., a:b] for a, b in zip(bounds, bounds[1:])]


def merge_in_random_order(states, gen):
    """Merge a list of states by repeatedly merging a random adjacent or non-adjacent pair (any tree, any order)."""
    states = list(states)
    while len(states) > 1:
        i, j = gen.sample(range(len(states)), 2)
        merged = merge_states(*states[i], *states[j])
        states = [s for t, s in enumerate(states) if t not in (i, j)] + [merged]
    return states[0]


@pytest.mark.parametrize("seed", range(20))
def test_merge_of_random_blocks_in_random_order_is_the_whole(seed):
    gen = random.Random(seed)
    x = rows(4, gen.randint(1, 40), scale=gen.choice([1.0, 10.0, 100.0]), seed=seed)
    x[0, : x.shape[1] // 2] = NEG_INF  # a partly masked row
    m, l = merge_in_random_order([softmax_state(b) for b in random_blocks(x, gen)], gen)
    m_all, l_all = softmax_state(x)
    torch.testing.assert_close(m, m_all)
    torch.testing.assert_close(l, l_all)


def test_merge_is_associative_and_commutative_with_identity():
    a, b, c = (softmax_state(rows(5, 9, scale=10.0, seed=s)) for s in range(3))
    left = merge_states(*merge_states(*a, *b), *c)
    right = merge_states(*a, *merge_states(*b, *c))
    for u, w in zip(left, right):
        torch.testing.assert_close(u, w)
    for u, w in zip(merge_states(*a, *b), merge_states(*b, *a)):
        torch.testing.assert_close(u, w)
    for u, w in zip(merge_states(*a, *empty_state((5,), dtype=torch.float64)), a):
        torch.testing.assert_close(u, w)


def test_merging_empty_states_gives_no_nan():
    m, l = merge_states(*empty_state((3,)), *empty_state((3,)))
    assert (m == NEG_INF).all() and (l == 0).all()


def test_merge_states_validates():
    m, l = softmax_state(rows(3, 4))
    with pytest.raises(ValueError, match="m_a has shape"):
        merge_states(m[:2], l, m, l)
    with pytest.raises(ValueError, match="m_a has shape .* m_b"):
        merge_states(m[:2], l[:2], m, l)
    with pytest.raises(TypeError, match="l_b must be a torch.Tensor"):
        merge_states(m, l, m, [1.0])
    with pytest.raises(TypeError, match="floating-point"):
        merge_states(m, l, m.long(), l)


@pytest.mark.parametrize("fn", [*VARIANTS, softmax_state, logsumexp])
def test_softmax_functions_validate(fn):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.arange(4))
    with pytest.raises(ValueError, match="out of range"):
        fn(torch.zeros(2, 3), dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        fn(torch.zeros(2, 3), dim=True)
    with pytest.raises(ValueError, match="at least one dimension"):
        fn(torch.tensor(1.0))


def test_block_size_and_scale_validation():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            online_softmax(torch.zeros(2, 3), block_size=bad)
    for bad in (0.0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="scale"):
            softmax_exp2(torch.zeros(2, 3), scale=bad)


def test_attention_with_lse_matches_reference():
    q, k, v = random_qkv(2, 4, 9, 13, 16, kv_heads=2, dtype=torch.float64)
    for causal in (False, True):
        o, lse = attention_with_lse(q, k, v, causal=causal)
        torch.testing.assert_close(o, reference_attention(q, k, v, causal=causal))
        assert lse.shape == (2, 4, 9) and lse.dtype == torch.float64
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 4
    torch.testing.assert_close(attention_with_lse(q, k, v)[1], torch.logsumexp(scores, -1))


def test_attention_with_lse_fully_masked_rows():
    q, k, v = random_qkv(1, 1, 6, 2, 8)
    o, lse = attention_with_lse(q, k, v, causal=True)  # the first 4 queries see no key
    assert (lse[..., :4] == NEG_INF).all() and torch.isfinite(lse[..., 4:]).all()
    assert o[..., :4, :].abs().max() == 0 and torch.isfinite(o).all()
    assert lse.dtype == torch.float32 and o.dtype == torch.float32


def test_attention_with_lse_validates():
    q, k, v = random_qkv(1, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        attention_with_lse(q[0], k, v)
    with pytest.raises(ValueError, match="sm_scale"):
        attention_with_lse(q, k, v, sm_scale=-1.0)


@pytest.mark.parametrize("seed", range(10))
def test_merge_attention_over_random_key_chunks_in_random_order(seed):
    gen = random.Random(seed)
    nk = gen.randint(2, 40)
    q, k, v = random_qkv(1, 2, 5, nk, 8, dtype=torch.float64, seed=seed)
    cuts = sorted(set(gen.randint(1, nk - 1) for _ in range(gen.randint(1, 5))))
    bounds = [0, *cuts, nk]
    parts = [attention_with_lse(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])]
    while len(parts) > 1:
        i, j = gen.sample(range(len(parts)), 2)
        merged = merge_attention(*parts[i], *parts[j])
        parts = [p for t, p in enumerate(parts) if t not in (i, j)] + [merged]
    o, lse = parts[0]
    o_all, lse_all = attention_with_lse(q, k, v)
    torch.testing.assert_close(o, o_all)
    torch.testing.assert_close(lse, lse_all)


def test_merge_attention_ignores_empty_parts():
    q, k, v = random_qkv(1, 2, 5, 7, 8, dtype=torch.float64)
    o, lse = attention_with_lse(q, k, v)
    garbage = torch.full_like(o, float("nan"))
    empty = torch.full_like(lse, NEG_INF)
    for a, b in ((o, lse), (garbage, empty)), ((garbage, empty), (o, lse)):
        o_m, lse_m = merge_attention(*a, *b)
        torch.testing.assert_close(o_m, o)
        torch.testing.assert_close(lse_m, lse)
    o_m, lse_m = merge_attention(garbage, empty, garbage, empty)
    assert (o_m == 0).all() and (lse_m == NEG_INF).all()


def test_merge_attention_keeps_o_dtype():
    o = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    lse = torch.randn(2, 3)
    o_m, lse_m = merge_attention(o, lse, o, lse)
    assert o_m.dtype == torch.bfloat16 and lse_m.dtype == torch.float32
    torch.testing.assert_close(o_m, o)  # two equal halves: the same average
    torch.testing.assert_close(lse_m, lse + math.log(2))


def test_merge_attention_validates():
    o, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match="o_a has shape"):
        merge_attention(o, lse, o[:1], lse)
    with pytest.raises(ValueError, match="lse_a has shape"):
        merge_attention(o, lse[:1], o, lse[:1])
    with pytest.raises(TypeError, match="lse_b must be a torch.Tensor"):
        merge_attention(o, lse, o, None)
