// test_router_dispatch.cpp: the router, the dispatch plans, the block-sparse topology and pre-gating
// of the CPU reference. Run: ctest --test-dir build -R ReferenceRouterDispatch (or the binary
// build/tests/reference_cpu/test_reference_cpu_router_dispatch).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "dispatch.h"
#include "permute.h"
#include "pregate.h"
#include "router.h"
#include "test_support.h"
#include "topology.h"

namespace moe::ref {
namespace {

using testing::random_input;
using testing::small_config;

// ---- router ----

TEST(ReferenceRouterDispatch, RouterMatchesItsDefinition) {
  MoeConfig config = small_config(Formulation::dropless, Activation::gelu, /*renormalize=*/true);
  const Matrix x = random_input(config.tokens, config.model_dim, 11);
  const Matrix gate = random_input(config.model_dim, config.num_experts, 12);
  const RouterOutput out = route(config, x, gate);
  const int64_t T = config.tokens, E = config.num_experts, K = config.top_k;

  EXPECT_LT((out.logits - x.cwiseProduct(out.jitter_noise) * gate).cwiseAbs().maxCoeff(), 1e-14);
  Eigen::VectorXd counts = Eigen::VectorXd::Zero(E);
  double z = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const double lse = std::log(out.logits.row(t).array().exp().sum());
    z += lse * lse / T;
    EXPECT_NEAR(out.probs.row(t).sum(), 1.0, 1e-14);
    for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(out.probs(t, e), std::exp(out.logits(t, e) - lse), 1e-14);
    // descending probabilities, and no unchosen expert beats the K-th choice
    for (int64_t k = 1; k < K; ++k) EXPECT_GE(out.top_probs(t, k - 1), out.top_probs(t, k));
    for (int64_t e = 0; e < E; ++e) {
      bool chosen = false;
      for (int64_t k = 0; k < K; ++k) chosen |= out.top_experts(t, k) == e;
      if (!chosen) {
        EXPECT_LE(out.probs(t, e), out.top_probs(t, K - 1));
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(out.top_probs(t, k), out.probs(t, out.top_experts(t, k)));
      counts(out.top_experts(t, k)) += 1.0;
    }
    EXPECT_NEAR(out.combine_weights.row(t).sum(), 1.0, 1e-14);  // renormalised
  }
  EXPECT_NEAR(out.expert_fraction.sum(), 1.0, 1e-14);
  EXPECT_NEAR(out.mean_probs.sum(), 1.0, 1e-14);
  const Eigen::VectorXd f = counts / static_cast<double>(T * K);
  const Eigen::VectorXd P = out.probs.colwise().sum().transpose() / static_cast<double>(T);
  EXPECT_NEAR(out.aux_loss, E * f.dot(P), 1e-14);
  EXPECT_NEAR(out.z_loss, z, 1e-12);

  config.renormalize = false;
  const RouterOutput raw = route(config, x, gate);
  EXPECT_EQ(raw.combine_weights, raw.top_probs);
}

TEST(ReferenceRouterDispatch, UniformRoutingGivesAuxLossOne) {
  MoeConfig config = small_config(Formulation::dropless);
  config.tokens = 4;
  config.top_k = 1;
  config.jitter_eps = 0.0;
  // one-hot tokens and an identity-like gate: token t strongly prefers expert t, each chosen once
  Matrix x = Matrix::Zero(4, config.model_dim);
  Matrix gate = Matrix::Zero(config.model_dim, 4);
  for (int t = 0; t < 4; ++t) {
    x(t, t) = 1.0;
    gate(t, t) = 1.0;
  }
  const RouterOutput out = route(config, x, gate);
  // f_e = 1/4 for every e and sum_e P_e = 1, so aux = E * (1/4) * 1 = 1 exactly
  EXPECT_NEAR(out.aux_loss, 1.0, 1e-14);
}

TEST(ReferenceRouterDispatch, TiesGoToTheLowerExpertIndex) {
  MoeConfig config = small_config(Formulation::dropless);
  config.jitter_eps = 0.0;
  const Matrix x = random_input(config.tokens, config.model_dim, 21);
  Matrix gate = random_input(config.model_dim, config.num_experts, 22);
  gate.col(1) = gate.col(3) = Matrix::Constant(config.model_dim, 1, 0.0);
  gate.col(0) = gate.col(2) = Matrix::Constant(config.model_dim, 1, 0.0);
  // all four logits equal: every token picks experts 0 then 1
  RouterOutput out = route(config, x, gate);
  for (int64_t t = 0; t < config.tokens; ++t) {
    EXPECT_EQ(out.top_experts(t, 0), 0);
    EXPECT_EQ(out.top_experts(t, 1), 1);
  }
  // experts 1 and 3 tie above 0 and 2: the pair is listed as 1, 3 for tokens where it wins
  const Matrix positive = random_input(config.tokens, config.model_dim, 23).cwiseAbs().array() + 0.1;
  gate.col(1) = gate.col(3) = Matrix::Constant(config.model_dim, 1, 1.0);
  out = route(config, positive, gate);
  for (int64_t t = 0; t < config.tokens; ++t) {
    EXPECT_EQ(out.top_experts(t, 0), 1);
    EXPECT_EQ(out.top_experts(t, 1), 3);
  }
}

TEST(ReferenceRouterDispatch, JitterIsDeterministicAndBounded) {
  MoeConfig config = small_config(Formulation::dropless);
  config.jitter_eps = 0.2;
  const Matrix a = jitter_noise(config, 6, 9);
  EXPECT_EQ(a, jitter_noise(config, 6, 9));
  EXPECT_GE(a.minCoeff(), 0.8);
  EXPECT_LT(a.maxCoeff(), 1.2);
  EXPECT_GT(a.maxCoeff() - a.minCoeff(), 0.1);  // it is really noise
  config.seed += 1;
  EXPECT_NE(a, jitter_noise(config, 6, 9));
  config.jitter_eps = 0.0;
  EXPECT_EQ(jitter_noise(config, 6, 9), Matrix::Ones(6, 9));
}

// ---- dispatch plans ----

// Invariants that every plan satisfies.
void expect_consistent_plan(const MoeConfig& config, const IndexMatrix& top, const DispatchPlan& plan) {
  const int64_t T = config.tokens, E = config.num_experts, K = config.top_k;
  EXPECT_EQ(std::accumulate(plan.tokens_per_expert.begin(), plan.tokens_per_expert.end(), int64_t{0}), T * K);
  EXPECT_EQ(plan.row_offsets.back(), plan.total_rows);
  int64_t dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    // the routed slots of expert e, in increasing slot (hence token) order
    int32_t previous = -1;
    for (int64_t i = plan.routed_offsets[e]; i < plan.routed_offsets[e + 1]; ++i) {
      const int32_t slot = plan.routed_slots[i];
      EXPECT_EQ(top.data()[slot], e);
      EXPECT_GT(slot, previous);
      previous = slot;
      // kept exactly when among the first kept_per_expert[e] slots, rows in that order
      const int64_t position = i - plan.routed_offsets[e];
      if (position < plan.kept_per_expert[e]) {
        EXPECT_EQ(plan.slot_row[slot], plan.row_offsets[e] + position);
        EXPECT_EQ(plan.row_slot[plan.row_offsets[e] + position], slot);
      } else {
        EXPECT_EQ(plan.slot_row[slot], -1);
        ++dropped;
      }
    }
    for (int64_t r = plan.row_offsets[e] + plan.kept_per_expert[e]; r < plan.row_offsets[e + 1]; ++r) {
      EXPECT_EQ(plan.row_slot[r], -1);  // padding
    }
    switch (config.formulation) {
      case Formulation::dropping:
        EXPECT_EQ(plan.kept_per_expert[e], std::min<int64_t>(plan.tokens_per_expert[e], capacity(config)));
        EXPECT_EQ(plan.rows_per_expert[e], plan.kept_per_expert[e]);
        break;
      case Formulation::padded:
        EXPECT_EQ(plan.kept_per_expert[e], std::min<int64_t>(plan.tokens_per_expert[e], capacity(config)));
        EXPECT_EQ(plan.rows_per_expert[e], capacity(config));
        break;
      case Formulation::dropless:
        EXPECT_EQ(plan.kept_per_expert[e], plan.tokens_per_expert[e]);
        EXPECT_EQ(plan.rows_per_expert[e] % config.block_size, 0);
        EXPECT_LT(plan.rows_per_expert[e] - plan.kept_per_expert[e], config.block_size);
        break;
    }
  }
  EXPECT_EQ(plan.dropped_slots, dropped);
  EXPECT_EQ(plan.padding_rows, std::count(plan.row_slot.begin(), plan.row_slot.end(), -1));
  EXPECT_EQ(plan.total_rows - plan.padding_rows + plan.dropped_slots, T * K);
}

TEST(ReferenceRouterDispatch, PlansAreConsistentInEveryFormulation) {
  uint64_t seed = 100;
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    for (double cf : {0.5, 0.75, 1.0, 2.0}) {
      MoeConfig config = small_config(f);
      config.tokens = 13;
      config.capacity_factor = cf;
      const Matrix x = random_input(config.tokens, config.model_dim, ++seed);
      const Matrix gate = random_input(config.model_dim, config.num_experts, ++seed);
      const RouterOutput router = route(config, x, gate);
      const DispatchPlan plan = plan_dispatch(config, router.top_experts);
      SCOPED_TRACE(std::string(to_string(f)) + " cf=" + std::to_string(cf));
      expect_consistent_plan(config, router.top_experts, plan);
      if (f != Formulation::dropless && cf == 0.5) {
        EXPECT_GT(plan.dropped_slots, 0);
      }
    }
  }
}

