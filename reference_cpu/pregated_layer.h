// pregated_layer.h: an MoE layer whose gate reads a different tensor than its experts, as in
// Pre-gated MoE (Hwang et al., ISCA 2024), forward and backward. Part of the CPU reference
// (moe::ref), used by the reference model (model.h); tested through its finite-difference checks
// (ctest --test-dir build -R ReferenceModel).
//
// moe_forward routes x and sends the same x to the experts. With pre-gating, MoE block j's gate
// was already evaluated one MoE block earlier, on that block's input (pregate.h), so here the
// routing arrives ready-made and only the experts read this block's x:
//   routing = pregate(config, router_input, gate_weights)     computed in the previous MoE block
//   y       = sum_k combine_weights[t, k] * expert_k(x[t])     with routing's plan
//
// The backward reuses moe_backward, which differentiates one input that feeds both the gate and
// the experts. moe_backward reads the routing and the expert activations from the saved forward, so
// the weights only connect the gradient to its input: zero the gate weights and dx is exactly the
// part through the experts; zero w1 and dx is exactly the part through the gate. Two calls, no
// subtraction, every other gradient taken from the call where it is exact.
#pragma once

#include "moe_layer.h"  // LayerForward, LayerGradients, MoeWeights
#include "pregate.h"    // PreGateOutput
#include "types.h"

namespace moe::ref {

struct PreGatedGradients {
  LayerGradients layer;  // x: through the experts only; gate_weights, w1, w2: complete
  Matrix router_input;   // [T, D] the part of the gradient that flows through the gate
};

// The layer forward on a routing computed elsewhere (by pregate on router_input).
LayerForward pregated_moe_forward(const MoeConfig& config,
                                  const Matrix& x,  // [T, D] the experts' input
                                  const MoeWeights& weights, const PreGateOutput& routing);

// Differentiates L = sum(dy .* y) + aux_loss_coef * aux + z_loss_coef * z, as moe_backward.
PreGatedGradients pregated_moe_backward(const MoeConfig& config,
                                        const Matrix& x,             // [T, D] the experts' input
                                        const Matrix& router_input,  // [T, D] the gate's input
                                        const MoeWeights& weights, const LayerForward& forward,
                                        const Matrix& dy);  // [T, D]

}  // namespace moe::ref
