"""Checks of the CUDA exercises of notebooks 06, 06b and 06bw, whose solutions sit inside CUDA source.

A check does what the machine allows, in this order:
1. compile the learner's source with nvcc for sm_80, compile only (no GPU needed). The learner version's stub
   is an `#error` line carrying STUB_MESSAGE, so a stub stops here and the check says "not yet";
2. run the learner's device functions on the CPU, in an emulated warp: the host C++ compiler builds them beside
   a small emulation of the warp-wide instructions they use (`__shfl_*_sync`, `ldmatrix`), 32 host threads
   play the 32 lanes, and what every lane ends up holding is compared with what the PTX ISA says it must hold;
3. on a CUDA GPU, build them into a kernel with load_inline and compare its output with a float64 reference.

The references are computed here, from scratch; none of the course's kernels is called.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from utils.course.exercises import STUB_MESSAGE, _spans

CUDA_DIR = Path(__file__).resolve().parents[2] / "native" / "src"
BUILD_DIR = Path(__file__).resolve().parents[3] / "build" / "exercises"

# ---- compiling ----------------------------------------------------------------------------------------------


def _compiler_error(what: str, output: str) -> Exception:
    """The error for a failed compile: NotImplementedError (the check says "not yet") if the stub is there."""
    if STUB_MESSAGE in output:
        return NotImplementedError(f"{what}: the exercise's stub is still in the source ({STUB_MESSAGE})")
    return RuntimeError(f"{what} failed:\n{output[-3000:]}")


def nvcc_compile(source: str, *, arch: str = "sm_80") -> bool:
    """Compile CUDA `source` with nvcc (kernels only, no GPU needed); False if there is no nvcc here.

    Raises NotImplementedError when the source still holds an exercise stub, RuntimeError with the compiler's
    message for any other compile error.
    """
    from utils.native.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        return False
    headers = [h.read_text() for h in sorted(CUDA_DIR.glob("*.cuh")) + sorted(CUDA_DIR.glob("*.h"))]
    digest = hashlib.sha256("\0".join([nvcc, arch, source, *headers]).encode()).hexdigest()[:16]
    compiled = BUILD_DIR / f"nvcc_ok_{digest}"  # a source that compiled once compiles again: skip nvcc
    if compiled.is_file():
        return True
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exercise.cu"
        path.write_text(source)
        proc = subprocess.run([nvcc, "-c", "-std=c++17", f"-arch={arch}", f"-I{CUDA_DIR}", str(path),
                               "-o", str(Path(tmp) / "exercise.o")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise _compiler_error(f"nvcc ({arch})", proc.stdout + proc.stderr) from None
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    compiled.touch()
    return True


def host_compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


# Host emulation of one warp. 32 std::threads run the learner's device code, one per lane; every warp-wide
# instruction is a meeting point (a barrier) where the lanes publish their operand and read each other's, as
# the lanes of a warp execute it together. A lane that skips a shuffle the others execute leaves them waiting
# at the barrier forever: on a GPU that is undefined behaviour, here a hang that the check turns into a message.
WARP_EMULATION = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#include <math.h>
#define __device__
#define __host__
#define __forceinline__ inline

struct LaneIndex { unsigned x, y, z; };
inline thread_local LaneIndex threadIdx{0, 0, 0};

namespace warp_emulation {
inline thread_local int lane = 0;
inline std::barrier<>* meeting = nullptr;
inline std::uint64_t published[32];
inline const void* addresses[32];

template <typename T> T exchange(T v, int src) {  // every lane publishes v, then reads lane src's value
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "32- and 64-bit values only");
  std::memcpy(&published[lane], &v, sizeof(T));
  meeting->arrive_and_wait();
  std::memcpy(&v, &published[src], sizeof(T));
  meeting->arrive_and_wait();
  return v;
}

template <typename Body> void run_warp(Body body) {
  std::barrier<> b(32);
  meeting = &b;
  std::vector<std::thread> lanes;
  for (int l = 0; l < 32; ++l) lanes.emplace_back([&body, l] { lane = l; threadIdx.x = l; body(l); });
  for (auto& t : lanes) t.join();
}

// ldmatrix .x4: lane 8i + j gives the address of row j of 8x8 matrix i (8 16-bit values); register i of lane
// 4g + t receives row g, columns 2t and 2t + 1 of matrix i, or with .trans column g, rows 2t and 2t + 1.
template <bool kTrans> void ldmatrix(std::uint32_t (&r)[4], const void* row) {
  addresses[lane] = row;
  meeting->arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    std::uint16_t lo, hi;
    if (kTrans) {
      lo = static_cast<const std::uint16_t*>(addresses[8 * i + 2 * t])[g];
      hi = static_cast<const std::uint16_t*>(addresses[8 * i + 2 * t + 1])[g];
    } else {
      lo = static_cast<const std::uint16_t*>(addresses[8 * i + g])[2 * t];
      hi = static_cast<const std::uint16_t*>(addresses[8 * i + g])[2 * t + 1];
    }
    r[i] = lo | static_cast<std::uint32_t>(hi) << 16;
  }
  meeting->arrive_and_wait();
}
}  // namespace warp_emulation

template <typename T> T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  return warp_emulation::exchange(v, (warp_emulation::lane ^ lane_mask) & 31);
}
template <typename T> T __shfl_down_sync(unsigned, T v, int delta, int width = 32) {  // past the end: own value
  const int lane = warp_emulation::lane, src = lane + delta;
  return warp_emulation::exchange(v, src / width == lane / width ? src : lane);
}
template <typename T> T __shfl_up_sync(unsigned, T v, int delta, int width = 32) {
  const int lane = warp_emulation::lane, src = lane - delta;
  return warp_emulation::exchange(v, src >= 0 && src / width == lane / width ? src : lane);
}
template <typename T> T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
  return warp_emulation::exchange(v, warp_emulation::lane / width * width + src_lane % width);
}
inline void __syncwarp(unsigned = 0xffffffffu) { warp_emulation::meeting->arrive_and_wait(); }
"""


