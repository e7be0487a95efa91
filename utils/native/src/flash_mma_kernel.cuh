// FlashAttention-2 forward on tensor cores (notebook 06b): one kernel template, `Step` (flash_mma_steps.cuh)
// switches each optimisation on, and every switch is an `if constexpr` branch marked "Step N" below. Each step
// read alone, with its switches evaluated away: utils/native/src/steps/06b/ (python -m utils.course.flatten writes it from here).
//
//   grid:     one block per (BR query rows, batch * head); a block has kWarps warps, each owning 16 rows
//             (from step 11, 16 kRowTiles rows: each K and V fragment read from shared memory serves kRowTiles mma)
//   shared:   Qs [BR][D]                        the query tile, read once into registers (A fragments; step 11
//                                               at D = 128 reads it at every k-step: registers go to more rows)
//             Ks [stages][BC][D], Vs [stages][BC][D]   the current K and V tiles (2 stages from step 4)
//   registers (per thread, D = 128, BC = 128 from step 5): Q fragments 32 words, S 64 floats, O 64 floats,
//             m and l for its two rows g and g + 8 (step 11: twice S and O, half the keys per tile)
//   addresses (step 12): worked out once per thread before the loop (copy_rows, LaneOffsets), moved on per tile
//
// Per K/V tile: S = Q K^T (D/16 x BC/8 mma), mask, online softmax on the S fragments (row max over the 4
// threads of a group by two shuffles), P packed to 16 bits in place as the A operand of O += P V
// (BC/16 x D/8 mma). Bottom-right causal alignment; rows that see no key output 0.
#pragma once
#include "flash_mma.cuh"
#include "flash_mma_steps.cuh"
#include <type_traits>

