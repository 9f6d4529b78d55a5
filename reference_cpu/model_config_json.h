// model_config_json.h: ModelConfig <-> JSON, as it travels with a model's weights (the
// "model_config" entry of a weights file's metadata, model_safetensors.h) and in a training
// checkpoint's header (cuda/train writes the same keys). Part of the CPU reference (moe::ref);
// tested by tests/reference_cpu/test_model_safetensors.cpp (ctest --test-dir build -R ReferenceWeights).
//
// The keys are ModelConfig's field names, the enums by name:
//   {"model_dim": 64, "num_layers": 2, "num_heads": 4, "seq_len": 64, "moe_layers": "every_block",
//    "dense_hidden_dim": 256, "layer_norm_eps": 1e-05, "num_experts": 4, "top_k": 1,
//    "expert_hidden_dim": 64, "formulation": "dropless", "capacity_factor": 1.0, "block_size": 16,
//    "activation": "gelu", "renormalize": false, "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
//    "pregated": false}
// Reading requires the keys that decide the parameters' shapes and the routing (model_dim,
// num_layers, num_heads, seq_len, moe_layers, dense_hidden_dim, num_experts, top_k,
// expert_hidden_dim, pregated); the others default to ModelConfig's defaults, which are what the GPU
// trainer uses for the keys it does not write. A training checkpoint's "batch" is accepted and
// ignored, "vocabulary" must be 256; any other key is an error, so a model with a feature this
// reference does not know is never read as one without it. validate() runs on the result.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model_config.h"  // ModelConfig

namespace moe::ref {

nlohmann::json model_config_to_json(const ModelConfig& config);

// Throws std::invalid_argument naming the key and what it should be, or validate()'s message.
ModelConfig model_config_from_json(const nlohmann::json& json);

// The fields that decide what a model computes at inference, each as "name is A in <left_name>,
// B in <right_name>", for those that differ. Not compared: formulation, capacity_factor and
// block_size (inference routes dropless, generate.h), aux_loss_coef and z_loss_coef (training only).
std::vector<std::string> inference_differences(const ModelConfig& left, const std::string& left_name,
                                               const ModelConfig& right, const std::string& right_name);

}  // namespace moe::ref
