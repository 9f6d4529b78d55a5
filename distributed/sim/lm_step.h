// sim/lm_step.h: the language model's training step on R GPUs (moe_train_distributed: attention and
// dense parameters data-parallel, every MoE block expert-parallel), predicted from its step on one
// GPU. One GPU's step holds every cost but the network. Where the calibration also holds the
// expert-parallel layer at the model's MoE shape on one GPU, every MoE block becomes that layer's
// step on the cluster (layer_step.h):
//
//   step(R) = step(1) - its MoE blocks (forward and backward) - its optimizer
//           + per MoE block: the expert-parallel layer's step on R GPUs, its SGD left out
//           + the optimizer on this rank's parameters (the experts split R ways, the rest whole)
//           + the all-reduce of the data-parallel gradients (ring: 2 (R - 1) / R of their bytes)
//             that the backward does not hide: the trainer sums each block's as soon as its
//             backward has run, so only the embeddings' and the final norm's, and any time the
//             blocks' sums take beyond the one-GPU backward's, are added
//
// On one GPU (R = 1) the trainer runs the one-GPU MoE layer, not the expert-parallel one: the
// prediction is the measured step itself.
//
// Without that layer, the one-GPU run's MoE path stays and only its local exchanges and count
// exchanges are swapped for the cluster's (four all-to-alls of T K rows and a count exchange a
// block). The routing matters: a benchmark of a model fresh from initialisation routes far from
// uniformly (the busiest GPU gets several times the mean rows), so each block's load comes from a
// recorded run of the same model when one is given. The blocks run one after another, and no
// token exchange hides behind compute, as the trainer runs today.
// Tests: ctest -R SimLanguageModel.
#pragma once

#include <cstdint>
#include <string>

#include "sim/calibration.h"  // Calibration, LanguageModelStep
#include "sim/cluster.h"      // Cluster
#include "sim/routing_trace.h"  // RoutingTrace

namespace moe::sim {

struct LanguageModelPrediction {
  double step_ms = 0;
  double moe_ms = 0;         // the MoE blocks on the cluster (or their exchanges alone, see above)
  double all_reduce_ms = 0;  // the data-parallel gradients
  double optimizer_ms = 0;
};

// Throws std::invalid_argument when the calibration holds no language model step. `routing`: the
// model's own routing, one block's loads per MoE block from the trace's first step (a run record
// of the same model); without it, uniform routing.
// overlap: the step with two micro-batches overlapped (moe_train_distributed --overlap on); needs the
// calibration's overlapped one-GPU step and its layer at the model's shape, else std::invalid_argument.
LanguageModelPrediction predict_language_model_step(const Calibration& calibration, const Cluster& cluster,
                                                    const RoutingTrace* routing = nullptr, bool overlap = false);

}  // namespace moe::sim