namespace course_flash {

// Step 14: a warp rescales O only when one of its rows' maximum grew by more than this, in log2 units (P <= 2^8).
constexpr float kRescaleLog2 = 8.f;

template <typename Step, int D> struct MmaTile {
  static constexpr int kThreads = 32 * Step::kWarps;
  static constexpr int kRows = 16 * Step::kWarps * Step::kRowTiles;  // BR: each warp owns kRowTiles m16 tiles
  static constexpr int kCols = Step::template block_cols<D>();  // BC
  static constexpr bool kQInRegs = Step::template q_in_regs<D>();
  static constexpr bool kRareRescale = Step::template rare_rescale<D>();  // step 14
  static constexpr int kStages = Step::kCpAsync ? 2 : 1;
  static constexpr int kSmemBytes = (kRows + 2 * kStages * kCols) * D * 2;  // 16-bit elements
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static_assert(kCols % 16 == 0, "keys per tile: a multiple of the k of mma");
};

// Step 12: this thread's 16-byte chunks of a [kRows][D] tile, rows r, r + kPass, r + 2 kPass... with
// r = threadIdx.x / (D / 8). kPass is a multiple of 8, so all of them share row r's swizzle, and each copy is the one
// before moved by kPass rows, in shared and in global memory. `from` is the thread's first chunk in global memory
// (first_chunk); rows at or past `rows_left` become zeros (with `src`, any valid address, as their source: nothing
// is read). load_tile's general loop works out the row, the column and the swizzle of every chunk, in a loop whose
// trip count it cannot know: about 400 instructions for a tile's K and V at D = 128 (static SASS), against 16 copies.
// Step 15: kChecked = false when every row lies inside the sequence (no test, no dummy source).
template <typename T, int D, int kRows, int kThreads, bool kChecked = true>
__device__ __forceinline__ void copy_rows(T* tile, const T* from, const T* src, long long stride, int rows_left) {
  constexpr int kChunks = D / 8, kPass = kThreads / kChunks;
  static_assert(kRows % kPass == 0 && kPass % 8 == 0, "whole passes, whole swizzle periods");
  const int r = threadIdx.x / kChunks;
  T* to = tile + smem_offset<D, true>(r, threadIdx.x % kChunks * 8);
#pragma unroll
  for (int i = 0; i < kRows / kPass; ++i) {
    const bool valid = !kChecked || r + i * kPass < rows_left;
    cp_async_16(to + i * kPass * D, valid ? from : src, valid);
    from += kPass * stride;
  }
}

// Where this thread's first chunk of rows row0.. of a (seq, D) matrix lies, for copy_rows.
template <typename T, int D>
__device__ __forceinline__ const T* first_chunk(const T* src, long long stride, int row0) {
  return src + (row0 + threadIdx.x / (D / 8)) * stride + threadIdx.x % (D / 8) * 8;
}

// copy_rows of rows row0.. of a (seq, D) matrix (the backward's step 9; the forward's step 12 outside its loop).
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_rows(T* tile, const T* src, long long stride, int row0, int seqlen) {
  copy_rows<T, D, kRows, kThreads>(tile, first_chunk<T, D>(src, stride, row0), src, stride, seqlen - row0);
}

// Copy `rows` rows of a (seq, D) matrix, from row0, into a tile, 16 bytes (8 elements) per thread and step;
// rows past `seqlen` become zeros (so partial tiles need no care until the mask).
template <typename Step, typename T, int D, int kRowsInTile, int kThreads>
__device__ __forceinline__ void load_tile(T* tile, const T* src, long long row_stride, int row0, int seqlen) {
  if constexpr (Step::kHoisted) {  // Step 12
    static_assert(Step::kCpAsync && Step::kSwizzle && !Step::kSplitKV, "cp.async into a swizzled tile, one group");
    load_rows<T, D, kRowsInTile, kThreads>(tile, src, row_stride, row0, seqlen);
  } else {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int idx = threadIdx.x; idx < kRowsInTile * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8, row = row0 + r;
      const bool valid = row < seqlen;
      const T* from = src + (valid ? row : 0) * row_stride + c;
      T* to = tile + smem_offset<D, Step::kSwizzle>(r, c);
      if constexpr (Step::kCpAsync) {  // Step 4: asynchronous copy, completion awaited later
        cp_async_16(to, from, valid);
      } else {
        *reinterpret_cast<uint4*>(to) = valid ? *reinterpret_cast<const uint4*>(from) : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// A fragment of the 16x16 block (rows r0.., cols k0..) of a [rows][D] tile (Q in S = Q K^T).
template <typename Step, int D, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
  if constexpr (Step::kLdmatrix) {  // Step 2: lanes 0-7, 8-15, 16-23, 24-31 address matrices a[0..3]
    const int row = r0 + lane % 8 + (lane / 8 % 2) * 8, col = k0 + lane / 16 * 8;
    ldmatrix_x4(a, tile + smem_offset<D, Step::kSwizzle>(row, col));
  } else {
    const int g = lane / 4, t = lane % 4;
    const auto word = [&](int row, int col) {
      return *reinterpret_cast<const uint32_t*>(tile + smem_offset<D, Step::kSwizzle>(row, col));
    };
    a[0] = word(r0 + g, k0 + 2 * t);
    a[1] = word(r0 + g + 8, k0 + 2 * t);
    a[2] = word(r0 + g, k0 + 2 * t + 8);
    a[3] = word(r0 + g + 8, k0 + 2 * t + 8);
  }
}

// B fragments of two n8 tiles (K rows n0..n0+15) for the k-step k0 of S = Q K^T: B[k][n] = K[n][k], so the
// two elements of a register are consecutive in a row of K.
template <typename Step, int D, typename T>
__device__ __forceinline__ void load_b_k(uint32_t (&b)[2][2], const T* tile, int n0, int k0, int lane) {
  if constexpr (Step::kLdmatrix) {  // Step 2: matrices (keys n0.., cols k0), (n0.., k0+8), (n0+8.., k0), ...
    uint32_t r[4];
    ldmatrix_x4(r, tile + smem_offset<D, Step::kSwizzle>(n0 + lane % 8 + lane / 16 * 8, k0 + lane / 8 % 2 * 8));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  } else {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        b[i][half] = *reinterpret_cast<const uint32_t*>(
            tile + smem_offset<D, Step::kSwizzle>(n0 + 8 * i + g, k0 + 8 * half + 2 * t));
  }
}

// B fragments of two n8 tiles (V columns n0..n0+15) for the k-step k0 (keys k0..k0+15) of O += P V:
// B[k][n] = V[k][n], so the two elements of a register sit in two different rows of V.
template <typename Step, int D, typename T>
__device__ __forceinline__ void load_b_v(uint32_t (&b)[2][2], const T* tile, int n0, int k0, int lane) {
  if constexpr (Step::kLdmatrix) {  // Step 2: .trans reads rows of V and hands out columns
    uint32_t r[4];
    ldmatrix_x4_trans(r, tile + smem_offset<D, Step::kSwizzle>(k0 + lane % 8 + lane / 8 % 2 * 8,
                                                                n0 + lane / 16 * 8));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  } else {
    const int g = lane / 4, t = lane % 4;
    const auto* bits = reinterpret_cast<const uint16_t*>(tile);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = k0 + 8 * half + 2 * t, col = n0 + 8 * i + g;
        b[i][half] = bits[smem_offset<D, Step::kSwizzle>(key, col)] |
                     (static_cast<uint32_t>(bits[smem_offset<D, Step::kSwizzle>(key + 1, col)]) << 16);
      }
  }
}

// acc[i] (16 x 8 kTilesOut) += C[i] (16 x 16 kSteps) times rows 0 .. 16 kSteps - 1 of a [rows][D] tile, read as
// the B operand like V, for each of R m16 row tiles i: every B fragment read serves R mma. C is the accumulators
// of an earlier mma: n8 tiles 2kk and 2kk + 1, packed to 16 bits, are the A fragment of k-step kk, so C never
// leaves the registers. O += P V here; dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K in the backward
// (flash_mma_bwd_kernel.cuh, one row tile: the overload below). `read_b(b, n0, k0)` reads the B fragments of
// columns n0.. of k-step k0: load_b_v, or (step 12) an ldmatrix at an offset worked out once.
template <typename T, int kSteps, int kTilesOut, int R, typename ReadB>
__device__ __forceinline__ void mma_c_read(float (&acc)[R][kTilesOut][4], const float (&c)[R][2 * kSteps][4],
                                           ReadB read_b) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[R][4];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      a[i][0] = pack2<T>(c[i][2 * kk][0], c[i][2 * kk][1]), a[i][1] = pack2<T>(c[i][2 * kk][2], c[i][2 * kk][3]);
      a[i][2] = pack2<T>(c[i][2 * kk + 1][0], c[i][2 * kk + 1][1]);
      a[i][3] = pack2<T>(c[i][2 * kk + 1][2], c[i][2 * kk + 1][3]);
    }
#pragma unroll
    for (int n = 0; n < kTilesOut; n += 2) {
      uint32_t b[2][2];
      read_b(b, n * 8, kk * 16);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        mma_16816<T>(acc[i][n], a[i], b[0]);
        mma_16816<T>(acc[i][n + 1], a[i], b[1]);
      }
    }
  }
}

