// FlashAttention-2 backward on tensor cores (worklog notebook 06bw, section 6), with the forward's primitives (flash_mma.cuh)
// and its fragment loaders (flash_mma_kernel.cuh). With P = exp(S·scale − lse), S = Q Kᵀ and D = rowsum(dO ∘ O):
//
//   dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D)      dK = scale · dSᵀ Q      dQ = scale · dS K
//
// dkdv kernel: one block per (BC keys, batch, K/V head); warp w owns keys 16w..16w+15 and works in the transposed
//   frame, Sᵀ = K Qᵀ, so that Pᵀ and dSᵀ come out of the accumulators of one mma as the A operands of the next
//   (dV += Pᵀ dO, dK += dSᵀ Q): neither leaves the registers. dK and dV accumulate in registers while the block
//   walks the query blocks that see its keys (of every query head of its GQA group), Q and dO double-buffered.
//   Step 1 (`BwdAtomicDQ`): dSᵀ also goes to shared memory, every warp takes a slice of dQ += dS K, and adds it
//   to an fp32 dQ in global memory with atomics (FlashAttention-2's choice: S and dP are computed once).
// dq kernel (step 2, `BwdDQPass`): one block per (BR queries, batch, head), the forward's loop with two more
//   mma per tile; it recomputes S and dP, but writes dQ once, with no atomics, and the result is deterministic.
//
// lse2 and delta come from the host, fp32, (batch · heads, padded_q) with padded_q a multiple of kLsePad: lse2
// = lse · log2(e), +inf for rows that see no key and for the padding (so P = 2^(S·scale·log2 e − lse2) is 0
// there), delta = D (0 in the padding). Bottom-right causal alignment, as the forward.
#pragma once
#include "flash_mma_bwd_steps.cuh"
#include "flash_mma_kernel.cuh"

namespace course_flash {

using BwdLoad = Step7CausalSkip;  // how tiles are loaded and read: cp.async, swizzled, ldmatrix (06b step 7)

template <typename Step, int D, int kWarpsT = 8, int kStagesT = 2> struct BwdTile {
  static constexpr int kWarps = kWarpsT, kThreads = 32 * kWarps, kStages = kStagesT;
  static constexpr int kCols = 16 * kWarps;               // BC: keys per dkdv block, 16 per warp
  static constexpr int kRows = Step::template rows<D>();  // BR: queries per step of its loop
  // dSᵀ rows are padded by 8 elements (16 bytes): the 8 rows an ldmatrix phase reads, and the 8 rows g of a
  // fragment store, then start in 8 different groups of 4 banks (a swizzle needs rows of 64 elements).
  static constexpr int kDsStride = kRows + 8;
  // K, V [BC][D]; per stage Q, dO [BR][D] and lse2, delta [BR]; dSᵀ [BC][BR + 8] (step 1)
  static constexpr int kSmemBytes = 2 * kCols * D * 2 + kStages * (2 * kRows * D * 2 + 2 * kRows * 4) +
                                    kCols * kDsStride * 2;
  static_assert(kLsePad % kRows == 0 && kRows % 16 == 0, "query blocks: whole m16 tiles, whole lse2 tiles");
};

// dst[0..3] += x: one 16-byte atomic on sm_90 (Hopper adds vector atomics to global memory), four before.
__device__ __forceinline__ void atomic_add4(float* dst, float4 x) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), x);
#else
  atomicAdd(dst, x.x), atomicAdd(dst + 1, x.y), atomicAdd(dst + 2, x.z), atomicAdd(dst + 3, x.w);
#endif
}

// dst[0..1] += x: one 8-byte atomic on sm_90, two before.
__device__ __forceinline__ void atomic_add2(float* dst, float2 x) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), x);
#else
  atomicAdd(dst, x.x), atomicAdd(dst + 1, x.y);
#endif
}

// 16 bytes at a time, like load_tile: `count` floats (a multiple of 4) of an fp32 row, always in bounds.
template <int kThreads>
__device__ __forceinline__ void load_floats(float* dst, const float* src, int count) {
  for (int i = threadIdx.x * 4; i < count; i += kThreads * 4) cp_async_16(dst + i, src + i, true);
}

// 4 bytes global -> shared memory (step 16 places each value of lse2 and delta on its own). `.ca`: the only
// cache option PTX allows below 16 bytes.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(smem_address(dst)), "l"(src));
}

// Where a warp's per-query value of column `col` (n * 8 + 2t + e of its kTiles n8 tiles) is: in query order, or
// (step 16) thread t's 2 kTiles values side by side, tile n's pair at 2n.
template <int kTiles, bool kByThread>
__device__ __forceinline__ int query_slot(int n, int t, int e) {
  return kByThread ? t * 2 * kTiles + n * 2 + e : n * 8 + 2 * t + e;
}

// acc (16 x 8 kTiles, this warp's rows) += rows 16 warp.. of A times rows 0 .. 8 kTiles - 1 of B, transposed, both
// [rows][D] tiles: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ. `kUnroll`: iterations of the k loop unrolled (step 6).
template <int D, int kTiles, int kUnroll, typename T>
__device__ __forceinline__ void mma_a_bt(float (&acc)[kTiles][4], const T* A, const T* B, int warp, int lane) {
#pragma unroll (kUnroll)
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a<BwdLoad, D>(a, A, warp * 16, kk * 16, lane);
#pragma unroll
    for (int n = 0; n < kTiles; n += 2) {
      uint32_t b[2][2];
      load_b_k<BwdLoad, D>(b, B, n * 8, kk * 16, lane);
      mma_16816<T>(acc[n], a, b[0]);
      mma_16816<T>(acc[n + 1], a, b[1]);
    }
  }
}

