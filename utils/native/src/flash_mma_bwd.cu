// The tensor-core kernels with a backward pass (worklog notebook 06bw, section 6): the forward of the registry's "cuda" step,
// which also writes the log-sum-exp, and the backward kernels of flash_mma_bwd_kernel.cuh, one launcher per step of
// its worklog (utils.native.backward.BWD_STEPS). Bound to Python as flash_mma_bwd_forward and flash_mma_bwd_backward
// (utils/native/backward.py).
#ifndef COURSE_TORCH_WRAPPER  // the kernels: nvcc, no torch header
#if !defined(COURSE_PART) || COURSE_PART == 4  // its launchers are not inline: one part defines them
#include "flash_bwd_passes.cuh"  // the prepare and finish passes (step 14)
#endif
#include "flash_mma_bwd_kernel.cuh"

namespace course_flash {
// The forward step whose output the backward differentiates: utils.native.build.MMA_DEFAULT_STEP (a test holds them equal).
using BwdForwardStep = Step15WholeTiles;

// The extension builds this file in five parts at once (utils/native/build.py, BUILD_PARTS), since one nvcc run
// over every step takes minutes: parts 1-4 each instantiate the launchers of some steps (the lists below), and
// part 0 holds the two launchers that choose one, which only declare them. Compiled whole (no COURSE_PART), the
// launchers instantiate every step.
#define COURSE_PART_1(X) X(BwdAtomicDQ) X(BwdDQPass) X(BwdNarrowRows) X(BwdTwoBlocks) X(BwdPerHeadDim) X(BwdUnrollTwo)
#define COURSE_PART_2(X) X(BwdMaskAfter) X(BwdWarpTiles) X(BwdHoisted) X(BwdWideQueries) X(BwdStoreMatrix)
#define COURSE_PART_3(X) X(BwdPairDQ) X(BwdDQBetween) X(BwdPrepare) X(BwdPaddedDQ)
#define COURSE_PART_4(X) X(BwdLseByThread) X(BwdPairsBetween) X(BwdSplitKV) X(BwdStagger)
using LaunchBwd = cudaError_t(const BwdParams&, DType, cudaStream_t);
using LaunchFwd = cudaError_t(const Params&, DType, cudaStream_t);
#define COURSE_INSTANTIATE(S) template LaunchBwd launch_flash_mma_bwd<S>;
#define COURSE_DECLARE(S) extern template LaunchBwd launch_flash_mma_bwd<S>;
#if COURSE_PART == 1
COURSE_PART_1(COURSE_INSTANTIATE)
#elif COURSE_PART == 2
COURSE_PART_2(COURSE_INSTANTIATE)
#elif COURSE_PART == 3
COURSE_PART_3(COURSE_INSTANTIATE)
#elif COURSE_PART == 4
COURSE_PART_4(COURSE_INSTANTIATE)
template LaunchFwd launch_flash_mma<BwdForwardStep>;
#else
#ifdef COURSE_PART
COURSE_PART_1(COURSE_DECLARE) COURSE_PART_2(COURSE_DECLARE) COURSE_PART_3(COURSE_DECLARE) COURSE_PART_4(COURSE_DECLARE)
extern template LaunchFwd launch_flash_mma<BwdForwardStep>;
#endif

cudaError_t launch_flash_mma_bwd_forward(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_flash_mma<BwdForwardStep>(p, dtype, stream);
}

cudaError_t launch_flash_mma_bwd_backward(const BwdParams& bp, DType dtype, int step, cudaStream_t stream) {
  switch (step) {
    case 1: return launch_flash_mma_bwd<BwdAtomicDQ>(bp, dtype, stream);
    case 2: return launch_flash_mma_bwd<BwdDQPass>(bp, dtype, stream);
    case 3: return launch_flash_mma_bwd<BwdNarrowRows>(bp, dtype, stream);
    case 4: return launch_flash_mma_bwd<BwdTwoBlocks>(bp, dtype, stream);
    case 5: return launch_flash_mma_bwd<BwdPerHeadDim>(bp, dtype, stream);
    case 6: return launch_flash_mma_bwd<BwdUnrollTwo>(bp, dtype, stream);
    case 7: return launch_flash_mma_bwd<BwdMaskAfter>(bp, dtype, stream);
    case 8: return launch_flash_mma_bwd<BwdWarpTiles>(bp, dtype, stream);
    case 9: return launch_flash_mma_bwd<BwdHoisted>(bp, dtype, stream);
    case 10: return launch_flash_mma_bwd<BwdWideQueries>(bp, dtype, stream);
    case 11: return launch_flash_mma_bwd<BwdStoreMatrix>(bp, dtype, stream);
    case 12: return launch_flash_mma_bwd<BwdPairDQ>(bp, dtype, stream);
    case 13: return launch_flash_mma_bwd<BwdDQBetween>(bp, dtype, stream);
    case 14: return launch_flash_mma_bwd<BwdPrepare>(bp, dtype, stream);
    case 15: return launch_flash_mma_bwd<BwdPaddedDQ>(bp, dtype, stream);
    case 16: return launch_flash_mma_bwd<BwdLseByThread>(bp, dtype, stream);
    case 17: return launch_flash_mma_bwd<BwdPairsBetween>(bp, dtype, stream);
    case 18: return launch_flash_mma_bwd<BwdSplitKV>(bp, dtype, stream);
    case 19: return launch_flash_mma_bwd<BwdStagger>(bp, dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

#endif  // COURSE_PART
}  // namespace course_flash

#else  // COURSE_TORCH_WRAPPER: the torch wrappers, host C++ (load_inline cpp_sources)
#include "flash_bwd_host.h"  // bwd_prepare, bwd_finish
#include "flash_mma_torch.h"

namespace course_flash {
cudaError_t launch_flash_mma_bwd_forward(const Params& p, DType dtype, cudaStream_t stream);
cudaError_t launch_flash_mma_bwd_backward(const BwdParams& bp, DType dtype, int step, cudaStream_t stream);
}  // namespace course_flash

// (o, lse): the forward of the "cuda" step, and the natural-log log-sum-exp of every query row (-inf: no key).
std::vector<torch::Tensor> flash_mma_bwd_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                                 double scale) {
  using namespace course_flash;
  torch::Tensor lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
  const auto launcher = [&](Params p, DType dtype, cudaStream_t stream) {
    p.lse = lse.data_ptr<float>();
    return launch_flash_mma_bwd_forward(p, dtype, stream);
  };
  torch::Tensor o = mma_forward("flash_mma_bwd_forward", launcher, q, k, v, causal, scale);
  return {o, lse};
}

// (dq, dk, dv) from dO, the inputs, lse2 = lse * log2(e) (+inf for rows with no key) and delta = rowsum(dO * O),
// both fp32 (batch * heads, padded_q) with padded_q a multiple of 128 (+inf and 0 in the padding). step 1: dq is
// fp32 and unscaled (the atomics' accumulator); step 2: dq in the input dtype. dk, dv: per K/V head.
std::vector<torch::Tensor> flash_mma_bwd_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k,
                                                  torch::Tensor v, torch::Tensor lse2, torch::Tensor delta,
                                                  bool causal, double scale, int64_t step) {
  using namespace course_flash;
  const char* name = "flash_mma_bwd_backward";
  TORCH_CHECK(step >= 1 && step <= 19, name, ": step must be 1 to 19 (utils.native.backward.BWD_STEPS), got ",
              course::num(step));
  check_mma_inputs(name, q, k, v, &dout);
  const int64_t rows = q.size(0) * q.size(1), padded = (q.size(2) + kLsePad - 1) / kLsePad * kLsePad;
  for (const torch::Tensor* t : {&lse2, &delta})
    TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == torch::kFloat32 &&
                t->is_contiguous() && t->dim() == 2 && t->size(0) == rows && t->size(1) == padded, name,
                ": lse2 and delta must be contiguous fp32 (batch * heads, ", course::num(padded), ") on q's device, "
                "got ", course::shape(t->sizes()));
  const c10::cuda::CUDAGuard guard(q.device());
  BwdParams bp{};
  bp.fwd = make_params(name, q, k, v, q, causal, scale);
  bp.dout = dout.data_ptr();
  for (int dim = 0; dim < 3; ++dim) bp.do_stride[dim] = dout.stride(dim);
  bp.lse2 = lse2.data_ptr<float>();
  bp.delta = delta.data_ptr<float>();
  bp.padded_q = static_cast<int>(padded);
  const auto contiguous = q.options().memory_format(at::MemoryFormat::Contiguous);
  const bool atomic = step != 2;  // every step but 2 adds dQ up with atomics
  // step 15's accumulator has its rows padded as lse2's (the atomics need no row test)
  const auto fp32 = contiguous.dtype(torch::kFloat32);
  torch::Tensor dq = !atomic ? torch::empty(q.sizes(), contiguous)
                     : step == 15 ? torch::zeros({q.size(0), q.size(1), padded, q.size(3)}, fp32)
                                  : torch::zeros(q.sizes(), fp32);
  torch::Tensor dk = torch::empty(k.sizes(), contiguous), dv = torch::empty(v.sizes(), contiguous);
  if (atomic) bp.dq_accum = dq.data_ptr<float>();
  else bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  const cudaError_t err = launch_flash_mma_bwd_backward(bp, dtype_of(q), static_cast<int>(step),
                                                        c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv};
}

