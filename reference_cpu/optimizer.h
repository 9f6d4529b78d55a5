// optimizer.h: AdamW with decoupled weight decay and gradient clipping by the global norm, in
// double: the oracle of the GPU optimizer. Part of the CPU reference (moe::ref); tested by
// tests/reference_cpu/test_model.cpp (ctest --test-dir build -R ReferenceModel).
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
// AdamWConfig, ScheduleConfig and learning_rate: common/optimizer_config.h (the GPU trainer's too).
#pragma once

#include <cstdint>
#include <vector>

#include "model.h"             // Parameter
#include "optimizer_config.h"  // AdamWConfig
#include "types.h"

namespace moe::ref {

struct AdamWState {
  int64_t step = 0;            // steps taken; the next step is step + 1 in the bias corrections
  std::vector<Matrix> m, v;    // first and second moments, one per parameter, zeros at first
};

// One step on every parameter, with learning rate lr. Starts the moments at zero on the first call.
void adamw_step(const AdamWConfig& config, double lr, std::vector<Parameter>& params, AdamWState& state);

// The global L2 norm of all gradients; if it exceeds max_norm, every gradient is scaled by
// max_norm / norm. Returns the norm before clipping. max_norm <= 0 only measures.
double clip_gradient_norm(std::vector<Parameter>& params, double max_norm);

}  // namespace moe::ref
