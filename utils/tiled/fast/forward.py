"""FlashAttention-2 forward in Triton, tuned (notebook 05b): the registry's "triton" forward. One kernel that runs
compiled on a GPU and, through the Triton interpreter, on a CPU.

`flash_attention_forward(q, k, v, *, causal=False, sm_scale=None)` follows the course conventions
(utils.eager.reference): `(batch, heads, seq, head_dim)` tensors, K/V with fewer heads than Q (GQA/MQA, read in place,
never copied), any strides, any sequence lengths >= 1 with Nq != Nk allowed, causal masking aligned bottom-right
(query i sees keys j <= i + Nk - Nq) and a zero output for a query that sees no key. Head dims 16 to 256; a head
dim that is not a power of two (80, 96) is padded to the next one with masks.

Dtypes: fp16, bf16 and fp32 on a GPU (16-bit inputs go through the tensor cores with an fp32 accumulator; fp32
inputs use exact fp32 dots, `input_precision="ieee"`, because TF32 rounding of Q·Kᵀ moves large logits by whole
units). On a CPU the interpreter runs fp32 and fp16; it has no bf16 arithmetic (NumPy has no bfloat16), so bf16
inputs on a CPU are computed in fp32 and the output is returned in bf16.

Beyond notebook 05's kernel (utils.tiled.forward): per shape class an autotuner picks the tiles and whether Q,
K, V and O move through TMA tensor descriptors made once by the host (TMA=2, Hopper) or through pointers
(TMA=0); launches skip Triton's dispatch (utils.tiled.fast.launch.FastLauncher); and a call of a kind seen before (same
shapes, strides, dtypes, alignment and options) skips the checks and choices (utils.tiled.fast.launch.kind_of). The
experiments notebook 05b measured and did not keep live in utils.course.worklogs.triton_forward.

`flash_attention_forward` returns (o, lse) with the natural-log log-sum-exp, fp32, shape (batch, heads,
seqlen_q), -inf where a query sees no key. The differentiable entry (the registry's "triton"),
`utils.tiled.fast.backward.flash_attention`, runs this forward and notebook 07's backward; it lives with the
backward so that this module never imports it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from utils import gpu
from utils.tiled.fast import launch
from utils.checks import check_attention_inputs, resolve_scale
from utils.tiled.fast.launch import FastLauncher
from utils.tiled.forward import Config
from utils.tiled.forward import candidate_tiles as tiled_candidate_tiles
from utils.triton_utils import cdiv

HEAD_DIMS = tuple(range(16, 257))           # any head dim from 16 to 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634                  # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453                    # ln(2): back from base 2 to natural logs for the lse


@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, lo, hi,
                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale, b, h_kv,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Online softmax of the Q block against the key blocks [lo, hi). MASKED=False: every key of every block is
    visible to every query of the Q block, so no score is masked (the loop body is pure matmul + softmax).
    TMA=2: k_ptrs and v_ptrs are tensor descriptors made by the host, one per (B, H, N, D) tensor, indexed by
    batch b and K/V head h_kv; rows past seqlen_k read as zeros."""
    if not TMA:
        k_ptrs += lo * stride_kn
        v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if TMA == 2:  # the copy engine fetches the whole tile; no addresses, no masks in the warps
            k = k_ptrs.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_ptrs.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED:  # the last, ragged key block (and, when causal, the blocks crossing the diagonal)
            kv_mask = cols[:, None] < seqlen_k
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)          # (BLOCK_M, BLOCK_N), fp32
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(keep, qk, float("-inf"))
        acc, l_i, m_i = _online_softmax(qk, v, acc, l_i, m_i, qk_scale, MASKED, DOT_PRECISION)
        if not TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _online_softmax(qk, v, acc, l_i, m_i, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores `qk` (fp32, unscaled) and its values `v` into the running maximum m_i, sum l_i
    and unnormalised output acc; returns the new (acc, l_i, m_i)."""
    # Running maximum in base-2 units: qk_scale = sm_scale * log2(e), so exp2 below is the softmax's exp.
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:  # a row that has seen no key yet keeps m = -inf; subtract 0 there instead (-inf - -inf = nan)
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    else:
        m_sub = m_ij
    p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)                                    # rescales what came before
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_ij


# Sequence lengths and head counts change from call to call: specializing on them (Triton otherwise compiles a
# variant per "divisible by 16" / "equal to 1") would only multiply compilations.
@triton.jit(do_not_specialize=["heads", "group", "seqlen_q", "seqlen_k", "seqlen_bucket"])
def flash_fwd_kernel(Q, K, V, O, LSE, QD, KD, VD, OD,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ob, stride_oh, stride_om, stride_od,
                     heads, group, seqlen_q, seqlen_k, qk_scale, seqlen_bucket,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     TMA: tl.constexpr = 0):
    """One program: BLOCK_M queries of one (batch, head) against all the keys they may see.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Query head h reads K/V head h // group (GQA without copies).
    `seqlen_bucket` is not read: it is part of the autotuner's key (sequence lengths rounded to a power of two).
    TMA=2: Q, K, V and O move through Hopper's TMA copy engine, by the tensor descriptors QD, KD, VD, OD that
    the host made over the whole (B, H, N, D) tensors; TMA=0: through pointers (the descriptors are None).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    h_kv = h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # 64-bit (batch, head) offsets: large batches times heads times seq times dims overflow 32 bits.
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    if TMA == 2:  # whole tensors, indexed [batch, head, row, 0]; rows past a head's last read as zeros
        k_ptrs, v_ptrs = KD, VD
        q = QD.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        q_mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Split the keys in two ranges: [0, n_full) every query of this block sees (whole blocks, no masking),
    # [n_full, n_end) needs masks (the ragged last block; when causal, the blocks crossing the diagonal).
    causal_offset = seqlen_k - seqlen_q          # bottom-right alignment: query i sees keys j <= i + offset
    if CAUSAL:
        n_full = tl.maximum(start_m + causal_offset + 1, 0)          # keys the *first* query of the block sees
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_offset, 0), seqlen_k)  # ... the last one sees
    else:
        n_full = seqlen_k
        n_end = seqlen_k
    n_full = (n_full // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, 0, n_full,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale, b, h_kv,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, DOT_PRECISION, TMA)
    acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, n_full, n_end,
                                   stride_kn, stride_vn, seqlen_k, causal_offset, qk_scale, b, h_kv,
                                   HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, DOT_PRECISION, TMA)

    # Rows that saw no key (causal with Nq > Nk) have l = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    if TMA == 2:
        OD.store([b, h, start_m, 0], acc.to(O.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc.to(O.dtype.element_ty),
                 mask=o_mask)


def launch_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> Config:
    """Block sizes, warps and pipeline stages for one launch on `device` when nothing is tuned: `pick_config` for
    the GPU's shared memory (utils.gpu, which a T4 profile can emulate). In the interpreter the blocks only trade
    Python overhead against wasted padding, so they are small.
    """
    if device.type != "cuda":
        return Config(32, 32, 4, 1)
    return pick_config(head_dim, dtype, gpu.shared_memory_per_block(device))


def pick_config(head_dim: int, dtype: torch.dtype, smem: int | None = None) -> Config:
    """The tiles for a head dim and dtype that fit `smem` bytes of shared memory per block (None: an H200's
    choice), as utils.tiled.forward.pick_config. utils.course.cross_compile checks a T4's by compiling."""
    if smem is not None and (isinstance(smem, bool) or not isinstance(smem, int)):
        raise TypeError(f"smem must be an int or None, got {type(smem).__name__}")
    return _fitted_config(head_dim, dtype, smem)


@functools.lru_cache(maxsize=None)  # asked at every launch
def _fitted_config(head_dim: int, dtype: torch.dtype, smem: int | None) -> Config:
    tried = [c for c in tiled_candidate_tiles(head_dim, dtype, smem) if (smem, c) not in _TOO_BIG]
    return tried[0] if tried else tiled_candidate_tiles(head_dim, dtype, smem)[-1]


# (shared memory per block, Config): fixed tiles whose compiled kernel Triton refused on such a GPU (as
# utils.tiled.forward.first_that_launches says, smem_estimate can miss Triton's buffers); never picked again.
_TOO_BIG: set[tuple[int, Config]] = set()


def _drop_if_too_big(config: Config, head_dim: int, dtype: torch.dtype, smem: int | None) -> bool:
    """Remember `config` as too big for GPUs of `smem` bytes per block; False when no other tiles are left."""
    if smem is None or (smem, config) in _TOO_BIG:
        return False
    _TOO_BIG.add((smem, config))
    _fitted_config.cache_clear()
    return any((smem, c) not in _TOO_BIG for c in tiled_candidate_tiles(head_dim, dtype, smem))


class Steps(NamedTuple):
    """What a launch may use beyond notebook 05's kernel; `Steps.fastest(...)` turns on what applies to the inputs."""
    autotune: bool = False      # tiles, warps and stages measured per shape class (16-bit, D <= 128, sm_80+)
    tma: bool = False           # host descriptors (TMA=2, Hopper); with autotune: allowed, the tuner decides

    @staticmethod
    def fastest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "Steps":
        if max(q.shape[2], k.shape[2]) < TUNE_MIN_SEQLEN:  # launch-bound: fixed tiles, pointer loads
            return Steps()
        return Steps(autotune=tunable(q), tma=tma_supported(q, k, v))

    @property
    def tma_mode(self) -> int:
        """The kernel's TMA switch: 0 pointer loads, 2 descriptors made by the host."""
        return 2 if self.tma else 0


def tunable(q) -> bool:
    """Whether the autotuner may run: 16-bit inputs, head dim <= 128, an sm_80+ GPU (it times on the GPU)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128
            and gpu.capability(q) >= (8, 0))


def tma_supported(q, k, v) -> bool:
    """Tensor descriptors need Hopper or newer, 16-bit data, a power-of-two head dim with unit stride, and
    16-byte aligned base addresses and row strides (the TMA unit's rules)."""
    if not (q.is_cuda and gpu.capability(q) >= (9, 0)):
        return False
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and d == triton.next_power_of_2(d)
            and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                    and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in (q, k, v)))


