// Host side of the prepare and finish passes (flash_bwd_passes.cuh), shared by the torch wrappers of 06bw's
// backward (flash_mma_bwd.cu) and 06c's (hopper_backward.cu). Host compiler only.
#pragma once
#include <vector>
#include "flash_torch.h"  // torch, dtype_of; BwdPrepareParams, kLsePad (flash_params.h)

namespace course_flash {

cudaError_t launch_bwd_prepare(const BwdPrepareParams& pp, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_finish(const float* accum, void* dq, long long rows, int seqlen_q, int acc_rows, int head_dim,
                              float scale, DType dtype, cudaStream_t stream);

// Rows of lse2 and delta a head: seqlen_q rounded up to `pad` (kLsePad unless a kernel reads tiles of another size).
inline int64_t padded_rows(int64_t seqlen_q, int64_t pad = kLsePad) { return (seqlen_q + pad - 1) / pad * pad; }

// (lse2, delta), fp32 (batch · heads, padded_rows(seqlen_q, pad)), from dO and O (the caller has checked them:
// CUDA, fp16/bf16, 4-d, head dim 64 or 128, rows on 16 bytes) and the forward's lse, checked here.
inline std::vector<torch::Tensor> bwd_prepare(const char* name, const torch::Tensor& dout, const torch::Tensor& o,
                                              const torch::Tensor& lse, int64_t pad = kLsePad) {
  TORCH_CHECK(lse.is_cuda() && lse.device() == o.device() && lse.scalar_type() == torch::kFloat32 &&
              lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == o.size(0) && lse.size(1) == o.size(1) &&
              lse.size(2) == o.size(2), name, ": lse must be contiguous fp32 (batch, heads, seqlen_q) on o's device, "
              "got ", course::shape(lse.sizes()));
  const c10::cuda::CUDAGuard guard(o.device());
  const int64_t bh = o.size(0) * o.size(1), padded = padded_rows(o.size(2), pad);
  const auto fp32 = o.options().dtype(torch::kFloat32);
  torch::Tensor lse2 = torch::empty({bh, padded}, fp32), delta = torch::empty({bh, padded}, fp32);
  BwdPrepareParams pp{};
  pp.dout = dout.data_ptr();
  pp.o = o.data_ptr();
  for (int dim = 0; dim < 3; ++dim) pp.do_stride[dim] = dout.stride(dim), pp.o_stride[dim] = o.stride(dim);
  pp.lse = lse.data_ptr<float>();
  pp.lse2 = lse2.data_ptr<float>();
  pp.delta = delta.data_ptr<float>();
  pp.heads = static_cast<int>(o.size(1));
  pp.seqlen_q = static_cast<int>(o.size(2));
  pp.padded_q = static_cast<int>(padded);
  pp.head_dim = static_cast<int>(o.size(3));
  pp.rows = bh * padded;
  const cudaError_t err = launch_bwd_prepare(pp, dtype_of(o), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": the prepare pass failed: ", cudaGetErrorString(err));
  return {lse2, delta};
}

// dQ in q's dtype and shape: scale · `accum`, the fp32 (batch, heads, acc_rows, head_dim) accumulator of a
// backward, acc_rows being seqlen_q or padded_rows(seqlen_q) (06bw's step 15). Checks accum against q.
inline torch::Tensor bwd_finish(const char* name, const torch::Tensor& accum, const torch::Tensor& q, double scale) {
  const int64_t padded = padded_rows(q.size(2));
  const int64_t acc_rows = accum.dim() == 4 ? accum.size(2) : -1;
  TORCH_CHECK(accum.is_cuda() && accum.device() == q.device() && accum.scalar_type() == torch::kFloat32 &&
              accum.is_contiguous() && accum.dim() == 4 && accum.size(0) == q.size(0) && accum.size(1) == q.size(1) &&
              (acc_rows == q.size(2) || acc_rows == padded) && accum.size(3) == q.size(3), name,
              ": accum must be contiguous fp32 (", course::num(q.size(0)), ", ", course::num(q.size(1)), ", ",
              course::num(q.size(2)), " or ", course::num(padded), ", ",
              course::num(q.size(3)), ") on q's device, got ", course::shape(accum.sizes()));
  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor dq = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const cudaError_t err = launch_bwd_finish(accum.data_ptr<float>(), dq.data_ptr(), q.size(0) * q.size(1) * q.size(2),
                                            static_cast<int>(q.size(2)), static_cast<int>(acc_rows),
                                            static_cast<int>(q.size(3)), static_cast<float>(scale), dtype_of(q),
                                            c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": the finish pass failed: ", cudaGetErrorString(err));
  return dq;
}

}  // namespace course_flash
