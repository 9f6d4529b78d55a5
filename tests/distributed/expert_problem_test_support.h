// expert_problem_test_support.h: the problems the expert-parallel GPU tests share
// (test_expert_parallel_gpu.cpp, test_expert_layouts_gpu.cpp): one layer and all ranks' tokens,
// made the same on every rank from a shared seed, and the ways to shard the tokens over the ranks.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "bridge/reference_bridge.h"  // round_bf16
#include "moe_config.h"             // MoeConfig
#include "reference_cpu/init.h"     // random_matrix, random_weights
#include "reference_cpu/types.h"    // Matrix

namespace moe::dist::testing {

using ref::Matrix;

// ||got - expected|| / ||expected||, or ||got|| when the expected tensor is zero or empty.
inline double relative_error(const Matrix& got, const Matrix& expected) {
  const double norm = expected.norm();
  return norm > 0 ? (got - expected).norm() / norm : got.norm();
}

// E = 8 divides R = 1, 2, 4; T = 300 is not a multiple of B; H = 256 at B = 64 leaves H / r = 128 and
// 64 for Tutel's r = 2 and 4.
inline MoeConfig base_config() {
  MoeConfig c;
  c.tokens = 300;
  c.model_dim = 128;
  c.hidden_dim = 256;
  c.num_experts = 8;
  c.top_k = 2;
  c.block_size = 64;
  c.renormalize = true;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

// All ranks' tokens and the whole layer, the same on every rank (from a shared seed), rounded to
// bf16 so that both layers read the same values.
struct Problem {
  MoeConfig config;
  Matrix x, dy;  // [T, D]
  ref::MoeWeights weights;
};

inline Problem make_problem(const MoeConfig& config, uint64_t seed, double gate_scale = 1.0, int favoured_expert = -1) {
  std::mt19937_64 generator(seed);
  Problem p{config, Matrix(), Matrix(), ref::random_weights(config, seed + 1)};
  p.weights.gate_weights *= gate_scale;
  if (favoured_expert >= 0) p.weights.gate_weights.col(favoured_expert).array() += 50.0;  // x > 0 below
  p.weights.gate_weights = cuda::round_bf16(p.weights.gate_weights);
  for (auto& w : p.weights.w1) w = cuda::round_bf16(w);
  for (auto& w : p.weights.w2) w = cuda::round_bf16(w);
  p.x = cuda::round_bf16(ref::random_matrix(config.tokens, config.model_dim, generator));
  if (favoured_expert >= 0) p.x = p.x.cwiseAbs();
  p.dy = cuda::round_bf16(ref::random_matrix(config.tokens, config.model_dim, generator));
  return p;
}

inline std::vector<int64_t> even_shards(int64_t tokens, int ranks) {
  std::vector<int64_t> shards(ranks, tokens / ranks);
  for (int p = 0; p < tokens % ranks; ++p) ++shards[p];
  return shards;
}

// Rank p holds (p + 1) parts: uneven, the last rank the most.
inline std::vector<int64_t> uneven_shards(int64_t tokens, int ranks) {
  std::vector<int64_t> shards(ranks);
  int64_t given = 0;
  for (int p = 0; p < ranks; ++p) {
    shards[p] = p + 1 == ranks ? tokens - given : tokens * (p + 1) / (ranks * (ranks + 1) / 2);
    given += shards[p];
  }
  return shards;
}

inline int64_t offset_of(const std::vector<int64_t>& shards, int rank) {
  int64_t offset = 0;
  for (int p = 0; p < rank; ++p) offset += shards[p];
  return offset;
}

}  // namespace moe::dist::testing
