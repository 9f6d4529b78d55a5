// router.h: the gate of an MoE layer: logits, softmax, top-K, combine weights, and the two router
// losses (Switch Transformer load balancing, ST-MoE z-loss). Part of the CPU reference (moe::ref);
// built into moe_reference_cpu, tested by tests/reference_cpu (ctest --test-dir build -R Reference).
//
//   x_router = x .* noise                   [T, D]   noise = 1 when jitter_eps = 0
//   logits   = x_router Wg                   [T, E]
//   probs    = softmax(logits) per token     [T, E]
//   top-K    : the K largest probs of each token, listed by descending probability;
//              equal probabilities go to the lower expert index
//   combine weights = the K chosen probs, divided by their sum when config.renormalize
//   aux loss = E * sum_e f_e * P_e, with
//              f_e = (routed slots that chose e) / (T * K)   so sum_e f_e = 1, counted before dropping
//              P_e = (1 / T) sum_t probs[t, e]              so sum_e P_e = 1
//              (perfectly uniform routing gives aux = 1; f is piecewise constant, no gradient)
//   z loss   = (1 / T) sum_t (logsumexp_e logits[t, e])^2
#pragma once

#include "moe_config.h"  // MoeConfig
#include "types.h"

namespace moe::ref {

struct RouterOutput {
  Matrix jitter_noise;      // [T, D] the multiplicative noise applied to the router input (ones if off)
  Matrix logits;            // [T, E]
  Matrix probs;             // [T, E] softmax of logits per token
  Vector logsumexp;         // [T]    logsumexp_e logits[t, e], the z-loss term
  IndexMatrix top_experts;  // [T, K] chosen experts, by descending probability, ties to lower index
  Matrix top_probs;         // [T, K] probs[t, top_experts[t, k]]
  Matrix combine_weights;   // [T, K] top_probs, renormalised to sum to 1 when config.renormalize
  Vector expert_fraction;   // [E]    f_e: fraction of the T*K routed slots that chose e
  Vector mean_probs;        // [E]    P_e: mean over tokens of probs[:, e]
  double aux_loss = 0.0;    // E * sum_e f_e P_e
  double z_loss = 0.0;      // mean_t logsumexp_t^2
};

// The jitter noise of Switch Transformer, reproducible on any platform: draws 64-bit words from
// std::mt19937_64(config.seed) in row-major order, u = (word >> 11) * 2^-53 in [0, 1), and
// noise = 1 - eps + 2 eps u. Returns ones when config.jitter_eps == 0.
Matrix jitter_noise(const MoeConfig& config, int64_t rows, int64_t cols);  // [rows, cols]

// Validates config, x and gate_weights, then routes every token.
RouterOutput route(const MoeConfig& config,
                   const Matrix& x,              // [T, D]
                   const Matrix& gate_weights);  // [D, E]

// The router's backward, from the combine weights' gradient to the logits' gradient, with the two
// router losses added at the coefficients of config:
//   d_combine [rows, K] -> d_logits [rows, E]
// `router` holds the rows of the tokens differentiated here: all T tokens (ref::moe_backward), or
// one rank's T_r of them (expert parallelism). The losses are means over all T tokens of the layer,
// so `tokens` is that T and `expert_fraction` the f_e [E] counted over all of them; on one device
// these are config.tokens and router.expert_fraction. The gate's own product (d Wg, dx) is left to
// the caller, which knows whether to sum it over ranks.
//   aux  : dL/dprobs[t, e] += aux_loss_coef * E * f_e / T   (f_e has no gradient)
//   z    : dL/dlogits[t, e] += z_loss_coef * 2 * lse_t / T * probs[t, e]
Matrix router_backward(const MoeConfig& config, const RouterOutput& router,
                       const Matrix& d_combine,         // [rows, K]
                       int64_t tokens,                  // T of the losses' means
                       const Vector& expert_fraction);  // [E] f_e over all T tokens

}  // namespace moe::ref