// (lse2, delta) for flash_mma_bwd_backward from dO, the forward's O and its lse (batch, heads, seqlen_q), in one
// pass on the GPU (from step 14; utils.native.backward.backward_inputs computes the same in torch).
std::vector<torch::Tensor> flash_mma_bwd_prepare(torch::Tensor dout, torch::Tensor o, torch::Tensor lse) {
  const char* name = "flash_mma_bwd_prepare";
  course_flash::check_mma_inputs(name, o, o, o, &dout);
  return course_flash::bwd_prepare(name, dout, o, lse);
}

// dQ in q's dtype and shape: scale times the fp32 accumulator of flash_mma_bwd_backward, whose rows a head are
// seqlen_q or (from step 15) padded as lse2's.
torch::Tensor flash_mma_bwd_finish(torch::Tensor accum, torch::Tensor q, double scale) {
  const char* name = "flash_mma_bwd_finish";
  TORCH_CHECK(q.is_cuda() && (q.scalar_type() == torch::kFloat16 || q.scalar_type() == torch::kBFloat16) &&
              q.dim() == 4 && (q.size(3) == 64 || q.size(3) == 128), name,
              ": q must be a CUDA fp16/bf16 (batch, heads, seqlen_q, 64 or 128) tensor, got ",
              course::shape(q.sizes()));
  return course_flash::bwd_finish(name, accum, q, scale);
}
#endif
