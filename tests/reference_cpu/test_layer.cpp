// test_layer.cpp: the whole MoE layer of the CPU reference: finite-difference gradient checks in
// every formulation, activation and renormalisation, the invariants that tie the formulations
// together, and the edge cases. Run: ctest --test-dir build -R ReferenceLayer
#include <gtest/gtest.h>

#include <functional>
#include <tuple>

#include "expert_ffn.h"
#include "init.h"
#include "moe_layer.h"
#include "test_support.h"

namespace moe::ref {
namespace {

using testing::random_input;
using testing::relative_error;
using testing::small_config;

// ---- finite differences ----

// Central differences of f with respect to every entry of m (m is restored afterwards).
Matrix finite_difference(Matrix& m, const std::function<double()>& f) {
  const double h = 1e-6;
  Matrix gradient(m.rows(), m.cols());
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
      const double saved = m(i, j);
      m(i, j) = saved + h;
      const double plus = f();
      m(i, j) = saved - h;
      const double minus = f();
      m(i, j) = saved;
      gradient(i, j) = (plus - minus) / (2 * h);
    }
  }
  return gradient;
}

// Relative error max|a - n| / max(|a|, |n|); a tensor whose true gradient is zero must be ~0.
void expect_gradient(const std::string& name, const Matrix& analytic, const Matrix& numeric,
                     double tolerance = 1e-6) {
  const double scale = std::max(analytic.cwiseAbs().maxCoeff(), numeric.cwiseAbs().maxCoeff());
  const double error = (analytic - numeric).cwiseAbs().maxCoeff();
  if (scale < 1e-9) {
    EXPECT_LT(error, 1e-9) << name << " should be zero";
    return;
  }
  EXPECT_LT(error / scale, tolerance) << name << ": max_abs_err=" << error << " scale=" << scale;
}

// Checks every gradient of moe_backward against central differences of moe_objective; for dropless
// also checks the block-sparse backward against the per-expert one.
void expect_gradients_match(const MoeConfig& config, Matrix x, MoeWeights weights, uint64_t seed) {
  const Matrix dy = random_input(config.tokens, config.model_dim, seed);
  const LayerForward forward = moe_forward(config, x, weights);
  const LayerGradients grads = moe_backward(config, x, weights, forward, dy);
  auto objective = [&] { return moe_objective(config, moe_forward(config, x, weights), dy); };

  expect_gradient("x", grads.x, finite_difference(x, objective));
  expect_gradient("gate_weights", grads.gate_weights, finite_difference(weights.gate_weights, objective));
  for (int64_t e = 0; e < config.num_experts; ++e) {
    expect_gradient("w1[" + std::to_string(e) + "]", grads.w1[e], finite_difference(weights.w1[e], objective));
    expect_gradient("w2[" + std::to_string(e) + "]", grads.w2[e], finite_difference(weights.w2[e], objective));
  }

  if (config.formulation == Formulation::dropless) {
    const LayerGradients sparse = moe_backward(config, x, weights, forward, dy, ExpertPath::block_sparse);
    expect_gradient("x (block-sparse)", sparse.x, grads.x, 1e-12);
    expect_gradient("gate_weights (block-sparse)", sparse.gate_weights, grads.gate_weights, 1e-12);
    for (int64_t e = 0; e < config.num_experts; ++e) {
      expect_gradient("w1 (block-sparse)", sparse.w1[e], grads.w1[e], 1e-12);
      expect_gradient("w2 (block-sparse)", sparse.w2[e], grads.w2[e], 1e-12);
    }
  }
}

void expect_gradients_match(const MoeConfig& config, uint64_t seed) {
  expect_gradients_match(config, random_input(config.tokens, config.model_dim, seed + 1),
                         random_weights(config, seed + 2), seed + 3);
}

using GradientCase = std::tuple<Formulation, Activation, bool>;
class ReferenceLayerGradient : public ::testing::TestWithParam<GradientCase> {};

TEST_P(ReferenceLayerGradient, MatchesCentralDifferences) {
  const auto [formulation, activation, renormalize] = GetParam();
  const MoeConfig config = small_config(formulation, activation, renormalize);
  const uint64_t seed = 1000 + 100 * static_cast<uint64_t>(formulation) +
                        10 * static_cast<uint64_t>(activation) + (renormalize ? 1 : 0);
  const Matrix x = random_input(config.tokens, config.model_dim, seed);
  const MoeWeights weights = random_weights(config, seed + 1);
  const LayerForward forward = moe_forward(config, x, weights);
  if (formulation != Formulation::dropless) {
    EXPECT_GT(forward.plan.dropped_slots, 0);  // the gradient through dropped slots is tested too
  }
  EXPECT_GT(forward.aux_loss, 0.0);
  expect_gradients_match(config, x, weights, seed + 2);
}

