import math

import pytest
import torch

from utils.checks import check_attention_inputs, resolve_scale
from utils.eager.reference import causal_mask, naive_attention, reference_attention, sdpa_attention
from utils.course.testing import random_qkv


def test_causal_mask_bottom_right():
    assert torch.equal(causal_mask(3, 3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(3, 1), torch.tensor([[0], [0], [1]], dtype=torch.bool))


def test_naive_matches_the_formula():
    q, k, v = random_qkv(1, 2, 5, 7, 8, dtype=torch.float64)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(naive_attention(q, k, v), p @ v)


@pytest.mark.parametrize("nq,nk", [(16, 16), (5, 9), (9, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_and_naive_agree(nq, nk, causal):
    q, k, v = random_qkv(2, 4, nq, nk, 16, kv_heads=2, dtype=torch.float64)
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=causal), naive_attention(q, k, v, causal=causal))


def test_fully_masked_rows_are_zero():
    q, k, v = random_qkv(1, 1, 6, 2, 8, dtype=torch.float64)
    for fn in (naive_attention, sdpa_attention, reference_attention):
        out = fn(q, k, v, causal=True)
        assert torch.isfinite(out).all() and out[..., :4, :].abs().max() == 0


def test_gqa_equals_repeated_heads():
    q, k, v = random_qkv(1, 4, 8, 8, 8, kv_heads=1, dtype=torch.float64)
    rep = dict(k=k.repeat(1, 4, 1, 1), v=v.repeat(1, 4, 1, 1))
    torch.testing.assert_close(naive_attention(q, k, v), naive_attention(q, rep["k"], rep["v"]))


def test_reference_is_float64():
    q, k, v = random_qkv(1, 1, 4, 4, 8, dtype=torch.float16)
    assert reference_attention(q, k, v).dtype == torch.float64


def _qkv(**changes):
    q, k, v = random_qkv(1, 4, 8, 8, 16)
    return {**dict(q=q, k=k, v=v), **changes}


@pytest.mark.parametrize("args,error,match", [
    (_qkv(q=[1]), TypeError, "q must be a torch.Tensor"),
    (_qkv(k=torch.zeros(8, 16)), ValueError, "k must have 4 dims"),
    (_qkv(v=torch.zeros(1, 4, 0, 16)), ValueError, "v is empty"),
    (_qkv(q=torch.zeros(1, 4, 8, 16, dtype=torch.int32)), TypeError, "q has dtype"),
    (_qkv(k=torch.zeros(1, 4, 8, 16, dtype=torch.float64)), TypeError, "k has dtype"),
    (_qkv(k=torch.zeros(1, 4, 8, 16, device="meta")), ValueError, "k is on meta"),
    (_qkv(v=torch.zeros(1, 4, 9, 16)), ValueError, "v has shape"),
    (_qkv(k=torch.zeros(2, 4, 8, 16), v=torch.zeros(2, 4, 8, 16)), ValueError, "k has batch"),
    (_qkv(k=torch.zeros(1, 4, 8, 8), v=torch.zeros(1, 4, 8, 8)), ValueError, "k has head_dim"),
    (_qkv(k=torch.zeros(1, 3, 8, 16), v=torch.zeros(1, 3, 8, 16)), ValueError, "not a multiple"),
])
def test_check_attention_inputs_names_the_bad_argument(args, error, match):
    with pytest.raises(error, match=match):
        check_attention_inputs(**args)


def test_check_attention_inputs_head_dims_and_causal():
    q, k, v = random_qkv(1, 2, 4, 4, 80)
    assert check_attention_inputs(q, k, v).head_dim == 80
    with pytest.raises(ValueError, match="head_dim 80 is not supported"):
        check_attention_inputs(q, k, v, head_dims=(64, 128))
    with pytest.raises(TypeError, match="causal"):
        check_attention_inputs(q, k, v, causal="yes")


def test_resolve_scale():
    assert resolve_scale(None, 64) == 0.125 and resolve_scale(0.5, 64) == 0.5
    for bad, error in (("0.1", TypeError), (True, TypeError), (0.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="sm_scale"):
            resolve_scale(bad, 64)