TEST(ReferenceRouterDispatch, HandCraftedPlans) {
  // T = 5, K = 1, E = 3; tokens choose experts 2, 0, 2, 2, 2.
  MoeConfig config;
  config.tokens = 5;
  config.model_dim = 2;
  config.hidden_dim = 4;
  config.num_experts = 3;
  config.top_k = 1;
  config.block_size = 4;
  config.capacity_factor = 1.5;  // C = ceil(1.5 * 5 / 3) = 3
  IndexMatrix top(5, 1);
  top << 2, 0, 2, 2, 2;

  config.formulation = Formulation::dropping;
  DispatchPlan plan = plan_dispatch(config, top);
  EXPECT_EQ(plan.capacity, 3);
  EXPECT_EQ(plan.tokens_per_expert, (IndexVector{1, 0, 4}));
  EXPECT_EQ(plan.routed_slots, (IndexVector{1, 0, 2, 3, 4}));
  EXPECT_EQ(plan.kept_per_expert, (IndexVector{1, 0, 3}));
  EXPECT_EQ(plan.row_offsets, (IndexVector{0, 1, 1, 4}));
  EXPECT_EQ(plan.row_slot, (IndexVector{1, 0, 2, 3}));
  EXPECT_EQ(plan.slot_row, (IndexVector{1, 0, 2, 3, -1}));  // the last token of expert 2 is dropped
  EXPECT_EQ(plan.dropped_slots, 1);
  EXPECT_EQ(plan.padding_rows, 0);

  config.formulation = Formulation::padded;
  plan = plan_dispatch(config, top);
  EXPECT_EQ(plan.rows_per_expert, (IndexVector{3, 3, 3}));
  EXPECT_EQ(plan.row_slot, (IndexVector{1, -1, -1, -1, -1, -1, 0, 2, 3}));
  EXPECT_EQ(plan.slot_row, (IndexVector{6, 0, 7, 8, -1}));
  EXPECT_EQ(plan.padding_rows, 5);

  config.formulation = Formulation::dropless;
  plan = plan_dispatch(config, top);
  EXPECT_EQ(plan.capacity, 0);
  EXPECT_EQ(plan.rows_per_expert, (IndexVector{4, 0, 4}));
  EXPECT_EQ(plan.row_offsets, (IndexVector{0, 4, 4, 8}));  // padded_bins = 4, 4, 8
  EXPECT_EQ(plan.row_slot, (IndexVector{1, -1, -1, -1, 0, 2, 3, 4}));
  EXPECT_EQ(plan.slot_row, (IndexVector{4, 0, 5, 6, 7}));
  EXPECT_EQ(plan.dropped_slots, 0);
  EXPECT_EQ(plan.padding_rows, 3);

  // permute gathers rows in that order, with zero padding
  const Matrix x = random_input(5, 2, 31);
  const Matrix permuted = permute_tokens(plan, x);
  EXPECT_EQ(permuted.row(0), x.row(1));
  EXPECT_EQ(permuted.row(1), Matrix::Zero(1, 2));
  EXPECT_EQ(permuted.row(7), x.row(4));
}