// The two element-wise steps of the transposed frame (Exercise 6b.8). In a warp's accumulators of Sᵀ = K Qᵀ,
// s[n][e] of the lane with g = lane / 4, t = lane % 4 holds key key0 + 8 (e / 2), where key0 = the warp's first
// key + g, and query q0 + 8n + 2t + e % 2: the C layout with keys as rows. So the per-query values lse2 and delta
// (the block's, from query q0) are indexed by the column.
// Pᵀ in place of Sᵀ: 2^(s·scale_log2 − lse2[query]), or 0 where the key is hidden from the query: past the end,
// or causal and key > query + offset (offset = seqlen_k − seqlen_q, the bottom-right alignment). `masked`:
// whether any key of the tile may be hidden (else no test). `kMaskAfter` (step 7): every exponential first, then
// the mask, only where `masked`; as one expression per element, the compiler puts a branch around each exp2.
template <int kTiles, bool kMaskAfter = false, bool kByThread = false>
__device__ __forceinline__ void probs_t(float (&s)[kTiles][4], const float* lse2, const Params& p, int key0, int q0,
                                        bool masked, int offset, int t) {
  if constexpr (kMaskAfter) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[n][e] = fast_exp2(fmaf(s[n][e], p.scale_log2, -lse2[query_slot<kTiles, kByThread>(n, t, e % 2)]));
    if (!masked) return;  // most tiles: no key hidden, no test
  }
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = n * 8 + 2 * t + e % 2, key = key0 + e / 2 * 8;
      const bool hidden = masked && (key >= p.seqlen_k || (p.causal && key > q0 + col + offset));
      if constexpr (kMaskAfter) {
        if (hidden) s[n][e] = 0.f;
      } else {
        s[n][e] = hidden ? 0.f
                         : fast_exp2(fmaf(s[n][e], p.scale_log2, -lse2[query_slot<kTiles, kByThread>(n, t, e % 2)]));
      }
    }
}

// dSᵀ in place of Pᵀ: Pᵀ ∘ (dPᵀ − delta[query]).
template <int kTiles, bool kByThread = false>
__device__ __forceinline__ void ds_t(float (&s)[kTiles][4], const float (&dp)[kTiles][4], const float* delta, int t) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] *= dp[n][e] - delta[query_slot<kTiles, kByThread>(n, t, e % 2)];
}

// One m16 tile of dQ (rows r0.. of query block q0 of head bh, kTiles n8 tiles from column c0) added to the fp32
// dQ with 16-byte atomics. Threads t and t ^ 1 swap a pair of values, so that each holds 4 consecutive columns of
// one row: even t columns 2t..2t+3 of row g, odd t columns 2t-2..2t+1 of row g + 8.
template <int D, int kTiles, bool kPadded = false>
__device__ __forceinline__ void add_dq_tile(const BwdParams& bp, const float (&dq)[kTiles][4], long long bh, int q0,
                                            int r0, int c0, int g, int t) {
  const bool odd = t & 1;
  const int row = r0 + g + (odd ? 8 : 0);
  const long long rows = kPadded ? bp.padded_q : bp.fwd.seqlen_q;  // step 15: padded rows, no row test
  float* dst = bp.dq_accum + (bh * rows + q0 + row) * D + c0 + 2 * (t & ~1);
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    const float x = __shfl_xor_sync(0xffffffffu, odd ? dq[n][0] : dq[n][2], 1);
    const float y = __shfl_xor_sync(0xffffffffu, odd ? dq[n][1] : dq[n][3], 1);
    if (kPadded || q0 + row < bp.fwd.seqlen_q)
      atomic_add4(dst + n * 8, odd ? make_float4(x, y, dq[n][2], dq[n][3]) : make_float4(dq[n][0], dq[n][1], x, y));
  }
}

// add_dq_tile with 8-byte atomics (step 12): each thread adds its own pairs, columns 2t, 2t + 1 of rows g and g + 8,
// straight from the accumulators: no shuffle, and no register that waits for an atomic to read it.
template <int D, int kTiles>
__device__ __forceinline__ void add_dq_pairs(const BwdParams& bp, const float (&dq)[kTiles][4], long long bh, int q0,
                                             int r0, int c0, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + g + 8 * r;
    float* dst = bp.dq_accum + (bh * bp.fwd.seqlen_q + q0 + row) * D + c0 + 2 * t;
    if (q0 + row < bp.fwd.seqlen_q)
#pragma unroll
      for (int n = 0; n < kTiles; ++n) atomic_add2(dst + n * 8, make_float2(dq[n][2 * r], dq[n][2 * r + 1]));
  }
}

// Rows key0 and key0 + 8 of `acc` times `scale`, kTiles n8 tiles from column c0, into dst (dK or dV, in T) of
// K/V head kv_row (b · Hkv + hk).
template <typename T, int D, int kTiles>
__device__ __forceinline__ void store_rows(const BwdParams& bp, void* dst, const float (&acc)[kTiles][4],
                                           long long kv_row, int key0, int c0, float scale, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= bp.fwd.seqlen_k) continue;
    T* row = static_cast<T*>(dst) + (kv_row * bp.fwd.seqlen_k + key) * D + c0 + 2 * t;
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
      *reinterpret_cast<uint32_t*>(row + n * 8) = pack2<T>(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
  }
}

// Rows key0 and key0 + 8 of dK (scaled) and dV, kTiles n8 tiles from column c0, of K/V head kv_row.
template <typename T, int D, int kTiles>
__device__ __forceinline__ void store_dkdv_rows(const BwdParams& bp, const float (&dk)[kTiles][4],
                                                const float (&dv)[kTiles][4], long long kv_row, int key0, int c0,
                                                float scale, int t) {
  store_rows<T, D>(bp, bp.dk, dk, kv_row, key0, c0, scale, t);
  store_rows<T, D>(bp, bp.dv, dv, kv_row, key0, c0, 1.f, t);
}

// What both dkdv kernels' blocks own: `cols` keys from n0 of K/V head hk of batch b, and the query blocks of `rows`
// that see any of them, blocks m_first.. of every query head of the GQA group (causal: query i sees key j when
// j <= i + offset): n_iters = group · per_head query blocks in all.
template <typename T> struct KeyBlock {
  int b, hk, group, n0, offset, m_first, m_blocks, per_head, n_iters;
  const T* k;  // K and V of (b, hk)
  const T* v;
  __device__ __forceinline__ KeyBlock(const Params& p, int cols, int rows)
      : b(blockIdx.y / p.kv_heads), hk(blockIdx.y % p.kv_heads), group(p.heads / p.kv_heads), n0(blockIdx.x * cols),
        offset(p.seqlen_k - p.seqlen_q), m_first(p.causal ? max(0, n0 - offset) / rows : 0),
        m_blocks((p.seqlen_q + rows - 1) / rows), per_head(max(0, m_blocks - m_first)), n_iters(group * per_head),
        k(static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1]),
        v(static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1]) {}
};

