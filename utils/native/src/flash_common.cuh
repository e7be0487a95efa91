// Device code shared by the kernels of flash_naive.cu and flash_tiled.cu (compiled by nvcc only): dtype
// conversions and the causal block-skipping rule.
#pragma once
#include "flash_params.h"
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

namespace course_flash {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Bottom-right causal alignment: query i sees keys j <= i + (seqlen_k - seqlen_q).
// The keys a block of queries [q0, q0 + rows) needs are [0, kv_end): later tiles are skipped entirely.
__host__ __device__ inline int kv_end_for_block(const Params& p, int q0, int rows) {
  if (!p.causal) return p.seqlen_k;
  const int end = q0 + rows + (p.seqlen_k - p.seqlen_q);
  return end < 0 ? 0 : (end < p.seqlen_k ? end : p.seqlen_k);
}

}  // namespace course_flash
