"""Flash-decoding: attention of a few query tokens against a long KV cache, with the keys split across programs.

A FlashAttention forward launches one program per (batch, head, block of queries). At decode time there is one
query per sequence, so that is batch × heads programs, often fewer than the GPU has SMs, each streaming the
whole cache alone. Here the cache is cut into `num_splits` slices:

- kernel 1 (`_split_kv_kernel`), one program per (batch, KV head, split, block of query rows): online softmax
  over its slice of the cache; writes a normalised partial output and its log-sum-exp. All query heads that
  share a KV head (GQA) are rows of one tile, so each K/V tile is read from memory once per group;
- kernel 2 (`_merge_kernel`) merges the splits of each query row by their log-sum-exps (notebook 02):
  lse = log Σ_s exp(lse_s) and o = Σ_s exp(lse_s − lse) · o_s.

With one split the first kernel writes the final output itself and the second is not launched.
Causal masking is bottom-right aligned against each sequence's own cache length: the new tokens come last.

`flash_decode_paged` runs the same kernel on a paged cache (utils/decoding/paged_kv.py): pools of fixed-size pages and a
block table per sequence. The only difference in the kernel is one look-up per key tile: which page holds it.
utils/decoding/single_path.py holds the same kernel with one path per cache, as notebook 08 prints it.
"""
from __future__ import annotations

import numbers
import weakref

import torch
import triton
import triton.language as tl

from utils.checks import AttentionShape, check_attention_inputs, check_bool, positive_int, resolve_scale
from utils.decoding.paged_kv import check_page_size
from utils.triton_utils import cdiv, interpreting