template <typename Step, typename T, int D, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Step::template min_blocks<D>()) flash_bwd_dkdv_kernel(BwdParams bp) {
  constexpr int BR = Tile::kRows, BC = Tile::kCols, kThreads = Tile::kThreads;
  constexpr int kTilesS = BR / 8, kTilesD = D / 8;  // n8 accumulator tiles of Sᵀ (queries) and of dK, dV
  const Params& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BC * D;
  T* Qs = Vs + BC * D;                          // [stage][BR][D]
  T* dOs = Qs + Tile::kStages * BR * D;         // [stage][BR][D]
  T* dSs = dOs + Tile::kStages * BR * D;        // [BC][kDsStride]
  float* lse_s = reinterpret_cast<float*>(dSs + BC * Tile::kDsStride);  // [stage][BR]
  float* delta_s = lse_s + Tile::kStages * BR;             // [stage][BR]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const KeyBlock<T> kb(p, BC, BR);
  const int b = kb.b, hk = kb.hk, group = kb.group, n0 = kb.n0, offset = kb.offset, m_first = kb.m_first;
  const int per_head = kb.per_head, n_iters = kb.n_iters;
  const T *k = kb.k, *v = kb.v;

  // Iteration it: query head hk * group + it / per_head, query block m_first + it % per_head.
  const auto load_q_block = [&](int it, int stage) {
    const int h = hk * group + it / per_head, q0 = (m_first + it % per_head) * BR;
    const long long bh = static_cast<long long>(b) * p.heads + h;
    load_tile<BwdLoad, T, D, BR, kThreads>(Qs + stage * BR * D, static_cast<const T*>(p.q) + b * p.q_stride[0] +
                                           h * p.q_stride[1], p.q_stride[2], q0, p.seqlen_q);
    load_tile<BwdLoad, T, D, BR, kThreads>(dOs + stage * BR * D, static_cast<const T*>(bp.dout) +
                                           b * bp.do_stride[0] + h * bp.do_stride[1], bp.do_stride[2], q0,
                                           p.seqlen_q);
    load_floats<kThreads>(lse_s + stage * BR, bp.lse2 + bh * bp.padded_q + q0, BR);
    load_floats<kThreads>(delta_s + stage * BR, bp.delta + bh * bp.padded_q + q0, BR);
    cp_async_commit();
  };

  load_tile<BwdLoad, T, D, BC, kThreads>(Ks, k, p.k_stride[2], n0, p.seqlen_k);
  load_tile<BwdLoad, T, D, BC, kThreads>(Vs, v, p.v_stride[2], n0, p.seqlen_k);
  if (n_iters > 0) load_q_block(0, 0);
  else cp_async_commit();

  float dk[kTilesD][4] = {}, dv[kTilesD][4] = {};
  const int key0 = n0 + warp * 16 + g;  // this thread's keys: key0 and key0 + 8

  for (int it = 0; it < n_iters; ++it) {
    const int stage = Tile::kStages == 2 ? it % 2 : 0;
    const int h = hk * group + it / per_head, q0 = (m_first + it % per_head) * BR;
    cp_async_wait<0>();
    __syncthreads();  // this block's tiles have landed, and every warp is done with the other stage
    if (Tile::kStages == 2 && it + 1 < n_iters) load_q_block(it + 1, 1 - stage);
    const T* Qt = Qs + stage * BR * D;
    const T* dOt = dOs + stage * BR * D;
    const float* lse2 = lse_s + stage * BR;
    const float* delta = delta_s + stage * BR;

    // Sᵀ = K Qᵀ: this warp's 16 keys against the BR queries of the block.
    float s[kTilesS][4] = {};
    mma_a_bt<D, kTilesS, Step::kUnrollD>(s, Ks, Qt, warp, lane);

    // Pᵀ = 2^(Sᵀ·scale·log2 e − lse2[query]); masked scores (keys past the end, causal) become 0.
    const bool masked = n0 + BC > p.seqlen_k || (p.causal && n0 + BC - 1 > q0 + offset);
    probs_t<kTilesS, Step::kMaskAfter>(s, lse2, p, key0, q0, masked, offset, t);

    // dV += Pᵀ dO: the Pᵀ accumulators of n8 tiles 2kk, 2kk + 1 are the A fragment of queries 16kk..16kk+15.
    mma_c_b<BwdLoad, D, BR / 16>(dv, s, dOt, lane);

    // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ − delta[query]) in place of Pᵀ.
    float dp[kTilesS][4] = {};
    mma_a_bt<D, kTilesS, Step::kUnrollD>(dp, Vs, dOt, warp, lane);
    ds_t(s, dp, delta, t);

    // dK += dSᵀ Q (the scale is applied once, at the end); step 1 also leaves dSᵀ in shared memory for dQ:
    // rows g, g + 8 of this warp's keys, queries 8n + 2t and 8n + 2t + 1 of every n8 tile.
    if constexpr (Step::kAtomicDQ) {
#pragma unroll
      for (int n = 0; n < kTilesS; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(dSs + (warp * 16 + g + 8 * r) * Tile::kDsStride + n * 8 + 2 * t) =
              pack2<T>(s[n][2 * r], s[n][2 * r + 1]);
    }
    mma_c_b<BwdLoad, D, BR / 16>(dk, s, Qt, lane);

    if constexpr (Step::kAtomicDQ) {
      // dQ (BR x D) += dS (BR x BC) K (BC x D): warp w takes query rows 16 (w % 4).., and D / (kWarps / 4)
      // columns; dS is read transposed out of dSᵀ (ldmatrix .trans), K as the B operand like V in the forward.
      constexpr int kRowTiles = BR / 16, kColsPerWarp = D * kRowTiles / Tile::kWarps;
      static_assert(Tile::kWarps % kRowTiles == 0 && kColsPerWarp % 16 == 0, "dQ: warps tile BR x D");
      __syncthreads();  // every warp's dSᵀ is in
      const int r0 = warp % kRowTiles * 16, c0 = warp / kRowTiles * kColsPerWarp;
      float dq[kColsPerWarp / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t a[4];  // matrices: (keys kk*16.., queries r0..), (keys .., r0+8..), (keys +8, r0..), (+8, +8)
        ldmatrix_x4_trans(a, dSs + (kk * 16 + lane % 8 + lane / 16 * 8) * Tile::kDsStride + r0 + lane / 8 % 2 * 8);
#pragma unroll
        for (int n = 0; n < kColsPerWarp / 8; n += 2) {
          uint32_t kb[2][2];
          load_b_v<BwdLoad, D>(kb, Ks, c0 + n * 8, kk * 16, lane);
          mma_16816<T>(dq[n], a, kb[0]);
          mma_16816<T>(dq[n + 1], a, kb[1]);
        }
      }
      add_dq_tile<D>(bp, dq, static_cast<long long>(b) * p.heads + h, q0, r0, c0, g, t);
    }
    if (Tile::kStages == 1 && it + 1 < n_iters) {  // one stage: the next tiles only once every warp is done
      __syncthreads();
      load_q_block(it + 1, 0);
    }
  }

  // dK (scaled) and dV of this block's keys: this thread's rows key0 and key0 + 8.
  const float scale = p.scale_log2 * 0.6931471805599453f;
  store_dkdv_rows<T, D>(bp, dk, dv, static_cast<long long>(b) * p.kv_heads + hk, key0, 0, scale, t);
}

// Step 8's dkdv kernel: FlashAttention-2's warp tiles. A block owns BC = 128 keys and walks query blocks of
// BR = 64, as before, but the 8 warps cover each product as a 4 x 2 (or 2 x 4) grid of 32-row tiles:
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ   warp (w % 4, w / 4): keys 32 (w % 4).., queries 32 (w / 4)..    A: K, V   B: Q, dO
//   dV += Pᵀ dO, dK += dSᵀ Q  warp (w % 4, w / 4): keys 32 (w % 4).., columns D/2 (w / 4)..   A: Pᵀ, dSᵀ (shared)
//   dQ += dS K (atomics)      warp (w % 2, w / 2): queries 32 (w % 2).., columns D/4 (w / 2)..  A: dS (shared)
// Two m16 tiles per warp: every B fragment read serves 2 mma (step 5: 1 for Sᵀ and dPᵀ), every A fragment 4 or 8.
// The price is the round trip of Pᵀ and dSᵀ through shared memory and one more barrier per query block.
// Step 10 at D = 64: BR = 128; a warp's tile of Sᵀ and dPᵀ is then 32 keys x 64 queries, and the dQ tiles are
// 32 queries x D/2 (warp (w % 4, w / 4)).
template <typename Step, int D, int kStagesT> struct BwdTiledTile {
  static constexpr int kWarps = 8, kThreads = 256, kStages = kStagesT, kCols = 128;  // BC
  static constexpr int kRows = Step::template rows<D>();                            // BR: 64 (step 10: 128)
  static constexpr bool kLseByThread = Step::template lse_by_thread<D>();           // step 16
  static constexpr int kPStride = kRows + 8;  // Pᵀ and dSᵀ rows padded by 16 bytes, as dSᵀ in step 1
  // K, V [BC][D]; per stage Q, dO [BR][D] and lse2, delta [BR]; Pᵀ, dSᵀ [BC][BR + 8]
  static constexpr int kSmemBytes = 2 * kCols * D * 2 + kStages * (2 * kRows * D * 2 + 2 * kRows * 4) +
                                    2 * kCols * kPStride * 2;
};

// A fragments of the 16 x 16 block (rows r0.., columns k0..) of a padded [rows][kStride] tile, as is (Pᵀ in
// dV += Pᵀ dO) or transposed (dS, read out of dSᵀ, in dQ += dS K: rows of A are columns of the tile).
template <int kStride, typename T>
__device__ __forceinline__ void load_a_padded(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
  ldmatrix_x4(a, tile + (r0 + lane % 8 + lane / 8 % 2 * 8) * kStride + k0 + lane / 16 * 8);
}
template <int kStride, typename T>
__device__ __forceinline__ void load_a_padded_trans(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
  ldmatrix_x4_trans(a, tile + (k0 + lane % 8 + lane / 16 * 8) * kStride + r0 + lane / 8 % 2 * 8);
}

// acc[m] (16 x 8kN, rows 16m of a warp's 32) += A B: two m16 row tiles by kN n8 tiles (4; step 10: 8), k = D.
// `read_a(a, m, kk)` and `read_b(b, nn, kk)` fetch the fragments of k-step kk (b: n8 tiles 2nn, 2nn + 1).
template <int D, typename T, int kN, typename ReadA, typename ReadB>
__device__ __forceinline__ void mma_tile(float (&acc)[2][kN][4], ReadA read_a, ReadB read_b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[2][4], b[kN / 2][2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m) read_a(a[m], m, kk);
#pragma unroll
    for (int nn = 0; nn < kN / 2; ++nn) read_b(b[nn], nn, kk);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int n = 0; n < kN; ++n) mma_16816<T>(acc[m][n], a[m], b[n / 2][n % 2]);
  }
}