INSTANTIATE_TEST_SUITE_P(
    AllFormulations, ReferenceLayerGradient,
    ::testing::Combine(::testing::Values(Formulation::dropping, Formulation::padded, Formulation::dropless),
                       ::testing::Values(Activation::gelu, Activation::swiglu), ::testing::Bool()),
    [](const auto& info) {
      return std::string(to_string(std::get<0>(info.param))) + "_" +
             std::string(to_string(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "_renormalized" : "_raw");
    });

// ---- invariants between formulations ----

// One expert's FFN on one token, written out directly.
Matrix expert_on_token(const MoeConfig& config, const MoeWeights& weights, int64_t e, const Matrix& token) {
  return activate(config, token * weights.w1[e]) * weights.w2[e];
}

// y recomputed token by token from the router's choices; keep(t, k) says whether the slot counts.
Matrix per_token_dense(const MoeConfig& config, const Matrix& x, const MoeWeights& weights,
                       const RouterOutput& router, const std::function<bool(int64_t, int64_t)>& keep) {
  Matrix y = Matrix::Zero(config.tokens, config.model_dim);
  for (int64_t t = 0; t < config.tokens; ++t) {
    for (int64_t k = 0; k < config.top_k; ++k) {
      if (!keep(t, k)) continue;
      y.row(t) += router.combine_weights(t, k) *
                  expert_on_token(config, weights, router.top_experts(t, k), x.row(t));
    }
  }
  return y;
}

TEST(ReferenceLayer, DroplessEqualsPerTokenDenseEvaluation) {
  uint64_t seed = 2000;
  for (Activation activation : {Activation::gelu, Activation::swiglu}) {
    const MoeConfig config = small_config(Formulation::dropless, activation, true);
    const Matrix x = random_input(config.tokens, config.model_dim, ++seed);
    const MoeWeights weights = random_weights(config, ++seed);
    const LayerForward forward = moe_forward(config, x, weights);
    const Matrix expected = per_token_dense(config, x, weights, forward.router, [](int64_t, int64_t) { return true; });
    EXPECT_LT(relative_error(forward.y, expected), 1e-13);
    EXPECT_NE(config.tokens % config.block_size, 0);  // T not a multiple of B
  }
}

TEST(ReferenceLayer, DroppingDropsExactlyTheSlotsPastCapacityInTokenOrder) {
  MoeConfig config = small_config(Formulation::dropping, Activation::swiglu);
  config.tokens = 12;
  config.capacity_factor = 0.5;  // C = ceil(0.5 * 12 * 2 / 4) = 3
  const Matrix x = random_input(config.tokens, config.model_dim, 2101);
  const MoeWeights weights = random_weights(config, 2102);
  const LayerForward forward = moe_forward(config, x, weights);
  ASSERT_EQ(capacity(config), 3);

  // Independently: walk the tokens in order and count per expert; slot (t, k) survives if fewer
  // than C earlier slots (t' < t, or t' = t and k' < k) chose its expert.
  IndexMatrix kept(config.tokens, config.top_k);
  std::vector<int64_t> seen(config.num_experts, 0);
  int64_t dropped = 0;
  for (int64_t t = 0; t < config.tokens; ++t) {
    for (int64_t k = 0; k < config.top_k; ++k) {
      const int64_t e = forward.router.top_experts(t, k);
      kept(t, k) = seen[e]++ < capacity(config) ? 1 : 0;
      dropped += 1 - kept(t, k);
      EXPECT_EQ(forward.plan.slot_row[t * config.top_k + k] >= 0, kept(t, k) == 1);
    }
  }
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(forward.plan.dropped_slots, dropped);
  const Matrix expected = per_token_dense(config, x, weights, forward.router,
                                          [&](int64_t t, int64_t k) { return kept(t, k) == 1; });
  EXPECT_LT(relative_error(forward.y, expected), 1e-13);
}

TEST(ReferenceLayer, DroppingAndPaddedWithCapacityFactorEEqualDropless) {
  uint64_t seed = 2200;
  for (Activation activation : {Activation::gelu, Activation::swiglu}) {
    MoeConfig dropless = small_config(Formulation::dropless, activation);
    const Matrix x = random_input(dropless.tokens, dropless.model_dim, ++seed);
    const MoeWeights weights = random_weights(dropless, ++seed);
    const Matrix dy = random_input(dropless.tokens, dropless.model_dim, ++seed);
    const LayerForward reference = moe_forward(dropless, x, weights);
    const LayerGradients reference_grads = moe_backward(dropless, x, weights, reference, dy);
    for (Formulation f : {Formulation::dropping, Formulation::padded}) {
      MoeConfig config = dropless;
      config.formulation = f;
      config.capacity_factor = static_cast<double>(config.num_experts);  // C = T*K: nothing can drop
      const LayerForward forward = moe_forward(config, x, weights);
      EXPECT_EQ(forward.plan.dropped_slots, 0);
      EXPECT_LT(relative_error(forward.y, reference.y), 1e-14);
      EXPECT_EQ(forward.aux_loss, reference.aux_loss);
      EXPECT_EQ(forward.z_loss, reference.z_loss);
      const LayerGradients grads = moe_backward(config, x, weights, forward, dy);
      EXPECT_LT(relative_error(grads.x, reference_grads.x), 1e-13);
      EXPECT_LT(relative_error(grads.gate_weights, reference_grads.gate_weights), 1e-13);
      for (int64_t e = 0; e < config.num_experts; ++e) {
        EXPECT_LT(relative_error(grads.w1[e], reference_grads.w1[e]), 1e-13);
        EXPECT_LT(relative_error(grads.w2[e], reference_grads.w2[e]), 1e-13);
      }
    }
  }
}

TEST(ReferenceLayer, PaddedEqualsDroplessOnRealRowsAndPadsWithZeros) {
  uint64_t seed = 2300;
  for (double cf : {0.75, 4.0}) {
    MoeConfig padded = small_config(Formulation::padded, Activation::swiglu);
    padded.capacity_factor = cf;
    MoeConfig dropless = padded;
    dropless.formulation = Formulation::dropless;
    MoeConfig dropping = padded;
    dropping.formulation = Formulation::dropping;
    const Matrix x = random_input(padded.tokens, padded.model_dim, ++seed);
    const MoeWeights weights = random_weights(padded, ++seed);
    const LayerForward p = moe_forward(padded, x, weights);
    const LayerForward d = moe_forward(dropless, x, weights);
    const LayerForward dropped = moe_forward(dropping, x, weights);
    EXPECT_GT(p.plan.padding_rows, 0);
    EXPECT_EQ(p.plan.total_rows, padded.num_experts * capacity(padded));
    for (int64_t row = 0; row < p.plan.total_rows; ++row) {
      const int32_t slot = p.plan.row_slot[row];
      if (slot < 0) {  // padding rows are zero all the way through
        EXPECT_EQ(p.permuted_x.row(row).cwiseAbs().maxCoeff(), 0.0);
        EXPECT_EQ(p.hidden.row(row).cwiseAbs().maxCoeff(), 0.0);
        EXPECT_EQ(p.expert_out.row(row).cwiseAbs().maxCoeff(), 0.0);
      } else {  // a real row computes exactly what dropless computes for the same slot
        EXPECT_LT(relative_error(p.expert_out.row(row), d.expert_out.row(d.plan.slot_row[slot])), 1e-14);
      }
    }
    EXPECT_LT(relative_error(p.y, dropped.y), 1e-14);  // padded = dropping at the same capacity
    if (cf == 4.0) {
      EXPECT_LT(relative_error(p.y, d.y), 1e-14);
    }
  }
}

// ---- edge cases ----

TEST(ReferenceLayer, SingleToken) {
  uint64_t seed = 2400;
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    MoeConfig config = small_config(f, Activation::gelu, true);
    config.tokens = 1;
    config.capacity_factor = 1.0;
    SCOPED_TRACE(std::string(to_string(f)));
    expect_gradients_match(config, seed += 10);
  }
}

