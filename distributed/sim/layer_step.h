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
// Each micro-batch computes on its own stream (kCompute, kCompute2), as the layer's two lanes do;
// the two share the GPU (timeline.h), so one's work fills the other's waits. Each micro-batch's
// experts are a launch of their own, so the launch's fixed cost (cost_model.h's B) is paid once
// more: at small experts it can outweigh the exchange hidden.
//
// Tests: ctest -R SimLayerStep.
#pragma once

#include <vector>

#include "sim/cost_model.h"  // CostModel
#include "sim/step_load.h"   // StepLoad
#include "sim/timeline.h"    // Timeline

namespace moe::sim {

// Issues one MoE block's step of `load` on every rank of `timeline`: forward(), backward(), update({}).
void issue_layer_step(Timeline& timeline, const CostModel& model, const StepLoad& load);

struct LayerMicroBatch;  // layer_step.cpp

struct LayerUpdate {
  bool router_all_reduce = true;  // false in a model that sums the router's gradients with its others
  bool sgd = true;                // false in a model whose optimizer updates the experts
  int stream = kCompute;          // a model sums its gradients on a stream of their own
};

// The same step in the three parts a model's step puts its other work between (lm_step.h): the
// forward, the backward, the update. One micro-batch, or two with the layer's overlap, micro-batch
// i on compute stream i (kCompute, kCompute2). `before[i]`: what micro-batch i waits for first
// (empty: nothing). forward() and backward() return each micro-batch's last operation.
class LayerStepOps {
 public:
  LayerStepOps(Timeline& timeline, const CostModel& model, const StepLoad& load);
  ~LayerStepOps();
  // Routing and count exchange of each micro-batch; the host's wait for each one's counts and its
  // permute; the pipelined exchanges and experts; the combine.
  std::vector<Op> forward(const std::vector<Op>& before = {});
  // The combine's backward, the pipelined gradients, the router's backward.
  std::vector<Op> backward(const std::vector<Op>& before = {});
  // The expert gradients made whole (what.router_all_reduce: the router's summed over the ranks, as
  // the layer alone does; the replicas' summed; layouts' returned; the second micro-batch's added),
  // then the experts' SGD when what.sgd, all on what.stream; the layer's time no phase names on the
  // compute stream. Returns the gradients' last operation.
  Op update(const LayerUpdate& what);

 private:
  Timeline& timeline_;
  const CostModel& model_;
  const StepLoad& load_;
  std::vector<LayerMicroBatch> batches_;
};

}  // namespace moe::sim