// dV or dK alone (step 13): acc (a warp's two m16 tiles by kN n8 tiles) += A B over k = kK, A = rows r0.. of a
// padded [rows][kStride] tile at shared address a_at (this lane's ldmatrix offset included), B by read_b(b, n, k0):
// n8 tiles n, n + 1 of k-step k0.
template <int kStride, int kK, typename T, int kN, typename ReadB>
__device__ __forceinline__ void mma_padded_a(float (&acc)[2][kN][4], uint32_t a_at, int r0, ReadB read_b) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) ldmatrix_x4_at(a[m], a_at + ((r0 + 16 * m) * kStride + kk * 16) * 2, false);
#pragma unroll
    for (int n = 0; n < kN; n += 2) {
      uint32_t b[2][2];
      read_b(b, n, kk * 16);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        mma_16816<T>(acc[m][n], a[m], b[0]);
        mma_16816<T>(acc[m][n + 1], a[m], b[1]);
      }
    }
  }
}

// Rows g and g + 8 of a warp's two m16 tiles of C, packed to 16 bits, into a padded [rows][kStride] tile.
template <int kStride, typename T, int kN>
__device__ __forceinline__ void store_tile(T* tile, const float (&c)[2][kN][4], int r0, int c0, int g, int t) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<uint32_t*>(tile + (r0 + 16 * m + g + 8 * r) * kStride + c0 + n * 8 + 2 * t) =
            pack2<T>(c[m][n][2 * r], c[m][n][2 * r + 1]);
}

// store_tile by stmatrix (step 11; sm_90): one instruction per pair of n8 tiles of an m16 tile, not four 4-byte
// stores. Lane l gives row l % 8 of matrix l / 8: rows + 8 (l / 8 % 2) of n8 tile n + l / 16.
template <int kStride, typename T, int kN>
__device__ __forceinline__ void store_tile_matrix(T* tile, const float (&c)[2][kN][4], int r0, int c0, int g, int t) {
#if __CUDA_ARCH__ >= 900
  const int lane = 4 * g + t;
  const uint32_t at = smem_address(tile + (r0 + lane % 8 + lane / 8 % 2 * 8) * kStride + c0 + lane / 16 * 8);
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int n = 0; n < kN; n += 2) {
      const uint32_t r[4] = {pack2<T>(c[m][n][0], c[m][n][1]), pack2<T>(c[m][n][2], c[m][n][3]),
                             pack2<T>(c[m][n + 1][0], c[m][n + 1][1]), pack2<T>(c[m][n + 1][2], c[m][n + 1][3])};
      stmatrix_x4(at + (16 * m * kStride + 8 * n) * 2, r);
    }
