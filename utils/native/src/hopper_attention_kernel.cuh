// Notebook 06c's attention kernel, every step of utils/native/src/hopper_attention_steps.cuh in one template:
// each step's change is a branch on a member of `Step`. hopper_attention.cu launches it; utils/native/src/steps/06c
// holds each step flat (python -m utils.course.flatten).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cuda.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include "hopper.cuh"
#include "hopper_attention_steps.cuh"

namespace course_hopper {

constexpr int kRows = 64;  // queries per block: 16 per warp
constexpr int kKeys = 64;  // keys per tile

struct AttentionParams {
  int seqlen_q, seqlen_k, heads, kv_heads, batch_heads;
  float scale_log2;  // softmax scale * log2(e): exp2 instead of exp
  int* work_counter;  // step 12: the next query block to hand out (zeroed by the caller), else unused
  int head_group;     // step 13: how many heads' blocks start together (at least 1)
  long long* timeline;  // step 3 on: kTimelineSlots milestones per block (utils.native.hopper.block_timeline), or null
  float* lse;           // the natural-log log-sum-exp of each row, fp32 (batch · heads, seqlen_q), or null
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

// Step 33: a descriptor's start address is its low 14 bits, in 16-byte units, and shared memory ends below 256 KB,
// so the descriptor of the operand `bytes` further on is this one plus bytes / 16, with no carry out of the low
// word. Only the low word changes, so ptxas keeps the high word and adds one number per wgmma operand, where
// smem_desc of each slice's address masks, shifts and merges again.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4), hi = static_cast<uint32_t>(desc >> 32);
  return static_cast<uint64_t>(hi) << 32 | lo;
}

// 2. S = Q Kᵀ for one tile of N keys (64, or 128 from step 9): D / 16 slices of 16 along the head dim, 4 per
// 64-column panel, both operands in shared memory (`sq` this warpgroup's Q tile, its panels `q_panel` bytes
// apart; `sk` the K tile, N rows per panel). Only the issue: the caller fences before and commits after.
// kDescAdd (step 33): each operand's descriptor built once, each slice's by desc_plus.
template <typename T, int D, int N = 64, bool kDescAdd = false>
__device__ __forceinline__ void issue_qk(float (&s)[N / 2], uint32_t sq, uint32_t q_panel, uint32_t sk) {
  constexpr int kPanel = N * 128;  // an N-row, 64-column panel of a K-major tile
  const uint64_t a0 = smem_desc(sq, 16, 1024, Swizzle::k128B), b0 = smem_desc(sk, 16, 1024, Swizzle::k128B);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // the first slice overwrites S (accumulate = 0)
    const uint64_t a = kDescAdd ? desc_plus(a0, (ks / 4) * q_panel + (ks % 4) * 32)
                                : smem_desc(sq + (ks / 4) * q_panel + (ks % 4) * 32, 16, 1024, Swizzle::k128B);
    const uint64_t b = kDescAdd ? desc_plus(b0, (ks / 4) * kPanel + (ks % 4) * 32)
                                : smem_desc(sk + (ks / 4) * kPanel + (ks % 4) * 32, 16, 1024, Swizzle::k128B);
    if constexpr (N == 64) wgmma_m64n64k16<T>(s, a, b, ks > 0);
    else wgmma_m64n128k16<T>(s, a, b, ks > 0);
  }
}

// The C fragments of key columns 16kk..16kk+15 are the A fragment of P for that K-slice of O += P V.
template <typename T, int N>
__device__ __forceinline__ void pack_p(const float (&s)[N / 2], uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
}

