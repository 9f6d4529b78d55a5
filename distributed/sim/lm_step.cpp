// sim/lm_step.cpp: the language model's step on R GPUs from its step on one (lm_step.h).
#include "sim/lm_step.h"

#include <algorithm>
#include <memory>
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

namespace {

// The one-GPU step's phases outside the MoE layers and the optimizer, by where the step runs them:
// the embedding first, the LM head and the loss after the blocks (forward), their backward in
// reverse; every other phase a block's (attention, layer norms), split evenly over the blocks.
struct OtherWork {
  double head_forward_ms = 0, tail_forward_ms = 0, block_forward_ms = 0;   // embedding; lm_head + loss; all blocks'
  double head_backward_ms = 0, tail_backward_ms = 0, block_backward_ms = 0;  // lm_head's; embedding's; all blocks'
  double unphased_ms = 0;  // the step's time no phase names
};

OtherWork other_work(const LanguageModelStep& one) {
  OtherWork w;
  double named = 0;
  for (const auto& [phase, ms] : one.phase_ms) {
    if (phase.find('/') != std::string::npos) continue;  // nested: inside its parent's time
    named += ms;
    if (phase == "moe" || phase == "backward_moe" || phase == "optimizer") continue;
    if (phase == "embedding") w.head_forward_ms += ms;
    else if (phase == "lm_head" || phase == "loss") w.tail_forward_ms += ms;
    else if (phase == "backward_lm_head") w.head_backward_ms += ms;
    else if (phase == "backward_embedding") w.tail_backward_ms += ms;
    else if (phase.rfind("backward_", 0) == 0) w.block_backward_ms += ms;
    else w.block_forward_ms += ms;
  }
  w.unphased_ms = std::max(0.0, one.step_ms - named);
  return w;
}

}  // namespace

