"""The single-path split-KV kernels notebook 08 prints (utils.decoding.single_path): each matches the library's
kernel, `flash_decode` on a contiguous cache and `flash_decode_paged` on a paged one, and each holds one path
only."""
import inspect

import pytest
import torch

from utils.course.testing import assert_close
from utils.decoding.paged_kv import PagedKVCache
from utils.decoding.single_path import decode_contiguous, decode_paged, split_kv_contiguous, split_kv_paged
from utils.decoding.split_kv import flash_decode, flash_decode_paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)


# (heads, kv heads, new tokens, lengths, capacity, splits, causal): ragged lengths with an empty cache, empty
# splits, GQA, causal new tokens.
CASES = [(4, 4, 1, (70, 23, 0), 80, 3, False), (8, 2, 3, (65, 40), 72, 2, True), (4, 1, 2, (50,), 50, 1, True)]


@pytest.mark.parametrize("heads, kv_heads, nq, lengths, cap, splits, causal", CASES)
def test_contiguous_kernel_matches_flash_decode(heads, kv_heads, nq, lengths, cap, splits, causal):
    gen = torch.Generator().manual_seed(len(lengths) + nq)
    q = _randn(len(lengths), heads, nq, 32, gen=gen)
    k, v = (_randn(len(lengths), kv_heads, cap, 32, gen=gen) for _ in range(2))
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    o, lse = decode_contiguous(q, k, v, cache_seqlens=lens, causal=causal, num_splits=splits)
    o_ref, lse_ref = flash_decode(q, k, v, cache_seqlens=lens, causal=causal, num_splits=splits, return_lse=True)
    assert_close(o, o_ref, dtype=DTYPE)
    assert torch.allclose(lse, lse_ref, atol=1e-3, rtol=1e-3, equal_nan=False)


@pytest.mark.parametrize("page_size, splits", [(16, 3), (32, 1)])
def test_paged_kernel_matches_flash_decode_paged(page_size, splits):
    gen = torch.Generator().manual_seed(page_size)
    cache = PagedKVCache(num_pages=24, page_size=page_size, kv_heads=2, head_dim=32, dtype=DTYPE, device=DEVICE)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append([a], *(_randn(1, 2, 40, 32, gen=gen) for _ in range(2)))
    cache.append([b], *(_randn(1, 2, 7, 32, gen=gen) for _ in range(2)))
    c = cache.fork(a)                                  # shares a's full pages: the table is not in page order
    cache.append([a, b, c], *(_randn(3, 2, 5, 32, gen=gen) for _ in range(2)))
    table, lens = cache.block_table([a, b, c])
    q = _randn(3, 8, 2, 32, gen=gen)
    o, lse = decode_paged(q, cache.k_pages, cache.v_pages, table, lens, causal=True, num_splits=splits)
    o_ref, lse_ref = flash_decode_paged(q, cache.k_pages, cache.v_pages, table, lens, causal=True,
                                        num_splits=splits, return_lse=True)
    assert_close(o, o_ref, dtype=DTYPE)
    assert torch.allclose(lse, lse_ref, atol=1e-3, rtol=1e-3)


def test_each_kernel_has_one_path_and_the_paged_one_differs_only_in_the_look_up():
    contiguous, paged = (inspect.getsource(k.fn) for k in (split_kv_contiguous, split_kv_paged))
    assert "BLOCK_TABLE" not in contiguous and "is None" not in contiguous and "is None" not in paged
    body = [set(src.split('"""')[2].splitlines()) for src in (contiguous, paged)]   # after the docstring
    changed = body[0] ^ body[1]
    assert len(changed) <= 12, f"the paged kernel should be the contiguous one plus its look-up: {sorted(changed)}"


def test_launchers_validate_their_arguments():
    q = torch.zeros(1, 2, 1, 24, device=DEVICE, dtype=DTYPE)
    k = torch.zeros(1, 2, 8, 24, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="head_dim"):
        decode_contiguous(q, k, k)
    q, k = q[..., :16].contiguous(), k[..., :16].contiguous()
    with pytest.raises(ValueError, match="num_splits"):
        decode_contiguous(q, k, k, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        decode_contiguous(q, k, k, num_splits=1.0)
