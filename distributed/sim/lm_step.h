// sim/lm_step.h: the language model's training step on R GPUs (moe_train_distributed: attention and
// dense parameters data-parallel, every MoE block expert-parallel), predicted from its step on one
// GPU. One GPU's step holds every cost but the network; the prediction swaps its local exchanges
// for the cluster's:
//
//   step(R) = step(1) - the local exchanges and count exchanges of its MoE blocks - its optimizer
//           + per MoE block: the count exchange, and four all-to-alls (dispatch and combine forward,
//             their gradients backward) of T K rows a rank at the cluster's cost (cost_model.h)
//           + the optimizer on this rank's parameters (the experts split R ways, the rest whole)
//           + the all-reduce of the data-parallel gradients (ring: 2 (R - 1) / R of their bytes)
//
// Uniform routing (the benchmark's router is near-uniform); the blocks run one after another, and no
// exchange hides behind compute (as the trainer runs today). Tests: ctest -R SimLanguageModel.
#pragma once

#include <cstdint>
#include <string>

#include "sim/calibration.h"  // Calibration, LanguageModelStep
#include "sim/cluster.h"      // Cluster

namespace moe::sim {

struct LanguageModelPrediction {
  double step_ms = 0;
  double exchanges_ms = 0;   // the MoE blocks' count exchanges and all-to-alls
  double all_reduce_ms = 0;  // the data-parallel gradients
  double optimizer_ms = 0;
};

// Throws std::invalid_argument when the calibration holds no language model step.
LanguageModelPrediction predict_language_model_step(const Calibration& calibration, const Cluster& cluster);

}  // namespace moe::sim
