"""Checks of notebook 06c's exercises, whose solutions are C++ functions of utils/native/src/hopper_layout.h (6c.1,
6c.2, 6c.4) or Python (6c.3).

1. On the CPU (any machine with a C++ compiler): the learner's function is compiled beside the header with a
   small driver that prints what it returns for every input the kernel uses; the answers are compared with
   utils.native.hopper's model, and the message names the threads, rows or descriptor fields that are wrong.
2. On an sm_90 GPU (H100/H200): the wgmma GEMM of utils/native/src/wgmma_gemm.cu (6c.1, 6c.2) or the attention
   kernel of utils/native/src/hopper_attention.cu (6c.4) is rebuilt with the learner's function in place of the
   course's and compared with a float64 reference, block by block.
"""
from __future__ import annotations

import subprocess
from functools import partial

from utils.native import hopper
from utils.course.exercises import _spans
from utils.course.exercises.cuda_kernels import CUDA_DIR, _load_inline, build_host

# The macro that keeps hopper_layout.h's own version of each exercise's function out.
EXERCISE_MACROS = {"tile_chunk": "COURSE_EXERCISE_TILE_CHUNK", "gemm_desc": "COURSE_EXERCISE_GEMM_DESC",
                   "tile_needs_mask": "COURSE_EXERCISE_TILE_NEEDS_MASK"}


# The Hopper attention steps a check runs with the learner's function inside (4 and 6, which mask only the tiles
# that need it): hopper_attention.cu built with COURSE_EXERCISE_STEPS instantiates these, in bf16 at D = 128.
EXERCISE_STEPS = ("softmax", "overlap")


def _with_header(function: str, source: str) -> str:
    return (f"#define {EXERCISE_MACROS[function]}\n#include \"hopper_layout.h\"\n"
            f"namespace course_hopper {{\n{source}\n}}  // namespace course_hopper\n")


def run_host(program: str, *, timeout: float = 20.0) -> str:
    """Compile C++ `program` (utils/native/src on the include path) with the host compiler, run it, return stdout.
    A stub raises NotImplementedError."""
    binary = build_host(program, prefix="hopper", flags=["-std=c++17", "-O1", "-w"],
                        what="the host compiler, building your function",
                        depends=(CUDA_DIR / "hopper_layout.h").read_text())
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"your function crashed the test program (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


# ---- Exercise 6c.1: which chunk each thread copies, and where it goes -----------------------------------------

def _tile_chunks(source: str) -> dict:
    driver = ("#include <cstdio>\nint main() {\n  for (int tid = 0; tid < 128; ++tid)\n"
              "    for (int i = 0; i < 4; ++i) {\n      const auto c = course_hopper::tile_chunk(tid, i);\n"
              '      std::printf("%d %d %d %d %u\\n", tid, i, c.row, c.col, c.smem_byte);\n    }\n}\n')
    rows = [tuple(int(x) for x in line.split()) for line in run_host(_with_header("tile_chunk", source) + driver)
            .splitlines()]
    return {(tid, i): (row, col, byte) for tid, i, row, col, byte in rows}