template <typename Step, int D, int kSteps, int kTilesOut, int R, typename T>
__device__ __forceinline__ void mma_c_b(float (&acc)[R][kTilesOut][4], const float (&c)[R][2 * kSteps][4],
                                        const T* tile, int lane) {
  mma_c_read<T, kSteps>(acc, c, [&](uint32_t (&b)[2][2], int n0, int k0) { load_b_v<Step, D>(b, tile, n0, k0, lane); });
}

template <typename Step, int D, int kSteps, int kTilesOut, typename T>
__device__ __forceinline__ void mma_c_b(float (&acc)[kTilesOut][4], const float (&c)[2 * kSteps][4], const T* tile,
                                        int lane) {
  using Acc = float[1][kTilesOut][4];
  using C = const float[1][2 * kSteps][4];
  mma_c_b<Step, D, kSteps, kTilesOut, 1>(reinterpret_cast<Acc&>(acc), reinterpret_cast<C&>(c), tile, lane);
}

template <typename Step, typename T, int D>
__global__ void __launch_bounds__(MmaTile<Step, D>::kThreads, Step::template min_blocks<D>())
flash_mma_kernel(Params p) {
  using Tile = MmaTile<Step, D>;
  constexpr int BR = Tile::kRows, BC = Tile::kCols, kThreads = Tile::kThreads;
  constexpr int kTilesS = BC / 8, kTilesO = D / 8;  // n8 accumulator tiles of S and of O
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + BR * D;
  T* Vs = Ks + Tile::kStages * BC * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int hk = h / (p.heads / p.kv_heads);  // GQA
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  T* out = static_cast<T*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1];

  // Step 7: causal blocks near the bottom see the most keys; launched first, they do not trail the grid.
  const int q_block = Step::kCausalSkip && p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int q0 = q_block * BR;
  const int offset = p.seqlen_k - p.seqlen_q;  // bottom-right alignment: row r sees keys <= r + offset
  // Step 7: keys past the last one this block's last row can see are never loaded (block skipping).
  const int kv_end = Step::kCausalSkip ? kv_end_for_block(p, q0, BR) : p.seqlen_k;
  const int n_tiles = (kv_end + BC - 1) / BC;

  load_tile<Step, T, D, BR, kThreads>(Qs, q, p.q_stride[2], q0, p.seqlen_q);
  if constexpr (Step::kCpAsync) {  // Step 4: tile 0 of K and V travels with Q
    if (n_tiles > 0) load_tile<Step, T, D, BC, kThreads>(Ks, k, p.k_stride[2], 0, p.seqlen_k);
    if constexpr (Step::kSplitKV) cp_async_commit();  // Step 8: Q and K first, V in a group of its own
    if (n_tiles > 0) load_tile<Step, T, D, BC, kThreads>(Vs, v, p.v_stride[2], 0, p.seqlen_k);
    cp_async_commit();
    cp_async_wait<Step::kSplitKV ? 1 : 0>();
  }
  __syncthreads();

  // This warp's R m16 tiles of query rows (rows warp * 16R + 16i .. + 15 for tile i) stay in registers as
  // D / 16 A fragments each for the whole kernel, or (step 11 at D = 128) are read from Qs at every k-step.
  constexpr int R = Step::kRowTiles;
  constexpr bool kQInRegs = Tile::kQInRegs;
  constexpr bool kRareRescale = Tile::kRareRescale;
  // Step 12: where each lane's ldmatrix reads, worked out once (LaneOffsets, as in the backward's step 9) instead
  // of at every call of load_a, load_b_k and load_b_v: rows lane % 16 for Q's A fragments and V's B fragments (V
  // read transposed), rows lane % 8 + 8 (lane / 16) for K's.
  const LaneOffsets<D> at_rows(lane % 16, lane / 16 * 8), at_keys(lane % 8 + lane / 16 * 8, lane / 8 % 2 * 8);
  const auto read_q = [&](uint32_t (&a)[4], int r0, int k0) {
    if constexpr (Step::kHoisted) ldmatrix_x4_at(a, smem_address(Qs) + at_rows(r0, k0), false);
    else load_a<Step, D>(a, Qs, r0, k0, lane);
  };
  uint32_t qa[kQInRegs ? R : 1][kQInRegs ? D / 16 : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) read_q(qa[i][kk], (warp * R + i) * 16, kk * 16);
  }

  float o[R][kTilesO][4] = {};
  float m[R][2], l[R][2];  // running max of rows g and g + 8 of each tile, in units of raw scores; this thread's
