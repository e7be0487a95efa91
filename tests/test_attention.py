"""Every implementation in the registry against the float64 reference, on the shapes this device can afford.

On a CPU the shapes are small (Triton kernels run in the interpreter); on a GPU larger ones join them.
"""
import pytest
import torch

from utils import gpu
from utils.attention import REGISTRY, implementations
from utils.course.testing import (ATTENTION_SHAPES, assert_attention_matches_reference, assert_gradients_match_reference,
                           pairwise, random_qkv)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
IMPLS = implementations(DEVICE)

SHAPES = list(ATTENTION_SHAPES)
if CUDA:
    SHAPES += [
        (2, 8, 8, 1000, 1000, 64),
        (2, 8, 2, 128, 1000, 128),
        (1, 4, 4, 1000, 128, 256),
        (4, 16, 16, 1024, 1024, 64),
        (1, 8, 1, 4096, 4096, 128),
    ]


def _shapes_of(impl):
    return [s for s in SHAPES if (impl.head_dims is None or s[5] in impl.head_dims) and (s[1] == s[2] or impl.gqa)]


def _tag(name, shape, causal, dtype, layout=None):
    b, h, hk, nq, nk, d = shape
    return "-".join([name, f"{b}x{h}/{hk}x{nq}x{nk}x{d}", "causal" if causal else "full", str(dtype)[6:],
                     *([layout] if layout else [])])


# How the cases are chosen. The axes are the shape (which fixes head dim, GQA and the two lengths), causal,
# dtype and layout. Rather than their full product, each implementation runs a covering design of strength 2
# (utils.course.testing.pairwise): every value of every axis, and every pair of values of any two axes, at least once.
# Because a shape carries its head dim, GQA and lengths, covering (shape, dtype) covers (head dim, dtype),
# (GQA, dtype) and so on too. A bug that needs three axes to meet can slip through; the kernels' own test files
# run the combinations their code branches on. `naive` is left out: the reference is naive attention itself.
SELF_REFERENCE = {"naive"}


def cases():
    for name in IMPLS:
        if name in SELF_REFERENCE:
            continue
        impl = REGISTRY[name]
        axes = dict(shape=_shapes_of(impl), causal=(False, True) if impl.causal else (False,),
                    dtype=impl.dtypes, layout=("bhnd", "bnhd"))
        for row in pairwise(axes):
            yield pytest.param(name, row["shape"], row["causal"], row["dtype"], row["layout"],
                               id=_tag(name, row["shape"], row["causal"], row["dtype"], row["layout"]))


def supported_dtype(name):
    """float32 where the implementation takes it, else its first dtype (the tensor-core-only kernels)."""
    dtypes = REGISTRY[name].dtypes
    return torch.float32 if torch.float32 in dtypes else dtypes[0]


def make_inputs(shape, dtype, layout, seed=0):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=seed)
    if layout == "bnhd":  # views of a (batch, seq, heads, head_dim) buffer: not contiguous
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("name,shape,causal,dtype,layout", list(cases()))
def test_matches_reference(name, shape, causal, dtype, layout):
    q, k, v = make_inputs(shape, dtype, layout)
    out = assert_attention_matches_reference(IMPLS[name], q, k, v, causal=causal)
    assert out.dtype == dtype and out.device == q.device


def grad_cases():
    """Every differentiable implementation (but the reference's own formula) over a covering design of shape,
    causal and dtype: float32 on a CPU (the interpreter's bf16 is fp32 anyway), each of its grad_dtypes on a GPU;
    the largest GPU shape is left to the forward test."""
    for name in IMPLS:
        impl = REGISTRY[name]
        if name in SELF_REFERENCE or not impl.grad_dtypes:
            continue
        if name == "cuda" and CUDA and gpu.capability() < (8, 0):
            continue  # its backward is the tensor-core kernel's (sm_80+); the fallback of a T4 is forward only
        dtypes = impl.grad_dtypes if CUDA else [d for d in impl.grad_dtypes if d == torch.float32]
        shapes = [s for s in _shapes_of(impl) if not CUDA or s != SHAPES[-1]]
        if not dtypes or not shapes:
            continue
        axes = dict(shape=shapes, causal=(False, True) if impl.causal else (False,), dtype=dtypes)
        for row in pairwise(axes):
            yield pytest.param(name, row["shape"], row["causal"], row["dtype"],
                               id=_tag(name, row["shape"], row["causal"], row["dtype"]))


