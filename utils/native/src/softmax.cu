// Row softmax of a (rows, cols) float32 matrix, four ways: the case study of notebook 06.
//
//   softmax_smem         one block per row; max and sum reduced through shared memory (a tree, log2(256) steps
//                        with a __syncthreads each)
//   softmax_warp         one block per row; reductions with warp shuffles, shared memory only between warps
//   softmax_float4       softmax_warp with 16-byte float4 loads and stores where the rows allow them
//   softmax_row_per_warp one warp per row, no shared memory and no __syncthreads: for many short rows
//
// Each kernel reads the row three times (max, sum, normalise); the row is small enough to stay in L1/L2, so
// DRAM traffic is close to one read and one write.
//
// Two parts, one file: the kernels and their plain launcher, compiled by nvcc with no torch header (so
// utils.native.build.compile_check can compile them without a GPU or a CUDA build of torch); and, when
// COURSE_TORCH_WRAPPER is defined, the torch-facing wrapper, which load_inline compiles with the host C++
// compiler as its cpp_sources. Errors raised by TORCH_CHECK then never cross nvcc-compiled code.
#ifndef COURSE_TORCH_WRAPPER
#include <cstdint>
#include <cuda_runtime.h>
#include <math_constants.h>

namespace course_softmax {

constexpr int kThreads = 256;        // threads per block of the block-per-row kernels
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// ---- 1. shared-memory tree reduction ------------------------------------------------------------------
__global__ void softmax_smem(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
  __shared__ float buf[kThreads];
  const float* xr = x + static_cast<long long>(blockIdx.x) * cols;
  float* yr = y + static_cast<long long>(blockIdx.x) * cols;
  const int t = threadIdx.x;

  float m = -CUDART_INF_F;
  for (int c = t; c < cols; c += kThreads) m = fmaxf(m, xr[c]);
  buf[t] = m;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {  // 8 steps, each a barrier for the whole block
    if (t < half) buf[t] = fmaxf(buf[t], buf[t + half]);
    __syncthreads();
  }
  m = buf[0];
  __syncthreads();  // everyone has read buf[0] before it is overwritten below

  float s = 0.f;
  for (int c = t; c < cols; c += kThreads) s += __expf(xr[c] - m);
  buf[t] = s;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) buf[t] += buf[t + half];
    __syncthreads();
  }
  const float inv = 1.f / buf[0];
  for (int c = t; c < cols; c += kThreads) yr[c] = __expf(xr[c] - m) * inv;
}

// Block-wide reduction with shuffles: each warp reduces in registers, one value per warp goes through shared
// memory, and warp 0 reduces those. Two barriers instead of eight.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* warp_vals) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  v = lane < kWarps ? warp_vals[lane] : (kMax ? -CUDART_INF_F : 0.f);
  v = kMax ? warp_max(v) : warp_sum(v);  // every warp reduces the kWarps values: no second broadcast needed
  __syncthreads();                        // warp_vals may be reused by the next reduction
  return v;
}

// ---- 2. warp-shuffle reductions -----------------------------------------------------------------------
__global__ void softmax_warp(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
  __shared__ float warp_vals[kWarps];
  const float* xr = x + static_cast<long long>(blockIdx.x) * cols;
  float* yr = y + static_cast<long long>(blockIdx.x) * cols;

  float m = -CUDART_INF_F;
  for (int c = threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, xr[c]);
  m = block_reduce<true>(m, warp_vals);
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += kThreads) s += __expf(xr[c] - m);
  const float inv = 1.f / block_reduce<false>(s, warp_vals);
  for (int c = threadIdx.x; c < cols; c += kThreads) yr[c] = __expf(xr[c] - m) * inv;
}

