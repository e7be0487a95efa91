// FlashAttention forward, naive version (notebook 06): one thread per query row.
//
// A block of kRows threads owns kRows consecutive queries of one (batch, head). Each thread keeps its query
// row q and its output accumulator o in registers (D floats each) and walks over the keys in tiles of BC
// rows, which the whole block loads into shared memory together. For every key a thread computes one score and
// updates its online-softmax state (running max m, running sum l), rescaling o by exp2(m_old - m_new).
// Nothing of size seqlen_k is ever stored.
//
// What makes it naive: a thread does D multiply-adds per score out of registers and shared memory, with no
// reuse of a K element across queries in registers, o is rescaled for every key (D extra multiplies), threads
// whose row ends early (causal) idle while the others work, and q[D] + o[D] floats per thread exceed the
// register file for D = 128, so ptxas spills to local memory (see compile_check in notebook 06). Head dims
// above 128 are refused: at 256 the spills would dominate (and the tiled kernel handles them).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_common.cuh"

namespace course_flash {

constexpr int kNaiveRows = 64;  // queries (= threads) per block

template <typename T, int D>
__global__ void __launch_bounds__(kNaiveRows) flash_naive_kernel(Params p) {
  constexpr int BC = 32;  // keys per tile: 2 * BC * D * 4 bytes of shared memory (32 KiB for D = 128)
  __shared__ float Ks[BC][D];
  __shared__ float Vs[BC][D];

  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int hk = h / (p.heads / p.kv_heads);  // GQA: consecutive query heads share a K/V head
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  T* o_ptr = static_cast<T*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1];

  const int q0 = blockIdx.x * kNaiveRows;
  const int row = q0 + threadIdx.x;
  const int d = p.head_dim;
  const int last_key = p.causal ? row + (p.seqlen_k - p.seqlen_q) : p.seqlen_k - 1;  // largest visible key

  float qr[D], o[D];
#pragma unroll
  for (int i = 0; i < D; ++i) {
    qr[i] = (row < p.seqlen_q && i < d) ? to_float(q[row * p.q_stride[2] + i]) * p.scale_log2 : 0.f;
    o[i] = 0.f;
  }
  float m = -CUDART_INF_F, l = 0.f;

  const int kv_end = kv_end_for_block(p, q0, kNaiveRows);  // uniform over the block: safe around barriers
  for (int c0 = 0; c0 < kv_end; c0 += BC) {
    __syncthreads();  // the previous tile has been used by every thread
    for (int idx = threadIdx.x; idx < BC * D; idx += kNaiveRows) {
      const int r = idx / D, c = idx % D, key = c0 + r;
      const bool ok = key < p.seqlen_k && c < d;  // zero-fill past the end: 0 * V must not meet NaN garbage
      Ks[r][c] = ok ? to_float(k[key * p.k_stride[2] + c]) : 0.f;
      Vs[r][c] = ok ? to_float(v[key * p.v_stride[2] + c]) : 0.f;
    }
    __syncthreads();

#pragma unroll 1  // the key loop stays a loop: unrolling it too would multiply the code (and compile time)
    for (int j = 0; j < BC; ++j) {
      const int key = c0 + j;
      if (key >= p.seqlen_k || key > last_key) break;  // keys only grow within a tile: the rest are masked
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < D; ++i) s += qr[i] * Ks[j][i];  // every thread reads the same Ks[j][i]: broadcast
      // Online softmax, one key at a time: the new running max, the factor that rescales what was summed
      // under the old max, then this key's weight. m starts at -inf, and exp2(-inf) = 0 wipes the empty state.
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new), pj = exp2f(s - m_new);
      l = l * alpha + pj;
#pragma unroll
      for (int i = 0; i < D; ++i) o[i] = o[i] * alpha + pj * Vs[j][i];
      m = m_new;
    }
  }

  if (row < p.seqlen_q) {
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that saw no key outputs 0
    T* out = o_ptr + row * p.o_stride[2];
#pragma unroll
    for (int i = 0; i < D; ++i)
      if (i < d) out[i] = from_float<T>(o[i] * inv);
  }
}

template <typename T>
cudaError_t launch_naive_t(const Params& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_q + kNaiveRows - 1) / kNaiveRows, p.batch * p.heads);
  switch (padded_head_dim(p.head_dim)) {
    case 32: flash_naive_kernel<T, 32><<<grid, kNaiveRows, 0, stream>>>(p); break;
    case 64: flash_naive_kernel<T, 64><<<grid, kNaiveRows, 0, stream>>>(p); break;
    default: flash_naive_kernel<T, 128><<<grid, kNaiveRows, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

// Plain launcher, no torch types: the wrapper calls it, and it instantiates every kernel.
cudaError_t launch_flash_naive(const Params& p, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16: return launch_naive_t<__half>(p, stream);
    case DType::kBFloat16: return launch_naive_t<__nv_bfloat16>(p, stream);
    default: return launch_naive_t<float>(p, stream);
  }
}

}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: host C++ (load_inline cpp_sources)
#include "flash_torch.h"

torch::Tensor flash_naive_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale) {
  TORCH_CHECK(q.dim() != 4 || q.size(3) <= 128, "flash_naive: head_dim ", course::num(q.size(3)),
              " is not supported; ",
              "supported: multiples of 8 up to 128");
  return course_flash::forward("flash_naive", course_flash::launch_flash_naive, q, k, v, causal, scale);
}
#endif
