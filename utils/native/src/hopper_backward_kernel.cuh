// Notebook 06c's backward on Hopper's instructions (the worklog 07w's Gluon backward, utils/explicit/backward.py,
// in CUDA). With P = exp(S·scale − lse), S = Q Kᵀ and D = rowsum(dO ∘ O):
//
//   dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D)      dK = scale · dSᵀ Q      dQ = scale · dS K
//
// One block per 128 keys of one (batch, K/V head); it walks every query block of every query head of its GQA
// group, so dK and dV add up in registers. Three warpgroups:
//   warpgroup 0, the producer: one thread has TMA load the block's K and V once, then per query block Q, dO (in
//     128-byte swizzled panels of 64 columns) and the rows of lse2 and D into a ring of kStages stages;
//   warpgroups 1 and 2, the consumers: 64 keys each, in the transposed frame. Per query block:
//     Sᵀ = K Qᵀ and dPᵀ = V dOᵀ   wgmma, both operands in shared memory (as the forward's S = Q Kᵀ)
//     Pᵀ, then dV += Pᵀ dO         A = Pᵀ from registers, B = dO read N-major (as the forward's O += P V)
//     dSᵀ, then dK += dSᵀ Q        the same with dSᵀ and Q
//     dSᵀ to shared memory; once both consumers' halves are in (a named barrier over the two):
//     dQ = dS K                    A = dS read M-major out of dSᵀ, B = K read N-major: 64 x 64 per consumer
//     added to an fp32 dQ in global memory (the finish pass scales and casts it): by 8-byte atomics from the
//     threads (step "atomic_dq"), or staged in shared memory and added by TMA, two instructions per consumer
//     and tile (step "reduce_dq"); step "prefetch_s" also issues the next tile's Sᵀ once dQ is staged, so the
//     tensor cores work while dQ leaves. Step "bh_group" goes back to "reduce_dq" and, under a causal mask,
//     launches the blocks key block by key block over groups of kBhGroup (batch, K/V head)s. Step "stsm_ds" goes
//     back to "reduce_dq" and stores dSᵀ with stmatrix, four 8 x 8 tiles a warp instruction, not 4 bytes a thread.
//     Step "stsm_uniform" keeps "stsm_ds" and reads the warpgroup index from lane 0 (the forward's step 27).
//     Step "dq_first" keeps "stsm_uniform" and issues dQ before dK, as FlashAttention-3 does: dQ is staged
//     while dK still runs, where the tensor cores stood idle. Step "desc_add" keeps "stsm_uniform" and builds
//     each operand's wgmma descriptor once, then each K-slice's by one addition. Step "edge_mask" keeps
//     "desc_add" and masks in a branch of its own, taken only by the tiles on the diagonal or past Nk (the
//     forward's step 4): the others skip a compare and a select per score. Step "dv_late" keeps "edge_mask" and
//     issues dV after dS, as FlashAttention-3 and -4 do: P stays in fp32 until dS = P ∘ (dP − D) is in dP's
//     registers, so P's 16-bit fragments are never live beside Sᵀ and dPᵀ (at D = 64 ptxas spilled for them).
//     Step "late_prefetch" keeps "dv_late" and issues the next tile's Sᵀ while dQ leaves, as "prefetch_s" did,
//     but after the last tile too (on a stage no load refills), and waits for it before dPᵀ goes out: with
//     neither a branch around that wgmma nor a wait that counts groups across the loop, ptxas keeps the wgmmas
//     pipelined (it serialised "prefetch_s"). Step "late_group" keeps "late_prefetch" and, under a causal mask,
//     launches the blocks as "bh_group" does (the Gluon backward's choice at D = 128). Step "rows80" keeps
//     "late_prefetch" and at D = 128 takes 80 queries a tile, as FlashAttention-3 does: Sᵀ and dPᵀ are m64n80
//     wgmmas, dS goes to shared memory query-major (stmatrix .trans), and each consumer computes dQᵀ = Kᵀ dSᵀ for
//     its 64 columns of D (M = 64 columns, N = 80 queries), staged transposed for TMA's add. Step
//     "rows80_group" keeps "rows80" and, under a causal mask, launches the blocks as "bh_group" does. Step
//     "late_dq_first" keeps "rows80_group" and issues dQ before dK, as "dq_first" did: dQ is staged while dK runs,
//     and dK is waited for before the next tile's Sᵀ goes out (its registers then free for Sᵀ). Step "frag_dq"
//     keeps "rows80_group" and stages dQ in its accumulator's register order, as FlashAttention-3 and -4 do: a
//     thread's four values of a row pair and column pair as one 16-byte store (10 a tile at D = 128, not 40 of 4
//     bytes), a warp's 32 side by side. A dQ writer warp in the producer's warpgroup adds each consumer's run
//     into an fp32 dQ kept in that order with one bulk reduce (the fragment finish pass below puts it back in
//     rows). dV and dK are done before dQ goes out: with either still running, ptxas spilled or serialised.
//     Step "early_lse" keeps "frag_dq" and loads the tile's lse2 values into registers before it waits for Sᵀ,
//     so that the exponentials do not wait on shared memory (in "frag_dq" each waited on its own load).
//     Step "stagger" keeps "late_dq_first" and, without a mask, starts block x's walk of each head at query block
//     x mod the head's number of them (06b's step 19): blocks that run together add dQ into different rows, not
//     all into the same tile's at once. Under the mask each block starts at its diagonal already: unchanged.
//     Step "rows64" keeps "late_dq_first" on 64-query tiles at D = 128, as FlashAttention-3 and -4 take under a
//     causal mask: dQ = dS K as in "late_group", 64 x 64 a consumer (at D = 64 it is "late_dq_first").
//     Step "frag_dq_first" keeps "late_dq_first"'s order at D = 64, dQ staged while dK runs, and stages dQ in
//     register order for the dQ writer, as "frag_dq" does: FlashAttention-4's loop at D = 64 (at D = 128, where
//     that order left ptxas short of registers, it is "late_dq_first").
// lse2 = lse · log2(e) (+inf for rows that see no key, and in the padding), delta = D, fp32 (batch · heads,
// padded_q), padded_q a multiple of 128 (rows80: of 640, whole 80-row tiles): the prepare pass of
// flash_bwd_passes.cuh writes them. Causal attention is aligned bottom-right (key j visible to query i when
// j <= i + Nk − Nq); TMA's zero fill covers ragged tiles.
#pragma once
#include "flash_mma.cuh"                // stmatrix_x4 (notebook 06b's)
#include "hopper_attention_kernel.cuh"  // pack2, fast_exp2, fence_fragments, issue_qk, desc_plus

