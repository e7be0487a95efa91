"""utils.eager.forward: block sizes, traffic counts against the closed forms, the per-program FlashAttention-2
function against the whole function, log-sum-exp, block skipping, op counting and argument validation.
(tests/test_attention.py checks both registry entries against the reference over shapes and dtypes.)"""
import math

import pytest
import torch

from utils.eager.forward import (HBMCounter, block_is_visible, count_ops, flash1_attention, flash1_block_sizes,
                                 flash1_hbm_accesses, flash2_attention, flash2_hbm_accesses, flash2_kv_end,
                                 flash2_program, standard_hbm_accesses)
from utils.eager.reference import causal_mask, reference_attention
from utils.course.testing import random_qkv

SHAPES = [(1, 1, 1, 1, 1, 8), (2, 4, 2, 37, 37, 16), (1, 2, 1, 20, 45, 8), (1, 2, 2, 45, 20, 24)]


def logsumexp_reference(q, k, v, causal, scale=None):
    group = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2]), -math.inf)
    return torch.logsumexp(s, -1)


def test_flash1_block_sizes_follow_line_1():
    assert flash1_block_sizes(49152, 64) == (64, 192)      # 192 KB of fp32: B_c = 49152 / 256
    assert flash1_block_sizes(4 * 64 * 64, 64) == (64, 64)
    assert flash1_block_sizes(1000, 64) == (4, 4)          # ceil(1000 / 256) = 4
    assert flash1_block_sizes(1, 128) == (1, 1)
    assert flash1_block_sizes(10**6, 16) == (16, 15625)    # B_r never exceeds d


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sram_elements", [1, 4 * 8 * 5, 10_000])
def test_flash1_matches_reference_and_its_traffic_formula(shape, causal, sram_elements):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=torch.float64)
    counter = HBMCounter()
    out = flash1_attention(q, k, v, causal=causal, sram_bytes=8 * sram_elements, counter=counter)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=causal), rtol=1e-10, atol=1e-10)
    assert counter.accesses == b * h * flash1_hbm_accesses(nq, nk, d, sram_elements, causal=causal)
    assert counter.reads["K"] == counter.reads["V"] == b * h * nk * d   # K and V are read exactly once


def test_flash1_traffic_closed_form_and_theorem_2():
    # Non-causal, by hand: 2·Nk·d + Nq·(d+2) + T_c·Nq·(3d+4)
    assert flash1_hbm_accesses(100, 100, 16, 4 * 16 * 30) == 2 * 100 * 16 + 100 * 18 + 4 * 100 * 52
    # Θ(N²d²/M) while 4d <= M and the blocks do not cover everything: the ratio stays near 4·3 = 12
    for n, d, m in [(1024, 64, 16384), (4096, 64, 16384), (4096, 128, 65536), (8192, 64, 4096)]:
        ratio = flash1_hbm_accesses(n, n, d, m) / (n * n * d * d / m)
        assert 11 < ratio < 14, (n, d, m, ratio)
    assert standard_hbm_accesses(2, 3, 4) == 4 * 6 + 2 * 2 * 4 + 2 * 3 * 4


@pytest.mark.parametrize("nq,nk", [(45, 45), (20, 45), (45, 20)])
def test_flash1_causal_computes_exactly_the_visible_blocks(nq, nk):
    q, k, v = random_qkv(1, 1, nq, nk, 8, dtype=torch.float64)
    counter = HBMCounter()
    flash1_attention(q, k, v, causal=True, sram_bytes=8 * 4 * 8 * 6, counter=counter)   # B_r = B_c = 6
    mask = causal_mask(nq, nk)
    expected = {(i, j) for i in range(math.ceil(nq / 6)) for j in range(math.ceil(nk / 6))
                if mask[6 * i:6 * i + 6, 6 * j:6 * j + 6].any()}
    assert set(counter.blocks) == expected
    assert counter.skipped == math.ceil(nq / 6) * math.ceil(nk / 6) - len(expected)
    assert list(counter.blocks)[:2] == sorted(list(counter.blocks), key=lambda ij: (ij[1], ij[0]))[:2]  # j outer


