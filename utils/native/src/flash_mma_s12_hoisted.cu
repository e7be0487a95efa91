// Step 12 of 15: every address worked out once (copy_rows, LaneOffsets), on step 11.
// The kernel is flash_mma_kernel.cuh; this file compiles Step12Hoisted (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s12_hoisted_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s12_hoisted(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step12Hoisted>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step12Hoisted, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s12_hoisted(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s12_hoisted_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                               double scale) {
  using course_flash::launch_flash_mma_s12_hoisted;
  return course_flash::mma_forward("flash_mma_s12_hoisted", launch_flash_mma_s12_hoisted, q, k, v, causal, scale);
}
#endif
