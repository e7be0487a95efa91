// Notebook 06c: the FlashAttention-2 forward on Hopper's instructions. One warpgroup per 64
// query rows; per tile of 64 keys:
//   1. one thread asks TMA for the K tile and the Vᵀ tile (128-byte swizzled, counted on an mbarrier);
//   2. S = Q Kᵀ with wgmma, both operands from shared memory (Q was loaded once, the same way);
//   3. the online softmax on S in registers (each row lives in the 4 lanes of a quad: two shuffles per reduction);
//   4. P, rounded to 16 bits, is already in wgmma's register A-fragment layout: O += P V with A from registers
//      and B = the Vᵀ tile (V transposed by the caller, so every operand is K-major).
// Step 1 (kStages = 1): loads and multiplies take turns, as in the GEMM's step 2. Step 2 (kStages = 2): two
// K/Vᵀ buffers, the next tile's copy issued before this tile's multiplies. Steps 3 on (hopper_attention_ws_kernel):
// warp specialisation, then FlashAttention-3's refinements one at a time.
// Causal attention is bottom-right aligned (key c is visible to query r when c <= r + Nk - Nq), tiles past the
// diagonal are skipped, and TMA's zero fill covers the ragged last tiles.
#ifndef COURSE_TORCH_WRAPPER
#include "hopper_attention_dispatch.h"
#include "hopper_attention_kernel.cuh"

namespace course_hopper {

template <typename T, int D>
cudaError_t launch_step(int step, bool causal, const CUtensorMap& q, const CUtensorMap& k, const CUtensorMap& vt,
                        const CUtensorMap& o_map, void* o, const AttentionParams& p, int batch_heads,
                        cudaStream_t stream) {
  return with_step(step, [&](auto tag) {
    return launch_attention<typename decltype(tag)::type, T, D>(causal, q, k, vt, o_map, o, p, batch_heads, stream);
  });
}

// The extension builds this file in five parts at once (utils/native/build.py, BUILD_PARTS), since one nvcc run
// over every step takes minutes: parts 1-4 each instantiate launch_step at one dtype and head dim, and part 0 holds
// the launcher, which only declares them. Compiled whole (no COURSE_PART), the launcher instantiates all four.
using LaunchStep = cudaError_t(int, bool, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&,
                               const CUtensorMap&, void*, const AttentionParams&, int, cudaStream_t);
#ifdef COURSE_EXERCISE_STEPS
// An exercise's check (utils/course/exercises/hopper.py) runs steps 4 and 6 in bf16 at D = 128 only, so its build
// instantiates those two, in seconds.
cudaError_t hopper_attention_launch(int step, bool bf16, int head_dim, bool causal, const CUtensorMap& q,
                                    const CUtensorMap& k, const CUtensorMap& vt, const CUtensorMap& o_map, void* o,
                                    const AttentionParams& p, int batch_heads, cudaStream_t stream) {
  if (!bf16 || head_dim != 128 || (step != 4 && step != 6)) return cudaErrorInvalidValue;
  return step == 4 ? launch_attention<HopperStep4Softmax, __nv_bfloat16, 128>(causal, q, k, vt, o_map, o, p,
                                                                              batch_heads, stream)
                   : launch_attention<HopperStep6Overlap, __nv_bfloat16, 128>(causal, q, k, vt, o_map, o, p,
                                                                              batch_heads, stream);
}
#elif COURSE_PART == 1
template LaunchStep launch_step<__half, 64>;
#elif COURSE_PART == 2
template LaunchStep launch_step<__half, 128>;
#elif COURSE_PART == 3
template LaunchStep launch_step<__nv_bfloat16, 64>;
#elif COURSE_PART == 4
template LaunchStep launch_step<__nv_bfloat16, 128>;
#else
#ifdef COURSE_PART
extern template LaunchStep launch_step<__half, 64>;
extern template LaunchStep launch_step<__half, 128>;
extern template LaunchStep launch_step<__nv_bfloat16, 64>;
extern template LaunchStep launch_step<__nv_bfloat16, 128>;
#endif

// Plain launcher (no torch types); the wrapper has checked the shapes and built the tensor maps. Steps 1-2: one
// warpgroup per block (loads and multiplies in turn, then overlapped); step 3 on: a producer and two or three
// consumer warpgroups (Q's tensor map then reads 128 rows at a time, from step 11 64 per consumer). `o_map`
// (O in boxes of 64 rows) is step 15's way out; the other steps store through `o`.
cudaError_t hopper_attention_launch(int step, bool bf16, int head_dim, bool causal, const CUtensorMap& q,
                                    const CUtensorMap& k, const CUtensorMap& vt, const CUtensorMap& o_map, void* o,
                                    const AttentionParams& p, int batch_heads, cudaStream_t stream) {
  if (step < 1 || step > kHopperSteps) return cudaErrorInvalidValue;
  if (bf16) {
    return head_dim == 64
               ? launch_step<__nv_bfloat16, 64>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream)
               : launch_step<__nv_bfloat16, 128>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream);
  }
  return head_dim == 64 ? launch_step<__half, 64>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream)
                        : launch_step<__half, 128>(step, causal, q, k, vt, o_map, o, p, batch_heads, stream);
}
#endif  // COURSE_PART

}  // namespace course_hopper

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <algorithm>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"
#include "hopper_attention_dispatch.h"
#include "hopper_host.h"