namespace course_hopper {

struct BackwardParams {
  int seqlen_q, seqlen_k, heads, kv_heads, padded_q;
  float scale_log2;    // softmax scale · log2(e): P = exp2(s · scale_log2 − lse2)
  float scale;         // softmax scale: dK's
  const float* lse2;   // (batch · heads, padded_q)
  const float* delta;  // (batch · heads, padded_q)
  float* dq_accum;     // fp32 (batch, heads, seqlen_q, D), zeroed: receives dQ / scale (the finish pass scales)
  void* dk;            // (batch, kv_heads, seqlen_k, D), in T
  void* dv;
};

// Tiles and shared memory. BM queries per step of the loop: 128 at D = 64, 64 at D = 128 (dK and dV take D / 2
// registers each, and Sᵀ, dPᵀ BM / 2 each: at D = 128 both at 128 would not fit in 240); kWide (rows80): 80 at
// D = 128, with dQ transposed (kTransDq).
template <int D, bool kWide = false> struct BackwardTile {
  static constexpr bool kTransDq = kWide && D == 128;
  static constexpr int kRows = D == 64 ? 128 : kTransDq ? 80 : 64;  // BM
  static constexpr int kKeys = 128;                 // keys per block, 64 per consumer
  static constexpr int kStages = 2;                 // Q, dO, lse2, delta ring
  static constexpr int kThreads = 384;
  static constexpr int kQTile = kRows * D * 2;      // Q or dO: D / 64 panels of kRows rows x 128 bytes
  static constexpr int kKHalf = 64 * D * 2;         // one consumer's K or V: D / 64 panels of 64 rows
  // One consumer's dSᵀ: kRows / 64 panels of 64 key rows; kTransDq: a tile's dS, both consumers', as two panels
  // (one a consumer) of kRows query rows x 64 keys
  static constexpr int kDsTile = kTransDq ? kRows * 256 : 64 * kRows * 2;
  static constexpr int kDsBytes = kTransDq ? 2 * kDsTile : 4 * kDsTile;  // [tile parity] ([consumer])
  // "reduce_dq": a consumer's dQ (64 x 64 fp32; kTransDq: kRows x 64) as two boxes of 32 columns, 128-byte swizzled
  static constexpr int kDqBox = (kTransDq ? kRows : 64) * 128;
  // byte offsets from a 1024-byte boundary; swizzled tiles start on one (kTransDq: the dQ boxes before lse2's
  // 2 x 320 bytes)
  static constexpr int kQ = 0, kDO = kQ + kStages * kQTile, kK = kDO + kStages * kQTile, kV = kK + 2 * kKHalf;
  static constexpr int kDS = kV + 2 * kKHalf;
  static constexpr int kLse = kTransDq ? kDS + kDsBytes + 4 * kDqBox : kDS + kDsBytes;
  static constexpr int kDelta = kLse + kStages * kRows * 4;
  static constexpr int kDqStage = kTransDq ? kDS + kDsBytes : kDelta + kStages * kRows * 4;
  static constexpr int kBytes = kTransDq ? kDelta + kStages * kRows * 4 : kDqStage + 4 * kDqBox;
  static constexpr int kSmemBytes = kBytes + 1024;  // room to align the base
  static_assert(kSmemBytes + 64 <= 227 * 1024, "one block's shared memory, barriers included, within sm_90's 227 KB");
};

// The steps (utils.native.hopper_backward.BWD_STEPS, by index): reduce_dq on atomic_dq, prefetch_s, bh_group and
// stsm_ds each on reduce_dq, stsm_uniform on stsm_ds, dq_first and desc_add each on stsm_uniform, edge_mask on
// desc_add, dv_late on edge_mask, late_prefetch on dv_late, late_group and rows80 each on late_prefetch,
// rows80_group on rows80, late_dq_first and frag_dq each on rows80_group, early_lse on frag_dq, dq_writer,
// stagger, rows64 and frag_dq_first each on late_dq_first.
constexpr int kBwdAtomicDq = 0, kBwdReduceDq = 1, kBwdPrefetchS = 2, kBwdBhGroup = 3, kBwdStsmDs = 4;
constexpr int kBwdStsmUniform = 5, kBwdDqFirst = 6, kBwdDescAdd = 7, kBwdEdgeMask = 8, kBwdDvLate = 9;
constexpr int kBwdLatePrefetch = 10, kBwdLateGroup = 11, kBwdRows80 = 12, kBwdRows80Group = 13;
constexpr int kBwdLateDqFirst = 14, kBwdFragDq = 15, kBwdEarlyLse = 16, kBwdDqWriter = 17, kBwdStagger = 18;
constexpr int kBwdRows64 = 19, kBwdFragDqFirst = 20;
constexpr int kBwdSteps = kBwdFragDqFirst + 1;
// The steps on 80-query tiles at D = 128 (BackwardTile's kWide): rows80 and those built on it, but rows64
__host__ __device__ constexpr bool bwd_wide(int step) { return step >= kBwdRows80 && step != kBwdRows64; }
// The steps that keep dQ's accumulator in register order (dq_frag_float) at head dim D, for their own finish pass
__host__ __device__ constexpr bool bwd_fragments(int step, int D) {
  return step == kBwdFragDq || step == kBwdEarlyLse || (step == kBwdFragDqFirst && D == 64);
}

// frag_dq: where a consumer's dQ value goes in its run of the fp32 accumulator. Its dQ is a wgmma accumulator of
// 64 rows (M) by N columns (D = 64: its 64 query rows x the 64 columns of D; D = 128, dQᵀ: its 64 columns of D x
// the 80 queries); thread wtid holds (m, n) = (16 warp + g + 8h, 8j + 2 t4 + e) in register 4j + 2h + e. The run
// keeps each thread's four registers of a j together, the 128 threads' side by side: float 4 (128 j + wtid) + 2h
// + e. A tile's accumulator holds the two consumers' runs, consumer 0's first.
__host__ __device__ constexpr int dq_frag_float(int j, int wtid, int h, int e) {
  return 4 * (128 * j + wtid) + 2 * h + e;
}
// ... and back: the row (query) and column (of D) of a tile's dQ that float f of the tile's runs holds (BM rows of
// 128 at D = 64, 80 at D = 128; consumer W's rows 64W.. at D = 64, its columns 64W.. at D = 128)
struct DqPlace {
  int row, col;
};
template <int D>
__host__ __device__ constexpr DqPlace dq_frag_place(int f) {
  constexpr int kRun = (D == 64 ? 128 : 80) * D / 2;  // floats of a consumer's run
  const int W = f / kRun, rest = f % kRun, j = rest / 512, wtid = rest / 4 % 128, h = rest % 4 / 2, e = rest % 2;
  const int m = 16 * (wtid / 32) + wtid % 32 / 4 + 8 * h, n = 8 * j + 2 * (wtid % 4) + e;
  return D == 64 ? DqPlace{64 * W + m, n} : DqPlace{n, 64 * W + m};
}
// The first query row (r0) and column of D (c0) of the tile's dQ that consumer W computes: at D = 64 (128-query
// tiles) its 64 rows r0 = 64W.., every column; at D = 128 every row, its 64 columns c0 = 64W..
struct DqCorner {
  int r0, c0;
};
__host__ __device__ constexpr DqCorner dq_corner(int BM, int W) {
  return BM == 128 ? DqCorner{64 * W, 0} : DqCorner{0, 64 * W};
}
// The dQ writer's named barriers (frag_dq, early_lse, dq_writer; 1: both consumers' dSᵀ in; 2 + W: consumer W's
// dQ staged, in the other steps): consumer W's dQ staged, for the writer (kDqFull + W); and read by it, free for
// the next tile's (kDqFree + W)
constexpr int kDqFull = 4, kDqFree = 6;
// bh_group: (batch, K/V head)s per group, the Gluon backward's choice at D = 128 (utils.explicit.backward.pick_config)
constexpr int kBhGroup = 4;

// Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) for this consumer's 64 keys and BM queries: the forward's issue_qk, and for rows80's
// 80 queries the same slices on m64n80 wgmmas. `sk`: the consumer's K (or V), panels of 64 rows; `sq`: Q (or dO).
template <typename T, int D, int BM, bool kDescAdd>
__device__ __forceinline__ void issue_kq(float (&st)[BM / 2], uint32_t sk, uint32_t sq) {
  if constexpr (BM != 80) {
    issue_qk<T, D, BM, kDescAdd>(st, sk, 64 * 128, sq);
  } else {
    static_assert(kDescAdd, "rows80 keeps desc_add's descriptors");
    const uint64_t a0 = smem_desc(sk, 16, 1024, Swizzle::k128B), b0 = smem_desc(sq, 16, 1024, Swizzle::k128B);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)  // 4 slices of 16 columns a 64-column panel; the first overwrites Sᵀ
      wgmma_m64n80k16<T>(st, desc_plus(a0, (ks / 4) * 64 * 128 + (ks % 4) * 32),
                         desc_plus(b0, (ks / 4) * BM * 128 + (ks % 4) * 32), ks > 0);
  }
}

