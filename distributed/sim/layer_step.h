// sim/layer_step.h: the expert-parallel layer's training step (forward, backward, the experts' SGD)
// as the timeline's operations, in the order distributed/ep/expert_parallel_gpu.cpp issues them:
//
//   compute:  route | count exchange (all ranks) | permute | experts c=0 | experts c=1 | ... | combine
//   exchange:                                      out 0 | out 1 | back 0 | out 2 | back 1 | ...
//             then the backward: combine's backward, the same pipeline with the gradients (experts
//             at 2 x the forward's FLOPs), the router's backward, its all-reduce, SGD.
//
// Tutel's pipelining degree d splits every exchange and expert launch into d chunks; chunk c + 1
// goes out before chunk c comes back, so its exchange runs while chunk c's experts do.
//
// With overlap on, each rank's tokens are split into two micro-batches, and the schedule interleaves
// them so that one's exchanges run while the other computes (DeepSeek-V3's two-micro-batch overlap):
//
//   compute:  pre A | pre B | experts A | experts B | post A + pre-backward A | ... B | experts' A | ...
//   exchange:        out A  | out B     | back A    | back B ...
//
// Each micro-batch's experts are a launch of their own, so the launch's fixed cost (cost_model.h's
// B) is paid once more: at small experts it can outweigh the exchange hidden.
//
// Tests: ctest -R SimLayerStep.
#pragma once

#include "sim/cost_model.h"  // CostModel
#include "sim/step_load.h"   // StepLoad
#include "sim/timeline.h"    // Timeline

namespace moe::sim {

// Issues one MoE block's step of `load` on every rank of `timeline`.
void issue_layer_step(Timeline& timeline, const CostModel& model, const StepLoad& load);

}  // namespace moe::sim
