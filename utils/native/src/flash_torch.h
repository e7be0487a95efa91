// The torch side of the FlashAttention kernels, compiled by the host C++ compiler (load_inline's cpp_sources):
// input checks with TORCH_CHECK, output allocation, launch on the current stream.
#pragma once
#include "flash_params.h"
#include <cmath>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "course_str.h"

namespace course_flash {

// Validate (batch, heads, seq, head_dim) CUDA tensors; every violation is a TORCH_CHECK with a clear message,
// raised before anything is allocated or launched. Returns the params for a freshly allocated output.
inline Params make_params(const char* name, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& o, bool causal, double scale) {
  const torch::Tensor* ts[3] = {&q, &k, &v};
  const char* names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const torch::Tensor& t = *ts[i];
    TORCH_CHECK(t.is_cuda(), name, ": ", names[i], " must be a CUDA tensor, got one on ", t.device());
    TORCH_CHECK(t.dim() == 4, name, ": ", names[i], " must have 4 dims (batch, heads, seq, head_dim), got ",
                course::num(t.dim()));
    TORCH_CHECK(t.numel() > 0, name, ": ", names[i], " is empty, shape ", course::shape(t.sizes()));
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, ": ", names[i], " has dtype ", t.scalar_type(),
                " but q has ", q.scalar_type());
    TORCH_CHECK(t.device() == q.device(), name, ": ", names[i], " is on ", t.device(), " but q is on ",
                q.device());
    TORCH_CHECK(t.stride(3) == 1, name, ": ", names[i], " must be contiguous in head_dim (stride(3) == 1), got "
                "strides ", course::shape(t.strides()));
    for (int dim = 0; dim < 4; ++dim)
      TORCH_CHECK(t.size(dim) <= INT32_MAX, name, ": ", names[i], " is too large, shape ", course::shape(t.sizes()));
  }
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == torch::kFloat16 || dt == torch::kBFloat16 || dt == torch::kFloat32, name,
              ": dtype must be float16, bfloat16 or float32, got ", dt);
  TORCH_CHECK(k.sizes() == v.sizes(), name, ": k and v must have the same shape, got ", course::shape(k.sizes()),
              " and ", course::shape(v.sizes()));
  TORCH_CHECK(k.size(0) == q.size(0), name, ": k has batch ", course::num(k.size(0)), " but q has ",
              course::num(q.size(0)));
  TORCH_CHECK(k.size(3) == q.size(3), name, ": k has head_dim ", course::num(k.size(3)), " but q has ",
              course::num(q.size(3)));
  TORCH_CHECK(q.size(1) % k.size(1) == 0, name, ": q has ", course::num(q.size(1)),
              " heads, not a multiple of the ", course::num(k.size(1)), " heads of k and v");
  const int64_t d = q.size(3);
  TORCH_CHECK(d % 8 == 0 && d <= kMaxHeadDim, name, ": head_dim ", course::num(d),
              " is not supported; supported: multiples of 8 up to ", course::num(kMaxHeadDim));
  TORCH_CHECK(scale > 0 && std::isfinite(scale), name, ": scale must be finite and positive, got ", course::num(scale));
  // The kernels launch a row of blocks per (batch, head), on the grid's y dimension: at most 65,535 rows.
  TORCH_CHECK(q.size(0) * q.size(1) <= 65535, name, ": batch x heads = ", course::num(q.size(0)), " x ",
              course::num(q.size(1)), " is more than a grid has rows (gridDim.y, at most 65535); split the batch");

  Params p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  for (int dim = 0; dim < 3; ++dim) {
    p.q_stride[dim] = q.stride(dim);
    p.k_stride[dim] = k.stride(dim);
    p.v_stride[dim] = v.stride(dim);
    p.o_stride[dim] = o.stride(dim);
  }
  p.batch = static_cast<int>(q.size(0));
  p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.seqlen_q = static_cast<int>(q.size(2));
  p.seqlen_k = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(d);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
  p.causal = causal;
  return p;
}

inline DType dtype_of(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat16 ? DType::kFloat16
         : t.scalar_type() == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

// The torch side of both forward kernels: check, allocate the output, launch on the current stream.
template <typename Launcher>
torch::Tensor forward(const char* name, Launcher launcher, const torch::Tensor& q, const torch::Tensor& k,
                      const torch::Tensor& v, bool causal, double scale) {
  TORCH_CHECK(q.is_cuda(), name, ": q must be a CUDA tensor, got one on ", q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  // Allocate only once the shapes are known to be sane: make_params checks q, k, v before touching o.
  torch::Tensor o;
  Params p = make_params(name, q, k, v, q, causal, scale);  // o aliases q for the checks only
  o = torch::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  p.o = o.data_ptr();
  for (int dim = 0; dim < 3; ++dim) p.o_stride[dim] = o.stride(dim);
  const cudaError_t err = launcher(p, dtype_of(q), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": launch failed: ", cudaGetErrorString(err));
  return o;
}

}  // namespace course_flash
