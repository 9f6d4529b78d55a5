// model/layer_norm.h: LayerNorm over the model width on the GPU, forward and backward. The CPU oracle is
// moe::ref::layer_norm_forward / layer_norm_backward (reference_cpu/layer_norm.h), whose formulas
// these kernels follow. Built into moe_cuda; tested by tests/cuda/test_layer_norm.cpp
// (ctest --test-dir build -R CudaLayerNorm; skips without a GPU).
//
// Dimension legend: T rows (tokens), D model width.
//   forward : mean, rstd = 1 / sqrt(var + eps) per row; y = (x - mean) * rstd .* gain + bias
//   backward: x_hat recomputed from x, mean and rstd (cheaper to recompute than to store [T, D]);
//             g = dy .* gain;  dx (+)= rstd * (g - mean(g) - x_hat * mean(g .* x_hat))
//             d_gain = sum over rows of dy .* x_hat,  d_bias = sum over rows of dy
//
// Precision: x, gain, bias, y bf16 (activations and the forward copies of the weights); mean and
// rstd fp32, saved by the forward for the backward; dy, dx, d_gain, d_bias fp32 (dy comes from a
// cuBLAS product or the MoE layer in fp32, dx is the residual stream's gradient, summed over blocks).
// All arithmetic in fp32.
//
// Layout: one warp per row for the statistics and dx (a row is D contiguous values). The parameter
// gradients are column sums over T rows; for determinism they are reduced in two fixed passes, no
// atomics: each chunk of kLayerNormRowsPerChunk rows gets a partial in `scratch`, then the chunks'
// partials are added in chunk order. Where D = 128 G (G <= 8) one kernel reads dy and x once for dx
// and the chunk's partials (its warps' sums added in warp order); otherwise dx is one kernel and the
// partials another (block = column slice x row chunk), each reading dy and x.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

inline constexpr int64_t kLayerNormRowsPerChunk = 64;

// The fp32 entries of the backward's scratch: [ceil(T / kLayerNormRowsPerChunk), 2, D].
int64_t layer_norm_backward_scratch_floats(int64_t rows, int64_t model_dim);

void layer_norm_forward(const bf16* x,     // [T, D]
                        const bf16* gain,  // [D]
                        const bf16* bias,  // [D]
                        bf16* y,           // [T, D]
                        float* mean,       // [T]
                        float* rstd,       // [T]
                        int64_t rows, int64_t model_dim, float eps, cudaStream_t stream);

// With accumulate_dx the input gradient is added to dx (the residual stream's gradient, which
// already holds the gradient that skips the block); otherwise dx is overwritten. A non-null dx_bf16
// also receives dx's new value rounded to bf16 (what the block below reads: a separate cast would
// read dx again).
void layer_norm_backward(const float* dy,   // [T, D]
                         const bf16* x,     // [T, D]
                         const float* mean, // [T]
                         const float* rstd, // [T]
                         const bf16* gain,  // [D]
                         float* dx,         // [T, D]
                         float* d_gain,     // [D]
                         float* d_bias,     // [D]
                         float* scratch,    // [layer_norm_backward_scratch_floats(T, D)]
                         int64_t rows, int64_t model_dim, bool accumulate_dx, cudaStream_t stream,
                         bf16* dx_bf16 = nullptr);  // [T, D] or null

}  // namespace moe::cuda
