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
  static constexpr bool kSplitKV = false;                           // step 18
  static constexpr bool kStagger = false;                           // step 19
  static constexpr int kUnrollD = 8;                                 // step 6: iterations of the k loops unrolled
  template <int D> static constexpr int rows() { return 64; }       // BR
  template <int D> static constexpr int min_blocks() { return 1; }  // blocks per SM asked of ptxas
  template <int D> static constexpr bool lse_by_thread() { return false; }  // step 16
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
// Step 16: lse2 and delta in shared memory in the order each thread reads them. A thread needs the values of 2 BR / 8
// queries, 8 apart in pairs: step 14 reads them with 8-byte loads, 16 a step at D = 64. Copied 4 bytes at a time
// to where thread t finds its values side by side, they take 16-byte loads, half as many instructions. At D = 64
// only: at D = 128 the values loaded ahead cost ptxas a spill.
struct BwdLseByThread : BwdPrepare { template <int D> static constexpr bool lse_by_thread() { return D == 64; } };
// Step 17: FlashAttention-2's dQ: its atomics between dV and dK (step 13), adding each thread's pairs with no shuffle
// (step 12). In step 16's profile, the shuffles and atomics that end each step take a sixth of the samples.
struct BwdPairsBetween : BwdLseByThread {
  static constexpr bool kDQBetween = true;
  static constexpr bool kPairDQ = true;
};
// Step 18 (on 14): dV in warps 0-3 and dK in warps 4-7, each over all D columns, instead of both in every warp over
// D / 2. A warp's k-step then reads 2 A fragments and D / 16 B fragments for D / 4 mma, not 4 and D / 8: a
// quarter fewer ldmatrix at D = 64, where step 14's phase of dV, dK and dQ waits on shared memory.
struct BwdSplitKV : BwdPrepare { static constexpr bool kSplitKV = true; };
// Step 19: each block starts its walk over the query blocks at a different one (block x at the (x mod per_head)-th,
// wrapping around). Until here every block of a head starts at the first, so the blocks that run together add their
// dQ into the same rows at the same time, and their atomics queue at the same addresses in L2.
struct BwdStagger : BwdSplitKV { static constexpr bool kStagger = true; };

}  // namespace course_flash
