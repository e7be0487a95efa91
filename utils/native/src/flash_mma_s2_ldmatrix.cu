// Step 2 of 15: fragments loaded with ldmatrix (V with ldmatrix.trans).
// The kernel is flash_mma_kernel.cuh; this file compiles Step2Ldmatrix (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s2_ldmatrix_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s2_ldmatrix(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step2Ldmatrix>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step2Ldmatrix, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s2_ldmatrix(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s2_ldmatrix_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                            double scale) {
  using course_flash::launch_flash_mma_s2_ldmatrix;
  return course_flash::mma_forward("flash_mma_s2_ldmatrix", launch_flash_mma_s2_ldmatrix, q, k, v, causal, scale);
}
#endif
