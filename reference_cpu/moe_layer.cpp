// moe_layer.cpp: forward and backward of the whole MoE layer (see moe_layer.h).
#include "moe_layer.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "block_sparse_ffn.h"  // block_sparse_ffn_forward / backward
#include "checks.h"
#include "expert_ffn.h"  // expert_ffn_forward / backward
#include "permute.h"     // permute_tokens, unpermute_and_combine

namespace moe::ref {

void check_layer_inputs(const MoeConfig& config, const Matrix& x, const MoeWeights& weights) {
  validate(config);
  const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
  check_shape("x", x, T, D, "[T, D]");
  check_shape("gate_weights", weights.gate_weights, D, E, "[D, E]");
  check_expert_matrices("w1", weights.w1, E, D, w1_columns(config), "[D, w1_columns]");
  check_expert_matrices("w2", weights.w2, E, H, D, "[H, D]");
  check_finite("x", x);
  check_finite("gate_weights", weights.gate_weights);
}

LayerForward moe_forward(const MoeConfig& config, const Matrix& x, const MoeWeights& weights) {
  check_layer_inputs(config, x, weights);
  RouterOutput router = route(config, x, weights.gate_weights);
  DispatchPlan plan = plan_dispatch(config, router.top_experts);
  return moe_forward_routed(config, x, weights, std::move(router), std::move(plan));
}

LayerForward moe_forward_routed(const MoeConfig& config, const Matrix& x, const MoeWeights& weights,
                                RouterOutput router, DispatchPlan plan) {
  LayerForward forward;
  forward.router = std::move(router);
  forward.plan = std::move(plan);
  if (config.formulation == Formulation::dropless) forward.topology = make_topology(config, forward.plan);

  forward.permuted_x = permute_tokens(forward.plan, x);
  ExpertActivations experts = expert_ffn_forward(config, forward.plan, forward.permuted_x, weights.w1, weights.w2);
  forward.pre_activation = std::move(experts.pre_activation);
  forward.hidden = std::move(experts.hidden);
  forward.expert_out = std::move(experts.out);
  forward.y = unpermute_and_combine(forward.plan, forward.router.combine_weights, forward.expert_out);
  forward.aux_loss = forward.router.aux_loss;
  forward.z_loss = forward.router.z_loss;
  return forward;
}

double moe_objective(const MoeConfig& config, const LayerForward& forward, const Matrix& dy) {
  return dy.cwiseProduct(forward.y).sum() + config.aux_loss_coef * forward.aux_loss +
         config.z_loss_coef * forward.z_loss;
}

LayerGradients moe_backward(const MoeConfig& config, const Matrix& x, const MoeWeights& weights,
                            const LayerForward& forward, const Matrix& dy, ExpertPath path) {
  check_layer_inputs(config, x, weights);
  check_shape("dy", dy, config.tokens, config.model_dim, "[T, D]");
  check_finite("dy", dy);
  const int64_t T = config.tokens, K = config.top_k;
  const DispatchPlan& plan = forward.plan;
  const RouterOutput& router = forward.router;

  // ---- combine: y[t] = sum_k w[t,k] out[row(t,k)] ----
  Matrix d_expert_out = Matrix::Zero(plan.total_rows, config.model_dim);
  Matrix d_combine = Matrix::Zero(T, K);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = plan.slot_row[t * K + k];
      if (row < 0) continue;  // a dropped slot adds nothing to y, so nothing flows back through it
      d_expert_out.row(row) = router.combine_weights(t, k) * dy.row(t);
      d_combine(t, k) = dy.row(t).dot(forward.expert_out.row(row));
    }
  }

  // ---- experts ----
  ExpertGradients experts;
  if (path == ExpertPath::block_sparse) {
    if (!forward.topology) {
      throw std::invalid_argument("moe_backward: ExpertPath::block_sparse needs the dropless formulation; got " +
                                  std::string(to_string(config.formulation)));
    }
    const BlockSparseActivations blocks =
        block_sparse_ffn_forward(config, *forward.topology, forward.permuted_x, weights.w1, weights.w2);
    experts = block_sparse_ffn_backward(config, *forward.topology, forward.permuted_x, weights.w1,
                                        weights.w2, blocks, d_expert_out);
  } else {
    const ExpertActivations activations{forward.pre_activation, forward.hidden, forward.expert_out};
    experts = expert_ffn_backward(config, plan, forward.permuted_x, weights.w1, weights.w2,
                                  activations, d_expert_out);
  }

  LayerGradients grads;
  grads.w1 = std::move(experts.w1);
  grads.w2 = std::move(experts.w2);
  grads.x = Matrix::Zero(T, config.model_dim);
  for (int64_t row = 0; row < plan.total_rows; ++row) {  // un-permute: each row came from one token
    const int32_t slot = plan.row_slot[row];
    if (slot >= 0) grads.x.row(slot / K) += experts.permuted_x.row(row);
  }

  // ---- the router: combine weights -> probabilities -> logits, with the aux and z losses ----
  const Matrix d_logits = router_backward(config, router, d_combine, T, router.expert_fraction);

  // ---- logits = (x .* noise) Wg ----
  grads.gate_weights = x.cwiseProduct(router.jitter_noise).transpose() * d_logits;
  grads.x += (d_logits * weights.gate_weights.transpose()).cwiseProduct(router.jitter_noise);
  return grads;
}

}  // namespace moe::ref
