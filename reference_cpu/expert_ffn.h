// expert_ffn.h: the expert feed-forward networks, computed expert by expert on the dispatch plan's
// rows (the dense "grouped GEMM" formulation). Part of the CPU reference (moe::ref).
//
// Expert weights are addressed per expert, as the GPU kernels address them (a table of pointers):
//   w1[e] [D, w1_columns]  w1_columns = H for GeLU; 2H for SwiGLU with the gate columns first, then up
//   w2[e] [H, D]
// For the rows r of expert e (rows [row_offsets[e], row_offsets[e+1]) of the plan):
//   pre_activation = permuted_x w1[e]                                   [n_e, w1_columns]
//   hidden = gelu(pre_activation)               (GeLU, tanh approximation)
//          = silu(pre[:, :H]) .* pre[:, H:]     (SwiGLU)                 [n_e, H]
//   out    = hidden w2[e]                                               [n_e, D]
// Padding rows are zero in permuted_x, and act(0) = 0, so their hidden and out rows are zero too.
#pragma once

#include <vector>

#include "dispatch.h"    // DispatchPlan
#include "moe_config.h"  // MoeConfig, Activation
#include "types.h"

namespace moe::ref {

// GeLU with the tanh approximation: 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))).
double gelu(double a);
double gelu_derivative(double a);
// SiLU (swish): a * sigmoid(a).
double silu(double a);
double silu_derivative(double a);

struct ExpertActivations {
  Matrix pre_activation;  // [rows, w1_columns]
  Matrix hidden;          // [rows, H]
  Matrix out;             // [rows, D]
};

struct ExpertGradients {
  Matrix permuted_x;       // [rows, D]
  std::vector<Matrix> w1;  // E x [D, w1_columns]
  std::vector<Matrix> w2;  // E x [H, D]
};

// Shapes are the caller's to check (moe_forward does); these run on a consistent plan.
ExpertActivations expert_ffn_forward(const MoeConfig& config, const DispatchPlan& plan,
                                     const Matrix& permuted_x,      // [rows, D]
                                     const std::vector<Matrix>& w1,  // E x [D, w1_columns]
                                     const std::vector<Matrix>& w2);  // E x [H, D]

ExpertGradients expert_ffn_backward(const MoeConfig& config, const DispatchPlan& plan,
                                    const Matrix& permuted_x,       // [rows, D]
                                    const std::vector<Matrix>& w1,  // E x [D, w1_columns]
                                    const std::vector<Matrix>& w2,  // E x [H, D]
                                    const ExpertActivations& forward,
                                    const Matrix& d_out);  // [rows, D]

// hidden from pre-activation, and its backward (d_pre_activation from d_hidden), row-wise.
Matrix activate(const MoeConfig& config, const Matrix& pre_activation);  // [n, w1_columns] -> [n, H]
Matrix activate_backward(const MoeConfig& config,
                         const Matrix& pre_activation,  // [n, w1_columns]
                         const Matrix& d_hidden);       // [n, H] -> [n, w1_columns]

}  // namespace moe::ref