namespace course_hopper {
struct AttentionParams {
  int seqlen_q, seqlen_k, heads, kv_heads, batch_heads;
  float scale_log2;
  int* work_counter;
  int head_group;
  long long* timeline;
  float* lse;
};
cudaError_t hopper_attention_launch(int step, bool bf16, int head_dim, bool causal, const CUtensorMap& q,
                                    const CUtensorMap& k, const CUtensorMap& vt, const CUtensorMap& o_map, void* o,
                                    const AttentionParams& p, int batch_heads, cudaStream_t stream);

// What the wrapper needs of a step at one head dim, read off the steps table.
struct StepLayout {
  int q_rows, k_rows, v_rows;  // rows of the boxes its tensor maps read: Q, K, and V (Vᵀ: D rows)
  bool specialised;            // step 3 on: warp-specialised, so it can note a timeline
  bool v_direct;               // step 10 on: vt is V as stored
  bool persistent;             // its blocks take query blocks from a counter
  bool one_line;               // its blocks form one line (gridDim.x), not a row per (batch, head)
};

inline StepLayout step_layout(int step, int head_dim) {
  return with_step(step, [&](auto tag) {
    using Step = typename decltype(tag)::type;
    const bool d64 = head_dim == 64;
    const int consumers = d64 ? Step::template consumers<64>() : Step::template consumers<128>();
    const bool persistent = d64 ? Step::template persistent<64>() : Step::template persistent<128>();
    // one warpgroup of 64 rows (steps 1-2); then one box for all the consumers' rows, or one per consumer
    const int q_rows = !Step::kSpecialised || Step::kQPerConsumer ? 64 : 64 * consumers;
    return StepLayout{q_rows, Step::kKeys, Step::kVDirect ? Step::kKeys : head_dim, Step::kSpecialised,
                      Step::kVDirect, persistent, persistent || Step::kHeadGroups};
  });
}
}  // namespace course_hopper

