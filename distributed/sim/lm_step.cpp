// sim/lm_step.cpp: the language model's step on R GPUs from its step on one (lm_step.h).
#include "sim/lm_step.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "config_json.h"       // model_config_to_json, model_config_from_json
#include "model_config.h"      // ModelConfig, is_moe_block
#include "parameter_layout.h"  // parameter_layout
#include "sim/cost_model.h"    // CostModel
#include "sim/layer_step.h"    // issue_layer_step
#include "sim/step_load.h"     // step_load_from_shares
#include "sim/timeline.h"      // Timeline

namespace moe::sim {

namespace {

// The model a training benchmark's settings describe: its model keys read by the one model-config
// reader (common/config_json.h), the training keys beside them left out, defaults where a key is absent.
ModelConfig model_of(const nlohmann::json& config) {
  nlohmann::json model = model_config_to_json(ModelConfig{});
  for (auto& [key, value] : model.items()) {
    if (config.contains(key)) value = config[key];
  }
  return model_config_from_json(model);
}

bool is_local_exchange(const std::string& phase) {
  for (const char* name : {"ep_dispatch", "ep_combine_exchange", "ep_count_exchange", "gradient_all_reduce"}) {
    if (phase.find(name) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

LanguageModelPrediction predict_language_model_step(const Calibration& calibration, const Cluster& cluster,
                                                    const RoutingTrace* routing) {
  const LanguageModelStep& one = calibration.language_model;
  if (!one.measured()) throw std::invalid_argument("the calibration holds no language model step (calibrate from moe_train_distributed --benchmark-json at one rank)");
  const ModelConfig model = model_of(one.config);
  const int64_t R = cluster.ranks();
  LanguageModelPrediction out;
  if (R == 1) {  // one GPU trains through the one-GPU MoE layer: the measured step itself
    for (const auto& [phase, ms] : one.phase_ms) {
      if (phase == "optimizer") out.optimizer_ms = ms;
      if (phase == "moe" || phase == "backward_moe") out.moe_ms += ms;
    }
    out.step_ms = one.step_ms;
    return out;
  }
  int64_t moe_blocks = 0;
  for (int64_t layer = 0; layer < model.num_layers; ++layer) moe_blocks += is_moe_block(model, layer) ? 1 : 0;
  double expert_parameters = 0, other_parameters = 0, outside_blocks = 0;  // outside_blocks: embeddings, final norm
  for (const ParameterInfo& p : parameter_layout(model)) {
    const double count = static_cast<double>(p.rows * p.cols);
    (p.expert >= 0 ? expert_parameters : other_parameters) += count;
    if (p.block < 0) outside_blocks += count;
  }

  const LayerSpec layer = layer_spec_of(moe_layer_config(model, one.tokens_per_rank / model.seq_len));
  // Each MoE block's load: the recorded routing's first step, block by block, or uniform.
  const double rows_per_rank = static_cast<double>(layer.tokens_per_rank * layer.top_k);
  std::vector<StepLoad> loads;
  for (int64_t b = 0; b < moe_blocks; ++b) {
    std::vector<double> shares(static_cast<size_t>(layer.experts), 1.0 / static_cast<double>(layer.experts));
    if (routing != nullptr && !routing->loads.empty()) {
      const int64_t first = routing->loads.front().step;
      for (const BlockLoad& block : routing->loads) {
        if (block.step == first && block.layer == b) shares = stretch_shares(block.shares(), layer.experts);
      }
    }
    loads.push_back(step_load_from_shares(shares, R, rows_per_rank));
  }
  double optimizer_one = 0, moe_one = 0, local = 0;
  for (const auto& [phase, ms] : one.phase_ms) {
    if (phase == "optimizer") optimizer_one = ms;
    if (phase == "moe" || phase == "backward_moe") moe_one += ms;
    if (is_local_exchange(phase)) local += ms;
  }
  double rest = 0;
  if (one.layer.measured()) {
    // The expert-parallel layer at the model's shape, measured on one GPU: each MoE block is that
    // layer's step on the cluster (its SGD left to the model's optimizer) in place of the one-GPU
    // run's MoE path.
    const Calibration at_layer = calibration.at_language_model_layer();
    const CostModel cost(at_layer, cluster, layer);
    Timeline timeline(R);
    for (const StepLoad& load : loads) {
      issue_layer_step(timeline, cost, load);
      out.moe_ms += (timeline.finish_step() - cost.sgd_us()) / 1e3;
    }
    rest = one.step_ms - moe_one - optimizer_one;
  } else {
    // Without it: the one-GPU run's MoE path stays, its local exchanges swapped for the cluster's.
    const CostModel cost(calibration, cluster, layer);
    for (const StepLoad& load : loads) {
      out.moe_ms += (cost.count_exchange_us() + 2 * (cost.all_to_all_us(load, 1.0, false) + cost.all_to_all_us(load, 1.0, true))) / 1e3;
    }
    rest = one.step_ms - local - optimizer_one;
  }
  out.optimizer_ms = optimizer_one * (other_parameters + expert_parameters / static_cast<double>(R)) / (other_parameters + expert_parameters);
  if (R > 1) {
    // The trainer sums the data-parallel gradients under the backward, block by block (model.h):
    // what it cannot hide is the last bucket (the embeddings and the final norm, summed after the
    // embedding backward) and whatever the blocks' sums take beyond the one-GPU backward's time.
    const CostModel cost(calibration, cluster, layer);
    const int64_t G = std::min(cluster.gpus_per_node, R);
    auto all_reduce_ms = [&](double parameters) {
      const double bytes = 2.0 * static_cast<double>(R - 1) / static_cast<double>(R) * parameters * 4;  // fp32 gradients
      return std::max(cost.intra_node_us(bytes, G - 1), cost.inter_node_us(cluster.nodes > 1 ? bytes : 0, cluster.nodes - 1)) / 1e3;
    };
    double backward_ms = 0;
    for (const auto& [phase, ms] : one.phase_ms) {
      if (phase.rfind("backward_", 0) == 0) backward_ms += ms;
    }
    out.all_reduce_ms = all_reduce_ms(outside_blocks) + std::max(0.0, all_reduce_ms(other_parameters - outside_blocks) - backward_ms);
  }
  out.step_ms = rest + out.moe_ms + out.optimizer_ms + out.all_reduce_ms;
  return out;
}

}  // namespace moe::sim
