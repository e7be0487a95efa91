"""utils.flex (notebook 10): every modifier, forward and backward, against the float64 reference; block masks;
packed sequences; the errors a bad argument gets. On a CPU the kernels run in the Triton interpreter."""
import pytest
import torch
import triton
import triton.language as tl

from utils import flex
from utils.flex.attention import SPARSE_TILES, _Problem, pick_configs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=2e-3), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def modifiers(n):
    docs = flex.document_ids([n // 5, 0, n // 3, 1, n - n // 5 - n // 3 - 1], device=DEVICE)
    per_batch = torch.stack([docs, flex.document_ids([n // 2, n - n // 2], device=DEVICE)])
    return [None, flex.causal(), flex.sliding_window(n // 4), flex.sliding_window(n // 4, causal=False),
            flex.alibi(4, device=DEVICE), flex.alibi(4, causal=False, device=DEVICE), flex.softcap(4.0),
            flex.softcap(4.0, window=n // 5), flex.softcap(3.0, causal=False), flex.document(docs),
            flex.document(per_batch, causal=False), flex.prefix_lm(n // 3)]


def qkv(b, h, hk, nq, nk, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, n, d, generator=gen).to(DEVICE, dtype).requires_grad_()
            for heads, n in ((h, nq), (hk, nk), (hk, nk))]


def check_against_reference(mod, q, k, v, **kw):
    o, lse = flex.flex_attention(q, k, v, mod, return_lse=True, **kw)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rlse = flex.reference(q64, k64, v64, mod, sm_scale=kw.get("sm_scale"))
    rgrads = torch.autograd.grad(ro, (q64, k64, v64), do.double())
    tol = TOL[q.dtype]
    torch.testing.assert_close(o.double(), ro.double(), **tol, msg=lambda m: f"O of {mod}: {m}")
    torch.testing.assert_close(lse.double(), rlse, **tol, msg=lambda m: f"lse of {mod}: {m}")
    for name, g, r in zip("qkv", grads, rgrads):
        torch.testing.assert_close(g.double(), r, **tol, msg=lambda m: f"d{name} of {mod}: {m}")


# Each modifier runs in make test; four twins of kept cases (the same modifier, causal or not) run in the full suite.
TWINS = {"ALiBi", "softcap 3", "sliding window 17, causal", "document, causal"}


@pytest.mark.parametrize("index", [pytest.param(i, id=name, marks=pytest.mark.full if name in TWINS else ())
                                   for i, name in enumerate(m.name if m else "none" for m in modifiers(70))])
def test_every_modifier_forward_and_backward(index):
    mod = modifiers(70)[index]
    check_against_reference(mod, *qkv(2, 4, 2, 70, 70, 32))


@pytest.mark.parametrize("shape", [(1, 2, 1, 33, 77, 48), (1, 2, 2, 77, 40, 16), (2, 2, 2, 1, 50, 64)])
@pytest.mark.parametrize("mod", ["causal", "window", "softcap"])
def test_odd_shapes(shape, mod):
    mod = {"causal": flex.causal(), "window": flex.sliding_window(9), "softcap": flex.softcap(2.0)}[mod]
    check_against_reference(mod, *qkv(*shape))


@triton.jit
def _note_positions(q_idx, kv_idx, args):
    """Keep the largest position given in the slot just past the table (args[0], args[1] entries long)."""
    tl.atomic_max(args[0] + args[1] + 0 * (q_idx + kv_idx), tl.maximum(q_idx, kv_idx).to(tl.float32))


@triton.jit
def _position_scale(score, b, h, q_idx, kv_idx, args):
    _note_positions(q_idx, kv_idx, args)
    return score * tl.load(args[0] + q_idx) * tl.load(args[0] + kv_idx)


@triton.jit
def _position_scale_grad(score, b, h, q_idx, kv_idx, args):
    _note_positions(q_idx, kv_idx, args)
    return tl.load(args[0] + q_idx) * tl.load(args[0] + kv_idx) + 0 * score


@pytest.mark.parametrize("masked", [False, True], ids=["score_mod", "with_mask_mod"])
@pytest.mark.parametrize("nq, nk", [(40, 70), pytest.param(70, 70, marks=pytest.mark.full), (1, 50)])
def test_modifiers_get_no_position_past_the_last_key(masked, nq, nk):
    """Ragged tiles hold rows past the last query and keys past the last key: the modifiers (score_mod, its
    derivative, mask_mod) get them clamped to the last key, so a score_mod that indexes a per-position table
    never reads past its end. The one here scales by table[q] · table[kv] and notes the largest position it is
    given, forward and backward."""
    buf = torch.full((nk + 1,), -1.0, device=DEVICE)   # the table, then the slot for the largest position
    buf[:nk] = 0.5 + torch.rand(nk, generator=torch.Generator().manual_seed(nq)).to(DEVICE)
    table = buf[:nk]
    mod = flex.Modifier("position scale", score_mod=_position_scale, score_grad=_position_scale_grad,
                        torch_score=lambda s, b, h, q, kv: s * table[q] * table[kv], tensor=table, int_arg=nk,
                        indexed_by="position", mask_mod=flex.causal().mask_mod if masked else None,
                        torch_mask=flex.causal().torch_mask if masked else None)
    q, k, v = qkv(1, 2, 1, nq, nk, 16)
    o = flex.flex_attention(q, k, v, mod)
    assert buf[nk].item() == nk - 1, "the forward gave a modifier a position past the last key"
    buf[nk] = -1.0
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert buf[nk].item() == nk - 1, "the backward gave a modifier a position past the last key"
    check_against_reference(mod, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit(dtype):
    check_against_reference(flex.sliding_window(20), *qkv(1, 2, 1, 64, 64, 64, dtype=dtype), sm_scale=0.2)


@pytest.mark.skipif(not CUDA, reason="larger shapes: GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("index", range(12))
def test_gpu_shapes(d, index):
    mod = modifiers(1000)[index]
    check_against_reference(mod, *qkv(2, 4, 2, 1000, 1000, d, dtype=torch.bfloat16))


def test_block_mask_matches_the_readable_builder_and_skips_tiles():
    mod = flex.sliding_window(40)
    bm = flex.block_mask(mod, 1, 1, 300, 290, device=DEVICE, block_m=32, block_n=16)
    expected = flex.block_states(lambda q, kv: (kv <= q) & (q - kv < 40), 300, 290, 32, 16)
    assert torch.equal(bm.states()[0, 0].cpu(), expected)
    assert (expected == flex.FULL).any() and (expected == flex.PARTIAL).any()
    assert (bm.states()[..., -1] != flex.FULL).all(), "a ragged key tile is never full"
    assert 0.7 < bm.sparsity() < 0.9 and "skipped" in str(bm)
    dense = flex.block_mask(None, 1, 1, 64, 70, device=DEVICE, block_m=32, block_n=32)
    assert dense.sparsity() == 0 and (dense.states()[..., :2] == flex.FULL).all()


def test_block_mask_per_batch_and_reuse():
    ids = torch.stack([flex.document_ids([32, 32]), flex.document_ids([16, 48])]).to(DEVICE)
    mod = flex.document(ids)
    bm = flex.block_mask(mod, 2, 3, 64, 64, device=DEVICE, block_m=16, block_n=16)
    assert bm.kv_count.shape == (2, 1, 4) and not torch.equal(bm.states()[0], bm.states()[1])
    q, k, v = qkv(2, 3, 3, 64, 64, 32)
    check_against_reference(mod, q, k, v, block_mask=bm)


def test_empty_rows_give_zero_and_no_nan():
    """Causal with more queries than keys: the first queries see nothing."""
    q, k, v = qkv(1, 2, 2, 40, 10, 32)
    o, lse = flex.flex_attention(q, k, v, causal=True, return_lse=True)
    assert (o[:, :, :30] == 0).all() and torch.isinf(lse[:, :, :30]).all()
    g = torch.autograd.grad(o.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in g) and (g[0][:, :, :30] == 0).all()


def varlen_check(lq, lk, causal, mod=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0] + lq).cumsum(0).int().to(DEVICE)
    cu_k = torch.tensor([0] + lk).cumsum(0).int().to(DEVICE)
    q = torch.randn(sum(lq), 4, 32, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(sum(lk), 2, 32, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    o = flex.flash_varlen(q, k, v, cu_q, cu_k, causal=causal, modifier=mod)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    for i, (a, b) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
        sq, sk = slice(a, a + lq[i]), slice(b, b + lk[i])
        if lq[i] == 0:
            continue
        if lk[i] == 0:
            assert (o[sq] == 0).all(), f"sequence {i} has no keys: its output must be 0"
            continue
        ref_mod = flex.softcap(mod.float_arg, causal=causal) if mod else (flex.causal() if causal else None)
        qi, ki, vi = (t[s].detach().double().transpose(0, 1)[None].requires_grad_() for t, s in
                      ((q, sq), (k, sk), (v, sk)))
        ro = flex.reference(qi, ki, vi, ref_mod)[0]
        rg = torch.autograd.grad(ro, (qi, ki, vi), do[sq].double().transpose(0, 1)[None])
        torch.testing.assert_close(o[sq].double(), ro[0].transpose(0, 1), **TOL[dtype], msg=f"sequence {i}")
        for name, g, r, s in zip("qkv", grads, rg, (sq, sk, sk)):
            torch.testing.assert_close(g[s].double(), r[0].transpose(0, 1), **TOL[dtype],
                                       msg=lambda m: f"d{name} of sequence {i}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_any_lengths(causal):
    varlen_check([5, 0, 1, 40, 33], [5, 0, 1, 40, 33], causal)


def test_varlen_different_q_and_k_lengths_with_softcap():
    varlen_check([3, 1, 20, 7], [9, 4, 20, 50], True, flex.softcap(3.0, causal=False))
    varlen_check([3, 2, 20], [9, 0, 20], False, flex.softcap(3.0, causal=False))


@pytest.mark.parametrize("launches", [pytest.param(1, marks=pytest.mark.full), 2])
def test_backward_in_one_launch_or_two(monkeypatch, launches):
    """dK/dV and dQ programs share one grid when the config gives both the same warps and stages, else each kind
    gets a launch of its own (PART 1 and 2); tiles of different sizes in the two passes, GQA, a packed batch."""
    import utils.flex.attention as A
    from utils.tiled.fast.backward import Config

    bwd = Config(16, 32, 4, 1, 32, 16, 4 if launches == 1 else 8, 1)
    real = A.pick_configs
    monkeypatch.setattr(A, "pick_configs", lambda p, dtype, device: (real(p, dtype, device)[0], bwd))
    check_against_reference(flex.softcap(3.0, window=20), *qkv(2, 4, 2, 45, 70, 32))
    varlen_check([3, 0, 20], [9, 4, 33], True)


def test_tuned_tiles_divide_the_block_mask():
    for fwd, bwd in SPARSE_TILES.values():
        for size in (fwd.block_m, fwd.block_n, bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2):
            assert 128 % size == 0
    p = _Problem(1, 1, 1, 64, 64, 64, 0.1, None, None)
    assert pick_configs(p, torch.float32, torch.device("cpu"))[0].block_m <= 64


def test_whole_tiles_are_loaded_without_masks(request):
    """EVEN (every tile of the block mask whole: no packed sequences, lengths multiples of its tiles) drops the
    kernels' load masks. Both ways must match the reference, with block-mask tiles larger than the kernels' (they
    walk a listed tile to its end: N = 64 is whole for a kernel tile, not for a 128 x 128 mask tile), Nq != Nk
    and masks that make partial tiles."""
    from utils.flex.attention import _even

    def problem(nq, nk):   # a block mask of 32 x 64 tiles
        bm = flex.block_mask(None, 1, 1, nq, nk, device=DEVICE, block_m=32, block_n=64)
        return _Problem(1, 1, 1, nq, nk, 64, 0.1, None, bm)

    assert _even(problem(64, 128))
    assert not _even(problem(64, 96))
    assert not _even(problem(63, 128))
    cu = torch.tensor([0, 64])
    assert not _even(_Problem(1, 1, 1, 64, 64, 64, 0.1, None, None, cu_q=cu, cu_k=cu))   # packed
    shapes = [(128, 256), (64, 64), (64, 101)]   # whole, whole for a kernel tile only, partial
    if CUDA or request.config.getoption("--full"):
        shapes += [(128, 128), (32, 96)]
    for nq, nk in shapes:
        for mod, heads in ((flex.sliding_window(20), 1),
                           (flex.document(flex.document_ids([nk // 3, nk - nk // 3], device=DEVICE), causal=False), 2)):
            bm = flex.block_mask(mod, 1, 2, nq, nk, device=DEVICE, block_m=128, block_n=128)
            check_against_reference(mod, *qkv(1, 2, heads, nq, nk, 32), block_mask=bm)


def test_bad_arguments_raise_clear_errors():
    q, k, v = qkv(1, 2, 2, 16, 16, 32)
    with pytest.raises(TypeError, match="modifier must be"):
        flex.flex_attention(q, k, v, "causal")
    with pytest.raises(ValueError, match="through the modifier"):
        flex.flex_attention(q, k, v, flex.sliding_window(4), causal=True)
    with pytest.raises(ValueError, match="ids for 10 positions"):
        flex.flex_attention(q, k, v, flex.document(flex.document_ids([5, 5], device=DEVICE)))
    with pytest.raises(ValueError, match="values for 1 heads"):
        flex.flex_attention(q, k, v, flex.alibi(1, device=DEVICE))
    bm = flex.block_mask(flex.causal(), 1, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="built for 'causal'"):
        flex.flex_attention(q, k, v, flex.sliding_window(4), block_mask=bm)
    with pytest.raises(ValueError, match="Nq=16"):
        flex.flex_attention(*qkv(1, 2, 2, 8, 16, 32), causal=True, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be"):
        flex.flex_attention(q, k, v, block_mask="dense")
    for bad, match in ((lambda: flex.sliding_window(0), "window"), (lambda: flex.softcap(-1.0), "cap"),
                       (lambda: flex.document([0, 1]), "doc_ids"), (lambda: flex.document_ids([]), "lengths"),
                       (lambda: flex.prefix_lm(1.5), "prefix_len"),
                       (lambda: flex.block_mask(None, 1, 1, 8, 8, device="cpu", block_m=24), "block_m")):
        with pytest.raises((TypeError, ValueError), match=match):
            bad()


def test_varlen_bad_arguments():
    q = torch.randn(10, 2, 32, device=DEVICE)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3 dims"):
        flex.flash_varlen(q[None], q, q, cu, cu)
    with pytest.raises(ValueError, match="end at the packed length 10"):
        flex.flash_varlen(q, q, q, cu - 1, cu)
    with pytest.raises(ValueError, match="int32/int64"):
        flex.flash_varlen(q, q, q, cu.float(), cu)
    with pytest.raises(ValueError, match="score modifier only"):
        flex.flash_varlen(q, q, q, cu, cu, modifier=flex.sliding_window(3))
    with pytest.raises(ValueError, match="2 sequences, cu_seqlens_k 1"):
        flex.flash_varlen(q, q, q, cu, torch.tensor([0, 10], dtype=torch.int32, device=DEVICE))


def test_torch_twins_agree_with_pytorch_flex_attention():
    """The PyTorch halves of the modifiers are valid score_mod / mask_mod functions for torch's flex_attention
    (eager), and give what the course's reference gives."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k, v = (t.detach() for t in qkv(2, 4, 4, 64, 64, 32))
    for mod in modifiers(64)[1:]:
        bm = create_block_mask(mod.torch_mask, None, None, 64, 64, device=DEVICE) if mod.torch_mask else None
        if mod.per_batch:
            bm = create_block_mask(mod.torch_mask, 2, None, 64, 64, device=DEVICE)
        out = torch_flex(q, k, v, score_mod=mod.torch_score, block_mask=bm)
        torch.testing.assert_close(out, flex.reference(q, k, v, mod)[0], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{mod}: {m}")
