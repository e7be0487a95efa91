// The torch side of the tensor-core kernels (flash_mma_s*.cu), compiled by the host C++ compiler: what they
// support beyond flash_torch.h's checks (fp16/bf16, D = 64 or 128, an sm_80+ GPU), then the common forward.
#pragma once
#include "flash_torch.h"

namespace course_flash {

template <typename Launcher>
torch::Tensor mma_forward(const char* name, Launcher launcher, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, bool causal, double scale) {
  TORCH_CHECK(q.is_cuda(), name, ": q must be a CUDA tensor, got one on ", q.device());
  TORCH_CHECK(q.scalar_type() == torch::kFloat16 || q.scalar_type() == torch::kBFloat16, name,
              ": dtype must be float16 or bfloat16 (the tensor-core kernels), got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 4 && (q.size(3) == 64 || q.size(3) == 128), name,
              ": head_dim must be 64 or 128, got q of shape ", course::shape(q.sizes()));
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device());
  TORCH_CHECK(major >= 8, name, ": needs a GPU of compute capability 8.0 or newer (mma.sync.m16n8k16 with bf16, "
              "ldmatrix, cp.async); this one is sm_", course::num(major), course::num(minor),
              ". flash_tiled runs on it.");
  return forward(name, launcher, q, k, v, causal, scale);
}

}  // namespace course_flash
