// The steps of notebook 06b's worklog. Each step is the step before with one change, so the whole history of
// the kernel reads top to bottom here; flash_mma_kernel.cuh implements every change as an `if constexpr`
// branch marked "Step N", and utils/cuda/flash_mma_sN_<name>.cu compiles step N on its own.
#pragma once

namespace course_flash {

// Step 1: the tiled FlashAttention-2 kernel of notebook 06 on tensor cores. 4 warps, 16 query rows each (one
// m16 tile); S = Q K^T and O += P V with mma.sync.m16n8k16, fp32 accumulators; the online softmax works on
// the accumulator fragments in registers, and P goes from the S accumulators straight into the A operand of
// P V without touching shared memory. Fragments are read from shared memory one 32-bit word (V: one 16-bit
// element) at a time; tiles are row-major with no padding; loads are synchronous.
struct Step1Mma {
  static constexpr bool kLdmatrix = false;    // step 2
  static constexpr bool kSwizzle = false;     // step 3
  static constexpr bool kCpAsync = false;     // step 4
  static constexpr int kWarps = 4;            // step 5: query rows per block = 16 * kWarps * kRowTiles
  template <int D> static constexpr int block_cols() { return 64; }  // step 5: keys per tile
  static constexpr bool kExp2 = false;        // step 6
  static constexpr bool kCausalSkip = false;  // step 7
  static constexpr bool kSplitKV = false;     // step 8
  template <int D> static constexpr int min_blocks() { return 1; }  // step 9: blocks per SM asked of ptxas
  static constexpr int kRowTiles = 1;         // step 11: m16 tiles of query rows per warp
  template <int D> static constexpr bool q_in_regs() { return true; }  // step 11: Q's A fragments held throughout
  static constexpr bool kHoisted = false;     // step 12
  static constexpr bool kLateCopy = false;    // step 13
  template <int D> static constexpr bool rare_rescale() { return false; }  // step 14
  static constexpr bool kWholeTiles = false;  // step 15
};

// Step 2: ldmatrix. One instruction loads a whole 16x16 A fragment, or two 8-column B fragments, for the
// warp: 4 shared-memory instructions instead of 4 (Q, K) or 8 (V, which is read transposed) per fragment.
struct Step2Ldmatrix : Step1Mma { static constexpr bool kLdmatrix = true; };

// Step 3: swizzled shared memory. ldmatrix reads 8 rows of 16 bytes per phase; with rows of 128 or 256 bytes
// those 8 chunks fall in the same 4 banks (8-way conflicts). XOR-ing the chunk index with row % 8 spreads
// them over all 32 banks, at no cost in memory (padding would cost 1/8 of it).
struct Step3Swizzle : Step2Ldmatrix { static constexpr bool kSwizzle = true; };

// Step 4: cp.async double buffering. Two buffers for K and V: while the warps compute on tile j, the copy
// engine fills the other buffer with tile j + 1, global -> shared without a detour through registers.
struct Step4CpAsync : Step3Swizzle { static constexpr bool kCpAsync = true; };

// Step 5: larger tiles. 8 warps, 128 query rows per block: every K/V tile loaded from memory serves twice
// the rows. And 128 keys per tile: half the loop iterations, barriers and rescalings of O per key.
struct Step5Tiles : Step4CpAsync {
  static constexpr int kWarps = 8;
  template <int D> static constexpr int block_cols() { return 128; }
};

// Step 6: exp2 with the scale folded in. softmax(scale * s) = 2^(scale * log2(e) * s - m'): one FFMA and one
// MUFU.EX2 per score, instead of a subtraction, a multiplication and expf's range reduction.
struct Step6Exp2 : Step5Tiles { static constexpr bool kExp2 = true; };

// Step 7: causal block skipping. Tiles above the diagonal are never loaded or computed, only the tiles that
// cross it are masked, and the query blocks with the most work are launched first.
struct Step7CausalSkip : Step6Exp2 { static constexpr bool kCausalSkip = true; };

// Step 8: K and V in separate cp.async groups. One group carried both, so S = Q K^T waited for V as well; now
// the scores start as soon as K has landed, and V's copy overlaps them and the softmax (for one more barrier).
struct Step8SplitKV : Step7CausalSkip { static constexpr bool kSplitKV = true; };

// Step 9: two blocks per SM at D = 64. __launch_bounds__(256, 2) caps the registers at 128 a thread, so two
// blocks' warps fit on an SM; 64-key tiles (S: 32 floats a thread instead of 64) keep that within 128 registers
// without spilling, and halve the shared memory (48 KB a block). D = 128 keeps one block of 128-key tiles.
struct Step9Occupancy : Step8SplitKV {
  template <int D> static constexpr int min_blocks() { return D == 64 ? 2 : 1; }
  template <int D> static constexpr int block_cols() { return D == 64 ? 64 : 128; }
};

// Step 10: step 9 with step 8 undone. Step 8's second copy group cost 11-14 % (one more block-wide barrier per
// tile, for a wait on V that double buffering had already hidden); step 9's two blocks per SM won 13-17 % back.
// Keeping the second and dropping the first asks whether the two gains add up.
struct Step10OneGroup : Step9Occupancy { static constexpr bool kSplitKV = false; };

// Step 11: two m16 tiles of query rows per warp, on step 7. An ldmatrix of K or V now feeds one mma per row
// tile, so 32 rows a warp halve the shared-memory reads per mma; shared memory was the unit Nsight Compute found
// busiest at step 7 (63 %). The second tile costs a second O and S in registers, so the tiles shrink to keep a
// thread's S + O at 128 (D = 64) or 192 floats (D = 128): 4 warps x 32 rows x 64 keys, two blocks of 128 threads
// per SM, the shape FlashAttention-2 uses on sm_80+ (Dao, 2023; its flash_fwd_launch_template.h). At D = 128
// the 64 registers of Q's fragments do not fit beside them: Q is read from shared memory at every k-step.
struct Step11WarpRows : Step7CausalSkip {
  static constexpr int kWarps = 4;
  static constexpr int kRowTiles = 2;
  template <int D> static constexpr bool q_in_regs() { return D == 64; }
  template <int D> static constexpr int block_cols() { return 64; }
};

// Step 12: every address worked out once, on step 11. Step 11's loop holds about 6.8 instructions per mma at
// D = 128 and 10 at D = 64 (static SASS; Nsight Compute counts 6.4 executed at D = 128), most of them integer
// arithmetic: load_tile works out the row, column and swizzle of every 16-byte copy in a loop of unknown trip
// count, and load_a / load_b_k / load_b_v the swizzled address of every ldmatrix. Here the copies go through
// copy_rows (a thread's rows are a multiple of 8 apart, so they share one swizzle) and the ldmatrix addresses
// through LaneOffsets (four offsets per lane cover every 16 x 16 block): the backward's step 9, applied to the
// forward.
struct Step12Hoisted : Step11WarpRows { static constexpr bool kHoisted = true; };

// Step 13: the next tile's copies requested after S = Q K^T instead of before it. After each tile's barrier, step 12
// first issues 16 copies (about a hundred instructions with their addresses and checks) and only then the first
// mma, so the tensor pipe waits on them. Requested after S's mma, the copies issue beside the softmax, and they
// still have a whole tile's P V and the next barrier to land. (The buffer they fill is free: every warp passed
// this tile's barrier, so none still reads tile j - 1.)
struct Step13LateCopy : Step12Hoisted { static constexpr bool kLateCopy = true; };

// Step 14: O rescaled only when a row's maximum grows by more than 2^8, at D = 128. Each tile, step 13 multiplies all
// of O by alpha: 128 FMUL a thread at D = 128, one in ten of the loop's instructions, though after the first few
// tiles the running maximum seldom moves much. Here a warp keeps its stale maxima unless one of its rows' grew by
// more than kRescaleLog2 (log2 units): P's entries are then at most 2^8, harmless in fp32 and in 16-bit P, and the
// final 1 / l and the log-sum-exp use the same stale maximum, so it cancels exactly. The threshold is
// FlashAttention-4's (rescale_threshold = 8.0 for 16-bit inputs in flash_attn/cute/flash_fwd_sm100.py), where a
// thread owns a row and each row decides alone. Here a row spans four lanes and the saving is the multiplications a
// warp skips, which it skips only if all its lanes do: the warp votes (__any_sync), and when one row outgrows its
// maximum, all move. At D = 64 O is half as large, and the vote and the branch cost more than they save (0.96-1.00x
// step 13, an exploratory run): D = 64 keeps step 13's softmax.
struct Step14RareRescale : Step13LateCopy {
  template <int D> static constexpr bool rare_rescale() { return D == 128; }
};

// Step 15: whole tiles copied without row checks. copy_rows tests every row against the end of the sequence and
// selects a dummy source for rows past it: about 50 instructions per K/V tile, for a case that arises in one tile
// per block at most. A tile that lies wholly inside the sequence now takes a branch without those checks.
struct Step15WholeTiles : Step14RareRescale { static constexpr bool kWholeTiles = true; };

}  // namespace course_flash