TEST(ReferenceLayer, SingleExpert) {
  MoeConfig config = small_config(Formulation::dropless, Activation::swiglu);
  config.num_experts = 1;
  config.top_k = 1;
  const Matrix x = random_input(config.tokens, config.model_dim, 2501);
  const MoeWeights weights = random_weights(config, 2502);
  const LayerForward forward = moe_forward(config, x, weights);
  EXPECT_EQ(forward.router.combine_weights, Matrix::Ones(config.tokens, 1));
  EXPECT_NEAR(forward.aux_loss, 1.0, 1e-15);
  const Matrix expected = (activate(config, x * weights.w1[0]) * weights.w2[0]);
  EXPECT_LT(relative_error(forward.y, expected), 1e-13);
  expect_gradients_match(config, x, weights, 2503);
}

TEST(ReferenceLayer, TopKEqualsNumExperts) {
  uint64_t seed = 2600;
  for (Formulation f : {Formulation::dropping, Formulation::dropless}) {
    MoeConfig config = small_config(f, Activation::gelu, true);
    config.num_experts = 3;
    config.top_k = 3;
    const Matrix x = random_input(config.tokens, config.model_dim, ++seed);
    const MoeWeights weights = random_weights(config, ++seed);
    const LayerForward forward = moe_forward(config, x, weights);
    // every token reaches every expert; renormalising all E probabilities changes nothing
    EXPECT_LT(relative_error(forward.router.combine_weights, forward.router.top_probs), 1e-14);
    for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(forward.plan.tokens_per_expert[e], config.tokens);
    expect_gradients_match(config, x, weights, ++seed);
  }
}

