// Notebook 06c: the FlashAttention-2 forward on Hopper's instructions. One warpgroup per 64
// query rows; per tile of 64 keys:
//   1. one thread asks TMA for the K tile and the Vᵀ tile (128-byte swizzled, counted on an mbarrier);
//   2. S = Q Kᵀ with wgmma, both operands from shared memory (Q was loaded once, the same way);
//   3. the online softmax on S in registers (each row lives in the 4 lanes of a quad: two shuffles per reduction);
//   4. P, rounded to 16 bits, is already in wgmma's register A-fragment layout: O += P V with A from registers
//      and B = the Vᵀ tile (V transposed by the caller, so every operand is K-major).
// Step 1 (kStages = 1): loads and multiplies take turns, as in the GEMM's step 2. Step 2 (kStages = 2): two
// K/Vᵀ buffers, the next tile's copy issued before this tile's multiplies. Steps 3-16 (hopper_attention_ws_kernel):
// warp specialisation, then FlashAttention-3's refinements one at a time.
// Causal attention is bottom-right aligned (key c is visible to query r when c <= r + Nk - Nq), tiles past the
// diagonal are skipped, and TMA's zero fill covers the ragged last tiles.
#ifndef COURSE_TORCH_WRAPPER
#include <algorithm>
#include <cstdint>
#include <cuda.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include "hopper.cuh"

namespace course_hopper {

constexpr int kRows = 64;  // queries per block: 16 per warp
constexpr int kKeys = 64;  // keys per tile

struct AttentionParams {
  int seqlen_q, seqlen_k, heads, kv_heads, batch_heads;
  float scale_log2;  // softmax scale * log2(e): exp2 instead of exp
  int* work_counter;  // step 12: the next query block to hand out (zeroed by the caller), else unused
  int head_group;     // step 13: how many heads' blocks start together (at least 1)
  long long* timeline;  // steps 3-16: kTimelineSlots milestones per block (utils.hopper.block_timeline), or null
};
// The milestones of a block's first work item, in ns of the global timer: its start, Q arrived, the first K/V
// tile arrived, the first tile's softmax done, the main loop done, the last P V done, the store of O done; and last
// the SM and the item's tile count (sm << 32 | tiles). Noted by the first consumer's thread 0 (the start by thread
// 0). The store is "done" when that thread has issued its stores (store_rows), or when TMA has read its warpgroup's
// tile out of shared memory (store_tile): O may still be on its way to global memory.
constexpr int kTimelineSlots = 8;
__device__ __forceinline__ void note(const AttentionParams& p, int slot, long long value) {
  if (p.timeline != nullptr) p.timeline[kTimelineSlots * (blockIdx.x + blockIdx.y * gridDim.x) + slot] = value;
}

template <typename T>
__device__ inline uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One warpgroup's running state for its 64 query rows: O's fp32 accumulators, and per row the running maximum m
// and this thread's part of the sum l (log2 domain; the quad adds its parts at the end).
template <int D>
struct RowState {
  float acc[D / 2], m[2], l[2];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }
};

// exp2 as one instruction of the special-function unit (MUFU.EX2), denormal results flushed to zero; exp2f
// without --use_fast_math wraps it in range handling that costs several more.
__device__ inline float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2. S = Q Kᵀ for one tile of N keys (64, or 128 from step 9): D / 16 slices of 16 along the head dim, 4 per
// 64-column panel, both operands in shared memory (`sq` this warpgroup's Q tile, its panels `q_panel` bytes
// apart; `sk` the K tile, N rows per panel). Only the issue: the caller fences before and commits after.
template <typename T, int D, int N = 64>
__device__ __forceinline__ void issue_qk(float (&s)[N / 2], uint32_t sq, uint32_t q_panel, uint32_t sk) {
  constexpr int kPanel = N * 128;  // an N-row, 64-column panel of a K-major tile
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // the first slice overwrites S (accumulate = 0)
    const uint64_t a = smem_desc(sq + (ks / 4) * q_panel + (ks % 4) * 32, 16, 1024, Swizzle::k128B);
    const uint64_t b = smem_desc(sk + (ks / 4) * kPanel + (ks % 4) * 32, 16, 1024, Swizzle::k128B);
    if constexpr (N == 64) wgmma_m64n64k16<T>(s, a, b, ks > 0);
    else wgmma_m64n128k16<T>(s, a, b, ks > 0);
  }
}

// 3. The online softmax of one tile of S, starting at key k0: updates the row maxima and sums, returns each row's
// rescale factor for O in `alpha` and P, rounded to 16 bits, in `a`. s[4j + r] is row row[r / 2], key
// k0 + 8j + 2t + r % 2 (`row`: the two rows this thread holds; `t`: its lane within the quad). kFast (step 4):
// keys are masked only in tiles that need it (kMask), and the scale joins the exponent in one FMA:
// exp2(s·c - m) with m kept in scaled units, instead of scaling every score first.
template <typename T, int D, bool kCausal, bool kFast, bool kMask, int N = 64>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, float (&s)[N / 2], uint32_t (&a)[N / 16][4],
                                             float (&alpha)[2], int k0, const int (&row)[2], int t,
                                             const AttentionParams& p) {
  const int diagonal = p.seqlen_k - p.seqlen_q;
  float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = k0 + 8 * j + 2 * t + r % 2;
      if (kMask && (key >= p.seqlen_k || (kCausal && key > row[r / 2] + diagonal))) s[4 * j + r] = -CUDART_INF_F;
      if (!kFast) s[4 * j + r] *= p.scale_log2;
      tile_max[r / 2] = fmaxf(tile_max[r / 2], s[4 * j + r]);
    }
  }
  float base[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_new = fmaxf(st.m[i], quad_max(tile_max[i]) * (kFast ? p.scale_log2 : 1.f));
    base[i] = m_new == -CUDART_INF_F ? 0.f : m_new;  // a row with no key yet: keep exp2 away from inf - inf
    alpha[i] = exp2f(st.m[i] - base[i]);
    st.m[i] = m_new;
    st.l[i] *= alpha[i];
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    s[i] = kFast ? fast_exp2(fmaf(s[i], p.scale_log2, -base[i % 4 / 2])) : exp2f(s[i] - base[i % 4 / 2]);
    st.l[i % 4 / 2] += s[i];
  }
  // The C fragments of key columns 16kk..16kk+15 are the A fragment of P for that K-slice of O += P V.
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
}

