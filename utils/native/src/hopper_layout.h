// Where a tile lives in shared memory for wgmma, and the descriptor wgmma finds it by (notebook 06c). Plain
// C++ that nvcc compiles for the GPU and any host compiler for the CPU, so utils/native/hopper.py's Python model, the
// tests and the exercise checks of notebook 06c run it on machines without a GPU.
#pragma once
#include <cstdint>
#if !defined(__CUDACC__)
#define __host__
#define __device__
#endif

namespace course_hopper {

// Swizzle modes as wgmma's descriptor encodes them (bits 62-63), named by the width of the swizzled row.
enum class Swizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// Where byte `offset` of a tile lands in shared memory. The 16-byte chunk index (address bits 4..6) is XORed
// with bits 7..9, the "row" of 128 bytes within a 1024-byte block: 128-byte swizzling uses all three bits,
// 64-byte two and 32-byte one. Consecutive rows then put the same column in different banks. The hardware
// applies it to absolute addresses, which is why a swizzled tile must start on a 1024-byte boundary.
__host__ __device__ constexpr uint32_t swizzle(uint32_t offset, Swizzle s) {
  const uint32_t mask = s == Swizzle::k128B ? 7u : s == Swizzle::k64B ? 3u : s == Swizzle::k32B ? 1u : 0u;
  return offset ^ (((offset >> 7) & mask) << 4);
}

// The descriptor: start address, leading- and stride-dimension byte offsets (each in 16-byte units, 14 bits),
// and the swizzle mode.
__host__ __device__ constexpr uint64_t smem_desc(uint32_t smem_address, uint32_t leading_bytes,
                                                 uint32_t stride_bytes, Swizzle s) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 |
         static_cast<uint64_t>(s) << 62;
}

// One 16-byte chunk of a 64 x 64 tile of 2-byte elements (64 rows of 128 bytes, 8 chunks each).
struct TileChunk {
  int row, col;        // the chunk's row and 16-byte column in the tile
  uint32_t smem_byte;  // where it goes, from the tile's (1024-byte aligned) start
};

#ifndef COURSE_EXERCISE_TILE_CHUNK  // exercise 6c.1 writes this one
// The i-th (0-3) of the 4 chunks thread tid (0-127) of a warpgroup copies. Consecutive threads take
// consecutive chunks of a row (each warp reads 4 whole rows: 512 contiguous bytes of global memory per row
// pair), and each chunk lands at its 128-byte swizzled position.
__host__ __device__ constexpr TileChunk tile_chunk(int tid, int i) {
  const int id = tid + 128 * i, row = id / 8, col = id % 8;
  return {row, col, swizzle(row * 128 + col * 16, Swizzle::k128B)};
}
#endif

#ifndef COURSE_EXERCISE_GEMM_DESC  // exercise 6c.2 writes this one
// The descriptor of K-slice `k_step` (16 elements = 32 bytes each) of a 64 x 64 K-major tile with 128-byte
// swizzling at shared address `tile`: the start moves 32 bytes per step inside the swizzled rows (the hardware
// swizzles the addresses it computes, so the XOR still lines up); groups of 8 rows are 8 x 128 = 1024 bytes
// apart (stride offset); the leading offset is unused by this layout (one K-slice lies inside a swizzled row)
// and set to 16 bytes by convention.
__host__ __device__ constexpr uint64_t gemm_desc(uint32_t tile, int k_step) {
  return smem_desc(tile + 32 * k_step, 16, 8 * 128, Swizzle::k128B);
}
#endif

#ifndef COURSE_EXERCISE_TILE_NEEDS_MASK  // exercise 6c.4 writes this one
// The attention kernel's step "softmax": does any score of a warpgroup's 64 query rows (the first is `first_row`)
// against tile `tile` of `keys` keys need masking? A key at or past Nk always does; with `causal`, so does a key
// after a row's diagonal (key > row + Nk - Nq, bottom-right aligned). The last key of the tile against the first
// row decides both. Where this is false, the kernel skips the per-score test.
__host__ __device__ constexpr bool tile_needs_mask(int tile, int keys, int first_row, int seqlen_q, int seqlen_k,
                                                   bool causal) {
  return keys * (tile + 1) > seqlen_k || (causal && keys * (tile + 1) - 1 > first_row + seqlen_k - seqlen_q);
}
#endif

}  // namespace course_hopper
