// Notebook 06c, step 1: one warpgroup multiplies on Hopper's tensor cores with wgmma. C = A Bᵀ in fp32 for
// A (M x K) and B (N x K), both fp16 or bf16 and row-major, i.e. "K-major": the layout of Q and K in QKᵀ.
//
// Each block computes a 64 x 64 tile of C with one warpgroup (128 threads). Per 64-wide slice of K:
//   1. the threads copy A's and B's 64 x 64 tiles (8 KB each) into shared memory, 16 bytes at a time, at the
//      128-byte-swizzled positions the descriptor promises (course_hopper::swizzle);
//   2. fence.proxy.async makes those ordinary stores visible to the tensor cores, __syncthreads to all warps;
//   3. four wgmma m64n64k16 (K = 16 each) read both tiles straight from shared memory through descriptors
//      whose start address moves 32 bytes (16 elements) per step, and accumulate into registers;
//   4. commit and wait: wgmma is asynchronous, and the next slice overwrites the tiles.
// No pipelining yet (loads and multiplies take turns): the later steps of 06c add TMA and warp specialisation.
#ifndef COURSE_TORCH_WRAPPER
#include <cstdint>
#include <cuda_runtime.h>
#include "hopper.cuh"

namespace course_hopper {

constexpr int kTile = 64;                       // rows of A and of B per block, and K per slice
constexpr int kTileBytes = kTile * kTile * 2;   // 8 KB: one 64 x 64 fp16/bf16 tile
constexpr int kSmemBytes = 2 * kTileBytes + 1024;  // + room to align the tiles to 1024 bytes

template <typename T>
__global__ void __launch_bounds__(128) wgmma_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                         float* __restrict__ c, int m, int n, int k) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The swizzle is a function of absolute address bits 4-9: align both tiles to 1024 bytes.
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t tile_a = smem_u32(smem), tile_b = tile_a + kTileBytes;
  const int tid = threadIdx.x, m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;

  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;

  for (int k0 = 0; k0 < k; k0 += kTile) {
    // 512 chunks of 16 bytes per tile (64 rows x 8 chunks), 4 per thread; chunk (row, col) of a tile goes
    // to byte swizzle(row * 128 + col * 16): the row-th 128-byte row, its chunks permuted by the row.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int id = tid + 128 * i, row = id / 8, col = id % 8;
      const uint32_t at = swizzle(row * 128 + col * 16, Swizzle::k128B);
      *reinterpret_cast<uint4*>(smem + at) =
          *reinterpret_cast<const uint4*>(a + static_cast<size_t>(m0 + row) * k + k0 + col * 8);
      *reinterpret_cast<uint4*>(smem + kTileBytes + at) =
          *reinterpret_cast<const uint4*>(b + static_cast<size_t>(n0 + row) * k + k0 + col * 8);
    }
    fence_proxy_async();
    __syncthreads();

    fence_registers(d);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kTile / 16; ++step) {  // K = 16 per wgmma: 32 bytes further along each row
      const uint64_t desc_a = smem_desc(tile_a + step * 32, 16, 8 * 128, Swizzle::k128B);
      const uint64_t desc_b = smem_desc(tile_b + step * 32, 16, 8 * 128, Swizzle::k128B);
      wgmma_m64n64k16<T>(d, desc_a, desc_b, 1);
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

// Plain launcher (no torch types): M, N, K multiples of 64, every pointer 16-byte aligned (checked by the wrapper).
cudaError_t wgmma_gemm_launch(bool bf16, const void* a, const void* b, float* c, int m, int n, int k,
                              cudaStream_t stream) {
  const dim3 grid(n / kTile, m / kTile);
  if (bf16) {
    wgmma_gemm_kernel<__nv_bfloat16><<<grid, 128, kSmemBytes, stream>>>(
        static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), c, m, n, k);
  } else {
    wgmma_gemm_kernel<__half><<<grid, 128, kSmemBytes, stream>>>(static_cast<const __half*>(a),
                                                                 static_cast<const __half*>(b), c, m, n, k);
  }
  return cudaGetLastError();
}

}  // namespace course_hopper

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"

namespace course_hopper {
cudaError_t wgmma_gemm_launch(bool bf16, const void* a, const void* b, float* c, int m, int n, int k,
                              cudaStream_t stream);
}

// a (M, K) @ b (N, K)ᵀ -> (M, N) float32 on an sm_90 GPU. Checks everything before launching.
torch::Tensor wgmma_gemm_forward(torch::Tensor a, torch::Tensor b) {
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
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.get_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a.get_device());
  TORCH_CHECK(major == 9 && minor == 0, "wgmma_gemm: needs an sm_90 GPU (H100/H200: wgmma), this one is sm_",
              course::num(major), course::num(minor));
  const c10::cuda::CUDAGuard guard(a.device());
  auto c = torch::empty({a.size(0), b.size(0)}, a.options().dtype(torch::kFloat32));
  const cudaError_t err = course_hopper::wgmma_gemm_launch(
      a.scalar_type() == torch::kBFloat16, a.data_ptr(), b.data_ptr(), c.data_ptr<float>(),
      static_cast<int>(a.size(0)), static_cast<int>(b.size(0)), static_cast<int>(a.size(1)),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "wgmma_gemm: launch failed: ", cudaGetErrorString(err));
  return c;
}
#endif