template <int D>
__device__ __forceinline__ void rescale(RowState<D>& st, const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) st.acc[i] *= alpha[i % 4 / 2];
}

// 4. O += P V: A = P from registers (`a`, one K-slice of 16 keys each), B = the Vᵀ tile `sv` (D rows of N keys,
// in panels of 64 keys). Only the issue, as for issue_qk. kVDirect (step 10): `sv` is V as stored, N rows of
// keys in panels of 64 head-dim columns: a K-slice is 16 rows (two 1 KB swizzle atoms, 1024 bytes apart), the
// next 64 columns of D one panel (N * 128 bytes) on, read N-major.
template <typename T, int D, int N = 64, bool kVDirect = false>
__device__ __forceinline__ void issue_pv(RowState<D>& st, const uint32_t (&a)[N / 16][4], uint32_t sv) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    if constexpr (kVDirect) {
      wgmma_m64k16_rs<T, D, true>(st.acc, a[kk], smem_desc(sv + kk * 16 * 128, N * 128, 1024, Swizzle::k128B));
    } else {
      const uint32_t slice = sv + (kk / 4) * D * 128 + (kk % 4) * 32;
      wgmma_m64k16_rs<T, D>(st.acc, a[kk], smem_desc(slice, 16, 1024, Swizzle::k128B));
    }
  }
}

// Pins P's fragments in place: the register moves and conversions that make them stay before the wgmma that
// follows (a non-wgmma instruction writing a wgmma input inside the pipeline makes ptxas serialize every wgmma).
template <int K>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kk][i])::"memory");
  }
}

// Parts 2-4 for one tile of 64 keys, each waited for before the next starts (the worklog's steps 1-5).
template <typename T, int D, bool kCausal, bool kFast, bool kMask>
__device__ __forceinline__ void attend_tile(RowState<D>& st, uint32_t sq, uint32_t q_panel, uint32_t sk, uint32_t sv,
                                            int k0, const int (&row)[2], int t, const AttentionParams& p) {
  float s[32], alpha[2];
  uint32_t a[4][4];
  fence_registers(s);
  wgmma_fence();
  issue_qk<T, D>(s, sq, q_panel, sk);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(s);
  softmax_tile<T, D, kCausal, kFast, kMask>(st, s, a, alpha, k0, row, t, p);
  rescale<D>(st, alpha);
  fence_registers(st.acc);
  wgmma_fence();
  issue_pv<T, D>(st, a, sv);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(st.acc);
}

// The epilogue: the quad's row sums, O / l (0 for a row that saw no key), 4-byte stores of two values.
template <typename T, int D>
__device__ __forceinline__ void store_rows(RowState<D>& st, T* o, int bh, const int (&row)[2], int t,
                                           int seqlen_q) {
#pragma unroll
  for (int i = 0; i < 2; ++i) st.l[i] = quad_sum(st.l[i]);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row[half];
      if (r >= seqlen_q) continue;
      const float inv = st.l[half] > 0.f ? 1.f / st.l[half] : 0.f;
      const uint32_t v = pack2<T>(st.acc[4 * j + 2 * half] * inv, st.acc[4 * j + 2 * half + 1] * inv);
      *reinterpret_cast<uint32_t*>(o + (static_cast<size_t>(bh) * seqlen_q + r) * D + 8 * j + 2 * t) = v;
    }
  }
}

// Step 15's epilogue. store_rows's 4-byte stores put 8 rows x 16 bytes into each warp's store instruction: 8
// half-filled 32-byte sectors each, and the store queue backs up (the block's last 3 us at D = 128). Instead, O / l
// rounded to 16 bits goes into this warpgroup's own Q tile in shared memory (`tile`, 64-column panels
// `panel_bytes` apart; Q's last S is done, so it is free) in the 128-byte swizzled layout TMA loaded Q in: the
// same row's 16-byte chunks land in different banks, so no store conflicts. Then one thread has TMA write each
// 64 x 64 panel to rows q_lo.. of head bh as whole lines; rows past Nq are not written.
template <typename T, int D>
__device__ __forceinline__ void store_tile(RowState<D>& st, uint32_t tile, uint32_t panel_bytes,
                                           const CUtensorMap* map_o, int q_lo, int bh, int wg) {
  const int wtid = threadIdx.x % 128, lane = wtid % 32, t = lane % 4, r0 = 16 * (wtid / 32) + lane / 4;
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    st.l[i] = quad_sum(st.l[i]);
    inv[i] = st.l[i] > 0.f ? 1.f / st.l[i] : 0.f;
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {  // columns 8j + 2t and + 1: panel j / 8, bytes 16 (j % 8) + 4t of the row
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t v = pack2<T>(st.acc[4 * j + 2 * half] * inv[half], st.acc[4 * j + 2 * half + 1] * inv[half]);
      const uint32_t at = tile + (j / 8) * panel_bytes + swizzle((r0 + 8 * half) * 128 + 16 * (j % 8) + 4 * t,
                                                                 Swizzle::k128B);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
    }
  }
  fence_proxy_async();               // the tile's stores visible to TMA (the async proxy)
  named_barrier_sync(3 + wg, 128);   // the whole warpgroup's part of O is in (barriers 1-2 are step 7's turns)
  if (wtid == 0) {
    for (int panel = 0; panel < D / 64; ++panel) tma_store_3d(map_o, 64 * panel, q_lo, bh, tile + panel * panel_bytes);
    tma_store_commit();
    tma_store_wait_read();  // shared memory must outlive TMA's reads of it: the block ends after this
  }
}

