// permute.h: applying a dispatch plan: gather tokens into expert order, and scatter expert outputs
// back to tokens, weighted by the router. Part of the CPU reference (moe::ref).
//
//   permuted_x[r]   = x[t]            for the row r of slot (t, k); zero for padding rows
//   y[t]            = sum_k combine_weights[t, k] * expert_out[row of (t, k)]; dropped slots add 0
#pragma once

#include "dispatch.h"  // DispatchPlan
#include "types.h"

namespace moe::ref {

Matrix permute_tokens(const DispatchPlan& plan,
                      const Matrix& x);  // [T, D] -> [rows, D]

Matrix unpermute_and_combine(const DispatchPlan& plan,
                             const Matrix& combine_weights,  // [T, K]
                             const Matrix& expert_out);      // [rows, D] -> [T, D]

}  // namespace moe::ref
