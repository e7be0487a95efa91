// Step 4 of 15: cp.async double buffering of K and V.
// The kernel is flash_mma_kernel.cuh; this file compiles Step4CpAsync (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s4_cp_async_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s4_cp_async(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step4CpAsync>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step4CpAsync, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s4_cp_async(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s4_cp_async_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                            double scale) {
  using course_flash::launch_flash_mma_s4_cp_async;
  return course_flash::mma_forward("flash_mma_s4_cp_async", launch_flash_mma_s4_cp_async, q, k, v, causal, scale);
}
#endif
