// Host side of the Hopper kernels' torch wrappers (host compiler only): the sm_90 check, the checks of the tensors
// TMA reads, and TMA tensor maps read in boxes with 128-byte swizzling, the layout their wgmma descriptors expect
// (fp16/bf16; fp32 for the backward's dQ).
#pragma once
#include <cuda.h>  // CUtensorMap and its enums; the encoding function is looked up in the driver at run time
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include "course_str.h"

namespace course_hopper {

// sm_90a code runs on sm_90 GPUs alone: anything else gets this error, naming the kernel, not a launch failure.
inline void check_sm90(const char* name, const torch::Tensor& t) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.get_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, t.get_device());
  TORCH_CHECK(major == 9 && minor == 0, name, ": needs an sm_90 GPU (H100/H200: wgmma, TMA), this one is sm_",
              course::num(major), course::num(minor));
}

// The tensors kernel `name` reads by TMA, `inputs` called `names`: each a contiguous 4-d CUDA tensor on q's device,
// fp16 or bf16 like q, starting on 16 bytes.
template <int N>
inline void check_operands(const char* name, const torch::Tensor* (&inputs)[N], const char* (&names)[N],
                           const torch::Tensor& q) {
  for (int i = 0; i < N; ++i) {
    const torch::Tensor& t = *inputs[i];
    TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous() && t.device() == q.device(), name, ": ", names[i],
                " must be a contiguous 4-d CUDA tensor on q's device, got shape ", course::shape(t.sizes()));
    TORCH_CHECK(t.scalar_type() == q.scalar_type() && (q.scalar_type() == torch::kFloat16 ||
                q.scalar_type() == torch::kBFloat16), name, ": ", names[i], " must be float16 or bfloat16 like q, got ",
                t.scalar_type());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, ": ", names[i], " must start on 16 bytes");
  }
}

// cuTensorMapEncodeTiled lives in the driver (libcuda), which torch extensions do not link: found once with
// dlsym in the libcuda.so.1 that the CUDA runtime has already loaded.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);
inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    return lib ? reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled")) : nullptr;
  }();
  return fn;
}

// The map of fp16/bf16/fp32 tensor `t` seen as `rank` dims (`dims`, innermost first; `strides` in bytes for dims
// 1..rank-1), read in boxes of `box` elements. `name` names the kernel in errors.
inline CUtensorMap tensor_map(const char* name, const torch::Tensor& t, cuuint32_t rank, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map{};
  const EncodeTiled encode = encode_tiled();
  TORCH_CHECK(encode != nullptr, name, ": cuTensorMapEncodeTiled not found in libcuda.so.1");
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type = t.scalar_type() == torch::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : t.scalar_type() == torch::kFloat32  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult err = encode(
      &map, type, rank, t.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(err == CUDA_SUCCESS, name, ": cuTensorMapEncodeTiled failed with error ",
              course::num(static_cast<int>(err)));
  return map;
}

// A contiguous (batch, heads, rows, cols) tensor seen as 3-d (cols, rows, batch x heads), read in boxes of
// 128 bytes of columns (64 of fp16/bf16, 32 of fp32) x `box_rows` rows: Q, K, V, O, dO and the backward's dQ.
inline CUtensorMap map_3d(const char* name, const torch::Tensor& t, int box_rows) {
  const int64_t rows = t.size(2), cols = t.size(3), bytes = t.element_size();
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(t.size(0) * t.size(1))};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * bytes), static_cast<cuuint64_t>(rows * cols * bytes)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / bytes), static_cast<cuuint32_t>(box_rows), 1};
  return tensor_map(name, t, 3, dims, strides, box);
}

}  // namespace course_hopper