def check_tile_chunk(source: str) -> None:
    """Exercise 6c.1: every chunk of the 64 x 64 tile copied once, each to its 128-byte-swizzled byte."""
    chunks = _tile_chunks(source)
    outside = [(k, v) for k, v in chunks.items() if not (0 <= v[0] < 64 and 0 <= v[1] < 8)]
    assert not outside, (f"thread {outside[0][0][0]}, chunk {outside[0][0][1]} names row {outside[0][1][0]}, "
                         f"column {outside[0][1][1]}: outside the tile (rows 0-63, 16-byte columns 0-7)")
    copies: dict = {}
    for (tid, i), (row, col, _) in chunks.items():
        copies.setdefault((row, col), []).append((tid, i))
    twice = [(rc, who) for rc, who in sorted(copies.items()) if len(who) > 1]
    assert not twice, (f"{len(twice)} chunks are copied more than once, e.g. row {twice[0][0][0]}, column "
                       f"{twice[0][0][1]} by (thread, i) {twice[0][1]}")
    missing_rows = sorted({r for r in range(64) for c in range(8) if (r, c) not in copies})
    assert not missing_rows, f"rows {_spans(missing_rows)} are never (fully) copied"
    wrong = [(k, v) for k, v in sorted(chunks.items()) if v[2] != hopper.swizzle(v[0] * 128 + v[1] * 16, 128)]
    if wrong:
        (tid, i), (row, col, byte) = wrong[0]
        raise AssertionError(
            f"{len(wrong)} of 512 chunks land in the wrong place, e.g. thread {tid}, i = {i} copies row {row}, column "
            f"{col} to byte {byte}; the 128-byte swizzle puts it at {row} * 128 + ({col} ^ {row % 8}) * 16 = "
            f"{hopper.swizzle(row * 128 + col * 16, 128)} (rows with wrong bytes: "
            f"{_spans(sorted({v[0] for _, v in wrong}))})")
    # Correct either way; say when a warp's 32 loads are not whole rows (each row is one 128-byte segment).
    scattered = [(w, i) for w in range(4) for i in range(4)
                 if len({chunks[32 * w + lane, i][0] for lane in range(32)}) > 4]
    if scattered:
        print(f"note: correct, but warp {scattered[0][0]}'s loads for i = {scattered[0][1]} touch more than 4 rows "
              "(more 128-byte segments of global memory per load than needed)")
    _check_gemm_on_gpu({"tile_chunk": source})


# ---- Exercise 6c.2: the descriptor of each K-slice --------------------------------------------------------------

DESC_TILES = (0x0, 0x400, 0x2000, 0x1FC00)


def check_gemm_desc(source: str) -> None:
    """Exercise 6c.2: gemm_desc(tile, k_step) describes K-slice k_step of a 128-byte-swizzled K-major tile."""
    driver = ("#include <cstdio>\nint main() {\n"
              f"  const unsigned tiles[] = {{{', '.join(str(t) for t in DESC_TILES)}}};\n"
              "  for (unsigned t : tiles)\n    for (int k = 0; k < 4; ++k)\n"
              '      std::printf("%llu\\n", (unsigned long long)course_hopper::gemm_desc(t, k));\n}\n')
    got = [int(x) for x in run_host(_with_header("gemm_desc", source) + driver).split()]
    cases = [(t, k) for t in DESC_TILES for k in range(4)]
    for (tile, k), desc in zip(cases, got, strict=True):
        fields = hopper.decode_descriptor(desc)
        where = f"gemm_desc(0x{tile:x}, {k})"
        assert fields["address"] == tile + 32 * k, (
            f"{where}: start address 0x{fields['address']:x}, expected 0x{tile + 32 * k:x} (K-slice {k} of 16 "
            f"elements starts {32 * k} bytes into each row; the address is stored >> 4 in bits 0-13)")
        assert fields["stride_bytes"] == 1024, (
            f"{where}: stride offset {fields['stride_bytes']} bytes, expected 1024 (groups of 8 rows of 128 bytes; "
            f"stored >> 4 in bits 32-45)")
        assert fields["mode"] == 128, f"{where}: swizzle mode {fields['mode']} bytes, expected 128 (bits 62-63 = 1)"
        assert fields["base_offset"] == 0 and desc >> 46 & 0x7 == 0 and desc >> 52 & 0x3FF == 0, (
            f"{where}: bits outside the fields are set (0x{desc:016x})")
    _check_gemm_on_gpu({"gemm_desc": source})


# ---- on an H100/H200: the GEMM with the learner's function inside --------------------------------------------

