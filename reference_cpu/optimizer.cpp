// optimizer.cpp: AdamW, gradient clipping and the learning-rate schedule (see optimizer.h).
#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
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

void validate(const ScheduleConfig& c) {
  auto reject = [](std::string_view field, const std::string& value, std::string_view allowed) {
    std::ostringstream message;
    message << "invalid schedule: " << field << " = " << value << "; allowed: " << allowed;
    throw std::invalid_argument(message.str());
  };
  if (!std::isfinite(c.peak_lr) || c.peak_lr <= 0.0) reject("peak_lr", std::to_string(c.peak_lr), "a finite number > 0");
  if (c.warmup_steps < 0) reject("warmup_steps", std::to_string(c.warmup_steps), "warmup_steps >= 0");
  if (c.total_steps <= c.warmup_steps) {
    reject("total_steps", std::to_string(c.total_steps),
           "total_steps > warmup_steps = " + std::to_string(c.warmup_steps));
  }
  if (!(c.min_lr_ratio >= 0.0 && c.min_lr_ratio <= 1.0)) {
    reject("min_lr_ratio", std::to_string(c.min_lr_ratio), "0 <= min_lr_ratio <= 1");
  }
}

double learning_rate(const ScheduleConfig& c, int64_t step) {
  validate(c);
  if (step < c.warmup_steps) {
    return c.peak_lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  const double progress = std::min(
      1.0, static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.total_steps - c.warmup_steps));
  const double min_lr = c.min_lr_ratio * c.peak_lr;
  return min_lr + (c.peak_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace moe::ref
