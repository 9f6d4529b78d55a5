// dense_ffn.h: the dense feed-forward block of the non-MoE layers, forward and backward. Part of the
// CPU reference (moe::ref), used by the reference model (model.h); tested through its
// finite-difference checks (ctest --test-dir build -R ReferenceModel).
//
//   pre_activation = x w1          [T, H_dense]
//   hidden = gelu(pre_activation)  [T, H_dense]  (tanh approximation, the experts' gelu)
//   out    = hidden w2             [T, D]
// No biases, like the experts: a dense block is one expert that every token goes to with weight 1.
#pragma once

#include "expert_ffn.h"  // ExpertActivations
#include "types.h"

namespace moe::ref {

// An expert's intermediates (expert_ffn.h), here over all T tokens: pre_activation [T, H_dense],
// hidden [T, H_dense], out [T, D].
using DenseFfnForward = ExpertActivations;

struct DenseFfnGradients {
  Matrix x;   // [T, D]
  Matrix w1;  // [D, H_dense]
  Matrix w2;  // [H_dense, D]
};

DenseFfnForward dense_ffn_forward(const Matrix& x,    // [T, D]
                                  const Matrix& w1,   // [D, H_dense]
                                  const Matrix& w2);  // [H_dense, D]

DenseFfnGradients dense_ffn_backward(const Matrix& x,   // [T, D]
                                     const Matrix& w1,  // [D, H_dense]
                                     const Matrix& w2,  // [H_dense, D]
                                     const DenseFfnForward& forward,
                                     const Matrix& d_out);  // [T, D]

}  // namespace moe::ref
