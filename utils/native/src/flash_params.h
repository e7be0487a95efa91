// Plain C++ shared by the kernels (flash_common.cuh) and the torch wrappers (flash_torch.h): the parameters of
// a forward launch (and of the mma backward), the dtypes, the head-dim padding rule and the launchers' signatures.
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
  float* lse = nullptr;  // when set (the mma forward only): (batch, heads, seqlen_q) log-sum-exp for the backward
};

// The backward of the mma kernels (flash_mma_bwd_kernel.cuh): the forward's Params and what else it reads and writes.
constexpr int kLsePad = 128;  // lse2 and delta rows are padded to a multiple of this: tiles of them are read whole
struct BwdParams {
  Params fwd;            // q, k, v, their strides and sizes, scale_log2, causal (fwd.o is unused)
  const void* dout;      // dO, with its own strides
  long long do_stride[3];
  const float* lse2;     // (batch * heads, padded_q): lse * log2(e); +inf for rows with no key and the padding
  const float* delta;    // (batch * heads, padded_q): rowsum(dO * O); 0 in the padding
  int padded_q;
  float* dq_accum;       // step 1: fp32 (batch, heads, seqlen_q, D), contiguous and zeroed, unscaled
  void* dq;              // step 2: (batch, heads, seqlen_q, D), contiguous, in the input dtype
  void* dk;              // (batch, kv_heads, seqlen_k, D), contiguous
  void* dv;
};

// The backward's prepare pass from step 14 on (flash_bwd_passes.cuh): lse2 and delta from the forward's lse and O and
// from dO.
struct BwdPrepareParams {
  const void* dout;      // dO and O, (batch, heads, seqlen_q, head_dim) with their own strides
  const void* o;
  long long do_stride[3], o_stride[3];
  const float* lse;      // (batch, heads, seqlen_q), contiguous: natural log, -inf for rows with no key
  float* lse2;           // (batch * heads, padded_q), as BwdParams
  float* delta;
  int heads, seqlen_q, padded_q, head_dim;
  long long rows;        // batch * heads * padded_q
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
