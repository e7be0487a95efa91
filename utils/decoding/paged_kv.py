"""A paged KV cache: the K/V of many sequences in one pool of fixed-size pages (vLLM's PagedAttention idea).

A contiguous cache (B, Hkv, N, D) reserves N positions for every sequence, however short it stays, and cannot
let two sequences share a prompt. Here the pools `k_pages`, `v_pages` have shape (pages, Hkv, page_size, D) and
each sequence owns a list of page ids, its row of the **block table**: position p of a sequence is row
p % page_size of its page number p // page_size. A sequence takes a page only when it needs one, so at most
one partly filled page per sequence is wasted, and a freed sequence's pages go straight back to the free list.

Layout: a page is (Hkv, page_size, D), so one head's keys in a page are one contiguous block, exactly a slice
of the course's contiguous (B, Hkv, N, D) cache; the decode kernel reads a key tile of a page as it reads a tile
of a contiguous cache. (FlashAttention and vLLM keep (pages, page_size, Hkv, D), matching their (B, N, H, D)
tensors; such a pool works with `flash_decode_paged` too, as `.transpose(1, 2)`.)

Sharing (`fork`): pages are reference-counted. Full pages are never written again (appends only write past a
sequence's end), so a fork shares them for free. Only a sequence's last, partly filled page is ever written, so
`fork` gives the child its own copy of that one page at once: copy-on-write done eagerly, at most one page per
fork, the copy a lazy copy-on-write would make at the first append. Then no page that is written is shared, and
`append` needs no sharing logic at all.

`PagedKVCache` is plain PyTorch (it imports no Triton kernel); `utils.decoding.split_kv.flash_decode_paged` reads it.
"""
from __future__ import annotations

import numbers

import torch

from utils.checks import positive_int

PAGE_SIZES = (16, 32, 64, 128, 256)