def host_descriptors(q, k, v, o, block_m: int, block_n: int) -> tuple:
    """One TMA descriptor per (B, H, N, D) tensor, made once per call by the host; the kernel indexes a tile as
    [batch, head, first row, 0]. Tiles past a head's last row read as zeros."""
    d = q.shape[-1]
    return tuple(TensorDescriptor.from_tensor(t, [1, 1, rows, d])
                  for t, rows in ((q, block_m), (k, block_n), (v, block_n), (o, block_m)))


def _fit_descriptors(nargs: dict) -> None:
    """The pre-hook of the TMA=2 configs: the host descriptors' tile shapes follow the config about to run."""
    for name, rows in (("QD", "BLOCK_M"), ("KD", "BLOCK_N"), ("VD", "BLOCK_N"), ("OD", "BLOCK_M")):
        nargs[name].block_shape = [1, 1, nargs[rows], nargs["BLOCK_D"]]


# The autotuner's search: kept small (each config costs a compile), measured once per shape class (head dim,
# causal, dtype, sequence-length bucket) and cached on disk (Triton's cache directory), so only the first run of
# a shape class waits. Where TMA is allowed each tile is tried with and without it, since neither wins on every
# shape (notebook 05b). A config that does not fit a GPU's shared memory is skipped by the autotuner.
TUNE_TILES = [Config(*c) for c in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3))]
TUNE_CONFIGS = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                              num_stages=c.num_stages) for c in TUNE_TILES]
TUNE_MIN_SEQLEN = 2048      # shorter problems are bound by launch overhead, not tiles: fixed tiles, no TMA
_progress = None
_progress_total = len(TUNE_CONFIGS)  # configs in the tuning under way
_progress_left = 0          # configs of that tuning still to time
_tuned_configs: dict = {}   # (device, dtype, head dim, causal, TMA allowed, bucket) -> (Config, TMA)


