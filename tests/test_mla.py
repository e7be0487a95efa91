"""MLA decoding and cascade decoding (utils.mla, notebook 11): the absorbed form equals the naive one, the Triton
kernel matches the float64 reference and reads each cache entry once per block of heads, the cascade matches
attention over the concatenated caches, and bad inputs are named; the GPU benchmark's arguments and refusal."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from utils.course.bench import mla as bench
from utils.course.testing import assert_close
from utils.decoding.split_kv import MAX_SPLITS
from utils.eager.reference import causal_mask
from utils.mla.cascade import cascade_decode, cascade_traffic, merge_two
from utils.mla import decode
from utils.mla.decode import Tiles, candidate_tiles, check_tiles, decode_layout, mla_decode, mla_decode_kernel, pick_splits
from utils.mla.reference import (DEEPSEEK_SM_SCALE, absorb, mla_absorbed_reference, mla_naive, up_project)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (1, 37, 100)   # ragged and odd: a sequence shorter than Nq = 2, a part tile, a full cache
SCALE = 1 / math.sqrt(32 + 16)


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)


def _problem(heads, n_q, latent=64, rope=16, lengths=LENGTHS, dtype=torch.float32, seed=0):
    """Absorbed queries and a latent cache of capacity max(lengths), stored as one (B, N, r + d_rope) tensor
    that c and k_rope are views of, as a server keeps it."""
    gen = torch.Generator().manual_seed(seed)
    batch, cap = len(lengths), max(lengths)
    q_latent = _randn(batch, heads, n_q, latent, gen=gen, dtype=dtype)
    q_rope = _randn(batch, heads, n_q, rope, gen=gen, dtype=dtype)
    kv = _randn(batch, cap, latent + rope, gen=gen, dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q_latent, q_rope, kv[..., :latent], kv[..., latent:], seqlens


# --- the reference: absorbing the up-projections changes nothing -------------------------------------------------

def _naive_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, nq, n, d_nope, d_rope, r, d_v = 3, 4, 2, 20, 32, 16, 64, 24
    q_nope, q_rope = (torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) for d in (d_nope, d_rope))
    c = torch.randn(b, n, r, generator=gen, dtype=torch.float64)
    k_rope = torch.randn(b, n, d_rope, generator=gen, dtype=torch.float64)
    w_uk = torch.randn(h, d_nope, r, generator=gen, dtype=torch.float64) / math.sqrt(r)
    w_uv = torch.randn(h, d_v, r, generator=gen, dtype=torch.float64) / math.sqrt(r)
    return q_nope, q_rope, c, k_rope, w_uk, w_uv


def test_naive_mla_is_attention_over_the_expanded_keys_and_values():
    q_nope, q_rope, c, k_rope, w_uk, w_uv = _naive_problem()
    h = q_nope.shape[1]
    k = torch.cat([torch.einsum("bnr,hdr->bhnd", c, w_uk), k_rope[:, None].expand(-1, h, -1, -1)], dim=-1)
    v = torch.einsum("bnr,hvr->bhnv", c, w_uv)
    mask = causal_mask(q_nope.shape[2], c.shape[1])   # bottom-right: the new tokens are the cache's last
    expected = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, v, attn_mask=mask)   # 1/sqrt(48)
    torch.testing.assert_close(mla_naive(q_nope, q_rope, c, k_rope, w_uk, w_uv), expected, atol=1e-12, rtol=1e-12)


def test_absorbed_equals_naive_and_the_scale_is_the_original_head_dims():
    q_nope, q_rope, c, k_rope, w_uk, w_uv = _naive_problem()
    seqlens = torch.tensor([1, 13, 20])
    naive = mla_naive(q_nope, q_rope, c, k_rope, w_uk, w_uv, seqlens=seqlens)
    o_latent, _ = mla_absorbed_reference(absorb(q_nope, w_uk), q_rope, c, k_rope, seqlens, sm_scale=SCALE)
    torch.testing.assert_close(up_project(o_latent, w_uv), naive, atol=1e-12, rtol=1e-12)
    assert naive[0, :, 0].abs().max() == 0   # sequence 0 holds 1 entry: its first of 2 new tokens sees none
    # 1/sqrt(r + d_rope), the absorbed key's width, is not the same attention
    wrong, _ = mla_absorbed_reference(absorb(q_nope, w_uk), q_rope, c, k_rope, seqlens, sm_scale=(64 + 16) ** -0.5)
    assert (up_project(wrong, w_uv) - naive).abs().max() > 1e-3
    assert DEEPSEEK_SM_SCALE == pytest.approx(192 ** -0.5)


# --- the Triton kernel against the float64 reference -------------------------------------------------------------

# (heads, new tokens, splits, latent, rope) over batch 3 of lengths LENGTHS. Heads {4, 16} × Nq {1, 2} × splits
# {1, 3} is covered pairwise by the first four (each pair of values appears together once); 3 splits of 2 tiles
# leave one split empty. The last has other dims (r = 128, d_rope = 32) and the automatic split count.
CASES = [(4, 1, 1, 64, 16), (4, 2, 3, 64, 16), (16, 1, 3, 64, 16), (16, 2, 1, 64, 16), (4, 2, None, 128, 32)]


@pytest.mark.parametrize("heads, n_q, splits, latent, rope", CASES)
def test_decode_matches_the_float64_reference(heads, n_q, splits, latent, rope):
    q_latent, q_rope, c, k_rope, seqlens = _problem(heads, n_q, latent, rope, seed=heads + n_q)
    o, lse = mla_decode(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE, num_splits=splits)
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.shape == q_latent.shape
    assert_close(o, o_ref, dtype=torch.float32)
    assert_close(lse, lse_ref, dtype=torch.float32)   # -inf where a new token sees no entry: equal too
    assert torch.isinf(lse_ref).any() == (n_q > 1)


def test_decode_in_bf16_and_with_every_sequence_full():
    q_latent, q_rope, c, k_rope, _ = _problem(8, 1, lengths=(48, 48), dtype=torch.bfloat16, seed=3)
    o, lse = mla_decode(q_latent, q_rope, c, k_rope, sm_scale=DEEPSEEK_SM_SCALE, num_splits=2)   # seqlens: all
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, sm_scale=DEEPSEEK_SM_SCALE)
    assert o.dtype == torch.bfloat16
    assert_close(o, o_ref, dtype=torch.bfloat16)
    assert_close(lse, lse_ref, dtype=torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="DeepSeek's shape: r = 512 is minutes in the interpreter")
@pytest.mark.parametrize("heads", [16, 128])
def test_decode_at_deepseeks_shape(heads):
    q_latent, q_rope, c, k_rope, seqlens = _problem(heads, 1, 512, 64, lengths=(1, 700, 2049),
                                                    dtype=torch.bfloat16, seed=heads)
    o, lse = mla_decode(q_latent, q_rope, c, k_rope, seqlens, sm_scale=DEEPSEEK_SM_SCALE)
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, seqlens, sm_scale=DEEPSEEK_SM_SCALE)
    assert_close(o, o_ref, dtype=torch.bfloat16)
    assert_close(lse, lse_ref, dtype=torch.bfloat16)


SMEM_PROBE = """
import torch
from utils.course.cross_compile import _capture, compile_launch
from utils.mla.decode import Tiles, mla_decode
from utils.mla.decode import candidate_tiles
for heads, tiles in ((16, candidate_tiles(512, 16)[0]), (128, Tiles(32, 8, 2))):
    ql, qr = torch.zeros(2, heads, 1, 512, dtype=torch.bfloat16), torch.zeros(2, heads, 1, 64, dtype=torch.bfloat16)
    c, kr = torch.zeros(2, 1024, 512, dtype=torch.bfloat16), torch.zeros(2, 1024, 64, dtype=torch.bfloat16)
    launch = _capture(lambda: mla_decode(ql, qr, c, kr, num_splits=4, tiles=tiles))[0]
    print(heads, compile_launch(launch, (9, 0)).metadata.shared)
