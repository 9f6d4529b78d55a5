// sim/lm_step.h: the language model's training step on R GPUs (moe_train_distributed: attention and
// dense parameters data-parallel, every MoE block expert-parallel), predicted from its step on one
// GPU. One GPU's step holds every cost but the network. Where the calibration also holds the
// expert-parallel layer at the model's MoE shape on one GPU, the step is issued on the timeline in
// the trainer's order (cuda/model/model.h):
//
//   forward:  embedding | per block: its other work (attention, norms: the one-GPU phases / blocks),
//             then the MoE block as the layer's forward on the cluster | LM head and loss
//   backward: in reverse, per block: the layer's backward, the block's other backward work; then the
//             block's data-parallel gradients summed (ring: 2 (R - 1) / R of their fp32 bytes) on a
//             gradient stream, beside the next block's backward
//   then:     the embeddings' sum, the optimizer on this rank's parameters (the experts split R
//             ways, the rest whole), and the one-GPU step's time no phase names
//
// With overlap (two micro-batches, --overlap on) each half of the batch is a lane on a compute
// stream of its own (timeline.h: the two share the GPU), in the trainer's interleaving; a lane's
// work outside the MoE layers is half the one-GPU work times what halving cost on one GPU (the
// calibration's overlapped one-GPU step over the plain one). The layer's own two micro-batches
// (layer_step.h) are the lanes' MoE blocks.
//
// On one GPU (R = 1) the trainer runs the one-GPU MoE layer, not the expert-parallel one: the
// prediction is the measured step itself (plain or overlapped).
//
// Without that layer, the one-GPU run's MoE path stays and only its local exchanges and count
// exchanges are swapped for the cluster's (four all-to-alls of T K rows and a count exchange a
// block), the blocks one after another; the overlapped step is not predicted then. The routing
// matters: a benchmark of a model fresh from initialisation routes far from uniformly (the busiest
// GPU gets several times the mean rows), so each block's load comes from a recorded run of the
// same model when one is given.
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
  double moe_ms = 0;         // the MoE blocks' layer steps alone on the cluster (or their exchanges alone, see above)
  double all_reduce_ms = 0;  // the data-parallel gradients' sums the backward does not hide
  double optimizer_ms = 0;
};

struct LanguageModelOptions {
  // The model's own routing, one block's loads per MoE block from the trace's first step (a run
  // record of the same model); nullptr: uniform routing.
  const RoutingTrace* routing = nullptr;
  // The step with two micro-batches overlapped (moe_train_distributed --overlap on); needs the
  // calibration's overlapped one-GPU step and its layer at the model's shape.
  bool overlap = false;
  // 0: the model's E. Else the same model with E experts a block (a multiple of the ranks): weak
  // scaling past E GPUs, each GPU keeping E / R experts of the same rows.
  int64_t experts = 0;
};

// Throws std::invalid_argument when the calibration holds no language model step, or not what the
// options need.
LanguageModelPrediction predict_language_model_step(const Calibration& calibration, const Cluster& cluster,
                                                    const LanguageModelOptions& options = {});

}  // namespace moe::sim