template <typename T, int D, bool kCausal, int kStep>
__global__ void __launch_bounds__(BackwardTile<D>::kThreads, 1)
    hopper_backward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                           const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                           const __grid_constant__ CUtensorMap map_dq, const BackwardParams p) {
  using Tile = BackwardTile<D, bwd_wide(kStep)>;
  constexpr int BM = Tile::kRows, kStages = Tile::kStages;
  constexpr bool kTransDq = Tile::kTransDq;
  // frag_dq, early_lse, frag_dq_first (D = 64), dq_writer: warp 1 of the producer adds dQ. dq_writer only without
  // the mask: under it the writer's loop, beside late_dq_first's consumers, left ptxas short of registers (C7512,
  // every wgmma serialised)
  constexpr bool kWriter = bwd_fragments(kStep, D) || (kStep == kBwdDqWriter && !kCausal);
  constexpr int kPanel = 64 * 128;  // 64 rows of a 64-column panel
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t base = smem_u32(smem);
  const float* lse_s = reinterpret_cast<const float*>(smem + Tile::kLse);
  const float* delta_s = reinterpret_cast<const float*>(smem + Tile::kDelta);
  __shared__ __align__(8) uint64_t bars[1 + 2 * kStages];  // K and V arrived; full[s]; empty[s]
  const uint32_t kv_bar = smem_u32(&bars[0]);
  auto full = [&](int s) { return smem_u32(&bars[1 + s]); };
  auto empty = [&](int s) { return smem_u32(&bars[1 + kStages + s]); };

  // stsm_uniform: lane 0's index, which ptxas can prove the same in the whole warp, so the consumers' shared-memory
  // addresses (one set per warpgroup) and the wgmma descriptors built from them stay in uniform registers
  const int tid = threadIdx.x;
  const int warpgroup = kStep >= kBwdStsmUniform ? __shfl_sync(0xffffffffu, tid / 128, 0) : tid / 128;
  // Under a causal mask key block 0 sees every query and the last block a few. Launched head by head, one head's
  // long blocks run beside the next heads' short ones; step bh_group launches block i of the grid as key block
  // i / size of the i % size-th (batch, K/V head) of its group, so blocks of about one length run together.
  int key_block = blockIdx.x, bh_kv = blockIdx.y;
  if constexpr ((kStep == kBwdBhGroup || kStep == kBwdLateGroup || kStep >= kBwdRows80Group) && kCausal) {
    const int pid = key_block + bh_kv * gridDim.x, first = pid / (kBhGroup * gridDim.x) * kBhGroup;
    const int size = min(static_cast<int>(gridDim.y) - first, kBhGroup), r = pid - first * gridDim.x;
    key_block = r / size, bh_kv = first + r % size;
  }
  const int n0 = key_block * Tile::kKeys, b = bh_kv / p.kv_heads, hk = bh_kv % p.kv_heads;
  const int group = p.heads / p.kv_heads, offset = p.seqlen_k - p.seqlen_q;
  // the query blocks that see any of the block's keys: from m_first on (causal), of each head of the group
  const int m_first = kCausal ? max(0, n0 - offset) / BM : 0, m_blocks = (p.seqlen_q + BM - 1) / BM;
  const int per_head = max(0, m_blocks - m_first), tiles = group * per_head;
  // Tile t: (batch · heads + query head) bh and first query row q0. Walked by counters: query blocks m_first.. of
  // head hk · group, then of the next head of the group. stagger (no mask): query blocks m0.., then 0..m0 - 1.
  constexpr bool kStagger = kStep == kBwdStagger && !kCausal;
  struct Walk {
    int bh, m, m0;
    __device__ __forceinline__ void next(int m_first, int m_blocks) {
      if constexpr (kStagger) {
        if (++m == m_blocks) m = 0;
        if (m == m0) ++bh;  // the head's every block walked
      } else {
        if (++m == m_blocks) m = m_first, ++bh;
      }
    }
  };
  const int m0 = kStagger && per_head > 0 ? key_block % per_head : m_first;
  const Walk start{b * p.heads + hk * group, m0, m0};

  if (tid == 0) {
    mbarrier_init(kv_bar, 1);
    for (int s = 0; s < kStages; ++s) mbarrier_init(full(s), 1), mbarrier_init(empty(s), 256);
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer
    setmaxnreg_dec<24>();
    if (tid == 0) {
      mbarrier_arrive_expect(kv_bar, 4 * Tile::kKHalf);
      for (int c = 0; c < 2; ++c) {  // consumer c's keys
        for (int panel = 0; panel < D / 64; ++panel) {
          const uint32_t at = c * Tile::kKHalf + panel * kPanel;
          tma_load_3d(base + Tile::kK + at, &map_k, 64 * panel, n0 + 64 * c, bh_kv, kv_bar);
          tma_load_3d(base + Tile::kV + at, &map_v, 64 * panel, n0 + 64 * c, bh_kv, kv_bar);
        }
      }
      Walk w = start;
      for (int t = 0; t < tiles; ++t, w.next(m_first, m_blocks)) {
        const int s = t % kStages, bh = w.bh, q0 = w.m * BM;
        if (t >= kStages) mbarrier_wait(empty(s), (t / kStages - 1) & 1);  // tile t - kStages released it
        mbarrier_arrive_expect(full(s), 2 * Tile::kQTile + 2 * BM * 4);
        for (int panel = 0; panel < D / 64; ++panel) {
          const uint32_t at = s * Tile::kQTile + panel * BM * 128;
          tma_load_3d(base + Tile::kQ + at, &map_q, 64 * panel, q0, bh, full(s));
          tma_load_3d(base + Tile::kDO + at, &map_do, 64 * panel, q0, bh, full(s));
        }
        const long long row = static_cast<long long>(bh) * p.padded_q + q0;
        bulk_load(base + Tile::kLse + s * BM * 4, p.lse2 + row, BM * 4, full(s));
        bulk_load(base + Tile::kDelta + s * BM * 4, p.delta + row, BM * 4, full(s));
      }
    } else if (kWriter && tid / 32 == 1) {
      // The dQ writer, as FlashAttention-3's and -4's: once consumer W has staged a tile's dQ (named barrier
      // kDqFull + W), lane 0 adds it into the accumulator (frag_dq: its run, by one bulk reduce; dq_writer: its two
      // boxes, by TMA); once that has read the staging, the warp tells the consumer it is free (kDqFree + W) for
      // its next tile's.
      Walk w = start;
      for (int t = 0; t < tiles; ++t, w.next(m_first, m_blocks)) {
        for (int W = 0; W < 2; ++W) {
          named_barrier_sync(kDqFull + W, 160);
          if (tid % 32 == 0) {
            const uint32_t stage = base + Tile::kDqStage + W * 2 * Tile::kDqBox;
            if constexpr (kStep == kBwdDqWriter) {
              const DqCorner at = dq_corner(BM, W);
              for (int box = 0; box < 2; ++box)
                tma_reduce_add_3d(&map_dq, at.c0 + 32 * box, w.m * BM + at.r0, w.bh, stage + box * Tile::kDqBox);
            } else {
              const long long run = (static_cast<long long>(w.bh) * p.padded_q + w.m * BM) * D + W * (BM * D / 2);
              bulk_reduce_add_f32(p.dq_accum + run, stage, BM * D / 2 * 4);
            }
            tma_store_commit();
            tma_store_wait_read();
          }
          __syncwarp();
          if (t + 1 < tiles) named_barrier_arrive(kDqFree + W, 160);
        }
      }
      if (tid % 32 == 0) tma_store_wait_all();  // the staging stays until the adds are done
    }
    return;
  }

  setmaxnreg_inc<240>();  // a consumer
  const int W = warpgroup - 1, wtid = tid % 128, warp = wtid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const uint32_t sk = base + Tile::kK + W * Tile::kKHalf, sv = base + Tile::kV + W * Tile::kKHalf;
  const int key_lo = n0 + 64 * W;                                  // this consumer's 64 keys
  const int key[2] = {key_lo + 16 * warp + g, key_lo + 16 * warp + g + 8};  // the rows this thread holds
  const DqCorner corner = dq_corner(BM, W);  // this consumer's part of the tile's dQ
  const int r0 = corner.r0, c0 = corner.c0;
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  mbarrier_wait(kv_bar, 0);
  // frag_dq keeps rows80_group's order: dK before dQ
  constexpr bool kReduce = kStep >= kBwdReduceDq;
  constexpr bool kDqFirst =
      kStep == kBwdDqFirst || kStep == kBwdLateDqFirst || kStep == kBwdDqWriter || kStep == kBwdStagger ||
      kStep == kBwdRows64 || kStep == kBwdFragDqFirst;
  constexpr bool kLatePrefetch = kStep >= kBwdLatePrefetch;  // late_prefetch and late_group
  constexpr bool kPrefetch = kStep == kBwdPrefetchS || kLatePrefetch;
  constexpr bool kDescAdd = kStep >= kBwdDescAdd, kEdgeMask = kStep >= kBwdEdgeMask, kDvLate = kStep >= kBwdDvLate;
  constexpr bool kFragDq = bwd_fragments(kStep, D), kEarlyLse = kStep == kBwdEarlyLse;
  // The descriptor of the operand at `at` + `offset`; desc_add: at's, plus the offset (the forward's desc_plus)
  auto desc = [](uint32_t at, uint32_t leading, uint32_t offset) {
    return kDescAdd ? desc_plus(smem_desc(at, leading, 1024, Swizzle::k128B), offset)
                    : smem_desc(at + offset, leading, 1024, Swizzle::k128B);
  };
  float st[BM / 2];  // Sᵀ, then Pᵀ and dSᵀ in place; prefetch_s: issued a tile ahead
  if constexpr (kStep == kBwdPrefetchS) {
    if (tiles > 0) {
      mbarrier_wait(full(0), 0);
      fence_registers(st);
      wgmma_fence();
      issue_kq<T, D, BM, false>(st, sk, base + Tile::kQ);
      wgmma_commit();
    }
  } else if constexpr (kLatePrefetch) {  // issued even without a tile: stage 0 is read, never used
    if (tiles > 0) mbarrier_wait(full(0), 0);
    fence_registers(st);
    wgmma_fence();
    issue_kq<T, D, BM, true>(st, sk, base + Tile::kQ);
    wgmma_commit();
  }

  Walk w = start;
  for (int t = 0; t < tiles; ++t, w.next(m_first, m_blocks)) {
    const int s = t % kStages, bh = w.bh, q0 = w.m * BM;
    const uint32_t sq = base + Tile::kQ + s * Tile::kQTile, sdo = base + Tile::kDO + s * Tile::kQTile;
    const float* lse2 = lse_s + s * BM;
    const float* delta = delta_s + s * BM;
    if constexpr (!kPrefetch) mbarrier_wait(full(s), (t / kStages) & 1);  // prefetch_s: waited a tile ahead

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: 64 keys x BM queries each; A: this consumer's K or V (panels of 64 rows), B: Q or
    // dO (panels of BM rows). Thread: keys key[0], key[1]; queries q0 + 8j + 2t4 (+1) in st[4j..4j+3].
    float dpt[BM / 2];
    // early_lse: this thread's lse2 values (queries 8j + 2t4, +1), loaded while Sᵀ may still run
    auto lse_at = [&](int j) { return *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t4); };
    float2 lse_early[kEarlyLse ? BM / 8 : 1];
    if constexpr (kEarlyLse) {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) lse_early[j] = lse_at(j);
    }
    auto lse_of = [&](int j) {
      if constexpr (kEarlyLse) return lse_early[j];
      else return lse_at(j);
    };
    if constexpr (kLatePrefetch) {
      // Sᵀ, issued while the last tile's dQ left, is done before dPᵀ goes out: ptxas does not count wgmma groups
      // across the loop's back edge, and would serialise every wgmma had Sᵀ a wait of its own below
      wgmma_wait<0>();
    }
    if constexpr (!kPrefetch) fence_registers(st);
    fence_registers(dpt);
    wgmma_fence();
    if constexpr (!kPrefetch) {
      issue_kq<T, D, BM, kDescAdd>(st, sk, sq);
      wgmma_commit();
    }
    issue_kq<T, D, BM, kDescAdd>(dpt, sv, sdo);
    wgmma_commit();
    if constexpr (!kLatePrefetch) wgmma_wait<1>();  // Sᵀ is done (issued here or, prefetch_s, a tile ago)
    fence_registers(st);

    // Pᵀ = 2^(Sᵀ·scale·log2 e − lse2[query]); 0 where the key is hidden: past Nk, or causal and key > query + offset
    const bool masked = key_lo + 64 > p.seqlen_k || (kCausal && key_lo + 63 > q0 + offset);
    if (kEdgeMask && !masked) {  // edge_mask: no key to hide (`masked` is the same in the warp: no divergence)
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 l = lse_of(j);
#pragma unroll
        for (int r = 0; r < 4; ++r) st[4 * j + r] = fast_exp2(fmaf(st[4 * j + r], p.scale_log2, -(r % 2 ? l.y : l.x)));
      }
    } else {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 l = lse_of(j);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int q = q0 + 8 * j + 2 * t4 + r % 2, k = key[r / 2];
          const float x = fast_exp2(fmaf(st[4 * j + r], p.scale_log2, -(r % 2 ? l.y : l.x)));
          st[4 * j + r] = masked && (k >= p.seqlen_k || (kCausal && k > q + offset)) ? 0.f : x;
        }
      }
    }
    // The C fragments of query columns 16kk.. are the A fragment of K-slice kk (as P in the forward's O += P V).
    uint32_t pa[BM / 16][4], sa[BM / 16][4];
    // dV += Pᵀ dO: K = the BM queries, 16 rows (2 KB) a slice; N = D, dO's panels BM · 128 bytes apart
    auto issue_dv = [&] {
      fence_fragments(pa);
      fence_registers(dv);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        wgmma_m64k16_rs<T, D, true>(dv, pa[kk], desc(sdo, BM * 128, kk * 2048));
      wgmma_commit();
    };
    if constexpr (kDvLate) {
      wgmma_wait<0>();  // dPᵀ is done; dV waits for dSᵀ
    } else {
      pack_p<T, BM>(st, pa);
      issue_dv();
      wgmma_wait<1>();  // dPᵀ is done (dV may still run)
    }
    fence_registers(dpt);

    // dSᵀ = Pᵀ ∘ (dPᵀ − delta[query]), in place of Pᵀ (dv_late: of dPᵀ, so that Pᵀ stays for dV), then its A
    // fragments
    float (&ds)[BM / 2] = kDvLate ? dpt : st;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t4);
