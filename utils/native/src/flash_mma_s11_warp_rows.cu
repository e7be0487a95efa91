// Step 11 of 15: two m16 tiles of query rows per warp (32 rows), on step 7.
// The kernel is flash_mma_kernel.cuh; this file compiles Step11WarpRows (flash_mma_steps.cuh) for fp16 and bf16
// at D = 64 and 128, and binds it to Python as flash_mma_s11_warp_rows_forward (notebook 06b).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#include "flash_mma_kernel.cuh"

namespace course_flash {
cudaError_t launch_flash_mma_s11_warp_rows(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<Step11WarpRows>(p, dtype, stream);
}
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrapper of Step11WarpRows, host C++ (load_inline cpp_sources)
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_s11_warp_rows(const Params& p, DType dtype, cudaStream_t stream);
}

torch::Tensor flash_mma_s11_warp_rows_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                               double scale) {
  using course_flash::launch_flash_mma_s11_warp_rows;
  return course_flash::mma_forward("flash_mma_s11_warp_rows", launch_flash_mma_s11_warp_rows, q, k, v, causal, scale);
}
#endif
