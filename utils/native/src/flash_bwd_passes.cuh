// The passes around a backward's main kernel, on CUDA cores: the prepare pass before it (lse2 and delta from the
// forward's lse and O and from dO) and the finish pass after it (dQ scaled and cast from its fp32 accumulator).
// Notebook 06bw's tensor-core backward (flash_mma_bwd.cu, from step 14) and 06c's backward on wgmma
// (hopper_backward.cu) both launch them.
#pragma once
#include "flash_mma.cuh"  // pack2; to_float, DType, BwdPrepareParams (flash_common.cuh, flash_params.h)

namespace course_flash {

// The prepare pass (06bw step 14; FlashAttention-2 has one too): per row of the padded (batch · heads, padded_q), lse2 =
// lse · log2 e (+inf where lse = -inf: the row sees no key) and delta = rowsum(dO ∘ O) in fp32; +inf and 0 in the
// padding. One pass over dO and O, instead of torch's casts, product and sum. kLanes threads share a row, each
// reading 8 elements (16 bytes) at a time, and add up their sums by shuffles.
// A block's rows lie in one head (padded_q is a multiple of them), so the head and row come from the block index by
// 32-bit divisions: 64-bit ones, a subroutine of many instructions, set the pass's time before memory did.
__host__ __device__ constexpr int prepare_rows(int head_dim) { return 256 / (head_dim / 8); }  // a block's rows
template <typename T, int D>
__global__ void __launch_bounds__(256) flash_bwd_prepare_kernel(BwdPrepareParams pp) {
  constexpr int kLanes = D / 8, kRows = prepare_rows(D);  // kLanes: 8 (D = 64) or 16 (D = 128), 16 bytes each
  const unsigned blocks_a_head = static_cast<unsigned>(pp.padded_q / kRows);
  const int bh = static_cast<int>(blockIdx.x / blocks_a_head), lane = threadIdx.x % kLanes;
  const int n = static_cast<int>(blockIdx.x % blocks_a_head) * kRows + threadIdx.x / kLanes;
  const int b = bh / pp.heads, h = bh % pp.heads;
  const long long row = static_cast<long long>(bh) * pp.padded_q + n;
  float sum = 0.f;
  if (n < pp.seqlen_q) {
    const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const T*>(pp.dout) + b * pp.do_stride[0] +
                                                   h * pp.do_stride[1] + n * pp.do_stride[2] + lane * 8);
    const uint4 y = *reinterpret_cast<const uint4*>(static_cast<const T*>(pp.o) + b * pp.o_stride[0] +
                                                   h * pp.o_stride[1] + n * pp.o_stride[2] + lane * 8);
    const T* xs = reinterpret_cast<const T*>(&x);
    const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum = fmaf(to_float(xs[i]), to_float(ys[i]), sum);
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const float lse = n < pp.seqlen_q ? pp.lse[static_cast<long long>(bh) * pp.seqlen_q + n] : -INFINITY;
    pp.lse2[row] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
    pp.delta[row] = sum;
  }
}

// The finish pass: dQ = scale · its fp32 accumulator, in T, 8 elements a thread. The accumulator has acc_rows
// rows a head: seqlen_q, or from step 15 seqlen_q padded as lse2's.
template <typename T, int D>
__global__ void __launch_bounds__(256) flash_bwd_finish_kernel(const float* accum, T* dq, long long rows,
                                                               int seqlen_q, int acc_rows, float scale) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;  // an 8-element chunk
  if (i >= rows * (D / 8)) return;
  const long long row = i / (D / 8), bh = row / seqlen_q;
  const int col = static_cast<int>(i % (D / 8)) * 8;
  const float* src = accum + (bh * acc_rows + row % seqlen_q) * D + col;
  const float4 a = *reinterpret_cast<const float4*>(src), c = *reinterpret_cast<const float4*>(src + 4);
  *reinterpret_cast<uint4*>(dq + row * D + col) = make_uint4(pack2<T>(a.x * scale, a.y * scale),
      pack2<T>(a.z * scale, a.w * scale), pack2<T>(c.x * scale, c.y * scale), pack2<T>(c.z * scale, c.w * scale));
}

template <typename T>
cudaError_t launch_prepare_t(const BwdPrepareParams& pp, cudaStream_t stream) {
  const long long blocks = pp.rows / prepare_rows(pp.head_dim);  // whole: launch_bwd_prepare checked padded_q
  if (pp.head_dim == 64) flash_bwd_prepare_kernel<T, 64><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(pp);
  else flash_bwd_prepare_kernel<T, 128><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(pp);
  return cudaGetLastError();
}

// Not inline: each extension's C++ wrapper, a translation unit of its own, calls these two, so the CUDA one must
// emit them. Include this header once per extension.
cudaError_t launch_bwd_prepare(const BwdPrepareParams& pp, DType dtype, cudaStream_t stream) {
  if (pp.head_dim != 64 && pp.head_dim != 128) return cudaErrorInvalidValue;
  if (pp.padded_q % prepare_rows(pp.head_dim) != 0 || pp.rows / prepare_rows(pp.head_dim) > INT32_MAX)
    return cudaErrorInvalidValue;  // blocks of one head's rows, and a grid that blockIdx.x can count
  if (pp.rows == 0) return cudaSuccess;
  return dtype == DType::kFloat16 ? launch_prepare_t<__half>(pp, stream) : launch_prepare_t<__nv_bfloat16>(pp, stream);
}

template <typename T>
cudaError_t launch_finish_t(const float* accum, void* dq, long long rows, int seqlen_q, int acc_rows, int head_dim,
                            float scale, cudaStream_t stream) {
  const long long blocks = (rows * (head_dim / 8) + 255) / 256;
  T* out = static_cast<T*>(dq);
  if (head_dim == 64)
    flash_bwd_finish_kernel<T, 64><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(accum, out, rows, seqlen_q,
                                                                                         acc_rows, scale);
  else
    flash_bwd_finish_kernel<T, 128><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(accum, out, rows, seqlen_q,
                                                                                          acc_rows, scale);
  return cudaGetLastError();
}

cudaError_t launch_bwd_finish(const float* accum, void* dq, long long rows, int seqlen_q, int acc_rows, int head_dim,
                              float scale, DType dtype, cudaStream_t stream) {
  if (head_dim != 64 && head_dim != 128) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return dtype == DType::kFloat16
             ? launch_finish_t<__half>(accum, dq, rows, seqlen_q, acc_rows, head_dim, scale, stream)
             : launch_finish_t<__nv_bfloat16>(accum, dq, rows, seqlen_q, acc_rows, head_dim, scale, stream);
}

}  // namespace course_flash