// 3. The online softmax of one tile of S, starting at key k0: updates the row maxima and sums, returns each row's
// rescale factor for O in `alpha` and P, rounded to 16 bits, in `a`. s[4j + r] is row row[r / 2], key
// k0 + 8j + 2t + r % 2 (`row`: the two rows this thread holds; `t`: its lane within the quad). kFast (step 4):
// keys are masked only in tiles that need it (kMask), and the scale joins the exponent in one FMA:
// exp2(s·c - m) with m kept in scaled units, instead of scaling every score first. kPack false (step 21): P is
// left in `s` as fp32, for pack_p once the registers of `a` are free. kLazy (step 29): a row's maximum moves only
// when the tile's passes it by more than kLazyLog2; until then alpha is exactly 1 and P stays below 2^kLazyLog2.
// kTree (step 31): a row's tile maximum and sum each kept in kChains partial values, combined at the end, so that
// each chain of dependent instructions is a quarter as long.
template <typename T, int D, bool kCausal, bool kFast, bool kMask, int N = 64, bool kPack = true, bool kLazy = false,
          bool kTree = false>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, float (&s)[N / 2], uint32_t (&a)[N / 16][4],
                                             float (&alpha)[2], int k0, const int (&row)[2], int t,
                                             const AttentionParams& p) {
  const int diagonal = p.seqlen_k - p.seqlen_q;
  constexpr float kLazyLog2 = 8.f;  // in exp2's units: P at most 256, far inside fp16, bf16 and fp32
  constexpr int kChains = kTree ? 4 : 1;  // partial maxima and sums a row
  float tile_max[2][kChains];
#pragma unroll
  for (int c = 0; c < 2 * kChains; ++c) tile_max[c / kChains][c % kChains] = -CUDART_INF_F;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int key = k0 + 8 * j + 2 * t + r % 2;
      if (kMask && (key >= p.seqlen_k || (kCausal && key > row[r / 2] + diagonal))) s[4 * j + r] = -CUDART_INF_F;
      if (!kFast) s[4 * j + r] *= p.scale_log2;
      float& m = tile_max[r / 2][(2 * j + r % 2) % kChains];
      m = kTree && 2 * j + r % 2 < kChains ? s[4 * j + r] : fmaxf(m, s[4 * j + r]);  // kTree: a chain's first
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int c = 1; c < kChains; c *= 2) {
#pragma unroll
      for (int e = 0; e + c < kChains; e += 2 * c) tile_max[i][e] = fmaxf(tile_max[i][e], tile_max[i][e + c]);
    }
  }
  float base[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_tile = quad_max(tile_max[i][0]) * (kFast ? p.scale_log2 : 1.f);
    const float m_new = kLazy && m_tile <= st.m[i] + kLazyLog2 ? st.m[i] : fmaxf(st.m[i], m_tile);
    base[i] = m_new == -CUDART_INF_F ? 0.f : m_new;  // a row with no key yet: keep exp2 away from inf - inf
    alpha[i] = exp2f(st.m[i] - base[i]);
    st.m[i] = m_new;
    st.l[i] *= alpha[i];
  }
  float sum[2][kChains];  // kTree: the tile's partial sums, added to l at the end (-0 + x is x); else l itself
#pragma unroll
  for (int c = 0; c < 2 * kChains; ++c) sum[c / kChains][c % kChains] = kTree ? -0.f : st.l[c / kChains];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    s[i] = kFast ? fast_exp2(fmaf(s[i], p.scale_log2, -base[i % 4 / 2])) : exp2f(s[i] - base[i % 4 / 2]);
    sum[i % 4 / 2][(i / 4 * 2 + i % 2) % kChains] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (kTree) {
      st.l[r] += (sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]);
    } else {
      st.l[r] = sum[r][0];
    }
  }
  if constexpr (kPack) pack_p<T, N>(s, a);
}

template <int D>
__device__ __forceinline__ void rescale(RowState<D>& st, const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) st.acc[i] *= alpha[i % 4 / 2];
}