"""


@pytest.mark.full
@pytest.mark.skipif(DEVICE == "cuda", reason="checks this Triton compiling for sm_90 from a CPU; on a GPU, "
                    "test_decode_at_deepseeks_shape launches the kernel")
def test_the_kernel_at_deepseeks_shape_fits_an_h200s_shared_memory():
    """Compiled for sm_90 by this Triton (in a process without the interpreter), at r = 512: the first tiles fit
    the 227 KiB a block may have at 16 heads (16 rows), and at 128 heads (64 rows) a later candidate does."""
    from utils.course.cross_compile import script_in_fresh_process

    assert candidate_tiles(512)[0] == Tiles(64, 8, 2) and Tiles(32, 8, 2) in candidate_tiles(512)
    assert candidate_tiles(512, 16)[0] == Tiles(64, 4, 2)
    out = script_in_fresh_process(SMEM_PROBE)
    shared = dict(tuple(map(int, line.split())) for line in out.split("\n") if line.strip())
    assert set(shared) == {16, 128} and all(0 < b <= 227 * 1024 for b in shared.values()), shared


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the loads of the Triton interpreter")
@pytest.mark.parametrize("heads, n_q, latent, rope", [(16, 2, 64, 16), (40, 2, 16, 16)])
def test_each_cache_entry_is_loaded_once_per_block_of_heads(monkeypatch, heads, n_q, latent, rope):
    from triton.runtime import interpreter

    q_latent, q_rope, c, k_rope, seqlens = _problem(heads, n_q, latent, rope)
    first = c.data_ptr()   # c and k_rope are views of one (B, N, r + d_rope) tensor that starts with c
    end = first + c.shape[0] * c.stride(0) * c.element_size()
    loaded = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, *args):
        addresses = ptrs.data[mask.data]
        loaded.append(addresses[(addresses >= first) & (addresses < end)])
        return load(self, ptrs, mask, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting_load)
    mla_decode(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE, num_splits=3)
    addresses, times = np.unique(np.concatenate(loaded), return_counts=True)
    layout = decode_layout(len(LENGTHS), heads, n_q, c.shape[1], latent, num_splits=3)
    assert len(addresses) == sum(LENGTHS) * (latent + rope)   # every valid entry, and nothing past a length
    assert set(times.tolist()) == {layout.row_blocks}          # once per Q tile, which holds every head it can
    assert layout.row_blocks == math.ceil(heads * n_q / 64) and layout.grid == (layout.row_blocks, 3, 3)


def test_the_kernel_is_one_path():
    body = inspect.getsource(mla_decode_kernel.fn).split('"""')[2]
    assert not any(line.strip().startswith(("if ", "elif ", "else")) for line in body.splitlines())
    assert body.count("tl.load(C") == 1   # one load of each c tile: keys and values