#pragma unroll             // part of their running sums
  for (int i = 0; i < R; ++i) m[i][0] = m[i][1] = -CUDART_INF_F, l[i][0] = l[i][1] = 0.f;
  const float scale = p.scale_log2 * 0.6931471805599453f;  // sm_scale (Params carries sm_scale * log2(e))
  const int row0 = q0 + warp * 16 * R + g;        // this thread's rows: row0 + 16i and row0 + 16i + 8

  // Step 12: this thread's first chunks of K and V in global memory, moved BC rows on per tile (copy_rows).
  const T* k_from = first_chunk<T, D>(k, p.k_stride[2], 0);
  const T* v_from = first_chunk<T, D>(v, p.v_stride[2], 0);
  // Step 4: the copies of tile j + 1 into the buffer that tile j - 1 used, in one cp.async group (step 8: two).
  // Issued right after the barrier that starts tile j, or (step 13) once tile j's S = Q K^T is issued.
  const auto request_next = [&](int j) {
    if (j + 1 >= n_tiles) return;
    const int next = (j + 1) % 2 * BC * D, c0 = j * BC;
    if constexpr (Step::kHoisted) {  // Step 12: each copy starts where the last tile's did, BC rows on
      k_from += BC * p.k_stride[2], v_from += BC * p.v_stride[2];
      const int rows_left = p.seqlen_k - c0 - BC;
      const auto copy_kv = [&](auto checked) {
        copy_rows<T, D, BC, kThreads, checked.value>(Ks + next, k_from, k, p.k_stride[2], rows_left);
        copy_rows<T, D, BC, kThreads, checked.value>(Vs + next, v_from, v, p.v_stride[2], rows_left);
      };
      if (Step::kWholeTiles && rows_left >= BC) copy_kv(std::false_type{});  // Step 15: no row past the end
      else copy_kv(std::true_type{});
    } else {
      load_tile<Step, T, D, BC, kThreads>(Ks + next, k, p.k_stride[2], c0 + BC, p.seqlen_k);
      if constexpr (Step::kSplitKV) cp_async_commit();
      load_tile<Step, T, D, BC, kThreads>(Vs + next, v, p.v_stride[2], c0 + BC, p.seqlen_k);
    }
    cp_async_commit();
  };
  for (int j = 0; j < n_tiles; ++j) {
    const int c0 = j * BC;
    const T* Kt = Ks;
    const T* Vt = Vs;
    if constexpr (Step::kCpAsync) {
      // Step 4: tile j was requested an iteration ago. Wait for it; the barrier also says every warp is done
      // with tile j - 1, whose buffer now receives tile j + 1 while this tile is computed.
      // Step 8: only K of tile j needs to be in here (its V, a group of its own, may still be on the way).
      if (j > 0) {
        cp_async_wait<Step::kSplitKV ? 1 : 0>();
        __syncthreads();
      }
      if (!Step::kLateCopy) request_next(j);
      Kt = Ks + j % 2 * BC * D;
      Vt = Vs + j % 2 * BC * D;
    } else {
      if (j > 0) __syncthreads();  // every warp is done with the previous tile
      load_tile<Step, T, D, BC, kThreads>(Ks, k, p.k_stride[2], c0, p.seqlen_k);
      load_tile<Step, T, D, BC, kThreads>(Vs, v, p.v_stride[2], c0, p.seqlen_k);
      __syncthreads();
    }

    const auto read_k = [&](uint32_t (&b)[2][2], int n0, int k0) {
      if constexpr (Step::kHoisted) {  // Step 12
        uint32_t r[4];
        ldmatrix_x4_at(r, smem_address(Kt) + at_keys(n0, k0), false);
        b_pair(b, r);
      } else {
        load_b_k<Step, D>(b, Kt, n0, k0, lane);
      }
    };
    const auto read_v = [&](uint32_t (&b)[2][2], int n0, int k0) {
      if constexpr (Step::kHoisted) {  // Step 12
        uint32_t r[4];
        ldmatrix_x4_at(r, smem_address(Vt) + at_rows(k0, n0), true);
        b_pair(b, r);
      } else {
        load_b_v<Step, D>(b, Vt, n0, k0, lane);
      }
    };

    // S = Q K^T: 16R x BC scores per warp, fp32 accumulators. Each K fragment serves R mma.
    float s[R][kTilesS][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[R][4];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[i][e] = qa[i][kk][e];
        } else {  // Step 11
          read_q(a[i], (warp * R + i) * 16, kk * 16);
        }
      }
