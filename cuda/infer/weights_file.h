// infer/weights_file.h: a trained model's config and weights for the decoding model, read from a
// model.safetensors file (common/model_weights_file.h: written by moe_export_weights or by the CPU
// reference's save_model_safetensors) or from a moe_train run's latest checkpoint
// (common/checkpoint.h). Header only, over moe_common's readers.
//
//   moe::cuda::InferenceWeights w = moe::cuda::load_weights_safetensors("model.safetensors");
//   w.config.batch = 4;                                   // the sequences to decode together
//   moe::cuda::InferenceModelGpu model(w.config, w.weights, experts);
//   moe::cuda::PinnedExpertStore store = moe::cuda::pinned_experts(w.config, w.weights);  // offloaded modes
//
// Every fault is an exception that names the file: moe::SafetensorsError for a safetensors file
// (truncated, not this layout, a missing or misshapen tensor, a value that is not finite, or, with
// an expected config, each field in which the file's model differs: "num_experts is 8 in the file,
// 4 in the model being built"), moe::CheckpointError for a checkpoint, std::invalid_argument for a
// path that holds neither.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"          // load_checkpoint, latest_checkpoint
#include "config_json.h"         // model_config_from_json
#include "model/model.h"         // ModelGpuConfig, gpu_config_of, model_config_of
#include "model_weights_file.h"  // load_flat_weights_safetensors
#include "offload/pinned_expert_store.h"  // PinnedExpertStore, ExpertShape

namespace moe::cuda {

struct InferenceWeights {
  ModelGpuConfig config;       // batch = 1: set it to the sequences to decode together
  std::vector<float> weights;  // [parameter_count] fp32 in parameter_layout's order
  std::map<std::string, std::string> metadata;  // a safetensors file's __metadata__; empty for a checkpoint
  std::filesystem::path source;                 // the file read
};

namespace detail {

inline InferenceWeights weights_of(LoadedWeights&& loaded, const std::filesystem::path& path) {
  InferenceWeights out;
  out.config = gpu_config_of(loaded.config, 1);
  out.metadata = std::move(loaded.metadata);
  out.source = path;
  out.weights.assign(loaded.flat.begin(), loaded.flat.end());  // fp32, parameter_layout's order
  return out;
}

}  // namespace detail

// The model the file's metadata describes, and its weights.
inline InferenceWeights load_weights_safetensors(const std::filesystem::path& path) {
  return detail::weights_of(load_flat_weights_safetensors(path), path);
}

// As above, after checking that the file's model is `expected` in every field that decides what it
// computes at inference (the error names each field that differs).
inline InferenceWeights load_weights_safetensors(const std::filesystem::path& path, const ModelGpuConfig& expected) {
  InferenceWeights out = detail::weights_of(load_flat_weights_safetensors(path, model_config_of(expected)), path);
  out.config.batch = expected.batch;
  out.config.moe = moe_layer_config(model_config_of(out.config), expected.batch);
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
  ModelConfig config;
  try {
    config = model_config_from_json(loaded.header.model_config);
  } catch (const std::invalid_argument& bad) {
    throw CheckpointError(file.string() + ": its model config: " + bad.what());
  }
  InferenceWeights out;
  out.config = gpu_config_of(config, 1);
  out.weights = loaded.array("weights");
  out.source = file;
  const int64_t expected = parameter_count(config);
  if (static_cast<int64_t>(out.weights.size()) != expected) {
    throw CheckpointError(file.string() + ": its weights hold " + std::to_string(out.weights.size()) +
                          " values; its model config has " + std::to_string(expected) + " parameters");
  }
  return out;
}

// Every MoE block's experts of `weights`, stacked [E, D, H] / [E, H, D] as the flat layout holds
// them (expert e's w1 right after expert e-1's), in pinned host memory as bf16: what the offloaded
// modes stream to the GPU (cuda/offload/).
inline PinnedExpertStore pinned_experts(const ModelGpuConfig& config, const std::vector<float>& weights) {
  std::vector<int64_t> moe;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    if (is_moe_block(config, i)) moe.push_back(i);
  }
  const ExpertShape shape{int64_t(moe.size()), config.moe.num_experts, config.model_dim, config.moe.hidden_dim, 0};
  PinnedExpertStore store(shape);
  const std::vector<ParameterSpan> layout = parameter_layout(config);
  auto stacked = [&](const std::string& first, int64_t elements) {
    const auto span = std::find_if(layout.begin(), layout.end(), [&](const ParameterSpan& s) { return s.name == first; });
    std::vector<bf16> out(static_cast<size_t>(elements));
    for (int64_t i = 0; i < elements; ++i) out[size_t(i)] = __float2bfloat16(weights[size_t(span->offset + i)]);
    return out;
  };
  for (size_t j = 0; j < moe.size(); ++j) {
    const std::string prefix = "blocks." + std::to_string(moe[j]) + ".moe.";
    const std::vector<bf16> w1 = stacked(prefix + "w1.0", shape.experts * shape.w1_elements());
    const std::vector<bf16> w2 = stacked(prefix + "w2.0", shape.experts * shape.w2_elements());
    store.set_block(int64_t(j), w1, w2);
  }
  return store;
}


}  // namespace moe::cuda