def exercise_sources(kernel: str, sources: dict) -> tuple[str, str]:
    """(host C++, CUDA) of utils/native/src/<kernel>.cu with the learner's functions (`sources`: exercise name ->
    C++) in place of the course's; hopper_attention keeps only the steps the check runs (EXERCISE_STEPS)."""
    if kernel not in ("hopper_attention", "wgmma_gemm"):
        raise ValueError(f"kernel must be 'hopper_attention' or 'wgmma_gemm', got {kernel!r}")
    unknown = [name for name in sources if name not in EXERCISE_MACROS]
    if unknown:
        raise ValueError(f"sources: no exercise named {unknown[0]!r} (they are {', '.join(EXERCISE_MACROS)})")
    prelude = "".join(f"#define {EXERCISE_MACROS[name]}\n" for name in sources) + '#include "hopper_layout.h"\n'
    if kernel == "hopper_attention":
        prelude = "#define COURSE_EXERCISE_STEPS\n" + prelude
    learner = "".join(f"namespace course_hopper {{\n{src}\n}}\n" for src in sources.values())
    return f'#define COURSE_TORCH_WRAPPER\n#include "{kernel}.cu"\n', prelude + learner + f'#include "{kernel}.cu"\n'


def _build_on_hopper(kernel: str, entry: str, sources: dict):
    """exercise_sources(kernel, sources) built, or None off an sm_90 GPU, where the CPU part of a check is the
    whole check."""
    import torch

    from utils import gpu

    if not torch.cuda.is_available() or gpu.capability() != (9, 0):
        return None
    cpp, cuda = exercise_sources(kernel, sources)
    return _load_inline(f"{kernel}_" + "_".join(sources), cpp, cuda, [entry],
                        flags=["-gencode=arch=compute_90a,code=sm_90a"])


