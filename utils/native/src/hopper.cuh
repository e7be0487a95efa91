// Hopper (sm_90a) building blocks of notebook 06c, each a thin wrapper around one PTX instruction:
//   hopper_layout.h       the tile layout and the descriptor wgmma reads it through (host and device code)
//   wgmma_*               the warpgroup matrix multiply: fence, issue (m64nNk16), commit, wait
// A warpgroup is 4 consecutive warps (128 threads) starting at a warp index divisible by 4; every wgmma
// instruction is executed by all 128 threads together ("sync.aligned").
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "hopper_layout.h"

namespace course_hopper {

__device__ inline uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The GPU's nanosecond clock, the same on every SM (utils.native.hopper.block_timeline reads a block's milestones with
// it; it ticks in steps of 32 ns on the H200), and the SM this thread runs on.
__device__ inline long long global_timer_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ inline int sm_id() {
  int s;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(s));
  return s;
}

// Ordinary stores to shared memory are seen by the tensor cores (the "async proxy") only after this fence.
__device__ inline void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders this warpgroup's earlier accesses to registers that the following wgmma use: their accumulators, and A
// when it comes from registers. It does not order shared memory: ordinary stores need fence_proxy_async above.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving reads or writes of the accumulators across an asynchronous wgmma.
template <int R>
__device__ inline void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of an inline-PTX wgmma: "+f" constraints for 8 or 32 registers of d from index i,
// and the brace lists of 32 or 64 operand numbers.
#define COURSE_F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define COURSE_F32(d, i) COURSE_F8(d, i), COURSE_F8(d, i + 8), COURSE_F8(d, i + 16), COURSE_F8(d, i + 24)
#define COURSE_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define COURSE_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
                   "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
                   "%56, %57, %58, %59, %60, %61, %62, %63}"
// d (64 x 64 fp32, 32 registers a thread) += A (64 x 16, shared) * B (16 x 64, shared; stored N x K, K-major).
// accumulate == 0 ignores d's old value (D = A*B). Thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4
// and +8, columns 8*j + 2*(t%4) and +1 in d[4j..4j+3], the layout of mma.sync's accumulator repeated.
// kTransA, kTransB (the backward's dQ = dS K): A stored M-major (its M index contiguous), B N-major.
template <typename T, bool kTransA = false, bool kTransB = false>
__device__ inline void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 COURSE_D32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : COURSE_F32(d, 0) : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA ? 1 : 0),
                   "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 COURSE_D32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : COURSE_F32(d, 0) : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA ? 1 : 0),
                   "n"(kTransB ? 1 : 0));
  }
}

// The same with N = 128 (64 registers of d a thread): attention's S for a tile of 128 keys.
template <typename T>
__device__ inline void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 COURSE_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F32(d, 32) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 COURSE_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F32(d, 32) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// The same with N = 80 (40 registers of d a thread): the backward's Sᵀ and dPᵀ over 80 queries, and dQᵀ = Kᵀ dSᵀ
// (kTransA: Kᵀ read M-major out of K) for them. FlashAttention-3 picks these 80-query tiles at D = 128.
#define COURSE_D40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                   "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
                   "%38, %39}"
template <typename T, bool kTransA = false, bool kTransB = false>
__device__ inline void wgmma_m64n80k16(float (&d)[40], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
                 COURSE_D40 ", %40, %41, p, 1, 1, %43, %44;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F8(d, 32) : "l"(desc_a), "l"(desc_b), "r"(accumulate),
                   "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 "
                 COURSE_D40 ", %40, %41, p, 1, 1, %43, %44;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F8(d, 32) : "l"(desc_a), "l"(desc_b), "r"(accumulate),
                   "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0));
  }
}

// The same multiply with A from registers ("RS"): a (four 32-bit registers of two 16-bit values each) holds
// this thread's part of the 64 x 16 A tile in mma.sync's A-fragment layout, one 16-row slab per warp. This is
// how P, computed in registers by the softmax, feeds the second product of attention. N = 64 or 128; always
// accumulates (d += a * b). kTransB: B is stored N-major (its N index contiguous, as V is in memory) instead of
// K-major; the descriptor then steps along N by its leading offset and along K by its stride offset.
template <typename T, int N, bool kTransB = false>
__device__ inline void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "N = 64 or 128");
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 COURSE_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : COURSE_F32(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB ? 1 : 0));
  } else if constexpr (N == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 COURSE_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : COURSE_F32(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB ? 1 : 0));
  } else if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 COURSE_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB ? 1 : 0));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 COURSE_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : COURSE_F32(d, 0), COURSE_F32(d, 32)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB ? 1 : 0));
  }
}

