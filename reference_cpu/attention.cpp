// attention.cpp: causal multi-head self-attention forward and backward (see attention.h).
#include "attention.h"

#include <cmath>

namespace moe::ref {

AttentionForward attention_forward(const Matrix& x, const Matrix& qkv_weights, const Matrix& out_weights,
                                   int64_t seq_len, int64_t num_heads) {
  const int64_t T = x.rows(), D = x.cols(), S = seq_len, N = T / S, d = D / num_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionForward forward;
  forward.qkv = x * qkv_weights;
  forward.context = Matrix::Zero(T, D);
  forward.probs.reserve(N * num_heads);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const auto q = forward.qkv.block(n * S, h * d, S, d);
      const auto k = forward.qkv.block(n * S, D + h * d, S, d);
      const auto v = forward.qkv.block(n * S, 2 * D + h * d, S, d);
      const Matrix scores = scale * q * k.transpose();
      Matrix probs = Matrix::Zero(S, S);
      for (int64_t i = 0; i < S; ++i) {  // row i sees columns 0..i: the causal mask
        const double row_max = scores.row(i).head(i + 1).maxCoeff();
        probs.row(i).head(i + 1) = (scores.row(i).head(i + 1).array() - row_max).exp().matrix();
        probs.row(i).head(i + 1) /= probs.row(i).head(i + 1).sum();
      }
      forward.context.block(n * S, h * d, S, d) = probs * v;
      forward.probs.push_back(std::move(probs));
    }
  }
  forward.out = forward.context * out_weights;
  return forward;
}

AttentionGradients attention_backward(const Matrix& x, const Matrix& qkv_weights, const Matrix& out_weights,
                                      const AttentionForward& forward, const Matrix& d_out, int64_t seq_len,
                                      int64_t num_heads) {
  const int64_t T = x.rows(), D = x.cols(), S = seq_len, N = T / S, d = D / num_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionGradients grads;
  grads.out_weights = forward.context.transpose() * d_out;
  const Matrix d_context = d_out * out_weights.transpose();
  Matrix d_qkv = Matrix::Zero(T, 3 * D);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const Matrix& probs = forward.probs[n * num_heads + h];
      const auto q = forward.qkv.block(n * S, h * d, S, d);
      const auto k = forward.qkv.block(n * S, D + h * d, S, d);
      const auto v = forward.qkv.block(n * S, 2 * D + h * d, S, d);
      const auto d_ctx = d_context.block(n * S, h * d, S, d);
      const Matrix d_probs = d_ctx * v.transpose();
      d_qkv.block(n * S, 2 * D + h * d, S, d) = probs.transpose() * d_ctx;
      // softmax backward, row by row: d_scores = probs .* (d_probs - sum_j d_probs .* probs);
      // masked entries have probs = 0, so they receive no gradient.
      Matrix d_scores(S, S);
      for (int64_t i = 0; i < S; ++i) {
        const double inner = probs.row(i).dot(d_probs.row(i));
        d_scores.row(i) = probs.row(i).cwiseProduct((d_probs.row(i).array() - inner).matrix());
      }
      d_qkv.block(n * S, h * d, S, d) = scale * d_scores * k;
      d_qkv.block(n * S, D + h * d, S, d) = scale * d_scores.transpose() * q;
    }
  }
  grads.qkv_weights = x.transpose() * d_qkv;
  grads.x = d_qkv * qkv_weights.transpose();
  return grads;
}

}  // namespace moe::ref
