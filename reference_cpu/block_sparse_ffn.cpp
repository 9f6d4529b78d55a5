// block_sparse_ffn.cpp: the dropless expert FFN through SDD / DSD / DDS (see block_sparse_ffn.h).
#include "block_sparse_ffn.h"

#include "block_sparse.h"  // sdd, dsd, dds

namespace moe::ref {

Matrix concat_expert_columns(const std::vector<Matrix>& per_expert, int64_t first, int64_t count) {
  const int64_t E = static_cast<int64_t>(per_expert.size());
  Matrix out(per_expert.front().rows(), E * count);
  for (int64_t e = 0; e < E; ++e) out.middleCols(e * count, count) = per_expert[e].middleCols(first, count);
  return out;
}

Matrix concat_expert_rows(const std::vector<Matrix>& per_expert) {
  const int64_t R = per_expert.front().rows();
  Matrix out(R * static_cast<int64_t>(per_expert.size()), per_expert.front().cols());
  for (size_t e = 0; e < per_expert.size(); ++e) out.middleRows(static_cast<int64_t>(e) * R, R) = per_expert[e];
  return out;
}

BlockSparseActivations block_sparse_ffn_forward(const MoeConfig& config,
                                                const BlockSparseTopology& topology,
                                                const Matrix& permuted_x, const std::vector<Matrix>& w1,
                                                const std::vector<Matrix>& w2) {
  const int64_t H = config.hidden_dim;
  const bool swiglu = config.activation == Activation::swiglu;
  BlockSparseActivations out;
  out.pre_activation = sdd(permuted_x, concat_expert_columns(w1, 0, H), topology);
  if (swiglu) {
    out.up_projection = sdd(permuted_x, concat_expert_columns(w1, H, H), topology);
    out.hidden = out.pre_activation.unaryExpr([](double a) { return silu(a); })
                     .cwiseProduct(out.up_projection);
  } else {
    out.hidden = out.pre_activation.unaryExpr([](double a) { return gelu(a); });
  }
  out.out = dsd(topology, out.hidden, /*transpose_s=*/false, concat_expert_rows(w2));
  return out;
}

ExpertGradients block_sparse_ffn_backward(const MoeConfig& config,
                                          const BlockSparseTopology& topology,
                                          const Matrix& permuted_x, const std::vector<Matrix>& w1,
                                          const std::vector<Matrix>& w2,
                                          const BlockSparseActivations& forward, const Matrix& d_out) {
  const int64_t E = config.num_experts, H = config.hidden_dim;
  const bool swiglu = config.activation == Activation::swiglu;

  const Matrix d_w2_cat = dsd(topology, forward.hidden, /*transpose_s=*/true, d_out);  // [E*H, D]
  const Matrix w2_cat_t = concat_expert_rows(w2).transpose();                            // [D, E*H]
  const Matrix d_hidden = sdd(d_out, w2_cat_t, topology);                                // blocks

  // The activation is elementwise, so its backward works on the blocks directly.
  Matrix d_pre, d_up;
  if (swiglu) {
    d_pre = d_hidden.cwiseProduct(forward.up_projection)
                .cwiseProduct(forward.pre_activation.unaryExpr([](double a) { return silu_derivative(a); }));
    d_up = d_hidden.cwiseProduct(forward.pre_activation.unaryExpr([](double a) { return silu(a); }));
  } else {
    d_pre = d_hidden.cwiseProduct(forward.pre_activation.unaryExpr([](double a) { return gelu_derivative(a); }));
  }

  const Matrix permuted_x_t = permuted_x.transpose();  // [D, rows]
  const Matrix d_w1_gate = dds(permuted_x_t, topology, d_pre, /*transpose_s=*/false);  // [D, E*H]
  Matrix d_permuted_x =
      dsd(topology, d_pre, /*transpose_s=*/false, concat_expert_columns(w1, 0, H).transpose());
  Matrix d_w1_up;
  if (swiglu) {
    d_w1_up = dds(permuted_x_t, topology, d_up, /*transpose_s=*/false);
    d_permuted_x += dsd(topology, d_up, /*transpose_s=*/false, concat_expert_columns(w1, H, H).transpose());
  }

  // Split the concatenated gradients back into per-expert matrices.
  ExpertGradients grads;
  grads.permuted_x = std::move(d_permuted_x);
  grads.w1.resize(E);
  grads.w2.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    grads.w2[e] = d_w2_cat.middleRows(e * H, H);
    grads.w1[e].resize(config.model_dim, w1_columns(config));
    grads.w1[e].leftCols(H) = d_w1_gate.middleCols(e * H, H);
    if (swiglu) grads.w1[e].rightCols(H) = d_w1_up.middleCols(e * H, H);
  }
  return grads;
}

}  // namespace moe::ref
