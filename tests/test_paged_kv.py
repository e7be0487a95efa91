"""The paged KV cache (utils.decoding.paged_kv) and decoding through its block table (flash_decode_paged): every
result is compared with the contiguous `flash_decode` on a cache the test keeps itself, on the CPU through the
interpreter and, where there is one, on a GPU."""
import itertools

import pytest
import torch

from utils.decoding.split_kv import flash_decode, flash_decode_paged
from utils.decoding.paged_kv import OutOfPages, PagedKVCache, check_page_size
from utils.course.testing import assert_close, pairwise

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


class Harness:
    """A PagedKVCache and, beside it, the contiguous K/V of each sequence (Hkv, L, D), grown by the same appends."""

    def __init__(self, num_pages, page_size, kv_heads=2, head_dim=32, dtype=torch.float32, device=DEVICE, seed=0):
        self.cache = PagedKVCache(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.gen = torch.Generator().manual_seed(seed)
        self.k, self.v = {}, {}

    def new(self):
        s = self.cache.new_sequence()
        shape = self.cache.k_pages.shape
        self.k[s] = self.v[s] = torch.empty(shape[1], 0, shape[3], dtype=self.cache.k_pages.dtype, device=DEVICE)
        return s

    def grow(self, ids, tokens):
        """Append `tokens` random positions to each sequence of `ids`, in one call."""
        shape = self.cache.k_pages.shape
        k, v = (torch.randn(len(ids), shape[1], tokens, shape[3], generator=self.gen).to(self.cache.k_pages)
                for _ in range(2))
        self.cache.append(ids, k, v)
        for i, s in enumerate(ids):
            self.k[s], self.v[s] = torch.cat([self.k[s], k[i]], 1), torch.cat([self.v[s], v[i]], 1)

    def fork(self, s):
        child = self.cache.fork(s)
        self.k[child], self.v[child] = self.k[s], self.v[s]
        return child

    def contiguous(self, ids):
        """(k_cache, v_cache (B, Hkv, longest + 5, D), cache_seqlens): garbage past each length, never read."""
        longest = max(self.k[s].shape[1] for s in ids) + 5
        k = torch.full((len(ids), self.k[ids[0]].shape[0], longest, self.k[ids[0]].shape[2]), float("nan"),
                       dtype=self.cache.k_pages.dtype, device=DEVICE)
        v = k.clone()
        for i, s in enumerate(ids):
            k[i, :, :self.k[s].shape[1]], v[i, :, :self.v[s].shape[1]] = self.k[s], self.v[s]
        return k, v, torch.tensor([self.k[s].shape[1] for s in ids], dtype=torch.int32, device=DEVICE)

    def check(self, ids, *, heads=4, new_tokens=1, causal=False, splits=(1, 3)):
        """Decode q for the sequences `ids` through the block table and through their contiguous caches."""
        q = torch.randn(len(ids), heads, new_tokens, self.cache.k_pages.shape[3], generator=self.gen)
        q = q.to(self.cache.k_pages)
        table, seqlens = self.cache.block_table(ids)
        k, v, lengths = self.contiguous(ids)
        assert torch.equal(seqlens, lengths)
        for num_splits in splits:
            kw = dict(causal=causal, num_splits=num_splits, return_lse=True)
            out, lse = flash_decode_paged(q, self.cache.k_pages, self.cache.v_pages, table, seqlens, **kw)
            expect, expect_lse = flash_decode(q, k, v, cache_seqlens=lengths, **kw)
            assert out.dtype == q.dtype and out.shape == q.shape
            assert_close(out, expect, dtype=q.dtype)
            torch.testing.assert_close(lse, expect_lse, atol=1e-2 if q.dtype != torch.float32 else 1e-4, rtol=0)
        return out


def cdiv(a, b):
    return -(-a // b)


# (lengths, heads, kv_heads, new tokens, causal, head_dim): a ragged batch with an empty sequence and lengths
# off the page size, GQA and MQA, several causal new tokens (one sequence shorter than them).
CASES = [((0, 37, 300), 4, 2, 1, False, 32),
         ((130, 2), 4, 1, 3, True, 64)]


def _decode_cases():
    """Page size x case x dtype: make test runs a covering design of strength 2 (every pair of values of two axes
    at least once); the full suite runs the product."""
    axes = dict(page_size=[16, 64, 256], case=[0, 1], dtype=DTYPES)
    covered = {tuple(row.values()) for row in pairwise(axes)}
    for page_size, case, dtype in itertools.product(*axes.values()):
        name = f"{page_size}-{('ragged-gqa', 'causal-mqa')[case]}-{dtype}"
        yield pytest.param(page_size, CASES[case], dtype, id=name,
                           marks=() if (page_size, case, dtype) in covered else pytest.mark.full)


@pytest.mark.parametrize("page_size, case, dtype", list(_decode_cases()))
def test_paged_decode_equals_contiguous(page_size, case, dtype):
    lengths, heads, kv_heads, new_tokens, causal, head_dim = case
    h = Harness(64, page_size, kv_heads, head_dim, dtype=dtype, seed=page_size)
    ids = [h.new() for _ in lengths]
    for start in range(0, max(lengths), 50):  # grow in rounds, so that the sequences' pages interleave in the pool
        growing = [s for s, n in zip(ids, lengths) if n > start]
        for s, n in zip(ids, lengths):
            if s in growing:
                h.grow([s], min(50, n - start))
    assert [h.cache.length(s) for s in ids] == list(lengths)
    h.check(ids, heads=heads, new_tokens=new_tokens, causal=causal)


def test_appends_across_page_boundaries():
    h = Harness(16, 16, seed=1)
    a, b = h.new(), h.new()
    h.grow([a], 14)
    h.grow([b], 30)
    for _ in range(4):  # decode steps: a crosses 16, b crosses 32
        h.grow([a, b], 1)
        h.check([a, b], splits=(2,))
    assert (h.cache.length(a), h.cache.length(b)) == (18, 34)
    h.grow([a, b], 20)  # several tokens at once (a prefill chunk, drafted tokens), over two boundaries
    for s in (a, b):
        assert len(h.cache.pages(s)) == cdiv(h.cache.length(s), 16)
    assert h.cache.num_free_pages == 16 - 3 - 4
    h.check([b, a], new_tokens=2, causal=True)


@pytest.mark.parametrize("prompt", [40, 32], ids=["partial-last-page", "full-pages"])
def test_prefix_sharing(prompt):
    h = Harness(16, 16, seed=2)
    parent = h.new()
    h.grow([parent], prompt)
    child = h.fork(parent)
    full = prompt // 16
    assert h.cache.pages(child)[:full] == h.cache.pages(parent)[:full]  # full pages shared, not copied
    if prompt % 16:
        assert h.cache.pages(child)[-1] != h.cache.pages(parent)[-1]  # the partly filled page is the child's own
    assert h.cache.num_free_pages == 16 - cdiv(prompt, 16) - (prompt % 16 > 0)
    h.grow([child], 20)             # the two diverge: the child writes its own continuation ...
    h.grow([parent, child], 3)      # ... then both, in one batch
    assert h.cache.pages(child)[:full] == h.cache.pages(parent)[:full]
    h.check([parent, child], new_tokens=2, causal=True)
    k, v, _ = h.cache.to_contiguous([parent])
    assert torch.equal(k[0], h.k[parent]) and torch.equal(v[0], h.v[parent])  # the child's appends left it alone


def test_free_returns_pages_and_they_are_reused():
    h = Harness(8, 16, seed=3)
    a = h.new()
    h.grow([a], 50)                                   # 4 pages, the last one partly filled
    b = h.fork(a)                                     # shares 3, copies 1
    assert h.cache.num_free_pages == 3
    tail_of_a = h.cache.pages(a)[-1]
    h.cache.free(a)
    assert h.cache.num_free_pages == 4                # a's shared pages stay: b still holds them
    c = h.new()
    h.grow([c], 64)                                   # takes every free page, a's old tail among them
    assert tail_of_a in h.cache.pages(c) and h.cache.num_free_pages == 0
    assert not set(h.cache.pages(c)) & set(h.cache.pages(b))
    h.check([b, c], splits=(1,))                      # c reads over a's stale rows; b's pages were not handed out
    for s in (b, c):
        h.cache.free(s)
    assert h.cache.num_free_pages == 8
    with pytest.raises(ValueError, match="not in the cache"):
        h.cache.free(b)


def test_out_of_pages_changes_nothing():
    h = Harness(4, 16, seed=4)
    a = h.new()
    h.grow([a], 40)
    b = h.new()
    with pytest.raises(OutOfPages, match="needs 3 new pages but 1 of 4"):
        h.grow([a, b], 20)                            # a needs 1 more page, b 2: 3 > 1 free
    assert (h.cache.length(a), h.cache.length(b), h.cache.num_free_pages) == (40, 0, 1)
    h.fork(a)                                         # takes the last page for a's partly filled one
    with pytest.raises(OutOfPages, match="fork needs a free page"):
        h.cache.fork(a)
    h.check([a], splits=(1,))


def test_block_table_and_contiguous_view():
    h = Harness(8, 16, seed=5)
    a, b, empty = h.new(), h.new(), h.new()
    h.grow([a], 20)
    h.grow([b], 5)
    h.grow([a], 20)
    table, seqlens = h.cache.block_table([a, empty, b])
    assert table.dtype == torch.int32 and table.tolist() == [[0, 1, 3], [-1, -1, -1], [2, -1, -1]]
    assert seqlens.tolist() == [40, 0, 5]
    k, v, lengths = h.cache.to_contiguous([b, a])
    assert k.shape == (2, 2, 40, 32) and lengths.tolist() == [5, 40]
    assert torch.equal(k[1], h.k[a]) and torch.equal(v[0, :, :5], h.v[b]) and torch.all(k[0, :, 5:] == 0)


def test_entries_past_a_sequence_are_never_read():
    h = Harness(8, 16, seed=6)
    a, b = h.new(), h.new()
    h.grow([a], 20)
    h.grow([b], 40)
    q = torch.randn(2, 2, 1, 32, device=DEVICE)
    table, seqlens = h.cache.block_table([a, b])
    out = flash_decode_paged(q, h.cache.k_pages, h.cache.v_pages, table, seqlens)
    table[0, 2] = 10**6                                     # a uses 2 pages: its third entry is not read
    unused = [p for p in range(8) if p not in h.cache.pages(a) + h.cache.pages(b)]
    k, v = h.cache.k_pages.clone(), h.cache.v_pages.clone()
    k[unused], v[unused] = float("nan"), float("nan")       # nor are free pages
    k[h.cache.pages(a)[1], :, 4:] = 1e4                     # nor rows past a's length in its last page
    assert torch.equal(flash_decode_paged(q, k, v, table, seqlens), out)


def test_same_tiles_give_the_same_numbers():
    """Pages of 64 keys and the contiguous kernel's 64-key tiles: the same arithmetic, bit for bit."""
    h = Harness(16, 64, seed=7)
    ids = [h.new(), h.new()]
    h.grow(ids, 100)
    q = torch.randn(2, 4, 1, 32, device=DEVICE)
    k, v, lengths = h.contiguous(ids)
    table, seqlens = h.cache.block_table(ids)
    for splits in (1, 2):
        expect = flash_decode(q, k, v, cache_seqlens=lengths, num_splits=splits)
        assert torch.equal(flash_decode_paged(q, h.cache.k_pages, h.cache.v_pages, table, seqlens,
                                              num_splits=splits), expect)


def test_pool_stored_position_major():
    """A pool kept as (pages, page_size, Hkv, D), as FlashAttention and vLLM do, passed as a transposed view."""
    h = Harness(8, 16, seed=8)
    ids = [h.new(), h.new()]
    h.grow(ids, 27)
    k_major, v_major = (p.transpose(1, 2).contiguous() for p in (h.cache.k_pages, h.cache.v_pages))
    q = torch.randn(2, 4, 1, 32, device=DEVICE)
    table, seqlens = h.cache.block_table(ids)
    out = flash_decode_paged(q, k_major.transpose(1, 2), v_major.transpose(1, 2), table, seqlens, num_splits=2)
    torch.testing.assert_close(out, flash_decode_paged(q, h.cache.k_pages, h.cache.v_pages, table, seqlens,
                                                       num_splits=2))


def test_check_page_size():
    assert [check_page_size(p) for p in (16, 256)] == [16, 256]
    for bad in (8, 48, 512, 0):
        with pytest.raises(ValueError, match="page_size"):
            check_page_size(bad)
    with pytest.raises(TypeError, match="page_size"):
        check_page_size(16.0)


def test_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache(0, 16, 2, 32)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(4, 24, 2, 32)
    with pytest.raises(TypeError, match="kv_heads"):
        PagedKVCache(4, 16, 2.0, 32)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(4, 16, 2, 32, dtype=torch.int32)
    with pytest.raises(TypeError, match="device"):
        PagedKVCache(4, 16, 2, 32, device=0)
    cache = PagedKVCache(4, 16, 2, 8, dtype=torch.float32)
    a = cache.new_sequence()
    kv = torch.zeros(1, 2, 3, 8)
    bad_calls = [
        (TypeError, "seq_ids must be", lambda: cache.append("a", kv, kv)),
        (ValueError, "seq_ids is empty", lambda: cache.append([], kv, kv)),
        (TypeError, "seq_ids must hold ints", lambda: cache.append([True], kv, kv)),
        (ValueError, "sequence 7 is not in the cache", lambda: cache.append([7], kv, kv)),
        (ValueError, "repeated", lambda: cache.append([a, a], torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8))),
        (ValueError, r"k must have shape \(1, 2, new tokens >= 1, 8\)", lambda: cache.append([a], kv[:, :1], kv)),
        (ValueError, "k must have shape", lambda: cache.append([a], kv[:, :, :0], kv[:, :, :0])),
        (ValueError, "v has shape", lambda: cache.append([a], kv, kv[:, :, :2])),
        (TypeError, "k has dtype torch.float16", lambda: cache.append([a], kv.half(), kv)),
        (TypeError, "v must be a torch.Tensor", lambda: cache.append([a], kv, kv.tolist())),
        (ValueError, "k is on meta", lambda: cache.append([a], kv.to("meta"), kv)),
        (ValueError, "not in the cache", lambda: cache.fork(3)),
        (TypeError, "seq_ids must be", lambda: cache.block_table(None)),
        (TypeError, "seq must be one sequence id", lambda: cache.pages([a])),
        (TypeError, "seq must be one sequence id", lambda: cache.free(None)),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()
    assert cache.length(a) == 0 and cache.num_free_pages == 4


def test_flash_decode_paged_rejects_bad_inputs():
    h = Harness(4, 16, seed=9)
    ids = [h.new(), h.new()]
    h.grow(ids, 20)
    k, v = h.cache.k_pages, h.cache.v_pages
    table, seqlens = h.cache.block_table(ids)
    q = torch.zeros(2, 4, 1, 32, device=DEVICE)
    bad_calls = [
        (ValueError, "q must be a non-empty 4-dim", lambda: flash_decode_paged(q[0], k, v, table, seqlens)),
        (ValueError, "k_pages must be a non-empty 4-dim", lambda: flash_decode_paged(q, k[0], v, table, seqlens)),
        (TypeError, "v_pages has dtype", lambda: flash_decode_paged(q, k, v.half(), table, seqlens)),
        (TypeError, "q has dtype torch.float64", lambda: flash_decode_paged(q.double(), k, v, table, seqlens)),
        (ValueError, "v_pages has shape", lambda: flash_decode_paged(q, k, v[:3], table, seqlens)),
        (ValueError, "head_dim", lambda: flash_decode_paged(q[..., :16], k, v, table, seqlens)),
        (ValueError, "not a multiple", lambda: flash_decode_paged(q[:, :3], k, v, table, seqlens)),
        (ValueError, "page size", lambda: flash_decode_paged(q, k[:, :, :8], v[:, :, :8], table, seqlens)),
        (TypeError, "block_table must be int32", lambda: flash_decode_paged(q, k, v, table.long(), seqlens)),
        (TypeError, "block_table must be a torch.Tensor", lambda: flash_decode_paged(q, k, v, [[0]], seqlens)),
        (ValueError, r"block_table must have shape \(2,", lambda: flash_decode_paged(q, k, v, table[:1], seqlens)),
        (TypeError, "cache_seqlens must be a tensor", lambda: flash_decode_paged(q, k, v, table, None)),
        (ValueError, r"cache_seqlens must lie in \[0, 32\] \(2 pages of 16",
         lambda: flash_decode_paged(q, k, v, table, seqlens + 13)),
        (ValueError, "cache_seqlens must be", lambda: flash_decode_paged(q, k, v, table, seqlens.float())),
        (ValueError, r"block_table\[1, 1\] = 4 is not a page of the pool \(0 to 3\)",
         lambda: flash_decode_paged(q, k, v, torch.tensor([[0, 1], [2, 4]], dtype=torch.int32, device=q.device), seqlens)),
        (ValueError, r"block_table\[0, 0\] = -1", lambda: flash_decode_paged(q, k, v, table - 1 - table, seqlens)),
        (ValueError, "num_splits", lambda: flash_decode_paged(q, k, v, table, seqlens, num_splits=0)),
        (TypeError, "causal", lambda: flash_decode_paged(q, k, v, table, seqlens, causal=None)),
        (TypeError, "return_lse", lambda: flash_decode_paged(q, k, v, table, seqlens, return_lse=1)),
        (ValueError, "sm_scale", lambda: flash_decode_paged(q, k, v, table, seqlens, sm_scale=0.0)),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_long_ragged_batch_on_gpu(page_size, dtype):
    """Serving-sized: 8 sequences up to 6k tokens, 32 query heads on 8 KV heads, d = 128, forks included."""
    h = Harness(8 * 6144 // page_size + 64, page_size, kv_heads=8, head_dim=128, dtype=dtype, seed=10)
    ids = [h.new() for _ in range(6)]
    for s, n in zip(ids, (6000, 1, 777, 4096, 3000, 65)):
        h.grow([s], n)
    ids += [h.fork(ids[2]), h.fork(ids[3])]
    h.grow(ids, 3)
    for new_tokens, causal in ((1, False), (4, True)):
        h.check(ids, heads=32, new_tokens=new_tokens, causal=causal, splits=(None, 1, 8))


@pytest.mark.gpu
def test_page_offsets_past_2_to_the_31_on_gpu():
    """Page 1 of a pool starts 2**31 elements in: a 32-bit page * stride would wrap around."""
    page_size, d = 16, 128
    stride_page = 2**31 + page_size * d
    storage = torch.zeros(stride_page + page_size * d, device="cuda", dtype=torch.bfloat16)
    k = storage.as_strided((2, 1, page_size, d), (stride_page, page_size * d, d, 1))
    k.copy_(torch.randn(2, 1, page_size, d, device="cuda"))
    q = torch.randn(1, 4, 1, d, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[1]], dtype=torch.int32, device="cuda")
    out = flash_decode_paged(q, k, k, table, torch.tensor([page_size], device="cuda"))
    expect = flash_decode(q, k[1:].contiguous(), k[1:].contiguous())
    assert_close(out.float(), expect.float(), dtype=torch.bfloat16)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_copy_is_the_cache_in_shuffled_pages(page_size):
    """The benchmark's pools: every page lands where the block table says, in an order that is not the identity."""
    from utils.course.bench.decoding import paged_copy

    k, v = (torch.randn(3, 2, 4 * page_size, 8, device=DEVICE) for _ in range(2))
    k_pool, v_pool, table = paged_copy(k, v, page_size, seed=1)
    assert table.dtype == torch.int32 and table.shape == (3, 4) and k_pool.shape == (12, 2, page_size, 8)
    assert sorted(table.flatten().tolist()) == list(range(12)) and table.flatten().tolist() != list(range(12))
    for b in range(3):
        for j in range(4):
            rows = slice(j * page_size, (j + 1) * page_size)
            assert torch.equal(k_pool[table[b, j]], k[b, :, rows]) and torch.equal(v_pool[table[b, j]], v[b, :, rows])
    q = torch.randn(3, 4, 1, 8, device=DEVICE)
    lengths = torch.full((3,), 4 * page_size, device=DEVICE)
    assert_close(flash_decode_paged(q, k_pool, v_pool, table.to(DEVICE), lengths), flash_decode(q, k, v))


def test_paged_copy_rejects_bad_arguments():
    from utils.course.bench.decoding import paged_copy

    k = torch.zeros(1, 1, 48, 8)
    with pytest.raises(ValueError, match="multiple of page_size=32"):
        paged_copy(k, k, 32)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        paged_copy(k, k, 24)


@pytest.mark.gpu
def test_paged_benchmark_on_gpu(tmp_path):
    """`python -m utils.course.bench.decoding --paged`'s writer at a small size: one row per method, errors small."""
    import json

    from utils.course.bench.decoding import PAGED_COMMAND, paged_path, write_paged

    path = write_paged(tmp_path, "gpu", batches=(2,), seqlens=(512,), page_sizes=(16, 256))
    assert path == paged_path(tmp_path, "gpu")
    result = json.loads(path.read_text())
    assert result["environment"]["command"] == PAGED_COMMAND
    methods = [r["method"] for r in result["rows"]]
    assert methods == ["flash_decode", "flash_decode, cache_seqlens", "flash_decode_paged, 16-token pages",
                       "flash_decode_paged, 256-token pages"]
    assert all(r["gbps"] > 0 and r["max_abs_err"] < 2e-2 for r in result["rows"])


def test_lengths_and_tables_are_read_once_until_written():
    """Value checks sync with the GPU: a tensor that passed is not read again until an in-place write changes it."""
    from unittest import mock

    import utils.decoding.split_kv as fd

    k, v = (torch.randn(4, 2, 16, 8, device=DEVICE) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([32, 20], device=DEVICE)
    q = torch.randn(2, 4, 1, 8, device=DEVICE)
    with mock.patch.object(fd, "_refuse_capture", wraps=fd._refuse_capture) as reads:
        def checks():
            before = reads.call_count
            fd.flash_decode_paged(q, k, v, table, lengths)
            return reads.call_count - before

        assert checks() == 2 and checks() == 0            # lengths and table, then neither
        table[1, 1] = 0
        assert checks() == 1                              # the table again, the lengths not
        lengths[1] = 17
        assert checks() == 2                              # the lengths, and the table (which entries are read)
        table[1:].fill_(7)                                # through a view: the version counter is shared
        with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 7 is not a page"):
            fd.flash_decode_paged(q, k, v, table, lengths)
        table[1] = torch.tensor([2, 3])
        lengths[0] = 33
        with pytest.raises(ValueError, match="cache_seqlens must lie in"):
            fd.flash_decode_paged(q, k, v, table, lengths)
        lengths[0] = 32
        assert checks() == 2
        before = reads.call_count                         # another limit (a cache of 40): checked again
        fd.flash_decode(q, k[:2].repeat(1, 1, 3, 1)[:, :, :40], v[:2, :, :8].repeat(1, 1, 5, 1),
                        cache_seqlens=lengths)
        assert reads.call_count - before == 1
        with torch.inference_mode():                      # no version counter: checked at every call
            lengths_inf, table_inf = lengths.clone(), table.clone()
        before = reads.call_count
        for _ in range(2):
            fd.flash_decode_paged(q, k, v, table_inf, lengths_inf)
        assert reads.call_count - before == 4


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")   # the interpreter's max of NaN rows
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.full)], ids=["full", "causal"])
def test_a_table_written_without_a_version_bump_is_never_followed_out_of_the_pool(causal):
    """A kernel or a CUDA graph's replay writes a checked table or lengths without bumping their version counter
    (here: through `.data`), so the host check is skipped. The kernel still reads nothing outside the pool and
    the table: the rows that would see such a page, or a sequence whose length passes the table's reach, come
    out NaN; the other rows are unchanged. Outside the pool and the table lie real memory (the pool and the
    table are views into larger tensors), so that a kernel following the ids would give finite numbers."""
    gen = torch.Generator().manual_seed(9)
    store_k, store_v = (torch.randn(10, 2, 16, 32, generator=gen).to(DEVICE) for _ in range(2))
    k, v = store_k[1:9], store_v[1:9]                         # a pool of 8 pages: pages -1 and 8 are in the store
    store_table = torch.full((2, 5), 4, dtype=torch.int32, device=DEVICE)
    table = store_table[:, :3]                                # 3 pages per sequence: a reach of 48 positions
    table[0], table[1, :2] = torch.tensor([3, 5, 0]), torch.tensor([6, 2])
    lengths = torch.tensor([40, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 10, 32, generator=gen).to(DEVICE)   # 10 new tokens: causal rows 0, 1 stop at key 31
    for splits in (1, 3):
        def decode():
            return flash_decode_paged(q, k, v, table, lengths, causal=causal, num_splits=splits, return_lse=True)

        good, good_lse = decode()                             # checked, and stamped with the versions
        versions = table._version, lengths._version
        for entry, value in (("page", 8), ("page", -1), ("length", 49), ("length", -3)):
            target, index, seq = (table, (0, 2), 0) if entry == "page" else (lengths, 1, 1)
            before = int(target[index])
            target.data[index] = value                        # no version bump: the stamp still vouches
            out, lse = decode()
            target.data[index] = before
            assert (table._version, lengths._version) == versions
            # the rows that see the last page of sequence 0 (positions 32 to 39), or all of sequence 1
            lost = torch.zeros(2, 4, 10, dtype=torch.bool, device=DEVICE)
            lost[seq, :, 2 if causal and entry == "page" else 0:] = True
            assert torch.isnan(out[lost]).all() and torch.isnan(lse[lost]).all(), (splits, entry, value)
            assert torch.equal(out[~lost], good[~lost]) and torch.equal(lse[~lost], good_lse[~lost])
        assert torch.equal(decode()[0], good)


def test_unchecked_values_refused_during_graph_capture(monkeypatch):
    """Inside CUDA-graph capture a host read would fail obscurely: a clear error says to call once before."""
    import utils.decoding.split_kv as fd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cache_seqlens's values are read on the host.*call once"):
        fd._check_seqlens(torch.tensor([3, 4]), 2, 16, torch.device("cpu"))


@pytest.mark.gpu
def test_a_table_rewritten_by_a_graph_replay_is_guarded_by_the_kernel():
    """A CUDA graph's replay writes the table without bumping its version counter, so the check is skipped: the
    kernel does not follow the page id outside the pool (past the pool lies real memory, a kernel that did would
    give finite numbers); the sequence that reads it gets NaN rows, the other the same as before."""
    store_k, store_v = (torch.randn(10, 2, 16, 32, device="cuda") for _ in range(2))
    k, v = store_k[1:9], store_v[1:9]                      # pools of 8 pages in stores of 10
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([40, 20], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 4, 1, 32, device="cuda")
    source = table.clone()
    rewrite = torch.cuda.CUDAGraph()
    with torch.cuda.graph(rewrite):
        table.copy_(source)                                # recorded, not run: the version is bumped now, once
    good = flash_decode_paged(q, k, v, table, lengths)     # checked and stamped
    version = table._version
    source[0, 2] = 8                                       # one past the pool
    rewrite.replay()
    assert table._version == version and int(table[0, 2]) == 8
    out = flash_decode_paged(q, k, v, table, lengths)
    assert torch.isnan(out[0]).all() and torch.equal(out[1], good[1])


@pytest.mark.gpu
def test_paged_decode_in_a_cuda_graph():
    """Checked once outside, the paged decode is captured and replayed; the replay follows new query values."""
    k, v = (torch.randn(8, 8, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(8, device="cuda").to(torch.int32).view(2, 4)
    lengths = torch.tensor([256, 100], device="cuda", dtype=torch.int32)
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    flash_decode_paged(q, k, v, table, lengths)  # the checks, and Triton's compilation, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_decode_paged(q, k, v, table, lengths)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_close(out.float(), flash_decode_paged(q, k, v, table, lengths).float(), dtype=torch.bfloat16)
