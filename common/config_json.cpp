// config_json.cpp: the configs <-> JSON through one field reader (see config_json.h).
#include "config_json.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

using nlohmann::json;

// ---- the reader ----

namespace {

std::string shown(const json& value) {  // invalid UTF-8 in a string is shown, not thrown
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

JsonFields::JsonFields(const json& object, std::string what, Raise raise)
    : object_(object), what_(std::move(what)), raise_(std::move(raise)) {
  if (!object_.is_object()) raise_(what_ + " is " + shown(object_) + "; expected a JSON object");
}

void JsonFields::fail(const std::string& message) const {
  raise_(what_ + ": " + message);
  throw std::logic_error("JsonFields: raise returned");  // `raise` must throw
}

void JsonFields::wrong(const char* key, const std::string& expected, const json& value) const {
  fail(std::string(key) + " is " + shown(value) + "; expected " + expected);
}

const json* JsonFields::find(const char* key, bool required) const {
  const auto it = object_.find(key);
  if (it != object_.end()) return &*it;
  if (required) fail(std::string(key) + " is missing (required)");
  return nullptr;
}

void JsonFields::integer(const char* key, bool required, int64_t& out) const {
  const json* value = find(key, required);
  if (!value) return;
  if (!value->is_number_integer()) wrong(key, "an integer", *value);
  if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    wrong(key, "an integer that fits in int64", *value);
  }
  out = value->get<int64_t>();
}

void JsonFields::unsigned_integer(const char* key, uint64_t& out) const {
  const json* value = find(key, false);
  if (!value) return;
  if (!value->is_number_unsigned()) wrong(key, "an integer >= 0", *value);
  out = value->get<uint64_t>();
}

void JsonFields::number(const char* key, double& out) const {
  const json* value = find(key, false);
  if (!value) return;
  if (value->is_null()) {  // to_json wrote a NaN as null
    out = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  if (!value->is_number()) wrong(key, "a number", *value);
  out = value->get<double>();
}

void JsonFields::boolean(const char* key, bool required, bool& out) const {
  const json* value = find(key, required);
  if (!value) return;
  if (!value->is_boolean()) wrong(key, "true or false", *value);
  out = value->get<bool>();
}

void JsonFields::only(const std::vector<std::string>& known, const std::string& why) const {
  for (const auto& [key, value] : object_.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) fail("unknown key '" + key + "' (" + why + ")");
  }
}

// ---- MoeConfig ----

void to_json(json& j, const MoeConfig& c) {
  j = json{
      {"tokens", c.tokens},
      {"model_dim", c.model_dim},
      {"hidden_dim", c.hidden_dim},
      {"num_experts", c.num_experts},
      {"top_k", c.top_k},
      {"formulation", std::string(to_string(c.formulation))},
      {"capacity_factor", c.capacity_factor},
      {"block_size", c.block_size},
      {"activation", std::string(to_string(c.activation))},
      {"renormalize", c.renormalize},
      {"jitter_eps", c.jitter_eps},
      {"seed", c.seed},
      {"aux_loss_coef", c.aux_loss_coef},
      {"z_loss_coef", c.z_loss_coef},
  };
}

void from_json(const json& j, MoeConfig& out) {
  const JsonFields fields(j, "moe_config", [](const std::string& message) { throw RecordError(message); });
  MoeConfig c;  // absent optional fields keep the struct's defaults
  fields.integer("tokens", true, c.tokens);
  fields.integer("model_dim", true, c.model_dim);
  fields.integer("hidden_dim", true, c.hidden_dim);
  fields.integer("num_experts", true, c.num_experts);
  fields.integer("top_k", false, c.top_k);
  fields.name("formulation", false, c.formulation, parse_formulation);
  fields.number("capacity_factor", c.capacity_factor);
  fields.integer("block_size", false, c.block_size);
  fields.name("activation", false, c.activation, parse_activation);
  fields.boolean("renormalize", false, c.renormalize);
  fields.number("jitter_eps", c.jitter_eps);
  fields.unsigned_integer("seed", c.seed);
  fields.number("aux_loss_coef", c.aux_loss_coef);
  fields.number("z_loss_coef", c.z_loss_coef);
  try {
    validate(c);
  } catch (const std::invalid_argument& e) {
    fields.fail(e.what());
  }
  out = c;
}

// ---- ModelConfig ----

namespace {

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
  const JsonFields fields(j, "model config", [](const std::string& message) { throw std::invalid_argument(message); });
  fields.only({"model_dim", "num_layers", "num_heads", "seq_len", "moe_layers", "dense_hidden_dim", "layer_norm_eps",
               "num_experts", "top_k", "expert_hidden_dim", "formulation", "capacity_factor", "block_size",
               "activation", "renormalize", "aux_loss_coef", "z_loss_coef", "pregated", "batch", "vocabulary"},
              "a model this project does not know");
  if (const json* vocabulary = fields.find("vocabulary", false); vocabulary && *vocabulary != kByteVocabulary) {
    fields.wrong("vocabulary", std::to_string(kByteVocabulary) + " (bytes)", *vocabulary);
  }
  ModelConfig c;
  fields.integer("model_dim", true, c.model_dim);
  fields.integer("num_layers", true, c.num_layers);
  fields.integer("num_heads", true, c.num_heads);
  fields.integer("seq_len", true, c.seq_len);
  fields.name("moe_layers", true, c.moe_layers, parse_moe_layers);
  fields.integer("dense_hidden_dim", true, c.dense_hidden_dim);
  fields.number("layer_norm_eps", c.layer_norm_eps);
  fields.integer("num_experts", true, c.num_experts);
  fields.integer("top_k", true, c.top_k);
  fields.integer("expert_hidden_dim", true, c.expert_hidden_dim);
  fields.name("formulation", false, c.formulation, parse_formulation);
  fields.number("capacity_factor", c.capacity_factor);
  fields.integer("block_size", false, c.block_size);
  fields.name("activation", false, c.activation, parse_activation);
  fields.boolean("renormalize", false, c.renormalize);
  fields.number("aux_loss_coef", c.aux_loss_coef);
  fields.number("z_loss_coef", c.z_loss_coef);
  fields.boolean("pregated", true, c.pregated);
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

}  // namespace moe
