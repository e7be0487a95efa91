// Hopper (sm_90a) building blocks of notebook 06c, each a thin wrapper around one PTX instruction:
//   smem_desc / swizzle   the 64-bit shared-memory matrix descriptor that wgmma reads its operands through,
//                         and the byte permutation (swizzle) of the tile it describes; both also run on the
//                         host, so tests compare them with utils/hopper.py's Python model
//   wgmma_*               the warpgroup matrix multiply: fence, issue (m64nNk16), commit, wait
// A warpgroup is 4 consecutive warps (128 threads) starting at a warp index divisible by 4; every wgmma
// instruction is executed by all 128 threads together ("sync.aligned").
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace course_hopper {

// Swizzle modes as wgmma's descriptor encodes them (bits 62-63): the width of the swizzled row in bytes.
enum class Swizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

__host__ __device__ constexpr uint32_t swizzle_bytes(Swizzle s) {
  return s == Swizzle::k128B ? 128 : s == Swizzle::k64B ? 64 : s == Swizzle::k32B ? 32 : 0;
}

// Where byte `offset` of a tile lands in shared memory. The 16-byte chunk index (address bits 4..6) is XORed
// with bits 7..9, the "row" of 128 bytes within a 1024-byte block: 128-byte swizzling uses all three bits,
// 64-byte two and 32-byte one. Consecutive rows then put the same column in different banks. The hardware
// applies it to absolute addresses, which is why a swizzled tile must start on a 1024-byte boundary.
__host__ __device__ constexpr uint32_t swizzle(uint32_t offset, Swizzle s) {
  const uint32_t mask = s == Swizzle::k128B ? 7u : s == Swizzle::k64B ? 3u : s == Swizzle::k32B ? 1u : 0u;
  return offset ^ (((offset >> 7) & mask) << 4);
}

// The descriptor: start address, leading- and stride-dimension byte offsets (each in 16-byte units, 14 bits),
// and the swizzle mode. For a K-major tile with 128-byte swizzling, the stride offset is the distance between
// groups of 8 rows (8 x 128 = 1024 bytes) and the leading offset is unused (K of one wgmma, 16 elements =
// 32 bytes, lies inside one swizzled row); it is set to 1 by convention.
__host__ __device__ constexpr uint64_t smem_desc(uint32_t smem_address, uint32_t leading_bytes,
                                                 uint32_t stride_bytes, Swizzle s) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 |
         static_cast<uint64_t>(s) << 62;
}

__device__ inline uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Ordinary stores to shared memory are seen by the tensor cores (the "async proxy") only after this fence.
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders this warpgroup's register and shared-memory accesses before the wgmma that follow.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving reads or writes of the accumulators across an asynchronous wgmma.
template <int R>
__device__ inline void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 64 fp32, 32 registers a thread) += A (64 x 16, shared) * B (16 x 64, shared; stored N x K, K-major).
// accumulate == 0 ignores d's old value (D = A*B). Thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4
// and +8, columns 8*j + 2*(t%4) and +1 in d[4j..4j+3], the layout of mma.sync's accumulator repeated.
template <typename T>
__device__ inline void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#define COURSE_WGMMA_ASM(TYPES)                                                                                \
  asm volatile(                                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                             \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " "                                                  \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                       \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
        "+f"(d[30]), "+f"(d[31])                                                                               \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    COURSE_WGMMA_ASM("bf16.bf16");
  } else {
    COURSE_WGMMA_ASM("f16.f16");
  }
#undef COURSE_WGMMA_ASM
}

}  // namespace course_hopper
