// model_config.cpp: validation of the model configuration (see model_config.h).
#include "model_config.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "checked_size.h"      // checked_add, checked_product
#include "config_rejection.h"  // ConfigRejection, number_text
#include "enum_names.h"        // EnumNames, name_of, parse_name

namespace moe {

namespace {

constexpr ConfigRejection reject{"model config"};

}  // namespace

void validate(const ModelConfig& c) {
  reject.if_outside("model_dim (D)", c.model_dim, "D", kMaxModelDim);
  reject.if_outside("num_layers (L)", c.num_layers, "L", kMaxLayers);
  reject.if_below_one("num_heads", c.num_heads, "num_heads");
  if (c.model_dim % c.num_heads != 0) {
    reject("num_heads", std::to_string(c.num_heads),
           "a divisor of model_dim D = " + std::to_string(c.model_dim) +
               " (each head gets D / num_heads columns)");
  }
  reject.if_outside("seq_len (S)", c.seq_len, "S", kMaxSeqLen);
  if (!std::isfinite(c.layer_norm_eps) || c.layer_norm_eps <= 0.0) {
    reject("layer_norm_eps", number_text(c.layer_norm_eps), "a finite number > 0");
  }
  if (c.moe_layers == MoeLayers::every_other_block && c.num_layers < 2) {
    reject("moe_layers", "every_other_block with num_layers (L) = " + std::to_string(c.num_layers),
           "L >= 2 (block 1 is the first MoE block), or moe_layers = none for a dense model");
  }
  if (c.moe_layers != MoeLayers::every_block && (c.dense_hidden_dim < 1 || c.dense_hidden_dim > kMaxHiddenDim)) {
    reject("dense_hidden_dim (H_dense)", std::to_string(c.dense_hidden_dim),
           "1 <= H_dense <= " + std::to_string(kMaxHiddenDim) + " when some blocks are dense (moe_layers = " +
               std::string(to_string(c.moe_layers)) + ")");
  }
  if (c.pregated && c.moe_layers == MoeLayers::none) {
    reject("pregated", "true with moe_layers = none", "pregated = false for a dense model (no gate to move)");
  }
  if (c.moe_layers != MoeLayers::none) {  // else the MoE fields are unused
    try {
      moe::validate(moe_layer_config(c, 1));
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(std::string("MoE layer: ") + error.what());
    }
  }
  const std::optional<int64_t> count = checked_parameter_count(c);
  if (!count || *count > kMaxParameters) {
    reject("parameter count", count ? std::to_string(*count) : "beyond 2^63 - 1",
           "at most " + std::to_string(kMaxParameters) + " (2^36) parameters; lower D, L, E, H or H_dense");
  }
}

std::optional<int64_t> checked_parameter_count(const ModelConfig& c) {
  const int64_t D = c.model_dim;
  const int64_t moe_count = c.moe_layers == MoeLayers::every_block         ? c.num_layers
                            : c.moe_layers == MoeLayers::every_other_block ? c.num_layers / 2
                                                                           : 0;
  const int64_t dense_count = c.num_layers - moe_count;
  const int64_t w1 = c.activation == Activation::swiglu ? 2 : 1;
  // The sums of parameter_layout.h's list: embeddings; per block LayerNorms and attention
  // (4 D + 4 D^2), then the FFN; the final LayerNorm.
  const std::optional<int64_t> embedding_rows = checked_add(kByteVocabulary + 2, c.seq_len);  // V + S + 2
  const std::optional<int64_t> D_plus_one = checked_add(D, 1);
  if (!embedding_rows || !D_plus_one) return std::nullopt;
  std::optional<int64_t> total = checked_multiply(*embedding_rows, D);
  auto add = [&](std::initializer_list<int64_t> factors) {
    const std::optional<int64_t> term = checked_product(factors);
    total = total && term ? checked_add(*total, *term) : std::nullopt;
  };
  add({c.num_layers, 4, *D_plus_one, D});
  if (dense_count > 0) add({dense_count, 2, D, c.dense_hidden_dim});  // else H_dense is unused
  if (moe_count > 0) {
    add({moe_count, D, c.num_experts});                           // gate
    add({moe_count, c.num_experts, D, w1, c.expert_hidden_dim});  // experts' W1
    add({moe_count, c.num_experts, c.expert_hidden_dim, D});      // experts' W2
  }
  return total;
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