#else
  store_tile<kStride>(tile, c, r0, c0, g, t);  // no stmatrix before sm_90
#endif
}

template <typename Step, typename T, int D, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, Step::template min_blocks<D>())
flash_bwd_dkdv_tiled_kernel(BwdParams bp) {
  constexpr int BR = Tile::kRows, BC = Tile::kCols, kThreads = Tile::kThreads, kS = Tile::kPStride;
  // A warp's tiles: Sᵀ and dPᵀ 32 keys x BR / 2 queries (kTilesS n8 tiles), dK and dV 32 keys x D / 2 columns
  // (step 18: one of them, 32 keys x D), dQ 32 queries x kColsQ columns (the 8 warps as BR / 32 x 256 / BR).
  constexpr int kTilesS = BR / 16, kTilesKV = (Step::kSplitKV ? D : D / 2) / 8, kColsQ = D * BR / 256;
  constexpr int kTilesQ = kColsQ / 8;
  constexpr bool kHoisted = Step::kHoisted;           // step 9
  constexpr bool kByThread = Tile::kLseByThread;      // step 16
  const Params& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BC * D;
  T* Qs = Vs + BC * D;                   // [stage][BR][D]
  T* dOs = Qs + Tile::kStages * BR * D;  // [stage][BR][D]
  T* Ps = dOs + Tile::kStages * BR * D;  // Pᵀ [BC][kS]
  T* dSs = Ps + BC * kS;                 // dSᵀ [BC][kS]
  float* lse_s = reinterpret_cast<float*>(dSs + BC * kS);  // [stage][BR]
  float* delta_s = lse_s + Tile::kStages * BR;             // [stage][BR]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const KeyBlock<T> kb(p, BC, BR);
  const int b = kb.b, hk = kb.hk, group = kb.group, n0 = kb.n0, offset = kb.offset, m_first = kb.m_first;
  const int m_blocks = kb.m_blocks, n_iters = kb.n_iters;
  const T *k = kb.k, *v = kb.v;
  // The query block each head's walk starts at (step 19: block x's (x mod per_head)-th; the walk wraps around).
  const int m_start = Step::kStagger && kb.per_head > 0 ? m_first + blockIdx.x % kb.per_head : m_first;

  // Query block (h, m): Q, dO, lse2 and delta into a stage. Step 9 copies each with load_rows, and lse2 and delta
  // with one 16-byte copy each by threads 0 .. BR / 2 - 1.
  const auto load_q_block = [&](int h, int m, int stage) {
    const int q0 = m * BR;
    const long long bh = static_cast<long long>(b) * p.heads + h;
    const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
    const T* dout = static_cast<const T*>(bp.dout) + b * bp.do_stride[0] + h * bp.do_stride[1];
    if constexpr (kHoisted) {
      load_rows<T, D, BR, kThreads>(Qs + stage * BR * D, q, p.q_stride[2], q0, p.seqlen_q);
      load_rows<T, D, BR, kThreads>(dOs + stage * BR * D, dout, bp.do_stride[2], q0, p.seqlen_q);
      if constexpr (kByThread) {  // step 16: value i to its thread's slot in its half of the block's queries
        static_assert(2 * BR <= kThreads, "one value per thread");
        if (threadIdx.x < 2 * BR) {
          const bool is_lse = threadIdx.x < BR;
          const int i = threadIdx.x % BR, j = i % (BR / 2);  // j: column of the warps' BR / 2 queries
          const int slot = i - j + query_slot<kTilesS, true>(j / 8, j % 8 / 2, j % 2);
          cp_async_4((is_lse ? lse_s : delta_s) + stage * BR + slot, (is_lse ? bp.lse2 : bp.delta) + bh * bp.padded_q +
                     q0 + i);
        }
      } else {
        if (threadIdx.x < BR / 2) {
          const bool is_lse = threadIdx.x < BR / 4;
          const int i = threadIdx.x % (BR / 4) * 4;
          cp_async_16((is_lse ? lse_s : delta_s) + stage * BR + i, (is_lse ? bp.lse2 : bp.delta) + bh * bp.padded_q +
                      q0 + i, true);
        }
      }
    } else {
      load_tile<BwdLoad, T, D, BR, kThreads>(Qs + stage * BR * D, q, p.q_stride[2], q0, p.seqlen_q);
      load_tile<BwdLoad, T, D, BR, kThreads>(dOs + stage * BR * D, dout, bp.do_stride[2], q0, p.seqlen_q);
      load_floats<kThreads>(lse_s + stage * BR, bp.lse2 + bh * bp.padded_q + q0, BR);
      load_floats<kThreads>(delta_s + stage * BR, bp.delta + bh * bp.padded_q + q0, BR);
    }
    cp_async_commit();
  };

  if constexpr (kHoisted) {
    load_rows<T, D, BC, kThreads>(Ks, k, p.k_stride[2], n0, p.seqlen_k);
    load_rows<T, D, BC, kThreads>(Vs, v, p.v_stride[2], n0, p.seqlen_k);
  } else {
    load_tile<BwdLoad, T, D, BC, kThreads>(Ks, k, p.k_stride[2], n0, p.seqlen_k);
    load_tile<BwdLoad, T, D, BC, kThreads>(Vs, v, p.v_stride[2], n0, p.seqlen_k);
  }
  if (n_iters > 0) load_q_block(hk * group, m_start, 0);
  else cp_async_commit();

  const int rk = warp % 4 * 32, cq = warp / 4 * (BR / 2);  // this warp's keys and queries in Sᵀ and dPᵀ
  const int cd = Step::kSplitKV ? 0 : warp / 4 * (D / 2);  // its columns of dK and dV (keys rk..)
  const int rq = warp % (BR / 32) * 32, cdq = warp / (BR / 32) * kColsQ;  // its queries and columns of dQ

  // The fragment reads. Step 9: per-lane offsets (LaneOffsets) computed once, instead of load_a, load_b_k and
  // load_b_v working out the swizzled address of every lane at every call. A: rows lane % 16, columns 8 (lane / 16);
  // load_b_k's B: rows lane % 8 + 8 (lane / 16), columns 8 (lane / 8 % 2); load_b_v's B as A, read transposed.
  const LaneOffsets<D> at_a(lane % 16, lane / 16 * 8), at_b(lane % 8 + lane / 16 * 8, lane / 8 % 2 * 8);
  const uint32_t k_at = smem_address(Ks), v_at = smem_address(Vs);
  // Sᵀ and dPᵀ: A = rows rk + 16m of K or V, B = rows cq + 16nn of Q or dO, k-step kk
  const auto read_rows = [&](uint32_t (&a)[4], const T* tile, uint32_t tile_at, int r0, int k0) {
    if constexpr (kHoisted) ldmatrix_x4_at(a, tile_at + at_a(r0, k0), false);
    else load_a<BwdLoad, D>(a, tile, r0, k0, lane);
  };
  const auto read_cols = [&](uint32_t (&bf)[2][2], const T* tile, uint32_t tile_at, int n0_, int k0) {
    if constexpr (kHoisted) {
      uint32_t r[4];
      ldmatrix_x4_at(r, tile_at + at_b(n0_, k0), false);
      b_pair(bf, r);
    } else {
      load_b_k<BwdLoad, D>(bf, tile, n0_, k0, lane);
    }
  };
  // dV, dK and dQ: B = columns c0 of rows k0.. of dO, Q or K, transposed (load_b_v). Its columns start at a
  // warp's cd or cdq, so step 9 keeps the offsets of its own columns (at_a's rows, those columns).
  const LaneOffsets<D> at_kv(lane % 16, cd + lane / 16 * 8), at_dq(lane % 16, cdq + lane / 16 * 8);
  const auto read_trans = [&](uint32_t (&bf)[2][2], const T* tile, uint32_t tile_at, const LaneOffsets<D>& at,
                              int c0, int dc, int k0) {  // dc: c0 minus the warp's first column (at's)
    if constexpr (kHoisted) {
      uint32_t r[4];
      ldmatrix_x4_at(r, tile_at + at(k0, dc), true);
      b_pair(bf, r);
    } else {
      load_b_v<BwdLoad, D>(bf, tile, c0, k0, lane);
    }
  };
  const uint32_t pad_at = (lane % 16 * kS + lane / 16 * 8) * 2;                // Pᵀ, dSᵀ rows as A
  const uint32_t pad_trans_at = ((lane % 8 + lane / 16 * 8) * kS + lane / 8 % 2 * 8) * 2;  // dSᵀ read as dS

  // dV and dK of this warp's tiles; step 18: one accumulator, dV in warps 0-3 and dK in warps 4-7.
  float acc[Step::kSplitKV ? 1 : 2][2][kTilesKV][4] = {};
  auto &dv = acc[0], &dk = acc[Step::kSplitKV ? 0 : 1];  // step 18: both name the one accumulator
  int h = hk * group, m = m_start;  // this iteration's query block, by a counter (step 1: a division)
  for (int it = 0; it < n_iters; ++it) {
    const int stage = Tile::kStages == 2 ? it % 2 : 0;
    const int q0 = m * BR;
    const int next_m = m + 1 < m_blocks ? m + 1 : m_first;
    const int next_h = (Step::kStagger ? next_m == m_start : m + 1 == m_blocks) ? h + 1 : h;
    cp_async_wait<0>();
    __syncthreads();  // tiles landed; every warp is done with the other stage, and with Pᵀ and dSᵀ
    if (Tile::kStages == 2 && it + 1 < n_iters) load_q_block(next_h, next_m, 1 - stage);
    const T* Qt = Qs + stage * BR * D;
    const T* dOt = dOs + stage * BR * D;
    const uint32_t q_at = smem_address(Qt), do_at = smem_address(dOt);
    const float* lse2 = lse_s + stage * BR + cq;
    const float* delta = delta_s + stage * BR + cq;

    {  // Pᵀ and dSᵀ of this warp's 32 keys x BR / 2 queries, into shared memory
      float s[2][kTilesS][4] = {}, dp[2][kTilesS][4] = {};
      mma_tile<D, T>(s, [&](uint32_t (&a)[4], int mi, int kk) { read_rows(a, Ks, k_at, rk + 16 * mi, kk * 16); },
                     [&](uint32_t (&bf)[2][2], int nn, int kk) { read_cols(bf, Qt, q_at, cq + 16 * nn, kk * 16); });
      const bool masked = n0 + BC > p.seqlen_k || (p.causal && n0 + BC - 1 > q0 + offset);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        probs_t<kTilesS, Step::kMaskAfter, kByThread>(s[mi], lse2, p, n0 + rk + 16 * mi + g, q0 + cq, masked,
                                                               offset, t);
      if constexpr (Step::kStoreMatrix) store_tile_matrix<kS>(Ps, s, rk, cq, g, t);
      else store_tile<kS>(Ps, s, rk, cq, g, t);
      mma_tile<D, T>(dp, [&](uint32_t (&a)[4], int mi, int kk) { read_rows(a, Vs, v_at, rk + 16 * mi, kk * 16); },
                     [&](uint32_t (&bf)[2][2], int nn, int kk) { read_cols(bf, dOt, do_at, cq + 16 * nn, kk * 16); });
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) ds_t<kTilesS, kByThread>(s[mi], dp[mi], delta, t);
      if constexpr (Step::kStoreMatrix) store_tile_matrix<kS>(dSs, s, rk, cq, g, t);
      else store_tile<kS>(dSs, s, rk, cq, g, t);
    }
    __syncthreads();  // every warp's Pᵀ and dSᵀ are in

    // Step 13 takes FlashAttention-2's order: dV, then dQ and its atomics, then dK. Before: dV and dK in one loop.
    if constexpr (Step::kDQBetween) {
      // dV += Pᵀ dO: keys rk.., columns cd.., k = the BR queries
      mma_padded_a<kS, BR, T>(dv, smem_address(Ps) + pad_at, rk, [&](uint32_t (&bf)[2][2], int n, int k0) {
        read_trans(bf, dOt, do_at, at_kv, cd + n * 8, n * 8, k0);
      });
    } else {
      if constexpr (Step::kSplitKV) {
        // Step 18: dV += Pᵀ dO in warps 0-3, dK += dSᵀ Q in warps 4-7; keys rk.., all D columns, k = the BR queries
        const bool is_dv = warp < 4;
        const T* b_tile = is_dv ? dOt : Qt;
        const uint32_t b_at = is_dv ? do_at : q_at;
        mma_padded_a<kS, BR, T>(acc[0], smem_address(is_dv ? Ps : dSs) + pad_at, rk,
                                [&](uint32_t (&bf)[2][2], int n, int k0) {
                                  read_trans(bf, b_tile, b_at, at_kv, n * 8, n * 8, k0);
                                });
      } else {
        // dV += Pᵀ dO and dK += dSᵀ Q: keys rk.., columns cd.., k = the BR queries
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
          uint32_t pa[2][4], sa[2][4];
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            const int at = ((rk + 16 * mi) * kS + kk * 16) * 2;
            if constexpr (kHoisted) {
              ldmatrix_x4_at(pa[mi], smem_address(Ps) + pad_at + at, false);
              ldmatrix_x4_at(sa[mi], smem_address(dSs) + pad_at + at, false);
            } else {
              load_a_padded<kS>(pa[mi], Ps, rk + 16 * mi, kk * 16, lane);
              load_a_padded<kS>(sa[mi], dSs, rk + 16 * mi, kk * 16, lane);
            }
          }
#pragma unroll
          for (int n = 0; n < kTilesKV; n += 2) {
            uint32_t ob[2][2], qb[2][2];
            read_trans(ob, dOt, do_at, at_kv, cd + n * 8, n * 8, kk * 16);
            read_trans(qb, Qt, q_at, at_kv, cd + n * 8, n * 8, kk * 16);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
              mma_16816<T>(dv[mi][n], pa[mi], ob[0]);
              mma_16816<T>(dv[mi][n + 1], pa[mi], ob[1]);
              mma_16816<T>(dk[mi][n], sa[mi], qb[0]);
              mma_16816<T>(dk[mi][n + 1], sa[mi], qb[1]);
            }
          }
        }
      }
    }

    // dQ += dS K: queries rq.., columns cdq.., k = the BC keys; added to the fp32 dQ with 16-byte atomics
    float dq[2][kTilesQ][4] = {};
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        if constexpr (kHoisted)
          ldmatrix_x4_at(a[mi], smem_address(dSs) + pad_trans_at + (kk * 16 * kS + rq + 16 * mi) * 2, true);
        else
          load_a_padded_trans<kS>(a[mi], dSs, rq + 16 * mi, kk * 16, lane);
      }
