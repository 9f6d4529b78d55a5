// model/optimizer.h: the optimizer step on the GPU: the global gradient norm (deterministic, two passes),
// clipping folded into AdamW as a scale read on the device, and AdamW with decoupled weight decay
// over fp32 master weights that also refreshes their bf16 copies for the next forward. The CPU
// oracle is moe::ref::clip_gradient_norm and moe::ref::adamw_step (reference_cpu/optimizer.h), whose
// formulas these follow. Built into moe_cuda; tested by tests/cuda/test_adamw.cpp
// (ctest --test-dir build -R CudaAdamW; skips without a GPU).
//
// The learning-rate schedule (warm-up + cosine) is host arithmetic, one number per step:
// moe::learning_rate gives it, and the host passes lr and the step count here; the bias
// corrections 1 - beta^t are computed on the host in double, once per step.
//
// Precision: everything fp32 (master weights, gradients, both moments, the norm); the bf16 copies
// are rounded from the updated fp32 weights.
//
// Layout: the gradients of all parameters live in one flat fp32 buffer in the order of
// moe::parameter_layout, so the norm is one pass over one buffer. The update runs per
// parameter span (a run of the flat buffers with one weight-decay setting), e.g. once per tensor.
//
// No host synchronisation: the norm and the clip scale stay in device memory and the update reads
// the scale there; the host copies the norm back only when it wants to print it.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

// The norm's first pass always uses this many blocks, whatever the GPU: the partition of the sum,
// and so its rounding, is the same on every device and every run.
inline constexpr int kGradientNormBlocks = 256;

// norm = sqrt(sum of squares of gradients[0, count)); clip_scale = max_norm / norm where
// max_norm > 0 and norm > max_norm, else 1 (max_norm <= 0 only measures). Pass 1: block b sums
// squares of a fixed strided subset into partials[b]; pass 2: one block adds the partials in a
// fixed tree, in double.
void gradient_norm(const float* gradients,  // [count]
                   int64_t count,
                   float* partials,         // [kGradientNormBlocks] scratch
                   float* norm,             // [1]
                   float* clip_scale,       // [1]
                   float max_norm, cudaStream_t stream);

// The norm of gradients that live on several ranks (data parallel with expert parallelism: the
// replicated parameters' gradients are the same on every rank after their all-reduce, each rank's
// experts' gradients only there): each rank sums weight * g^2 over its spans (the replicated ones
// with weight 1 / R, its experts with weight 1) in the fixed order of gradient_norm (block b takes a
// strided share of every span, the partials added in a fixed tree in double), the ranks add their
// sums, and clip_scale_from_squared_norm finishes as gradient_norm does.
struct NormSpan {
  int64_t offset = 0;   // first entry in the flat gradient buffer
  int64_t count = 0;    // entries
  float weight = 1.0f;  // the factor of its squares
};
void gradient_squared_norm(const float* gradients,  // the flat buffer
                           const NormSpan* spans,   // [span_count] on the device
                           int span_count,
                           float* partials,         // [kGradientNormBlocks] scratch
                           double* squared,         // [1] the weighted sum of squares
                           cudaStream_t stream);
void clip_scale_from_squared_norm(const double* squared,  // [1] summed over ranks
                                  float* norm, float* clip_scale, float max_norm, cudaStream_t stream);

struct AdamWStep {
  float lr = 0.0f;            // from the schedule, for this step
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // 0 for spans without decay (LayerNorm gains and biases)
  int64_t step = 1;           // t = 1, 2, ...: the step being taken, for the bias corrections
};

// For each i < count, with g = gradients[i] * (*gradient_scale) (1 where gradient_scale is null):
//   theta = theta * (1 - lr * weight_decay);  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   theta = theta - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//   weights_bf16[i] = bf16(theta)   (skipped where weights_bf16 is null)
void adamw_update(const AdamWStep& step,
                  float* weights,              // [count] fp32 master weights
                  const float* gradients,      // [count]
                  float* first_moment,         // [count] m, zeros before step 1
                  float* second_moment,        // [count] v, zeros before step 1
                  bf16* weights_bf16,          // [count] the forward's copy, or null
                  const float* gradient_scale, // [1] on the device (gradient_norm's clip_scale), or null
                  int64_t count, cudaStream_t stream);

}  // namespace moe::cuda