#pragma unroll
      for (int n = 0; n < kTilesS; n += 2) {
        uint32_t kb[2][2];
        read_k(kb, n * 8, kk * 16);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          mma_16816<T>(s[i][n], a[i], kb[0]);
          mma_16816<T>(s[i][n + 1], a[i], kb[1]);
        }
      }
    }

    if constexpr (Step::kLateCopy) request_next(j);  // Step 13: after S's mma, before the softmax

    // Mask keys past the end and, when causal, keys after the diagonal. Step 7 masks only the tiles that
    // cross the diagonal (tiles past it are not visited at all); before, every causal tile is masked.
    const bool crosses_diagonal = p.causal && (!Step::kCausalSkip || c0 + BC - 1 > q0 + offset);
    if (c0 + BC > p.seqlen_k || crosses_diagonal) {
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int n = 0; n < kTilesS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = c0 + n * 8 + 2 * t + e % 2, row = row0 + 16 * i + e / 2 * 8;
            if (key >= p.seqlen_k || (p.causal && key > row + offset)) s[i][n][e] = -CUDART_INF_F;
          }
    }

    // Online softmax on the fragments: row r (0: g, 1: g + 8) of tile i owns entries 2r, 2r + 1 of every n8 tile.
    const auto new_max = [&](int i, int r) {
      float tile_max = -CUDART_INF_F;
#pragma unroll
      for (int n = 0; n < kTilesS; ++n) tile_max = fmaxf(tile_max, fmaxf(s[i][n][2 * r], s[i][n][2 * r + 1]));
      // The rest of the row is held by the other 3 threads of the group (lanes 4g .. 4g + 3).
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      return fmaxf(m[i][r], tile_max);
    };
    float m_new[R][2];
    bool rescale = true;
    if constexpr (kRareRescale) {  // Step 14: keep every stale maximum unless one row of the warp outgrew it
      bool grows = false;               // (from -inf: always; -inf to -inf gives NaN, which is not > 8)
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          m_new[i][r] = new_max(i, r);
          grows |= (m_new[i][r] - m[i][r]) * p.scale_log2 > kRescaleLog2;
        }
      rescale = __any_sync(0xffffffffu, grows);
    }
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (!kRareRescale) m_new[i][r] = new_max(i, r);
        const float m_ref = rescale ? m_new[i][r] : m[i][r];  // step 14: the stale maximum, if no rescale
        const float ref = m_ref == -CUDART_INF_F ? 0.f : m_ref;  // no visible key yet: every exp is 0
        float alpha = 1.f, sum = 0.f;
        if constexpr (Step::kExp2) {  // Step 6: 2^(s * scale * log2 e - ref * scale * log2 e): FFMA + EX2
          const float ref_log2 = ref * p.scale_log2;
          if (rescale) alpha = fast_exp2(m[i][r] * p.scale_log2 - ref_log2);
#pragma unroll
          for (int n = 0; n < kTilesS; ++n)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              s[i][n][e] = fast_exp2(fmaf(s[i][n][e], p.scale_log2, -ref_log2));
              sum += s[i][n][e];
            }
        } else {
          if (rescale) alpha = expf((m[i][r] - ref) * scale);
#pragma unroll
          for (int n = 0; n < kTilesS; ++n)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              s[i][n][e] = expf((s[i][n][e] - ref) * scale);
              sum += s[i][n][e];
            }
        }
        if (rescale) {
          l[i][r] = l[i][r] * alpha + sum;
          m[i][r] = m_ref;
#pragma unroll
          for (int n = 0; n < kTilesO; ++n) o[i][n][2 * r] *= alpha, o[i][n][2 * r + 1] *= alpha;
        } else {
          l[i][r] += sum;
        }
      }

    if constexpr (Step::kSplitKV) {  // Step 8: now V of tile j (tile j + 1's two groups may stay in flight)
      if (j + 1 < n_tiles) cp_async_wait<2>();
      else cp_async_wait<0>();
      __syncthreads();
    }

    // O += P V. The S accumulators of n8 tiles 2kk and 2kk + 1 are, packed to 16 bits, exactly the A
    // fragment of keys 16kk..16kk+15: P never leaves the registers.
    mma_c_read<T, BC / 16>(o, s, read_v);
  }

  // Finish: the 4 threads of a group add their parts of l, then normalise and store their rows.
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[i][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees no key outputs 0
      const int row = row0 + 16 * i + 8 * r;
      if (row >= p.seqlen_q) continue;
      if (p.lse != nullptr && t == 0)  // what the backward needs to rebuild P: log(sum of e^(scale s)), natural log
        p.lse[static_cast<long long>(blockIdx.y) * p.seqlen_q + row] = sum > 0.f ? m[i][r] * scale + logf(sum)
                                                                                 : -CUDART_INF_F;
      T* dst = out + row * p.o_stride[2] + 2 * t;
#pragma unroll
      for (int n = 0; n < kTilesO; ++n)
        *reinterpret_cast<uint32_t*>(dst + n * 8) = pack2<T>(o[i][n][2 * r] * inv, o[i][n][2 * r + 1] * inv);
    }
}