def test_pick_splits_and_the_layout():
    # DeepSeek on an H200: batch 1, 128 heads in 2 Q tiles, a 4096-token cache in tiles of 32
    assert pick_splits(1, 4096, row_blocks=2, block_n=32, num_sms=132) == 32   # slices of 4 tiles at least
    assert pick_splits(1, 1 << 20, row_blocks=2, block_n=32, num_sms=132) == 66   # one wave: a program per SM
    assert pick_splits(3, 1 << 20, num_sms=132) == 44
    assert pick_splits(128, 4096, row_blocks=1, num_sms=132) == 1              # the batch fills the wave
    assert pick_splits(1, 100, block_n=32, num_sms=132) == 1                   # too short to cut
    assert pick_splits(1, 1 << 20, block_n=16, num_sms=1000) == MAX_SPLITS
    layout = decode_layout(4, 128, 1, 4096, 512, num_sms=132)
    assert (layout.block_m, layout.block_n, layout.row_blocks, layout.num_splits) == (64, 64, 2, 16)
    assert (layout.num_warps, layout.num_stages) == (8, 2)
    assert layout.grid == (2, 16, 4)
    assert decode_layout(2, 16, 1, 4096, 512).row_blocks == 1   # 16 heads: one tile reads the cache for all
    # 16 rows: two programs per SM. Batch 64 takes 4 splits, 128 takes 2; 64 rows fill one wave with batch 64
    assert pick_splits(64, 4096, block_n=64, num_sms=132, per_sm=2) == 4
    assert [decode_layout(b, 16, 1, 4096, 512).num_splits for b in (64, 128)] == [4, 2]
    assert decode_layout(64, 128, 1, 4096, 512).num_splits == 1


