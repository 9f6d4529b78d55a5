// moe_config.cpp: validation and naming for MoeConfig (see moe_config.h).
#include "moe_config.h"

#include <cmath>
#include <stdexcept>

#include "config_rejection.h"  // ConfigRejection, number_text
#include "enum_names.h"        // EnumNames, name_of, parse_name

namespace moe {

namespace {

constexpr ConfigRejection reject{"MoE config"};

}  // namespace

void validate(const MoeConfig& c) {
  reject.if_outside("tokens (T)", c.tokens, "T", kMaxTokens);
  reject.if_outside("model_dim (D)", c.model_dim, "D", kMaxModelDim);
  reject.if_outside("hidden_dim (H)", c.hidden_dim, "H", kMaxHiddenDim);
  reject.if_outside("num_experts (E)", c.num_experts, "E", kMaxExperts);
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    reject("top_k (K)", std::to_string(c.top_k),
           "1 <= K <= E (E = " + std::to_string(c.num_experts) + ")");
  }
  if (c.formulation != Formulation::dropless) {
    if (!std::isfinite(c.capacity_factor) || c.capacity_factor <= 0.0 || c.capacity_factor > kMaxCapacityFactor) {
      reject("capacity_factor", number_text(c.capacity_factor),
             "a number > 0 and <= 1024 for the dropping and padded formulations");
    }
  }
  reject.if_outside("block_size (B)", c.block_size, "B", kMaxBlockSize);
  if (c.formulation == Formulation::dropless && c.hidden_dim % c.block_size != 0) {
    reject("hidden_dim (H)", std::to_string(c.hidden_dim),
           "a multiple of block_size B = " + std::to_string(c.block_size) +
               " in the dropless formulation (the hidden dimension is tiled by B x B blocks)");
  }
  if (!std::isfinite(c.jitter_eps) || c.jitter_eps < 0.0 || c.jitter_eps >= 1.0) {
    reject("jitter_eps", number_text(c.jitter_eps), "0 <= eps < 1 (0 turns jitter off)");
  }
  if (!std::isfinite(c.aux_loss_coef) || c.aux_loss_coef < 0.0) {
    reject("aux_loss_coef", number_text(c.aux_loss_coef), "a finite number >= 0");
  }
  if (!std::isfinite(c.z_loss_coef) || c.z_loss_coef < 0.0) {
    reject("z_loss_coef", number_text(c.z_loss_coef), "a finite number >= 0");
  }
}

int64_t capacity(const MoeConfig& c) {
  const double rows = c.capacity_factor * static_cast<double>(c.tokens * c.top_k) /
                      static_cast<double>(c.num_experts);
  return static_cast<int64_t>(std::ceil(rows));
}

int64_t w1_columns(const MoeConfig& c) {
  return c.activation == Activation::swiglu ? 2 * c.hidden_dim : c.hidden_dim;
}

namespace {

constexpr EnumNames<Formulation, 3> kFormulations{{
    {Formulation::dropping, "dropping"}, {Formulation::padded, "padded"}, {Formulation::dropless, "dropless"}}};
constexpr EnumNames<Activation, 2> kActivations{{{Activation::gelu, "gelu"}, {Activation::swiglu, "swiglu"}}};

}  // namespace

std::string_view to_string(Formulation f) { return name_of(kFormulations, f); }
std::string_view to_string(Activation a) { return name_of(kActivations, a); }
Formulation parse_formulation(std::string_view text) { return parse_name(kFormulations, text, "formulation"); }
Activation parse_activation(std::string_view text) { return parse_name(kActivations, text, "activation"); }

}  // namespace moe