// Shared memory per block that every sm_80+ GPU grants (sm_86, sm_89, sm_120: 99 KB; A100 163 KB, H100 227 KB).
constexpr int kSmemEveryGpu = 99 * 1024;

// The same step with half the keys per tile, for GPUs that cannot give a block the shared memory of the full
// tile (D = 128 from step 5 needs 160 KB).
template <typename Step> struct HalfTile : Step {
  template <int D> static constexpr int block_cols() { return Step::template block_cols<D>() / 2; }
};

template <typename Step, typename T, int D>
cudaError_t launch_mma_d(const Params& p, cudaStream_t stream) {
  using Tile = MmaTile<Step, D>;
  if constexpr (Tile::kSmemBytes > kSmemEveryGpu) {
    int device = 0, limit = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (Tile::kSmemBytes > limit) return launch_mma_d<HalfTile<Step>, T, D>(p, stream);
  }
  auto kernel = flash_mma_kernel<Step, T, D>;
  if (Tile::kSmemBytes > 48 * 1024) {  // above 48 KB a kernel must opt in to more dynamic shared memory
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((p.seqlen_q + Tile::kRows - 1) / Tile::kRows, p.batch * p.heads);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The plain launcher of one step: fp16 or bf16, D = 64 or 128 (the torch wrapper refuses anything else).
template <typename Step>
cudaError_t launch_flash_mma(const Params& p, DType dtype, cudaStream_t stream) {
  const bool wide = p.head_dim == 128;
  if (p.head_dim != 64 && !wide) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return wide ? launch_mma_d<Step, __half, 128>(p, stream)
                                      : launch_mma_d<Step, __half, 64>(p, stream);
    case DType::kBFloat16: return wide ? launch_mma_d<Step, __nv_bfloat16, 128>(p, stream)
                                       : launch_mma_d<Step, __nv_bfloat16, 64>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace course_flash