@pytest.mark.parametrize("heads", [16, 128])
def test_candidate_tiles_start_with_the_layouts_choice(heads):
    for latent in (64, 512):
        tried = candidate_tiles(latent, decode.block_rows(heads))
        layout = decode_layout(4, heads, 1, 4096, latent)
        assert (layout.block_n, layout.num_warps, layout.num_stages) == tried[0]
        assert len(set(tried)) == len(tried) > 1 and all(check_tiles(t) == t for t in tried)
        assert tried[-1].block_n * tried[-1].num_stages < tried[0].block_n * tried[0].num_stages, "less in flight"


@pytest.mark.gpu
def test_decode_tries_the_next_tiles_where_triton_refuses_the_first(monkeypatch, refusing):
    """Triton's "out of resource: shared memory" for the first tiles: mla_decode launches the next ones.
    The first tiles' layout is made to fail as Triton's launch does."""
    too_big, fits = Tiles(128, 8, 3), Tiles(16, 4, 1)
    tried = []
    layout = decode.decode_layout
    step = refusing(too_big, tried, lambda tiles, *args, **kwargs: layout(*args, tiles=tiles, **kwargs))

    def refusing_layout(*args, tiles=None, **kwargs):
        return step(tiles, *args, **kwargs)

    monkeypatch.setattr(decode, "candidate_tiles", lambda latent, block_m: [too_big, fits])
    monkeypatch.setattr(decode, "decode_layout", refusing_layout)
    q_latent, q_rope, c, k_rope, seqlens = _problem(4, 2, seed=6)
    o, lse = mla_decode(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE)
    assert tried == [too_big, fits]
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE)
    assert_close(o, o_ref, dtype=torch.float32)


@pytest.mark.parametrize("tiles", [Tiles(16, 4, 1), Tiles(32, 2, 2)])
def test_decode_with_the_callers_tiles(tiles):
    q_latent, q_rope, c, k_rope, seqlens = _problem(4, 2, seed=5)
    o, lse = mla_decode(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE, num_splits=2, tiles=tiles)
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, seqlens, sm_scale=SCALE)
    assert_close(o, o_ref, dtype=torch.float32)
    assert_close(lse, lse_ref, dtype=torch.float32)
    layout = decode_layout(3, 4, 2, 100, 64, num_splits=2, tiles=tiles)
    assert (layout.block_n, layout.num_warps, layout.num_stages) == tiles


def test_bad_tiles_are_named():
    q_latent, q_rope, c, k_rope, _ = _problem(4, 1)
    for tiles, error, message in [((32, 4, 2), TypeError, "tiles must be a utils.mla.decode.Tiles"),
                                  (Tiles(24, 4, 2), ValueError, "tiles.block_n must be a power of two"),
                                  (Tiles(8, 4, 2), ValueError, "tiles.block_n must be a power of two of at least 16"),
                                  (Tiles(32, 3, 2), ValueError, "tiles.num_warps must be"),
                                  (Tiles(32, 4, 0), ValueError, "tiles.num_stages must be a positive int"),
                                  (Tiles(32, 4, 9), ValueError, "tiles.num_stages must be at most 6"),
                                  (Tiles(32, True, 2), ValueError, "tiles.num_warps must be a positive int")]:
        with pytest.raises(error, match=message):
            mla_decode(q_latent, q_rope, c, k_rope, sm_scale=SCALE, tiles=tiles)


