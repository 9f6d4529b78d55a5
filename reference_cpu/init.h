// init.h: reproducible random tensors and layer weights for tests, lessons and GPU comparisons.
// Part of the CPU reference (moe::ref).
//
// Values come from std::mt19937_64(seed) through common/uniform.h's draw: the same seed gives the
// same tensor on every platform, so a GPU program can regenerate an input instead of loading it.
#pragma once

#include <cstdint>
#include <random>

#include "moe_config.h"  // MoeConfig
#include "moe_layer.h"   // MoeWeights
#include "types.h"

namespace moe::ref {

// Uniform in [-scale, scale), drawn in row-major order.
Matrix random_matrix(int64_t rows, int64_t cols, std::mt19937_64& generator, double scale = 1.0);

// gate_weights and w1 scaled by 1/sqrt(D), w2 by 1/sqrt(H) (uniform, so the outputs stay O(1)).
MoeWeights random_weights(const MoeConfig& config, uint64_t seed);

}  // namespace moe::ref
