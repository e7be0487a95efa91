// FlashAttention-2 forward, tiled (notebook 06): a block of 128 threads computes BR query rows of one
// (batch, head) against all the keys it may see, BC keys at a time.
//
//   shared memory:  Qs [BR][D+1]  the query tile, loaded once, pre-multiplied by sm_scale * log2(e)
//                   KVs[BC][D+1]  the current K tile, then (same buffer) the current V tile
//   registers:      each thread (ty, tx) of the 8 x 16 thread grid owns TM query rows (ty*TM + i) and
//                   - for S = Q K^T: the TM x TN scores of keys tx + 16*j  (j < TN)
//                   - for O:         the TM x D/16 outputs of columns tx + 16*dd (dd < D/16)
//                   - the online-softmax state m (row max) and l (this thread's part of the row sum)
//
// Rows are shared by the 16 threads of a half-warp, so row reductions are 4 shuffles (xor 8, 4, 2, 1) and
// the probabilities P reach the other threads of the row by shuffles, not shared memory. The +1 column of
// padding puts the 16 K rows a half-warp reads at once in 16 different banks. Compute is fp32 on CUDA
// cores (no tensor cores: that is the next step), whatever the input dtype.
//
// Causal masking is aligned bottom-right; tiles past the last key a block can see are never loaded (block
// skipping), tiles entirely visible skip the mask arithmetic, and blocks are launched heaviest first.
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_common.cuh"

namespace course_flash {

constexpr int kThreads = 128;        // 8 rows (ty) x 16 columns (tx) of threads
constexpr int kTY = 8, kTX = 16;

// Tile shapes per (padded) head dim, chosen so that (BR + BC) * (D + 1) * 4 bytes stays under 50 KB: this
// fits every GPU since Volta with the dynamic shared memory opt-in (a T4 allows 64 KB per block).
template <int D> struct TileConfig;
template <> struct TileConfig<32> { static constexpr int TM = 8, TN = 4; };   // BR 64, BC 64
template <> struct TileConfig<64> { static constexpr int TM = 8, TN = 4; };   // BR 64, BC 64
template <> struct TileConfig<128> { static constexpr int TM = 8, TN = 2; };  // BR 64, BC 32
template <> struct TileConfig<256> { static constexpr int TM = 4, TN = 1; };  // BR 32, BC 16

template <int D> __host__ __device__ constexpr int block_rows() { return kTY * TileConfig<D>::TM; }
template <int D> __host__ __device__ constexpr int block_cols() { return kTX * TileConfig<D>::TN; }
template <int D> __host__ __device__ constexpr int smem_bytes() {
  return (block_rows<D>() + block_cols<D>()) * (D + 1) * static_cast<int>(sizeof(float));
}

// Cooperative load of `rows` rows (from row0) of a (seq, head_dim) matrix into a [rows][D+1] fp32 tile.
// Consecutive threads read consecutive columns (coalesced); rows past `seqlen` and columns past the real
// head dim are zero-filled, so partial tiles need no special case later.
template <typename T, int D>
__device__ __forceinline__ void load_tile(float* tile, const T* src, long long row_stride, int row0, int rows,
                                          int seqlen, int head_dim, float scale) {
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, c = idx % D, row = row0 + r;
    tile[r * (D + 1) + c] = (row < seqlen && c < head_dim) ? to_float(src[row * row_stride + c]) * scale : 0.f;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_tiled_kernel(Params p) {
  constexpr int TM = TileConfig<D>::TM, TN = TileConfig<D>::TN;
  constexpr int BR = block_rows<D>(), BC = block_cols<D>(), LD = D + 1, DN = D / kTX;
  extern __shared__ float smem[];
  float* Qs = smem;
  float* KVs = smem + BR * LD;

  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int hk = h / (p.heads / p.kv_heads);  // GQA
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  T* out = static_cast<T*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1];

  // Causal: the last query blocks see the most keys; launching them first keeps the tail of the grid short.
  const int q_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int q0 = q_block * BR;
  const int offset = p.seqlen_k - p.seqlen_q;  // bottom-right alignment: row r sees keys <= r + offset

  load_tile<T, D>(Qs, q, p.q_stride[2], q0, BR, p.seqlen_q, p.head_dim, p.scale_log2);

  float o[TM][DN], m[TM], l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
#pragma unroll
    for (int dd = 0; dd < DN; ++dd) o[i][dd] = 0.f;
  }

  const int kv_end = kv_end_for_block(p, q0, BR);  // block skipping: later tiles are all masked
  for (int c0 = 0; c0 < kv_end; c0 += BC) {
    __syncthreads();  // Q is written (first tile) and the previous V tile is no longer read
    load_tile<T, D>(KVs, k, p.k_stride[2], c0, BC, p.seqlen_k, p.head_dim, 1.f);
    __syncthreads();

    // S = Q K^T for this thread's TM x TN scores (already in log2 units: Q carries scale * log2(e)).
    float s[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll 8
    for (int kk = 0; kk < D; ++kk) {
      float a[TM], bk[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) a[i] = Qs[(ty * TM + i) * LD + kk];
#pragma unroll
      for (int j = 0; j < TN; ++j) bk[j] = KVs[(tx + kTX * j) * LD + kk];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] += a[i] * bk[j];
    }

    // Mask only tiles that need it: past the last key, or crossing the causal diagonal of this block.
    const bool past_end = c0 + BC > p.seqlen_k;
    const bool crosses_diagonal = p.causal && c0 + BC - 1 > q0 + offset;
    if (past_end || crosses_diagonal) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int key = c0 + tx + kTX * j, row = q0 + ty * TM + i;
          if (key >= p.seqlen_k || (p.causal && key > row + offset)) s[i][j] = -CUDART_INF_F;
        }
    }

    // Online softmax: new row max over the 16 threads of the row, rescale the old state, exponentiate.
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float mt = s[i][0];
#pragma unroll
      for (int j = 1; j < TN; ++j) mt = fmaxf(mt, s[i][j]);
