// The steps of the tensor-core backward's worklog (notebook 06bw, section 6), each the one before with one change,
// as flash_mma_steps.cuh is for the forward. flash_mma_bwd_kernel.cuh reads them; python -m utils.course.flatten
// writes each step alone, with its switches evaluated away, into steps/06b/bwd_sNN_<step>.cu.
#pragma once

namespace course_flash {

// Step 1: dQ by fp32 atomics from the dkdv kernel; 64 queries per step of its loop; one block per SM.
struct BwdAtomicDQ {
  static constexpr bool kAtomicDQ = true;
  static constexpr bool kMaskAfter = false;                         // step 7
  static constexpr bool kWarpTiles = false;                         // step 8
  static constexpr bool kHoisted = false;                           // step 9
  static constexpr bool kStoreMatrix = false;                       // step 11
  static constexpr bool kPairDQ = false;                            // step 12
  static constexpr bool kDQBetween = false;                         // step 13
  static constexpr bool kPaddedDQ = false;                          // step 15
  static constexpr int kUnrollD = 8;                                 // step 6: iterations of the k loops unrolled
  template <int D> static constexpr int rows() { return 64; }       // BR
  template <int D> static constexpr int min_blocks() { return 1; }  // blocks per SM asked of ptxas
};
// Step 2: dQ by a pass of its own (no atomics: deterministic; S and dP computed twice).
struct BwdDQPass : BwdAtomicDQ { static constexpr bool kAtomicDQ = false; };
// Step 3: step 1 with 32 queries per step: Sᵀ and dPᵀ take 16 registers each instead of 32, which ends the
// spills at D = 128 and leaves registers for fragments loaded ahead.
struct BwdNarrowRows : BwdAtomicDQ { template <int D> static constexpr int rows() { return 32; } };
// Step 4: step 3 with two blocks per SM at D = 64 (registers capped at 128).
struct BwdTwoBlocks : BwdNarrowRows {
  template <int D> static constexpr int min_blocks() { return D == 64 ? 2 : 1; }
};
// Step 5: each head dim with what paid for it: D = 64 step 4's, D = 128 step 1's 64 queries per step.
struct BwdPerHeadDim : BwdTwoBlocks { template <int D> static constexpr int rows() { return D == 64 ? 32 : 64; } };
// Step 6: the k loops of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ unrolled twice, not fully. Fully unrolled, the compiler
// hoisted every fragment address out of the query loop and spilled at D = 128 (images/06b_ncu_backward_h200.txt);
// with two iterations in flight the mma still overlap the next ldmatrix, and nothing spills.
struct BwdUnrollTwo : BwdPerHeadDim { static constexpr int kUnrollD = 2; };
// Step 7: Pᵀ's exponentials first and its mask after them, only in tiles the mask touches (probs_t, kMaskAfter).
// Written as `hidden ? 0 : exp2(..)` per element, as in Exercise 6b.8, each exp2 sits behind a branch: in the SASS of
// step 5's loop, 32 of its 48 convergence barriers (BSSY/BSYNC) wrap one exp2 each.
struct BwdMaskAfter : BwdPerHeadDim { static constexpr bool kMaskAfter = true; };
// Step 8: FlashAttention-2's warp tiles (flash_bwd_dkdv_tiled_kernel below). Each warp computes a 32 x 32 tile of
// Sᵀ and dPᵀ instead of 16 keys x 64 queries, so every fragment read from shared memory serves two mma, not one;
// Pᵀ and dSᵀ then go through shared memory, where dV, dK and dQ are tiled 32 x D/2, 32 x D/2 and 32 x D/4.
struct BwdWarpTiles : BwdMaskAfter {
  static constexpr bool kWarpTiles = true;
  template <int D> static constexpr int rows() { return 64; }
  template <int D> static constexpr int min_blocks() { return 1; }
};
// Step 9: the addresses worked out once. In step 8's loop, integer instructions outnumber the mma three to one:
// each copy and each ldmatrix recomputes its row, column and swizzle. Here every thread's copy rows and every
// lane's ldmatrix offsets are computed before the loop.
struct BwdHoisted : BwdWarpTiles { static constexpr bool kHoisted = true; };
// Step 10: at D = 64, 128 queries per step instead of 64 (FlashAttention-2's block there). Each warp's tile of Sᵀ
// and dPᵀ grows to 32 keys x 64 queries, so each fragment of K or V read from shared memory serves 8 mma, not 4;
// the loop runs half as many steps, with half the barriers per mma. At D = 128 dK and dV take 64 registers each,
// and the larger tiles of Sᵀ and dPᵀ would not fit beside them.
struct BwdWideQueries : BwdHoisted { template <int D> static constexpr int rows() { return D == 64 ? 128 : 64; } };
// Step 11: Pᵀ and dSᵀ into shared memory by stmatrix (sm_90), 16 instructions a step instead of 64 4-byte stores.
struct BwdStoreMatrix : BwdWideQueries { static constexpr bool kStoreMatrix = true; };
// Step 12: dQ added with 8-byte atomics, a pair of values per thread (add_dq_pairs). Step 1's 16-byte atomics first
// swap values between neighbouring lanes, and in step 11's machine code each atomic's registers are the next
// shuffle's: it must wait until the atomic has read them. Here the atomics read the accumulators themselves.
struct BwdPairDQ : BwdStoreMatrix { static constexpr bool kPairDQ = true; };
// Step 13: step 11 in FlashAttention-2's order: dV, then dQ and its atomics, then dK, so the atomics are in flight
// while dK's mma run instead of at the end of the step, before the barrier.
struct BwdDQBetween : BwdStoreMatrix { static constexpr bool kDQBetween = true; };
// Step 14: the kernel of step 11; lse2 and delta by a prepare kernel, dQ's scale and cast by a finish kernel
// (flash_mma_bwd.cu), each one pass over memory, instead of torch's casts, products and sums around it.
struct BwdPrepare : BwdStoreMatrix {};
// Step 15: dQ's fp32 accumulator padded as lse2 (to a multiple of 128 rows), so the atomics need no row test.
struct BwdPaddedDQ : BwdPrepare { static constexpr bool kPaddedDQ = true; };

}  // namespace course_flash