// q (B, H, Nq, D), k (B, Hkv, Nk, D) and vt (B, Hkv, D, Nk padded to a multiple of 8: V transposed; from step
// 10, V itself, (B, Hkv, Nk, D)), all
// contiguous fp16 or bf16 on an sm_90 GPU, D = 64 or 128 -> o (B, H, Nq, D). `timeline`: empty, or (step 3 on)
// int64 room for kTimelineSlots per block of 64 query rows (more than any step launches), filled per block. `lse`:
// empty, or fp32 room for each row's log-sum-exp (B · H · Nq elements), which the kernel writes: the backward's input.
torch::Tensor hopper_attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor vt, int64_t seqlen_k,
                                       bool causal, double scale, int64_t step, torch::Tensor timeline,
                                       torch::Tensor lse) {
  TORCH_CHECK(step >= 1 && step <= course_hopper::kHopperSteps, "hopper_attention: step must be 1 to ",
              course::num(course_hopper::kHopperSteps), " (utils.native.hopper.ATTENTION_STEPS), got ",
              course::num(step));
  const torch::Tensor* inputs[] = {&q, &k, &vt};
  const char* names[] = {"q", "k", "vt"};
  course_hopper::check_operands("hopper_attention", inputs, names, q);
  const int64_t d = q.size(3);
  TORCH_CHECK(d == 64 || d == 128, "hopper_attention: head_dim must be 64 or 128, got ", course::num(d));
  const course_hopper::StepLayout layout = course_hopper::step_layout(static_cast<int>(step), static_cast<int>(d));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == d && q.size(1) % k.size(1) == 0 && k.size(2) == seqlen_k,
              "hopper_attention: k of shape ", course::shape(k.sizes()), " does not fit q of shape ",
              course::shape(q.sizes()));
  if (layout.v_direct) {
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
  // a step whose blocks form one line takes any number; the others launch a row per (batch, head), at most 65,535
  TORCH_CHECK(layout.one_line || q.size(0) * q.size(1) <= 65535, "hopper_attention: batch x heads = ",
              course::num(q.size(0)), " x ", course::num(q.size(1)), " is more than step ", course::num(step),
              "'s grid has rows (gridDim.y, at most 65535); split the batch");
  const int64_t most_blocks = (q.size(2) + 63) / 64 * q.size(0) * q.size(1);
  TORCH_CHECK(timeline.numel() == 0 || (layout.specialised && timeline.is_cuda() &&
              timeline.scalar_type() == torch::kInt64 && timeline.is_contiguous() &&
              timeline.numel() >= most_blocks * 8), "hopper_attention: timeline must be "
              "empty, or from step 3 on a contiguous int64 CUDA tensor of at least ", course::num(most_blocks * 8),
              " elements, got ", course::shape(timeline.sizes()));
  TORCH_CHECK(lse.numel() == 0 || (lse.is_cuda() && lse.device() == q.device() &&
              lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() &&
              lse.numel() == q.size(0) * q.size(1) * q.size(2)), "hopper_attention: lse must be empty, or a ",
              "contiguous fp32 tensor of B * H * Nq = ", course::num(q.size(0) * q.size(1) * q.size(2)),
              " elements on q's device, got ", course::shape(lse.sizes()), " ", lse.scalar_type());
  course_hopper::check_sm90("hopper_attention", q);
  const c10::cuda::CUDAGuard guard(q.device());
  auto o = torch::empty_like(q);
  // persistent blocks take query blocks from this counter; the others need none
  torch::Tensor counter;
  if (layout.persistent) counter = torch::zeros({1}, q.options().dtype(torch::kInt32));
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
                                                          : nullptr,
                                         lse.numel() ? lse.data_ptr<float>() : nullptr};
  const char* name = "hopper_attention";
  const CUtensorMap map_q = course_hopper::map_3d(name, q, layout.q_rows),
                    map_k = course_hopper::map_3d(name, k, layout.k_rows),
                    map_vt = course_hopper::map_3d(name, vt, layout.v_rows),
                    map_o = course_hopper::map_3d(name, o, 64);  // step 15 stores O in boxes of 64 rows
  const cudaError_t err = course_hopper::hopper_attention_launch(
      static_cast<int>(step), q.scalar_type() == torch::kBFloat16, static_cast<int>(d), causal, map_q, map_k, map_vt,
      map_o, o.data_ptr(), p, static_cast<int>(q.size(0) * q.size(1)), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "hopper_attention: launch failed: ", cudaGetErrorString(err));
  return o;
}
#endif
