// layer_norm.h: LayerNorm over the model width, forward and backward. Part of the CPU reference
// (moe::ref), used by the reference model (model.h); tested through its finite-difference checks
// (ctest --test-dir build -R ReferenceModel).
//
// For every row x of [T, D]:
//   mean = (1/D) sum_j x_j,   var = (1/D) sum_j (x_j - mean)^2   (biased, as PyTorch)
//   rstd = 1 / sqrt(var + eps),   x_hat = (x - mean) * rstd
//   y    = x_hat .* gain + bias
// Backward, with g = dy .* gain:
//   dx   = rstd * (g - mean(g) - x_hat * mean(g .* x_hat))
//   dgain = sum over rows of dy .* x_hat,   dbias = sum over rows of dy
#pragma once

#include "types.h"

namespace moe::ref {

struct LayerNormForward {
  Matrix y;       // [T, D]
  Matrix x_hat;   // [T, D] the normalised input, before gain and bias
  Vector rstd;    // [T]    1 / sqrt(var + eps) per row
};

struct LayerNormGradients {
  Matrix x;     // [T, D]
  Matrix gain;  // [1, D]
  Matrix bias;  // [1, D]
};

LayerNormForward layer_norm_forward(const Matrix& x,     // [T, D]
                                    const Matrix& gain,  // [1, D]
                                    const Matrix& bias,  // [1, D]
                                    double eps);

LayerNormGradients layer_norm_backward(const LayerNormForward& forward,
                                       const Matrix& gain,  // [1, D]
                                       const Matrix& dy);   // [T, D]

}  // namespace moe::ref
