"""Exercise checks of notebook 07b: the fake functions of the attention operators, and a transformers adapter."""
from __future__ import annotations

import importlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# (batch, heads, kv_heads, Nq, Nk, head_dim, layout, dtype): GQA, Nq != Nk, a model's transposed layout, fp16
CASES = [(1, 4, 2, 40, 72, 32, "bhnd", torch.float32),
         (2, 4, 4, 33, 17, 64, "bnhd", torch.float32),
         (1, 8, 1, 16, 50, 16, "bnhd", torch.float16)]


class _OpLog(TorchDispatchMode):
    """Records the name of every operator dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.name()))
        return func(*args, **(kwargs or {}))


def _inputs(b, h, hk, nq, nk, d, layout, dtype):
    def make(heads, n):
        if layout == "bnhd":   # a view of a (batch, seq, heads, dim) buffer, as a model's projections give it
            return torch.empty(b, n, heads, d, dtype=dtype).transpose(1, 2)
        return torch.empty(b, heads, n, d, dtype=dtype)
    return make(h, nq), make(hk, nk), make(hk, nk)


def _call_fake(fake, args, where: str, names: tuple) -> tuple:
    """fake(*args) on fake tensors, refused if it calls a course operator; its outputs, checked to be a tuple of
    len(names) tensors."""
    log = _OpLog()
    with log:
        out = fake(*args)
    course = sorted({n for n in log.names if n.startswith("course::")})
    assert not course, f"{where}: your function calls the course's operator ({', '.join(course)}); " \
                       "a fake function describes the outputs itself"
    assert isinstance(out, tuple) and len(out) == len(names) and all(isinstance(t, torch.Tensor) for t in out), \
        f"{where}: return a tuple ({', '.join(names)}) of {len(names)} tensors, got {type(out).__name__}"
    return out


def check_attention_fake(fake) -> None:
    """`fake(q, k, v, causal, scale) -> (o, lse)` must say what the operator returns without computing it: o new
    and contiguous, q's shape and dtype; lse (batch, heads, Nq) in float32. It runs on fake tensors; calling the
    course's operator is refused."""
    if not callable(fake):
        raise TypeError(f"fake must be a function, got {type(fake).__name__}")
    for case in CASES:
        b, h, hk, nq, nk, d, layout, dtype = case
        where = _case_name(*case)
        with FakeTensorMode() as mode:
            q, k, v = (mode.from_tensor(t) for t in _inputs(*case))
            o, lse = _call_fake(fake, (q, k, v, True, 0.125), where, ("o", "lse"))
        assert tuple(o.shape) == tuple(q.shape), f"{where}: o has shape {tuple(o.shape)}, expected q's " \
                                                 f"{tuple(q.shape)}"
        assert o.dtype == q.dtype, f"{where}: o has dtype {o.dtype}, expected q's {q.dtype}"
        assert o.is_contiguous(), (f"{where}: o has strides {o.stride()}, but the kernel writes a new contiguous "
                                   f"tensor, strides {torch.empty(o.shape).stride()}")
        assert tuple(lse.shape) == (b, h, nq), f"{where}: lse has shape {tuple(lse.shape)}, expected " \
                                               f"{(b, h, nq)}: one number per query row of each head"
        assert lse.dtype == torch.float32, f"{where}: lse has dtype {lse.dtype}; the kernels keep it in float32"
        assert lse.is_contiguous(), f"{where}: lse has strides {lse.stride()}; the kernel writes it contiguous"


def _case_name(b, h, hk, nq, nk, d, layout, dtype):
    return (f"q {b}x{h}x{nq}x{d} ({layout} layout{', not contiguous' if layout == 'bnhd' else ''}), "
            f"k and v {b}x{hk}x{nk}x{d}, {str(dtype).removeprefix('torch.')}")


