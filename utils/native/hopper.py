"""Hopper's tensor-core operands, modelled in Python (notebook 06c), and the wgmma kernels' entry points.

wgmma reads its operands from shared memory through a 64-bit *descriptor* (where the tile starts, how far apart
its 8-row groups are, how it is swizzled). The functions here compute the same descriptor and the same swizzled
byte positions as utils/native/src/hopper.cuh, so a learner can inspect them on any machine (tests compare the two),
and draw a swizzled tile to see why consecutive rows stop colliding in the same shared-memory banks.

- `swizzle(offset, mode)`: where byte `offset` of a tile lands under 0, 32, 64 or 128-byte swizzling.
- `smem_descriptor(...)` / `decode_descriptor(d)`: the descriptor's bit fields, packed and unpacked.
- `chunk_layout(rows, row_bytes, mode)`: for each 16-byte chunk of a tile, the chunk slot it occupies.
- `bank_conflicts(...)`: how many 16-byte accesses of one column of chunks share a bank group.
- `wgmma_gemm(a, b)`: a @ b.T in fp32 on an H100/H200 (utils/native/src/wgmma_gemm.cu), validated first.
- `flash_hopper(q, k, v)`: the attention forward of notebook 06c (steps 1-3) and its worklog 06cw, any step.
- `default_step(head_dim)`: the step `flash_hopper` runs when given none (DEFAULT_STEPS).
- `flash_hopper_forward(q, k, v)` -> (o, lse): the same, with the log-sum-exp its backward needs
  (utils.native.hopper_backward).
- `block_timeline(q, k, v)`: where each block of one launch spends its time, read from the GPU's clock inside
  the kernel; `timeline_summary` reduces it to medians per phase.
"""
from __future__ import annotations

import torch

from utils.checks import CUDA_GRID_Y, check_int

# Swizzle width in bytes -> the mode bits (62-63) of a wgmma descriptor.
SWIZZLE_MODES = {0: 0, 128: 1, 64: 2, 32: 3}
# Which address bits 7-9 each mode XORs into the 16-byte chunk index (bits 4-6).
_SWIZZLE_MASKS = {0: 0, 32: 1, 64: 3, 128: 7}
GEMM_TILE = 64
# Notebook 06c's GEMM in two steps: step 1 copies the tiles with the threads, step 2 with TMA.
GEMM_STEPS = ("threads", "tma")
# ... and for attention: step 1 loads and multiplies in turn, step 2 copies the next K/V tile during this one,
# step 3 hands the copies to a producer warpgroup and the math to two consumer warpgroups; then FlashAttention-3's
# refinements: a leaner softmax, a deeper K/V ring, the softmax under the previous tile's P V, consumers in turns,
# (causal) the longest rows launched first, tiles of 128 keys; and (step 6 again) V read as it is stored, then at
# D = 64 a third consumer warpgroup; persistent blocks, one per SM, that take query blocks from a counter; and
# (step 11 again, causal) the longest query blocks of a group of heads launched first, not one head after another,
# then each consumer stopping at its own diagonal; and (step 11 again) O stored through shared memory by TMA; and
# (step 10 again) tiles of 128 keys without the consumers' turns, which "wide_tiles" was measured with; and (step
# 15 again) K and V each counted on a barrier of its own, so that S waits for K alone; and (step 15 again) tiles of
# 128 keys on its three consumers at D = 64, then with a third stage; and (step 15 again, causal) the longest
# query blocks launched first; and (step 19 again) P in one set of registers, packed once the previous P V is done,
# then the consumers in turns, a ring of three at D = 64; and (step 21 again, causal) each consumer stopping at its
# own diagonal, then the longest query blocks launched first; and (step 21 again) persistent blocks at D = 64,
# then taking their work in step 13's order of head groups; and (steps 21 and 19 again) the warpgroup index read
# from lane 0, so that ptxas keeps the causal main loop in the uniform datapath; then O rescaled only when a
# row's maximum grew by more than 2^8; and (steps 29 and 28 again) a row's tile maximum and sum in four chains;
# and (steps 29 and 30 again) each operand's wgmma descriptor built once a tile, a slice's by one addition; and
# (step 33 again, causal) each consumer stopping at its own diagonal, then the longest query blocks launched first;
# then waits that let the hardware suspend a waiting thread.
ATTENTION_STEPS = ("tma", "pipelined", "specialised", "softmax", "stages", "overlap", "pingpong", "heavy_first",
                   "wide_tiles", "v_direct", "three_consumers", "persistent", "head_groups", "own_diagonal",
                   "tma_store", "wide_v_direct", "split_full", "wide_tma_store",
                   "wide_stages", "tma_heavy_first", "one_p", "one_p_turns", "one_p_diagonal",
                   "one_p_heavy_first", "one_p_persistent",
                   "one_p_head_groups", "one_p_uniform", "wide_uniform", "one_p_lazy", "wide_lazy", "one_p_tree",
                   "wide_tree", "one_p_desc", "wide_desc", "desc_diagonal", "desc_heavy_first", "wait_suspend")
