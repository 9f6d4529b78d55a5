// optimizer.h: AdamW with decoupled weight decay, gradient clipping by the global norm, and the
// warm-up + cosine learning-rate schedule, in double: the oracle of the GPU optimizer. Part of the
// CPU reference (moe::ref); tested by tests/reference_cpu/test_model.cpp
// (ctest --test-dir build -R ReferenceModel).
//
// AdamW (Loshchilov & Hutter 2019, in PyTorch's form), at step t = 1, 2, ... for each entry:
//   theta = theta * (1 - lr * weight_decay)          only where Parameter::weight_decay
//   m     = beta1 m + (1 - beta1) g
//   v     = beta2 v + (1 - beta2) g^2
//   theta = theta - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// Weight decay pulls weights towards zero. It applies to the matrices (embeddings, attention, FFN,
// gates, experts) and not to the LayerNorm gains and biases: decaying a gain pulls it towards 0,
// not towards its natural value 1, and a bias or a gain has too few entries to overfit with
// (GPT-2 / nanoGPT's rule: decay every tensor of rank 2, none of rank 1).
//
// Schedule, for step = 0, 1, ..., total_steps - 1 (the step about to be taken):
//   step < warmup_steps:  lr = peak * (step + 1) / warmup_steps              linear warm-up
//   otherwise:            progress = (step - warmup_steps) / (total_steps - warmup_steps)
//                         lr = min_lr + (peak - min_lr) * (1 + cos(pi * progress)) / 2
//   with min_lr = min_lr_ratio * peak; steps past the end stay at min_lr.
#pragma once

#include <cstdint>
#include <vector>

#include "model.h"  // Parameter
#include "types.h"

namespace moe::ref {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct AdamWState {
  int64_t step = 0;            // steps taken; the next step is step + 1 in the bias corrections
  std::vector<Matrix> m, v;    // first and second moments, one per parameter, zeros at first
};

// One step on every parameter, with learning rate lr. Starts the moments at zero on the first call.
void adamw_step(const AdamWConfig& config, double lr, std::vector<Parameter>& params, AdamWState& state);

// The global L2 norm of all gradients; if it exceeds max_norm, every gradient is scaled by
// max_norm / norm. Returns the norm before clipping. max_norm <= 0 only measures.
double clip_gradient_norm(std::vector<Parameter>& params, double max_norm);

struct ScheduleConfig {
  double peak_lr = 3e-3;
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;
  double min_lr_ratio = 0.1;  // the learning rate at the end, as a fraction of the peak
};

// Throws std::invalid_argument naming the field and what is allowed.
void validate(const ScheduleConfig& config);

double learning_rate(const ScheduleConfig& config, int64_t step);

}  // namespace moe::ref
