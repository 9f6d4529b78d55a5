// permute.cpp: gather into expert order and weighted scatter back (see permute.h).
#include "permute.h"

namespace moe::ref {

Matrix permute_tokens(const DispatchPlan& plan, const Matrix& x) {
  Matrix permuted = Matrix::Zero(plan.total_rows, x.cols());
  for (int64_t row = 0; row < plan.total_rows; ++row) {
    const int32_t slot = plan.row_slot[row];
    if (slot >= 0) permuted.row(row) = x.row(slot / plan.top_k);
  }
  return permuted;
}

Matrix unpermute_and_combine(const DispatchPlan& plan, const Matrix& combine_weights,
                             const Matrix& expert_out) {
  Matrix y = Matrix::Zero(plan.tokens, expert_out.cols());
  for (int64_t t = 0; t < plan.tokens; ++t) {
    for (int64_t k = 0; k < plan.top_k; ++k) {
      const int32_t row = plan.slot_row[t * plan.top_k + k];
      if (row >= 0) y.row(t) += combine_weights(t, k) * expert_out.row(row);
    }
  }
  return y;
}

}  // namespace moe::ref
