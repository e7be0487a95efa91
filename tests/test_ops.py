"""utils.ops.attention: the Triton kernels as torch.library operators (issue 76): opcheck, autograd against the
float64 reference, and a transformer block that torch.compile takes whole (fullgraph=True)."""
from functools import partial

import pytest
import torch

from utils.course.testing import assert_attention_matches_reference, assert_gradients_match_reference, random_qkv
from utils.ops import attention as ops
from utils.ops.model import Block, sdpa_causal

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32   # the interpreter has no bf16 arithmetic
KERNELS = list(ops.KERNELS)


def inputs(b=1, h=4, hk=2, nq=40, nk=72, d=32, *, layout="bhnd", seed=0):
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=DTYPE, device=DEVICE, seed=seed)
    if layout == "bnhd":   # views of a (batch, seq, heads, dim) buffer, as a model's projections give them
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


# make test runs one case (the registry's kernel, causal, a model's layout); the operators share their code.
@pytest.mark.parametrize("kernel,causal,layout", [
    ("triton", True, "bnhd"),
    *(pytest.param(*case, marks=pytest.mark.full) for case in [("triton", False, "bhnd"),
                                                                ("triton_lesson", True, "bnhd"),
                                                                ("triton_lesson", False, "bhnd")])])
def test_opcheck_passes(kernel, causal, layout):
    """Schema, fake tensors (shapes, dtypes, strides), autograd registration and a dynamic-shape trace."""
    q, k, v = (t.requires_grad_() for t in inputs(layout=layout))
    torch.library.opcheck(ops.OPS[kernel], (q, k, v, causal, 0.2))
    o, lse = ops.OPS[kernel](q, k, v, causal, 0.2)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.course.__getattr__(f"{kernel}_attention_backward"),
                          (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, causal, 0.2))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_operator_matches_the_reference_forward_and_backward(kernel, causal):
    q, k, v = inputs(nq=72, nk=40)   # Nq > Nk, causal: the first rows see no key
    fn = partial(ops.attention, kernel=kernel)
    assert_attention_matches_reference(fn, q, k, v, causal=causal)
    assert_gradients_match_reference(fn, q, k, v, causal=causal)
    o, lse = ops.attention(q, k, v, causal=causal, kernel=kernel, return_lse=True)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and o.is_contiguous()


def test_bad_arguments_are_refused():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops.attention(q, k, v, kernel="mine")
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ops.attention(q, k, v, return_lse=1)
    k3, v3 = (torch.cat([t, t[:, :1]], dim=1) for t in (k, v))   # 3 K/V heads for 4 query heads
    with pytest.raises(ValueError, match="not a multiple"):
        ops.attention(q, k3, v3)
    with pytest.raises(TypeError, match="sm_scale"):
        ops.attention(q, k, v, sm_scale="big")


@pytest.mark.parametrize("kernel", [k if k == "triton" else pytest.param(k, marks=pytest.mark.full) for k in KERNELS])
def test_a_transformer_block_compiles_whole_and_trains_like_sdpa(kernel):
    """fullgraph=True fails on any graph break, so the operator is one node of the compiled graph. On a CPU the
    graph runs through aot_eager (the kernels in the interpreter); on a GPU through inductor."""
    torch.manual_seed(0)   # float32 (exact dots in the kernels), so that SDPA's answer is close to the digit
    ours = Block(partial(ops.attention, causal=True, kernel=kernel)).to(DEVICE)
    theirs = Block(sdpa_causal).to(DEVICE)
    theirs.load_state_dict(ours.state_dict())
    compiled = torch.compile(ours, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    x = torch.randn(2, 48, 64, device=DEVICE)
    y, y_ref = compiled(x), theirs(x)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, y_ref, **tol)
    y.square().mean().backward()
    y_ref.square().mean().backward()
    for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