template <typename T, int D, bool kCausal, int kStages>
__global__ void __launch_bounds__(128) hopper_attention_kernel(const __grid_constant__ CUtensorMap map_q,
                                                               const __grid_constant__ CUtensorMap map_k,
                                                               const __grid_constant__ CUtensorMap map_vt,
                                                               T* __restrict__ o, const AttentionParams p) {
  constexpr int kPanel = 64 * 128;  // a 64-row, 64-column panel of a K-major tile: 8 KB
  constexpr int kTile = D * 128;    // Q and K tiles (64 rows x D), and the Vᵀ tile (D rows x 64 keys)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  // Q, then per stage a K tile and a Vᵀ tile; step 2 keeps two stages: the next tile arrives during this one.
  const uint32_t sq = smem_u32(smem);
  __shared__ __align__(8) uint64_t bars[1 + kStages];  // Q arrived; stage s's K and Vᵀ arrived
  const uint32_t bar_q = smem_u32(&bars[0]);

  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int bh_kv = b * p.kv_heads + h / (p.heads / p.kv_heads);
  const int q0 = blockIdx.x * kRows;
  const int row[2] = {q0 + 16 * (tid / 32) + g, q0 + 16 * (tid / 32) + g + 8};  // the rows this thread holds
  const int diagonal = p.seqlen_k - p.seqlen_q;
  const int k_end = kCausal ? min(p.seqlen_k, max(0, q0 + kRows + diagonal)) : p.seqlen_k;

  const int tiles = (k_end + kKeys - 1) / kKeys;
  // One thread asks for tile `i`'s K and Vᵀ in stage i % kStages; that stage's barrier counts their bytes.
  auto issue = [&](int i) {
    const int stage = i % kStages;
    const uint32_t sk = sq + kTile * (1 + 2 * stage), sv = sk + kTile, bar = smem_u32(&bars[1 + stage]);
    mbarrier_arrive_expect(bar, 2 * kTile);
    for (int panel = 0; panel < D / 64; ++panel) {
      tma_load_3d(sk + panel * kPanel, &map_k, 64 * panel, kKeys * i, bh_kv, bar);
    }
    tma_load_3d(sv, &map_vt, kKeys * i, 0, bh_kv, bar);
  };
  if (tid == 0) {
    for (int i = 0; i < 1 + kStages; ++i) mbarrier_init(smem_u32(&bars[i]), 1);
    mbarrier_arrive_expect(bar_q, kTile);
    for (int panel = 0; panel < D / 64; ++panel) tma_load_3d(sq + panel * kPanel, &map_q, 64 * panel, q0, bh, bar_q);
    if (kStages > 1 && tiles > 0) issue(0);  // the pipeline's first tile, before anyone waits
  }
  __syncthreads();

  RowState<D> st;
  st.init();
  mbarrier_wait(bar_q, 0);

  for (int it = 0; it < tiles; ++it) {
    const int stage = it % kStages;
    const uint32_t sk = sq + kTile * (1 + 2 * stage), sv = sk + kTile;
    // Step 1 asks for this tile now; step 2 for the next one, into the stage the previous tile freed (every
    // warp passed the __syncthreads at the end of the last iteration).
    if (tid == 0 && (kStages == 1 || it + 1 < tiles)) issue(kStages == 1 ? it : it + 1);
    mbarrier_wait(smem_u32(&bars[1 + stage]), (it / kStages) & 1);  // a stage's phase flips at each of its tiles
    attend_tile<T, D, kCausal, false, true>(st, sq, kPanel, sk, sv, kKeys * it, row, t, p);
    __syncthreads();  // every warp is done with K and Vᵀ before the next copy overwrites them
  }
  store_rows<T, D>(st, o, bh, row, t, p.seqlen_q);
}

