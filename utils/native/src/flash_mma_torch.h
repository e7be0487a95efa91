// The torch side of the tensor-core kernels (flash_mma_step.cu.in, flash_mma_bwd.cu), compiled by the host C++
// compiler: what they support beyond flash_torch.h's checks (fp16/bf16, D = 64 or 128, an sm_80+ GPU, rows on
// 16 bytes), then the common forward.
#pragma once
#include "flash_torch.h"

namespace course_flash {

// What the mma kernels need of q, k, v (and dO, for the backward) beyond make_params's checks.
inline void check_mma_inputs(const char* name, const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const torch::Tensor* dout = nullptr) {
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
  // The kernels move rows in 16-byte chunks (cp.async, uint4): a row that starts off a 16-byte boundary would
  // fault. Python's flash_mma copies such inputs first; a direct call gets this error instead of a crash.
  const torch::Tensor* inputs[] = {&q, &k, &v, dout};
  const char* names[] = {"q", "k", "v", "dout"};
  if (dout != nullptr)
    TORCH_CHECK(dout->sizes() == q.sizes() && dout->scalar_type() == q.scalar_type() && dout->device() == q.device(),
                name, ": dout must match q in shape, dtype and device, got ", course::shape(dout->sizes()));
  for (int i = 0; i < (dout != nullptr ? 4 : 3); ++i) {
    const torch::Tensor& t = *inputs[i];
    bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int dim = 0; dim < t.dim() - 1; ++dim) aligned = aligned && t.stride(dim) % 8 == 0;
    TORCH_CHECK(aligned, name, ": ", names[i], " rows must start on 16 bytes (data pointer and strides of the "
                "first three dims multiples of 8 elements); call .contiguous() first, got strides ",
                course::shape(t.strides()));
  }
}

template <typename Launcher>
torch::Tensor mma_forward(const char* name, Launcher launcher, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, bool causal, double scale) {
  check_mma_inputs(name, q, k, v);
  return forward(name, launcher, q, k, v, causal, scale);
}

}  // namespace course_flash
