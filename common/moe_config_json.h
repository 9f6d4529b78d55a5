// moe_config_json.h: MoeConfig <-> JSON, as it appears under "moe_config" in a run's run.json.
//
// nlohmann-json finds these two functions by argument-dependent lookup, so with this header
// included `nlohmann::json j = config;` and `j.get<moe::MoeConfig>()` both work.
// The JSON uses the struct's field names and the enum names ("dropless", "swiglu"):
//   {"tokens": 4096, "model_dim": 512, "hidden_dim": 1024, "num_experts": 8, "top_k": 2,
//    "formulation": "dropless", "capacity_factor": 1.0, "block_size": 128, "activation": "gelu",
//    "renormalize": false, "jitter_eps": 0.0, "seed": 0, "aux_loss_coef": 0.01, "z_loss_coef": 0.0}
// from_json requires T, D, H and E, lets the other fields default to MoeConfig's defaults, checks
// every field's type, and runs validate(): a config read from disk is as checked as one built in
// code. Any problem throws moe::RecordError naming the field.
#pragma once

#include <nlohmann/json.hpp>

#include "moe_config.h"
#include "record_error.h"

namespace moe {

void to_json(nlohmann::json& j, const MoeConfig& config);
void from_json(const nlohmann::json& j, MoeConfig& config);

}  // namespace moe