def test_flash1_result_does_not_depend_on_the_block_sizes():
    q, k, v = random_qkv(2, 2, 50, 31, 16, dtype=torch.float64)
    outs = [flash1_attention(q, k, v, causal=True, sram_bytes=8 * m) for m in (1, 64, 300, 10**6)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (32, 8)])
def test_flash2_program_by_program_equals_lockstep(shape, causal, blocks):
    b, h, hk, nq, nk, d = shape
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=torch.float64)
    runs = []
    for per_program in (True, False):
        counter = HBMCounter()
        o, lse = flash2_attention(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1], return_lse=True,
                                  counter=counter, per_program=per_program)
        runs.append((o, lse, counter))
    (o1, lse1, c1), (o2, lse2, c2) = runs
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse1, lse2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o1, reference_attention(q, k, v, causal=causal), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse1, logsumexp_reference(q, k, v, causal), rtol=1e-10, atol=1e-10)
    assert c1.reads == c2.reads and c1.writes == c2.writes and c1.blocks == c2.blocks and c1.skipped == c2.skipped
    assert c1.accesses == b * h * flash2_hbm_accesses(nq, nk, d, *blocks, causal=causal)
    assert c1.reads["Q"] == c1.writes["O"] == b * h * nq * d     # Q read once, O written once


def test_flash2_program_writes_only_its_own_rows():
    q, k, v = random_qkv(2, 2, 40, 40, 8, dtype=torch.float64)
    o = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:-1], math.nan, dtype=torch.float64)
    flash2_program(1, 3, q, k, v, o, lse, sm_scale=8 ** -0.5, causal=False, BLOCK_M=16, BLOCK_N=16)
    written = ~o.isnan().any(-1)
    assert written.sum() == 16 and written[1, 1, 16:32].all()      # pid_bh 3 = (batch 1, head 1), rows 16..31
    torch.testing.assert_close(o[1, 1, 16:32], reference_attention(q, k, v)[1, 1, 16:32])
    flash2_program(2, 0, q, k, v, o, lse, sm_scale=8 ** -0.5, causal=False, BLOCK_M=16, BLOCK_N=16)
    assert (~o[0, 0].isnan().any(-1)).sum() == 8                   # the ragged last block: rows 32..39 only


def test_flash2_lse_and_rows_that_see_no_key():
    q, k, v = random_qkv(1, 2, 10, 4, 8, dtype=torch.float16)
    o, lse = flash2_attention(q, k, v, causal=True, block_m=4, block_n=4, return_lse=True)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    assert (o[:, :, :6] == 0).all() and torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    o64, lse64 = flash2_attention(*(t.double() for t in (q, k, v)), return_lse=True)
    assert o64.dtype == lse64.dtype == torch.float64


def test_flash2_causal_skips_the_blocks_above_the_diagonal():
    q, k, v = random_qkv(1, 1, 128, 128, 8, dtype=torch.float64)
    counter = HBMCounter()
    flash2_attention(q, k, v, causal=True, block_m=16, block_n=16, counter=counter)
    assert sum(counter.blocks.values()) == 8 * 9 // 2 and counter.skipped == 8 * 7 // 2
    assert set(counter.blocks) == {(i, j) for i in range(8) for j in range(i + 1)}
    # Nq = 10, Nk = 4: query i sees keys j <= i - 6; the last query of block p is 4p + 3
    assert [flash2_kv_end(p, 4, 10, 4, True) for p in range(3)] == [-2, 2, 4]
    assert flash2_kv_end(0, 4, 10, 4, False) == 4


def test_block_is_visible():
    assert block_is_visible(range(0, 4), range(0, 4), 8, 8)
    assert not block_is_visible(range(0, 4), range(4, 8), 8, 8)
    assert block_is_visible(range(0, 4), range(4, 8), 4, 8)       # Nk > Nq: the diagonal moves right
    assert not block_is_visible(range(0, 2), range(0, 2), 6, 2)   # Nq > Nk: the first rows see nothing