#pragma unroll
      for (int r = 0; r < 4; ++r) ds[4 * j + r] = st[4 * j + r] * (dpt[4 * j + r] - (r % 2 ? dl.y : dl.x));
    }
    if constexpr (kDvLate) pack_p<T, BM>(st, pa);
    pack_p<T, BM>(ds, sa);
    if constexpr (kDvLate) issue_dv();

    // dK += dSᵀ Q (the scale once, at the end); dq_first: after dQ, below
    auto issue_dk = [&] {
      fence_fragments(sa);
      fence_registers(dk);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        wgmma_m64k16_rs<T, D, true>(dk, sa[kk], desc(sq, BM * 128, kk * 2048));
      wgmma_commit();
    };
    if constexpr (!kDqFirst) issue_dk();

    // dSᵀ into shared memory for dQ: this consumer's 64 key rows x BM queries, in panels of 64 queries, 128-byte
    // swizzled as TMA lays out a tile (the layout wgmma's descriptors read). Buffers alternate with the tile's
    // parity: the other consumer may still read the last tile's.
    const uint32_t sds = base + Tile::kDS + ((t % 2) * 2 + W) * Tile::kDsTile;
    if constexpr (kTransDq) {
      // dS query-major: consumer W's panel of the tile's buffer holds its 64 keys for each of the BM query rows.
      // stmatrix .trans stores each 8 x 8 tile of sa[kk] (queries 16kk + 8 (tile / 2).., keys 16 warp + 8 (tile
      // % 2)..) transposed: lane l gives query row 8 (tile / 2) + l % 8 of the slice, whose 8 keys are chunk
      // 2 warp + tile % 2 of the row, swizzled by the row's index mod 8, l % 8.
      const int tile = lane / 8, m = lane % 8;
      const uint32_t row_at = base + Tile::kDS + (t % 2) * Tile::kDsTile + W * BM * 128 +
                              (8 * (tile / 2) + m) * 128 + ((2 * warp + tile % 2) ^ m) * 16;
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) stmatrix_x4_trans(row_at + kk * 2048, sa[kk]);
    } else if constexpr (kStep >= kBwdStsmDs) {
      // sa[kk] holds four 8 x 8 tiles: queries 16kk.. and 16kk + 8.., each for key rows g and g + 8 of the warp's
      // 16 (register i: query half i / 2, key half i % 2). Lane l gives row l % 8 of tile l / 8, whose 8 queries
      // are chunk 2kk + (l / 8) / 2 of the row. The 128-byte swizzle moves chunk c of row r to c ^ (r % 8): folded
      // into one address here, so that each tile's is a constant XOR and offset (nothing more to keep in registers).
      const int tile = lane / 8, key_row = 16 * warp + lane % 8 + 8 * (tile % 2);
      const uint32_t row_at = (sds + key_row * 128 + (key_row % 8) * 16) ^ ((tile / 2) * 16);
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        course_flash::stmatrix_x4((row_at ^ (2 * kk % 8) * 16) + (2 * kk / 8) * kPanel, sa[kk]);
    } else {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t at = sds + (j / 8) * kPanel +
                              swizzle((16 * warp + g + 8 * half) * 128 + 16 * (j % 8) + 4 * t4, Swizzle::k128B);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(sa[j / 2][2 * (j % 2) + half]) : "memory");
        }
      }
    }
    fence_proxy_async();         // the stores visible to wgmma
    if constexpr (kFragDq && !kDqFirst) {
      // frag_dq: dV and dK are done before dQ goes out, so that their operands' fragments and dQ's accumulators
      // are never live at once (at D = 128 ptxas serialised every wgmma without this wait, and spilled with dK
      // still running)
      wgmma_wait<0>();
      fence_registers(dv);
      fence_registers(dk);
    }
    // reduce_dq: the last tile's reduces have read the staging boxes before anyone passes the barrier below.
    // dq_writer: this thread committed none, but without the branch ptxas runs short of registers at D = 128 and
    // serialises every wgmma (C7512)
    if constexpr (kReduce && !kFragDq)
      if (wtid == 0) tma_store_wait_read();
    named_barrier_sync(1, 256);  // both consumers' dSᵀ are in

    // dQ (rows r0.., columns c0.., 64 x 64) = dS K over the block's 128 keys, 16 a slice: A = dS, M-major out of
    // dSᵀ (consumer hh's panel of queries r0..); B = K of consumer hh, N-major (its panel of columns c0..).
    // kTransDq: dQᵀ (columns 64W.. of D x the BM queries) = Kᵀ dSᵀ: A = Kᵀ, M-major out of K (consumer hh's keys,
    // panel W of columns); B = dSᵀ, K-major out of dS (panel hh, 16 keys a slice, 32 bytes on in the row).
    float dq[kTransDq ? BM / 2 : 32];
    fence_registers(dq);
    wgmma_fence();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if constexpr (kTransDq) {
        const uint32_t ak = base + Tile::kK + hh * Tile::kKHalf + W * kPanel;
        const uint32_t b = base + Tile::kDS + (t % 2) * Tile::kDsTile + hh * BM * 128;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n80k16<T, true, false>(dq, desc(ak, kPanel, kk * 2048), desc(b, 16, kk * 32), hh + kk > 0);
      } else {
        const uint32_t a = base + Tile::kDS + ((t % 2) * 2 + hh) * Tile::kDsTile + (r0 / 64) * kPanel;
        const uint32_t bk = base + Tile::kK + hh * Tile::kKHalf + (c0 / 64) * kPanel;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n64k16<T, true, true>(dq, desc(a, kPanel, kk * 2048), desc(bk, kPanel, kk * 2048), hh + kk > 0);
      }
    }
    wgmma_commit();
    if constexpr (kDqFirst) {
      issue_dk();
      wgmma_wait<1>();  // dV and dQ done; dK runs on while dQ is staged
    } else {
      wgmma_wait<0>();  // dV, dK and dQ done: Q, dO, lse2 and delta of stage s are free
      fence_registers(dk);
      mbarrier_arrive(empty(s));
    }
    fence_registers(dq);
    fence_registers(dv);

    // dQ / scale into the fp32 accumulator: rows q0 + r0 + 16 warp + g (+8), columns c0 + 8j + 2t4 (+1)
    if constexpr (!kReduce) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = q0 + r0 + 16 * warp + g + 8 * half;
        if (q >= p.seqlen_q) continue;
        float* dst = p.dq_accum + (static_cast<long long>(bh) * p.seqlen_q + q) * D + c0 + 2 * t4;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          atomicAdd(reinterpret_cast<float2*>(dst + 8 * j),
                    make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]));
      }
    } else {
      // Staged as two boxes of 64 rows (kTransDq: BM queries) x 32 columns (128 bytes a row, swizzled as TMA reads
      // them); one thread (with a writer warp: the writer) then hands both to TMA, which adds them in L2. Rows past
      // seqlen_q are not written (the map's edge).
      const uint32_t stage = base + Tile::kDqStage + W * 2 * Tile::kDqBox;
      if constexpr (kWriter) {
        // The dQ writer (warp 1) has read the last tile's dQ before this one goes in, and adds it once all 128
        // threads have arrived (below).
        if (t > 0) {  // barrier ids as immediates: no register holds one across the loop
          if (W == 0) named_barrier_sync_n<kDqFree, 160>();
          else named_barrier_sync_n<kDqFree + 1, 160>();
        }
      }
      if constexpr (kFragDq) {
        // frag_dq: registers 4j..4j+3 as one 16-byte store at the run's float dq_frag_float(j, wtid, 0, 0): a
        // warp's store fills 512 contiguous bytes, four wavefronts with no bank conflict.
#pragma unroll
        for (int j = 0; j < static_cast<int>(sizeof(dq) / sizeof(float)) / 4; ++j)
          asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(stage + 4 * dq_frag_float(j, wtid, 0, 0)),
                       "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3]) : "memory");
      } else if constexpr (kTransDq) {
        // dq[4j + r] is column 16 warp + g + 8 (r / 2) of this consumer's 64 (box warp / 2) and query 8j + 2 t4
        // + r % 2: one 4-byte store each, at row query, column (that column mod 32) of the box. The swizzle
        // depends on the row mod 8 only: four addresses, and 1 KB on for each j.
        const uint32_t box = stage + (warp / 2) * Tile::kDqBox;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int col = 16 * (warp % 2) + g + 8 * (r / 2), row = 2 * t4 + r % 2;
          const uint32_t at = box + swizzle(row * 128 + 4 * col, Swizzle::k128B);
#pragma unroll
          for (int j = 0; j < BM / 8; ++j)
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at + 1024 * j), "f"(dq[4 * j + r]) : "memory");
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t at = stage + (j / 4) * Tile::kDqBox +
                                swizzle((16 * warp + g + 8 * half) * 128 + 32 * (j % 4) + 8 * t4, Swizzle::k128B);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(dq[4 * j + 2 * half]),
                         "f"(dq[4 * j + 2 * half + 1]) : "memory");
          }
        }
      }
      if constexpr (kDqFirst && kLatePrefetch) {  // late_dq_first: dK done before the next Sᵀ takes registers
        wgmma_wait<0>();                           // (dSᵀ's fragments are then free); stage s is free
        fence_registers(dk);
        mbarrier_arrive(empty(s));
      }
      if constexpr (kStep == kBwdPrefetchS) {  // the next tile's Sᵀ, while dQ leaves: st is free (dSᵀ is in its
        if (t + 1 < tiles) {                   // fragments)
          const int ns = (t + 1) % kStages;
          mbarrier_wait(full(ns), ((t + 1) / kStages) & 1);
          fence_registers(st);
          wgmma_fence();
          issue_kq<T, D, BM, false>(st, sk, base + Tile::kQ + ns * Tile::kQTile);
          wgmma_commit();
        }
      } else if constexpr (kLatePrefetch) {  // after the last tile too: its stage is not refilled
        const int ns = (t + 1) % kStages;
        if (t + 1 < tiles) mbarrier_wait(full(ns), ((t + 1) / kStages) & 1);
        fence_registers(st);
        wgmma_fence();
        issue_kq<T, D, BM, true>(st, sk, base + Tile::kQ + ns * Tile::kQTile);
        wgmma_commit();
      }
      if constexpr (kWriter) {
        fence_proxy_async();  // the stores visible to the writer's reduce
        if (W == 0) named_barrier_arrive_n<kDqFull, 160>();
        else named_barrier_arrive_n<kDqFull + 1, 160>();
      } else {
        fence_proxy_async();             // the stores visible to TMA
        named_barrier_sync(2 + W, 128);  // this consumer's dQ is staged
        if (wtid == 0) {
          int at_bh = bh, at_q0 = q0;
          if constexpr (kStagger) {  // the tile's place from t, here: a Walk kept beside dQ cost ptxas registers
            at_bh = start.bh + t / per_head;
            at_q0 = (t % per_head + m0) % per_head * BM;
          }
          for (int box = 0; box < 2; ++box)  // kTransDq: c0 = 64 W, r0 = 0 (D = 128)
            tma_reduce_add_3d(&map_dq, c0 + 32 * box, at_q0 + r0, at_bh, stage + box * Tile::kDqBox);
          tma_store_commit();
        }
      }
    }
    if constexpr (kDqFirst && !kLatePrefetch) {
      wgmma_wait<0>();  // dK done: Q, dO, lse2 and delta of stage s are free
      fence_registers(dk);
      mbarrier_arrive(empty(s));
    }
  }
  if constexpr (kLatePrefetch) wgmma_wait<0>();  // the Sᵀ issued after the last tile
  if constexpr (kReduce && !kWriter)
    if (wtid == 0) tma_store_wait_all();  // the staging boxes stay until the adds are done

  // dK (scaled) and dV of this thread's two keys
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (key[half] >= p.seqlen_k) continue;
    const long long row = (static_cast<long long>(bh_kv) * p.seqlen_k + key[half]) * D + 2 * t4;
    T* dk_row = static_cast<T*>(p.dk) + row;
    T* dv_row = static_cast<T*>(p.dv) + row;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(dk_row + 8 * j) =
          pack2<T>(dk[4 * j + 2 * half] * p.scale, dk[4 * j + 2 * half + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_row + 8 * j) = pack2<T>(dv[4 * j + 2 * half], dv[4 * j + 2 * half + 1]);
    }
  }
}

