// Step 13 of 15: the next tile's copies requested after S = Q K^T, on step 12.
// The kernel is flash_mma_kernel.cuh; this file compiles Step13LateCopy (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s13_late_copy_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s13_late_copy(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step13LateCopy>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step13LateCopy, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s13_late_copy(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s13_late_copy_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                               double scale) {
  using course_flash::launch_flash_mma_s13_late_copy;
  return course_flash::mma_forward("flash_mma_s13_late_copy", launch_flash_mma_s13_late_copy, q, k, v, causal, scale);
}
#endif
