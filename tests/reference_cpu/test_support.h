// test_support.h: small helpers shared by the tests of the CPU reference (tests/reference_cpu).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>

#include "init.h"        // random_matrix, random_weights
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
