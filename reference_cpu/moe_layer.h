// moe_layer.h: one whole MoE layer, forward and backward: router -> dispatch plan -> permute ->
// expert FFN -> un-permute and combine, plus the router losses. Part of the CPU reference
// (moe::ref), the oracle every GPU and distributed layer is compared with; built into
// moe_reference_cpu, tested by tests/reference_cpu (ctest --test-dir build -R Reference).
//
// The backward pass differentiates the scalar
//   L = sum(dy .* y) + aux_loss_coef * aux_loss + z_loss_coef * z_loss
// with respect to x, gate_weights, every w1[e] and w2[e]. Gradients flow through the combine
// weights (and their renormalisation), the softmax, the jitter-scaled router input, the aux loss
// through P_e and the z-loss through the logits. The top-K choice, the dropping and f_e are
// piecewise constant in the inputs: they have no gradient.
#pragma once

#include <optional>
#include <vector>

#include "dispatch.h"    // DispatchPlan
#include "moe_config.h"  // MoeConfig
#include "router.h"      // RouterOutput
#include "topology.h"    // BlockSparseTopology
#include "types.h"

namespace moe::ref {

struct MoeWeights {
  Matrix gate_weights;     // [D, E]
  std::vector<Matrix> w1;  // E x [D, w1_columns]  (SwiGLU: gate columns, then up columns)
  std::vector<Matrix> w2;  // E x [H, D]
};

struct LayerForward {
  RouterOutput router;
  DispatchPlan plan;
  std::optional<BlockSparseTopology> topology;  // dropless only
  Matrix permuted_x;      // [rows, D]  tokens in expert order; padding rows are zero
  Matrix pre_activation;  // [rows, w1_columns]
  Matrix hidden;          // [rows, H]
  Matrix expert_out;      // [rows, D]  expert outputs, before the combine weights
  Matrix y;               // [T, D]     the layer output (without the residual)
  double aux_loss = 0.0;  // router.aux_loss, unscaled
  double z_loss = 0.0;    // router.z_loss, unscaled
};

struct LayerGradients {
  Matrix x;                // [T, D]
  Matrix gate_weights;     // [D, E]
  std::vector<Matrix> w1;  // E x [D, w1_columns]
  std::vector<Matrix> w2;  // E x [H, D]
};

// How the backward pass computes the experts: one dense product per expert, or the block-sparse
// SDD / DSD / DDS products of MegaBlocks (dropless only).
enum class ExpertPath { per_expert, block_sparse };

// validate(config), then the shapes and finiteness of x and every weight.
void check_layer_inputs(const MoeConfig& config, const Matrix& x, const MoeWeights& weights);

LayerForward moe_forward(const MoeConfig& config,
                         const Matrix& x,  // [T, D]
                         const MoeWeights& weights);

// The forward after routing: permute x by the plan, run the experts, un-permute and combine with
// the router's weights. moe_forward routes x itself; pregated_moe_forward brings a routing made
// one MoE block earlier. Checks nothing: its callers check the inputs first.
LayerForward moe_forward_routed(const MoeConfig& config,
                                const Matrix& x,  // [T, D] the experts' input
                                const MoeWeights& weights, RouterOutput router,
                                DispatchPlan plan);  // made from router.top_experts

LayerGradients moe_backward(const MoeConfig& config,
                            const Matrix& x,  // [T, D]
                            const MoeWeights& weights, const LayerForward& forward,
                            const Matrix& dy,  // [T, D]
                            ExpertPath path = ExpertPath::per_expert);

// The scalar L that moe_backward differentiates (used by the finite-difference tests).
double moe_objective(const MoeConfig& config, const LayerForward& forward,
                     const Matrix& dy);  // [T, D]

}  // namespace moe::ref