def check_page_size(page_size, name: str = "page_size") -> int:
    """`page_size` as an int, or a TypeError/ValueError naming `name` unless it is a power of two from 16 to 256.

    16 is `tl.dot`'s smallest tile; 256 keeps the waste in each sequence's last page small. The decode kernel
    cuts its key tile (a power of two) to min(tile, page size), which then divides the page size: a tile lies in
    one page, found with one look-up in the block table.
    """
    page_size = positive_int(name, page_size)
    if page_size not in PAGE_SIZES:
        raise ValueError(f"{name} must be a power of two from 16 to 256, got {page_size}")
    return page_size


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than an append or a fork needs; the cache is left as it was."""


class PagedKVCache:
    """K/V of many sequences in pools of `num_pages` pages of `page_size` positions each.

    cache = PagedKVCache(num_pages=64, page_size=16, kv_heads=2, head_dim=32)
    a = cache.new_sequence()
    cache.append([a], k, v)                       # k, v: (1, kv_heads, new tokens, head_dim)
    b = cache.fork(a)                             # b shares a's full pages
    block_table, seqlens = cache.block_table([a, b])
    out = flash_decode_paged(q, cache.k_pages, cache.v_pages, block_table, seqlens)
    cache.free(a)
    """

    def __init__(self, num_pages, page_size, kv_heads, head_dim, *, dtype=torch.float16, device="cpu"):
        num_pages = positive_int("num_pages", num_pages)
        self.page_size = check_page_size(page_size)
        shape = (num_pages, positive_int("kv_heads", kv_heads), self.page_size, positive_int("head_dim", head_dim))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out the lowest page first
        self._refs = [0] * num_pages                     # how many sequences hold each page
        self._pages: dict[int, list[int]] = {}           # sequence id -> its pages, in order
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    # --- what is where -------------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def length(self, seq) -> int:
        """How many positions sequence `seq` holds."""
        return self._lengths[self._check_seq(seq)]

    def pages(self, seq) -> tuple[int, ...]:
        """The page ids of sequence `seq`, in order: its row of the block table."""
        return tuple(self._pages[self._check_seq(seq)])

    def block_table(self, seq_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table (B, max pages) int32, cache_seqlens (B,) int32) of the sequences `seq_ids`, in that order.

        Rows are padded with -1 past a sequence's last page: the kernel never reads past a sequence's length."""
        ids = self._check_ids(seq_ids)
        width = max(1, max(len(self._pages[s]) for s in ids))
        table = torch.full((len(ids), width), -1, dtype=torch.int32)
        for row, s in enumerate(ids):
            table[row, :len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        seqlens = torch.tensor([self._lengths[s] for s in ids], dtype=torch.int32)
        return table.to(self.k_pages.device), seqlens.to(self.k_pages.device)

    def to_contiguous(self, seq_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache (B, Hkv, max length, D), cache_seqlens (B,)): the contiguous cache these pages stand
        for, zero past each length. For checks and pictures; decoding reads the pages themselves."""
        ids = self._check_ids(seq_ids)
        longest = max(self._lengths[s] for s in ids)
        _, heads, _, dim = self.k_pages.shape
        caches = []
        for pool in (self.k_pages, self.v_pages):
            out = pool.new_zeros(len(ids), heads, longest, dim)
            for row, s in enumerate(ids):
                n = self._lengths[s]
                pages = pool[self._pages[s]]  # (pages, Hkv, page_size, D): concatenate along the positions
                out[row, :, :n] = pages.transpose(0, 1).reshape(heads, -1, dim)[:, :n]
            caches.append(out)
        seqlens = torch.tensor([self._lengths[s] for s in ids], dtype=torch.int32, device=self.k_pages.device)
        return caches[0], caches[1], seqlens

    # --- changing it --------------------------------------------------------------------------------------

    def new_sequence(self) -> int:
        """A new, empty sequence; returns its id. It takes no page until something is appended."""
        seq = self._next_id
        self._next_id += 1
        self._pages[seq], self._lengths[seq] = [], 0
        return seq

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` (len(seq_ids), Hkv, T, D) after the ends of the sequences `seq_ids` (T new positions
        each: one for a decode step, the prompt for a prefill), taking pages as they grow. All or nothing: if
        the pool is short of pages, OutOfPages is raised and nothing changes."""
        ids = self._check_ids(seq_ids)
        new_tokens = self._check_new_kv(k, v, len(ids))
        size = self.page_size
        needed = sum(-(-(self._lengths[s] + new_tokens) // size) - len(self._pages[s]) for s in ids)
        if needed > len(self._free):
            raise OutOfPages(f"append needs {needed} new pages but {len(self._free)} of {self.num_pages} are "
                             "free; free finished sequences or make a larger pool")
        rows_page, rows_offset = [], []
        for s in ids:
            start = self._lengths[s]
            while len(self._pages[s]) * size < start + new_tokens:
                self._pages[s].append(self._take_page())
            # Only the last page written before may be partly full, and it is this sequence's own (see fork).
            positions = range(start, start + new_tokens)
            rows_page += [self._pages[s][p // size] for p in positions]
            rows_offset += [p % size for p in positions]
            self._lengths[s] = start + new_tokens
        page = torch.tensor(rows_page, device=self.k_pages.device)
        offset = torch.tensor(rows_offset, device=self.k_pages.device)
        # One scatter for the whole batch: (B, Hkv, T, D) -> one (Hkv, D) row per (sequence, new position).
        for pool, x in ((self.k_pages, k), (self.v_pages, v)):
            pool[page, :, offset] = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])

    def fork(self, seq) -> int:
        """A new sequence with the same contents as `seq` (a shared prompt, beams, parallel samples); returns its
        id. Full pages are shared; the last page, if partly full, is copied, since both will write into it."""
        seq = self._check_seq(seq)
        pages = self._pages[seq]
        partial = self._lengths[seq] % self.page_size != 0
        if partial and not self._free:
            raise OutOfPages(f"fork needs a free page to copy sequence {seq}'s partly filled last page; "
                             f"none of {self.num_pages} is free")
        shared = pages[:-1] if partial else pages
        for p in shared:
            self._refs[p] += 1
        child = self.new_sequence()
        self._pages[child] = shared + ([self._copy_page(pages[-1])] if partial else [])
        self._lengths[child] = self._lengths[seq]
        return child

    def free(self, seq) -> None:
        """Drop sequence `seq`; each of its pages goes back to the pool once no other sequence holds it."""
        seq = self._check_seq(seq)
        for p in self._pages.pop(seq):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        del self._lengths[seq]

    # --- helpers ------------------------------------------------------------------------------------------

    def _take_page(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _copy_page(self, page: int) -> int:
        copy = self._take_page()
        self.k_pages[copy] = self.k_pages[page]
        self.v_pages[copy] = self.v_pages[page]
        return copy

    def _check_seq(self, seq) -> int:
        """`seq`, the id of one live sequence, as an int."""
        if isinstance(seq, bool) or not isinstance(seq, numbers.Integral):
            raise TypeError(f"seq must be one sequence id (an int), got {type(seq).__name__}")
        return self._check_ids([seq])[0]

    def _check_ids(self, seq_ids) -> list[int]:
        """`seq_ids` (an id, or a non-empty list or tuple of distinct ids of live sequences) as a list of ints."""
        ids = [seq_ids] if isinstance(seq_ids, numbers.Integral) and not isinstance(seq_ids, bool) else seq_ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"seq_ids must be a sequence id or a list of them, got {type(seq_ids).__name__}")
        if not ids:
            raise ValueError("seq_ids is empty: name at least one sequence")
        for s in ids:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral):
                raise TypeError(f"seq_ids must hold ints, got {type(s).__name__}")
            if s not in self._pages:
                raise ValueError(f"sequence {s} is not in the cache (never created, or freed)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids has repeated ids: {list(ids)}")
        return [int(s) for s in ids]

    def _check_new_kv(self, k, v, batch: int) -> int:
        """The number of new positions in `k`, `v`, after checking them against the pool."""
        _, heads, _, dim = self.k_pages.shape
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != heads or x.shape[3] != dim or x.shape[2] == 0:
                raise ValueError(f"{name} must have shape ({batch}, {heads}, new tokens >= 1, {dim}) for "
                                 f"{batch} sequences, got {tuple(x.shape)}")
            if x.dtype != self.k_pages.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but the pool has {self.k_pages.dtype}")
            if x.device != self.k_pages.device:
                raise ValueError(f"{name} is on {x.device} but the pool is on {self.k_pages.device}")
        if v.shape != k.shape:
            raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match")
        return k.shape[2]
