// expert_ffn_cublas.cpp: the cuBLAS expert FFN's groups and its forward and backward
// (see expert_ffn_cublas.h).
//   cmake --build build --target moe_bench
#include "expert_ffn_cublas.h"

#include <vector>

#include "core/gemm.h"        // gemm, gemm_batched, gemm_grouped
#include "moe/activation.h"   // activation_forward / _backward

namespace moe::bench {

ExpertGroups capacity_groups(int experts, int capacity) {  // padded / dropping: E x [C, .]
  ExpertGroups g;
  for (int e = 0; e < experts; ++e) {
    g.expert.push_back(e);
    g.rows.push_back(capacity);
    g.first_row.push_back(size_t(e) * capacity);
  }
  return g;
}

ExpertGroups exact_groups(const std::vector<int>& counts) {  // dropless grouped: empty experts left out
  ExpertGroups g;
  size_t first = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) {
      g.expert.push_back(static_cast<int>(e));
      g.rows.push_back(counts[e]);
      g.first_row.push_back(first);
    }
    first += counts[e];
  }
  return g;
}

namespace {

// A matrix of the FFN in the forms the kinds read: whole (dense), and as the per-group pointer
// table (batched, grouped). T: const bf16 for the operands, bf16 for the results.
template <typename T>
struct GroupMatrix {
  T* whole;
  T* const* of;
  int ld;
};

// C = op_a(A) · op_b(B) for every expert group, in the kind's form: one GEMM over all the rows, one
// batched GEMM of C rows a group, or one grouped GEMM. A is always the group's rows [rows, a_cols]:
// read as it is (C [rows, n], k = a_cols), or transposed (the weight gradients: the product sums
// over the rows, C [a_cols, n]).
void group_product(cublasHandle_t handle, CublasKind kind, const CublasFfn& f, Op op_a, Op op_b, int a_cols, int n,
                   GroupMatrix<const bf16> a, GroupMatrix<const bf16> b, GroupMatrix<bf16> c) {
  const bool sums_rows = op_a == Op::transpose;
  const int groups = static_cast<int>(f.groups.rows.size());
  switch (kind) {
    case CublasKind::dense: {
      const int rows = int(f.rows);
      moe::cuda::gemm(handle, op_a, op_b, sums_rows ? a_cols : rows, n, sums_rows ? rows : a_cols, a.whole, a.ld,
                      b.whole, b.ld, c.whole, c.ld);
      break;
    }
    case CublasKind::batched: {
      const int rows = f.groups.rows[0];
      moe::cuda::gemm_batched(handle, op_a, op_b, sums_rows ? a_cols : rows, n, sums_rows ? rows : a_cols, a.of, a.ld,
                              b.of, b.ld, c.of, c.ld, groups);
      break;
    }
    case CublasKind::grouped: {
      const std::vector<int> cols(groups, a_cols);
      moe::cuda::gemm_grouped(handle, op_a, op_b, sums_rows ? cols : f.groups.rows, std::vector<int>(groups, n),
                              sums_rows ? f.groups.rows : cols, a.of, a.ld, b.of, b.ld, c.of, c.ld);
      break;
    }
  }
}

}  // namespace

void cublas_ffn_forward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1;
  group_product(handle, kind, f, Op::none, Op::none, D, W1, {f.x.data(), f.x_of.data(), D}, {f.w1, f.w1_of.data(), W1},
                {f.pre.data(), f.pre_of.data(), W1});
  moe::cuda::activation_forward(f.activation, f.pre.data(), f.hidden.data(), int64_t(f.rows), H, stream);
  group_product(handle, kind, f, Op::none, Op::none, H, D, {f.hidden.data(), f.hidden_of.data(), H},
                {f.w2, f.w2_of.data(), D}, {f.out.data(), f.out_of.data(), D});
}

void cublas_ffn_backward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1;
  bf16* const d_pre = f.d_pre();
  group_product(handle, kind, f, Op::none, Op::transpose, D, H, {f.d_out.data(), f.d_out_of.data(), D},
                {f.w2, f.w2_of.data(), D}, {f.d_hidden.data(), f.d_hidden_of.data(), H});
  moe::cuda::activation_backward(f.activation, f.pre.data(), f.d_hidden.data(), d_pre, int64_t(f.rows), H, stream);
  group_product(handle, kind, f, Op::transpose, Op::none, H, D, {f.hidden.data(), f.hidden_of.data(), H},
                {f.d_out.data(), f.d_out_of.data(), D}, {f.dw2.data(), f.dw2_of.data(), D});
  group_product(handle, kind, f, Op::transpose, Op::none, D, W1, {f.x.data(), f.x_of.data(), D},
                {d_pre, f.d_pre_of.data(), W1}, {f.dw1.data(), f.dw1_of.data(), W1});
  group_product(handle, kind, f, Op::none, Op::transpose, W1, D, {d_pre, f.d_pre_of.data(), W1},
                {f.w1, f.w1_of.data(), W1}, {f.dx.data(), f.dx_of.data(), D});
}

}  // namespace moe::bench
