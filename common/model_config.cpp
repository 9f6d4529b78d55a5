// model_config.cpp: validation of the model configuration (see model_config.h).
#include "model_config.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "config_rejection.h"  // ConfigRejection, number_text
#include "enum_names.h"        // EnumNames, name_of, parse_name

namespace moe {

namespace {

constexpr ConfigRejection reject{"model config"};

}  // namespace

void validate(const ModelConfig& c) {
  reject.if_below_one("model_dim (D)", c.model_dim, "D");
  reject.if_below_one("num_layers (L)", c.num_layers, "L");
  reject.if_below_one("num_heads", c.num_heads, "num_heads");
  if (c.model_dim % c.num_heads != 0) {
    reject("num_heads", std::to_string(c.num_heads),
           "a divisor of model_dim D = " + std::to_string(c.model_dim) +
               " (each head gets D / num_heads columns)");
  }
  reject.if_below_one("seq_len (S)", c.seq_len, "S");
  if (!std::isfinite(c.layer_norm_eps) || c.layer_norm_eps <= 0.0) {
    reject("layer_norm_eps", number_text(c.layer_norm_eps), "a finite number > 0");
  }
  if (c.moe_layers == MoeLayers::every_other_block && c.num_layers < 2) {
    reject("moe_layers", "every_other_block with num_layers (L) = " + std::to_string(c.num_layers),
           "L >= 2 (block 1 is the first MoE block), or moe_layers = none for a dense model");
  }
  if (c.moe_layers != MoeLayers::every_block && c.dense_hidden_dim < 1) {
    reject("dense_hidden_dim (H_dense)", std::to_string(c.dense_hidden_dim),
           "H_dense >= 1 when some blocks are dense (moe_layers = " + std::string(to_string(c.moe_layers)) + ")");
  }
  if (c.pregated && c.moe_layers == MoeLayers::none) {
    reject("pregated", "true with moe_layers = none", "pregated = false for a dense model (no gate to move)");
  }
  if (c.moe_layers == MoeLayers::none) return;  // the MoE fields are unused
  try {
    moe::validate(moe_layer_config(c, 1));
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("MoE layer: ") + error.what());
  }
}

bool is_moe_block(const ModelConfig& config, int64_t layer) {
  switch (config.moe_layers) {
    case MoeLayers::every_block: return true;
    case MoeLayers::every_other_block: return layer % 2 == 1;
    case MoeLayers::none: return false;
  }
  return false;
}

std::vector<int64_t> moe_blocks(const ModelConfig& config) {
  std::vector<int64_t> blocks;
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    if (is_moe_block(config, layer)) blocks.push_back(layer);
  }
  return blocks;
}

MoeConfig moe_layer_config(const ModelConfig& c, int64_t batch) {
  MoeConfig layer;
  layer.tokens = batch * c.seq_len;
  layer.model_dim = c.model_dim;
  layer.hidden_dim = c.expert_hidden_dim;
  layer.num_experts = c.num_experts;
  layer.top_k = c.top_k;
  layer.formulation = c.formulation;
  layer.capacity_factor = c.capacity_factor;
  layer.block_size = c.block_size;
  layer.activation = c.activation;
  layer.renormalize = c.renormalize;
  layer.jitter_eps = 0.0;
  layer.aux_loss_coef = c.aux_loss_coef;
  layer.z_loss_coef = c.z_loss_coef;
  return layer;
}

namespace {

constexpr EnumNames<MoeLayers, 3> kMoeLayers{{{MoeLayers::every_block, "every_block"},
                                             {MoeLayers::every_other_block, "every_other_block"},
                                             {MoeLayers::none, "none"}}};

}  // namespace

std::string_view to_string(MoeLayers moe_layers) { return name_of(kMoeLayers, moe_layers); }
MoeLayers parse_moe_layers(std::string_view text) { return parse_name(kMoeLayers, text, "moe_layers"); }

}  // namespace moe