def _check_gemm_on_gpu(sources: dict) -> None:
    import torch

    from utils.course.exercises import assert_rows_close

    module = _build_on_hopper("wgmma_gemm", "wgmma_gemm_forward", sources)
    if module is None:
        return
    a = torch.randn(192, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    out = module.wgmma_gemm_forward(a, b, 1)  # step 1: the threads copy the tiles, with tile_chunk
    assert_rows_close(out, (a.double() @ b.double().T).float(), atol=2e-3, rtol=0, block_rows=64, name="C = A Bᵀ")


# ---- Exercise 6c.3: which thread holds which accumulator element -----------------------------------------------

def _ptx_accumulator_element(tid: int, reg: int) -> tuple:
    # PTX ISA, wgmma .m64nNk16 D fragments: warp w of the warpgroup owns rows 16w..16w+15; within it the
    # layout of mma.m16n8's C fragment, repeated every 8 columns (4 registers per 8 columns).
    warp, lane = divmod(tid, 32)
    return 16 * warp + lane // 4 + 8 * (reg % 4 // 2), 8 * (reg // 4) + 2 * (lane % 4) + reg % 2


def check_accumulator_layout(fn) -> None:
    """Exercise 6c.3: fn(tid, reg) -> (row, col) of the 64 x 64 fp32 accumulator of wgmma m64n64k16."""
    if not callable(fn):
        raise TypeError(f"pass your function, got {type(fn).__name__}")
    wrong, warps = [], set()
    for tid in range(128):
        for reg in range(32):
            got, expected = tuple(fn(tid, reg)), _ptx_accumulator_element(tid, reg)
            if got != expected:
                wrong.append((tid, reg, got, expected))
                warps.add(tid // 32)
    if wrong:
        tid, reg, got, expected = wrong[0]
        raise AssertionError(
            f"{len(wrong)} of 4096 (thread, register) pairs are wrong, in warps {sorted(warps)}; e.g. thread {tid} "
            f"(warp {tid // 32}, lane {tid % 32}), register {reg}: you say (row, col) = {got}, the tensor cores "
            f"put {expected} there")


# ---- Exercise 6c.4: which tiles need the mask ----------------------------------------------------------------

# (Nq, Nk): equal, Nq < Nk, Nq > Nk, one row block against many keys, one past a tile, and Nk - Nq of every
# residue mod 64 (so that some tile's last key lands on, or one past, a first row's diagonal); every
# warpgroup's first row and every tile of 64 and of 128 keys, causal and not.
MASK_SHAPES = ((1024, 1024), (333, 517), (700, 300), (64, 2000), (129, 129),
               *((192, 192 + d) for d in range(-64, 64)))


def mask_cases() -> list[tuple]:
    """(tile, keys, first_row, seqlen_q, seqlen_k, causal) for every tile the kernel visits in MASK_SHAPES."""
    return [(tile, keys, first_row, nq, nk, causal) for nq, nk in MASK_SHAPES for keys in (64, 128)
            for causal in (False, True) for first_row in range(0, nq, 64) for tile in range(-(-nk // keys))]


def _why_masked(tile, keys, first_row, nq, nk, causal):
    """Brute force: the first key of the tile that some row of the warpgroup must not see, and why (or None)."""
    for key in range(tile * keys, (tile + 1) * keys):
        if key >= nk:
            return key, f"is past the last key (Nk = {nk})"
        if causal and key > first_row + nk - nq:  # the first row sees the fewest keys
            return key, f"comes after row {first_row}'s diagonal (it sees keys up to {first_row + nk - nq})"
    return None


def check_tile_needs_mask(source: str) -> None:
    """Exercise 6c.4: tile_needs_mask is true exactly for the tiles with a score that must be masked."""
    cases = mask_cases()
    rows = ",\n".join("{%d, %d, %d, %d, %d, %d}" % (t, k, r, q, n, int(c)) for t, k, r, q, n, c in cases)
    driver = (f"#include <cstdio>\nstatic const int cases[][6] = {{\n{rows}}};\nint main() {{\n"
              "  for (const auto& c : cases)\n"
              '    std::printf("%d\\n", course_hopper::tile_needs_mask(c[0], c[1], c[2], c[3], c[4], c[5] != 0) ? 1 : 0);\n}\n')
    got = [line == "1" for line in run_host(_with_header("tile_needs_mask", source) + driver).split()]
    missed, extra = [], []
    for case, says in zip(cases, got, strict=True):
        why = _why_masked(*case)
        if why and not says:
            missed.append((case, why))
        elif not why and says:
            extra.append(case)
    if missed:
        (tile, keys, row, nq, nk, causal), (key, reason) = missed[0]
        raise AssertionError(
            f"{len(missed)} of {len(cases)} tiles would go unmasked: e.g. Nq = {nq}, Nk = {nk}, "
            f"{'causal' if causal else 'not causal'}, rows {row}-{row + 63}, tile {tile} of {keys} keys "
            f"(keys {tile * keys}-{tile * keys + keys - 1}): you skip its mask, but key {key} {reason}")
    if extra:
        tile, keys, row, nq, nk, causal = extra[0]
        raise AssertionError(
            f"{len(extra)} of {len(cases)} tiles need no mask but you mask them (correct, but they pay for the test "
            f"this step removes): e.g. Nq = {nq}, Nk = {nk}, {'causal' if causal else 'not causal'}, rows "
            f"{row}-{row + 63}, tile {tile} of {keys} keys: every key is below Nk"
            + (f" and at or before row {row}'s diagonal ({row + nk - nq})" if causal else ""))
    _check_attention_on_gpu({"tile_needs_mask": source})


def _check_attention_on_gpu(sources: dict) -> None:
    import torch

    from utils.course.testing import assert_attention_matches_reference, random_qkv

    module = _build_on_hopper("hopper_attention", "hopper_attention_forward", sources)
    if module is None:
        return
    for nq, nk in ((333, 517), (700, 300)):
        q, k, v = random_qkv(1, 4, nq, nk, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda")
        for step in EXERCISE_STEPS:
            for causal in (False, True):
                fn = partial(hopper.flash_hopper, step=step, module=module)
                assert_attention_matches_reference(fn, q, k, v, causal=causal)
