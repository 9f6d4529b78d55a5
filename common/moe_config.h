// moe_config.h: the one description of an MoE layer that every part of the project shares.
//
// The CPU reference, the CUDA kernels, the distributed layer, the lessons and the run records all
// describe a layer with this struct, and all of them check it with validate() before any work, so
// a bad configuration gets the same clear message everywhere.
//
// Dimension legend (used in every file of the project):
//   T tokens, D model width, H expert hidden width, E experts, K top-k,
//   C capacity (rows per expert in the dropping / padded formulations), B block size (dropless),
//   L layers, R ranks (GPUs).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

// How the tokens routed to an expert become rows of that expert's matrix product.
enum class Formulation {
  dropping,  // capacity C per expert; tokens past C (in token order) are dropped (Switch, GShard)
  padded,    // capacity C per expert, every expert computes all C rows, empty rows are zeros
  dropless,  // every routed token is computed; each expert's rows rounded up to B (MegaBlocks)
};

enum class Activation {
  gelu,    // h = gelu(x W1), tanh approximation
  swiglu,  // h = silu(x W1_gate) * (x W1_up); W1 then holds [gate | up], 2H columns
};

// Upper limits of the sizes, checked by validate(): generous for a layer that one node runs
// (DeepSeek-V3's layer is D = 7168, H = 2048, E = 256), and small enough that any product of them
// a kernel or a reader forms stays far inside 64 bits. Each size is also at least 1.
inline constexpr int64_t kMaxTokens = int64_t{1} << 24;     // T <= 16,777,216 tokens in one call
inline constexpr int64_t kMaxModelDim = int64_t{1} << 16;   // D <= 65,536
inline constexpr int64_t kMaxHiddenDim = int64_t{1} << 18;  // H <= 262,144 (and H_dense, model_config.h)
inline constexpr int64_t kMaxExperts = int64_t{1} << 10;    // E <= 1,024; K <= E
inline constexpr int64_t kMaxBlockSize = int64_t{1} << 16;  // B <= 65,536
// capacity_factor <= 1,024 (dropping, padded): beyond E every expert has room for more rows than
// there are tokens, and E <= 1,024; it keeps C = ceil(cf T K / E) far inside 64 bits.
inline constexpr double kMaxCapacityFactor = 1024.0;

struct MoeConfig {
  int64_t tokens = 0;       // T
  int64_t model_dim = 0;    // D
  int64_t hidden_dim = 0;   // H
  int64_t num_experts = 0;  // E
  int64_t top_k = 1;        // K
  Formulation formulation = Formulation::dropless;
  double capacity_factor = 1.0;  // dropping / padded: C = ceil(capacity_factor * T * K / E)
  int64_t block_size = 128;      // B: dropless rows per block, and the block width over H
  Activation activation = Activation::gelu;
  bool renormalize = false;   // rescale the K chosen router probabilities to sum to 1
  double jitter_eps = 0.0;    // router input multiplied by U(1 - eps, 1 + eps) (Switch); 0 = off
  uint64_t seed = 0;          // seeds the jitter noise
  double aux_loss_coef = 0.0;  // weight of the load-balancing loss E * sum_e f_e * P_e
  double z_loss_coef = 0.0;    // weight of the router z-loss mean_t (logsumexp_e logits)^2
};

// Throws std::invalid_argument naming the field, its value and what is allowed (the limits above
// included).
void validate(const MoeConfig& config);

// Rows per expert in the dropping and padded formulations: C = ceil(capacity_factor * T * K / E).
int64_t capacity(const MoeConfig& config);

// Columns of W1 per expert: H for GeLU, 2H for SwiGLU (gate and up projections side by side).
int64_t w1_columns(const MoeConfig& config);

std::string_view to_string(Formulation formulation);
std::string_view to_string(Activation activation);
// Throw std::invalid_argument listing the allowed names when the text matches none.
Formulation parse_formulation(std::string_view text);
Activation parse_activation(std::string_view text);

}  // namespace moe