def _time_with_progress(kernel_call, quantiles):
    """The autotuner's timer: triton.testing.do_bench, with a progress bar over the configs of one tuning."""
    global _progress, _progress_left
    if _progress is None:
        from tqdm.auto import tqdm
        _progress = tqdm(total=_progress_total, leave=False,
                         desc="tuning flash_fwd_kernel (once per shape class, then cached on disk)")
        _progress_left = _progress_total   # counted here: a disabled bar (TQDM_DISABLE=1) does not count
    try:
        return triton.testing.do_bench(kernel_call, quantiles=quantiles, warmup=5, rep=25)
    finally:
        _progress.update()
        _progress_left -= 1
        if _progress_left <= 0:
            _progress.close()
            _progress = None


def _autotuner(tma_mode: int):
    """The tuner for one TMA mode: each tile of TUNE_CONFIGS with pointer loads and, when mode > 0, with TMA."""
    configs = [triton.Config({**c.kwargs, "TMA": tma}, num_warps=c.num_warps, num_stages=c.num_stages,
                             pre_hook=_fit_descriptors if tma == 2 else None)
               for c in TUNE_CONFIGS for tma in dict.fromkeys((0, tma_mode))]
    return triton.autotune(configs, key=["HEAD_DIM", "CAUSAL", "seqlen_bucket"], do_bench=_time_with_progress,
                           cache_results=True)(flash_fwd_kernel)


