// expert_ffn_cublas.cpp: the cuBLAS expert FFN's groups and its forward and backward
// (see expert_ffn_cublas.h).
//   cmake --build build --target moe_bench
#include "expert_ffn_cublas.h"

#include "core/gemm.h"        // gemm, gemm_batched, gemm_grouped
#include "moe/activation.h"   // gelu_forward / _backward, swiglu_forward / _backward

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

void cublas_ffn_forward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1, groups = static_cast<int>(f.groups.rows.size());
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::none, int(f.rows), W1, D, f.x.data(), D, f.w1, W1, f.pre.data(), W1);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::none, f.groups.rows[0], W1, D, f.x_of.data(), D, f.w1_of.data(),
                              W1, f.pre_of.data(), W1, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, f.groups.rows, W1, D, f.x_of.data(), D, f.w1_of.data(), W1, f.pre_of.data(), W1);
      break;
  }
  if (f.swiglu()) {
    moe::cuda::swiglu_forward(f.pre.data(), f.hidden.data(), int64_t(f.rows), H, stream);
  } else {
    moe::cuda::gelu_forward(f.pre.data(), f.hidden.data(), f.rows * H, stream);
  }
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::none, int(f.rows), D, H, f.hidden.data(), H, f.w2, D, f.out.data(), D);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::none, f.groups.rows[0], D, H, f.hidden_of.data(), H,
                              f.w2_of.data(), D, f.out_of.data(), D, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, f.groups.rows, D, H, f.hidden_of.data(), H, f.w2_of.data(), D,
                              f.out_of.data(), D);
      break;
  }
}

void cublas_ffn_backward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1, groups = static_cast<int>(f.groups.rows.size());
  bf16* const d_pre = f.d_pre();
  const int m = int(f.rows);
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::transpose, m, H, D, f.d_out.data(), D, f.w2, D, f.d_hidden.data(), H);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::transpose, f.groups.rows[0], H, D, f.d_out_of.data(), D,
                              f.w2_of.data(), D, f.d_hidden_of.data(), H, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, Op::none, Op::transpose, f.groups.rows, std::vector<int>(groups, H),
                           std::vector<int>(groups, D), f.d_out_of.data(), D, f.w2_of.data(), D,
                           f.d_hidden_of.data(), H);
      break;
  }
  if (f.swiglu()) {
    moe::cuda::swiglu_backward(f.pre.data(), f.d_hidden.data(), d_pre, int64_t(f.rows), H, stream);
  } else {
    moe::cuda::gelu_backward(f.pre.data(), f.d_hidden.data(), d_pre, f.rows * H, stream);
  }
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::transpose, Op::none, H, D, m, f.hidden.data(), H, f.d_out.data(), D, f.dw2.data(), D);
      moe::cuda::gemm(handle, Op::transpose, Op::none, D, W1, m, f.x.data(), D, d_pre, W1, f.dw1.data(), W1);
      moe::cuda::gemm(handle, Op::none, Op::transpose, m, D, W1, d_pre, W1, f.w1, W1, f.dx.data(), D);
      break;
    case CublasKind::batched: {
      const int C = f.groups.rows[0];
      moe::cuda::gemm_batched(handle, Op::transpose, Op::none, H, D, C, f.hidden_of.data(), H, f.d_out_of.data(), D,
                              f.dw2_of.data(), D, groups);
      moe::cuda::gemm_batched(handle, Op::transpose, Op::none, D, W1, C, f.x_of.data(), D, f.d_pre_of.data(), W1,
                              f.dw1_of.data(), W1, groups);
      moe::cuda::gemm_batched(handle, Op::none, Op::transpose, C, D, W1, f.d_pre_of.data(), W1, f.w1_of.data(), W1,
                              f.dx_of.data(), D, groups);
      break;
    }
    case CublasKind::grouped: {
      const std::vector<int> all_d(groups, D), all_h(groups, H), all_w1(groups, W1);
      moe::cuda::gemm_grouped(handle, Op::transpose, Op::none, all_h, all_d, f.groups.rows, f.hidden_of.data(), H,
                           f.d_out_of.data(), D, f.dw2_of.data(), D);
      moe::cuda::gemm_grouped(handle, Op::transpose, Op::none, all_d, all_w1, f.groups.rows, f.x_of.data(), D,
                           f.d_pre_of.data(), W1, f.dw1_of.data(), W1);
      moe::cuda::gemm_grouped(handle, Op::none, Op::transpose, f.groups.rows, all_d, all_w1, f.d_pre_of.data(), W1,
                           f.w1_of.data(), W1, f.dx_of.data(), D);
      break;
    }
  }
}

}  // namespace moe::bench