# --- cascade decoding ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_q, splits", [(1, 1), (2, 2)])
def test_cascade_matches_attention_over_prefix_plus_suffix(n_q, splits):
    gen = torch.Generator().manual_seed(n_q)
    batch, heads, latent, rope, prefix, suffix_lens = 3, 4, 64, 16, 45, (2, 20, 33)
    q_latent, q_rope = _randn(batch, heads, n_q, latent, gen=gen), _randn(batch, heads, n_q, rope, gen=gen)
    prefix_c, prefix_k_rope = _randn(prefix, latent, gen=gen), _randn(prefix, rope, gen=gen)
    suffix_c, suffix_k_rope = _randn(batch, 33, latent, gen=gen), _randn(batch, 33, rope, gen=gen)
    suffix_seqlens = torch.tensor(suffix_lens, device=DEVICE)
    o, lse = cascade_decode(q_latent, q_rope, prefix_c, prefix_k_rope, suffix_c, suffix_k_rope, suffix_seqlens,
                            sm_scale=SCALE, num_splits=splits)
    # each sequence's whole cache: the prefix copied in front of its suffix
    c = torch.cat([prefix_c.expand(batch, -1, -1), suffix_c], dim=1)
    k_rope = torch.cat([prefix_k_rope.expand(batch, -1, -1), suffix_k_rope], dim=1)
    o_ref, lse_ref = mla_absorbed_reference(q_latent, q_rope, c, k_rope, suffix_seqlens + prefix, sm_scale=SCALE)
    assert_close(o, o_ref, dtype=torch.float32)
    assert_close(lse, lse_ref, dtype=torch.float32)