#pragma unroll
      for (int n = 0; n < kTilesQ; n += 2) {
        uint32_t kb[2][2];
        read_trans(kb, Ks, k_at, at_dq, cdq + n * 8, n * 8, kk * 16);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma_16816<T>(dq[mi][n], a[mi], kb[0]);
          mma_16816<T>(dq[mi][n + 1], a[mi], kb[1]);
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
      if constexpr (Step::kPairDQ)
        add_dq_pairs<D>(bp, dq[mi], static_cast<long long>(b) * p.heads + h, q0, rq + 16 * mi, cdq, g, t);
      else
        add_dq_tile<D, kTilesQ, Step::kPaddedDQ>(bp, dq[mi], static_cast<long long>(b) * p.heads + h, q0,
                                                 rq + 16 * mi, cdq, g, t);
    if constexpr (Step::kDQBetween) {
      // dK += dSᵀ Q, while the atomics are in flight
      mma_padded_a<kS, BR, T>(dk, smem_address(dSs) + pad_at, rk, [&](uint32_t (&bf)[2][2], int n, int k0) {
        read_trans(bf, Qt, q_at, at_kv, cd + n * 8, n * 8, k0);
      });
    }
    if (Tile::kStages == 1 && it + 1 < n_iters) {
      __syncthreads();
      load_q_block(next_h, next_m, 0);
    }
    h = next_h, m = next_m;
  }

  const float scale = p.scale_log2 * 0.6931471805599453f;
  const long long kv_row = static_cast<long long>(b) * p.kv_heads + hk;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    if constexpr (Step::kSplitKV)
      store_rows<T, D>(bp, warp < 4 ? bp.dv : bp.dk, acc[0][mi], kv_row, n0 + rk + 16 * mi + g, 0,
                       warp < 4 ? 1.f : scale, t);
    else
      store_dkdv_rows<T, D>(bp, dk[mi], dv[mi], kv_row, n0 + rk + 16 * mi + g, cd, scale, t);
  }
}