// Steps 3-16: warp specialisation. Three warpgroups per block (four at steps 11-15 at D = 64): warpgroup 0 is the
// producer (one thread issues every TMA copy, the others leave at once), the others the consumers, 64 query rows
// each. The producer gives its registers away (setmaxnreg), so each of two consumers may use up to 240. Each K/Vᵀ
// stage passes back and forth on two barriers: `full` (its bytes arrived) and `empty` (every consumer thread is
// done with it).
// Step 4 trims the softmax (softmax_tile's kFast, masks only where needed); step 5 deepens the ring from 2 to 4
// stages; step 6 computes tile i's softmax while tile i-1's P V runs; step 7 makes the consumers take turns;
// step 8 launches the longest causal rows first; step 9 takes 128 keys per tile (back to 2 stages, which fit).
__host__ __device__ constexpr int ws_stages(int step) { return step >= 5 && step < 9 ? 4 : 2; }
__host__ __device__ constexpr int ws_keys(int step) { return step >= 9 ? 128 : 64; }
// Step 10 goes back to step 6, the fastest, and changes one thing: V is read as it is stored (N-major B), so the
// caller no longer writes a transposed copy of V before every call.
// Step 11 keeps step 10 and, at D = 64, gives each block a third consumer warpgroup (192 query rows): each K/V
// tile then serves 1.5 times the rows, and three softmaxes can hide under each other's short multiplies. The
// registers are shared four ways, 24 for the producer and 160 for each consumer (a D = 64 consumer needs fewer
// than 128). D = 128 keeps two, whose accumulators would not fit in 160.
__host__ __device__ constexpr int ws_base(int step) { return step >= 10 ? 6 : step; }
__host__ __device__ constexpr int ws_consumers(int step, int d) {
  return step >= 11 && step <= 15 && d == 64 ? 3 : 2;
}
// Step 12 keeps step 11 and makes the blocks persistent: one per SM, each taking query blocks from a counter
// until none are left (under a causal mask the longest first; one head's blocks after each other, so its K and V
// stay in L2). Q gets a ring of its own, two deep: the producer loads the next block's Q and first K/V tiles
// while the consumers finish this one, so no block starts on an empty pipeline and no launch leaves an SM idle.
__host__ __device__ constexpr bool ws_persistent(int step) { return step == 12; }
__host__ __device__ constexpr int ws_q_buffers(int step) { return ws_persistent(step) ? 2 : 1; }
__host__ __device__ constexpr int ws_threads(int step, int d) { return 128 * (1 + ws_consumers(step, d)); }
// Step 13 goes back to step 11 and changes the order the blocks start in. Step 8 put the longest query blocks
// first within each head, but heads still came one after another: the GPU started each head's longest blocks only
// after the previous head's shortest, and the last heads' long blocks ran alone at the end. Now the blocks of
// `head_group` heads start together, the longest query block of every head of the group first, so the whole
// launch ends on short blocks; the group is as many heads as half the L2 cache holds the K and V of (the caller
// chooses; 1 without a causal mask, where every block is as long).
__host__ __device__ constexpr bool ws_head_groups(int step) { return step == 13 || step == 14; }
// Step 14 keeps step 13 and lets each consumer stop at its own diagonal. A causal block reads keys up to its last
// row's diagonal, but the first consumer's rows end 64 (at D = 64 with three consumers, 128) keys earlier: its last
// tile or two are masked out completely, yet it multiplied them anyway. Now it only waits for them and hands them
// back, leaving the tensor cores to the consumer that needs them.
__host__ __device__ constexpr bool ws_own_diagonal(int step) { return step == 14; }
// Step 15 goes back to step 11 and changes its last act: O leaves through shared memory and a TMA store
// (store_tile) instead of each thread's 4-byte stores (store_rows). A per-block timeline of step 11 on the H200
// showed store_rows taking about 3.4 us of a causal 4k block's 42 us at D = 128, and 1.6 of 38 at D = 64.
__host__ __device__ constexpr bool ws_tma_store(int step) { return step == 15; }
// Step 16 goes back to step 10 and takes step 9's tiles of 128 keys (two stages), without the turns of step 7 that
// step 9 kept: step 9 lost, but on top of turns that had lost too. Two consumers at both head dims, as step 10.
__host__ __device__ constexpr bool ws_wide_v_direct(int step) { return step == 16; }
// Keys per tile and K/V stages of a step: its base step's, but 128 and 2 for step 16.
__host__ __device__ constexpr int ws_tile_keys(int step) {
  return ws_wide_v_direct(step) ? 128 : ws_keys(ws_base(step));
}
__host__ __device__ constexpr int ws_tile_stages(int step) {
  return ws_wide_v_direct(step) ? 2 : ws_stages(ws_base(step));
}

