// Step 10 of 15: step 9 with one cp.async group for K and V again (step 8 undone).
// The kernel is flash_mma_kernel.cuh; this file compiles Step10OneGroup (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s10_one_group_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s10_one_group(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step10OneGroup>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step10OneGroup, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s10_one_group(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s10_one_group_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                               double scale) {
  using course_flash::launch_flash_mma_s10_one_group;
  return course_flash::mma_forward("flash_mma_s10_one_group", launch_flash_mma_s10_one_group, q, k, v, causal, scale);
}
#endif
