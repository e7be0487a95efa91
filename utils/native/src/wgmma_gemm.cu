// Notebook 06c: one warpgroup multiplies on Hopper's tensor cores with wgmma. C = A Bᵀ in fp32 for
// A (M x K) and B (N x K), both fp16 or bf16 and row-major, i.e. "K-major": the layout of Q and K in QKᵀ.
//
// Each block computes a 64 x 64 tile of C with one warpgroup (128 threads). Per 64-wide slice of K:
//   1. the threads copy A's and B's 64 x 64 tiles (8 KB each) into shared memory, 16 bytes at a time, at the
//      128-byte-swizzled positions the descriptor promises (course_hopper::swizzle);
//   2. fence.proxy.async makes those ordinary stores visible to the tensor cores, __syncthreads to all warps;
//   3. four wgmma m64n64k16 (K = 16 each) read both tiles straight from shared memory through descriptors
//      whose start address moves 32 bytes (16 elements) per step, and accumulate into registers;
//   4. commit and wait: wgmma is asynchronous, and the next slice overwrites the tiles.
// Step 2 (kTma) replaces 1-2 with one thread issuing two TMA copies, which write the tiles already swizzled
// (the tensor map's swizzle mode is the descriptor's), and an mbarrier that everyone waits on until their bytes
// have arrived. No pipelining yet in either step: loads and multiplies take turns.
#ifndef COURSE_TORCH_WRAPPER
#include <cstdint>
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>
#include "hopper.cuh"

namespace course_hopper {

constexpr int kTile = 64;                       // rows of A and of B per block, and K per slice
constexpr int kTileBytes = kTile * kTile * 2;   // 8 KB: one 64 x 64 fp16/bf16 tile
constexpr int kSmemBytes = 2 * kTileBytes + 1024;  // + room to align the tiles to 1024 bytes

template <typename T, bool kTma>
__global__ void __launch_bounds__(128) wgmma_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                         const __grid_constant__ CUtensorMap map_a,
                                                         const __grid_constant__ CUtensorMap map_b,
                                                         float* __restrict__ c, int m, int n, int k) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The swizzle is a function of absolute address bits 4-9: align both tiles to 1024 bytes.
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t tile_a = smem_u32(smem), tile_b = tile_a + kTileBytes;
  const int tid = threadIdx.x, m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  __shared__ __align__(8) uint64_t arrived;  // step 2: the mbarrier that counts the bytes TMA delivered
  const uint32_t bar = smem_u32(&arrived);
  if constexpr (kTma) {
    if (tid == 0) mbarrier_init(bar, 1);
    __syncthreads();
  }
  int phase = 0;

  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;

  for (int k0 = 0; k0 < k; k0 += kTile) {
    if constexpr (kTma) {
      if (tid == 0) {  // one thread: expect both tiles' bytes, then start both copies
        mbarrier_arrive_expect(bar, 2 * kTileBytes);
        tma_load_2d(tile_a, &map_a, k0, m0, bar);
        tma_load_2d(tile_b, &map_b, k0, n0, bar);
      }
      mbarrier_wait(bar, phase);  // the barrier completes a phase per tile pair: 0, 1, 0, ...
      phase ^= 1;
    } else {
      // 512 chunks of 16 bytes per tile (64 rows x 8 chunks), 4 per thread (tile_chunk: which, and where to).
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const TileChunk c = tile_chunk(tid, i);
        *reinterpret_cast<uint4*>(smem + c.smem_byte) =
            *reinterpret_cast<const uint4*>(a + static_cast<size_t>(m0 + c.row) * k + k0 + c.col * 8);
        *reinterpret_cast<uint4*>(smem + kTileBytes + c.smem_byte) =
            *reinterpret_cast<const uint4*>(b + static_cast<size_t>(n0 + c.row) * k + k0 + c.col * 8);
      }
      fence_proxy_async();
      __syncthreads();
    }

    fence_registers(d);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kTile / 16; ++step) {  // K = 16 per wgmma
      wgmma_m64n64k16<T>(d, gemm_desc(tile_a, step), gemm_desc(tile_b, step), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(d);
    __syncthreads();  // every warp has finished reading the tiles before they are overwritten
  }

  // Thread t holds rows 16*(t/32) + (t%32)/4 (and +8), columns 8*j + 2*(t%4) (and +1) in d[4j..4j+3].
  const int row = m0 + 16 * (tid / 32) + (tid % 32) / 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = n0 + 8 * j + 2 * (tid % 4);
    *reinterpret_cast<float2*>(c + static_cast<size_t>(row) * n + col) = make_float2(d[4 * j], d[4 * j + 1]);
    *reinterpret_cast<float2*>(c + static_cast<size_t>(row + 8) * n + col) =
        make_float2(d[4 * j + 2], d[4 * j + 3]);
  }
}