// 4. O += P V: A = P from registers (`a`, one K-slice of 16 keys each), B = the Vᵀ tile `sv` (D rows of N keys,
// in panels of 64 keys). Only the issue, as for issue_qk. kVDirect (step 10): `sv` is V as stored, N rows of
// keys in panels of 64 head-dim columns: a K-slice is 16 rows (two 1 KB swizzle atoms, 1024 bytes apart), the
// next 64 columns of D one panel (N * 128 bytes) on, read N-major. kDescAdd (step 33): as issue_qk's.
template <typename T, int D, int N = 64, bool kVDirect = false, bool kDescAdd = false>
__device__ __forceinline__ void issue_pv(RowState<D>& st, const uint32_t (&a)[N / 16][4], uint32_t sv) {
  constexpr uint32_t kLeading = kVDirect ? N * 128 : 16;
  const uint64_t v0 = smem_desc(sv, kLeading, 1024, Swizzle::k128B);
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    const uint32_t at = kVDirect ? kk * 16 * 128 : (kk / 4) * D * 128 + (kk % 4) * 32;
    const uint64_t b = kDescAdd ? desc_plus(v0, at) : smem_desc(sv + at, kLeading, 1024, Swizzle::k128B);
    if constexpr (kVDirect) {
      wgmma_m64k16_rs<T, D, true>(st.acc, a[kk], b);
    } else {
      wgmma_m64k16_rs<T, D>(st.acc, a[kk], b);
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

// Each row's natural-log log-sum-exp, (m + log2 l) · ln 2 with m and l in the log2 domain (l already summed over
// the quad by the store of O), -inf for a row that saw no key: the backward's input, when p.lse asks for it.
template <int D>
__device__ __forceinline__ void store_lse(const RowState<D>& st, const AttentionParams& p, int bh,
                                          const int (&row)[2], int t) {
  if (p.lse == nullptr || t != 0) return;  // one lane of each quad
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row[i] < p.seqlen_q)
      p.lse[static_cast<long long>(bh) * p.seqlen_q + row[i]] =
          st.l[i] > 0.f ? (st.m[i] + log2f(st.l[i])) * 0.6931471805599453f : -CUDART_INF_F;
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
  named_barrier_sync(4 + wg, 128);   // the whole warpgroup's part of O is in (barriers 1-3 are the turns)
  if (wtid == 0) {
    for (int panel = 0; panel < D / 64; ++panel) tma_store_3d(map_o, 64 * panel, q_lo, bh, tile + panel * panel_bytes);
    tma_store_commit();
    tma_store_wait_read();  // shared memory must outlive TMA's reads of it: the block ends after this
  }
}

template <typename T, int D, bool kCausal, typename Step>
__global__ void __launch_bounds__(128) hopper_attention_kernel(const __grid_constant__ CUtensorMap map_q,
                                                               const __grid_constant__ CUtensorMap map_k,
                                                               const __grid_constant__ CUtensorMap map_vt,
                                                               T* __restrict__ o, const AttentionParams p) {
  constexpr int kStages = Step::kStages;  // K/Vᵀ buffers
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
  store_lse<D>(st, p, bh, row, t);
}

// Steps 3 on: warp specialisation. Three warpgroups per block (four at D = 64 from step 11, but for step 16):
// warpgroup 0 is the producer (one thread issues every TMA copy, the others leave at once), the others the
// consumers, 64 query rows each. The producer gives its registers away (setmaxnreg), so each of two consumers may
// use up to 240 (three: 160). Each K/Vᵀ stage passes back and forth on two barriers: `full` (its bytes arrived) and
// `empty` (every consumer thread is done with it).
template <typename T, int D, bool kCausal, typename Step>
__global__ void __launch_bounds__(128 * (1 + Step::template consumers<D>()), 1)
    hopper_attention_ws_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                               const __grid_constant__ CUtensorMap map_vt, const __grid_constant__ CUtensorMap map_o,
                               T* __restrict__ o, const AttentionParams p) {
  constexpr int kN = Step::kKeys, kStages = Step::kStages;  // keys per tile, K/V stages
  constexpr int kConsumers = Step::template consumers<D>(), kBlockRows = kConsumers * kRows;  // query rows per block
  constexpr int kQPanel = kBlockRows * 128, kKPanel = kN * 128;     // 64-column panels of Q (all rows) and K
  constexpr int kTile = kN * D * 2;                                 // bytes of a K tile, and of a Vᵀ tile
  constexpr bool kPersistent = Step::template persistent<D>();       // steps 12, and 25-26 at D = 64
  constexpr int kQBufs = kPersistent ? 2 : 1;                       // Q's ring: two deep when persistent
  // a consumer that skips tiles (step 14) would leave the turns' named barriers (step 7) short of arrivals
  static_assert(!(Step::kOwnDiagonal && Step::kTurns), "own_diagonal builds on a step without turns");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sq = smem_u32(smem), stages = sq + kQBufs * D / 64 * kQPanel;  // Q buffers; kStages x (K, Vᵀ)
  // q_full[b]; q_empty[b]; full[s]: K and V arrived (step 17: K); empty[s]; step 17: v_full[s], V arrived
  __shared__ __align__(8) uint64_t bars[2 * kQBufs + (Step::kSplitFull ? 3 : 2) * kStages];
  __shared__ int work_slot[kQBufs];  // step 12: the work item whose Q is in buffer b (-1: none left)
  auto q_full = [&](int b) { return smem_u32(&bars[b]); };
  auto q_empty = [&](int b) { return smem_u32(&bars[kQBufs + b]); };
  auto full = [&](int s) { return smem_u32(&bars[2 * kQBufs + s]); };
  auto empty = [&](int s) { return smem_u32(&bars[2 * kQBufs + kStages + s]); };
  auto v_full = [&](int s) { return smem_u32(&bars[2 * kQBufs + 2 * kStages + s]); };

  // step 27: lane 0's index, so that ptxas knows it is the same in the whole warp (uniform branches, uniform loop)
  const int tid = threadIdx.x, warpgroup = Step::kUniformWarpgroup ? __shfl_sync(0xffffffffu, tid / 128, 0) : tid / 128;
  if (tid == 0) note(p, 0, global_timer_ns());
  const int q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows, diagonal = p.seqlen_k - p.seqlen_q;
  // A work item: one block of query rows of one (batch, head), and how many K/V tiles it reads. Step 8: with a
  // causal mask the last query blocks have the most keys; launching them first (blocks start in order of
  // blockIdx.x) leaves the short ones to fill the GPU at the end instead of a long one running alone.
  struct Work { int q0, bh, bh_kv, tiles; };
  auto work = [&](int w) {
    int bh = kPersistent ? w / q_blocks : blockIdx.y, x = kPersistent ? w % q_blocks : blockIdx.x;
    if constexpr (Step::kHeadGroups) {  // step 13: w = blockIdx.x: its head group, then the query block, then the head
      const int g = w / (p.head_group * q_blocks), r = w % (p.head_group * q_blocks);
      const int heads_in_group = min(p.head_group, p.batch_heads - g * p.head_group);
      bh = g * p.head_group + r % heads_in_group, x = r / heads_in_group;
    }
    const int q_block = (Step::kHeadGroups || Step::kHeavyFirst || kPersistent) && kCausal ? q_blocks - 1 - x : x;
    const int q0 = q_block * kBlockRows, b = bh / p.heads, h = bh % p.heads;
    const int k_end = kCausal ? min(p.seqlen_k, max(0, q0 + kBlockRows + diagonal)) : p.seqlen_k;
    return Work{q0, bh, b * p.kv_heads + h / (p.heads / p.kv_heads), (k_end + kN - 1) / kN};
  };
  if (tid == 0) {
    for (int b = 0; b < kQBufs; ++b) mbarrier_init(q_full(b), 1), mbarrier_init(q_empty(b), 128 * kConsumers);
    for (int s = 0; s < kStages; ++s) mbarrier_init(full(s), 1), mbarrier_init(empty(s), 128 * kConsumers);
    if constexpr (Step::kSplitFull)
      for (int s = 0; s < kStages; ++s) mbarrier_init(v_full(s), 1);
  }
  __syncthreads();

  if (warpgroup == 0) {  // the producer
    setmaxnreg_dec<24>();
    if (tid == 0) {
      const int total = q_blocks * p.batch_heads;
      int w = blockIdx.x, it = 0;  // the work item (step 12: the first is the block's own); K/V tiles issued
      for (int n = 0;; ++n) {
        const int qb = n % kQBufs;
        // item n - 2 is done with buffer qb
        if (n >= kQBufs) mbarrier_wait<Step::kWaitSuspend>(q_empty(qb), (n / kQBufs - 1) & 1);
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
          if constexpr (Step::kQPerConsumer) {
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
          // tile it - kStages released it
          if (it >= kStages) mbarrier_wait<Step::kWaitSuspend>(empty(s), (it / kStages - 1) & 1);
          const uint32_t sk = stages + s * 2 * kTile, sv = sk + kTile;
          const uint32_t v_bar = Step::kSplitFull ? v_full(s) : full(s);  // step 17: V on a barrier of its own
          mbarrier_arrive_expect(full(s), Step::kSplitFull ? kTile : 2 * kTile);
          for (int panel = 0; panel < D / 64; ++panel) {  // K: N rows of 64 columns per copy
            tma_load_3d(sk + panel * kKPanel, &map_k, 64 * panel, kN * i, wk.bh_kv, full(s));
          }
          if constexpr (Step::kSplitFull) mbarrier_arrive_expect(v_bar, kTile);
          for (int panel = 0; panel < (Step::kVDirect ? D : kN) / 64; ++panel) {
            if (Step::kVDirect) tma_load_3d(sv + panel * kKPanel, &map_vt, 64 * panel, kN * i, wk.bh_kv, v_bar);  // V
            else tma_load_3d(sv + panel * D * 128, &map_vt, kN * i + 64 * panel, 0, wk.bh_kv, v_bar);  // Vᵀ
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
    mbarrier_wait<Step::kWaitSuspend>(q_full(qb), (n / kQBufs) & 1);
    const int w = kPersistent ? work_slot[qb] : blockIdx.x;
    if (w < 0) break;
    const Work wk = work(w);
    auto mark = [&](int slot) { if (tid == 128 && n == 0) note(p, slot, global_timer_ns()); };  // first consumer
    mark(1);
    const int q_lo = wk.q0 + kRows * wg;  // this warpgroup's first row
    // the tiles this consumer multiplies: the block's, or from step 14 (causal) those up to its own diagonal
    const int own_end = min(p.seqlen_k, max(0, q_lo + kRows + diagonal));
    const int tiles = Step::kOwnDiagonal && kCausal ? min(wk.tiles, (own_end + kN - 1) / kN) : wk.tiles;
    const int row[2] = {q_lo + 16 * (wtid / 32) + lane / 4, q_lo + 16 * (wtid / 32) + lane / 4 + 8};
    const uint32_t sq_wg = sq + qb * D / 64 * kQPanel + wg * kRows * 128;
    auto ring = [&](int i) { return (it + i) % kStages; };  // the stage holding this item's K/V tile i
    // step 17: K only on `full`, V on `v_full`
    auto wait_full = [&](int i) { mbarrier_wait<Step::kWaitSuspend>(full(ring(i)), ((it + i) / kStages) & 1); };
    auto wait_v = [&](int i) { mbarrier_wait<Step::kWaitSuspend>(v_full(ring(i)), ((it + i) / kStages) & 1); };
    auto key_tile = [&](int i) { return stages + ring(i) * 2 * kTile; };
    // Only a tile that reaches past Nk, or crosses this warpgroup's diagonal, has keys to mask (steps 1-3 mask all).
    auto needs_mask = [&](int i) {
      if constexpr (Step::kFast) return tile_needs_mask(i, kN, q_lo, p.seqlen_q, p.seqlen_k, kCausal);
      else return true;
    };
    RowState<D> st;
    st.init();
    if constexpr (!Step::kOverlap) {
      for (int i = 0; i < tiles; ++i) {
        wait_full(i);
        if constexpr (Step::kSplitFull) wait_v(i);
        if (i == 0) mark(2);
        const uint32_t sk = key_tile(i);
        if (needs_mask(i)) {
          attend_tile<T, D, kCausal, Step::kFast, true>(st, sq_wg, kQPanel, sk, sk + kTile, kN * i, row, t, p);
        } else {
          attend_tile<T, D, kCausal, Step::kFast, false>(st, sq_wg, kQPanel, sk, sk + kTile, kN * i, row, t, p);
        }
        mbarrier_arrive(empty(ring(i)));
        if (i == 0) mark(3);
      }
      mark(4);
    } else if (tiles > 0) {
      // Step 6: S for tile i is issued together with P V for tile i-1, and the softmax of tile i runs while P V
      // does; O is rescaled only after that wgmma is done. Step 7 adds turns: a consumer issues its wgmma only
      // when the one before it (in a ring) has issued its own, so one's softmax lines up under the others'
      // multiplies. Each consumer issues tiles + 1 times; the last consumer opens consumer 0's first turn and skips
      // giving back its own last one, so every named barrier completes as often as it is waited on.
      auto turn = [&] {
        if (Step::kTurns) named_barrier_sync(1 + wg, 256);
      };
      auto done = [&](bool last) {
        if (Step::kTurns && !(last && wg == kConsumers - 1)) named_barrier_arrive(1 + (wg + 1) % kConsumers, 256);
      };
      if (Step::kTurns && wg == kConsumers - 1) named_barrier_arrive(1, 256);
      float s[kN / 2], alpha[2];
      // P of two consecutive tiles: P V reads one, the softmax writes the other
      uint32_t pa[kN / 16][4], pb[kN / 16][4];
      // step 21 (kOneP): P stays in s, packed into `out` only once P V is done with it
      constexpr bool kPack = !Step::kOneP;
      auto softmax = [&](int i, uint32_t (&out)[kN / 16][4]) {
        const int k0 = kN * i;
        constexpr bool kLazy = Step::kLazyRescale, kTree = Step::kTreeReduce;
        if (needs_mask(i)) {
          softmax_tile<T, D, kCausal, true, true, kN, kPack, kLazy, kTree>(st, s, out, alpha, k0, row, t, p);
        } else {
          softmax_tile<T, D, kCausal, true, false, kN, kPack, kLazy, kTree>(st, s, out, alpha, k0, row, t, p);
        }
      };
      // Tile i: S = Q K_iᵀ and O += P_(i-1) V_(i-1) in flight together, tile i's softmax under the second.
      auto tile = [&](int i, uint32_t (&prev)[kN / 16][4], uint32_t (&next)[kN / 16][4]) {
        wait_full(i);
        turn();
        fence_registers(s);  // every input of both products settled before the first is issued
        fence_registers(st.acc);
        fence_fragments(prev);
        wgmma_fence();
        issue_qk<T, D, kN, Step::kDescAdd>(s, sq_wg, kQPanel, key_tile(i));
        wgmma_commit();
        if constexpr (Step::kSplitFull) wait_v(i - 1);  // step 17: V only now, where P V reads it
        issue_pv<T, D, kN, Step::kVDirect, Step::kDescAdd>(st, prev, key_tile(i - 1) + kTile);
        wgmma_commit();
        done(false);
        wgmma_wait<1>();  // S is in; P V may still run
        fence_registers(s);
        softmax(i, next);
        // step 29: no row of the warp moved its maximum, so O keeps its scale (a vote: one branch for the warp)
        const bool kept = Step::kLazyRescale && __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f);
        wgmma_wait<0>();
        fence_registers(st.acc);
        mbarrier_arrive(empty(ring(i - 1)));
        if (!kept) rescale<D>(st, alpha);
        if constexpr (Step::kOneP) pack_p<T, kN>(s, next);  // step 21: P V is done with `next`
      };
      auto last = [&](uint32_t (&prev)[kN / 16][4]) {  // O += P V for the last tile
        if constexpr (Step::kSplitFull) wait_v(tiles - 1);
        turn();
        fence_registers(st.acc);
        fence_fragments(prev);
        wgmma_fence();
        issue_pv<T, D, kN, Step::kVDirect, Step::kDescAdd>(st, prev, key_tile(tiles - 1) + kTile);
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
      issue_qk<T, D, kN, Step::kDescAdd>(s, sq_wg, kQPanel, key_tile(0));
      wgmma_commit();
      done(false);
      wgmma_wait<0>();
      fence_registers(s);
      softmax(0, pa);  // O is still 0: nothing to rescale
      if constexpr (Step::kOneP) pack_p<T, kN>(s, pa);
      mark(3);
      // Two tiles per trip, so that pa and pb swap roles without a copy (register moves into a wgmma's inputs
      // between its issue and its wait make ptxas serialize every wgmma of the kernel).
      int i = 1;
      if constexpr (Step::kOneP) {  // step 21: one set of P registers, written only once P V has read it
        for (; i < tiles; ++i) tile(i, pa, pa);
        mark(4);
        last(pa);
      } else {
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
    }
    mark(5);
    for (int i = tiles; i < wk.tiles; ++i) {  // step 14: tiles only the other consumers need, handed straight back
      wait_full(i);  // (arriving before the tile is in would count towards the stage's previous tile)
      if constexpr (Step::kSplitFull) wait_v(i);
      mbarrier_arrive(empty(ring(i)));
    }
    it += wk.tiles;
    // Q's buffer may take item n + 2: at once, or after a TMA store once TMA has read O out of it
    if (!Step::kTmaStore && kPersistent) mbarrier_arrive(q_empty(qb));
    if constexpr (Step::kTmaStore) store_tile<T, D>(st, sq_wg, kQPanel, &map_o, q_lo, wk.bh, wg);
    else store_rows<T, D>(st, o, wk.bh, row, t, p.seqlen_q);
    if (Step::kTmaStore && kPersistent) mbarrier_arrive(q_empty(qb));
    store_lse<D>(st, p, wk.bh, row, t);
    mark(6);
    if (tid == 128 && n == 0) note(p, 7, static_cast<long long>(sm_id()) << 32 | wk.tiles);
    if (!kPersistent) break;
  }
}

template <typename Step, typename T, int D>
cudaError_t launch_ws(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                      const CUtensorMap& o_map, void* o, const AttentionParams& p, int batch_heads,
                      cudaStream_t stream) {
  // the block's rows of Q, the K/Vᵀ stages, alignment room
  constexpr bool kPersistent = Step::template persistent<D>();
  constexpr int kBlockRows = Step::template consumers<D>() * kRows, kQBufs = kPersistent ? 2 : 1;
  const int smem = kQBufs * kBlockRows * D * 2 + Step::kStages * 2 * Step::kKeys * D * 2 + 1024;
  const int q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
  dim3 grid(q_blocks, batch_heads);
  if (Step::kHeadGroups) grid = dim3(q_blocks * batch_heads, 1);  // one line of blocks, in work-item order
  if (kPersistent) {  // one block per SM (their registers fill it), none idle
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    grid = dim3(std::min(q_blocks * batch_heads, sms), 1);
  }
  auto kernel = causal ? hopper_attention_ws_kernel<T, D, true, Step> : hopper_attention_ws_kernel<T, D, false, Step>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, 128 * (1 + Step::template consumers<D>()), smem, stream>>>(q, k, vt, o_map, static_cast<T*>(o), p);
  return cudaGetLastError();
}

template <typename Step, typename T, int D>
cudaError_t launch_typed(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt, void* o,
                         const AttentionParams& p, int batch_heads, cudaStream_t stream) {
  const int smem = (1 + 2 * Step::kStages) * D * 128 + 1024;  // Q, kStages x (K, Vᵀ) tiles + alignment room
  const dim3 grid((p.seqlen_q + kRows - 1) / kRows, batch_heads);
  auto kernel = causal ? hopper_attention_kernel<T, D, true, Step> : hopper_attention_kernel<T, D, false, Step>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, 128, smem, stream>>>(q, k, vt, static_cast<T*>(o), p);
  return cudaGetLastError();
}

// Step N of the steps table, at one dtype and head dim: hopper_attention.cu's launcher picks it at run time.
template <typename Step, typename T, int D>
cudaError_t launch_attention(bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                             const CUtensorMap& o_map, void* o, const AttentionParams& p, int batch_heads,
                             cudaStream_t stream) {
  if constexpr (Step::kSpecialised) return launch_ws<Step, T, D>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
  else return launch_typed<Step, T, D>(causal, q, k, vt, o, p, batch_heads, stream);
}

}  // namespace course_hopper