LOG2E = 1.4426950408889634  # inside the kernels scores are in base 2: exp2 is the cheap instruction
LN2 = 0.6931471805599453
MAX_SPLITS = 128
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _split_kv_kernel(Q, K, V, O, LSE, SEQLENS, BLOCK_TABLE,
                     sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     sob, soh, son, sos, sod, slb, slh, sln, sls, stb, stp,
                     kv_heads, group, n_q, n_k, n_pages, qk_scale,
                     CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr, IEEE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    # BLOCK_TABLE None (a constexpr): K, V are caches (B, Hkv, N, D). Otherwise they are pools of pages
    # (pages, Hkv, PAGE_SIZE, D), skb/svb step from page to page, and BLOCK_TABLE[b, j] is the page holding
    # positions [j·PAGE_SIZE, (j+1)·PAGE_SIZE) of sequence b. BLOCK_N divides PAGE_SIZE: a tile never straddles pages.
    # A length outside [0, n_k] or a page id outside [0, n_pages) (values written since the host checked them:
    # see _STAMP) is never followed into memory: the rows that would read there come out NaN (`lost`).
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    num_splits = tl.num_programs(1)
    b = (pid_bh // kv_heads).to(tl.int64)  # int64: b * stride passes 2**31 elements in a large cache
    hk = (pid_bh % kv_heads).to(tl.int64)

    # Rows of the tile are (query head of this KV head's group, query token) pairs, flattened.
    n_rows = group * n_q
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    g = rows // n_q
    i = rows % n_q
    h = hk * group + g
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    lost = tl.zeros([BLOCK_M], tl.int1)   # rows that would read past the cache or the pool: NaN at the end
    if HAS_SEQLENS:
        given = tl.load(SEQLENS + b)
        seqlen = tl.minimum(tl.maximum(given, 0), n_k)
        lost = lost | (given != seqlen)
    else:
        seqlen = n_k
    # This split's slice of the cache: a whole number of BLOCK_N tiles, the same count for every split.
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), num_splits)
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen)
    if CAUSAL:  # no row of this block sees past key (last query of the block) + seqlen - n_q
        first_row = row_block * BLOCK_M
        last_row = tl.minimum(first_row + BLOCK_M, n_rows) - 1
        max_i = tl.where(first_row // n_q == last_row // n_q, last_row % n_q, n_q - 1)
        hi = tl.minimum(hi, max_i + seqlen - n_q + 1)

    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqn + d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = K + hk * skh
    v_base = V + hk * svh
    if BLOCK_TABLE is None:
        k_base += b * skb
        v_base += b * svb
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        if BLOCK_TABLE is None:
            k_tile, v_tile, pos = k_base, v_base, cols
        else:  # the one extra step of a paged cache: which page holds this tile (int64: page * stride is large)
            page = tl.load(BLOCK_TABLE + b * stb + (start // PAGE_SIZE) * stp).to(tl.int64)
            outside = (page < 0) | (page >= n_pages)
            if CAUSAL:
                lost = lost | (outside & (start <= i + seqlen - n_q))   # the rows that see this tile
            else:
                lost = lost | outside
            col_ok = col_ok & ~outside
            page = tl.where(outside, 0, page)
            k_tile, v_tile, pos = k_base + page * skb, v_base + page * svb, cols % PAGE_SIZE
        k = tl.load(k_tile + pos[None, :] * skn + d[:, None] * skd, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:  # fp32 inputs: exact fp32 products, not TF32 (large logits would lose the softmax)
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= i[:, None] + seqlen - n_q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: keep p = 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_tile + pos[:, None] * svn + d[None, :] * svd, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    l_safe = tl.where(l == 0.0, 1.0, l)  # rows that saw no key in this slice: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    o = tl.where(lost[:, None], float("nan"), o)
    lse = tl.where(lost, float("nan"), lse)
    o_ptrs = O + b * sob + h[:, None] * soh + i[:, None] * son + split * sos + d[None, :] * sod
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * slb + h * slh + i * sln + split * sls, lse, mask=row_ok)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, O, LSE, heads, n_q, num_splits,
                  spb, sph, spn, sps, spd, slb, slh, sln, sls, sob, soh, son, sod, sxb, sxh, sxn,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)  # one (batch, head, query) row per program
    b = (row // (heads * n_q)).to(tl.int64)
    h = (row // n_q) % heads
    i = row % n_q
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    lse = tl.load(LSE_PART + b * slb + h * slh + i * sln + s * sls, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # exp(-inf) = 0: empty splits weigh nothing
    total = tl.sum(w, 0)
    parts = tl.load(O_PART + b * spb + h * sph + i * spn + s[:, None] * sps + d[None, :] * spd,
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    parts = tl.where(w[:, None] > 0.0, parts, 0.0)  # an empty split's output weighs nothing, even if NaN
    total_safe = tl.where(total == 0.0, 1.0, total)
    o = tl.sum(w[:, None] * parts, 0) / total_safe
    tl.store(O + b * sob + h * soh + i * son + d * sod, o.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + b * sxb + h * sxh + i * sxn, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe)))


def _check_launchable(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(f"{name} is on {t.device}: Triton kernels need a CUDA tensor, or CPU tensors with "
                         "TRITON_INTERPRET=1 set before the kernels were defined")


def default_num_sms(device) -> int:
    """SMs of the GPU; on the CPU (interpreter) a pretend count of 4, so that small problems still split."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(programs: int, seqlen_k: int, block_n: int, num_sms: int) -> int:
    """How many slices to cut the cache into so that about two waves of programs fill `num_sms` SMs.

    `programs` is what one split would launch (batch × KV heads × query-row blocks). Already a wave: 1.
    Never more splits than cache tiles of `block_n` keys, nor more than MAX_SPLITS.
    """
    for name, x in (("programs", programs), ("seqlen_k", seqlen_k), ("block_n", block_n), ("num_sms", num_sms)):
        positive_int(name, x)
    if programs >= num_sms:
        return 1
    return max(1, min(cdiv(2 * num_sms, programs), cdiv(seqlen_k, block_n), MAX_SPLITS))


# Keys per tile, warps and pipeline stages on a GPU for head dims up to 128 (chosen by a sweep on an H200).
GPU_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}


def _block_sizes(rows: int, head_dim: int) -> tuple[int, int, int]:
    d_pad = max(16, triton.next_power_of_2(head_dim))    # tl.dot needs K >= 16
    block_m = min(64, max(16, triton.next_power_of_2(rows)))  # decode: G·Nq rows, padded to a dot's minimum
    block_n = 32 if d_pad >= 256 else GPU_CONFIG["block_n"]
    return block_m, block_n, d_pad


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, *, out_dtype=None):
    """Merge split-KV partial results: `o_parts` (B, H, Nq, S, D) normalised per split, `lse_parts` (B, H, Nq, S)
    their natural-log log-sum-exps (-inf for a split that saw no key). Returns (o (B, H, Nq, D), lse (B, H, Nq)).
    """
    for name, t in (("o_parts", o_parts), ("lse_parts", lse_parts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        _check_launchable(t, name)
    if o_parts.dim() != 5 or o_parts.numel() == 0:
        raise ValueError(f"o_parts must be a non-empty (B, H, Nq, splits, D) tensor, got {tuple(o_parts.shape)}")
    if lse_parts.shape != o_parts.shape[:4]:
        raise ValueError(f"lse_parts has shape {tuple(lse_parts.shape)}, expected {tuple(o_parts.shape[:4])}")
    if lse_parts.device != o_parts.device:
        raise ValueError(f"lse_parts is on {lse_parts.device} but o_parts is on {o_parts.device}")
    batch, heads, n_q, splits, head_dim = o_parts.shape
    out = torch.empty(batch, heads, n_q, head_dim, device=o_parts.device, dtype=out_dtype or o_parts.dtype)
    lse = torch.empty(batch, heads, n_q, device=o_parts.device, dtype=torch.float32)
    _merge_kernel[(batch * heads * n_q,)](
        o_parts, lse_parts, out, lse, heads, n_q, splits, *o_parts.stride(), *lse_parts.stride(), *out.stride(),
        *lse.stride(), HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out, lse


# Value checks read a tensor on the host: a sync per call, which costs a small decode step more than its kernels
# and is forbidden inside CUDA-graph capture. A tensor whose values passed is remembered with its version counter
# (bumped by every in-place write, through any view), so a server's lengths and block table, passed to every layer
# of a step, are read once per step; a changed tensor is checked again. Inference-mode tensors have no version
# counter: they are checked at every call. The stamp is an attribute of the tensor, so it lives and dies with it.
# A write that bumps no version counter (a kernel's, a CUDA graph's replay, a write through `.data`) escapes the
# stamp, so the kernel guards itself too: it follows no length or page id outside the cache, the table or the
# pool, and writes NaN for the rows that would have read there.
_STAMP = "_flash_decoding_checked"


def _trackable(*tensors) -> bool:
    return not any(isinstance(x, torch.Tensor) and x.is_inference() for x in tensors)


def _already_checked(t: torch.Tensor, *limits) -> bool:
    """Whether t's values passed a check against these `limits` and t has not been written since."""
    seen = getattr(t, _STAMP, None)
    if seen is None or not _trackable(t, *limits) or seen[0] != t._version or len(seen[1]) != len(limits):
        return False
    return all(a() is b if isinstance(a, weakref.ref) else a == b for a, b in zip(seen[1], limits))


def _remember_checked(t: torch.Tensor, *limits) -> None:
    """Stamp t with its version and the limits, a tensor among them by a weak reference (compared by identity)."""
    if _trackable(t, *limits):
        setattr(t, _STAMP, (t._version, tuple(weakref.ref(x) if isinstance(x, torch.Tensor) else x
                                              for x in limits)))


def _refuse_capture(name: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name}'s values are read on the host, which CUDA-graph capture forbids: call once "
                           f"with the same tensors before capturing (checked tensors are remembered)")


def check_seqlens(seqlens, batch: int, n_k: int, device, *, name: str = "seqlens", at_least: int = 0,
                  like: str = "q"):
    """`seqlens` (B,) int32/int64 within [at_least, n_k] as a contiguous int32 tensor (None: all n_k). Reads the
    values on the host (a sync on a GPU): a length past the cache would send the kernel outside it. `like`: the
    tensor whose device it must share, as the message names it."""
    if seqlens is None:
        if n_k < at_least:
            raise ValueError(f"{name} is None, so every sequence holds all {n_k} entries: fewer than {at_least}")
        return torch.full((batch,), n_k, dtype=torch.int32, device=device)
    if not isinstance(seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(seqlens).__name__}")
    if seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {seqlens.dtype}")
    if seqlens.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), one length per sequence, got {tuple(seqlens.shape)}")
    if seqlens.device != device:
        raise ValueError(f"{name} is on {seqlens.device} but {like} is on {device}; they must match")
    if int(seqlens.min()) < at_least or int(seqlens.max()) > n_k:
        raise ValueError(f"{name} must lie in [{at_least}, {n_k}] ({n_k}: the cache length), got "
                         f"{seqlens.tolist() if batch <= 8 else 'values outside'}")
    return seqlens.to(torch.int32).contiguous()


def _check_seqlens(cache_seqlens, batch: int, seqlen_k: int, device, limit="the cache length"):
    if cache_seqlens is None:
        return None
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor or None, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int32/int64 tensor of shape ({batch},), got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
    if not _already_checked(cache_seqlens, seqlen_k):
        _refuse_capture("cache_seqlens")
        if int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > seqlen_k:
            raise ValueError(f"cache_seqlens must lie in [0, {seqlen_k}] ({limit}), got "
                             f"{cache_seqlens.tolist() if batch <= 8 else 'values outside'}")
        _remember_checked(cache_seqlens, seqlen_k)
    return cache_seqlens.to(torch.int32).contiguous()


def flash_decode(q, k_cache, v_cache, *, sm_scale=None, num_splits=None, cache_seqlens=None, causal=False,
                 return_lse=False, _block_n=None, _num_warps=None, _num_stages=None):
    """Attention of q (B, H, Nq, D), a few new tokens, against a KV cache (B, Hkv, Nk, D), split over the keys.

    - `num_splits`: slices of the cache per sequence (None: enough to fill the GPU, `choose_num_splits`);
    - `cache_seqlens`: (B,) ints, how many cache entries of each sequence are valid (None: all Nk);
    - `causal`: new token i sees cache entries j <= i + L - Nq, L the sequence's length (bottom-right);
    - `return_lse`: also return the natural-log log-sum-exp (B, H, Nq) in fp32 (-inf where no key was seen).
    A length outside [0, Nk] that escaped the check (see flash_decode_paged) gives its sequence NaN rows.
    fp16, bf16 and fp32; on the CPU through the Triton interpreter, which has no bf16 arithmetic, so there bf16
    inputs are computed in fp32 and the output is rounded to bf16.
    """
    shape = check_attention_inputs(q, k_cache, v_cache, causal=causal, dtypes=DTYPES)
    scale = resolve_scale(sm_scale, shape.head_dim)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_launchable(t, name)
    check_bool("return_lse", return_lse)
    seqlens = _check_seqlens(cache_seqlens, shape.batch, shape.seqlen_k, q.device)
    return _decode(q, k_cache, v_cache, seqlens, None, shape, scale=scale, causal=causal, num_splits=num_splits,
                   return_lse=return_lse, block_n=_block_n, num_warps=_num_warps, num_stages=_num_stages)


def _decode(q, k, v, seqlens, block_table, shape, *, scale, causal, num_splits, return_lse, block_n=None,
            num_warps=None, num_stages=None):
    """Launch the split-KV kernel, then the merge, on validated inputs. With a `block_table`, `k` and `v` are pools
    of pages and `shape.seqlen_k` is what the table can hold (its width × the page size)."""
    out_dtype = q.dtype
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        q, k, v = q.float(), k.float(), v.float()

    group = shape.heads // shape.kv_heads
    rows = group * shape.seqlen_q
    block_m, default_block_n, d_pad = _block_sizes(rows, shape.head_dim)
    block_n = block_n or default_block_n
    page_size = None if block_table is None else k.shape[2]
    if page_size is not None:
        block_n = min(block_n, page_size)  # powers of two: the tile divides the page, so it lies in one page
    num_warps = num_warps or GPU_CONFIG["num_warps"]
    num_stages = num_stages or (GPU_CONFIG["num_stages"] if d_pad <= 128 else 2)
    row_blocks = cdiv(rows, block_m)
    programs = shape.batch * shape.kv_heads * row_blocks
    if num_splits is None:
        num_splits = choose_num_splits(programs, shape.seqlen_k, block_n, default_num_sms(q.device))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    b, h, nq, d = shape.batch, shape.heads, shape.seqlen_q, shape.head_dim
    out = torch.empty(b, h, nq, d, device=q.device, dtype=q.dtype)
    if num_splits == 1:  # write the final result directly: the "split" stride is 0
        o_dst, lse_dst = out.unsqueeze(3), torch.empty(b, h, nq, 1, device=q.device, dtype=torch.float32)
    else:
        o_dst = torch.empty(b, h, nq, num_splits, d, device=q.device, dtype=torch.float32)
        lse_dst = torch.empty(b, h, nq, num_splits, device=q.device, dtype=torch.float32)
    table_strides = (0, 0) if block_table is None else block_table.stride()
    _split_kv_kernel[(b * shape.kv_heads, num_splits, row_blocks)](
        q, k, v, o_dst, lse_dst, seqlens if seqlens is not None else q, block_table,
        *q.stride(), *k.stride(), *v.stride(), *o_dst.stride(), *lse_dst.stride(), *table_strides,
        shape.kv_heads, group, nq, shape.seqlen_k, 0 if block_table is None else k.shape[0], scale * LOG2E,
        CAUSAL=causal, HAS_SEQLENS=seqlens is not None, IEEE=q.dtype == torch.float32, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, num_warps=num_warps, num_stages=num_stages)
    if num_splits == 1:
        lse = lse_dst.squeeze(3)
    else:
        out, lse = merge_partials(o_dst, lse_dst, out_dtype=q.dtype)
    out = out.to(out_dtype)  # a no-op except for bf16 on the CPU
    return (out, lse) if return_lse else out


def _check_paged_inputs(q, k_pages, v_pages, *, causal) -> tuple[int, int, int]:
    """q (B, H, Nq, D) and two pools (pages, Hkv, page_size, D) of q's dtype and device: (pages, Hkv, page_size)."""
    pool = "(pages, kv_heads, page_size, head_dim)"
    for name, t, dims in (("q", q, "(batch, heads, seq, head_dim)"), ("k_pages", k_pages, pool),
                          ("v_pages", v_pages, pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 4-dim tensor {dims}, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
        _check_launchable(t, name)
    check_bool("causal", causal)
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages has shape {tuple(v_pages.shape)} but k_pages has {tuple(k_pages.shape)}")
    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    if head_dim != q.shape[3]:
        raise ValueError(f"k_pages has head_dim {head_dim} but q has {q.shape[3]}; they must match")
    if q.shape[1] % kv_heads != 0:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {kv_heads} heads of k_pages and v_pages")
    check_page_size(page_size, "k_pages.shape[2] (the page size)")
    return num_pages, kv_heads, page_size


def _check_block_table(block_table, cache_seqlens, num_pages: int, page_size: int, batch: int, device):
    """Validate the block table and the lengths; return the lengths as int32. Only the entries the kernel reads
    are checked (the first ceil(L_b / page_size) of row b): a page index outside the pool would read memory that
    is not the cache, silently or with a crash."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape ({batch}, pages per sequence >= 1), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if cache_seqlens is None:
        raise TypeError("cache_seqlens must be a tensor of each sequence's length; a paged cache has no default")
    reach = f"{block_table.shape[1]} pages of {page_size}, the block table's reach"
    seqlens = _check_seqlens(cache_seqlens, batch, block_table.shape[1] * page_size, device, limit=reach)
    # which entries are read depends on the lengths: remembered with the very tensor and version they had
    limits = (num_pages, page_size, cache_seqlens, cache_seqlens._version if _trackable(cache_seqlens) else None)
    if not _already_checked(block_table, *limits):
        _refuse_capture("block_table")
        used = torch.arange(block_table.shape[1], device=device) < ((seqlens + page_size - 1) // page_size)[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bad.any():
            b, j = bad.nonzero()[0].tolist()
            raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the pool (0 to "
                             f"{num_pages - 1}), and sequence {b} of length {int(seqlens[b])} reads it")
        _remember_checked(block_table, *limits)
    return seqlens


def flash_decode_paged(q, k_pages, v_pages, block_table, cache_seqlens, *, sm_scale=None, num_splits=None,
                       causal=False, return_lse=False):
    """`flash_decode` against a paged KV cache: position p of sequence b is row p % page_size of page
    block_table[b, p // page_size] of the pools `k_pages`, `v_pages` (pages, Hkv, page_size, D).

    - `block_table`: (B, pages per sequence) int32; entries past a sequence's last page are never read;
    - `cache_seqlens`: (B,) ints, each sequence's length (required);
    - the page size is a power of two from 16 to 256; the kernel's key tile is cut to fit in one page.
    Other arguments and the result as in `flash_decode`. Sequences may share pages (a common prefix). A pool kept
    as (pages, page_size, Hkv, D) can be passed as `.transpose(1, 2)`: the kernel follows strides. Like
    `flash_decode`'s check of `cache_seqlens`, the check of the table reads its values (on a GPU, a sync), once
    until an in-place write bumps the tensor's version counter. A table or lengths changed since without one (by
    a kernel, or a CUDA graph's replay) are not checked again; the kernel still reads nothing outside the pool
    and the table. Instead a query row that would see a position on a page outside the pool, and every row of a
    sequence whose length lies outside [0, the table's reach], gets NaN (output and lse).
    """
    num_pages, kv_heads, page_size = _check_paged_inputs(q, k_pages, v_pages, causal=causal)
    batch, heads, seqlen_q, head_dim = q.shape
    scale = resolve_scale(sm_scale, head_dim)
    check_bool("return_lse", return_lse)
    seqlens = _check_block_table(block_table, cache_seqlens, num_pages, page_size, batch, q.device)
    shape = AttentionShape(batch, heads, kv_heads, seqlen_q, block_table.shape[1] * page_size, head_dim)
    return _decode(q, k_pages, v_pages, seqlens, block_table, shape, scale=scale, causal=causal,
                   num_splits=num_splits, return_lse=return_lse)


def flash_decoding_attention(q, k, v, *, causal=False, sm_scale=None):
    """Registry entry: `flash_decode` with the course's attention signature (any Nq, bottom-right causal)."""
    return flash_decode(q, k, v, causal=causal, sm_scale=sm_scale)
