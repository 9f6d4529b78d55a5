// cross_entropy.h: the language-model loss over the 256 byte classes on the GPU, forward (the mean
// loss) and backward (d_logits, the softmax recomputed in the same pass). The CPU oracle is the
// "cross-entropy and the tied output projection" lines of moe::ref::model_forward / model_backward
// (reference_cpu/model.cpp). Built into moe_cuda; tested by tests/cuda/test_cross_entropy.cpp
// (ctest --test-dir build -R CudaCrossEntropy; skips without a GPU).
//
// Dimension legend: T = N * S positions, V = 256 byte classes.
//   losses[t]  = logsumexp(logits[t]) - logits[t, targets[t]]        nats
//   mean_loss  = (1/T) sum_t losses[t]
//   d_logits[t] = (softmax(logits[t]) - one_hot(targets[t])) / T      the gradient of mean_loss
// The logits come from the tied output projection, logits = LN_final(x) token_embedding^T, one
// cuBLAS product (gemm.h) written in fp32.
//
// Precision: logits fp32 (a log-sum-exp over 256 classes, and the loss that the run records show,
// deserve more than bf16's 3 digits), targets int32, losses and mean_loss fp32; d_logits bf16, the
// operand of the two backward products (d_x_final = d_logits E, d_E = d_logits^T x_final).
//
// A target outside 0..255 makes its loss NaN (the mean follows) and its d_logits row NaN: visible
// at once, without a host synchronisation to check the batch.
//
// Layout: one warp per position, 8 classes per lane. The mean is a second pass of one block that
// adds the T losses in a fixed order (per-thread strided sums, then a fixed tree): deterministic.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

inline constexpr int kCrossEntropyClasses = 256;  // V

void cross_entropy_forward(const float* logits,    // [T, V]
                           const int32_t* targets, // [T]
                           float* losses,          // [T]
                           float* mean_loss,       // [1]
                           int64_t positions, cudaStream_t stream);

// d_logits = d (sum of the T losses / mean_over) / d logits. mean_over is T for the mean over these
// positions (0 means T); a model trained on several ranks passes all ranks' positions, so that each
// rank's gradient is its share of the mean over the global batch.
void cross_entropy_backward(const float* logits,    // [T, V]
                            const int32_t* targets, // [T]
                            bf16* d_logits,         // [T, V]
                            int64_t positions, cudaStream_t stream, int64_t mean_over = 0);

}  // namespace moe::cuda