// stmatrix with .trans: lane l gives the address of row l % 8 of matrix l / 8, and that row receives column
// l % 8 of the matrix register i of each lane holds in the C fragment layout: each 8 x 8 tile lands transposed.
__device__ inline void stmatrix_x4_trans(uint32_t address, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// ---- TMA: the tensor memory accelerator copies a box of a tensor into shared memory, and an mbarrier counts
// the bytes that arrived. One thread issues the copy; everyone waits on the barrier's phase.
__device__ inline void mbarrier_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine
}
// This thread arrives, and the barrier expects `bytes` more to be written before the phase can complete.
__device__ inline void mbarrier_arrive_expect(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ inline bool mbarrier_try_wait(uint32_t bar, int phase) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(phase) : "memory");
  return done;
}
// The same test, but the thread may be suspended until the phase completes, for up to kWaitSuspendNs, instead of
// the hardware's own, shorter limit: a waiting warp then polls (and takes issue slots) less often.
constexpr uint32_t kWaitSuspendNs = 10000000;
__device__ inline bool mbarrier_try_wait_suspend(uint32_t bar, int phase) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(phase), "r"(kWaitSuspendNs) : "memory");
  return done;
}
template <bool kSuspend = false>
__device__ inline void mbarrier_wait(uint32_t bar, int phase) {
  if constexpr (kSuspend) {
    while (!mbarrier_try_wait_suspend(bar, phase)) {}
  } else {
    while (!mbarrier_try_wait(bar, phase)) {}
  }
}
// A plain arrival: counts towards the barrier's expected arrivals (no bytes).
__device__ inline void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Copy the box at (x, y) (x along the contiguous dim) of the tensor `map` describes to shared address `dst`;
// the bytes count towards `bar`. The map's swizzle mode decides the layout in shared memory.
__device__ inline void tma_load_2d(uint32_t dst, const void* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar) : "memory");
}
// The same for a 3-d tensor (x contiguous, then y, then z: head_dim, sequence, batch x heads in attention).
__device__ inline void tma_load_3d(uint32_t dst, const void* map, int x, int y, int z, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, both 16-byte aligned, without a tensor map: the
// backward's rows of lse2 and delta. The bytes count towards `bar`.
__device__ inline void bulk_load(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar) : "memory");
}

// The other direction (step 15): the box at (x, y, z) of `map` from shared address `src` to global memory. Bytes
// past the tensor's edge are not written. A store joins this thread's bulk group on commit; `wait_read` returns
// once its reads of shared memory are done (the writes to global memory may still be under way).
__device__ inline void tma_store_3d(const void* map, int x, int y, int z, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(src) : "memory");
}
// The same box added element by element into fp32 global memory (the backward's dQ, step "reduce_dq"): the L2
// does the adds, so the threads issue one instruction per box instead of one atomic per pair of floats.
__device__ inline void tma_reduce_add_3d(const void* map, int x, int y, int z, uint32_t src) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(src) : "memory");
}
// `bytes` (a multiple of 16) of fp32 from shared `src` added element by element into global `dst`, both 16-byte
// aligned, without a tensor map (step "frag_dq": dQ in the accumulator's register order, one contiguous run)
__device__ inline void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(reinterpret_cast<uint64_t>(dst)), "r"(src), "r"(bytes) : "memory");
}
__device__ inline void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Warp specialisation: a warpgroup gives registers back (dec) or takes them (inc); all its warps execute it.
// Takes effect only with a register cap at entry (__launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ inline void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters)); }
template <int kRegisters>
__device__ inline void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters)); }

// Named barriers 1-15 (0 is __syncthreads'): `sync` waits until `threads` threads (whole warps, itself included)
// have arrived; `arrive` counts this warp in and goes on. Two consumer warpgroups take turns with them.
__device__ inline void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same with the barrier's id and count as immediates, so that no register holds them
template <int kId, int kThreads>
__device__ inline void named_barrier_sync_n() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ inline void named_barrier_arrive_n() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace course_hopper
