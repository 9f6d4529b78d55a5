// model_config_json.cpp: ModelConfig <-> JSON and the comparison of two configs (see
// model_config_json.h).
#include "model_config_json.h"

#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>

namespace moe::ref {

namespace {

using nlohmann::json;

[[noreturn]] void wrong(const std::string& key, const std::string& expected, const json& value) {
  throw std::invalid_argument("model config: " + key + " is " + value.dump() + "; expected " + expected);
}

const json* find(const json& j, const std::string& key, bool required) {
  const auto it = j.find(key);
  if (it != j.end()) return &*it;
  if (required) throw std::invalid_argument("model config: " + key + " is missing (required)");
  return nullptr;
}

void read_integer(const json& j, const std::string& key, bool required, int64_t& out) {
  const json* value = find(j, key, required);
  if (!value) return;
  if (!value->is_number_integer()) wrong(key, "an integer", *value);
  out = value->get<int64_t>();
}

void read_number(const json& j, const std::string& key, double& out) {
  const json* value = find(j, key, false);
  if (!value) return;
  if (!value->is_number()) wrong(key, "a number", *value);
  out = value->get<double>();
}

void read_boolean(const json& j, const std::string& key, bool required, bool& out) {
  const json* value = find(j, key, required);
  if (!value) return;
  if (!value->is_boolean()) wrong(key, "true or false", *value);
  out = value->get<bool>();
}

// Reads a string key through `parse` (which throws std::invalid_argument listing the names).
template <typename Enum, typename Parse>
void read_name(const json& j, const std::string& key, bool required, Enum& out, Parse parse) {
  const json* value = find(j, key, required);
  if (!value) return;
  if (!value->is_string()) wrong(key, "a string", *value);
  try {
    out = parse(value->get<std::string>());
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument("model config: " + key + ": " + error.what());
  }
}

template <typename T>
std::string text(const T& value) {
  std::ostringstream out;
  out << std::boolalpha << value;
  return out.str();
}

}  // namespace

json model_config_to_json(const ModelConfig& c) {
  return json{
      {"model_dim", c.model_dim},
      {"num_layers", c.num_layers},
      {"num_heads", c.num_heads},
      {"seq_len", c.seq_len},
      {"moe_layers", std::string(to_string(c.moe_layers))},
      {"dense_hidden_dim", c.dense_hidden_dim},
      {"layer_norm_eps", c.layer_norm_eps},
      {"num_experts", c.num_experts},
      {"top_k", c.top_k},
      {"expert_hidden_dim", c.expert_hidden_dim},
      {"formulation", std::string(to_string(c.formulation))},
      {"capacity_factor", c.capacity_factor},
      {"block_size", c.block_size},
      {"activation", std::string(to_string(c.activation))},
      {"renormalize", c.renormalize},
      {"aux_loss_coef", c.aux_loss_coef},
      {"z_loss_coef", c.z_loss_coef},
      {"pregated", c.pregated},
  };
}

ModelConfig model_config_from_json(const json& j) {
  if (!j.is_object()) throw std::invalid_argument("model config is " + j.dump() + "; expected a JSON object");
  static const std::set<std::string> known = {
      "model_dim",   "num_layers",        "num_heads",   "seq_len",    "moe_layers",    "dense_hidden_dim",
      "layer_norm_eps", "num_experts",    "top_k",       "expert_hidden_dim", "formulation", "capacity_factor",
      "block_size",  "activation",        "renormalize", "aux_loss_coef", "z_loss_coef", "pregated",
      "batch",       "vocabulary"};
  for (const auto& [key, value] : j.items()) {
    if (!known.contains(key)) {
      throw std::invalid_argument("model config: unknown key '" + key + "' (a model this reference does not know)");
    }
  }
  if (const json* vocabulary = find(j, "vocabulary", false); vocabulary && *vocabulary != kByteVocabulary) {
    wrong("vocabulary", std::to_string(kByteVocabulary) + " (bytes)", *vocabulary);
  }
  ModelConfig c;
  read_integer(j, "model_dim", true, c.model_dim);
  read_integer(j, "num_layers", true, c.num_layers);
  read_integer(j, "num_heads", true, c.num_heads);
  read_integer(j, "seq_len", true, c.seq_len);
  read_name(j, "moe_layers", true, c.moe_layers, parse_moe_layers);
  read_integer(j, "dense_hidden_dim", true, c.dense_hidden_dim);
  read_number(j, "layer_norm_eps", c.layer_norm_eps);
  read_integer(j, "num_experts", true, c.num_experts);
  read_integer(j, "top_k", true, c.top_k);
  read_integer(j, "expert_hidden_dim", true, c.expert_hidden_dim);
  read_name(j, "formulation", false, c.formulation, parse_formulation);
  read_number(j, "capacity_factor", c.capacity_factor);
  read_integer(j, "block_size", false, c.block_size);
  read_name(j, "activation", false, c.activation, parse_activation);
  read_boolean(j, "renormalize", false, c.renormalize);
  read_number(j, "aux_loss_coef", c.aux_loss_coef);
  read_number(j, "z_loss_coef", c.z_loss_coef);
  read_boolean(j, "pregated", true, c.pregated);
  validate(c);
  return c;
}

std::vector<std::string> inference_differences(const ModelConfig& a, const std::string& a_name, const ModelConfig& b,
                                               const std::string& b_name) {
  std::vector<std::string> differences;
  const auto compare = [&](const std::string& field, const auto& left, const auto& right) {
    if (left == right) return;
    differences.push_back(field + " is " + text(left) + " in " + a_name + ", " + text(right) + " in " + b_name);
  };
  compare("model_dim", a.model_dim, b.model_dim);
  compare("num_layers", a.num_layers, b.num_layers);
  compare("num_heads", a.num_heads, b.num_heads);
  compare("seq_len", a.seq_len, b.seq_len);
  compare("moe_layers", to_string(a.moe_layers), to_string(b.moe_layers));
  compare("layer_norm_eps", a.layer_norm_eps, b.layer_norm_eps);
  compare("pregated", a.pregated, b.pregated);
  if (a.moe_layers != MoeLayers::every_block || b.moe_layers != MoeLayers::every_block) {
    compare("dense_hidden_dim", a.dense_hidden_dim, b.dense_hidden_dim);
  }
  if (a.moe_layers != MoeLayers::none || b.moe_layers != MoeLayers::none) {
    compare("num_experts", a.num_experts, b.num_experts);
    compare("top_k", a.top_k, b.top_k);
    compare("expert_hidden_dim", a.expert_hidden_dim, b.expert_hidden_dim);
    compare("activation", to_string(a.activation), to_string(b.activation));
    compare("renormalize", a.renormalize, b.renormalize);
  }
  return differences;
}

}  // namespace moe::ref