// Step 2's dQ pass: the forward's loop (one block per BR queries and head, K and V double-buffered), with
// P = 2^(S·scale·log2 e − lse2) known up front instead of an online softmax.
template <int D> struct DQTile {
  static constexpr int kWarps = 8, kThreads = 256;
  static constexpr int kRows = 16 * kWarps;  // BR
  static constexpr int kCols = 64;           // BC
  static constexpr int kSmemBytes = (2 * kRows + 2 * 2 * kCols) * D * 2;  // Q, dO, 2 stages of K and V
};

template <typename T, int D>
__global__ void __launch_bounds__(DQTile<D>::kThreads, 1) flash_bwd_dq_kernel(BwdParams bp) {
  using Tile = DQTile<D>;
  constexpr int BR = Tile::kRows, BC = Tile::kCols, kThreads = Tile::kThreads;
  constexpr int kTilesS = BC / 8, kTilesD = D / 8;
  const Params& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BR * D;
  T* Ks = dOs + BR * D;
  T* Vs = Ks + 2 * BC * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads, hk = h / (p.heads / p.kv_heads);
  const int q0 = (p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;  // heaviest blocks first
  const int offset = p.seqlen_k - p.seqlen_q, n_tiles = (kv_end_for_block(p, q0, BR) + BC - 1) / BC;
  const long long bh = static_cast<long long>(b) * p.heads + h;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];

  load_tile<BwdLoad, T, D, BR, kThreads>(Qs, static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1],
                                         p.q_stride[2], q0, p.seqlen_q);
  load_tile<BwdLoad, T, D, BR, kThreads>(dOs, static_cast<const T*>(bp.dout) + b * bp.do_stride[0] +
                                         h * bp.do_stride[1], bp.do_stride[2], q0, p.seqlen_q);
  if (n_tiles > 0) {
    load_tile<BwdLoad, T, D, BC, kThreads>(Ks, k, p.k_stride[2], 0, p.seqlen_k);
    load_tile<BwdLoad, T, D, BC, kThreads>(Vs, v, p.v_stride[2], 0, p.seqlen_k);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qa[D / 16][4], oa[D / 16][4];  // this warp's 16 rows of Q and dO, as A fragments
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    load_a<BwdLoad, D>(qa[kk], Qs, warp * 16, kk * 16, lane);
    load_a<BwdLoad, D>(oa[kk], dOs, warp * 16, kk * 16, lane);
  }
  const int row0 = q0 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8 (padded lse2 and delta)
  const float lse2[2] = {bp.lse2[bh * bp.padded_q + row0], bp.lse2[bh * bp.padded_q + row0 + 8]};
  const float delta[2] = {bp.delta[bh * bp.padded_q + row0], bp.delta[bh * bp.padded_q + row0 + 8]};
  float dq[kTilesD][4] = {};

  for (int j = 0; j < n_tiles; ++j) {
    const int c0 = j * BC;
    if (j > 0) {
      cp_async_wait<0>();
      __syncthreads();
    }
    if (j + 1 < n_tiles) {
      load_tile<BwdLoad, T, D, BC, kThreads>(Ks + (j + 1) % 2 * BC * D, k, p.k_stride[2], c0 + BC, p.seqlen_k);
      load_tile<BwdLoad, T, D, BC, kThreads>(Vs + (j + 1) % 2 * BC * D, v, p.v_stride[2], c0 + BC, p.seqlen_k);
      cp_async_commit();
    }
    const T* Kt = Ks + j % 2 * BC * D;
    const T* Vt = Vs + j % 2 * BC * D;

    float s[kTilesS][4] = {}, dp[kTilesS][4] = {};  // S = Q Kᵀ and dP = dO Vᵀ
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int n = 0; n < kTilesS; n += 2) {
        uint32_t kb[2][2], vb[2][2];
        load_b_k<BwdLoad, D>(kb, Kt, n * 8, kk * 16, lane);
        mma_16816<T>(s[n], qa[kk], kb[0]);
        mma_16816<T>(s[n + 1], qa[kk], kb[1]);
        load_b_k<BwdLoad, D>(vb, Vt, n * 8, kk * 16, lane);
        mma_16816<T>(dp[n], oa[kk], vb[0]);
        mma_16816<T>(dp[n + 1], oa[kk], vb[1]);
      }

    // dS = P ∘ (dP − delta), P = 0 where masked.
    const bool masked = c0 + BC > p.seqlen_k || (p.causal && c0 + BC - 1 > q0 + offset);
