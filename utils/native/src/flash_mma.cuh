// The tensor-core primitives of notebook 06b, each a few lines of inline PTX (compiled by nvcc only, sm_80+).
//
//   mma_16816      D(16x8, fp32) += A(16x16, row-major) * B(16x8, column-major), A and B fp16 or bf16
//   ldmatrix_x4    four 8x8 matrices of 16-bit elements from shared memory into the fragment layout of mma
//                  (ldmatrix_x4_at: at an address worked out by the caller, with LaneOffsets)
//   cp_async_16    16 bytes global -> shared memory without passing through registers (Ampere's cp.async)
//   smem_offset    where element (row, col) of a [rows][D] tile lives, plain or XOR-swizzled
//   fast_exp2      the hardware 2^x (MUFU.EX2), one instruction
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), for lane = 4 * g + t (g = lane / 4 is the
// "group", t = lane % 4 the thread in the group); each 32-bit register holds two consecutive 16-bit elements:
//   A: a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]     a[2] = A[g][2t+8, 2t+9]     a[3] = A[g+8][2t+8, 2t+9]
//   B: b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
//   C: c[0], c[1] = C[g][2t, 2t+1]                           c[2], c[3] = C[g+8][2t, 2t+1]       (fp32)
// So a thread owns two rows of every accumulator tile, g and g + 8, and the four threads of a group share them.
#pragma once
#include "flash_common.cuh"
#include <cstdint>

namespace course_flash {

// Not volatile: an mma reads and writes registers only, so the compiler may schedule it freely. The memory
// instructions below are volatile, so that none is moved across a barrier or merged with an earlier one.
template <typename T> __device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                                               const uint32_t (&b)[2]);

template <> __device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                             const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                                    const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Lane l gives the address of row l % 8 of matrix l / 8; register i receives matrix i in the layout of a
// C fragment of an 8x8 tile: lane 4g + t gets row g, columns 2t and 2t+1. `.trans` transposes each matrix
// on the way, which turns row-major V into the column-major B operand of P V.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row_address)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row_address)));
}

// ldmatrix at a shared-memory address (the forward's step 12 and the backward's step 9 work it out themselves).
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t address, bool trans) {
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// The inverse of ldmatrix_x4 (sm_90's stmatrix): lane l gives the address of row l % 8 of matrix l / 8, and
// register i holds this lane's two values of matrix i, in the C fragment layout. One instruction for 4 stores.
// Callers test __CUDA_ARCH__ first; older GPUs have no such instruction.
__device__ __forceinline__ void stmatrix_x4(uint32_t address, const uint32_t (&r)[4]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#else
  __trap();
#endif
}

// An x4 read of two n8 B tiles: matrices 0, 1 are tile 0's two k-halves, matrices 2, 3 tile 1's.
__device__ __forceinline__ void b_pair(uint32_t (&b)[2][2], const uint32_t (&r)[4]) {
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}

// 16 bytes, or 16 zero bytes when !valid (src-size 0: nothing is read, so `src` only has to be some address).
// `.cg` caches in L2 only: K and V tiles are reused by other blocks through L2, never by this SM's L1.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(Pending) : "memory");
}

// Element (row, col) of a [rows][D] tile of 16-bit values. Rows of D = 64 or 128 elements are 128 or 256
// bytes, a multiple of the 32 banks x 4 bytes, so column c of every row sits in the same bank: the 8 rows an
// ldmatrix phase reads collide 8 ways. Swizzled, the 16-byte chunk c / 8 of row r moves to chunk
// (c / 8) XOR (r % 8): 8 consecutive rows put a given chunk in 8 different places, which cover all 32 banks.
template <int D, bool kSwizzle> __device__ __forceinline__ int smem_offset(int row, int col) {
  static_assert(D % 64 == 0, "the swizzle permutes groups of 8 chunks of 16 bytes");
  if constexpr (kSwizzle) return row * D + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
  else return row * D + col;
}

// Where a lane's ldmatrix reads in a swizzled [rows][D] tile, in bytes, for the 16 x 16 block at row r0 (a multiple
// of 8) and column k0 (a multiple of 16): r0·2D + 2·(k0 − k0 % 64) + at[k0 % 64 / 16]. The swizzle only permutes
// the 8 chunks of one row's 64 columns, and rows 8 apart alike, so four offsets per lane, computed once, cover
// every block (forward step 12, backward step 9). `row` and `col` are the lane's row and column in the block at
// (0, 0), as in load_a.
template <int D> struct LaneOffsets {
  uint32_t at[4];
  __device__ __forceinline__ LaneOffsets(int row, int col) {
#pragma unroll
    for (int b = 0; b < 4; ++b) at[b] = 2 * smem_offset<D, true>(row, col + 16 * b);
  }
  __device__ __forceinline__ uint32_t operator()(int r0, int k0) const {
    return r0 * 2 * D + 2 * (k0 - k0 % 64) + at[k0 % 64 / 16];
  }
};

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x on the SFU; 2^-inf = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats -> one register of two 16-bit values, the lower column in the lower half (as mma expects).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace course_flash