// frag_dq's finish pass: dQ = scale · its fp32 accumulator (batch · heads, padded_q rows, D), kept in register
// order, in T and in rows (batch, heads, seqlen_q, D). One block a tile of BM rows: it reads the tile's two runs
// in order (16 bytes a thread, coalesced), puts each value at its row and column in shared memory, then writes
// the rows before seqlen_q, 8 elements a thread.
template <typename T, int D>
__global__ void __launch_bounds__(256) hopper_bwd_finish_fragments_kernel(const float* accum, T* dq, int seqlen_q,
                                                                          int padded_q, float scale) {
  constexpr int BM = BackwardTile<D, true>::kRows, kPitch = D + 4;  // kPitch: rows on 16 bytes, banks staggered
  __shared__ __align__(16) float tile[BM * kPitch];
  const int tiles = (seqlen_q + BM - 1) / BM, q0 = static_cast<int>(blockIdx.x % tiles) * BM;
  const long long bh = blockIdx.x / tiles;
  const float4* src = reinterpret_cast<const float4*>(accum + (bh * padded_q + q0) * D);
  for (int f4 = threadIdx.x; f4 < BM * D / 4; f4 += blockDim.x) {
    const float4 x = src[f4];
    const float vals[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const DqPlace at = dq_frag_place<D>(4 * f4 + i);
      tile[at.row * kPitch + at.col] = vals[i];
    }
  }
  __syncthreads();
  for (int v = threadIdx.x; v < BM * D / 8; v += blockDim.x) {
    const int row = v / (D / 8), col = v % (D / 8) * 8;
    if (q0 + row >= seqlen_q) continue;
    const float4 a = *reinterpret_cast<const float4*>(&tile[row * kPitch + col]);
    const float4 c = *reinterpret_cast<const float4*>(&tile[row * kPitch + col + 4]);
    *reinterpret_cast<uint4*>(dq + (bh * seqlen_q + q0 + row) * D + col) = make_uint4(
        pack2<T>(a.x * scale, a.y * scale), pack2<T>(a.z * scale, a.w * scale), pack2<T>(c.x * scale, c.y * scale),
        pack2<T>(c.z * scale, c.w * scale));
  }
}

template <typename T, int D, int kStep>
cudaError_t launch_backward(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& v,
                            const CUtensorMap& dout, const CUtensorMap& dq, const BackwardParams& p,
                            int batch_kv_heads, cudaStream_t stream) {
  using Tile = BackwardTile<D, bwd_wide(kStep)>;
  auto kernel = causal ? hopper_backward_kernel<T, D, true, kStep> : hopper_backward_kernel<T, D, false, kStep>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.seqlen_k + Tile::kKeys - 1) / Tile::kKeys, batch_kv_heads);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(q, k, v, dout, dq, p);
  return cudaGetLastError();
}

}  // namespace course_hopper
