// config_json.cpp: the configs <-> JSON through one field reader (see config_json.h).
#include "config_json.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

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

// ---- the field lists ----

namespace {

// Each config's JSON keys, listed once: writing and reading both walk the list, so a key is
// written and read under one name. visit(key, member, required); reading needs a required key,
// and keeps the struct's default for an absent optional one (numbers and the seed are always
// optional: JsonFields reads them so).

// The routing settings MoeConfig and ModelConfig share, under the same keys, optional in both.
template <typename Config, typename Visit>
void routing_fields(Config& c, Visit& visit) {
  visit("formulation", c.formulation, false);
  visit("capacity_factor", c.capacity_factor, false);
  visit("block_size", c.block_size, false);
  visit("activation", c.activation, false);
  visit("renormalize", c.renormalize, false);
}

template <typename Config, typename Visit>  // Config: MoeConfig or const MoeConfig
void moe_config_fields(Config& c, Visit&& visit) {
  visit("tokens", c.tokens, true);
  visit("model_dim", c.model_dim, true);
  visit("hidden_dim", c.hidden_dim, true);
  visit("num_experts", c.num_experts, true);
  visit("top_k", c.top_k, false);
  routing_fields(c, visit);
  visit("jitter_eps", c.jitter_eps, false);
  visit("seed", c.seed, false);
  visit("aux_loss_coef", c.aux_loss_coef, false);
  visit("z_loss_coef", c.z_loss_coef, false);
}

template <typename Config, typename Visit>  // Config: ModelConfig or const ModelConfig
void model_config_fields(Config& c, Visit&& visit) {
  visit("model_dim", c.model_dim, true);
  visit("num_layers", c.num_layers, true);
  visit("num_heads", c.num_heads, true);
  visit("seq_len", c.seq_len, true);
  visit("moe_layers", c.moe_layers, true);
  visit("dense_hidden_dim", c.dense_hidden_dim, true);
  visit("layer_norm_eps", c.layer_norm_eps, false);
  visit("num_experts", c.num_experts, true);
  visit("top_k", c.top_k, true);
  visit("expert_hidden_dim", c.expert_hidden_dim, true);
  routing_fields(c, visit);
  visit("aux_loss_coef", c.aux_loss_coef, false);
  visit("z_loss_coef", c.z_loss_coef, false);
  visit("pregated", c.pregated, true);
}

// Writes each visited field into an object; the enums as their names.
struct FieldWriter {
  json& object;
  template <typename T>
  void operator()(const char* key, const T& value, bool /*required*/) {
    if constexpr (std::is_enum_v<T>) {
      object[key] = std::string(to_string(value));
    } else {
      object[key] = value;
    }
  }
};

// Reads each visited field through JsonFields, which checks its JSON type.
struct FieldReader {
  const JsonFields& fields;
  void operator()(const char* key, int64_t& out, bool required) { fields.integer(key, required, out); }
  void operator()(const char* key, uint64_t& out, bool /*optional*/) { fields.unsigned_integer(key, out); }
  void operator()(const char* key, double& out, bool /*optional*/) { fields.number(key, out); }
  void operator()(const char* key, bool& out, bool required) { fields.boolean(key, required, out); }
  void operator()(const char* key, Formulation& out, bool required) { fields.name(key, required, out, parse_formulation); }
  void operator()(const char* key, Activation& out, bool required) { fields.name(key, required, out, parse_activation); }
  void operator()(const char* key, MoeLayers& out, bool required) { fields.name(key, required, out, parse_moe_layers); }
};

}  // namespace

// ---- MoeConfig ----

void to_json(json& j, const MoeConfig& c) {
  j = json::object();
  moe_config_fields(c, FieldWriter{j});
}

void from_json(const json& j, MoeConfig& out) {
  const JsonFields fields(j, "moe_config", [](const std::string& message) { throw RecordError(message); });
  MoeConfig c;  // absent optional fields keep the struct's defaults
  moe_config_fields(c, FieldReader{fields});
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
  json j = json::object();
  model_config_fields(c, FieldWriter{j});
  return j;
}

ModelConfig model_config_from_json(const json& j) {
  const JsonFields fields(j, "model config", [](const std::string& message) { throw std::invalid_argument(message); });
  // A training checkpoint's "batch" is accepted and ignored; "vocabulary" is checked below.
  std::vector<std::string> known{"batch", "vocabulary"};
  const ModelConfig defaults;
  model_config_fields(defaults, [&](const char* key, const auto&, bool) { known.emplace_back(key); });
  fields.only(known, "a model this project does not know");
  if (const json* vocabulary = fields.find("vocabulary", false); vocabulary && *vocabulary != kByteVocabulary) {
    fields.wrong("vocabulary", std::to_string(kByteVocabulary) + " (bytes)", *vocabulary);
  }
  ModelConfig c;
  model_config_fields(c, FieldReader{fields});
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
