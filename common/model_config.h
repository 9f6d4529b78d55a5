// model_config.h: the configuration of the tiny byte-level MoE transformer language model: one
// description that the CPU reference (reference_cpu/model.h), the GPU model and trainer
// (cuda/model, cuda/train) and inference (cuda/infer) all build from. Plain C++; its JSON form is
// config_json.h, its parameters parameter_layout.h. Tested by tests/reference_cpu/test_model.cpp
// (ctest --test-dir build -R ReferenceModel) and tests/train/test_train_config.cpp.
//
// Dimension legend (README.md): V = 256 byte values, D model width, L layers (blocks),
// S sequence length, N batch (sequences), T = N * S tokens, heads with head width D / heads,
// H expert hidden width, H_dense the hidden width of a dense FFN block, E experts, K top-k, B block size.
//
// Which blocks are MoE (moe_layers):
//   every_block        every block's FFN is an MoE layer
//   every_other_block  blocks 1, 3, 5, ... are MoE, blocks 0, 2, 4, ... dense (as GShard and Switch
//                      alternate them, starting with a dense one)
//   none               a dense transformer: the baseline of the same active FLOPs
// The MoE blocks are numbered in order m_0 < m_1 < ...; pre-gating (model.h) routes MoE block m_j
// from the LayerNorm output of block m_{j-1} (reference_cpu/model.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "moe_config.h"  // MoeConfig, Formulation, Activation

namespace moe {

// Bytes: nothing to download, nothing to tokenise.
inline constexpr int64_t kByteVocabulary = 256;  // V

enum class MoeLayers { every_block, every_other_block, none };

// Upper limits, checked by validate() with the MoE layer's (moe_config.h: D <= 65,536,
// H and H_dense <= 262,144, E <= 1,024, B <= 65,536). The rule: a model of some tens of billions
// of parameters, as one node holds in fp32 with its optimizer state, is allowed; anything larger
// is a corrupt or hostile file, refused before a byte is allocated for it.
inline constexpr int64_t kMaxLayers = int64_t{1} << 10;       // L <= 1,024
inline constexpr int64_t kMaxSeqLen = int64_t{1} << 20;       // S <= 1,048,576
inline constexpr int64_t kMaxParameters = int64_t{1} << 36;  // 68,719,476,736 parameters (275 GB fp32)

// The defaults are a small model the CPU reference runs in a fraction of a second; a GPU trainer
// sets its own sizes.
struct ModelConfig {
  int64_t model_dim = 64;    // D
  int64_t num_layers = 2;    // L
  int64_t num_heads = 4;     // D % num_heads == 0
  int64_t seq_len = 64;      // S
  MoeLayers moe_layers = MoeLayers::every_block;
  int64_t dense_hidden_dim = 256;  // H_dense, the hidden width of the dense FFN blocks
  double layer_norm_eps = 1e-5;

  // The MoE layer of every MoE block (the fields of MoeConfig that are not T or D).
  int64_t num_experts = 4;         // E
  int64_t top_k = 1;               // K
  int64_t expert_hidden_dim = 64;  // H
  Formulation formulation = Formulation::dropless;
  double capacity_factor = 1.0;  // dropping / padded: C = ceil(capacity_factor * T * K / E)
  int64_t block_size = 16;       // B
  Activation activation = Activation::gelu;
  bool renormalize = false;     // rescale the K chosen router probabilities to sum to 1
  double aux_loss_coef = 0.01;  // weight of each MoE layer's load-balancing loss
  double z_loss_coef = 0.001;   // weight of each MoE layer's router z-loss

  // Pre-gated MoE (Hwang et al., ISCA 2024): MoE block m_j's gate reads block m_{j-1}'s input.
  bool pregated = false;
};

// Throws std::invalid_argument naming the field, its value and what is allowed. The MoE fields are
// checked through moe::validate on moe_layer_config(config, 1), with "MoE layer: " in front. Last,
// the parameter count (checked_parameter_count) must be at most kMaxParameters.
void validate(const ModelConfig& config);

// The number of parameters (parameter_layout.h's flat buffer, without building the list), in
// checked 64-bit arithmetic: nothing when a size is negative or the count exceeds 2^63 - 1. Does
// not validate; parameter_count (parameter_layout.h) is the validated form.
std::optional<int64_t> checked_parameter_count(const ModelConfig& config);

// True when block `layer` (0-based) has an MoE FFN.
bool is_moe_block(const ModelConfig& config, int64_t layer);

// The blocks with an MoE FFN, ascending (m_0, m_1, ...).
std::vector<int64_t> moe_blocks(const ModelConfig& config);

// The MoeConfig of every MoE layer for a batch of N sequences: T = N * S tokens, D = model_dim,
// no jitter (the model is deterministic).
MoeConfig moe_layer_config(const ModelConfig& config, int64_t batch);

std::string_view to_string(MoeLayers moe_layers);
// Throws std::invalid_argument listing the allowed names when the text matches none.
MoeLayers parse_moe_layers(std::string_view text);

}  // namespace moe