template <typename T, int D, bool kCausal, int kStep>
__global__ void __launch_bounds__(ws_threads(kStep, D), 1)
    hopper_attention_ws_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                               const __grid_constant__ CUtensorMap map_vt, const __grid_constant__ CUtensorMap map_o,
                               T* __restrict__ o, const AttentionParams p) {
  constexpr int kBase = ws_base(kStep), kN = ws_tile_keys(kStep), kStages = ws_tile_stages(kStep);  // keys, stages
  constexpr bool kVDirect = kStep >= 10;
  constexpr int kConsumers = ws_consumers(kStep, D), kBlockRows = kConsumers * kRows;  // query rows per block
  constexpr int kQPanel = kBlockRows * 128, kKPanel = kN * 128;     // 64-column panels of Q (all rows) and K
  constexpr int kTile = kN * D * 2;                                 // bytes of a K tile, and of a Vᵀ tile
  constexpr bool kFast = kBase >= 4, kPersistent = ws_persistent(kStep), kGrouped = ws_head_groups(kStep);
  constexpr int kQBufs = ws_q_buffers(kStep);                       // Q's ring: two deep when persistent
  // a consumer that skips tiles (step 14) would leave the turns' named barriers (step 7) short of arrivals
  static_assert(!(ws_own_diagonal(kStep) && kBase >= 7), "own_diagonal builds on a step without turns");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sq = smem_u32(smem), stages = sq + kQBufs * D / 64 * kQPanel;  // Q buffers; kStages x (K, Vᵀ)
  __shared__ __align__(8) uint64_t bars[2 * kQBufs + 2 * kStages];  // q_full[b]; q_empty[b]; full[s]; empty[s]
  __shared__ int work_slot[kQBufs];  // step 12: the work item whose Q is in buffer b (-1: none left)
  auto q_full = [&](int b) { return smem_u32(&bars[b]); };
  auto q_empty = [&](int b) { return smem_u32(&bars[kQBufs + b]); };
  auto full = [&](int s) { return smem_u32(&bars[2 * kQBufs + s]); };
  auto empty = [&](int s) { return smem_u32(&bars[2 * kQBufs + kStages + s]); };

  const int tid = threadIdx.x, warpgroup = tid / 128;
  if (tid == 0) note(p, 0, global_timer_ns());
  const int q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows, diagonal = p.seqlen_k - p.seqlen_q;
  // A work item: one block of query rows of one (batch, head), and how many K/V tiles it reads. Step 8: with a
  // causal mask the last query blocks have the most keys; launching them first (blocks start in order of
  // blockIdx.x) leaves the short ones to fill the GPU at the end instead of a long one running alone.
  struct Work { int q0, bh, bh_kv, tiles; };
  auto work = [&](int w) {
    int bh = kPersistent ? w / q_blocks : blockIdx.y, x = kPersistent ? w % q_blocks : blockIdx.x;
    if constexpr (kGrouped) {  // step 13: w = blockIdx.x; its group of heads, then the query block, then the head
      const int g = w / (p.head_group * q_blocks), r = w % (p.head_group * q_blocks);
      const int heads_in_group = min(p.head_group, p.batch_heads - g * p.head_group);
      bh = g * p.head_group + r % heads_in_group, x = r / heads_in_group;
    }
    const int q_block = (kPersistent || kGrouped || kBase >= 8) && kCausal ? q_blocks - 1 - x : x;
    const int q0 = q_block * kBlockRows, b = bh / p.heads, h = bh % p.heads;
    const int k_end = kCausal ? min(p.seqlen_k, max(0, q0 + kBlockRows + diagonal)) : p.seqlen_k;
    return Work{q0, bh, b * p.kv_heads + h / (p.heads / p.kv_heads), (k_end + kN - 1) / kN};
  };
  if (tid == 0) {
    for (int b = 0; b < kQBufs; ++b) mbarrier_init(q_full(b), 1), mbarrier_init(q_empty(b), 128 * kConsumers);
    for (int s = 0; s < kStages; ++s) mbarrier_init(full(s), 1), mbarrier_init(empty(s), 128 * kConsumers);
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer
    setmaxnreg_dec<24>();
    if (tid == 0) {
      const int total = q_blocks * p.batch_heads;
      int w = blockIdx.x, it = 0;  // the work item (step 12: the first is the block's own); K/V tiles issued
      for (int n = 0;; ++n) {
        const int qb = n % kQBufs;
        if (n >= kQBufs) mbarrier_wait(q_empty(qb), (n / kQBufs - 1) & 1);  // item n - 2 is done with buffer qb
        if constexpr (kPersistent) {
          work_slot[qb] = w < total ? w : -1;  // seen by the consumers once q_full(qb) completes
          if (w >= total) {
            mbarrier_arrive(q_full(qb));
            break;
          }
        }
        const Work wk = work(w);
        const int next = kPersistent ? gridDim.x + atomicAdd(p.work_counter, 1) : 0;  // asked for early
        const uint32_t sq_b = sq + qb * D / 64 * kQPanel;
        mbarrier_arrive_expect(q_full(qb), D / 64 * kQPanel);
        for (int panel = 0; panel < D / 64; ++panel) {  // Q in boxes of 128 rows; from step 11, 64 per consumer
          if constexpr (kStep >= 11) {
            for (int c = 0; c < kConsumers; ++c) {
              tma_load_3d(sq_b + panel * kQPanel + c * kRows * 128, &map_q, 64 * panel, wk.q0 + c * kRows, wk.bh,
                          q_full(qb));
            }
          } else {
            tma_load_3d(sq_b + panel * kQPanel, &map_q, 64 * panel, wk.q0, wk.bh, q_full(qb));
          }
        }
        for (int i = 0; i < wk.tiles; ++i, ++it) {  // `it` runs on across work items: the ring never restarts
          const int s = it % kStages;
          if (it >= kStages) mbarrier_wait(empty(s), (it / kStages - 1) & 1);  // tile it - kStages released it
          const uint32_t sk = stages + s * 2 * kTile, sv = sk + kTile;
          mbarrier_arrive_expect(full(s), 2 * kTile);
          for (int panel = 0; panel < D / 64; ++panel) {  // K: N rows of 64 columns per copy
            tma_load_3d(sk + panel * kKPanel, &map_k, 64 * panel, kN * i, wk.bh_kv, full(s));
          }
          for (int panel = 0; panel < (kVDirect ? D : kN) / 64; ++panel) {
            if (kVDirect) tma_load_3d(sv + panel * kKPanel, &map_vt, 64 * panel, kN * i, wk.bh_kv, full(s));  // V
            else tma_load_3d(sv + panel * D * 128, &map_vt, kN * i + 64 * panel, 0, wk.bh_kv, full(s));  // Vᵀ
          }
        }
        if (!kPersistent) break;
        w = next;
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumers == 3 ? 160 : 240>();  // a consumer
  const int wg = warpgroup - 1, wtid = tid % 128, lane = tid % 32, t = lane % 4;
  int it = 0;  // K/V tiles consumed so far: where this work item's first tile sits in the ring
  for (int n = 0;; ++n) {
    const int qb = n % kQBufs;
    mbarrier_wait(q_full(qb), (n / kQBufs) & 1);
    const int w = kPersistent ? work_slot[qb] : blockIdx.x;
    if (w < 0) break;
    const Work wk = work(w);
    auto mark = [&](int slot) { if (tid == 128 && n == 0) note(p, slot, global_timer_ns()); };  // first consumer
    mark(1);
    const int q_lo = wk.q0 + kRows * wg;  // this warpgroup's first row
    // the tiles this consumer multiplies: the block's, or from step 14 (causal) those up to its own diagonal
    const int own_end = min(p.seqlen_k, max(0, q_lo + kRows + diagonal));
    const int tiles = ws_own_diagonal(kStep) && kCausal ? min(wk.tiles, (own_end + kN - 1) / kN) : wk.tiles;
    const int row[2] = {q_lo + 16 * (wtid / 32) + lane / 4, q_lo + 16 * (wtid / 32) + lane / 4 + 8};
    const uint32_t sq_wg = sq + qb * D / 64 * kQPanel + wg * kRows * 128;
    auto ring = [&](int i) { return (it + i) % kStages; };  // the stage holding this item's K/V tile i
    auto wait_full = [&](int i) { mbarrier_wait(full(ring(i)), ((it + i) / kStages) & 1); };
    auto key_tile = [&](int i) { return stages + ring(i) * 2 * kTile; };
    // Only a tile that reaches past Nk, or crosses this warpgroup's diagonal, has keys to mask (steps 1-3 mask all).
    auto needs_mask = [&](int i) { return !kFast || tile_needs_mask(i, kN, q_lo, p.seqlen_q, p.seqlen_k, kCausal); };
    RowState<D> st;
    st.init();
    if constexpr (kBase <= 5) {
      for (int i = 0; i < tiles; ++i) {
        wait_full(i);
        if (i == 0) mark(2);
        const uint32_t sk = key_tile(i);
        if (needs_mask(i)) {
          attend_tile<T, D, kCausal, kFast, true>(st, sq_wg, kQPanel, sk, sk + kTile, kN * i, row, t, p);
        } else {
          attend_tile<T, D, kCausal, kFast, false>(st, sq_wg, kQPanel, sk, sk + kTile, kN * i, row, t, p);
        }
        mbarrier_arrive(empty(ring(i)));
        if (i == 0) mark(3);
      }
      mark(4);
    } else if (tiles > 0) {
      // Step 6: S for tile i is issued together with P V for tile i-1, and the softmax of tile i runs while P V
      // does; O is rescaled only after that wgmma is done. Step 7 adds turns: a consumer issues its wgmma only
      // when the other has issued its own, so one's softmax lines up under the other's multiplies. Each consumer
      // issues tiles + 1 times; consumer 1 opens consumer 0's first turn and skips giving back its own last one,
      // so every named barrier completes as often as it is waited on.
      auto turn = [&] { if (kBase >= 7) named_barrier_sync(1 + wg, 256); };
      auto done = [&](bool last) { if (kBase >= 7 && !(last && wg == 1)) named_barrier_arrive(2 - wg, 256); };
      if (kBase >= 7 && wg == 1) named_barrier_arrive(1, 256);
      float s[kN / 2], alpha[2];
      // P of two consecutive tiles: P V reads one, the softmax writes the other
      uint32_t pa[kN / 16][4], pb[kN / 16][4];
      auto softmax = [&](int i, uint32_t (&out)[kN / 16][4]) {
        if (needs_mask(i)) softmax_tile<T, D, kCausal, true, true, kN>(st, s, out, alpha, kN * i, row, t, p);
        else softmax_tile<T, D, kCausal, true, false, kN>(st, s, out, alpha, kN * i, row, t, p);
      };
      // Tile i: S = Q K_iᵀ and O += P_(i-1) V_(i-1) in flight together, tile i's softmax under the second.
      auto tile = [&](int i, uint32_t (&prev)[kN / 16][4], uint32_t (&next)[kN / 16][4]) {
        wait_full(i);
        turn();
        fence_registers(s);  // every input of both products settled before the first is issued
        fence_registers(st.acc);
        fence_fragments(prev);
        wgmma_fence();
        issue_qk<T, D, kN>(s, sq_wg, kQPanel, key_tile(i));
        wgmma_commit();
        issue_pv<T, D, kN, kVDirect>(st, prev, key_tile(i - 1) + kTile);
        wgmma_commit();
        done(false);
        wgmma_wait<1>();  // S is in; P V may still run
        fence_registers(s);
        softmax(i, next);
        wgmma_wait<0>();
        fence_registers(st.acc);
        mbarrier_arrive(empty(ring(i - 1)));
        rescale<D>(st, alpha);
      };
      auto last = [&](uint32_t (&prev)[kN / 16][4]) {  // O += P V for the last tile
        turn();
        fence_registers(st.acc);
        fence_fragments(prev);
        wgmma_fence();
        issue_pv<T, D, kN, kVDirect>(st, prev, key_tile(tiles - 1) + kTile);
        wgmma_commit();
        done(true);
        wgmma_wait<0>();
        fence_registers(st.acc);
        mbarrier_arrive(empty(ring(tiles - 1)));
      };
      wait_full(0);
      mark(2);
      turn();
      fence_registers(s);
      wgmma_fence();
      issue_qk<T, D, kN>(s, sq_wg, kQPanel, key_tile(0));
      wgmma_commit();
      done(false);
      wgmma_wait<0>();
      fence_registers(s);
      softmax(0, pa);  // O is still 0: nothing to rescale
      mark(3);
      // Two tiles per trip, so that pa and pb swap roles without a copy (register moves into a wgmma's inputs
      // between its issue and its wait make ptxas serialize every wgmma of the kernel).
      int i = 1;
      for (; i + 1 < tiles; i += 2) {
        tile(i, pa, pb);
        tile(i + 1, pb, pa);
      }
      mark(4);
      if (i < tiles) {
        tile(i, pa, pb);
        last(pb);
      } else {
        last(pa);
      }
    }
    mark(5);
    for (int i = tiles; i < wk.tiles; ++i) {  // step 14: tiles only the other consumers need, handed straight back
      wait_full(i);  // (arriving before the tile is in would count towards the stage's previous tile)
      mbarrier_arrive(empty(ring(i)));
    }
    it += wk.tiles;
    if (kPersistent) mbarrier_arrive(q_empty(qb));  // Q's buffer may take item n + 2
    if constexpr (ws_tma_store(kStep)) store_tile<T, D>(st, sq_wg, kQPanel, &map_o, q_lo, wk.bh, wg);
    else store_rows<T, D>(st, o, wk.bh, row, t, p.seqlen_q);
    mark(6);
    if (tid == 128 && n == 0) note(p, 7, static_cast<long long>(sm_id()) << 32 | wk.tiles);
    if (!kPersistent) break;
  }
}

template <typename T, int D, int kStep>
cudaError_t launch_ws(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                      const CUtensorMap& o_map, void* o, const AttentionParams& p, int batch_heads,
                      cudaStream_t stream) {
  // the block's rows of Q, the K/Vᵀ stages, alignment room
  constexpr int kBlockRows = ws_consumers(kStep, D) * kRows, kQBufs = ws_q_buffers(kStep);
  const int smem = kQBufs * kBlockRows * D * 2 + ws_tile_stages(kStep) * 2 * ws_tile_keys(kStep) * D * 2 + 1024;
  const int q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
  dim3 grid(q_blocks, batch_heads);
  if (ws_head_groups(kStep)) grid = dim3(q_blocks * batch_heads, 1);  // one line of blocks, in work-item order
  if (ws_persistent(kStep)) {  // one block per SM (their registers fill it), none idle
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    grid = dim3(std::min(q_blocks * batch_heads, sms), 1);
  }
  auto kernel = causal ? hopper_attention_ws_kernel<T, D, true, kStep> : hopper_attention_ws_kernel<T, D, false, kStep>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, ws_threads(kStep, D), smem, stream>>>(q, k, vt, o_map, static_cast<T*>(o), p);
  return cudaGetLastError();
}

template <typename T, int D, int kStages>
cudaError_t launch_typed(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt, void* o,
                         const AttentionParams& p, int batch_heads, cudaStream_t stream) {
  const int smem = (1 + 2 * kStages) * D * 128 + 1024;  // Q, kStages x (K, Vᵀ) tiles + alignment room
  const dim3 grid((p.seqlen_q + kRows - 1) / kRows, batch_heads);
  auto kernel = causal ? hopper_attention_kernel<T, D, true, kStages>
                       : hopper_attention_kernel<T, D, false, kStages>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, 128, smem, stream>>>(q, k, vt, static_cast<T*>(o), p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_step(int step, bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                        const CUtensorMap& o_map, void* o, const AttentionParams& p, int batch_heads,
                        cudaStream_t stream) {
  switch (step) {
    case 1: return launch_typed<T, D, 1>(causal, q, k, vt, o, p, batch_heads, stream);
    case 2: return launch_typed<T, D, 2>(causal, q, k, vt, o, p, batch_heads, stream);
    case 3: return launch_ws<T, D, 3>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 4: return launch_ws<T, D, 4>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 5: return launch_ws<T, D, 5>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 6: return launch_ws<T, D, 6>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 7: return launch_ws<T, D, 7>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 8: return launch_ws<T, D, 8>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 9: return launch_ws<T, D, 9>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 10: return launch_ws<T, D, 10>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 11: return launch_ws<T, D, 11>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 12: return launch_ws<T, D, 12>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 13: return launch_ws<T, D, 13>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 14: return launch_ws<T, D, 14>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    case 15: return launch_ws<T, D, 15>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
    default: return launch_ws<T, D, 16>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
  }
}

// Plain launcher (no torch types); the wrapper has checked the shapes and built the tensor maps. Steps 1-2: one
// warpgroup per block (loads and multiplies in turn, then overlapped); steps 3-16: a producer and two or three
// consumer warpgroups (Q's tensor map then reads 128 rows at a time, from step 11 64 per consumer). `o_map`
// (O in boxes of 64 rows) is step 15's way out; the other steps store through `o`.
cudaError_t hopper_attention_launch(int step, bool bf16, int head_dim, bool causal, const CUtensorMap& q,
                                    const CUtensorMap& k, const CUtensorMap& vt, const CUtensorMap& o_map, void* o,
                                    const AttentionParams& p, int batch_heads, cudaStream_t stream) {
  if (step < 1 || step > 16) return cudaErrorInvalidValue;
  if (bf16) {
    return head_dim == 64
               ? launch_step<__nv_bfloat16, 64>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream)
               : launch_step<__nv_bfloat16, 128>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream);
  }
  return head_dim == 64 ? launch_step<__half, 64>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream)
                        : launch_step<__half, 128>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream);
}

}  // namespace course_hopper

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <algorithm>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"
#include "hopper_host.h"

