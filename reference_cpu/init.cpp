// init.cpp: reproducible random tensors (see init.h).
#include "init.h"

#include <cmath>

#include "uniform.h"  // uniform_symmetric

namespace moe::ref {

Matrix random_matrix(int64_t rows, int64_t cols, std::mt19937_64& generator, double scale) {
  Matrix m(rows, cols);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      m(i, j) = uniform_symmetric(generator, scale);
    }
  }
  return m;
}

MoeWeights random_weights(const MoeConfig& config, uint64_t seed) {
  validate(config);
  std::mt19937_64 generator(seed);
  const int64_t D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
  const double input_scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double hidden_scale = 1.0 / std::sqrt(static_cast<double>(H));
  MoeWeights weights;
  weights.gate_weights = random_matrix(D, E, generator, input_scale);
  for (int64_t e = 0; e < E; ++e) weights.w1.push_back(random_matrix(D, w1_columns(config), generator, input_scale));
  for (int64_t e = 0; e < E; ++e) weights.w2.push_back(random_matrix(H, D, generator, hidden_scale));
  return weights;
}

}  // namespace moe::ref