def test_fa2_moves_less_and_computes_fewer_non_matmul_flops_than_fa1():
    q, k, v = random_qkv(1, 1, 256, 256, 64, dtype=torch.float32)
    c1, c2 = HBMCounter(), HBMCounter()
    _, ops1 = count_ops(flash1_attention, q, k, v, sram_bytes=4 * 4 * 64 * 64, counter=c1)   # 64 x 64 blocks
    _, ops2 = count_ops(flash2_attention, q, k, v, block_m=64, block_n=64, counter=c2)
    assert ops1.matmul_flops == ops2.matmul_flops == 4 * 256 * 256 * 64
    assert ops2.non_matmul_flops < ops1.non_matmul_flops
    assert c2.accesses < c1.accesses and sum(c2.writes.values()) == 256 * 65


def test_count_ops():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out, ops = count_ops(lambda x, y: torch.exp(x @ y).sum(-1) + torch.arange(3), a, b)
    assert out.shape == (3,)
    assert ops.matmul_flops == 2 * 3 * 5 * 4
    assert ops.non_matmul == {"exp": 15, "sum": 15, "add": 3}      # the int arange is not a FLOP
    with pytest.raises(TypeError, match="callable"):
        count_ops("fn")


def test_hbm_counter_counts_elements_and_bytes():
    c = HBMCounter()
    x = torch.zeros(4, 8, dtype=torch.float16)
    assert c.read("Q", x, times=2) is x
    c.write("O", x, elements=8)
    assert c.reads == {"Q": 64} and c.writes == {"O": 8} and c.bytes_read == 128 and c.bytes_written == 16
    assert c.accesses == 72 and "72 HBM accesses" in c.summary()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(sram_bytes=0), ValueError, "sram_bytes must be positive"),
    (dict(sram_bytes=1024.0), TypeError, "sram_bytes must be an int"),
    (dict(counter={}), TypeError, "counter must be an HBMCounter"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
])
def test_flash1_validates_arguments(kwargs, error, match):
    q, k, v = random_qkv(1, 1, 8, 8, 8)
    with pytest.raises(error, match=match):
        flash1_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_m=0), ValueError, "block_m must be positive"),
    (dict(block_n=16.0), TypeError, "block_n must be an int"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    (dict(per_program=None), TypeError, "per_program must be a bool"),
    (dict(counter=[]), TypeError, "counter must be an HBMCounter"),
])
def test_flash2_validates_arguments(kwargs, error, match):
    q, k, v = random_qkv(1, 1, 8, 8, 8)
    with pytest.raises(error, match=match):
        flash2_attention(q, k, v, **kwargs)


def test_flash2_program_and_formulas_validate_arguments():
    q, k, v = random_qkv(1, 2, 8, 8, 8)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    with pytest.raises(ValueError, match="outside the grid"):
        flash2_program(1, 0, q, k, v, o, lse, sm_scale=0.3, causal=False, BLOCK_M=8, BLOCK_N=8)
    with pytest.raises(ValueError, match="outside the grid"):
        flash2_program(0, 2, q, k, v, o, lse, sm_scale=0.3, causal=False, BLOCK_M=8, BLOCK_N=8)
    with pytest.raises(ValueError, match="BLOCK_N must be positive"):
        flash2_program(0, 0, q, k, v, o, lse, sm_scale=0.3, causal=False, BLOCK_M=8, BLOCK_N=0)
    with pytest.raises(ValueError, match="M must be positive"):
        flash1_block_sizes(0, 64)
    with pytest.raises(TypeError, match="d must be an int"):
        flash1_hbm_accesses(8, 8, 8.0, 64)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash2_hbm_accesses(8, 8, 8, 4, 4, causal=None)
    with pytest.raises(ValueError, match="seqlen_q must be positive"):
        standard_hbm_accesses(0, 8, 8)
