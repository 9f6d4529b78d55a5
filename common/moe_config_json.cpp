// moe_config_json.cpp: MoeConfig <-> JSON with type checks and validation (see moe_config_json.h).
#include "moe_config_json.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace moe {

namespace {

using nlohmann::json;

[[noreturn]] void wrong_type(const char* field, const char* expected, const json& value) {
  throw RecordError("moe_config." + std::string(field) + " must be " + expected + ", found " +
                    std::string(value.type_name()) + " " + value.dump(-1, ' ', false,
                                                                      json::error_handler_t::replace));
}

// Each reader leaves `out` alone when the field is absent and `required` is false.
void read_int(const json& j, const char* field, bool required, int64_t& out) {
  auto it = j.find(field);
  if (it == j.end()) {
    if (required) throw RecordError("moe_config." + std::string(field) + " is missing (required)");
    return;
  }
  if (!it->is_number_integer()) wrong_type(field, "an integer", *it);
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    wrong_type(field, "an integer that fits in int64", *it);
  }
  out = it->get<int64_t>();
}

void read_uint(const json& j, const char* field, uint64_t& out) {
  auto it = j.find(field);
  if (it == j.end()) return;
  if (!it->is_number_unsigned()) wrong_type(field, "an integer >= 0", *it);
  out = it->get<uint64_t>();
}

void read_double(const json& j, const char* field, double& out) {
  auto it = j.find(field);
  if (it == j.end()) return;
  if (it->is_null()) {  // JSON has no NaN: to_json wrote a NaN as null
    out = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  if (!it->is_number()) wrong_type(field, "a number", *it);
  out = it->get<double>();
}

void read_bool(const json& j, const char* field, bool& out) {
  auto it = j.find(field);
  if (it == j.end()) return;
  if (!it->is_boolean()) wrong_type(field, "true or false", *it);
  out = it->get<bool>();
}

const std::string* read_string(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return nullptr;
  if (!it->is_string()) wrong_type(field, "a string", *it);
  return it->get_ptr<const std::string*>();
}

}  // namespace

void to_json(nlohmann::json& j, const MoeConfig& c) {
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

void from_json(const nlohmann::json& j, MoeConfig& out) {
  if (!j.is_object()) {
    throw RecordError("moe_config must be a JSON object, found " + std::string(j.type_name()));
  }
  MoeConfig c;  // absent optional fields keep the struct's defaults
  read_int(j, "tokens", true, c.tokens);
  read_int(j, "model_dim", true, c.model_dim);
  read_int(j, "hidden_dim", true, c.hidden_dim);
  read_int(j, "num_experts", true, c.num_experts);
  read_int(j, "top_k", false, c.top_k);
  read_double(j, "capacity_factor", c.capacity_factor);
  read_int(j, "block_size", false, c.block_size);
  read_bool(j, "renormalize", c.renormalize);
  read_double(j, "jitter_eps", c.jitter_eps);
  read_uint(j, "seed", c.seed);
  read_double(j, "aux_loss_coef", c.aux_loss_coef);
  read_double(j, "z_loss_coef", c.z_loss_coef);
  try {
    if (const std::string* name = read_string(j, "formulation")) c.formulation = parse_formulation(*name);
    if (const std::string* name = read_string(j, "activation")) c.activation = parse_activation(*name);
    validate(c);
  } catch (const std::invalid_argument& e) {
    throw RecordError(std::string("moe_config: ") + e.what());
  }
  out = c;
}

}  // namespace moe