def build_host(program: str, *, prefix: str, flags: list, what: str, note: str = "", depends: str = "") -> Path:
    """Compile C++ `program` with the host compiler (utils/native/src on the include path) and return the binary.

    Builds are cached under build/exercises/ by a hash of the compiler, flags, program and `depends` (the text
    of headers it includes). Each build writes files of its own and renames the binary into place, so that
    processes building the same program at once (two notebooks, two test runs) never run or overwrite a
    half-written one. A stub raises NotImplementedError, another compile error a RuntimeError that starts with
    `what` and ends with the compiler's message and `note`."""
    compiler = host_compiler()
    if compiler is None:
        raise RuntimeError("no host C++ compiler (c++, g++ or clang++): the CPU part of this check needs one")
    digest = hashlib.sha256("\0".join([compiler, *flags, program, depends]).encode()).hexdigest()[:16]
    binary = BUILD_DIR / f"{prefix}_{digest}"
    if not binary.is_file():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        mine = f"{prefix}_{digest}.{os.getpid()}.{threading.get_ident()}"   # this build's own files
        cpp, built = BUILD_DIR / f"{mine}.cpp", BUILD_DIR / mine
        cpp.write_text(program)
        try:
            proc = subprocess.run([compiler, *flags, f"-I{CUDA_DIR}", str(cpp), "-o", str(built)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise _compiler_error(what, proc.stderr + note) from None
            os.replace(built, binary)   # atomic: others see no binary or a whole one
        finally:
            cpp.unlink(missing_ok=True)
            built.unlink(missing_ok=True)
    return binary


def run_emulated(source: str, *, timeout: float = 10.0) -> str:
    """Compile C++ `source` (WARP_EMULATION goes first) with the host compiler, run it, return its stdout.

    Builds are cached under build/exercises/ by a hash of the source. A stub raises NotImplementedError; a
    program that does not finish in `timeout` seconds (lanes waiting at a shuffle that others skipped) raises
    an AssertionError that says so.
    """
    binary = build_host(WARP_EMULATION + source, prefix="warp_emulation", flags=["-std=c++20", "-O1", "-pthread", "-w"],
                        what="the host compiler, building the CPU emulation of your code",
                        note="\n(the emulation knows __shfl_xor/down/up_sync, __shfl_sync, __syncwarp, "
                             "ldmatrix_x4, ldmatrix_x4_trans and smem_offset)")
    try:
        proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("the emulated warp hung: some lanes wait at a shuffle (or ldmatrix) that other lanes "
                             "never reach. Every lane named in the mask must execute every warp-wide "
                             "instruction: keep them out of lane-dependent branches") from None
    if proc.returncode != 0:
        raise AssertionError(f"the emulation of your code crashed (exit {proc.returncode}): an address outside "
                             f"the tile?\n{proc.stderr[-2000:]}")
    return proc.stdout


def _load_inline(name: str, cpp: str, cuda: str, functions: list[str], flags=None):
    """Build a small extension for the GPU at hand (cached by a hash of everything that goes into it);
    `flags` replaces the GPU's -gencode (the Hopper exercises build for sm_90a)."""
    import torch
    from torch.utils.cpp_extension import load_inline

    from utils.native.build import CUDA_FLAGS, build_lock, gencode_flags

    flags = [*CUDA_FLAGS, *(flags or gencode_flags(torch.cuda.get_device_capability()))]
    digest = hashlib.sha256("\0".join([cpp, cuda, *functions, *flags]).encode()).hexdigest()[:12]
    ext = f"course_exercise_{name}_{digest}"
    build = BUILD_DIR.parent / "torch_extensions" / ext
    with build_lock(build):  # a build killed half-way would otherwise leave load_inline waiting without end
        try:
            return load_inline(name=ext, cpp_sources=cpp, cuda_sources=cuda, functions=functions,
                               extra_cuda_cflags=flags, extra_include_paths=[str(CUDA_DIR)],
                               build_directory=str(build))
        except Exception as err:  # torch's error carries the compiler's output
            raise _compiler_error(f"load_inline ({ext})", str(err)) from err


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- Exercise 6.5: warp-shuffle reductions (notebook 06) ----------------------------------------------------

# Case k gives lane l the value CASES[k][l]: mixed signs, one large outlier lane, -inf in some lanes.
def _reduction_cases() -> np.ndarray:
    rng = np.random.default_rng(6)
    cases = [np.arange(32, dtype=np.float32), rng.normal(size=32).astype(np.float32) * 5,
             -np.abs(rng.normal(size=32)).astype(np.float32)]
    outlier = rng.normal(size=32).astype(np.float32)
    outlier[13] = 1000.0
    cases.append(outlier)
    with_inf = rng.normal(size=32).astype(np.float32)
    with_inf[::3] = -np.inf
    cases.append(with_inf)
    return np.stack(cases)


_REDUCTION_DRIVER = r"""
int main() {
  const float cases[][32] = {@CASES@};
  for (int c = 0; c < int(sizeof(cases) / sizeof(cases[0])); ++c) {
    float maxes[32], sums[32];
    warp_emulation::run_warp([&](int lane) {
      maxes[lane] = warp_max(cases[c][lane]);
      float v = cases[c][lane];
      sums[lane] = warp_sum(std::isinf(v) ? 0.f : v);
    });
    for (int l = 0; l < 32; ++l) std::printf("%d %d %.9g %.9g\n", c, l, maxes[l], sums[l]);
  }
}
"""


def _float_literal(x: float) -> str:
    return "-INFINITY" if x == -np.inf else f"{float(x)!r}f"


def _lane_report(what: str, case: int, got: np.ndarray, expected: np.ndarray, ok: np.ndarray) -> str:
    wrong = np.flatnonzero(~ok)
    first = wrong[0]
    text = (f"{what}, test case {case}: lanes {_spans(wrong.tolist())} wrong ({len(wrong)} of 32); lane {first} "
            f"holds {got[first]:.6g}, expected {expected[first]:.6g}")
    if ok[0] and len(wrong) == 31:
        text += (". Only lane 0 has the result, as with __shfl_down_sync: the softmax needs it in every lane "
                 "(a butterfly, __shfl_xor_sync, leaves it everywhere)")
    return text


def check_warp_reductions(source: str) -> None:
    """Exercise 6.5: `source` defines `warp_max(float)` and `warp_sum(float)`; every lane must return the max
    (the sum) of the 32 lanes' values. Raises AssertionError naming the wrong lanes."""
    if not isinstance(source, str):
        raise TypeError("source must be the CUDA source string of the exercise")
    nvcc_compile(_SOFTMAX_INCLUDES + source + _SOFTMAX_KERNEL)
    cases = _reduction_cases()
    table = ",\n".join("{" + ", ".join(_float_literal(x) for x in case) + "}" for case in cases)
    out = run_emulated(source + _REDUCTION_DRIVER.replace("@CASES@", table))
    rows = np.array([line.split() for line in out.split("\n") if line], dtype=np.float64)
    if rows.shape != (len(cases) * 32, 4):
        raise AssertionError(f"the emulation printed {rows.shape[0]} lines, expected {len(cases) * 32}")
    for c, case in enumerate(cases.astype(np.float64)):
        got = rows[rows[:, 0] == c]
        finite = np.where(np.isinf(case), 0.0, case)
        for what, column, expected in (("warp_max", 2, case.max()), ("warp_sum", 3, finite.sum())):
            values, want = got[:, column], np.full(32, expected)
            ok = np.isclose(values, want, rtol=1e-5, atol=1e-4)
            if not ok.all():
                raise AssertionError(_lane_report(what, c, values, want, ok))
    if _gpu_available():
        _check_softmax_on_gpu(source)


# One warp per row, as softmax_row_per_warp in utils/native/src/softmax.cu: the learner's reductions are the whole
# cross-lane part. expf (not __expf) keeps the comparison with float64 tight.
_SOFTMAX_INCLUDES = "#include <cuda_runtime.h>\n#include <math.h>\n"
_SOFTMAX_KERNEL = r"""
__global__ void exercise_softmax_kernel(const float* x, float* y, int rows, int cols) {
  const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  const float* xr = x + static_cast<long long>(row) * cols;
  float m = -INFINITY;
  for (int c = lane; c < cols; c += 32) m = fmaxf(m, xr[c]);
  m = warp_max(m);
  float s = 0.f;
  for (int c = lane; c < cols; c += 32) s += expf(xr[c] - m);
  const float inv = 1.f / warp_sum(s);
  for (int c = lane; c < cols; c += 32) y[static_cast<long long>(row) * cols + c] = expf(xr[c] - m) * inv;
}

void exercise_softmax_launch(const float* x, float* y, int rows, int cols) {
  exercise_softmax_kernel<<<(rows + 7) / 8, 256>>>(x, y, rows, cols);
}
"""

_SOFTMAX_CPP = r"""
#include <torch/extension.h>
#include <cuda_runtime_api.h>
void exercise_softmax_launch(const float* x, float* y, int rows, int cols);

torch::Tensor exercise_softmax(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "exercise_softmax: x must be a contiguous 2-d float32 CUDA tensor");
  auto y = torch::empty_like(x);
  exercise_softmax_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "exercise_softmax: launch failed");
  return y;
}
"""


def _check_softmax_on_gpu(source: str) -> None:
    import torch

    from utils.course.exercises import assert_rows_close

    ext = _load_inline("warp_softmax", _SOFTMAX_CPP, _SOFTMAX_INCLUDES + source + _SOFTMAX_KERNEL,
                       ["exercise_softmax"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in ((37, 1001), (5, 33), (300, 128), (3, 4097), (9, 1)):
        x = torch.randn(rows, cols, device="cuda", generator=gen) * 4
        expected = torch.softmax(x.double(), dim=-1)
        assert_rows_close(ext.exercise_softmax(x), expected, atol=1e-6, rtol=1e-4,
                          name=f"softmax of a {rows} x {cols} matrix")


# ---- Exercise 6b.3: V's B fragments with ldmatrix.trans (notebook 06b) --------------------------------------

def _smem_offset_source() -> str:
    """smem_offset<D, kSwizzle> from utils/native/src/flash_mma.cuh: the emulation stores tiles exactly as the
    kernel does."""
    text = (CUDA_DIR / "flash_mma.cuh").read_text()
    match = re.search(r"^template <int D, bool kSwizzle>.*?^}\n", text, re.S | re.M)
    if match is None:
        raise RuntimeError("smem_offset not found in utils/native/src/flash_mma.cuh")
    return match.group(0)


# V tile element (key, col) holds the 16-bit value key * 256 + col, so every register says where it came from.
_LOAD_B_V_CASES = [(64, False, 0, 0), (64, True, 16, 0), (64, True, 48, 16), (128, True, 112, 48),
                   (128, False, 32, 32)]
_LOAD_B_V_DRIVER = r"""
template <int D, bool kSwizzle> void run_case(int n0, int k0) {
  static std::uint16_t tile[64 * D];
  for (int key = 0; key < 64; ++key)
    for (int col = 0; col < D; ++col)
      tile[course_flash::smem_offset<D, kSwizzle>(key, col)] = static_cast<std::uint16_t>(key * 256 + col);
  std::uint32_t b[32][2][2];
  warp_emulation::run_warp([&](int lane) { load_b_v<D, kSwizzle>(b[lane], tile, n0, k0, lane); });
  for (int l = 0; l < 32; ++l)
    std::printf("%d %d %d %d %d %u %u %u %u\n", D, int(kSwizzle), n0, k0, l, b[l][0][0], b[l][0][1], b[l][1][0],
                b[l][1][1]);
}

int main() {
@CASES@
}
"""

_EMULATED_PRIMITIVES = r"""
namespace course_flash {
inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) { warp_emulation::ldmatrix<false>(r, row); }
inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) { warp_emulation::ldmatrix<true>(r, row); }
@SMEM_OFFSET@
}  // namespace course_flash
using namespace course_flash;
using std::uint32_t;
"""


def _v_pair(word: int) -> str:
    lo, hi = word & 0xFFFF, word >> 16
    return f"(V[{lo >> 8}][{lo & 255}], V[{hi >> 8}][{hi & 255}])"


def expected_b_v(lane: int, i: int, half: int, n0: int, k0: int) -> int:
    """The register b[i][half] of `lane` for O += P V: V[k0 + 8 half + 2t][n0 + 8i + g] in the low 16 bits,
    the next key in the high 16 bits (PTX ISA, B operand of mma.m16n8k16), with V[key][col] = key*256 + col."""
    g, t = divmod(lane, 4)
    key, col = k0 + 8 * half + 2 * t, n0 + 8 * i + g
    return (key * 256 + col) | ((key + 1) * 256 + col) << 16


def check_load_b_v(source: str) -> None:
    """Exercise 6b.3: `source` defines `load_b_v<D, kSwizzle>(b, tile, n0, k0, lane)`, the B fragments of V for
    two n8 tiles of O += P V with one ldmatrix.x4.trans. Raises AssertionError naming the wrong lanes and
    registers, and the elements they hold."""
    if not isinstance(source, str):
        raise TypeError("source must be the CUDA source string of the exercise")
    nvcc_compile(_PV_INCLUDES + source + _PV_KERNEL)
    calls = "\n".join(f"  run_case<{d}, {str(s).lower()}>({n0}, {k0});" for d, s, n0, k0 in _LOAD_B_V_CASES)
    program = (_EMULATED_PRIMITIVES.replace("@SMEM_OFFSET@", _smem_offset_source()) + source
               + _LOAD_B_V_DRIVER.replace("@CASES@", calls))
    out = run_emulated(program)
    got = {tuple(row[:5]): row[5:] for row in
           (list(map(int, line.split())) for line in out.split("\n") if line)}
    for d, swizzle, n0, k0 in _LOAD_B_V_CASES:
        where = f"D={d}, {'swizzled' if swizzle else 'plain'} tile, n0={n0}, k0={k0}"
        for r, (i, half) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            lanes = [lane for lane in range(32)
                     if got[d, int(swizzle), n0, k0, lane][r] != expected_b_v(lane, i, half, n0, k0)]
            if lanes:
                lane = lanes[0]
                raise AssertionError(
                    f"{where}: b[{i}][{half}] wrong in lanes {_spans(lanes)}; lane {lane} (g={lane // 4}, "
                    f"t={lane % 4}) holds {_v_pair(got[d, int(swizzle), n0, k0, lane][r])}, expected "
                    f"{_v_pair(expected_b_v(lane, i, half, n0, k0))} (V[key][column])")
    if _gpu_available():
        _check_pv_on_gpu(source)


# O (16 x D) = P (16 x keys) V (keys x D) by one warp with mma.sync; V staged in shared memory as the kernel
# stages it; the learner's load_b_v gives the B fragments.
_PV_INCLUDES = '#include "flash_mma.cuh"\nusing namespace course_flash;\n'
_PV_KERNEL = r"""
template <int D, bool kSwizzle>
__global__ void exercise_pv_kernel(const __nv_bfloat16* p, const __nv_bfloat16* v, float* o, int keys) {
  extern __shared__ __align__(128) unsigned char smem[];
  auto* vs = reinterpret_cast<__nv_bfloat16*>(smem);
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < keys * D; i += 32) vs[smem_offset<D, kSwizzle>(i / D, i % D)] = v[i];
  __syncwarp();
  float acc[D / 8][4] = {};
  const auto pair = [&](int r, int c) { return *reinterpret_cast<const uint32_t*>(p + r * keys + c); };
  for (int k0 = 0; k0 < keys; k0 += 16) {
    const uint32_t a[4] = {pair(g, k0 + 2 * t), pair(g + 8, k0 + 2 * t), pair(g, k0 + 2 * t + 8),
                           pair(g + 8, k0 + 2 * t + 8)};
    for (int n0 = 0; n0 < D; n0 += 16) {
      uint32_t b[2][2];
      load_b_v<D, kSwizzle>(b, vs, n0, k0, lane);
      mma_16816<__nv_bfloat16>(acc[n0 / 8], a, b[0]);
      mma_16816<__nv_bfloat16>(acc[n0 / 8 + 1], a, b[1]);
    }
  }
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) o[(g + 8 * (e / 2)) * D + 8 * n + 2 * t + e % 2] = acc[n][e];
}

void exercise_pv_launch(const void* p, const void* v, float* o, int keys, int d, bool swizzle) {
  const auto* pp = static_cast<const __nv_bfloat16*>(p);
  const auto* vv = static_cast<const __nv_bfloat16*>(v);
  const int smem = keys * d * 2;
  if (d == 64) {
    if (swizzle) exercise_pv_kernel<64, true><<<1, 32, smem>>>(pp, vv, o, keys);
    else exercise_pv_kernel<64, false><<<1, 32, smem>>>(pp, vv, o, keys);
  } else {
    if (swizzle) exercise_pv_kernel<128, true><<<1, 32, smem>>>(pp, vv, o, keys);
    else exercise_pv_kernel<128, false><<<1, 32, smem>>>(pp, vv, o, keys);
  }
}
"""

_PV_CPP = r"""
#include <torch/extension.h>
#include <cuda_runtime_api.h>
void exercise_pv_launch(const void* p, const void* v, float* o, int keys, int d, bool swizzle);

torch::Tensor exercise_pv(torch::Tensor p, torch::Tensor v, bool swizzle) {
  TORCH_CHECK(p.is_cuda() && v.is_cuda() && p.scalar_type() == torch::kBFloat16 &&
              v.scalar_type() == torch::kBFloat16 && p.is_contiguous() && v.is_contiguous(),
              "exercise_pv: p and v must be contiguous bf16 CUDA tensors");
  TORCH_CHECK(p.dim() == 2 && v.dim() == 2 && p.size(0) == 16 && p.size(1) == v.size(0) && v.size(0) % 16 == 0 &&
              v.size(0) <= 128 && (v.size(1) == 64 || v.size(1) == 128),
              "exercise_pv: p is 16 x keys, v is keys x 64 or 128, keys a multiple of 16 up to 128");
  auto o = torch::empty({16, v.size(1)}, p.options().dtype(torch::kFloat32));
  exercise_pv_launch(p.data_ptr(), v.data_ptr(), o.data_ptr<float>(), v.size(0), v.size(1), swizzle);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "exercise_pv: launch failed");
  return o;
}
"""


def _check_pv_on_gpu(source: str) -> None:
    import torch

    from utils.course.exercises import assert_rows_close

    if torch.cuda.get_device_capability() < (8, 0):
        print("this GPU has no bf16 mma.sync (sm_80+): the GPU part of this check is skipped")
        return
    ext = _load_inline("load_b_v", _PV_CPP, _PV_INCLUDES + source + _PV_KERNEL, ["exercise_pv"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for keys, d, swizzle in ((16, 64, False), (48, 64, True), (112, 128, True), (32, 128, False)):
        p = torch.rand(16, keys, device="cuda", generator=gen).bfloat16()
        v = torch.randn(keys, d, device="cuda", generator=gen).bfloat16()
        assert_rows_close(ext.exercise_pv(p, v, swizzle), p.double() @ v.double(), atol=1e-3, rtol=1e-3,
                          block_rows=8, name=f"O = P V ({keys} keys, D={d}, {'swizzled' if swizzle else 'plain'})")


# ---- Exercise 6b.8: Pᵀ and dSᵀ in the backward's transposed frame (notebook 06bw) -------------------------------

class _DsCase(NamedTuple):
    tiles: int        # n8 tiles of queries: BR = 8 tiles
    k0: int           # the warp's first key
    q0: int           # the block's first query
    seqlen_q: int
    seqlen_k: int
    causal: bool
    masked: bool      # the tile may hide keys (the kernel's test); False: none is hidden

    def describe(self) -> str:
        return (f"keys {self.k0}..{self.k0 + 15}, queries {self.q0}..{self.q0 + 8 * self.tiles - 1}, "
                f"Nq={self.seqlen_q}, Nk={self.seqlen_k}, {'causal' if self.causal else 'not causal'}")


_DS_CASES = [_DsCase(4, 0, 0, 512, 512, False, False),     # nothing hidden
             _DsCase(8, 48, 32, 256, 256, True, True),     # the causal diagonal crosses the tile
             _DsCase(4, 112, 0, 100, 120, False, True),    # keys 120.. are past the end
             _DsCase(8, 16, 0, 40, 45, True, True),        # causal, bottom-right: offset 5; queries 40.. padded
             _DsCase(4, 32, 96, 100, 100, False, True)]    # queries 100..127 are padding (lse2 = +inf)
_DS_SCALE_LOG2 = 0.125 * 1.4426950408889634


def _ds_data(case: _DsCase, seed: int) -> dict:
    """Sᵀ and dPᵀ (16 keys x 8·tiles queries), lse2 and delta per query (+inf and 0 for the padding)."""
    rng = np.random.default_rng(seed)
    cols = 8 * case.tiles
    queries = case.q0 + np.arange(cols)
    lse2 = rng.uniform(-1.0, 3.0, cols).astype(np.float32)
    lse2[queries >= case.seqlen_q] = np.inf
    delta = rng.normal(size=cols).astype(np.float32)
    delta[queries >= case.seqlen_q] = 0.0
    return dict(s=(rng.normal(size=(16, cols)) * 8).astype(np.float32), dp=rng.normal(size=(16, cols)).astype(np.float32),
                lse2=lse2, delta=delta)


def _ds_expected(case: _DsCase, data: dict, *, lse_by_key=False, delta_by_key=False) -> tuple:
    """Pᵀ and dSᵀ in float64; the flags give two plausible mistakes, to recognise them in a learner's output."""
    keys = case.k0 + np.arange(16)[:, None]
    queries = case.q0 + np.arange(8 * case.tiles)[None, :]
    hidden = (keys >= case.seqlen_k) | (case.causal & (keys > queries + case.seqlen_k - case.seqlen_q))
    hidden &= case.masked
    lse2 = data["lse2"].astype(np.float64)
    lse = lse2[np.arange(16)][:, None] if lse_by_key else lse2[None, :]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(hidden, 0.0, np.exp2(data["s"].astype(np.float64) * _DS_SCALE_LOG2 - lse))
        delta = data["delta"].astype(np.float64)
        d = delta[np.arange(16)][:, None] if delta_by_key else delta[None, :]
        ds = p * (data["dp"].astype(np.float64) - d)
    return p, ds, hidden


_DS_PRELUDE = r"""
namespace course_flash {
struct Params { int seqlen_q = 0, seqlen_k = 0; float scale_log2 = 0.f; bool causal = false; };  // what it reads
inline float fast_exp2(float x) { return exp2f(x); }
}  // namespace course_flash
using namespace course_flash;
"""
_DS_DRIVER = r"""
template <int kTiles>
void run_case(int c, const float* S, const float* dP, const float* lse2, const float* delta, int k0, int q0, int sq,
              int sk, bool causal, bool masked, float scale_log2) {
  constexpr int cols = 8 * kTiles;
  Params p;
  p.seqlen_q = sq, p.seqlen_k = sk, p.scale_log2 = scale_log2, p.causal = causal;
  static float P[32][kTiles][4], dS[32][kTiles][4];
  warp_emulation::run_warp([&](int lane) {
    const int g = lane / 4, t = lane % 4;
    float s[kTiles][4], dp[kTiles][4];
    for (int n = 0; n < kTiles; ++n)  // the C layout: (row g + 8 (e / 2), column 8n + 2t + e % 2)
      for (int e = 0; e < 4; ++e) {
        const int at = (g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2;
        s[n][e] = S[at], dp[n][e] = dP[at];
      }
    probs_t<kTiles>(s, lse2, p, k0 + g, q0, masked, sk - sq, t);
    std::memcpy(P[lane], s, sizeof(s));
    ds_t<kTiles>(s, dp, delta, t);
    std::memcpy(dS[lane], s, sizeof(s));
  });
  for (int l = 0; l < 32; ++l)
    for (int n = 0; n < kTiles; ++n)
      for (int e = 0; e < 4; ++e) std::printf("%d %d %d %d %.9g %.9g\n", c, l, n, e, P[l][n][e], dS[l][n][e]);
}

int main() {
@CASES@
}
"""


def _c_array(values) -> str:
    return "{" + ", ".join("INFINITY" if x == np.inf else f"{float(x)!r}f" for x in np.ravel(values)) + "}"


def _ds_program(source: str, data: list) -> str:
    calls = []
    for c, (case, d) in enumerate(zip(_DS_CASES, data)):
        calls.append(
            f"  {{ static const float S[] = {_c_array(d['s'])}, dP[] = {_c_array(d['dp'])}, lse2[] = "
            f"{_c_array(d['lse2'])}, delta[] = {_c_array(d['delta'])};\n"
            f"    run_case<{case.tiles}>({c}, S, dP, lse2, delta, {case.k0}, {case.q0}, {case.seqlen_q}, "
            f"{case.seqlen_k}, {str(case.causal).lower()}, {str(case.masked).lower()}, {_DS_SCALE_LOG2!r}f); }}")
    return _DS_PRELUDE + source + _DS_DRIVER.replace("@CASES@", "\n".join(calls))


def _ds_report(what: str, case: _DsCase, got: np.ndarray, want: np.ndarray, ok: np.ndarray, hint: str) -> str:
    rows, cols = np.nonzero(~ok)
    r, c = rows[0], cols[0]
    lane, n, e = 4 * (r % 8) + (c % 8) // 2, c // 8, 2 * (r // 8) + c % 2
    return (f"{what} ({case.describe()}): wrong at keys {_spans(sorted(set((case.k0 + rows).tolist())))}, queries "
            f"{_spans(sorted(set((case.q0 + cols).tolist())))} ({len(rows)} of {ok.size}); lane {lane} "
            f"(g={lane // 4}, t={lane % 4}) s[{n}][{e}] holds key {case.k0 + r}, query {case.q0 + c}: got "
            f"{got[r, c]:.6g}, expected {want[r, c]:.6g}{hint}")


def _ds_hint(case: _DsCase, data: dict, got_p: np.ndarray, got_ds: np.ndarray, p: np.ndarray, hidden: np.ndarray,
             p_wrong: bool) -> str:
    """Why, for the mistakes that have a recognisable output (p, hidden: the expected Pᵀ and hidden keys)."""
    close = lambda a, b: np.isclose(a, b, rtol=1e-4, atol=1e-6) | (np.isnan(a) & np.isnan(b))
    if p_wrong:
        if np.any(hidden & (got_p != 0)):
            return ". That key is hidden from that query (past the end, or after the diagonal): its P must be 0"
        if np.any(~hidden & (got_p == 0) & (p != 0)):
            return ". That key is visible to that query: only past the end and, causal, key > query + offset hide"
        if close(got_p, _ds_expected(case, data, lse_by_key=True)[0]).all():
            return (". Every value matches lse2 indexed by the key: in Sᵀ = K Qᵀ the rows are keys and the columns "
                    "queries, and lse2 belongs to the query")
        if np.isnan(got_p).any():
            return ". NaN: a padded query has lse2 = +inf, and 2^(x − inf) is 0 only if x stays finite"
        return ""
    if close(got_ds, _ds_expected(case, data, delta_by_key=True)[1]).all():
        return ". Every value matches delta indexed by the key: delta = rowsum(dO ∘ O) belongs to the query"
    return ""


def check_backward_ds(source: str) -> None:
    """Exercise 6b.8: `source` defines `probs_t<kTiles>(s, lse2, p, key0, q0, masked, offset, t)` and
    `ds_t<kTiles>(s, dp, delta, t)`, the element-wise steps of the CUDA backward's dkdv kernel in the transposed
    frame. Raises AssertionError naming the wrong keys, queries and lanes."""
    if not isinstance(source, str):
        raise TypeError("source must be the CUDA source string of the exercise")
    nvcc_compile(_PV_INCLUDES + source + _DS_KERNEL)
    data = [_ds_data(case, seed) for seed, case in enumerate(_DS_CASES)]
    out = run_emulated(_ds_program(source, data))
    rows = np.array([line.split() for line in out.split("\n") if line], dtype=np.float64)
    expected_lines = sum(32 * case.tiles * 4 for case in _DS_CASES)
    if rows.shape != (expected_lines, 6):
        raise AssertionError(f"the emulation printed {rows.shape[0]} lines, expected {expected_lines}")
    for c, (case, d) in enumerate(zip(_DS_CASES, data)):
        got_p, got_ds = (np.full((16, 8 * case.tiles), np.nan) for _ in range(2))
        for _, lane, n, e, pv, dsv in rows[rows[:, 0] == c]:
            lane, n, e = int(lane), int(n), int(e)
            r, col = lane // 4 + 8 * (e // 2), 8 * n + 2 * (lane % 4) + e % 2
            got_p[r, col], got_ds[r, col] = pv, dsv
        p, ds, hidden = _ds_expected(case, d)
        for what, got, want in (("Pᵀ (probs_t)", got_p, p), ("dSᵀ (ds_t)", got_ds, ds)):
            ok = np.isclose(got, want, rtol=1e-5, atol=1e-6)
            if not ok.all():
                hint = _ds_hint(case, d, got_p, got_ds, p, hidden, what.startswith("P"))
                raise AssertionError(_ds_report(what, case, got, want, ok, hint))
    if _gpu_available():
        _check_ds_on_gpu(source, data)


# One warp: the C fragments of Sᵀ and dPᵀ loaded from global memory, the learner's functions, Pᵀ and dSᵀ stored.
_DS_KERNEL = r"""
template <int kTiles>
__global__ void exercise_ds_kernel(const float* S, const float* dP, const float* lse2, const float* delta, float* P,
                                   float* dS, Params p, int k0, int q0, bool masked) {
  constexpr int cols = 8 * kTiles;
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  float s[kTiles][4], dp[kTiles][4];
  for (int n = 0; n < kTiles; ++n)
    for (int e = 0; e < 4; ++e) {
      const int at = (g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2;
      s[n][e] = S[at], dp[n][e] = dP[at];
    }
  probs_t<kTiles>(s, lse2, p, k0 + g, q0, masked, p.seqlen_k - p.seqlen_q, t);
  for (int n = 0; n < kTiles; ++n)
    for (int e = 0; e < 4; ++e) P[(g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2] = s[n][e];
  ds_t<kTiles>(s, dp, delta, t);
  for (int n = 0; n < kTiles; ++n)
    for (int e = 0; e < 4; ++e) dS[(g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2] = s[n][e];
}

void exercise_ds_launch(const float* S, const float* dP, const float* lse2, const float* delta, float* P, float* dS,
                        int tiles, int k0, int q0, int seqlen_q, int seqlen_k, bool causal, bool masked,
                        float scale_log2) {
  Params p{};
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.scale_log2 = scale_log2, p.causal = causal;
  if (tiles == 4) exercise_ds_kernel<4><<<1, 32>>>(S, dP, lse2, delta, P, dS, p, k0, q0, masked);
  else exercise_ds_kernel<8><<<1, 32>>>(S, dP, lse2, delta, P, dS, p, k0, q0, masked);
}
"""

_DS_CPP = r"""
#include <torch/extension.h>
#include <cuda_runtime_api.h>
void exercise_ds_launch(const float* S, const float* dP, const float* lse2, const float* delta, float* P, float* dS,
                        int tiles, int k0, int q0, int seqlen_q, int seqlen_k, bool causal, bool masked,
                        float scale_log2);

std::vector<torch::Tensor> exercise_ds(torch::Tensor s, torch::Tensor dp, torch::Tensor lse2, torch::Tensor delta,
                                       int64_t k0, int64_t q0, int64_t seqlen_q, int64_t seqlen_k, bool causal,
                                       bool masked, double scale_log2) {
  for (const auto& x : {s, dp, lse2, delta})
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "exercise_ds: contiguous fp32 CUDA tensors only");
  TORCH_CHECK(s.dim() == 2 && s.size(0) == 16 && (s.size(1) == 32 || s.size(1) == 64) && dp.sizes() == s.sizes() &&
              lse2.numel() == s.size(1) && delta.numel() == s.size(1), "exercise_ds: s and dp 16 x 32 or 16 x 64");
  auto p = torch::empty_like(s), ds = torch::empty_like(s);
  exercise_ds_launch(s.data_ptr<float>(), dp.data_ptr<float>(), lse2.data_ptr<float>(), delta.data_ptr<float>(),
                     p.data_ptr<float>(), ds.data_ptr<float>(), s.size(1) / 8, k0, q0, seqlen_q, seqlen_k, causal,
                     masked, static_cast<float>(scale_log2));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "exercise_ds: launch failed");
  return {p, ds};
}
"""


def _check_ds_on_gpu(source: str, data: list) -> None:
    import torch

    from utils.course.exercises import assert_rows_close

    ext = _load_inline("backward_ds", _DS_CPP, _PV_INCLUDES + source + _DS_KERNEL, ["exercise_ds"])
    for case, d in zip(_DS_CASES, data):
        args = [torch.from_numpy(d[name]).cuda() for name in ("s", "dp", "lse2", "delta")]
        p, ds = ext.exercise_ds(*args, case.k0, case.q0, case.seqlen_q, case.seqlen_k, case.causal, case.masked,
                                _DS_SCALE_LOG2)
        want_p, want_ds, _ = _ds_expected(case, d)
        # the GPU's exp2 (ex2.approx) is within 2 ulp: a looser tolerance than the emulation's exp2f
        for what, got, want in (("Pᵀ", p, want_p), ("dSᵀ", ds, want_ds)):
            assert_rows_close(got, torch.from_numpy(want), atol=1e-5, rtol=1e-4,
                              name=f"{what} on the GPU ({case.describe()}), rows = keys from {case.k0}")


# ---- Exercise 6b.5: the online softmax on the C fragments (notebook 06b) -----------------------------------------

# One warp's 16 rows against 4 tiles of 32 keys (kTilesS = 4 n8 tiles), O of 16 columns (kTilesO = 2), carried
# across the tiles as the kernel carries m, l and o. Rows 3 and 12 see no key in tiles 0 and 1 (m stays -inf);
# row 10 sees none in tile 2 (its max is carried); tile 1 is lower than tile 0 (a max that must not shrink) and
# tile 2 higher (every row's max grows: l and o must be rescaled).
_FRAG_TILES, _FRAG_COLS, _FRAG_D = 4, 32, 16
_FRAG_SCALE_LOG2 = 0.125 * 1.4426950408889634


def _frag_data(seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    s = (rng.normal(size=(_FRAG_TILES, 16, _FRAG_COLS)) * 8).astype(np.float32)
    s[1] -= 30.0
    s[2] += 25.0
    s[0:2, [3, 12]] = -np.inf
    s[1, 5, ::3] = -np.inf
    s[2, 10] = -np.inf
    v = rng.normal(size=(_FRAG_TILES, _FRAG_COLS, _FRAG_D)).astype(np.float32)
    return s, v


def _frag_reference(s: np.ndarray, v: np.ndarray, *, carry_max=True, rescale=True, fold_scale=True) -> list:
    """Per tile: (m, P, l, O after O += P V) in float64; the flags give the mistakes the check recognises."""
    c = _FRAG_SCALE_LOG2 if fold_scale else 1.0
    m, l, o, out = np.full(16, -np.inf), np.zeros(16), np.zeros((16, _FRAG_D)), []
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(len(s)):
            sj = s[j].astype(np.float64)
            tile_max = sj.max(axis=1)
            m_new = np.maximum(m, tile_max) if carry_max else tile_max
            ref = np.where(m_new == -np.inf, 0.0, m_new)
            alpha = np.exp2(m * c - ref * c) if rescale else np.ones(16)
            p = np.exp2(sj * c - ref[:, None] * c)
            l = l * alpha + p.sum(axis=1)
            o = o * alpha[:, None] + p @ v[j].astype(np.float64)
            m = m_new
            out.append((m.copy(), p, l.copy(), o.copy()))
    return out


_FRAG_PRELUDE = r"""
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }  // the kernel's uses ex2.approx
"""
_FRAG_DRIVER = r"""
int main() {
  constexpr int kTiles = @TILES@, kTilesS = @COLS@ / 8, kTilesO = @D@ / 8, cols = @COLS@, d = @D@;
  static const float S[] = @S@, V[] = @V@;
  static float m[32][2], l[32][2], o[32][kTilesO][4], P[32][kTilesS][4];
  for (int lane = 0; lane < 32; ++lane) m[lane][0] = m[lane][1] = -INFINITY, l[lane][0] = l[lane][1] = 0.f;
  for (int j = 0; j < kTiles; ++j) {
    warp_emulation::run_warp([&](int lane) {
      const int g = lane / 4, t = lane % 4;
      float s[kTilesS][4];
      for (int n = 0; n < kTilesS; ++n)  // the C layout: (row g + 8 (e / 2), column 8n + 2t + e % 2)
        for (int e = 0; e < 4; ++e) s[n][e] = S[(j * 16 + g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2];
      online_softmax_step<kTilesS, kTilesO>(s, m[lane], l[lane], o[lane], @SCALE@f);
      std::memcpy(P[lane], s, sizeof(s));
    });
    // O += P V, as the kernel's mma do it: row r of P is spread over the 4 lanes of its quad
    for (int lane = 0; lane < 32; ++lane)
      for (int n = 0; n < kTilesO; ++n)
        for (int e = 0; e < 4; ++e) {
          const int row = lane / 4 + 8 * (e / 2), col = 8 * n + 2 * (lane % 4) + e % 2;
          double acc = 0;
          for (int key = 0; key < cols; ++key) {
            const int owner = 4 * (row % 8) + key % 8 / 2;
            acc += double(P[owner][key / 8][2 * (row / 8) + key % 2]) * V[(j * cols + key) * d + col];
          }
          o[lane][n][e] += float(acc);
        }
    for (int lane = 0; lane < 32; ++lane) {
      std::printf("%d %d %.9g %.9g %.9g %.9g", j, lane, m[lane][0], m[lane][1], l[lane][0], l[lane][1]);
      for (int n = 0; n < kTilesS; ++n)
        for (int e = 0; e < 4; ++e) std::printf(" %.9g", P[lane][n][e]);
      for (int n = 0; n < kTilesO; ++n)
        for (int e = 0; e < 4; ++e) std::printf(" %.9g", o[lane][n][e]);
      std::printf("\n");
    }
  }
}
"""

# The driver's loop as a one-warp kernel: nvcc compiles it on every machine, a GPU runs it. Record (j, lane) of
# `out` holds m, l, P and o after tile j, as the emulation prints them.
_FRAG_KERNEL = r"""
__global__ void exercise_softmax_step_kernel(const float* S, const float* V, float* out, int tiles, float scale_log2) {
  constexpr int kTilesS = 4, kTilesO = 2, cols = 32, d = 16, width = 4 + 4 * kTilesS + 4 * kTilesO;
  __shared__ float P[32][kTilesS][4];
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[kTilesO][4] = {};
  for (int j = 0; j < tiles; ++j) {
    float s[kTilesS][4];
    for (int n = 0; n < kTilesS; ++n)
      for (int e = 0; e < 4; ++e) s[n][e] = S[(j * 16 + g + 8 * (e / 2)) * cols + 8 * n + 2 * t + e % 2];
    online_softmax_step<kTilesS, kTilesO>(s, m, l, o, scale_log2);
    for (int n = 0; n < kTilesS; ++n)
      for (int e = 0; e < 4; ++e) P[lane][n][e] = s[n][e];
    __syncwarp();
    for (int n = 0; n < kTilesO; ++n)  // O += P V, as the emulation's driver does it
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 8 * n + 2 * t + e % 2;
        float acc = 0.f;
        for (int key = 0; key < cols; ++key)
          acc += P[4 * (row % 8) + key % 8 / 2][key / 8][2 * (row / 8) + key % 2] * V[(j * cols + key) * d + col];
        o[n][e] += acc;
      }
    __syncwarp();
    float* rec = out + (j * 32 + lane) * width;
    rec[0] = m[0], rec[1] = m[1], rec[2] = l[0], rec[3] = l[1];
    for (int n = 0; n < kTilesS; ++n)
      for (int e = 0; e < 4; ++e) rec[4 + 4 * n + e] = s[n][e];
    for (int n = 0; n < kTilesO; ++n)
      for (int e = 0; e < 4; ++e) rec[4 + 4 * kTilesS + 4 * n + e] = o[n][e];
  }
}
"""
_FRAG_LAUNCH = r"""
void exercise_softmax_step_launch(const float* S, const float* V, float* out, int tiles, float scale_log2) {
  exercise_softmax_step_kernel<<<1, 32>>>(S, V, out, tiles, scale_log2);
}
"""

_FRAG_CPP = r"""
#include <torch/extension.h>
#include <cuda_runtime_api.h>
void exercise_softmax_step_launch(const float* S, const float* V, float* out, int tiles, float scale_log2);

torch::Tensor exercise_softmax_step(torch::Tensor s, torch::Tensor v, double scale_log2) {
  TORCH_CHECK(s.is_cuda() && v.is_cuda() && s.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32 && s.is_contiguous() && v.is_contiguous(),
              "exercise_softmax_step: s and v must be contiguous fp32 CUDA tensors");
  TORCH_CHECK(s.dim() == 3 && s.size(1) == 16 && s.size(2) == 32 && v.dim() == 3 && v.size(0) == s.size(0) &&
              v.size(1) == 32 && v.size(2) == 16, "exercise_softmax_step: s is tiles x 16 x 32, v tiles x 32 x 16");
  auto out = torch::empty({s.size(0) * 32, 4 + 16 + 8}, s.options());
  exercise_softmax_step_launch(s.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), s.size(0),
                               static_cast<float>(scale_log2));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "exercise_softmax_step: launch failed");
  return out;
}
"""


def _frag_array(values) -> str:
    return "{" + ", ".join("-INFINITY" if x == -np.inf else f"{float(x)!r}f" for x in np.ravel(values)) + "}"


def _refuse_course_code(source: str) -> None:
    """RefusedAnswer if `source` includes one of the course's CUDA headers or names its namespace."""
    from utils.course.exercises.refuse import RefusedAnswer

    course_files = {p.name for p in CUDA_DIR.rglob("*") if p.is_file()}
    for name in re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', source):
        if Path(name).name in course_files:
            raise RefusedAnswer(f"the check refuses the course's own `{name}`: it holds the kernel this exercise "
                                f"asks for; write the step with your own code")
    if "course_flash" in source:
        raise RefusedAnswer("the check refuses the course's own namespace `course_flash`: it holds the kernel "
                            "this exercise asks for; write the step with your own code")


def _frag_where(row: int, lane: int) -> str:
    return f"row {row} (lanes {4 * (row % 8)}–{4 * (row % 8) + 3}, r={row // 8})"


def check_online_softmax_fragments(source: str) -> None:
    """Exercise 6b.5: `source` defines `online_softmax_step<kTilesS, kTilesO>(s, m, l, o, scale_log2)`, one
    warp's online-softmax step on the C fragments of a 16-row key tile. Runs it in the emulated warp over a
    sequence of tiles (m, l and o carried, O += P V between them), and on a GPU as a one-warp kernel, and
    compares with float64. Raises AssertionError naming the tile, row, lane and register that are wrong."""
    if not isinstance(source, str):
        raise TypeError("source must be the CUDA source string of the exercise")
    _refuse_course_code(source)
    kernel = _SOFTMAX_INCLUDES + _FRAG_PRELUDE + source + _FRAG_KERNEL + _FRAG_LAUNCH
    nvcc_compile(kernel)
    s, v = _frag_data()
    driver = (_FRAG_DRIVER.replace("@TILES@", str(_FRAG_TILES)).replace("@COLS@", str(_FRAG_COLS))
              .replace("@D@", str(_FRAG_D)).replace("@S@", _frag_array(s)).replace("@V@", _frag_array(v))
              .replace("@SCALE@", repr(_FRAG_SCALE_LOG2)))
    out = run_emulated(_FRAG_PRELUDE + source + driver)
    rows = np.array([line.split() for line in out.split("\n") if line], dtype=np.float64)
    _frag_compare(rows, s, v, "")
    if _gpu_available():
        import torch

        ext = _load_inline("softmax_step", _FRAG_CPP, kernel, ["exercise_softmax_step"])
        records = ext.exercise_softmax_step(torch.from_numpy(s).cuda(), torch.from_numpy(v).cuda(),
                                            _FRAG_SCALE_LOG2).cpu().double().numpy()
        index = np.array([(j, lane) for j in range(_FRAG_TILES) for lane in range(32)], dtype=np.float64)
        _frag_compare(np.hstack([index, records]), s, v, "on the GPU: ")


def _frag_compare(rows: np.ndarray, s: np.ndarray, v: np.ndarray, where: str) -> None:
    """Compare the records (tile, lane, m[2], l[2], P, o) of a run with float64; AssertionError at the first
    wrong value, prefixed by `where`."""
    k_s, k_o = _FRAG_COLS // 8, _FRAG_D // 8
    width = 6 + 4 * k_s + 4 * k_o
    if rows.shape != (_FRAG_TILES * 32, width):
        raise AssertionError(f"the emulation printed {rows.shape} values, expected {(_FRAG_TILES * 32, width)}")
    want = _frag_reference(s, v)
    close = lambda a, b: np.isclose(a, b, rtol=1e-4, atol=1e-5) | ((a == b) & np.isinf(b))
    for j in range(_FRAG_TILES):
        got = rows[j * 32:(j + 1) * 32]
        m_ref, p_ref, l_ref, o_ref = want[j]
        m_prev = want[j - 1][0] if j else np.full(16, -np.inf)
        tile = f"{where}tile {j} of {_FRAG_TILES} (m, l and o carried across the tiles)"
        # m: every lane of a quad holds its rows' running max
        for lane in range(32):
            for r in range(2):
                row = lane // 4 + 8 * r
                if not close(got[lane, 2 + r], m_ref[row]):
                    own = max(s[j, row, 8 * n + 2 * (lane % 4) + e] for n in range(k_s) for e in range(2))
                    why = ""
                    if np.isclose(got[lane, 2 + r], own) and own != s[j, row].max():
                        why = (". That is the max of this lane's own entries: the other three lanes of the "
                               "quad hold the rest of the row")
                    elif np.isclose(got[lane, 2 + r], s[j, row].max()):
                        why = (f". That is this tile's max; the running max before it was {m_prev[row]:.6g}, and "
                               f"the max of all keys so far is never smaller")
                    raise AssertionError(f"{tile}, {_frag_where(row, lane)}: lane {lane} m[{r}] holds "
                                         f"{got[lane, 2 + r]:.6g}, expected {m_ref[row]:.6g}{why}")
        # P, in place of s
        got_p = np.empty((16, _FRAG_COLS))
        got_o = np.empty((16, _FRAG_D))
        for lane in range(32):
            for n in range(k_s):
                for e in range(4):
                    got_p[lane // 4 + 8 * (e // 2), 8 * n + 2 * (lane % 4) + e % 2] = got[lane, 6 + 4 * n + e]
            for n in range(k_o):
                for e in range(4):
                    got_o[lane // 4 + 8 * (e // 2), 8 * n + 2 * (lane % 4) + e % 2] = got[lane, 6 + 4 * k_s + 4 * n + e]
        ok = close(got_p, p_ref)
        if not ok.all():
            row, col = (int(x[0]) for x in np.nonzero(~ok))
            lane, n, e = 4 * (row % 8) + col % 8 // 2, col // 8, 2 * (row // 8) + col % 2
            why = ""
            if close(got_p[row], _frag_reference(s, v, fold_scale=False)[j][1][row]).all():
                why = (". These are 2^(s − m) without the softmax scale: fold scale·log₂ e (scale_log2) into the "
                       "exponent, for s and m alike")
            elif np.isnan(got_p[row]).any():
                why = (". NaN: this row has no visible key yet (its max is −∞), and −∞ − (−∞) is NaN. Subtract 0 "
                       "instead when the max is −∞")
            raise AssertionError(f"{tile}, {_frag_where(row, lane)}: P wrong in columns "
                                 f"{_spans(np.flatnonzero(~ok[row]).tolist())} of that row; lane {lane} s[{n}][{e}] "
                                 f"(column {col}) holds {got_p[row, col]:.6g}, expected {p_ref[row, col]:.6g}{why}")
        # l: each lane keeps its part; the quad's four parts add up to the row sum
        for row in range(16):
            lanes = [4 * (row % 8) + t for t in range(4)]
            total = got[lanes, 4 + row // 8].sum()
            if not close(total, l_ref[row]):
                why = ""
                if np.isclose(total, 4 * l_ref[row], rtol=1e-4):
                    why = (". That is 4 times the row sum: each lane keeps only the sum of its own entries; the "
                           "kernel adds the quad's four parts once, after the last tile")
                elif np.isclose(total, _frag_reference(s, v, rescale=False)[j][2][row], rtol=1e-4):
                    why = (f". The max of this row grew from {m_prev[row]:.6g} to {m_ref[row]:.6g} here: the sum "
                           f"so far was taken against the old max")
                raise AssertionError(f"{tile}, {_frag_where(row, lanes[0])}: the four lanes' l[{row // 8}] add up "
                                     f"to {total:.6g}, expected the row sum {l_ref[row]:.6g}{why}")
        ok = close(got_o, o_ref)
        if not ok.all():
            row, col = (int(x[0]) for x in np.nonzero(~ok))
            lane, n, e = 4 * (row % 8) + col % 8 // 2, col // 8, 2 * (row // 8) + col % 2
            why = ""
            if m_prev[row] != m_ref[row] and m_prev[row] != -np.inf:
                why = (f". The max of this row grew from {m_prev[row]:.6g} to {m_ref[row]:.6g} here: the row's "
                       f"accumulators were summed against the old max")
            raise AssertionError(f"{tile}, {_frag_where(row, lane)}: O (after O += P V) wrong; lane {lane} "
                                 f"o[{n}][{e}] (column {col}) holds {got_o[row, col]:.6g}, expected "
                                 f"{o_ref[row, col]:.6g}{why}")
