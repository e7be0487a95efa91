// Step N of notebook 06c's steps table (hopper_attention_steps.cuh) as a type: `with_step(step, f)` calls
// f(StepTag<HopperStepN...>{}), so that the launcher and the torch wrapper read one table. Plain C++ that the host
// compiler reads too: the wrapper takes its tensor maps' boxes and the grid's layout from the step's members.
#pragma once
#include "hopper_layout.h"  // __host__ and __device__ for a host compiler
#include "hopper_attention_steps.cuh"

namespace course_hopper {

constexpr int kHopperSteps = 37;  // utils.native.hopper.ATTENTION_STEPS has as many

template <typename Step> struct StepTag { using type = Step; };

// Step `step` (1 to kHopperSteps; the caller has checked it) given to `f` as StepTag<its struct>.
template <typename F>
decltype(auto) with_step(int step, F&& f) {
  switch (step) {
    case 1: return f(StepTag<HopperStep1Tma>{});
    case 2: return f(StepTag<HopperStep2Pipelined>{});
    case 3: return f(StepTag<HopperStep3Specialised>{});
    case 4: return f(StepTag<HopperStep4Softmax>{});
    case 5: return f(StepTag<HopperStep5Stages>{});
    case 6: return f(StepTag<HopperStep6Overlap>{});
    case 7: return f(StepTag<HopperStep7Pingpong>{});
    case 8: return f(StepTag<HopperStep8HeavyFirst>{});
    case 9: return f(StepTag<HopperStep9WideTiles>{});
    case 10: return f(StepTag<HopperStep10VDirect>{});
    case 11: return f(StepTag<HopperStep11ThreeConsumers>{});
    case 12: return f(StepTag<HopperStep12Persistent>{});
    case 13: return f(StepTag<HopperStep13HeadGroups>{});
    case 14: return f(StepTag<HopperStep14OwnDiagonal>{});
    case 15: return f(StepTag<HopperStep15TmaStore>{});
    case 16: return f(StepTag<HopperStep16WideVDirect>{});
    case 17: return f(StepTag<HopperStep17SplitFull>{});
    case 18: return f(StepTag<HopperStep18WideTmaStore>{});
    case 19: return f(StepTag<HopperStep19WideStages>{});
    case 20: return f(StepTag<HopperStep20TmaHeavyFirst>{});
    case 21: return f(StepTag<HopperStep21OneP>{});
    case 22: return f(StepTag<HopperStep22OnePTurns>{});
    case 23: return f(StepTag<HopperStep23OnePDiagonal>{});
    case 24: return f(StepTag<HopperStep24OnePHeavyFirst>{});
    case 25: return f(StepTag<HopperStep25OnePPersistent>{});
    case 26: return f(StepTag<HopperStep26OnePHeadGroups>{});
    case 27: return f(StepTag<HopperStep27OnePUniform>{});
    case 28: return f(StepTag<HopperStep28WideUniform>{});
    case 29: return f(StepTag<HopperStep29OnePLazy>{});
    case 30: return f(StepTag<HopperStep30WideLazy>{});
    case 31: return f(StepTag<HopperStep31OnePTree>{});
    case 32: return f(StepTag<HopperStep32WideTree>{});
    case 33: return f(StepTag<HopperStep33OnePDesc>{});
    case 34: return f(StepTag<HopperStep34WideDesc>{});
    case 35: return f(StepTag<HopperStep35DescDiagonal>{});
    case 36: return f(StepTag<HopperStep36DescHeavyFirst>{});
    default: return f(StepTag<HopperStep37WaitSuspend>{});
  }
}

}  // namespace course_hopper