# Not every step paid, and not at both head dims: the default at each head dim (the registry's "cuda_hopper") is the
# fastest step measured there on the H200 (images/06c_*_h200.json; tests/test_bench_cuda_mma.py checks them).
DEFAULT_STEPS = {64: "desc_heavy_first", 128: "wide_desc"}
# The steps whose blocks form one line (gridDim.x), and at which head dims: persistent blocks, or blocks started in
# head-group order (the steps table's persistent<D>() or kHeadGroups; tests/test_hopper.py holds this to it). The
# others launch a row of blocks per (batch, head), on gridDim.y.
ONE_LINE_STEPS = {"persistent": (64, 128), "head_groups": (64, 128), "own_diagonal": (64, 128),
                  "one_p_persistent": (64,), "one_p_head_groups": (64, 128)}


def pick_by_head_dim(table: dict, head_dim) -> str:
    """table[head_dim] for a table keyed by the head dims a kernel takes, or a ValueError naming head_dim."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in table:
        raise ValueError(f"head_dim must be one of {sorted(table)}, got {head_dim!r}")
    return table[head_dim]


def default_step(head_dim: int) -> str:
    """The step `flash_hopper` runs at `head_dim` (64 or 128) when given none: the fastest measured there."""
    return pick_by_head_dim(DEFAULT_STEPS, head_dim)


def _check_mode(mode) -> int:
    if mode not in SWIZZLE_MODES or isinstance(mode, bool):
        raise ValueError(f"mode must be one of {sorted(SWIZZLE_MODES)} (bytes), got {mode!r}")
    return mode


def swizzle(offset: int, mode: int = 128) -> int:
    """The byte where byte `offset` of a tile (starting on a 1024-byte boundary) is stored under `mode`."""
    check_int("offset", offset, 0)
    return offset ^ (((offset >> 7) & _SWIZZLE_MASKS[_check_mode(mode)]) << 4)


def smem_descriptor(address: int, *, leading_bytes: int, stride_bytes: int, mode: int = 128) -> int:
    """The 64-bit wgmma descriptor of a shared-memory tile.

    address: the tile's shared-memory byte address (18 bits, a multiple of 16); leading_bytes: distance between
    core matrices along K (unused by K-major swizzled tiles); stride_bytes: distance between groups of 8 rows
    (8 x 128 = 1024 for a K-major tile with 128-byte swizzling). Offsets are stored in 16-byte units.
    """
    for name, value, bits in (("address", address, 18), ("leading_bytes", leading_bytes, 18),
                              ("stride_bytes", stride_bytes, 18)):
        check_int(name, value, 0, (1 << bits) - 1)
        if value % 16:
            raise ValueError(f"{name} must be a multiple of 16 bytes, got {value}")
    return (address >> 4) | (leading_bytes >> 4) << 16 | (stride_bytes >> 4) << 32 | SWIZZLE_MODES[
        _check_mode(mode)] << 62


def decode_descriptor(descriptor: int) -> dict:
    """The fields of a descriptor, in bytes: the inverse of `smem_descriptor`."""
    check_int("descriptor", descriptor, 0, (1 << 64) - 1)
    modes = {bits: width for width, bits in SWIZZLE_MODES.items()}
    return dict(address=(descriptor & 0x3FFF) << 4, leading_bytes=((descriptor >> 16) & 0x3FFF) << 4,
                stride_bytes=((descriptor >> 32) & 0x3FFF) << 4, base_offset=(descriptor >> 49) & 7,
                mode=modes[descriptor >> 62])


def chunk_layout(rows: int = 8, row_bytes: int = 128, mode: int = 128) -> torch.Tensor:
    """(rows, row_bytes // 16) int tensor: the chunk slot within its row that each 16-byte chunk is stored in."""
    check_int("rows", rows, 1)
    check_int("row_bytes", row_bytes, 16)
    if row_bytes % 16:
        raise ValueError(f"row_bytes must be a multiple of 16, got {row_bytes}")
    chunks = row_bytes // 16
    return torch.tensor([[swizzle(r * row_bytes + c * 16, mode) % row_bytes // 16 for c in range(chunks)]
                         for r in range(rows)])


def bank_conflicts(rows: int = 8, row_bytes: int = 128, mode: int = 128, column: int = 0) -> int:
    """How many of `rows` 16-byte reads of one column of chunks (what ldmatrix and wgmma do) fall in the most
    crowded group of 4 banks: 1 means conflict-free, `rows` means all serialised. 32 banks x 4 bytes = 8 groups."""
    check_int("column", column, 0, row_bytes // 16 - 1)
    check_int("rows", rows, 1)
    groups = [swizzle(r * row_bytes + column * 16, _check_mode(mode)) // 16 % 8 for r in range(rows)]
    return max(groups.count(g) for g in set(groups))


def _readable(t: torch.Tensor) -> torch.Tensor:
    """`t` if it is contiguous and starts on 16 bytes (TMA and the 16-byte copies need both), else a copy that is:
    a copy, not .contiguous(), which returns a contiguous view at an odd address unchanged."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def wgmma_gemm(a: torch.Tensor, b: torch.Tensor, *, step: str = GEMM_STEPS[-1]) -> torch.Tensor:
    """a (M, K) @ b (N, K)ᵀ -> (M, N) float32 with one warpgroup's wgmma per 64 x 64 tile (sm_90 GPUs only).

    fp16 or bf16, M, N and K positive multiples of 64; `step` "threads" copies the tiles with the threads,
    "tma" with the tensor memory accelerator. Anywhere but an H100/H200 it raises a RuntimeError that says so,
    before compiling anything."""
    from utils import gpu
    from utils.native import build as native_build

    if step not in GEMM_STEPS:
        raise ValueError(f"step must be one of {GEMM_STEPS}, got {step!r}")

    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have 2 dims (rows, K), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if any(s == 0 or s % GEMM_TILE for s in t.shape):
            raise ValueError(f"{name}'s dims must be positive multiples of {GEMM_TILE}, got {tuple(t.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a is {a.dtype} but b is {b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a has K = {a.shape[1]} but b has K = {b.shape[1]}")
    if a.shape[0] // GEMM_TILE > CUDA_GRID_Y:
        raise ValueError(f"a has {a.shape[0]} rows, more than the kernel takes: it launches a row of blocks per "
                         f"{GEMM_TILE} rows of a, and a grid has at most {CUDA_GRID_Y} rows (gridDim.y); at most "
                         f"{CUDA_GRID_Y * GEMM_TILE} rows")
    if a.device != b.device or a.device.type != "cuda":
        raise ValueError(f"a and b must be on one CUDA device, got {a.device} and {b.device}")
    native_build.check_hopper_capability(gpu.capability(a.device))
    a, b = _readable(a), _readable(b)
    return native_build.load("wgmma_gemm").wgmma_gemm_forward(a, b, GEMM_STEPS.index(step) + 1)


def flash_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, sm_scale=None,
                 step: str | None = None, module=None, timeline: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None):
    """FlashAttention forward with wgmma and TMA (utils/native/src/hopper_attention.cu), on an sm_90 GPU only, as of
    `step` of notebooks 06c and 06cw (ATTENTION_STEPS; None: `default_step(head_dim)`, the fastest).

    fp16 or bf16 (batch, heads, seq, head_dim) tensors, head dims 64 and 128, any lengths, GQA, causal aligned
    bottom-right. Steps before "v_direct" get V transposed (every wgmma operand K-major), its length rounded up
    to 8 so that TMA's row stride is a multiple of 16 bytes; from "v_direct" on, V is read as it is stored.
    `module`: the build of hopper_attention.cu to run (default: the course's; exercise 6c.4 passes one with the
    learner's function inside). `timeline`: block_timeline's buffer (the kernel notes its milestones in it).
    `lse`: fp32 room for each row's log-sum-exp, which the kernel fills (flash_hopper_forward)."""
    from utils import gpu
    from utils.native import build as native_build
    from utils.checks import check_attention_inputs, resolve_scale

    if step is not None and step not in ATTENTION_STEPS:
        raise ValueError(f"step must be one of {ATTENTION_STEPS} or None, got {step!r}")
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None  # checked just below
    shape = check_attention_inputs(q, k, v, causal=causal, head_dims=(64, 128),
                                   dtypes=(torch.float16, torch.bfloat16), runs_on="cuda",
                                   max_batch_heads=None if head_dim in ONE_LINE_STEPS.get(step, ()) else CUDA_GRID_Y)
    step = step or default_step(shape.head_dim)
    scale = resolve_scale(sm_scale, shape.head_dim)
    native_build.check_hopper_capability(gpu.capability(q.device))
    q, k = _readable(q), _readable(k)
    if ATTENTION_STEPS.index(step) >= ATTENTION_STEPS.index("v_direct"):  # the kernel reads V as it is (N-major)
        vt = _readable(v)
    else:
        padded = -(-shape.seqlen_k // 8) * 8
        vt = torch.zeros(shape.batch, shape.kv_heads, shape.head_dim, padded, device=v.device, dtype=v.dtype)
        vt[..., :shape.seqlen_k] = v.transpose(-1, -2)
    module = module if module is not None else native_build.load("hopper_attention")
    if timeline is None:
        timeline = torch.empty(0, dtype=torch.int64, device=q.device)
    if lse is None:
        lse = torch.empty(0, dtype=torch.float32, device=q.device)
    return module.hopper_attention_forward(q, k, vt, shape.seqlen_k, causal, scale, ATTENTION_STEPS.index(step) + 1,
                                           timeline, lse)


def flash_hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, sm_scale=None,
                         step: str | None = None):
    """(o, lse): `flash_hopper`, and the natural-log log-sum-exp of each row's scaled scores, fp32 (batch, heads,
    seqlen_q), -inf for a row that sees no key (the backward's input)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        flash_hopper(q, k, v, causal=causal, sm_scale=sm_scale, step=step)  # its error names the argument
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return flash_hopper(q, k, v, causal=causal, sm_scale=sm_scale, step=step, lse=lse), lse


# A block's milestones, in the order the kernel notes them (kTimelineSlots in hopper_attention_kernel.cuh, less the
# last slot, which holds the SM and the tile count); the phases are the gaps between consecutive milestones. The last is
# the first consumer's store of O issued (or, with a TMA store, read out of shared memory), not O in global memory.
TIMELINE_MARKS = ("start", "Q arrived", "first K/V arrived", "first softmax done", "main loop done",
                  "last P V done", "store of O issued")
TIMELINE_PHASES = ("wait for Q", "wait for K/V", "first tile", "main loop", "last tile", "store O")


def block_timeline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   step: str | None = None) -> dict:
    """Run `flash_hopper` once with the kernel's clock on: per block, its first consumer notes the GPU's global
    nanosecond timer at each of TIMELINE_MARKS. Steps "specialised" (3) on; a persistent block reports its first
    work item. Returns {"sm", "tiles", "start", "end": (blocks,) int64 tensors, start and end in ns from the first
    block's start; "phases": (blocks, 6) ns per TIMELINE_PHASES, 0 where a block had no such phase}, on the CPU."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise TypeError(f"q must be a 4-d torch.Tensor (batch, heads, seq, head_dim), got {type(q).__name__}")
    step = default_step(q.shape[-1]) if step is None else step
    if step not in ATTENTION_STEPS:
        raise ValueError(f"step must be one of {ATTENTION_STEPS} or None, got {step!r}")
    if ATTENTION_STEPS.index(step) < ATTENTION_STEPS.index("specialised"):
        raise ValueError(f"block_timeline needs a warp-specialised step ({ATTENTION_STEPS[2]!r} or later): the "
                         f"first consumer notes the milestones; got {step!r}")
    blocks = -(-q.shape[2] // 64) * q.shape[0] * q.shape[1]  # more than any step launches
    buffer = torch.zeros(blocks, 8, dtype=torch.int64, device=q.device)
    flash_hopper(q, k, v, causal=causal, step=step, timeline=buffer)
    marks = buffer[buffer[:, 0] != 0].cpu()  # the rows a block wrote
    times, last = marks[:, :7], marks[:, 7]
    seen = times.clone()  # a milestone a block never reached (no tiles) takes the one before it
    for i in range(1, 7):
        seen[:, i] = torch.where(times[:, i] == 0, seen[:, i - 1], times[:, i])
    origin = seen[:, 0].min()
    return {"sm": last >> 32, "tiles": last & 0xFFFFFFFF, "start": seen[:, 0] - origin, "end": seen[:, 6] - origin,
            "phases": seen[:, 1:] - seen[:, :-1]}


def timeline_summary(timeline: dict) -> dict:
    """block_timeline's result reduced: the median ns of each phase and of a whole block; the median gap between
    one block's end and the next block's start on the same SM (the launch); and a least-squares fit of a block's
    time against its tile count, ns per tile and fixed ns per block (None without a causal mask, where every block
    has as many tiles)."""
    if not isinstance(timeline, dict) or not {"sm", "tiles", "start", "end", "phases"} <= timeline.keys():
        raise TypeError("timeline must be block_timeline's dict")
    start, end, sm, tiles = (timeline[key].double() for key in ("start", "end", "sm", "tiles"))
    duration = end - start
    gaps = []
    for unit in sm.unique():
        on = sm == unit
        order = start[on].argsort()
        gaps.append(start[on][order][1:] - end[on][order][:-1])
    gaps = torch.cat(gaps)
    per_tile = fixed = None  # no fit where every block has as many tiles (no causal mask)
    if tiles.unique().numel() > 1:
        design = torch.stack([tiles, torch.ones_like(tiles)], dim=1)
        per_tile, fixed = torch.linalg.lstsq(design, duration[:, None]).solution[:, 0].tolist()
    return {"phases_ns": dict(zip(TIMELINE_PHASES, timeline["phases"].double().median(dim=0).values.tolist())),
            "block_ns": duration.median().item(), "launch_gap_ns": gaps.median().item() if gaps.numel() else 0.0,
            "ns_per_tile": per_tile, "fixed_ns": fixed, "blocks": int(start.numel()),
            "span_ns": (end.max() - start.min()).item()}