// Positive tokens and a gate whose column 2 dominates, column 0 second: every token picks expert 2
// first and expert 0 second (no ties, so finite differences stay on one side of every choice).
MoeWeights skewed_weights(const MoeConfig& config, uint64_t seed) {
  MoeWeights weights = random_weights(config, seed);
  weights.gate_weights *= 0.1;
  weights.gate_weights.col(2).array() += 2.0;
  weights.gate_weights.col(0).array() += 1.0;
  weights.gate_weights.col(1).array() -= 1.0;
  weights.gate_weights.col(3).array() -= 1.0;
  return weights;
}

TEST(ReferenceLayer, AllTokensOnOneExpert) {
  uint64_t seed = 2700;
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    MoeConfig config = small_config(f, Activation::swiglu);
    config.top_k = 1;
    const Matrix x = random_input(config.tokens, config.model_dim, ++seed).cwiseAbs().array() + 0.1;
    const MoeWeights weights = skewed_weights(config, ++seed);
    const LayerForward forward = moe_forward(config, x, weights);
    SCOPED_TRACE(std::string(to_string(f)));
    EXPECT_EQ(forward.plan.tokens_per_expert, (IndexVector{0, 0, static_cast<int32_t>(config.tokens), 0}));
    if (f == Formulation::dropless) {
      EXPECT_EQ(forward.plan.rows_per_expert, (IndexVector{0, 0, 8, 0}));  // 7 rounded up to B = 2
      // only expert 2's block columns appear in the topology
      for (int32_t c : forward.topology->column_indices) EXPECT_EQ(c / 2, 2);
    } else {
      // C = ceil(0.75 * 7 / 4) = 2: the first two tokens are kept, the rest dropped
      EXPECT_EQ(forward.plan.kept_per_expert[2], 2);
      EXPECT_EQ(forward.plan.dropped_slots, config.tokens - 2);
      for (int64_t t = 2; t < config.tokens; ++t) EXPECT_EQ(forward.y.row(t).cwiseAbs().maxCoeff(), 0.0);
    }
    expect_gradients_match(config, x, weights, ++seed);
  }
}

TEST(ReferenceLayer, ExpertsWithNoTokens) {
  uint64_t seed = 2800;
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    MoeConfig config = small_config(f, Activation::gelu, true);
    config.capacity_factor = 2.0;
    const Matrix x = random_input(config.tokens, config.model_dim, ++seed).cwiseAbs().array() + 0.1;
    const MoeWeights weights = skewed_weights(config, ++seed);
    const LayerForward forward = moe_forward(config, x, weights);
    SCOPED_TRACE(std::string(to_string(f)));
    EXPECT_EQ(forward.plan.tokens_per_expert[1], 0);
    EXPECT_EQ(forward.plan.tokens_per_expert[3], 0);
    const LayerGradients grads = moe_backward(config, x, weights, forward, random_input(config.tokens, config.model_dim, ++seed));
    EXPECT_EQ(grads.w1[1].cwiseAbs().maxCoeff(), 0.0);  // an idle expert learns nothing
    EXPECT_EQ(grads.w2[3].cwiseAbs().maxCoeff(), 0.0);
    expect_gradients_match(config, x, weights, ++seed);
  }
}

TEST(ReferenceLayer, ForwardIsDeterministic) {
  const MoeConfig config = small_config(Formulation::dropless, Activation::swiglu, true);
  const Matrix x = random_input(config.tokens, config.model_dim, 2901);
  const MoeWeights weights = random_weights(config, 2902);
  EXPECT_EQ(moe_forward(config, x, weights).y, moe_forward(config, x, weights).y);
}

}  // namespace
}  // namespace moe::ref
