// optimizer.cpp: AdamW and gradient clipping (see optimizer.h).
#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moe::ref {

void adamw_step(const AdamWConfig& config, double lr, std::vector<Parameter>& params, AdamWState& state) {
  if (state.m.empty()) {
    for (const Parameter& p : params) {
      state.m.push_back(Matrix::Zero(p.value->rows(), p.value->cols()));
      state.v.push_back(Matrix::Zero(p.value->rows(), p.value->cols()));
    }
  }
  if (state.m.size() != params.size()) {
    throw std::invalid_argument("adamw_step: the state holds moments for " + std::to_string(state.m.size()) +
                                " parameters; got " + std::to_string(params.size()));
  }
  for (const Parameter& p : params) {
    if (p.value == nullptr || p.gradient == nullptr) {
      throw std::invalid_argument("adamw_step: parameter " + p.name + " has no value or no gradient");
    }
  }
  state.step += 1;
  const double t = static_cast<double>(state.step);
  const double correction1 = 1.0 - std::pow(config.beta1, t);
  const double correction2 = 1.0 - std::pow(config.beta2, t);
  for (size_t i = 0; i < params.size(); ++i) {
    Matrix& theta = *params[i].value;
    const Matrix& g = *params[i].gradient;
    if (params[i].weight_decay) theta *= 1.0 - lr * config.weight_decay;
    state.m[i] = config.beta1 * state.m[i] + (1.0 - config.beta1) * g;
    state.v[i] = config.beta2 * state.v[i] + (1.0 - config.beta2) * g.cwiseProduct(g);
    const auto m_hat = state.m[i].array() / correction1;
    const auto v_hat = state.v[i].array() / correction2;
    theta.array() -= lr * m_hat / (v_hat.sqrt() + config.eps);
  }
}

double clip_gradient_norm(std::vector<Parameter>& params, double max_norm) {
  double squares = 0.0;
  for (const Parameter& p : params) squares += p.gradient->squaredNorm();
  const double norm = std::sqrt(squares);
  if (max_norm > 0.0 && norm > max_norm) {
    for (Parameter& p : params) *p.gradient *= max_norm / norm;
  }
  return norm;
}

}  // namespace moe::ref