// ---- 3. float4 loads and stores ------------------------------------------------------------------------
// One 16-byte instruction moves four floats: a quarter of the load/store instructions. Only legal when every
// row starts on a 16-byte boundary (cols % 4 == 0 and an aligned base pointer): the launcher checks and
// otherwise passes vec = false, and the kernel runs the scalar loops of softmax_warp.
__global__ void softmax_float4(const float* __restrict__ x, float* __restrict__ y, int rows, int cols, bool vec) {
  __shared__ float warp_vals[kWarps];
  const float* xr = x + static_cast<long long>(blockIdx.x) * cols;
  float* yr = y + static_cast<long long>(blockIdx.x) * cols;
  const int n4 = vec ? cols / 4 : 0;  // float4 chunks; the scalar loops take columns [4*n4, cols)
  const float4* xr4 = reinterpret_cast<const float4*>(xr);
  float4* yr4 = reinterpret_cast<float4*>(yr);

  float m = -CUDART_INF_F;
  for (int i = threadIdx.x; i < n4; i += kThreads) {
    const float4 v = xr4[i];
    m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
  }
  for (int c = 4 * n4 + threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, xr[c]);
  m = block_reduce<true>(m, warp_vals);

  float s = 0.f;
  for (int i = threadIdx.x; i < n4; i += kThreads) {
    const float4 v = xr4[i];
    s += __expf(v.x - m) + __expf(v.y - m) + __expf(v.z - m) + __expf(v.w - m);
  }
  for (int c = 4 * n4 + threadIdx.x; c < cols; c += kThreads) s += __expf(xr[c] - m);
  const float inv = 1.f / block_reduce<false>(s, warp_vals);

  for (int i = threadIdx.x; i < n4; i += kThreads) {
    const float4 v = xr4[i];
    yr4[i] = make_float4(__expf(v.x - m) * inv, __expf(v.y - m) * inv, __expf(v.z - m) * inv,
                         __expf(v.w - m) * inv);
  }
  for (int c = 4 * n4 + threadIdx.x; c < cols; c += kThreads) yr[c] = __expf(xr[c] - m) * inv;
}

// ---- 4. one warp per row -------------------------------------------------------------------------------
// A 128-column row gives a 256-thread block half a column each to do, and two barriers per reduction. A warp
// per row keeps all 32 lanes busy with 4 columns each and needs no barrier at all: the shuffles are the
// whole reduction.
__global__ void softmax_row_per_warp(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together, so the shuffles below see all 32 lanes
  const float* xr = x + static_cast<long long>(row) * cols;
  float* yr = y + static_cast<long long>(row) * cols;

  float m = -CUDART_INF_F;
  for (int c = lane; c < cols; c += 32) m = fmaxf(m, xr[c]);
  m = warp_max(m);
  float s = 0.f;
  for (int c = lane; c < cols; c += 32) s += __expf(xr[c] - m);
  const float inv = 1.f / warp_sum(s);
  for (int c = lane; c < cols; c += 32) yr[c] = __expf(xr[c] - m) * inv;
}

enum Variant { kSmem = 0, kWarp = 1, kFloat4 = 2, kRowPerWarp = 3 };

// Plain launcher (no torch types), called by the wrapper below.
cudaError_t launch(int variant, const float* x, float* y, int rows, int cols, cudaStream_t stream) {
  switch (variant) {
    case kSmem: softmax_smem<<<rows, kThreads, 0, stream>>>(x, y, rows, cols); break;
    case kWarp: softmax_warp<<<rows, kThreads, 0, stream>>>(x, y, rows, cols); break;
    case kFloat4: {
      const bool vec = cols % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(y) % 16 == 0;
      softmax_float4<<<rows, kThreads, 0, stream>>>(x, y, rows, cols, vec);
      break;
    }
    case kRowPerWarp:
      softmax_row_per_warp<<<(rows + kWarps - 1) / kWarps, kThreads, 0, stream>>>(x, y, rows, cols);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace course_softmax

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"

namespace course_softmax {
cudaError_t launch(int variant, const float* x, float* y, int rows, int cols, cudaStream_t stream);
}

// softmax over the last dim of a contiguous float32 CUDA tensor of 2 dims. Checks everything before launching.
torch::Tensor softmax_forward(torch::Tensor x, int64_t variant) {
  TORCH_CHECK(x.is_cuda(), "softmax: x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "softmax: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "softmax: x must have 2 dims (rows, cols), got ", course::num(x.dim()));
  TORCH_CHECK(x.is_contiguous(), "softmax: x must be contiguous (call .contiguous() first)");
  TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0, "softmax: x is empty, shape ", course::shape(x.sizes()));
  TORCH_CHECK(x.size(0) <= INT32_MAX && x.size(1) <= INT32_MAX, "softmax: x is too large, shape ", course::shape(x.sizes()));
  TORCH_CHECK(variant >= 0 && variant <= 3, "softmax: variant must be 0 (smem), 1 (warp), 2 (float4) or ",
              "3 (row_per_warp), got ", course::num(variant));
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  const cudaError_t err = course_softmax::launch(static_cast<int>(variant), x.data_ptr<float>(),
                                                 y.data_ptr<float>(), static_cast<int>(x.size(0)),
                                                 static_cast<int>(x.size(1)),
                                                 c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "softmax: launch failed: ", cudaGetErrorString(err));
  return y;
}
#endif