def test_merge_two_weighs_each_side_by_its_lse():
    gen = torch.Generator().manual_seed(0)
    o1, o2 = (torch.randn(2, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    inf = float("inf")
    lse1 = torch.tensor([[1.0, 700.0, -inf], [-3.0, -inf, 2.0]], dtype=torch.float64)
    lse2 = torch.tensor([[0.5, 710.0, -inf], [4.0, 1.0, -inf]], dtype=torch.float64)   # e^710 overflows float64
    o, lse = merge_two(o1, lse1, o2, lse2)
    total = torch.logaddexp(lse1, lse2)
    w1, w2 = ((side - total).exp().nan_to_num(0.0) for side in (lse1, lse2))   # both sides empty: -inf - -inf
    torch.testing.assert_close(o.double(), w1[..., None] * o1 + w2[..., None] * o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, total)
    assert o[0, 2].abs().max() == 0 and lse[0, 2] == -inf and torch.equal(o[1, 1].float(), o2[1, 1].float())


def test_cascade_reads_the_prefix_once():
    t = cascade_traffic(8, 16, 1, 1000, [10] * 8, 512, 64, 2)
    entry = (512 + 64) * 2
    assert t.prefix_bytes == 1000 * entry
    assert t.cascade_bytes == 1000 * entry + 80 * entry and t.separate_bytes == 8 * 1000 * entry + 80 * entry
    assert t.separate_bytes - t.cascade_bytes == 7 * t.prefix_bytes
    assert (t.prefix_passes, t.separate_passes) == (2, 8)   # 128 stacked rows: 2 Q tiles; alone, 8 of 16 rows
    with pytest.raises(ValueError, match="suffix_lens"):
        cascade_traffic(8, 16, 1, 1000, [10] * 7, 512, 64, 2)


# --- validation ---------------------------------------------------------------------------------------------------

def _bad_calls():
    q, qr, c, kr, lens = _problem(4, 2)
    ok = dict(q_latent=q, q_rope=qr, c=c, k_rope=kr, seqlens=lens)

    def call(**changes):
        args = dict(ok, **{k: v for k, v in changes.items() if k in ok})
        kwargs = {k: v for k, v in changes.items() if k not in ok}
        return lambda: mla_decode(*args.values(), **{"sm_scale": SCALE, **kwargs})

    return [
        (call(q_latent=q.tolist()), TypeError, "q_latent must be a torch.Tensor"),
        (call(q_rope=qr[:2]), ValueError, "q_rope has shape"),
        (call(c=c[..., :32]), ValueError, "c has shape"),
        (call(k_rope=kr[:, :50]), ValueError, "k_rope has shape"),
        (call(c=c[0]), ValueError, "c must have 3 dims"),
        (call(q_latent=q.double(), q_rope=qr.double(), c=c.double(), k_rope=kr.double()), TypeError, "q_latent has "
         "dtype torch.float64"),
        (call(k_rope=kr.half()), TypeError, "k_rope has dtype torch.float16 but q_latent has torch.float32"),
        (call(c=c.to("meta")), ValueError, "c is on meta"),
        (call(q_latent=q[..., :48], c=c[..., :48]), ValueError, "latent dim 48"),
        (call(q_rope=qr[..., :8], k_rope=kr[..., :8]), ValueError, "rope dim 8"),
        (call(seqlens=lens.float()), TypeError, "seqlens must be an int32 or int64"),
        (call(seqlens=lens[:2]), ValueError, r"seqlens must have shape \(3,\)"),
        (call(seqlens=lens + 1), ValueError, r"seqlens must lie in \[0, 100\]"),
        (call(seqlens=[1, 2, 3]), TypeError, "seqlens must be a torch.Tensor"),
        (call(sm_scale=None), TypeError, "sm_scale must be a real number"),
        (call(sm_scale=-1.0), ValueError, "sm_scale"),
        (call(num_splits=0), ValueError, "num_splits"),
        (call(num_splits=2.0), TypeError, "num_splits"),
    ]


def test_bad_inputs_are_named():
    for fn, error, message in _bad_calls():
        with pytest.raises(error, match=message):
            fn()


def test_cascade_bad_inputs_are_named():
    q, qr, c, kr, _ = _problem(4, 2, lengths=(30, 30, 30))
    pc, pk = c[0, :10], kr[0, :10]
    lens = torch.tensor([5, 2, 30], device=DEVICE)
    for args, error, message in [
        ((q, qr, pc, pk, c, kr, torch.tensor([5, 1, 30], device=DEVICE)), ValueError,
         r"suffix_seqlens must lie in \[2, 30\]"),   # a sequence's new tokens lie in its own suffix
        ((q, qr, pc, pk, c[:, :1], kr[:, :1], None), ValueError, "suffix_seqlens is None"),
        ((q, qr, c[0, :10, :32], pk, c, kr, lens), ValueError, r"prefix_c must have shape \(prefix length >= 1, 64\)"),
        ((q, qr, pc, kr[0, :9], c, kr, lens), ValueError, "prefix_k_rope has 9 entries but prefix_c has 10"),
        ((q, qr, pc.half(), pk, c, kr, lens), TypeError, "prefix_c has dtype"),
        ((q, qr, pc, pk, c[:2], kr, lens), ValueError, "suffix_c has shape"),
        ((q, qr, pc, pk, c, kr.double(), lens), TypeError, "suffix_k_rope has dtype"),
    ]:
        with pytest.raises(error, match=message):
            cascade_decode(*args, sm_scale=SCALE)


# --- the GPU benchmark ------------------------------------------------------------------------------------------

def test_bench_arguments_and_bytes():
    args = bench.parse_args([])
    assert args.heads == [128, 16] and args.batches == [1, 2, 4, 8, 16, 32, 64, 128]
    assert (args.seqlen, args.latent, args.rope) == (4096, 512, 64)
    assert args.out == bench.DEFAULT_OUT and args.out.name == "11_mla_h200.json" and args.out.parent.name == "images"
    for bad in (["--seqlen", "100"], ["--batches", "0"], ["--rep", "-1"], ["--heads", "x"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    # batch 2, 16 heads, 1 token, 4096 entries of 512 + 64 in bf16: the cache once, q in, o out
    assert bench.step_bytes(2, 16, 1, 4096, 512, 64, 2) == (2 * 4096 * 576 + 2 * 16 * 576 + 2 * 16 * 512) * 2
    # per (head, token, entry): 576 products for the score, 512 for o, two FLOPs each
    assert bench.step_flops(2, 16, 1, 4096, 512, 64) == 2 * 16 * 4096 * 2 * (576 + 512)
    # at 128 heads a cache byte feeds more FLOPs than an H200's 989 TFLOP/s over 4.8 TB/s (its datasheet)
    intensity = bench.step_flops(1, 128, 1, 4096, 512, 64) / bench.step_bytes(1, 128, 1, 4096, 512, 64, 2)
    assert 989 / 4.8 < intensity < 250


def test_sweep_arguments_and_tiles():
    args = bench.parse_args(["--sweep"])
    assert args.sweep and args.batches == [64] and args.out == bench.SWEEP_OUT
    assert args.out.name == "11_mla_sweep_h200.json" and args.out.parent.name == "images"
    assert bench.parse_args(["--sweep", "--batches", "32", "128"]).batches == [32, 128]
    assert bench.parse_args([]).out == bench.DEFAULT_OUT and not bench.parse_args([]).sweep
    tiles = bench.sweep_tiles()
    assert len(set(tiles)) == len(tiles) == 12 and decode_layout(64, 16, 1, 4096, 512)[2:7:4] in {
        (t.block_n, t.num_stages) for t in tiles}, "the current choice is among those tried"
    assert None in bench.SWEEP_SPLITS



def test_the_default_tiles_against_the_stored_sweep():
    """decode_layout's tiles and splits at batch 64: the fastest of the stored sweep at 128 heads, and within 5 %
    of the fastest at 16 heads (64-entry tiles, three in flight: Triton 3.7 cannot fit them in shared memory)."""
    import json

    data = json.loads(bench.SWEEP_OUT.read_text())
    assert data["environment"]["gpu"] == "NVIDIA H200" and data["settings"]["sweep"]
    for heads, slack in ((128, 1.0), (16, 1.05)):
        layout = decode_layout(64, heads, 1, data["settings"]["seqlen"], 512)
        ours = Tiles(layout.block_n, layout.num_warps, layout.num_stages)
        rows = [r for r in data["rows"] if r["heads"] == heads and r["method"] == "mla_decode" and r.get("ms")
                and r["batch"] == 64]
        default = [r for r in rows if Tiles(**r["tiles"]) == ours and r["num_splits"] == layout.num_splits]
        assert len(rows) > 20 and default, f"{heads} heads: {ours} with {layout.num_splits} splits was not swept"
        fastest = min(rows, key=lambda r: r["ms"])
        assert min(r["ms"] for r in default) <= slack * fastest["ms"], f"{heads} heads: {fastest['tiles']} was faster"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_and_sweep_small_runs_write_their_rows(tmp_path, monkeypatch):
    import json

    small = ["--heads", "16", "--seqlen", "256", "--rep", "5", "--copy-mib", "16"]
    data = bench.main([*small, "--batches", "2", "--out", str(tmp_path / "mla.json")])
    assert json.loads((tmp_path / "mla.json").read_text()) == data and not data["settings"]["sweep"]
    ours = [r for r in data["rows"] if r["method"] == "mla_decode"]
    assert len(ours) == 1 and ours[0]["tflops"] > 0 and 0 < ours[0]["fraction_of_copy"] and ours[0]["tiles"] is None
    assert ours[0]["max_abs_err"] < 0.05 and ours[0]["eager_ms"] > 0
    assert data["settings"]["timing"] == "cuda graph replay"
    monkeypatch.setattr(bench, "sweep_tiles", lambda: [Tiles(16, 4, 2), Tiles(32, 8, 1)])
    monkeypatch.setattr(bench, "SWEEP_SPLITS", (None, 4))
    swept = bench.main([*small, "--sweep", "--batches", "2", "--out", str(tmp_path / "sweep.json")])
    assert swept["settings"]["sweep"] and not swept["flash_mla"]["available"]
    assert [(r["tiles"]["block_n"], r["asked_splits"]) for r in swept["rows"]] == [(16, None), (16, 4), (32, None),
                                                                                  (32, 4)]
    assert all(r["gbps"] > 0 and r["max_abs_err"] < 0.05 for r in swept["rows"])
    assert [r["num_splits"] for r in swept["rows"]][1::2] == [4, 4]