// ---- block-sparse topology ----

TEST(ReferenceRouterDispatch, TopologyOfAHandCraftedPlan) {
  // expert rows 4, 0, 8 with B = 2 and H = 4: block rows 0-1 are expert 0, 2-5 expert 2.
  MoeConfig config;
  config.tokens = 9;
  config.model_dim = 2;
  config.hidden_dim = 4;
  config.num_experts = 3;
  config.top_k = 1;
  config.block_size = 2;
  IndexMatrix top(9, 1);
  top << 0, 2, 2, 0, 2, 2, 0, 2, 2;  // counts 3, 0, 6 -> rows 4, 0, 6
  const DispatchPlan plan = plan_dispatch(config, top);
  EXPECT_EQ(plan.row_offsets, (IndexVector{0, 4, 4, 10}));
  const BlockSparseTopology topo = make_topology(config, plan);
  EXPECT_EQ(topo.block_rows, 5);
  EXPECT_EQ(topo.block_cols, 6);
  EXPECT_EQ(topo.nnz, 10);
  EXPECT_EQ(topo.offsets, (IndexVector{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(topo.row_indices, (IndexVector{0, 0, 1, 1, 2, 2, 3, 3, 4, 4}));
  EXPECT_EQ(topo.column_indices, (IndexVector{0, 1, 0, 1, 4, 5, 4, 5, 4, 5}));
  EXPECT_EQ(topo.column_offsets, (IndexVector{0, 2, 4, 4, 4, 7, 10}));
  EXPECT_EQ(topo.transpose_indices, (IndexVector{0, 2, 1, 3, 4, 6, 8, 5, 7, 9}));
  EXPECT_EQ(topo.block_row_expert, (IndexVector{0, 0, 2, 2, 2}));
  EXPECT_EQ(topo.block_row_tokens, (IndexVector{2, 1, 2, 2, 2}));  // expert 0: 3 slots in rows 0-3
}

TEST(ReferenceRouterDispatch, TransposeIndicesReallyTranspose) {
  uint64_t seed = 200;
  for (int64_t B : {1, 2, 4}) {
    MoeConfig config = small_config(Formulation::dropless);
    config.tokens = 11;
    config.num_experts = 5;
    config.block_size = B;
    config.hidden_dim = 2 * B;
    const Matrix x = random_input(config.tokens, config.model_dim, seed++);
    const Matrix gate = random_input(config.model_dim, config.num_experts, seed++);
    const RouterOutput router = route(config, x, gate);
    const DispatchPlan plan = plan_dispatch(config, router.top_experts);
    const BlockSparseTopology topo = make_topology(config, plan);
    EXPECT_EQ(topo.rows(), plan.total_rows);
    EXPECT_EQ(topo.cols(), config.num_experts * config.hidden_dim);

    // the dense block mask, from BCSR, and from the transpose walk
    Eigen::MatrixXi mask = Eigen::MatrixXi::Zero(topo.block_rows, topo.block_cols);
    for (int64_t r = 0; r < topo.block_rows; ++r) {
      for (int64_t i = topo.offsets[r]; i < topo.offsets[r + 1]; ++i) {
        EXPECT_EQ(topo.row_indices[i], r);
        if (i > topo.offsets[r]) {
          EXPECT_GT(topo.column_indices[i], topo.column_indices[i - 1]);
        }
        mask(r, topo.column_indices[i]) += 1;
      }
    }
    // block row r holds rows of the expert e with row_offsets[e] <= rB < row_offsets[e+1]
    for (int64_t e = 0; e < config.num_experts; ++e) {
      for (int64_t r = plan.row_offsets[e] / B; r < plan.row_offsets[e + 1] / B; ++r) {
        EXPECT_EQ(topo.block_row_expert[r], e);
        for (int64_t c = 0; c < topo.block_cols; ++c) {
          EXPECT_EQ(mask(r, c), c / (config.hidden_dim / B) == e ? 1 : 0);
        }
      }
    }
    Eigen::MatrixXi transposed = Eigen::MatrixXi::Zero(topo.block_cols, topo.block_rows);
    for (int64_t c = 0; c < topo.block_cols; ++c) {
      int32_t previous_row = -1;
      for (int64_t j = topo.column_offsets[c]; j < topo.column_offsets[c + 1]; ++j) {
        const int32_t block = topo.transpose_indices[j];
        EXPECT_EQ(topo.column_indices[block], c);
        EXPECT_GT(topo.row_indices[block], previous_row);  // top to bottom
        previous_row = topo.row_indices[block];
        transposed(c, topo.row_indices[block]) += 1;
      }
    }
    EXPECT_EQ(transposed, mask.transpose());
    IndexVector sorted = topo.transpose_indices;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < topo.nnz; ++i) EXPECT_EQ(sorted[i], i);  // a permutation
  }
}

// ---- pre-gating ----

TEST(ReferenceRouterDispatch, PregateRoutesTheNextBlockFromThisBlocksInput) {
  MoeConfig next = small_config(Formulation::dropping);
  next.num_experts = 6;
  const Matrix x_current = random_input(next.tokens, next.model_dim, 41);
  const Matrix next_gate = random_input(next.model_dim, next.num_experts, 42);
  const PreGateOutput pre = pregate(next, x_current, next_gate);
  const RouterOutput direct = route(next, x_current, next_gate);
  EXPECT_EQ(pre.router.top_experts, direct.top_experts);
  EXPECT_EQ(pre.router.combine_weights, direct.combine_weights);
  EXPECT_EQ(pre.plan.slot_row, plan_dispatch(next, direct.top_experts).slot_row);
  IndexVector used;
  for (int64_t e = 0; e < next.num_experts; ++e) {
    if (pre.plan.kept_per_expert[e] > 0) used.push_back(static_cast<int32_t>(e));
  }
  EXPECT_EQ(pre.experts_to_prefetch, used);
  EXPECT_FALSE(used.empty());
}

}  // namespace
}  // namespace moe::ref