#pragma unroll
      for (int off = kTX / 2; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off, kTX));
      const float m_new = fmaxf(m[i], mt);
      const float ref = m_new == -CUDART_INF_F ? 0.f : m_new;  // a row with no visible key yet: exp2 -> 0
      const float alpha = exp2f(m[i] - ref);
      l[i] *= alpha;
#pragma unroll
      for (int dd = 0; dd < DN; ++dd) o[i][dd] *= alpha;
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        s[i][j] = exp2f(s[i][j] - ref);  // s now holds P
        l[i] += s[i][j];                 // partial sum; the 16 parts of a row are added once, at the end
      }
      m[i] = m_new;
    }

    __syncthreads();  // everyone is done with K before V overwrites it
    load_tile<T, D>(KVs, v, p.v_stride[2], c0, BC, p.seqlen_k, p.head_dim, 1.f);
    __syncthreads();

    // O += P V. Thread tx holds P for keys tx + 16*j; a shuffle hands each key's P to the whole row.
#pragma unroll
    for (int j = 0; j < TN; ++j) {
#pragma unroll 4
      for (int src = 0; src < kTX; ++src) {
        const float* vrow = KVs + (src + kTX * j) * LD + tx;
        float vv[DN];
#pragma unroll
        for (int dd = 0; dd < DN; ++dd) vv[dd] = vrow[kTX * dd];
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const float pij = __shfl_sync(0xffffffffu, s[i][j], src, kTX);
#pragma unroll
          for (int dd = 0; dd < DN; ++dd) o[i][dd] += pij * vv[dd];
        }
      }
    }
  }

  // Finish: add the 16 partial row sums, normalise, store (rows and columns in range only).
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    float li = l[i];
#pragma unroll
    for (int off = kTX / 2; off > 0; off /= 2) li += __shfl_xor_sync(0xffffffffu, li, off, kTX);
    const int row = q0 + ty * TM + i;
    if (row >= p.seqlen_q) continue;
    const float inv = li > 0.f ? 1.f / li : 0.f;  // a row that sees no key outputs 0
#pragma unroll
    for (int dd = 0; dd < DN; ++dd) {
      const int col = tx + kTX * dd;
      if (col < p.head_dim) out[row * p.o_stride[2] + col] = from_float<T>(o[i][dd] * inv);
    }
  }
}

template <typename T, int D>
cudaError_t launch_tiled_d(const Params& p, cudaStream_t stream) {
  constexpr int smem = smem_bytes<D>();
  auto kernel = flash_tiled_kernel<T, D>;
  if (smem > 48 * 1024) {  // above 48 KB a kernel must opt in to more dynamic shared memory
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((p.seqlen_q + block_rows<D>() - 1) / block_rows<D>(), p.batch * p.heads);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_tiled_t(const Params& p, cudaStream_t stream) {
  switch (padded_head_dim(p.head_dim)) {
    case 32: return launch_tiled_d<T, 32>(p, stream);
    case 64: return launch_tiled_d<T, 64>(p, stream);
    case 128: return launch_tiled_d<T, 128>(p, stream);
    default: return launch_tiled_d<T, 256>(p, stream);
  }
}

// Shared memory a launch needs, so the torch wrapper can refuse a GPU that has too little, with a message.
int flash_tiled_smem_bytes(int head_dim) {
  switch (padded_head_dim(head_dim)) {
    case 32: return smem_bytes<32>();
    case 64: return smem_bytes<64>();
    case 128: return smem_bytes<128>();
    default: return smem_bytes<256>();
  }
}

// Plain launcher, no torch types: the wrapper calls it, and it instantiates every kernel.
cudaError_t launch_flash_tiled(const Params& p, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16: return launch_tiled_t<__half>(p, stream);
    case DType::kBFloat16: return launch_tiled_t<__nv_bfloat16>(p, stream);
    default: return launch_tiled_t<float>(p, stream);
  }
}

}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: host C++ (load_inline cpp_sources)
#include "flash_torch.h"

torch::Tensor flash_tiled_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale) {
  if (q.is_cuda() && q.dim() == 4) {
    const int need = course_flash::flash_tiled_smem_bytes(static_cast<int>(q.size(3)));
    int allowed = 0;
    cudaDeviceGetAttribute(&allowed, cudaDevAttrMaxSharedMemoryPerBlockOptin, q.get_device());
    TORCH_CHECK(need <= allowed, "flash_tiled: head_dim ", course::num(q.size(3)), " needs ",
                course::num(need), " bytes of shared memory per block, this GPU allows ", course::num(allowed));
  }
  return course_flash::forward("flash_tiled", course_flash::launch_flash_tiled, q, k, v, causal, scale);
}
#endif
