// config_json.h: the project's configs as JSON, read by one reader (JsonFields below) that checks
// every field's type and names the field in every error, then validates the result: a config read
// from disk is as checked as one built in code.
// Tested by tests/common/test_moe_config.cpp (ctest -R MoeConfig) and
// tests/reference_cpu/test_model_safetensors.cpp (ctest -R ReferenceWeights).
//
// MoeConfig, under "moe_config" in a run's run.json (run_record.h). nlohmann-json finds to_json and
// from_json by argument-dependent lookup, so `nlohmann::json j = config;` and
// `j.get<moe::MoeConfig>()` both work. Any problem throws moe::RecordError naming the field:
//   {"tokens": 4096, "model_dim": 512, "hidden_dim": 1024, "num_experts": 8, "top_k": 2,
//    "formulation": "dropless", "capacity_factor": 1.0, "block_size": 128, "activation": "gelu",
//    "renormalize": false, "jitter_eps": 0.0, "seed": 0, "aux_loss_coef": 0.01, "z_loss_coef": 0.0}
// T, D, H and E are required; the other fields default to MoeConfig's defaults.
//
// ModelConfig, as it travels with a model's weights (the "model_config" entry of a weights file's
// metadata, model_weights_file.h) and in a training checkpoint's header (cuda/train writes the same
// keys). Any problem throws std::invalid_argument naming the key:
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
// project does not know is never read as one without it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model_config.h"  // ModelConfig
#include "moe_config.h"    // MoeConfig
#include "record_error.h"  // RecordError

namespace moe {

// ---- MoeConfig ----

void to_json(nlohmann::json& j, const MoeConfig& config);
void from_json(const nlohmann::json& j, MoeConfig& config);

// ---- ModelConfig ----

nlohmann::json model_config_to_json(const ModelConfig& config);

// Throws std::invalid_argument naming the key and what it should be, or validate()'s message.
ModelConfig model_config_from_json(const nlohmann::json& json);

// The fields that decide what a model computes at inference, each as "name is A in <left_name>,
// B in <right_name>", for those that differ. Not compared: formulation, capacity_factor and
// block_size (inference routes dropless), aux_loss_coef and z_loss_coef (training only).
std::vector<std::string> inference_differences(const ModelConfig& left, const std::string& left_name,
                                               const ModelConfig& right, const std::string& right_name);

// ---- the reader ----

// The fields of one JSON object. Each read leaves `out` alone when the field is absent and not
// required. Every problem is raised as "<what>: <key> is <value>; expected <kind>" (or "<key> is
// missing (required)") through `raise`, which throws the caller's error type.
class JsonFields {
 public:
  using Raise = std::function<void(const std::string& message)>;  // must throw

  // Raises "<what> is <value>; expected a JSON object" unless `object` is one.
  JsonFields(const nlohmann::json& object, std::string what, Raise raise);

  void integer(const char* key, bool required, int64_t& out) const;  // fits in int64
  void unsigned_integer(const char* key, uint64_t& out) const;      // >= 0
  void number(const char* key, double& out) const;                  // JSON has no NaN: null reads as NaN
  void boolean(const char* key, bool required, bool& out) const;
  // A string read through `parse` (which throws std::invalid_argument listing the allowed names).
  template <typename Enum, typename Parse>
  void name(const char* key, bool required, Enum& out, Parse parse) const {
    const nlohmann::json* value = find(key, required);
    if (!value) return;
    if (!value->is_string()) wrong(key, "a string", *value);
    try {
      out = parse(value->get<std::string>());
    } catch (const std::invalid_argument& error) {
      fail(std::string(key) + ": " + error.what());
    }
  }
  // Raises for the first key not in `known`.
  void only(const std::vector<std::string>& known, const std::string& why) const;

  const nlohmann::json* find(const char* key, bool required) const;
  [[noreturn]] void wrong(const char* key, const std::string& expected, const nlohmann::json& value) const;
  [[noreturn]] void fail(const std::string& message) const;

 private:
  const nlohmann::json& object_;
  std::string what_;
  Raise raise_;
};

}  // namespace moe
