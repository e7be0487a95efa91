// Notebook 06c's backward (hopper_backward_kernel.cuh): dQ, dK and dV of the attention forward on Hopper's wgmma
// and TMA, from the forward's O and log-sum-exp; around it the prepare and finish passes of 06bw's backward
// (flash_bwd_passes.cuh).
#ifndef COURSE_TORCH_WRAPPER
#include "flash_bwd_passes.cuh"
#include "hopper_backward_kernel.cuh"

namespace course_hopper {

// Step `step` at dtype T and `head_dim`: each step of kStep down to 0 instantiated, the one asked for launched.
template <typename T, int kStep = kBwdSteps - 1>
cudaError_t launch_step(int step, int head_dim, bool causal, const CUtensorMap& q, const CUtensorMap& k,
                        const CUtensorMap& v, const CUtensorMap& dout, const CUtensorMap& dq, const BackwardParams& p,
                        int batch_kv_heads, cudaStream_t stream) {
  if (step == kStep) {
    return head_dim == 64 ? launch_backward<T, 64, kStep>(causal, q, k, v, dout, dq, p, batch_kv_heads, stream)
                          : launch_backward<T, 128, kStep>(causal, q, k, v, dout, dq, p, batch_kv_heads, stream);
  }
  if constexpr (kStep > 0) {
    return launch_step<T, kStep - 1>(step, head_dim, causal, q, k, v, dout, dq, p, batch_kv_heads, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

// Plain launcher (no torch types); the wrapper has checked the shapes and built the tensor maps. step: one of
// the kBwd* steps, 0 to kBwdSteps - 1.
cudaError_t hopper_backward_launch(bool bf16, int head_dim, bool causal, int step, const CUtensorMap& q,
                                   const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& dout,
                                   const CUtensorMap& dq, const BackwardParams& p, int batch_kv_heads,
                                   cudaStream_t stream) {
  return bf16 ? launch_step<__nv_bfloat16>(step, head_dim, causal, q, k, v, dout, dq, p, batch_kv_heads, stream)
              : launch_step<__half>(step, head_dim, causal, q, k, v, dout, dq, p, batch_kv_heads, stream);
}

// The query rows of step `step`'s tiles at `head_dim` (BackwardTile's kRows), for the wrapper: lse2 and delta are
// padded, and the tensor maps' boxes shaped, to them.
int hopper_backward_rows(int head_dim, int step) {
  if (head_dim == 64) return BackwardTile<64>::kRows;
  return bwd_wide(step) ? BackwardTile<128, true>::kRows : BackwardTile<128>::kRows;
}

// Whether step `step` keeps dQ's accumulator in register order at `head_dim` (bwd_fragments), for the wrapper: its
// accumulator then holds whole tiles, and hopper_backward_finish_fragments puts it back in rows.
bool hopper_backward_fragments(int head_dim, int step) { return bwd_fragments(step, head_dim); }

template <typename T, int D>
cudaError_t launch_finish_fragments(const float* accum, void* dq, int bh, int seqlen_q, int padded_q, float scale,
                                    cudaStream_t stream) {
  constexpr int kRows = BackwardTile<D, true>::kRows;  // a tile's, one block each
  const long long blocks = static_cast<long long>(bh) * ((seqlen_q + kRows - 1) / kRows);
  hopper_bwd_finish_fragments_kernel<T, D><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      accum, static_cast<T*>(dq), seqlen_q, padded_q, scale);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_finish_fragments(const float* accum, void* dq, int bh, int seqlen_q, int padded_q, int head_dim,
                                    float scale, cudaStream_t stream) {
  return head_dim == 64 ? launch_finish_fragments<T, 64>(accum, dq, bh, seqlen_q, padded_q, scale, stream)
                        : launch_finish_fragments<T, 128>(accum, dq, bh, seqlen_q, padded_q, scale, stream);
}

// Step frag_dq's finish pass (hopper_bwd_finish_fragments_kernel): dQ in rows from its accumulator in register
// order, (bh, padded_q, head_dim) fp32.
cudaError_t hopper_backward_finish_fragments(bool bf16, const float* accum, void* dq, int bh, int seqlen_q,
                                             int padded_q, int head_dim, float scale, cudaStream_t stream) {
  if (bh == 0 || seqlen_q == 0) return cudaSuccess;
  return bf16 ? launch_finish_fragments<__nv_bfloat16>(accum, dq, bh, seqlen_q, padded_q, head_dim, scale, stream)
              : launch_finish_fragments<__half>(accum, dq, bh, seqlen_q, padded_q, head_dim, scale, stream);
}

}  // namespace course_hopper

#else  // COURSE_TORCH_WRAPPER: host C++ only
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"
#include "flash_bwd_host.h"  // bwd_prepare, bwd_finish
#include "hopper_host.h"

namespace course_hopper {
struct BackwardParams {  // hopper_backward_kernel.cuh's, which the host compiler does not read
  int seqlen_q, seqlen_k, heads, kv_heads, padded_q;
  float scale_log2, scale;
  const float* lse2;
  const float* delta;
  float* dq_accum;
  void* dk;
  void* dv;
};
cudaError_t hopper_backward_launch(bool bf16, int head_dim, bool causal, int step, const CUtensorMap& q,
                                   const CUtensorMap& k, const CUtensorMap& v, const CUtensorMap& dout,
                                   const CUtensorMap& dq, const BackwardParams& p, int batch_kv_heads,
                                   cudaStream_t stream);
cudaError_t hopper_backward_finish_fragments(bool bf16, const float* accum, void* dq, int bh, int seqlen_q,
                                             int padded_q, int head_dim, float scale, cudaStream_t stream);
int hopper_backward_rows(int head_dim, int step);
bool hopper_backward_fragments(int head_dim, int step);

}  // namespace course_hopper

// do, q, o (B, H, Nq, D); k, v (B, Hkv, Nk, D), Hkv dividing H; all contiguous fp16 or bf16 on an sm_90 GPU, D =
// 64 or 128, starting on 16 bytes; lse fp32 (B, H, Nq), the forward's natural-log log-sum-exp; step 0
// ("atomic_dq"), 1 ("reduce_dq"), 2 ("prefetch_s"), 3 ("bh_group"), 4 ("stsm_ds"), 5 ("stsm_uniform"), 6
// ("dq_first"), 7 ("desc_add"), 8 ("edge_mask"), 9 ("dv_late"), 10 ("late_prefetch"), 11 ("late_group"), 12
// ("rows80"), 13 ("rows80_group"), 14 ("late_dq_first"), 15 ("frag_dq"), 16 ("early_lse"), 17 ("dq_writer"),
// 18 ("stagger"), 19 ("rows64") or 20 ("frag_dq_first") -> (dq, dk, dv).
std::vector<torch::Tensor> hopper_attention_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k,
                                                     torch::Tensor v, torch::Tensor o, torch::Tensor lse, bool causal,
                                                     double scale, int64_t step) {
  const char* name = "hopper_backward";
  const torch::Tensor* inputs[] = {&dout, &q, &k, &v, &o};
  const char* names[] = {"do", "q", "k", "v", "o"};
  course_hopper::check_operands(name, inputs, names, q);
  const int64_t d = q.size(3), nq = q.size(2), nk = k.size(2);
  TORCH_CHECK(d == 64 || d == 128, name, ": head_dim must be 64 or 128, got ", course::num(d));
  TORCH_CHECK(dout.sizes() == q.sizes() && o.sizes() == q.sizes(), name, ": do and o must be shaped like q ",
              course::shape(q.sizes()), ", got ", course::shape(dout.sizes()), " and ", course::shape(o.sizes()));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == d && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              v.sizes() == k.sizes(), name, ": k ", course::shape(k.sizes()), " and v ", course::shape(v.sizes()),
              " do not fit q ", course::shape(q.sizes()));
  TORCH_CHECK(nq > 0 && nk > 0 && nq <= INT32_MAX - 128 && nk <= INT32_MAX - 128, name, ": empty or too long, q ",
              course::shape(q.sizes()), ", k ", course::shape(k.sizes()));
  TORCH_CHECK(k.size(0) * k.size(1) <= 65535, name, ": batch x kv_heads = ", course::num(k.size(0) * k.size(1)),
              " is more than the grid has rows (65535); split the batch");
  TORCH_CHECK(scale > 0 && std::isfinite(scale), name, ": scale must be finite and positive, got ",
              course::num(scale));
  TORCH_CHECK(step >= 0 && step <= 20, name,
              ": step must be 0 (atomic_dq), 1 (reduce_dq), 2 (prefetch_s), 3 (bh_group), 4 (stsm_ds), 5 ",
              "(stsm_uniform), 6 (dq_first), 7 (desc_add), 8 (edge_mask), 9 (dv_late), 10 (late_prefetch), 11 ",
              "(late_group), 12 (rows80), 13 (rows80_group), 14 (late_dq_first), 15 (frag_dq), 16 (early_lse), 17 ",
              "(dq_writer), 18 (stagger), 19 (rows64) or 20 (frag_dq_first), got ", course::num(step));
  course_hopper::check_sm90(name, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // lse2 and delta, (B · H, Nq padded to kLsePad, or to 640 for 80-row tiles), by the prepare pass (it checks lse)
  const int rows = course_hopper::hopper_backward_rows(static_cast<int>(d), static_cast<int>(step));
  const int64_t pad = rows == 80 ? 640 : course_flash::kLsePad;
  const std::vector<torch::Tensor> stats = course_flash::bwd_prepare(name, dout, o, lse, pad);
  const torch::Tensor &lse2 = stats[0], &delta = stats[1];

  // frag_dq, early_lse and (at D = 64) frag_dq_first keep dQ in register order, whole tiles of each head's rows.
  // Zeroed by a memset: torch::zeros would launch a fill kernel through TensorIterator, with more host time a call.
  const bool fragments = course_hopper::hopper_backward_fragments(static_cast<int>(d), static_cast<int>(step));
  auto dq_accum = fragments ? torch::empty({q.size(0), q.size(1), lse2.size(1), d}, q.options().dtype(torch::kFloat32))
                            : torch::empty(q.sizes(), q.options().dtype(torch::kFloat32));
  const cudaError_t zeroed = cudaMemsetAsync(dq_accum.data_ptr(), 0, dq_accum.nbytes(), stream);
  TORCH_CHECK(zeroed == cudaSuccess, name, ": zeroing dQ's accumulator failed: ", cudaGetErrorString(zeroed));
  auto dk = torch::empty_like(k), dv = torch::empty_like(v);
  const course_hopper::BackwardParams p{static_cast<int>(nq), static_cast<int>(nk), static_cast<int>(q.size(1)),
                                        static_cast<int>(k.size(1)), static_cast<int>(lse2.size(1)),
                                        static_cast<float>(scale * 1.4426950408889634), static_cast<float>(scale),
                                        lse2.data_ptr<float>(), delta.data_ptr<float>(), dq_accum.data_ptr<float>(),
                                        dk.data_ptr(), dv.data_ptr()};
  const CUtensorMap map_q = course_hopper::map_3d(name, q, rows), map_do = course_hopper::map_3d(name, dout, rows),
                    map_k = course_hopper::map_3d(name, k, 64), map_v = course_hopper::map_3d(name, v, 64),
                    map_dq = course_hopper::map_3d(name, dq_accum, rows == 80 ? 80 : 64);  // x 32 fp32 columns
  const cudaError_t err = course_hopper::hopper_backward_launch(
      q.scalar_type() == torch::kBFloat16, static_cast<int>(d), causal, static_cast<int>(step), map_q, map_k, map_v,
      map_do, map_dq, p, static_cast<int>(k.size(0) * k.size(1)), stream);
  TORCH_CHECK(err == cudaSuccess, name, ": launch failed: ", cudaGetErrorString(err));

  // dQ = scale · its accumulator, in q's dtype, by the finish pass (frag_dq: its own, back from register order)
  if (!fragments) return {course_flash::bwd_finish(name, dq_accum, q, scale), dk, dv};
  torch::Tensor dq = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaError_t finish = course_hopper::hopper_backward_finish_fragments(
      q.scalar_type() == torch::kBFloat16, dq_accum.data_ptr<float>(), dq.data_ptr(),
      static_cast<int>(q.size(0) * q.size(1)), static_cast<int>(nq), static_cast<int>(lse2.size(1)),
      static_cast<int>(d), static_cast<float>(scale), stream);
  TORCH_CHECK(finish == cudaSuccess, name, ": the finish pass failed: ", cudaGetErrorString(finish));
  return {dq, dk, dv};
}
#endif