_tuners = {mode: _autotuner(mode) for mode in (0, 2)}  # keyed by Steps.tma_mode: which TMA the configs may use
_fwd_launcher = FastLauncher(flash_fwd_kernel)  # launches without Triton's per-call dispatch (utils.tiled.fast.launch)


def _launch(q, k, v, causal, scale, config: Config | None = None, steps: Steps | None = None,
            kind: launch.Kind | None = None):
    """Run the kernel on validated inputs; returns (o, lse). `config` fixes the block sizes (tests); `steps`
    what the launch may use (default: `Steps.fastest`); `kind` (flash_attention's calls, neither given) keeps the
    launch bound once a call of its kind has made it."""
    b, h, nq, d = q.shape
    o = torch.empty(b, h, nq, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, nq, device=q.device, dtype=torch.float32)
    if kind is not None and kind.ready():   # seen before: only this call's tensors (and descriptors) are new
        descs = kind.descriptors((q, k, v, o), lambda: _descriptors(q, k, v, o, kind.choices.tiles))
        kind.run([(q, k, v, o, lse, *descs)])
        return o, lse
    hk, nk = k.shape[1], k.shape[2]
    steps = steps or Steps.fastest(q, k, v)
    mode = steps.tma_mode
    block_d = max(16, triton.next_power_of_2(d))
    scalars = (*q.stride(), *k.stride(), *v.stride(), *o.stride(), h, h // hk, nq, nk, scale * LOG2E)
    switches = dict(HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32
                    else "tf32", TMA=mode)
    if config is None and steps.autotune:
        bucket = min(triton.next_power_of_2(max(nq, nk)), 8192)
        key = (q.device, q.dtype, d, causal, mode, bucket)
        if key not in _tuned_configs:  # the first call of a shape class: time the configs (or read the disk cache)
            global _progress_total
            tuner = _tuners[mode]
            _progress_total = len(tuner.configs)
            grid = lambda meta: (cdiv(nq, meta["BLOCK_M"]), b * h)  # noqa: E731 (the autotuner's grid)
            descs = host_descriptors(q, k, v, o, 16, 16) if mode == 2 else (None,) * 4  # tiles: set per config
            tuner[grid](q, k, v, o, lse, *descs, *scalars, **{k: v for k, v in switches.items() if k != "TMA"},
                        seqlen_bucket=bucket)
            best = tuner.best_config
            _tuned_configs[key] = (Config(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps,
                                          best.num_stages), best.kwargs["TMA"])
            return o, lse
        # Later calls launch directly, without the autotuner's own Python.
        config, switches["TMA"] = _tuned_configs[key]
    fixed = config is None   # the GPU's fixed tiles, not a caller's or the tuner's
    config = config or launch_config(d, q.dtype, q.device)
    tiles = (config.block_m, config.block_n) if switches["TMA"] == 2 else None
    head = (q, k, v, o, lse, *_descriptors(q, k, v, o, tiles))
    grid = (cdiv(nq, config.block_m), b * h)
    meta = dict(**switches, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
                num_stages=config.num_stages)
    try:
        if kind is None:
            _fwd_launcher[grid](*head, *scalars, 0, **meta)
        else:
            kind.choices = kind.choices._replace(tiles=tiles)
            kind.launch([head], lambda: [(_fwd_launcher, grid, (*scalars, 0), meta)], keep=True)
    except OutOfResources:   # the estimate fit, Triton's compiled kernel does not: the next tiles
        if not (fixed and _drop_if_too_big(config, d, q.dtype, gpu.shared_memory_per_block(q.device))):
            raise
        return _launch(q, k, v, causal, scale, None, steps, kind)
    return o, lse


def _descriptors(q, k, v, o, tiles: tuple | None) -> tuple:
    """The kernel's four descriptor arguments: host descriptors of (block_m, block_n) tiles, or four Nones."""
    return (None,) * 4 if tiles is None else host_descriptors(q, k, v, o, *tiles)


def check_inputs(q, k, v, causal, sm_scale):
    shape = check_attention_inputs(q, k, v, causal=causal, dtypes=DTYPES)
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {shape.head_dim} is not supported by the Triton kernel; supported: "
                         f"{HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    if q.device.type == "cpu" and not triton_interpreting():
        raise ValueError("q is on the CPU but TRITON_INTERPRET is not 1: run utils.course.bootstrap.setup() (or set "
                         "TRITON_INTERPRET=1) before importing the course's Triton kernels, or move the tensors to a GPU")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on {q.device}; the Triton kernel runs on CUDA devices or, interpreted, on the CPU")
    return shape, resolve_scale(sm_scale, shape.head_dim)


class Choices(NamedTuple):
    """What a kind of call keeps: the scale its checks resolved and, once launched, its host descriptors' tiles
    (None: the kernel takes no host descriptors)."""
    scale: float
    tiles: tuple | None = None


_KINDS = launch.kind_cache()   # _call_key -> launch.Kind of Choices: the launch.MAX_KINDS used most recently


def _call_key(q, k, v, causal, sm_scale):
    """Everything the checks and the launch depend on (utils.tiled.fast.launch.kind_key), for CUDA tensors and options of the
    expected types; None otherwise (such a call is checked every time)."""
    if not (type(causal) is bool and type(sm_scale) in (float, int, type(None))):
        return None
    return launch.kind_key((q, k, v), (causal, sm_scale))


def _kind(q, k, v, causal, sm_scale) -> launch.Kind:
    """The kind of this call: `check_inputs` runs on its first call (a ValueError or TypeError naming the argument);
    later calls of a kind (same shapes, strides, dtypes, device, alignment and options) skip the checks and
    the choices, and launch the kernel bound by the first (notebook 05b, section 7)."""
    return launch.kind_of(_KINDS, _call_key(q, k, v, causal, sm_scale),
                          lambda: Choices(check_inputs(q, k, v, causal, sm_scale)[1]))


def triton_interpreting() -> bool:
    """Whether this module's kernels were defined for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction  # not imported by `import triton` on a GPU

    return isinstance(flash_fwd_kernel, InterpretedFunction)


def flash_attention_forward(q, k, v, *, causal=False, sm_scale=None):
    """(o, lse) without autograd. lse: natural-log log-sum-exp of the scaled scores, fp32, (batch, heads,
    seqlen_q), -inf for a query that sees no key. bf16 on a CPU is computed in fp32 (see the module doc)."""
    return _forward(q, k, v, causal, _kind(q, k, v, causal, sm_scale))


def _forward(q, k, v, causal, kind):
    """flash_attention_forward on checked inputs (`kind`: their kind of call)."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:  # the interpreter has no bf16 arithmetic
        o, lse = _launch(q.float(), k.float(), v.float(), causal, kind.choices.scale)
        return o.to(torch.bfloat16), lse
    return _launch(q, k, v, causal, kind.choices.scale, kind=kind)
