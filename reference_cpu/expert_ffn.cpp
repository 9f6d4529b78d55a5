// expert_ffn.cpp: per-expert FFN forward and backward (see expert_ffn.h).
#include "expert_ffn.h"

#include <cmath>

namespace moe::ref {

namespace {
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
}  // namespace

double gelu(double a) {
  return 0.5 * a * (1.0 + std::tanh(kGeluScale * (a + kGeluCubic * a * a * a)));
}

double gelu_derivative(double a) {
  const double th = std::tanh(kGeluScale * (a + kGeluCubic * a * a * a));
  return 0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * kGeluScale * (1.0 + 3.0 * kGeluCubic * a * a);
}

double silu(double a) { return a / (1.0 + std::exp(-a)); }

double silu_derivative(double a) {
  const double sigmoid = 1.0 / (1.0 + std::exp(-a));
  return sigmoid * (1.0 + a * (1.0 - sigmoid));
}

Matrix activate(const MoeConfig& config, const Matrix& pre) {
  const int64_t H = config.hidden_dim;
  if (config.activation == Activation::gelu) return pre.unaryExpr([](double a) { return gelu(a); });
  const Matrix gate = pre.leftCols(H).unaryExpr([](double a) { return silu(a); });
  return gate.cwiseProduct(pre.rightCols(H));
}

Matrix activate_backward(const MoeConfig& config, const Matrix& pre, const Matrix& d_hidden) {
  const int64_t H = config.hidden_dim;
  if (config.activation == Activation::gelu) {
    return d_hidden.cwiseProduct(pre.unaryExpr([](double a) { return gelu_derivative(a); }));
  }
  Matrix d_pre(pre.rows(), 2 * H);
  d_pre.leftCols(H) = d_hidden.cwiseProduct(pre.rightCols(H))
                          .cwiseProduct(pre.leftCols(H).unaryExpr([](double a) { return silu_derivative(a); }));
  d_pre.rightCols(H) = d_hidden.cwiseProduct(pre.leftCols(H).unaryExpr([](double a) { return silu(a); }));
  return d_pre;
}

ExpertActivations expert_ffn_forward(const MoeConfig& config, const DispatchPlan& plan,
                                     const Matrix& permuted_x, const std::vector<Matrix>& w1,
                                     const std::vector<Matrix>& w2) {
  const int64_t rows = plan.total_rows;
  ExpertActivations out;
  out.pre_activation.resize(rows, w1_columns(config));
  out.hidden.resize(rows, config.hidden_dim);
  out.out.resize(rows, config.model_dim);
  for (int64_t e = 0; e < plan.num_experts; ++e) {
    const int64_t first = plan.row_offsets[e], n = plan.rows_per_expert[e];
    out.pre_activation.middleRows(first, n).noalias() = permuted_x.middleRows(first, n) * w1[e];
    out.hidden.middleRows(first, n) = activate(config, out.pre_activation.middleRows(first, n));
    out.out.middleRows(first, n).noalias() = out.hidden.middleRows(first, n) * w2[e];
  }
  return out;
}

ExpertGradients expert_ffn_backward(const MoeConfig& config, const DispatchPlan& plan,
                                    const Matrix& permuted_x, const std::vector<Matrix>& w1,
                                    const std::vector<Matrix>& w2, const ExpertActivations& forward,
                                    const Matrix& d_out) {
  ExpertGradients grads;
  grads.permuted_x.resize(plan.total_rows, config.model_dim);
  grads.w1.resize(plan.num_experts);
  grads.w2.resize(plan.num_experts);
  for (int64_t e = 0; e < plan.num_experts; ++e) {
    const int64_t first = plan.row_offsets[e], n = plan.rows_per_expert[e];
    const auto d_out_e = d_out.middleRows(first, n);
    grads.w2[e] = forward.hidden.middleRows(first, n).transpose() * d_out_e;
    const Matrix d_hidden = d_out_e * w2[e].transpose();
    const Matrix d_pre = activate_backward(config, forward.pre_activation.middleRows(first, n), d_hidden);
    grads.w1[e] = permuted_x.middleRows(first, n).transpose() * d_pre;
    grads.permuted_x.middleRows(first, n).noalias() = d_pre * w1[e].transpose();
  }
  return grads;
}

}  // namespace moe::ref