namespace course_hopper {
struct AttentionParams {
  int seqlen_q, seqlen_k, heads, kv_heads, batch_heads;
  float scale_log2;
  int* work_counter;
  int head_group;
  long long* timeline;
};
cudaError_t hopper_attention_launch(int step, bool bf16, int head_dim, bool causal, const CUtensorMap& q,
                                    const CUtensorMap& k, const CUtensorMap& vt, const CUtensorMap& o_map, void* o,
                                    const AttentionParams& p, int batch_heads, cudaStream_t stream);

// A contiguous (batch, heads, rows, cols) tensor seen as 3-d (cols, rows, batch x heads), read in boxes of
// 64 columns x `box_rows` rows.
inline CUtensorMap map_3d(const torch::Tensor& t, int box_rows) {
  const int64_t rows = t.size(2), cols = t.size(3);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(t.size(0) * t.size(1))};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * 2), static_cast<cuuint64_t>(rows * cols * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1};
  return tensor_map("hopper_attention", t, 3, dims, strides, box);
}
}  // namespace course_hopper

// q (B, H, Nq, D), k (B, Hkv, Nk, D) and vt (B, Hkv, D, Nk padded to a multiple of 8: V transposed; from step
// 10, V itself, (B, Hkv, Nk, D)), all
// contiguous fp16 or bf16 on an sm_90 GPU, D = 64 or 128 -> o (B, H, Nq, D). `timeline`: empty, or (steps 3-16)
// int64 room for kTimelineSlots per block of 64 query rows (more than any step launches), filled per block.
torch::Tensor hopper_attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor vt, int64_t seqlen_k,
                                       bool causal, double scale, int64_t step, torch::Tensor timeline) {
  TORCH_CHECK(step >= 1 && step <= 16, "hopper_attention: step must be 1 to 16 (utils.hopper.ATTENTION_STEPS), got ",
              course::num(step));
  const torch::Tensor* inputs[] = {&q, &k, &vt};
  const char* names[] = {"q", "k", "vt"};
  for (int i = 0; i < 3; ++i) {
    const torch::Tensor& t = *inputs[i];
    TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous(), "hopper_attention: ", names[i],
                " must be a contiguous 4-d CUDA tensor, got shape ", course::shape(t.sizes()));
    TORCH_CHECK(t.scalar_type() == q.scalar_type() && (q.scalar_type() == torch::kFloat16 ||
                q.scalar_type() == torch::kBFloat16), "hopper_attention: ", names[i], " must be float16 or ",
                "bfloat16 like q, got ", t.scalar_type());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "hopper_attention: ", names[i],
                " must start on 16 bytes");
  }
  const int64_t d = q.size(3);
  TORCH_CHECK(d == 64 || d == 128, "hopper_attention: head_dim must be 64 or 128, got ", course::num(d));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == d && q.size(1) % k.size(1) == 0 && k.size(2) == seqlen_k,
              "hopper_attention: k of shape ", course::shape(k.sizes()), " does not fit q of shape ",
              course::shape(q.sizes()));
  if (step >= 10) {
    TORCH_CHECK(vt.sizes() == k.sizes(), "hopper_attention: from step 10 vt is V, shaped like k ",
                course::shape(k.sizes()), ", got ", course::shape(vt.sizes()));
  } else {
    TORCH_CHECK(vt.size(0) == k.size(0) && vt.size(1) == k.size(1) && vt.size(2) == d && vt.size(3) >= seqlen_k &&
                vt.size(3) % 8 == 0, "hopper_attention: vt must be (B, Hkv, D, Nk rounded up to 8), got ",
                course::shape(vt.sizes()));
  }
  TORCH_CHECK(seqlen_k > 0 && q.size(2) > 0 && q.size(2) <= INT32_MAX && seqlen_k <= INT32_MAX,
              "hopper_attention: empty or too long, q ", course::shape(q.sizes()), ", Nk = ", course::num(seqlen_k));
  TORCH_CHECK(scale > 0 && std::isfinite(scale), "hopper_attention: scale must be finite and positive, got ",
              course::num(scale));
  // steps 12-14 lay their blocks out in one line; the others launch a row per (batch, head), at most 65,535
  TORCH_CHECK((step >= 12 && step <= 14) || q.size(0) * q.size(1) <= 65535, "hopper_attention: batch x heads = ",
              course::num(q.size(0)), " x ", course::num(q.size(1)), " is more than step ", course::num(step),
              "'s grid has rows (gridDim.y, at most 65535); split the batch");
  const int64_t most_blocks = (q.size(2) + 63) / 64 * q.size(0) * q.size(1);
  TORCH_CHECK(timeline.numel() == 0 || (step >= 3 && timeline.is_cuda() && timeline.scalar_type() == torch::kInt64 &&
              timeline.is_contiguous() && timeline.numel() >= most_blocks * 8), "hopper_attention: timeline must be "
              "empty, or for steps 3-16 a contiguous int64 CUDA tensor of at least ", course::num(most_blocks * 8),
              " elements, got ", course::shape(timeline.sizes()));
  course_hopper::check_sm90("hopper_attention", q);
  const c10::cuda::CUDAGuard guard(q.device());
  auto o = torch::empty_like(q);
  // step 12's blocks take query blocks from this counter; the other steps need none
  torch::Tensor counter;
  if (step == 12) counter = torch::zeros({1}, q.options().dtype(torch::kInt32));
  // step 13 starts the blocks of this many heads together under a causal mask: as many as half the L2 cache holds
  // the K and V of (heads sharing K and V count once), at least 1
  int l2_bytes = 0;
  cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, q.device().index());
  const int64_t kv_bytes = 2 * seqlen_k * d * 2, sharing = q.size(1) / k.size(1);
  const int head_group = causal ? static_cast<int>(std::clamp<int64_t>(
      l2_bytes / 2 / kv_bytes * sharing, 1, q.size(0) * q.size(1))) : 1;
  const course_hopper::AttentionParams p{static_cast<int>(q.size(2)), static_cast<int>(seqlen_k),
                                         static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                                         static_cast<int>(q.size(0) * q.size(1)),
                                         static_cast<float>(scale * 1.4426950408889634),
                                         counter.defined() ? counter.data_ptr<int>() : nullptr, head_group,
                                         timeline.numel() ? reinterpret_cast<long long*>(timeline.data_ptr<int64_t>())
                                                          : nullptr};
  // Q in boxes of the block's rows (128 from step 3; from step 11 one box of 64 per consumer), K of the tile's keys
  // (128 at steps 9 and 16), Vᵀ of D rows (from step 10: V, as K)
  const int keys = step == 9 || step == 16 ? 128 : 64;
  const CUtensorMap map_q = course_hopper::map_3d(q, step >= 3 && step < 11 ? 128 : 64),
                    map_k = course_hopper::map_3d(k, keys),
                    map_vt = course_hopper::map_3d(vt, step >= 10 ? keys : static_cast<int>(d)),
                    map_o = course_hopper::map_3d(o, 64);  // step 15 stores O in boxes of 64 rows
  const cudaError_t err = course_hopper::hopper_attention_launch(
      static_cast<int>(step), q.scalar_type() == torch::kBFloat16, static_cast<int>(d), causal, map_q, map_k, map_vt,
      map_o, o.data_ptr(), p, static_cast<int>(q.size(0) * q.size(1)), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "hopper_attention: launch failed: ", cudaGetErrorString(err));
  return o;
}
#endif