template <typename T>
void launch_step(int step, const void* a, const void* b, const CUtensorMap& map_a, const CUtensorMap& map_b,
                 float* c, int m, int n, int k, cudaStream_t stream) {
  const dim3 grid(n / kTile, m / kTile);
  const T* ta = static_cast<const T*>(a);
  const T* tb = static_cast<const T*>(b);
  if (step == 2) {
    wgmma_gemm_kernel<T, true><<<grid, 128, kSmemBytes, stream>>>(ta, tb, map_a, map_b, c, m, n, k);
  } else {
    wgmma_gemm_kernel<T, false><<<grid, 128, kSmemBytes, stream>>>(ta, tb, map_a, map_b, c, m, n, k);
  }
}

// Plain launcher (no torch types): M, N, K multiples of 64, every pointer 16-byte aligned (checked by the
// wrapper); the tensor maps are read by step 2 only.
cudaError_t wgmma_gemm_launch(int step, bool bf16, const void* a, const void* b, const CUtensorMap& map_a,
                              const CUtensorMap& map_b, float* c, int m, int n, int k, cudaStream_t stream) {
  if (step != 1 && step != 2) return cudaErrorInvalidValue;
  if (bf16) {
    launch_step<__nv_bfloat16>(step, a, b, map_a, map_b, c, m, n, k, stream);
  } else {
    launch_step<__half>(step, a, b, map_a, map_b, c, m, n, k, stream);
  }
  return cudaGetLastError();
}

}  // namespace course_hopper

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"
#include "hopper_host.h"

namespace course_hopper {
cudaError_t wgmma_gemm_launch(int step, bool bf16, const void* a, const void* b, const CUtensorMap& map_a,
                              const CUtensorMap& map_b, float* c, int m, int n, int k, cudaStream_t stream);

// The tensor map of a row-major (rows, cols) 2-byte matrix, read in 64 x 64 boxes with 128-byte swizzling:
// the layout wgmma's descriptors expect, written by the copy engine itself.
inline CUtensorMap tile_map(const torch::Tensor& t) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0)) * 2};  // bytes between rows
  const cuuint32_t box[2] = {64, 64};
  return tensor_map("wgmma_gemm", t, 2, dims, strides, box);
}
}  // namespace course_hopper

// a (M, K) @ b (N, K)ᵀ -> (M, N) float32 on an sm_90 GPU, with step 1 (thread copies) or 2 (TMA) of notebook
// 06c. Checks everything before launching.
torch::Tensor wgmma_gemm_forward(torch::Tensor a, torch::Tensor b, int64_t step) {
  TORCH_CHECK(step == 1 || step == 2, "wgmma_gemm: step must be 1 (thread copies) or 2 (TMA), got ",
              course::num(step));
  for (const auto& [t, name] : {std::pair{a, "a"}, std::pair{b, "b"}}) {
    TORCH_CHECK(t.is_cuda(), "wgmma_gemm: ", name, " must be a CUDA tensor, got one on ", t.device());
    TORCH_CHECK(t.dim() == 2, "wgmma_gemm: ", name, " must have 2 dims, got shape ", course::shape(t.sizes()));
    TORCH_CHECK(t.scalar_type() == torch::kFloat16 || t.scalar_type() == torch::kBFloat16, "wgmma_gemm: ", name,
                " must be float16 or bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "wgmma_gemm: ", name,
                " must be contiguous and 16-byte aligned (call .contiguous() first)");
    TORCH_CHECK(t.size(0) % 64 == 0 && t.size(1) % 64 == 0 && t.size(0) > 0 && t.size(0) <= INT32_MAX &&
                t.size(1) <= INT32_MAX, "wgmma_gemm: ", name, "'s dims must be positive multiples of 64, got ",
                course::shape(t.sizes()));
  }
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "wgmma_gemm: a is ", a.scalar_type(), " but b is ",
              b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "wgmma_gemm: a is on ", a.device(), " but b is on ", b.device());
  TORCH_CHECK(a.size(1) == b.size(1), "wgmma_gemm: a has K = ", course::num(a.size(1)), " but b has K = ",
              course::num(b.size(1)));
  TORCH_CHECK(a.size(0) / 64 <= 65535, "wgmma_gemm: a has ", course::num(a.size(0)), " rows, more than the "
              "grid has rows of 64 (gridDim.y, at most 65535)");
  course_hopper::check_sm90("wgmma_gemm", a);
  const c10::cuda::CUDAGuard guard(a.device());
  auto c = torch::empty({a.size(0), b.size(0)}, a.options().dtype(torch::kFloat32));
  CUtensorMap map_a{}, map_b{};
  if (step == 2) map_a = course_hopper::tile_map(a), map_b = course_hopper::tile_map(b);
  const cudaError_t err = course_hopper::wgmma_gemm_launch(
      static_cast<int>(step), a.scalar_type() == torch::kBFloat16, a.data_ptr(), b.data_ptr(), map_a, map_b,
      c.data_ptr<float>(),
      static_cast<int>(a.size(0)), static_cast<int>(b.size(0)), static_cast<int>(a.size(1)),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "wgmma_gemm: launch failed: ", cudaGetErrorString(err));
  return c;
}
#endif