def check_backward_fake(fake) -> None:
    """`fake(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)` must describe the backward operator's outputs
    (shapes, dtypes, strides) as the course's registered fake does, which opcheck holds to the kernels. It runs
    on fake tensors; calling the course's operator is refused."""
    importlib.import_module("utils.ops.attention")   # registers the course's operators

    if not callable(fake):
        raise TypeError(f"fake must be a function, got {type(fake).__name__}")
    for case in CASES:
        b, h, hk, nq, nk, d, layout, dtype = case
        where = _case_name(*case)
        with FakeTensorMode() as mode:
            q, k, v = (mode.from_tensor(t) for t in _inputs(*case))
            o, do = torch.empty(b, h, nq, d, dtype=dtype), torch.empty(b, h, nq, d, dtype=dtype)
            lse = torch.empty(b, h, nq, dtype=torch.float32)
            args = (do, q, k, v, o, lse, True, 0.125)
            expected = torch.ops.course.triton_attention_backward(*args)   # the registered fake
            out = _call_fake(fake, args, where, ("dq", "dk", "dv"))
        for name, got, want, of in zip(("dq", "dk", "dv"), out, expected, ("q", "k", "v")):
            assert tuple(got.shape) == tuple(want.shape), \
                f"{where}: {name} has shape {tuple(got.shape)}, expected {of}'s {tuple(want.shape)}"
            assert got.dtype == want.dtype, f"{where}: {name} has dtype {got.dtype}, expected {want.dtype}"
            assert got.stride() == want.stride(), \
                f"{where}: {name} has strides {got.stride()}, expected {want.stride()}: the kernels write each " \
                f"gradient laid out like {of}"


def _reference(q, k, v, causal, scale):
    """Float64 attention with K/V heads shared by groups of query heads, causal aligned to the last key."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = scale * q.double() @ k.transpose(-2, -1)
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(nk - nq + 1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)   # (batch, seq, heads, head_dim), as transformers wants


def check_transformers_adapter(fn) -> None:
    """`fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs)` must
    return (output of shape (batch, seq, heads, head_dim), None); causal from is_causal, else from
    module.is_causal; the default scale 1/sqrt(head_dim); and refuse a mask and dropout with a ValueError.
    The course's finished adapter (utils.ops.hf) is refused while it runs."""
    from types import SimpleNamespace

    from utils.course.exercises.refuse import refusing
    from utils.ops import hf

    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    device = "cuda" if torch.cuda.is_available() else "cpu"   # where the course's kernels run
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 16, generator=gen).to(device) for h in (4, 2, 2))
    cases = [("module causal, scaling 0.3", SimpleNamespace(is_causal=True), dict(scaling=0.3), True, 0.3),
             ("is_causal=False given", SimpleNamespace(is_causal=True), dict(is_causal=False), False, 0.25),
             ("scaling None (default 1/sqrt(16))", SimpleNamespace(is_causal=False), {}, False, 0.25)]
    with refusing(hf.attention_function, hf.register):
        for name, module, kwargs, causal, scale in cases:
            out = fn(module, q, k, v, None, **kwargs)
            assert isinstance(out, tuple) and len(out) == 2 and out[1] is None, \
                f"{name}: return (output, None); transformers reads attention weights from the second item"
            o, want = out[0], _reference(q, k, v, causal, scale)
            assert tuple(o.shape) == tuple(want.shape), \
                f"{name}: output of shape {tuple(o.shape)}, expected (batch, seq, heads, head_dim) = " \
                f"{tuple(want.shape)}"
            bad = ((o.double() - want).abs() > 1e-4).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            assert not bad, f"{name}: query positions {bad[0]}–{bad[-1]} wrong (causal={causal}, scale={scale:.3g})"
        mask = torch.ones(1, 1, 24, 24, dtype=torch.bool, device=device)
        for name, args, kwargs in (("a padding mask", (mask,), {}), ("dropout=0.1", (None,), dict(dropout=0.1))):
            try:
                fn(SimpleNamespace(is_causal=True), q, k, v, *args, **kwargs)
            except ValueError:
                continue
            raise AssertionError(f"{name}: no ValueError; the kernel cannot honour it, so the adapter must refuse")
