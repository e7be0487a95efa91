"""utils.eager.mha.MultiHeadAttention: shapes, equality with torch.nn.MultiheadAttention, swappable kernels,
validation."""
import math

import pytest
import torch
from torch import nn

from utils.eager.mha import MultiHeadAttention
from utils.eager.reference import naive_attention, sdpa_attention


def x_input(batch=2, seq=7, embed=32, dtype=torch.float64, seed=0):
    return torch.randn(batch, seq, embed, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def make(embed=32, heads=4, **kwargs):
    torch.manual_seed(0)
    return MultiHeadAttention(embed, heads, dtype=torch.float64, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_multihead_attention(causal):
    mha = make()
    ref = nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.out.weight)
        ref.out_proj.bias.copy_(mha.out.bias)
    x = x_input()
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64) if causal else None
    expected, _ = ref(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(mha(x, causal=causal), expected)


def test_head_split_layout():
    mha = make()
    qkv = torch.arange(2 * 5 * 96, dtype=torch.float64).reshape(2, 5, 96)
    q, k, v = mha.split_heads(qkv)
    assert q.shape == k.shape == v.shape == (2, 4, 5, 8)
    torch.testing.assert_close(q, qkv[..., :32].reshape(2, 5, 4, 8).transpose(1, 2))
    torch.testing.assert_close(v, qkv[..., 64:].reshape(2, 5, 4, 8).transpose(1, 2))
    torch.testing.assert_close(mha.merge_heads(k), qkv[..., 32:64])


def test_kernel_is_swappable_and_gets_scale_and_causal():
    seen = {}

    def spy(q, k, v, *, causal=False, sm_scale=None):
        seen.update(shape=tuple(q.shape), causal=causal, sm_scale=sm_scale)
        return naive_attention(q, k, v, causal=causal, sm_scale=sm_scale)

    x = x_input()
    out_sdpa = make(causal=True)(x)
    out_spy = make(causal=True, attention=spy)(x)
    assert seen == dict(shape=(2, 4, 7, 8), causal=True, sm_scale=1 / math.sqrt(8))
    torch.testing.assert_close(out_spy, out_sdpa)
    torch.testing.assert_close(make(attention="naive")(x), make(attention=sdpa_attention)(x))
    make(causal=True, attention=spy)(x, causal=False)
    assert seen["causal"] is False


def test_causal_output_ignores_future_tokens():
    mha = make(causal=True)
    x = x_input()
    y = x.clone()
    y[:, 4:] = torch.randn_like(y[:, 4:])
    torch.testing.assert_close(mha(x)[:, :4], mha(y)[:, :4])
    assert not torch.allclose(mha(x)[:, 4:], mha(y)[:, 4:])


def test_gradients_flow():
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    mha(x).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in mha.parameters())


def test_no_bias_and_repr():
    mha = MultiHeadAttention(16, 2, bias=False)
    assert mha.qkv.bias is None and mha.out.bias is None
    assert "num_heads=2" in repr(mha) and "sdpa_attention" in repr(mha)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((30, 4), {}, ValueError, "not divisible"),
    ((32.0, 4), {}, TypeError, "embed_dim must be an int"),
    ((32, 0), {}, ValueError, "num_heads must be positive"),
    ((32, True), {}, TypeError, "num_heads must be an int"),
    ((32, 4), {"causal": 1}, TypeError, "causal must be a bool"),
    ((32, 4), {"bias": None}, TypeError, "bias must be a bool"),
    ((32, 4), {"attention": 3}, TypeError, "attention must be a callable"),
    ((32, 4), {"attention": "no-such-kernel"}, ValueError, "not in the registry"),
])
def test_constructor_validates(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(*args, **kwargs)


def test_forward_validates():
    mha = MultiHeadAttention(32, 4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mha([[1.0]])
    with pytest.raises(ValueError, match="x must have shape"):
        mha(torch.randn(7, 32))
    with pytest.raises(ValueError, match="x must have shape"):
        mha(torch.randn(2, 7, 16))
    with pytest.raises(TypeError, match="x is torch.float64"):
        mha(torch.randn(2, 7, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="causal must be a bool or None"):
        mha(torch.randn(2, 7, 32), causal="yes")
