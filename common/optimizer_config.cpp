// optimizer_config.cpp: the schedule's checks and its learning rate (see optimizer_config.h).
#include "optimizer_config.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

#include "config_rejection.h"  // ConfigRejection

namespace moe {

void validate(const ScheduleConfig& c) {
  constexpr ConfigRejection reject{"schedule"};
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

}  // namespace moe
