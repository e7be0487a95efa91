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
"""
from __future__ import annotations

import functools
import numbers

import torch
import triton
import triton.language as tl

from utils.checks import check_attention_inputs, check_bool, positive_int, resolve_scale
from utils.triton_utils import cdiv, interpreting

LOG2E = 1.4426950408889634  # inside the kernels scores are in base 2: exp2 is the cheap instruction
LN2 = 0.6931471805599453
MAX_SPLITS = 128
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _split_kv_kernel(Q, K, V, O, LSE, SEQLENS,
                     sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     sob, soh, son, sos, sod, slb, slh, sln, sls,
                     kv_heads, group, n_q, n_k, qk_scale,
                     CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
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

    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b)
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
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :] * skn + d[:, None] * skd, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
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
        v = tl.load(v_base + cols[:, None] * svn + d[None, :] * svd, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    l_safe = tl.where(l == 0.0, 1.0, l)  # rows that saw no key in this slice: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
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


def _check_seqlens(cache_seqlens, batch: int, seqlen_k: int, device) -> torch.Tensor | None:
    if cache_seqlens is None:
        return None
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor or None, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int32/int64 tensor of shape ({batch},), got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
    if int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > seqlen_k:
        raise ValueError(f"cache_seqlens must lie in [0, {seqlen_k}] (the cache length), got "
                         f"{cache_seqlens.tolist() if batch <= 8 else 'values outside'}")
    return cache_seqlens.to(torch.int32).contiguous()


def flash_decode(q, k_cache, v_cache, *, sm_scale=None, num_splits=None, cache_seqlens=None, causal=False,
                 return_lse=False, _block_n=None, _num_warps=None, _num_stages=None):
    """Attention of q (B, H, Nq, D), a few new tokens, against a KV cache (B, Hkv, Nk, D), split over the keys.

    - `num_splits`: slices of the cache per sequence (None: enough to fill the GPU, `choose_num_splits`);
    - `cache_seqlens`: (B,) ints, how many cache entries of each sequence are valid (None: all Nk);
    - `causal`: new token i sees cache entries j <= i + L - Nq, L the sequence's length (bottom-right);
    - `return_lse`: also return the natural-log log-sum-exp (B, H, Nq) in fp32 (-inf where no key was seen).
    fp16, bf16 and fp32; on the CPU through the Triton interpreter, which has no bf16 arithmetic, so there bf16
    inputs are computed in fp32 and the output is rounded to bf16.
    """
    shape = check_attention_inputs(q, k_cache, v_cache, causal=causal, dtypes=DTYPES)
    scale = resolve_scale(sm_scale, shape.head_dim)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_launchable(t, name)
    check_bool("return_lse", return_lse)
    seqlens = _check_seqlens(cache_seqlens, shape.batch, shape.seqlen_k, q.device)
    out_dtype = q.dtype
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()

    group = shape.heads // shape.kv_heads
    rows = group * shape.seqlen_q
    block_m, block_n, d_pad = _block_sizes(rows, shape.head_dim)
    block_n = _block_n or block_n
    num_warps = _num_warps or GPU_CONFIG["num_warps"]
    num_stages = _num_stages or (GPU_CONFIG["num_stages"] if d_pad <= 128 else 2)
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
    _split_kv_kernel[(b * shape.kv_heads, num_splits, row_blocks)](
        q, k_cache, v_cache, o_dst, lse_dst, seqlens if seqlens is not None else q,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *o_dst.stride(), *lse_dst.stride(),
        shape.kv_heads, group, nq, shape.seqlen_k, scale * LOG2E,
        CAUSAL=causal, HAS_SEQLENS=seqlens is not None, IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, num_warps=num_warps, num_stages=num_stages)
    if num_splits == 1:
        lse = lse_dst.squeeze(3)
    else:
        out, lse = merge_partials(o_dst, lse_dst, out_dtype=q.dtype)
    out = out.to(out_dtype)  # a no-op except for bf16 on the CPU
    return (out, lse) if return_lse else out


def flash_decoding_attention(q, k, v, *, causal=False, sm_scale=None):
    """Registry entry: `flash_decode` with the course's attention signature (any Nq, bottom-right causal)."""
    return flash_decode(q, k, v, causal=causal, sm_scale=sm_scale)


