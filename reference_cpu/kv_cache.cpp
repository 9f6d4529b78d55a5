// kv_cache.cpp: attention over cached keys and values (see kv_cache.h).
#include "kv_cache.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace moe::ref {

KvCache make_kv_cache(const ModelConfig& config, int64_t batch) {
  validate(config);
  if (batch < 1) throw std::invalid_argument("kv cache batch (N) = " + std::to_string(batch) + "; expected N >= 1");
  KvCache cache;
  cache.capacity = config.seq_len;
  cache.lengths.assign(batch, 0);
  cache.layers.resize(config.num_layers);
  for (LayerKvCache& layer : cache.layers) {
    layer.keys.assign(batch, Matrix::Zero(config.seq_len, config.model_dim));
    layer.values.assign(batch, Matrix::Zero(config.seq_len, config.model_dim));
  }
  return cache;
}

Matrix cached_attention_forward(const Matrix& x, const Matrix& qkv_weights, const Matrix& out_weights,
                                int64_t num_heads, const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& counts, LayerKvCache& cache) {
  const int64_t D = x.cols(), d = D / num_heads, N = static_cast<int64_t>(lengths.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Matrix qkv = x * qkv_weights;  // [T_new, 3D]
  Matrix context = Matrix::Zero(x.rows(), D);
  int64_t row = 0;  // first row of sequence n in this step
  for (int64_t n = 0; n < N; ++n) {
    Matrix& keys = cache.keys[n];
    Matrix& values = cache.values[n];
    // Write every new key and value first: a step of several tokens (a prefill) attends among them.
    for (int64_t i = 0; i < counts[n]; ++i) {
      keys.row(lengths[n] + i) = qkv.block(row + i, D, 1, D);
      values.row(lengths[n] + i) = qkv.block(row + i, 2 * D, 1, D);
    }
    for (int64_t i = 0; i < counts[n]; ++i) {
      const int64_t visible = lengths[n] + i + 1;  // positions 0..lengths[n] + i: the causal mask
      for (int64_t h = 0; h < num_heads; ++h) {
        const auto q = qkv.block(row + i, h * d, 1, d);
        const auto k = keys.block(0, h * d, visible, d);
        const auto v = values.block(0, h * d, visible, d);
        const Eigen::RowVectorXd scores = scale * q * k.transpose();
        Eigen::RowVectorXd probs = (scores.array() - scores.maxCoeff()).exp().matrix();
        probs /= probs.sum();
        context.block(row + i, h * d, 1, d) = probs * v;
      }
    }
    row += counts[n];
  }
  return context * out_weights;
}

}  // namespace moe::ref
