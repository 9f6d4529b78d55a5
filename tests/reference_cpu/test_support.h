// test_support.h: small helpers shared by the tests of the CPU reference (tests/reference_cpu).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>

#include "init.h"        // random_matrix, random_weights
#include "model.h"       // ModelConfig, ModelWeights, parameters (random_test_weights)
#include "moe_config.h"  // MoeConfig
#include "types.h"

namespace moe::ref::testing {

// A small layer with every feature on; tests change what they study.
inline MoeConfig small_config(Formulation formulation, Activation activation = Activation::gelu,
                              bool renormalize = false) {
  MoeConfig config;
  config.tokens = 7;  // not a multiple of B
  config.model_dim = 5;
  config.hidden_dim = 4;
  config.num_experts = 4;
  config.top_k = 2;
  config.formulation = formulation;
  config.capacity_factor = 0.75;  // C = ceil(0.75 * 7 * 2 / 4) = 3: dropping really drops
  config.block_size = 2;
  config.activation = activation;
  config.renormalize = renormalize;
  config.jitter_eps = 0.1;
  config.seed = 1234;
  config.aux_loss_coef = 0.3;
  config.z_loss_coef = 0.2;
  return config;
}

// Fresh random values in [-1, 1), never zeros.
inline Matrix random_input(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 generator(seed);
  return random_matrix(rows, cols, generator, 1.0);
}

// max |actual - expected| / max |expected| (the infinity-norm relative error).
inline double relative_error(const Matrix& actual, const Matrix& expected) {
  const double scale = std::max(expected.cwiseAbs().maxCoeff(), 1e-300);
  return (actual - expected).cwiseAbs().maxCoeff() / scale;
}

// Random bytes in [0, 256): a batch of [rows, cols] token ids for the byte-level model.
inline IndexMatrix random_bytes(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 generator(seed);
  IndexMatrix bytes(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i) {
    for (Eigen::Index j = 0; j < cols; ++j) bytes(i, j) = static_cast<int32_t>(generator() % kByteVocabulary);
  }
  return bytes;
}

// Weights far from the initialisation, so attention is not uniform, the routing is far from
// balanced and every gradient is O(1e-3..1): matrices uniform with scale 1/sqrt(rows) (embeddings
// 1), gains 1 +- 0.3, biases +- 0.3.
inline ModelWeights random_test_weights(const ModelConfig& config, uint64_t seed) {
  ModelWeights weights = zero_weights(config);
  ModelGradients unused = zero_weights(config);
  std::mt19937_64 generator(seed);
  for (Parameter& p : parameters(config, weights, unused)) {
    Matrix& m = *p.value;
    if (p.name.ends_with("gain")) {
      m = Matrix::Ones(m.rows(), m.cols()) + random_matrix(m.rows(), m.cols(), generator, 0.3);
    } else if (p.name.ends_with("bias")) {
      m = random_matrix(m.rows(), m.cols(), generator, 0.3);
    } else if (p.name.ends_with("embedding")) {
      m = random_matrix(m.rows(), m.cols(), generator, 1.0);
    } else {
      m = random_matrix(m.rows(), m.cols(), generator, 1.0 / std::sqrt(static_cast<double>(m.rows())));
    }
  }
  return weights;
}

// The message of the std::invalid_argument that f throws, or "" if it throws none.
template <typename Function>
std::string invalid_argument_message(Function&& f) {
  try {
    f();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

}  // namespace moe::ref::testing