LanguageModelPrediction predict_language_model_step(const Calibration& calibration, const Cluster& cluster,
                                                    const LanguageModelOptions& options) {
  const RoutingTrace* routing = options.routing;
  const bool overlap = options.overlap;
  const LanguageModelStep& one = calibration.language_model;
  if (!one.measured()) throw std::invalid_argument("the calibration holds no language model step (calibrate from moe_train_distributed --benchmark-json at one rank)");
  if (overlap && !(one.overlapped_step_ms > 0)) {
    throw std::invalid_argument("the calibration holds no overlapped language model step on one GPU (calibrate from moe_train_distributed "
                                "--overlap on --benchmark-json at one rank)");
  }
  ModelConfig model = model_of(one.config);
  const int64_t R = cluster.ranks();
  if (options.experts != 0) {
    if (options.experts < 1 || options.experts % R != 0) {
      throw std::invalid_argument("the language model's experts: a multiple of the ranks (" + std::to_string(R) + "), got " +
                                  std::to_string(options.experts));
    }
    model.num_experts = options.experts;
  }
  LanguageModelPrediction out;
  if (R == 1) {  // one GPU trains through the one-GPU MoE layer: the measured step itself
    for (const auto& [phase, ms] : one.phase_ms) {
      if (phase == "optimizer") out.optimizer_ms = ms;
      if (phase == "moe" || phase == "backward_moe") out.moe_ms += ms;
    }
    out.step_ms = overlap ? one.overlapped_step_ms : one.step_ms;
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

  LayerSpec layer = layer_spec_of(moe_layer_config(model, one.tokens_per_rank / model.seq_len));
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
  double optimizer_one = 0, local = 0;
  for (const auto& [phase, ms] : one.phase_ms) {
    if (phase == "optimizer") optimizer_one = ms;
    if (is_local_exchange(phase)) local += ms;
  }
  // The optimizer is bound by the parameters it updates: this rank's, against all of the measured
  // model's (the same model, or the one whose experts options.experts replaced).
  double measured_experts = 0;
  for (const ParameterInfo& p : parameter_layout(model_of(one.config))) {
    if (p.expert >= 0) measured_experts += static_cast<double>(p.rows * p.cols);
  }
  out.optimizer_ms = optimizer_one * (other_parameters + expert_parameters / static_cast<double>(R)) / (other_parameters + measured_experts);
  const CostModel network(calibration, cluster, layer);
  const int64_t G = std::min(cluster.gpus_per_node, R);
  auto all_reduce_us = [&](double parameters) {  // ring: 2 (R - 1) / R of the fp32 gradients' bytes
    const double bytes = 2.0 * static_cast<double>(R - 1) / static_cast<double>(R) * parameters * 4;
    return std::max(network.intra_node_us(bytes, G - 1), network.inter_node_us(cluster.nodes > 1 ? bytes : 0, cluster.nodes - 1));
  };

  if (!one.layer.measured()) {
    if (overlap) throw std::invalid_argument("predicting the overlapped step needs the expert-parallel layer at the model's shape in the calibration");
    // Without it: the one-GPU run's MoE path stays, its local exchanges swapped for the cluster's,
    // and the data-parallel gradients' sums hidden under the backward as far as it lasts.
    for (const StepLoad& load : loads) {
      out.moe_ms += (network.count_exchange_us() + 2 * (network.all_to_all_us(load, 1.0, false) + network.all_to_all_us(load, 1.0, true))) / 1e3;
    }
    double backward_ms = 0;
    for (const auto& [phase, ms] : one.phase_ms) {
      if (phase.rfind("backward_", 0) == 0) backward_ms += ms;
    }
    out.all_reduce_ms = all_reduce_us(outside_blocks) / 1e3 + std::max(0.0, all_reduce_us(other_parameters - outside_blocks) / 1e3 - backward_ms);
    out.step_ms = one.step_ms - local - optimizer_one + out.moe_ms + out.optimizer_ms + out.all_reduce_ms;
    return out;
  }

  // The step as the trainer issues it (model.h), on the timeline: each block's attention, then its
  // MoE block as the expert-parallel layer at the model's shape (measured on one GPU; its SGD left to
  // the model's optimizer); the backward in reverse, each block's data-parallel gradients summed on
  // the gradient stream as soon as its backward has run; the optimizer after the last sum. With
  // overlap, each half of the batch is a lane on its own compute stream: its work takes half the
  // one-GPU step's, times what halving cost on one GPU (the overlapped one-GPU step over the plain).
  layer.overlap = overlap;
  const Calibration at_layer = calibration.at_language_model_layer();
  const CostModel cost(at_layer, cluster, layer);
  const OtherWork other = other_work(one);
  const int lanes = overlap ? 2 : 1;
  const double lane_us = 1e3 * (overlap ? one.overlapped_step_ms / one.step_ms : 1.0) / lanes;  // a lane's share of a one-GPU ms
  const double blocks = static_cast<double>(model.num_layers);
  const int streams[2] = {kCompute, kCompute2};
  const std::string suffix[2] = {overlap ? ".0" : "", ".1"};
  Timeline timeline(R);
  auto each_lane = [&](const std::string& name, double ms, const std::vector<Op>& before) {
    std::vector<Op> done;
    for (int i = 0; i < lanes; ++i) {
      const std::vector<Op> after = before.empty() ? std::vector<Op>{} : std::vector<Op>{before[static_cast<size_t>(i)]};
      done.push_back(timeline.local(name + suffix[i], streams[i], ms * lane_us, after));
    }
    return done;
  };
  // Forward.
  std::vector<Op> last = each_lane("embedding", other.head_forward_ms, {});
  std::vector<std::unique_ptr<LayerStepOps>> moe;  // [MoE block]
  for (int64_t b = 0; b < model.num_layers; ++b) {
    last = each_lane("block " + std::to_string(b), other.block_forward_ms / blocks, last);
    if (!is_moe_block(model, b)) continue;
    moe.push_back(std::make_unique<LayerStepOps>(timeline, cost, loads[moe.size()]));
    last = moe.back()->forward(last);
  }
  last = each_lane("lm_head", other.tail_forward_ms, last);
  // Backward, block by block in reverse; each block's gradients summed over the ranks on the
  // gradient stream once both lanes' backward of the block has run.
  last = each_lane("lm_head_backward", other.head_backward_ms, last);
  std::vector<Op> sums;
  const double block_sum_us = all_reduce_us((other_parameters - outside_blocks) / blocks);
  for (int64_t b = model.num_layers - 1; b >= 0; --b) {
    std::vector<Op> block_done;
    if (is_moe_block(model, b)) {
      LayerStepOps& ops = *moe.back();
      last = ops.backward(last);
      // lane B's expert gradients added in on the gradient stream; the router's gradient is summed with
      // the block's other data-parallel ones (all_reduce_router_gradient off in the model)
      block_done.push_back(ops.update({.router_all_reduce = false, .sgd = false, .stream = kCopy}));
      moe.pop_back();
    }
    last = each_lane("block " + std::to_string(b) + " backward", other.block_backward_ms / blocks, last);
    block_done.insert(block_done.end(), last.begin(), last.end());
    sums.push_back(timeline.collective("gradient_all_reduce " + std::to_string(b), kCopy, block_sum_us, block_done));
  }
  last = each_lane("embedding_backward", other.tail_backward_ms, last);
  sums.insert(sums.end(), last.begin(), last.end());
  const Op final_sum = timeline.collective("gradient_all_reduce embeddings", kCopy, all_reduce_us(outside_blocks), sums);
  double backward_end = 0;
  for (Op op : last) backward_end = std::max(backward_end, timeline.end_us(op, 0));
  out.all_reduce_ms = (timeline.end_us(final_sum, 0) - backward_end) / 1e3;  // the sums the backward did not hide
  timeline.local("optimizer", kCompute, 1e3 * out.optimizer_ms, {final_sum});
  timeline.local("unphased", kCompute, 1e3 * other.unphased_ms);
  out.step_ms = timeline.finish_step() / 1e3;
  // The MoE blocks' share: each block's layer step alone on the cluster, its SGD left out.
  Timeline alone(R);
  for (const StepLoad& load : loads) {
    LayerStepOps ops(alone, cost, load);
    ops.forward();
    ops.backward();
    ops.update({.router_all_reduce = false, .sgd = false});
    out.moe_ms += alone.finish_step() / 1e3;
  }
  return out;
}

}  // namespace moe::sim
