// router.cpp: logits, softmax, top-K and router losses of the CPU reference (see router.h).
#include "router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "checks.h"

namespace moe::ref {

Matrix jitter_noise(const MoeConfig& config, int64_t rows, int64_t cols) {
  Matrix noise = Matrix::Ones(rows, cols);
  if (config.jitter_eps == 0.0) return noise;
  std::mt19937_64 generator(config.seed);
  const double eps = config.jitter_eps;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      // Our own uniform instead of std::uniform_real_distribution, whose algorithm differs between
      // standard libraries; a GPU test can then regenerate the same noise bit for bit.
      const double u = static_cast<double>(generator() >> 11) * 0x1.0p-53;
      noise(i, j) = 1.0 - eps + 2.0 * eps * u;
    }
  }
  return noise;
}

RouterOutput route(const MoeConfig& config, const Matrix& x, const Matrix& gate_weights) {
  validate(config);
  const int64_t T = config.tokens, D = config.model_dim, E = config.num_experts, K = config.top_k;
  check_shape("x", x, T, D, "[T, D]");
  check_shape("gate_weights", gate_weights, D, E, "[D, E]");
  check_finite("x", x);
  check_finite("gate_weights", gate_weights);

  RouterOutput out;
  out.jitter_noise = jitter_noise(config, T, D);
  out.logits = x.cwiseProduct(out.jitter_noise) * gate_weights;

  // ---- softmax, computed after subtracting the row max so exp never overflows ----
  out.probs.resize(T, E);
  out.logsumexp.resize(T);
  for (int64_t t = 0; t < T; ++t) {
    const double row_max = out.logits.row(t).maxCoeff();
    const auto shifted = (out.logits.row(t).array() - row_max).exp();
    const double sum = shifted.sum();
    out.probs.row(t) = shifted / sum;
    out.logsumexp(t) = row_max + std::log(sum);
  }

  // ---- top-K: descending probability, equal probabilities to the lower expert index ----
  out.top_experts.resize(T, K);
  out.top_probs.resize(T, K);
  out.combine_weights.resize(T, K);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return out.probs(t, a) > out.probs(t, b); });
    for (int64_t k = 0; k < K; ++k) {
      out.top_experts(t, k) = order[k];
      out.top_probs(t, k) = out.probs(t, order[k]);
    }
    out.combine_weights.row(t) = out.top_probs.row(t);
    if (config.renormalize) out.combine_weights.row(t) /= out.top_probs.row(t).sum();
  }

  // ---- router losses ----
  out.expert_fraction = Vector::Zero(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) out.expert_fraction(out.top_experts(t, k)) += 1.0;
  }
  out.expert_fraction /= static_cast<double>(T * K);
  out.mean_probs = out.probs.colwise().mean().transpose();
  out.aux_loss = static_cast<double>(E) * out.expert_fraction.dot(out.mean_probs);
  out.z_loss = out.logsumexp.squaredNorm() / static_cast<double>(T);
  return out;
}

Matrix router_backward(const MoeConfig& config, const RouterOutput& router, const Matrix& d_combine,
                       int64_t tokens, const Vector& expert_fraction) {
  const int64_t rows = router.probs.rows(), E = config.num_experts, K = config.top_k;
  check_shape("d_combine", d_combine, rows, K, "[rows, K]");
  if (expert_fraction.size() != E || tokens < rows || tokens < 1) {
    throw std::invalid_argument("router_backward: expected expert_fraction of E = " + std::to_string(E) +
                                " entries and tokens >= " + std::to_string(std::max<int64_t>(rows, 1)) +
                                "; got " + std::to_string(expert_fraction.size()) + " and " +
                                std::to_string(tokens));
  }

  // ---- combine weights -> router probabilities ----
  Matrix d_probs = Matrix::Zero(rows, E);
  for (int64_t t = 0; t < rows; ++t) {
    if (config.renormalize) {
      // w_k = p_k / S with S = sum_j p_j:  dL/dp_k = (dw_k - sum_j dw_j w_j) / S
      const double sum = router.top_probs.row(t).sum();
      const double weighted = d_combine.row(t).dot(router.combine_weights.row(t));
      for (int64_t k = 0; k < K; ++k) {
        d_probs(t, router.top_experts(t, k)) += (d_combine(t, k) - weighted) / sum;
      }
    } else {
      for (int64_t k = 0; k < K; ++k) d_probs(t, router.top_experts(t, k)) += d_combine(t, k);
    }
  }
  // aux = E sum_e f_e P_e with P_e = mean over all T tokens of probs[t, e]: dL/dprobs[t, e] = coef E f_e / T
  const double aux_scale = config.aux_loss_coef * static_cast<double>(E) / static_cast<double>(tokens);
  d_probs.rowwise() += aux_scale * expert_fraction.transpose();

  // ---- softmax backward, then the z-loss: d lse_t / d logits[t, e] = probs[t, e] ----
  Matrix d_logits(rows, E);
  for (int64_t t = 0; t < rows; ++t) {
    const double inner = router.probs.row(t).dot(d_probs.row(t));
    d_logits.row(t) = router.probs.row(t).cwiseProduct((d_probs.row(t).array() - inner).matrix());
    const double z_scale = config.z_loss_coef * 2.0 * router.logsumexp(t) / static_cast<double>(tokens);
    d_logits.row(t) += z_scale * router.probs.row(t);
  }
  return d_logits;
}

}  // namespace moe::ref
