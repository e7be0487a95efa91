// Step 1 of 15: mma.sync on tensor cores, fragments read from shared memory word by word.
// The kernel is flash_mma_kernel.cuh; this file compiles Step1Mma (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s1_mma_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s1_mma(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step1Mma>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step1Mma, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s1_mma(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s1_mma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                       double scale) {
  using course_flash::launch_flash_mma_s1_mma;
  return course_flash::mma_forward("flash_mma_s1_mma", launch_flash_mma_s1_mma, q, k, v, causal, scale);
}
#endif
