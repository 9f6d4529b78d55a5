// optimizer_config.h: the settings of the optimizer, AdamW (Loshchilov & Hutter 2019, in PyTorch's
// form), and of its warm-up + cosine learning-rate schedule: one description that the CPU
// reference's optimizer (reference_cpu/optimizer.h) and the GPU trainer (cuda/train) both use.
// Plain C++. Tested by tests/reference_cpu/test_model.cpp (ctest --test-dir build -R ReferenceModel).
//
// Schedule, for step = 0, 1, ..., total_steps - 1 (the step about to be taken):
//   step < warmup_steps:  lr = peak * (step + 1) / warmup_steps              linear warm-up
//   otherwise:            progress = (step - warmup_steps) / (total_steps - warmup_steps)
//                         lr = min_lr + (peak - min_lr) * (1 + cos(pi * progress)) / 2
//   with min_lr = min_lr_ratio * peak; steps past the end stay at min_lr.
#pragma once

#include <cstdint>

namespace moe {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct ScheduleConfig {
  double peak_lr = 3e-3;
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;
  double min_lr_ratio = 0.1;  // the learning rate at the end, as a fraction of the peak
};

// Throws std::invalid_argument naming the field and what is allowed.
void validate(const ScheduleConfig& config);

double learning_rate(const ScheduleConfig& config, int64_t step);

}  // namespace moe