@pytest.mark.parametrize("name,shape,causal,dtype", list(grad_cases()))
def test_gradients_match_reference(name, shape, causal, dtype):
    """dq, dk, dv by autograd through the implementation against float64 autograd through the formula."""
    q, k, v = make_inputs(shape, dtype, "bhnd")
    assert_gradients_match_reference(IMPLS[name], q, k, v, causal=causal, sm_scale=None)


@pytest.mark.parametrize("name", list(IMPLS))
def test_custom_scale(name):
    q, k, v = make_inputs((1, 2, 2, 16, 16, 64), supported_dtype(name), "bhnd")
    assert_attention_matches_reference(IMPLS[name], q, k, v, sm_scale=0.05)


@pytest.mark.parametrize("name", list(IMPLS))
def test_large_logits_stay_finite(name):
    """Scores far beyond exp's range: a correct softmax subtracts the row maximum first."""
    q, k, v = make_inputs((1, 2, 2, 32, 32, 64), supported_dtype(name), "bhnd")
    q = q * 30  # scores of order 1e3-1e4 after the 1/8 scale
    out = assert_attention_matches_reference(IMPLS[name], q, k, v, causal=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(IMPLS))
def test_bad_inputs_raise_clear_errors(name):
    fn = IMPLS[name]
    q, k, v = make_inputs((1, 4, 4, 8, 8, 64), supported_dtype(name), "bhnd")
    with pytest.raises(ValueError, match="q must have 4 dims"):
        fn(q[0], k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        fn(q, k.double() if q.dtype != torch.float64 else k.float(), v)
    with pytest.raises(ValueError, match="not a multiple"):
        fn(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="empty"):
        fn(q[:, :, :0], k, v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fn(q.tolist(), k, v)
    head_dims = REGISTRY[name].head_dims
    if head_dims is not None:
        d = next(d for d in range(8, 512, 8) if d not in head_dims)
        q, k, v = make_inputs((1, 1, 1, 8, 8, d), supported_dtype(name), "bhnd")
        with pytest.raises(ValueError, match="head_dim"):
            fn(q, k, v)


def test_registry_entries_are_well_formed():
    for name, impl in REGISTRY.items():
        assert impl.name == name and ":" in impl.target and impl.runs_on in ("any", "triton", "cuda")
    assert {"sdpa", "naive"} <= set(implementations("cpu"))
    with pytest.raises(TypeError):
        implementations(0)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_tensors_on_the_wrong_device_raise_value_errors_naming_them(name):
    """Every implementation, available here or not: CPU tensors for a GPU-only kernel, or q, k, v on two
    devices, give a ValueError that names the tensor, never a crash or an error from deep inside a library."""
    fn, runs_on = REGISTRY[name].load(), REGISTRY[name].runs_on
    q, k, v = random_qkv(1, 2, 8, 8, 64, dtype=supported_dtype(name))
    other = "cuda" if CUDA else "meta"  # a second device: the GPU if there is one, else PyTorch's meta device
    with pytest.raises(ValueError, match=f"k is on {other}.* but q is on cpu"):
        fn(q, k.to(other), v)
    if CUDA:
        with pytest.raises(ValueError, match="v is on cpu but q is on cuda"):
            fn(q.cuda(), k.cuda(), v)
    gpu_only = runs_on == "cuda" or (runs_on == "triton" and CUDA)  # on a GPU machine the interpreter is off
    if gpu_only:
        with pytest.raises(ValueError, match="q is on (cpu|the CPU)"):
            fn(q, k, v)


def test_an_implementation_for_one_gpu_generation_is_available_there_only(monkeypatch):
    """cuda_hopper's sm_90a code runs on sm_90 alone: not on the CPU, an A100, a Blackwell or an emulated T4."""
    from utils import gpu

    impl = REGISTRY["cuda_hopper"]
    assert impl.capability == (9, 0) and not impl.available(torch.device("cpu"))
    for capability, expected in (((9, 0), True), ((8, 0), False), ((10, 0), False), ((7, 5), False)):
        monkeypatch.setattr(gpu, "capability", lambda device=None, c=capability: c)
        assert impl.available(torch.device("cuda")) is expected, capability
    assert REGISTRY["cuda"].available(torch.device("cuda"))  # no capability: any CUDA GPU
