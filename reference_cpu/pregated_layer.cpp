// pregated_layer.cpp: the MoE layer with a separately routed gate (see pregated_layer.h).
#include "pregated_layer.h"

#include "checks.h"  // check_shape

namespace moe::ref {

LayerForward pregated_moe_forward(const MoeConfig& config, const Matrix& x, const MoeWeights& weights,
                                  const PreGateOutput& routing) {
  check_layer_inputs(config, x, weights);
  check_shape("routing.router.logits", routing.router.logits, config.tokens, config.num_experts, "[T, E]");
  return moe_forward_routed(config, x, weights, routing.router, routing.plan);
}

PreGatedGradients pregated_moe_backward(const MoeConfig& config, const Matrix& x, const Matrix& router_input,
                                        const MoeWeights& weights, const LayerForward& forward,
                                        const Matrix& dy) {
  check_shape("router_input", router_input, config.tokens, config.model_dim, "[T, D]");

  MoeWeights without_gate = weights;  // dx flows only through the experts
  without_gate.gate_weights.setZero();
  PreGatedGradients grads;
  grads.layer = moe_backward(config, x, without_gate, forward, dy);

  MoeWeights without_experts = weights;  // dx flows only through the gate (d permuted_x = d_pre w1^T = 0)
  for (Matrix& w1 : without_experts.w1) w1.setZero();
  LayerGradients through_gate = moe_backward(config, router_input, without_experts, forward, dy);
  grads.layer.gate_weights = std::move(through_gate.gate_weights);
  grads.router_input = std::move(through_gate.x);
  return grads;
}

}  // namespace moe::ref
