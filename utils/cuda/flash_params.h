// Plain C++ shared by the kernels (flash_common.cuh) and the torch wrappers (flash_torch.h): the parameters of
// a forward launch, the dtypes, the head-dim padding rule and the launchers' signatures.
#pragma once
#include <cuda_runtime_api.h>

namespace course_flash {

enum class DType { kFloat16, kBFloat16, kFloat32 };

// Everything a forward kernel needs; strides in elements for (batch, head, seq); the last dim is contiguous.
struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  long long q_stride[3], k_stride[3], v_stride[3], o_stride[3];
  int batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim;
  float scale_log2;  // sm_scale * log2(e): the kernels use exp2, so the scale absorbs the change of base
  bool causal;
};

constexpr int kMaxHeadDim = 256;

// Kernels are compiled for a few head dims; any head dim up to kMaxHeadDim runs in the next larger one, with
// the extra columns of Q, K and V zero-filled in registers and shared memory (they add 0 to every dot product).
constexpr int padded_head_dim(int d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }

// Defined in flash_naive.cu and flash_tiled.cu (compiled by nvcc), called by their torch wrappers.
cudaError_t launch_flash_naive(const Params& p, DType dtype, cudaStream_t stream);
cudaError_t launch_flash_tiled(const Params& p, DType dtype, cudaStream_t stream);
int flash_tiled_smem_bytes(int head_dim);

}  // namespace course_flash
