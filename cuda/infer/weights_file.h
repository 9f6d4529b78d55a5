// infer/weights_file.h: a trained model's config and weights for the decoding model, read from a
// model.safetensors file (reference_cpu/model_safetensors.h: written by save_model_safetensors or
// moe_export_weights) or from a moe_train run's latest checkpoint (common/checkpoint.h).
// Header only, like core/reference_bridge.h, and for the same reason: the files' model config is
// the reference's (ModelConfig and its JSON), and moe_cuda does not link the Eigen reference. Include
// it only in targets that link moe_reference_cpu too (moe_generate, tests/cuda).
//
//   moe::cuda::InferenceWeights w = moe::cuda::load_weights_safetensors("model.safetensors");
//   w.config.batch = 4;                                   // the sequences to decode together
//   moe::cuda::InferenceModelGpu model(w.config, w.weights, experts);
//
// Every fault is an exception that names the file: moe::SafetensorsError for a safetensors file
// (truncated, not this layout, a missing or misshapen tensor, a value that is not finite, or, with
// an expected config, each field in which the file's model differs: "num_experts is 8 in the file,
// 4 in the model being built"), moe::CheckpointError for a checkpoint, std::invalid_argument for a
// path that holds neither.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"                      // load_checkpoint, latest_checkpoint
#include "model/model.h"                     // ModelGpuConfig, MoeBlocks
#include "reference_cpu/model.h"             // parameters, zero_weights
#include "reference_cpu/model_config_json.h"  // model_config_from_json
#include "reference_cpu/model_safetensors.h"  // load_model_safetensors

namespace moe::cuda {

struct InferenceWeights {
  ModelGpuConfig config;       // batch = 1: set it to the sequences to decode together
  std::vector<float> weights;  // [parameter_count] fp32 in parameter_layout's order
  std::map<std::string, std::string> metadata;  // a safetensors file's __metadata__; empty for a checkpoint
  std::filesystem::path source;                 // the file read
};

// ModelGpuConfig <-> the reference's ModelConfig (the same fields; batch is the GPU's own).
inline ModelGpuConfig gpu_config_of(const ref::ModelConfig& c, int64_t batch) {
  ModelGpuConfig g;
  g.model_dim = c.model_dim;
  g.num_layers = c.num_layers;
  g.num_heads = c.num_heads;
  g.seq_len = c.seq_len;
  g.batch = batch;
  g.moe_blocks = c.moe_layers == ref::MoeLayers::every_block         ? MoeBlocks::every_block
                 : c.moe_layers == ref::MoeLayers::every_other_block ? MoeBlocks::every_other_block
                                                                     : MoeBlocks::none;
  g.dense_hidden_dim = c.dense_hidden_dim;
  g.layer_norm_eps = c.layer_norm_eps;
  g.moe = ref::moe_layer_config(c, batch);
  g.pregated = c.pregated;
  return g;
}

inline ref::ModelConfig reference_config_of(const ModelGpuConfig& g) {
  ref::ModelConfig c;
  c.model_dim = g.model_dim;
  c.num_layers = g.num_layers;
  c.num_heads = g.num_heads;
  c.seq_len = g.seq_len;
  c.moe_layers = g.moe_blocks == MoeBlocks::every_block         ? ref::MoeLayers::every_block
                 : g.moe_blocks == MoeBlocks::every_other_block ? ref::MoeLayers::every_other_block
                                                                : ref::MoeLayers::none;
  c.dense_hidden_dim = g.dense_hidden_dim;
  c.layer_norm_eps = g.layer_norm_eps;
  c.num_experts = g.moe.num_experts;
  c.top_k = g.moe.top_k;
  c.expert_hidden_dim = g.moe.hidden_dim;
  c.formulation = g.moe.formulation;
  c.capacity_factor = g.moe.capacity_factor;
  c.block_size = g.moe.block_size;
  c.activation = g.moe.activation;
  c.renormalize = g.moe.renormalize;
  c.aux_loss_coef = g.moe.aux_loss_coef;
  c.z_loss_coef = g.moe.z_loss_coef;
  c.pregated = g.pregated;
  return c;
}

namespace detail {

inline InferenceWeights weights_of(const ref::LoadedModel& loaded, const std::filesystem::path& path) {
  InferenceWeights out;
  out.config = gpu_config_of(loaded.config, 1);
  out.metadata = loaded.metadata;
  out.source = path;
  ref::ModelWeights values = loaded.weights;  // parameters() hands out mutable pointers
  ref::ModelWeights unused = ref::zero_weights(loaded.config);
  for (const ref::Parameter& p : ref::parameters(loaded.config, values, unused)) {
    for (int64_t i = 0; i < p.value->size(); ++i) out.weights.push_back(static_cast<float>(p.value->data()[i]));
  }
  return out;
}

}  // namespace detail

// The model the file's metadata describes, and its weights.
inline InferenceWeights load_weights_safetensors(const std::filesystem::path& path) {
  return detail::weights_of(ref::load_model_safetensors(path), path);
}

// As above, after checking that the file's model is `expected` in every field that decides what it
// computes at inference (the error names each field that differs).
inline InferenceWeights load_weights_safetensors(const std::filesystem::path& path, const ModelGpuConfig& expected) {
  InferenceWeights out = detail::weights_of(ref::load_model_safetensors(path, reference_config_of(expected)), path);
  out.config.batch = expected.batch;
  out.config.moe = ref::moe_layer_config(reference_config_of(out.config), expected.batch);
  return out;
}

// A checkpoint file, or a moe_train run directory (or its checkpoints/ folder), whose latest
// checkpoint is taken: its model config and fp32 master weights (AdamW's moments stay behind).
inline InferenceWeights load_weights_checkpoint(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::path file = path;
  if (!fs::is_regular_file(path, error)) {
    if (!fs::is_directory(path, error)) {
      throw std::invalid_argument(path.string() + ": no such checkpoint file or run directory");
    }
    std::optional<fs::path> latest;
    for (const fs::path& directory : {path / "checkpoints", path}) {
      if ((latest = latest_checkpoint(directory))) break;
    }
    if (!latest) {
      throw std::invalid_argument(path.string() + ": no checkpoint_<step>.ckpt in it or in its checkpoints/ directory "
                                                  "(train first: moe_train --run-dir " + path.string() + ")");
    }
    file = *latest;
  }
  const LoadedCheckpoint loaded = load_checkpoint(file);
  ref::ModelConfig config;
  try {
    config = ref::model_config_from_json(loaded.header.model_config);
  } catch (const std::invalid_argument& bad) {
    throw CheckpointError(file.string() + ": its model config: " + bad.what());
  }
  InferenceWeights out;
  out.config = gpu_config_of(config, 1);
  out.weights = loaded.array("weights");
  out.source = file;
  const int64_t expected = ref::parameter_count(config);
  if (static_cast<int64_t>(out.weights.size()) != expected) {
    throw CheckpointError(file.string() + ": its weights hold " + std::to_string(out.weights.size()) +
                          " values; its model config has " + std::to_string(expected) + " parameters");
  }
  return out;
}

}  // namespace moe::cuda