#pragma unroll
    for (int n = 0; n < kTilesS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = c0 + n * 8 + 2 * t + e % 2, row = row0 + e / 2 * 8;
        const bool hidden = masked && (key >= p.seqlen_k || (p.causal && key > row + offset));
        const float prob = hidden ? 0.f : fast_exp2(fmaf(s[n][e], p.scale_log2, -lse2[e / 2]));
        s[n][e] = prob * (dp[n][e] - delta[e / 2]);
      }

    // dQ += dS K: dS's accumulators are the A fragments, K the B operand read like V in the forward.
    mma_c_b<BwdLoad, D, BC / 16>(dq, s, Kt, lane);
  }

  const float scale = p.scale_log2 * 0.6931471805599453f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= p.seqlen_q) continue;
    T* dst = static_cast<T*>(bp.dq) + (bh * p.seqlen_q + row) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < kTilesD; ++n)
      *reinterpret_cast<uint32_t*>(dst + n * 8) = pack2<T>(dq[n][2 * r] * scale, dq[n][2 * r + 1] * scale);
  }
}

template <typename Kernel>
cudaError_t launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                             const BwdParams& bp) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, threads, smem, stream>>>(bp);
  return cudaGetLastError();
}

// Steps 1-7's dK/dV kernel, and step 2's dQ pass after it. 8 warps and two stages (144 KB at D = 128) where the
// GPU grants it; 4 warps and one stage (72 KB) elsewhere.
template <typename Step, typename T, int D>
cudaError_t launch_bwd_rows(const BwdParams& bp, int limit, cudaStream_t stream) {
  const Params& p = bp.fwd;
  using Big = BwdTile<Step, D>;
  using Small = BwdTile<Step, D, 4, 1>;
  const bool big = Big::kSmemBytes <= limit;
  const int cols = big ? Big::kCols : Small::kCols;
  const dim3 grid((p.seqlen_k + cols - 1) / cols, p.batch * p.kv_heads);
  cudaError_t err = big ? launch_with_smem(flash_bwd_dkdv_kernel<Step, T, D, Big>, grid, Big::kThreads,
                                           Big::kSmemBytes, stream, bp)
                        : launch_with_smem(flash_bwd_dkdv_kernel<Step, T, D, Small>, grid, Small::kThreads,
                                           Small::kSmemBytes, stream, bp);
  if constexpr (Step::kAtomicDQ) {
    return err;
  } else {  // step 2: dQ by a pass of its own
    if (err != cudaSuccess) return err;
    using DQ = DQTile<D>;
    if (DQ::kSmemBytes > limit) return cudaErrorInvalidConfiguration;
    const dim3 dq_grid((p.seqlen_q + DQ::kRows - 1) / DQ::kRows, p.batch * p.heads);
    return launch_with_smem(flash_bwd_dq_kernel<T, D>, dq_grid, DQ::kThreads, DQ::kSmemBytes, stream, bp);
  }
}

template <typename Step, typename T, int D>
cudaError_t launch_bwd_d(const BwdParams& bp, cudaStream_t stream) {
  const Params& p = bp.fwd;
  int device = 0, limit = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if constexpr (Step::kWarpTiles) {  // steps 8, 9: two stages (165 KB at D = 128) or one; else step 7's kernel
    using Two = BwdTiledTile<Step, D, 2>;
    using One = BwdTiledTile<Step, D, 1>;
    const dim3 grid((p.seqlen_k + Two::kCols - 1) / Two::kCols, p.batch * p.kv_heads);
    if (Two::kSmemBytes <= limit)
      return launch_with_smem(flash_bwd_dkdv_tiled_kernel<Step, T, D, Two>, grid, Two::kThreads,
                              Two::kSmemBytes, stream, bp);
    if (One::kSmemBytes <= limit)
      return launch_with_smem(flash_bwd_dkdv_tiled_kernel<Step, T, D, One>, grid, One::kThreads,
                              One::kSmemBytes, stream, bp);
    // Step 7's kernel. It reads only switches steps 8 and 9 share with step 7 (kAtomicDQ, kMaskAfter, kUnrollD)
    // and its own rows<D> and min_blocks<D>, so a flattened step 8 or 9 (utils.course.flatten) launches it as is.
    return launch_bwd_rows<BwdMaskAfter, T, D>(bp, limit, stream);
  } else {
    return launch_bwd_rows<Step, T, D>(bp, limit, stream);
  }
}

template <typename Step>
cudaError_t launch_flash_mma_bwd(const BwdParams& bp, DType dtype, cudaStream_t stream) {
  const bool wide = bp.fwd.head_dim == 128;
  if (bp.fwd.head_dim != 64 && !wide) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return wide ? launch_bwd_d<Step, __half, 128>(bp, stream)
                                      : launch_bwd_d<Step, __half, 64>(bp, stream);
    case DType::kBFloat16: return wide ? launch_bwd_d<Step, __nv_bfloat16, 128>(bp, stream)
                                       : launch_bwd_d<Step, __nv_bfloat16, 64>(bp, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace course_flash