# --- benchmark (GPU): `python -m utils.flash_decoding --out DIR` writes decoding_h200.json and its plots --------

def decoding_methods() -> dict:
    """{name: fn(q, k, v)} compared at decode time: this kernel (auto splits and one split), notebook 05's
    kernel if present, and SDPA with each backend pinned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        return run

    methods = {"flash_decode": lambda q, k, v: flash_decode(q, k, v),
               "flash_decode, 1 split": lambda q, k, v: flash_decode(q, k, v, num_splits=1)}
    try:
        from utils.flash_triton import flash_attention
        methods["notebook 05 kernel"] = lambda q, k, v: flash_attention(q, k, v)
    except ImportError:
        pass
    methods.update({"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
                    "SDPA efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)})
    return methods


def benchmark_decoding(batches, seqlens, *, heads=16, kv_heads=16, head_dim=128, new_tokens=1,
                       dtype=torch.bfloat16, methods=None, splits=None) -> list[dict]:
    """Time each method on q (B, heads, new_tokens, D) against a cache (B, kv_heads, N, D) on the GPU.

    One row per (batch, seqlen, method): ms, TFLOP/s and GB/s (bytes of K, V, q and o over the time: decoding
    reads the whole cache once, so bandwidth is its roofline), and the error against the fp32 SDPA.
    `splits`: also time flash_decode with each of these num_splits (method "flash_decode, S splits").
    """
    from utils.bench import attention_flops, benchmark, tflops

    methods = dict(decoding_methods() if methods is None else methods)  # {} means: only the split sweep
    for s in splits or ():
        methods[f"flash_decode, {s} splits"] = lambda q, k, v, s=s: flash_decode(q, k, v, num_splits=s)
    rows = []
    for n in seqlens:
        for b in batches:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, heads, new_tokens, head_dim, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(b, kv_heads, n, head_dim, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(b, kv_heads, n, head_dim, device="cuda", dtype=dtype, generator=gen)
            # fp32 reference one sequence at a time: an fp32 copy of a 64 × 128k cache would not fit
            ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), enable_gqa=kv_heads != heads)
                for i in range(b)])
            nbytes = (2 * k.numel() + 2 * q.numel()) * k.element_size()
            flops = attention_flops(b, heads, new_tokens, n, head_dim)
            for name, fn in methods.items():
                row = dict(method=name, batch=b, seqlen_k=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           new_tokens=new_tokens, dtype=str(dtype).removeprefix("torch."))
                try:
                    err = float((fn(q, k, v).float() - ref).abs().max())
                    ms = benchmark(fn, q, k, v)
                except Exception as exc:  # a backend that does not take this shape (or OOM): recorded
                    torch.cuda.empty_cache()
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    rows.append(row)
                    continue
                programs = b * kv_heads * cdiv(heads // kv_heads * new_tokens, 64)
                rows.append(dict(row, ms=ms, tflops=tflops(flops, ms), gbps=nbytes / ms / 1e6, max_abs_err=err,
                                 auto_splits=choose_num_splits(programs, n, 64, default_num_sms("cuda"))))
            del q, k, v, ref
            torch.cuda.empty_cache()
    return rows


def plot_decoding_benchmark(rows, *, title="", peak_gbps=None):
    """One panel per batch size: achieved bandwidth (TB/s) against the KV length, one line per method."""
    import matplotlib.pyplot as plt

    from utils.plotting import use_course_style

    use_course_style()
    rows = [r for r in rows if "ms" in r]
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.6), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        for m in methods:
            pts = sorted((r["seqlen_k"], r["gbps"] / 1e3) for r in rows if r["batch"] == b and r["method"] == m)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, linestyle="--" if "1 split" in m else "-")
        if peak_gbps:
            ax.axhline(peak_gbps / 1e3, color="k", linewidth=1, linestyle=":", label="HBM peak")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("KV cache length")
    axes[0][0].set_ylabel("K/V read bandwidth (TB/s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # one legend beside the panels: inside one it would hide the lines it names
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return fig


def save_decoding_plots(result: dict, folder, tag: str) -> list:
    """decoding_mha_<tag>.png and decoding_gqa_<tag>.png from a benchmark result (the JSON `_main` writes)."""
    from pathlib import Path

    paths = []
    for key, label in (("mha", "16 heads"), ("gqa", "16 query heads, 2 KV heads")):
        fig = plot_decoding_benchmark(result[key], peak_gbps=result.get("peak_gbps"),
                                      title=f"Decoding one token, {label}, D=128, bf16 — {result['device']}")
        paths.append(Path(folder) / f"decoding_{key}_{tag}.png")
        fig.savefig(paths[-1], bbox_inches="tight")
    return paths


# --- launch floor (GPU): `python -m utils.flash_decoding --launch-floor --out images` ---------------------------

LAUNCH_FLOOR_COMMAND = "python -m utils.flash_decoding --launch-floor --out images"
LAUNCH_FLOOR_SHAPE = dict(batch=1, heads=16, kv_heads=16, seqlen_k=4096, head_dim=128)


def launch_floor_path(folder, tag: str = "h200"):
    """Where the launch-floor measurement of a GPU tagged `tag` is kept: <folder>/decoding_launch_floor_<tag>.json."""
    from pathlib import Path

    return Path(folder) / f"decoding_launch_floor_{tag}.json"


def wall_time_us(fn, *, iters: int = 200, warmup: int = 20) -> float:
    """Microseconds per call of `fn()` called back to back, as the host sees it (synchronised at both ends).

    For a tiny problem this is the floor of a decoding step: the GPU finishes each kernel before the CPU has
    launched the next one, so the time is the launch path's, not the kernel's."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def launch_floor_methods(q, k, v) -> dict:
    """{name: fn()} for one decode step on (q, k, v): flash_decode through its Python entry point, the same call
    captured once in a CUDA graph and replayed, and SDPA with the flash and cuDNN backends pinned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        return run

    step = functools.partial(flash_decode, q, k, v)
    side = torch.cuda.Stream()  # warm up (compile, allocate) outside the capture, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return {"flash_decode (Python launch)": step, "flash_decode (CUDA graph replay)": graph.replay,
            "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}


def launch_floor_env(command: str = LAUNCH_FLOOR_COMMAND) -> dict:
    """The environment a launch-floor measurement was taken in: GPU, versions, date and command."""
    from utils import gpu

    return gpu.environment(command)


def measure_launch_floor(*, methods=None, timer=wall_time_us, shape=None, dtype=torch.bfloat16,
                         command: str = LAUNCH_FLOOR_COMMAND) -> dict:
    """Time one decode step of a tiny problem (`LAUNCH_FLOOR_SHAPE`: a 4k cache at batch 1) each way of
    `launch_floor_methods`. Returns {"environment", "shape", "rows": [{"method", "us"} or {"method", "error"}]}.

    `methods` ({name: fn()}) and `timer` (fn -> µs) replace the GPU parts, e.g. in a test on the CPU."""
    shape = dict(LAUNCH_FLOOR_SHAPE if shape is None else shape)
    if methods is None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(shape["batch"], shape["heads"], 1, shape["head_dim"], device="cuda", dtype=dtype,
                        generator=gen)
        k, v = (torch.randn(shape["batch"], shape["kv_heads"], shape["seqlen_k"], shape["head_dim"], device="cuda",
                            dtype=dtype, generator=gen) for _ in range(2))
        methods = launch_floor_methods(q, k, v)
    rows = []
    for name, fn in methods.items():
        try:
            rows.append({"method": name, "us": float(timer(fn))})
        except Exception as exc:  # a backend that does not take this shape: recorded, not fatal
            rows.append({"method": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
    shape["dtype"] = str(dtype).removeprefix("torch.")
    return {"environment": launch_floor_env(command), "shape": shape, "rows": rows}


def write_launch_floor(folder, tag: str = "h200", **kwargs):
    """Measure the launch floor (`measure_launch_floor(**kwargs)`) and write it as JSON; returns the path."""
    import json

    result = measure_launch_floor(**kwargs)
    path = launch_floor_path(folder, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


# The tile sweep behind GPU_CONFIG: four decode shapes (batch, heads, kv_heads, cache length), every tile.
SWEEP_SHAPES = ((1, 16, 16, 32768), (4, 16, 16, 131072), (16, 16, 2, 65536), (64, 16, 16, 16384))
SWEEP_TILES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def tile_sweep(shapes=SWEEP_SHAPES, tiles=SWEEP_TILES, *, head_dim=128, dtype=torch.bfloat16) -> dict:
    """Time flash_decode (automatic splits) with each (keys per tile, warps, stages) on each shape. Returns
    {"rows": [{shape, bn, w, st, ms, gbps, err}], "best": the tile with the best geometric mean of GB/s}."""
    import math

    from utils.bench import benchmark

    rows = []
    for b, h, hk, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, 1, head_dim, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hk, n, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(), enable_gqa=hk != h) for i in range(b)])
        nbytes = (2 * k.numel() + 2 * q.numel()) * k.element_size()
        for bn, w, st in tiles:
            fn = functools.partial(flash_decode, _block_n=bn, _num_warps=w, _num_stages=st)
            err = (fn(q, k, v).float() - ref).abs().max().item()
            ms = benchmark(fn, q, k, v)
            rows.append(dict(shape=[b, h, hk, n], bn=bn, w=w, st=st, ms=ms, gbps=nbytes / ms / 1e6, err=err))
    score = {t: math.prod(r["gbps"] for r in rows if (r["bn"], r["w"], r["st"]) == t) for t in tiles}
    return {"rows": rows, "best": list(max(score, key=score.get))}


def _main(argv=None):
    import argparse
    import json
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Benchmark flash-decoding on a CUDA GPU")
    parser.add_argument("--out", default="images", help="folder for decoding_<gpu>.json and the plots")
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--launch-floor", action="store_true",
                        help="only measure the decode-step latency floor (decoding_launch_floor_<tag>.json)")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="only time every tile of SWEEP_TILES on SWEEP_SHAPES (decoding_sweep_<tag>.json)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tile_sweep:
        from utils import gpu

        command = "python -m utils.flash_decoding " + " ".join(sys.argv[1:] if argv is None else argv)
        result = {"environment": gpu.environment(command), **tile_sweep()}
        (out / f"decoding_sweep_{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
        print("best (keys per tile, warps, stages):", result["best"])
        return
    if args.launch_floor:
        command = "python -m utils.flash_decoding " + " ".join(sys.argv[1:] if argv is None else argv)
        path = write_launch_floor(out, args.tag, command=command)
        for r in json.loads(path.read_text())["rows"]:
            print(f"{r['method']:34s} " + (f"{r['us']:8.1f} µs" if "us" in r else r["error"]))
        print("wrote", path)
        return
    device = torch.cuda.get_device_name()
    peak = 4800.0 if "H200" in device else None  # GB/s, NVIDIA's H200 datasheet (HBM3e)
    batches, seqlens = (1, 4, 16, 64), (4096, 16384, 65536, 131072)
    from utils import gpu

    command = "python -m utils.flash_decoding " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"environment": gpu.environment(command), "device": device, "torch": torch.__version__,
              "triton": triton.__version__, "peak_gbps": peak}
    runs = {"mha": lambda: benchmark_decoding(batches, seqlens, heads=16, kv_heads=16),
            "gqa": lambda: benchmark_decoding(batches, seqlens, heads=16, kv_heads=2),
            "splits": lambda: benchmark_decoding((1,), (32768,), heads=16, kv_heads=16, methods={},
                                                 splits=(1, 2, 4, 8, 16, 32, 64, 128))}
    for key, run in runs.items():
        result[key] = run()
        (out / f"decoding_{args.tag}.json").write_text(json.dumps(result, indent=1))  # kept if a later one fails
    for key in ("mha", "gqa", "splits"):
        for r in result[key]:
            line = f"{r['ms']:8.3f} ms {r['gbps']:7.0f} GB/s {r['tflops']:6.2f} TFLOP/s err {r['max_abs_err']:.1e}" \
                if "ms" in r else r["error"]
            print(f"{key:6s} B={r['batch']:3d} N={r['seqlen_k']:6d} {r['method']:24s} {line}")
    print("wrote", *save_decoding_plots(result, out, args.tag))


if __name__ == "__main__":
    _main()
