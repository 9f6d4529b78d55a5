// test_expert_layouts.cpp: Tutel's parallelism switching on CPU ranks (distributed/expert_layouts.h).
// In every layout (r = 0 data parallel, r = 1 expert parallel, every r > 1 that divides R and H)
// the layer equals the single-device reference (reference_cpu/moe_layer.h) on all ranks' tokens
// together: y, the aux and z losses, dx, the router gradient, and every expert's dW1 and dW2 on the
// rank that stores it, within 1e-10 relative (double); in every formulation, GeLU and SwiGLU; with
// uneven shards, a rank without tokens, an expert that receives nothing. Switching r between calls
// on the same storage gives the same results and leaves the stored weights untouched. The bytes a
// layout sends are the header's formulas and the cost model's; the choice is the same on every rank.
// Bad settings are an error on every rank.
//   ctest --test-dir build -R DistributedExpertLayouts
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ep/expert_layouts.h"
#include "mpi_test_support.h"
#include "reference_cpu/init.h"
#include "reference_cpu/moe_layer.h"

namespace moe::dist {
namespace {

using ref::Matrix;
using testing::mix;
using testing::shared_seed;
using testing::world;
using ::testing::HasSubstr;

constexpr double kTolerance = 1e-10;  // double precision; only the order of sums differs

// E = 12 divides R = 1..4; H = 12 divides r = 2, 3, 4; T = 29 is odd and not a multiple of R or B.
MoeConfig layer_config(Formulation formulation, Activation activation = Activation::gelu, bool renormalize = false) {
  MoeConfig config;
  config.tokens = 29;
  config.model_dim = 6;
  config.hidden_dim = 12;
  config.num_experts = 12;
  config.top_k = 2;
  config.formulation = formulation;
  config.capacity_factor = 0.75;  // C = ceil(0.75 * 29 * 2 / 12) = 4: dropping really drops
  config.block_size = 2;
  config.activation = activation;
  config.renormalize = renormalize;
  config.jitter_eps = 0.1;
  config.seed = 8765;
  config.aux_loss_coef = 0.3;
  config.z_loss_coef = 0.2;
  return config;
}

const Formulation kFormulations[] = {Formulation::dropless, Formulation::padded, Formulation::dropping};

std::vector<int64_t> even_shards(int64_t tokens, int ranks) {
  std::vector<int64_t> shards(ranks, tokens / ranks);
  for (int p = 0; p < tokens % ranks; ++p) ++shards[p];
  return shards;
}

double relative_error(const Matrix& actual, const Matrix& expected) {
  if (expected.size() == 0) return actual.size() == 0 ? 0.0 : 1.0;
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols()) return 1.0;
  const double scale = std::max(expected.cwiseAbs().maxCoeff(), 1e-300);
  return (actual - expected).cwiseAbs().maxCoeff() / scale;
}

struct Problem {
  MoeConfig config;
  Matrix x;   // [T, D]
  Matrix dy;  // [T, D]
  ref::MoeWeights weights;
  ref::LayerForward forward;  // the single-device layer on all tokens
  ref::LayerGradients grads;
};

Problem make_problem(const MoeConfig& config, uint64_t seed,
                     const std::function<void(Matrix&, ref::MoeWeights&)>& shape = {}) {
  std::mt19937_64 generator(seed);
  Problem problem{config, ref::random_matrix(config.tokens, config.model_dim, generator),
                  ref::random_matrix(config.tokens, config.model_dim, generator),
                  ref::random_weights(config, mix(seed, 1)), {}, {}};
  if (shape) shape(problem.x, problem.weights);
  problem.forward = ref::moe_forward(config, problem.x, problem.weights);
  problem.grads = ref::moe_backward(config, problem.x, problem.weights, problem.forward, problem.dy);
  return problem;
}

struct Shard {
  int64_t offset = 0, tokens = 0;
};

Shard shard_of(const std::vector<int64_t>& shards) {
  Shard shard;
  for (int p = 0; p < world().rank(); ++p) shard.offset += shards[p];
  shard.tokens = shards[world().rank()];
  return shard;
}

struct RankRun {
  ExpertLayoutForward forward;
  ExpertLayoutGradients grads;
};

RankRun run_layout(const Problem& problem, const std::vector<int64_t>& shards, const ExpertParallelWeights& stored,
                   int r) {
  const Shard shard = shard_of(shards);
  const Matrix x = problem.x.middleRows(shard.offset, shard.tokens);
  const Matrix dy = problem.dy.middleRows(shard.offset, shard.tokens);
  ExpertLayoutOptions options;
  options.r = r;
  RankRun run;
  run.forward = expert_layout_forward(world(), problem.config, x, stored, options);
  run.grads = expert_layout_backward(world(), problem.config, x, stored, run.forward, dy);
  return run;
}

void expect_equals_single_device(const Problem& problem, const std::vector<int64_t>& shards, const RankRun& run) {
  const MoeConfig& config = problem.config;
  const Shard shard = shard_of(shards);
  EXPECT_LE(relative_error(run.forward.y, problem.forward.y.middleRows(shard.offset, shard.tokens)), kTolerance) << "y";
  EXPECT_NEAR(run.forward.aux_loss, problem.forward.aux_loss, kTolerance * std::abs(problem.forward.aux_loss));
  EXPECT_NEAR(run.forward.z_loss, problem.forward.z_loss, kTolerance * std::abs(problem.forward.z_loss));
  EXPECT_EQ(run.forward.dropped_slots, problem.forward.plan.dropped_slots);
  EXPECT_LE(relative_error(run.grads.x, problem.grads.x.middleRows(shard.offset, shard.tokens)), kTolerance) << "dx";
  EXPECT_LE(relative_error(run.grads.gate_weights, problem.grads.gate_weights), kTolerance) << "d gate_weights";
  const int64_t per_rank = config.num_experts / world().size();
  ASSERT_EQ(static_cast<int64_t>(run.grads.w1.size()), per_rank);
  ASSERT_EQ(static_cast<int64_t>(run.grads.w2.size()), per_rank);
  for (int64_t j = 0; j < per_rank; ++j) {
    const int64_t e = world().rank() * per_rank + j;
    if (problem.grads.w2[e].cwiseAbs().maxCoeff() == 0.0) {  // an idle expert: exactly zero
      EXPECT_EQ(run.grads.w1[j].cwiseAbs().maxCoeff(), 0.0) << "d w1 of idle expert " << e;
      EXPECT_EQ(run.grads.w2[j].cwiseAbs().maxCoeff(), 0.0) << "d w2 of idle expert " << e;
      continue;
    }
    EXPECT_LE(relative_error(run.grads.w1[j], problem.grads.w1[e]), kTolerance) << "d w1 of expert " << e;
    EXPECT_LE(relative_error(run.grads.w2[j], problem.grads.w2[e]), kTolerance) << "d w2 of expert " << e;
  }
}

// Every valid layout on one problem, each against the single-device layer.
void check_every_layout(const MoeConfig& config, const std::vector<int64_t>& shards,
                        const std::function<void(Matrix&, ref::MoeWeights&)>& shape = {}) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem problem = make_problem(config, seed, shape);
  const ExpertParallelWeights stored = local_weights(config, problem.weights, world().rank(), world().size());
  for (int r : valid_layouts(config, world().size())) {
    SCOPED_TRACE(layout_name(r));
    const RankRun run = run_layout(problem, shards, stored, r);
    EXPECT_EQ(run.forward.r, r);
    expect_equals_single_device(problem, shards, run);
  }
}

std::string name_of(const MoeConfig& config) {
  return std::string(to_string(config.formulation)) + " " + std::string(to_string(config.activation)) +
         (config.renormalize ? " renormalized" : "");
}

// ---- equal to the single-device layer ----

TEST(ExpertLayouts, ValidLayoutsAreZeroOneAndTheDivisorsOfRanksAndHidden) {
  const int R = world().size();
  const std::vector<int> layouts = valid_layouts(layer_config(Formulation::dropless), R);
  std::vector<int> expected{0, 1};
  for (int r = 2; r <= R; ++r) {
    if (R % r == 0) expected.push_back(r);  // H = 12 takes every r <= 4
  }
  EXPECT_EQ(layouts, expected);
}

TEST(ExpertLayouts, EveryLayoutEqualsTheSingleDeviceLayer) {
  for (Formulation formulation : kFormulations) {
    for (Activation activation : {Activation::gelu, Activation::swiglu}) {
      for (bool renormalize : {false, true}) {
        const MoeConfig config = layer_config(formulation, activation, renormalize);
        SCOPED_TRACE(name_of(config));
        check_every_layout(config, even_shards(config.tokens, world().size()));
      }
    }
  }
}

TEST(ExpertLayouts, UnevenShardsAndARankWithoutTokens) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation, Activation::swiglu);
    SCOPED_TRACE(name_of(config));
    std::vector<int64_t> uneven(R);
    int64_t given = 0;
    for (int p = 0; p < R; ++p) {
      uneven[p] = p + 1 == R ? config.tokens - given : config.tokens * (p + 1) / (R * (R + 1) / 2);
      given += uneven[p];
    }
    check_every_layout(config, uneven);
    if (R < 2) continue;
    for (int empty : {0, R - 1}) {
      SCOPED_TRACE("rank " + std::to_string(empty) + " holds no tokens");
      std::vector<int64_t> shards = even_shards(config.tokens, R - 1);
      shards.insert(shards.begin() + empty, 0);
      check_every_layout(config, shards);
    }
  }
}

// A constant first feature acts as a bias, so the router can be steered through gate_weights' first row.
TEST(ExpertLayouts, AnExpertThatReceivesNothing) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation);
    SCOPED_TRACE(name_of(config));
    check_every_layout(config, even_shards(config.tokens, R), [&](Matrix& x, ref::MoeWeights& w) {
      x.col(0).setOnes();
      w.gate_weights(0, 1) = -50.0;                       // stored on rank 0
      w.gate_weights(0, config.num_experts - 1) = -50.0;  // stored on the last rank
    });
  }
}

TEST(ExpertLayouts, SwitchingBetweenCallsOnTheSameStorageGivesTheSameResults) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation, Activation::swiglu);
    SCOPED_TRACE(name_of(config));
    const uint64_t seed = shared_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Problem problem = make_problem(config, seed);
    const std::vector<int64_t> shards = even_shards(config.tokens, R);
    const ExpertParallelWeights stored = local_weights(config, problem.weights, world().rank(), R);
    const ExpertParallelWeights before = stored;

    // Every layout, then every layout again in the reverse order, on the same storage.
    std::vector<int> sequence = valid_layouts(config, R);
    const std::vector<int> forwards = sequence;
    sequence.insert(sequence.end(), forwards.rbegin(), forwards.rend());
    std::vector<RankRun> first(forwards.size());
    for (size_t i = 0; i < sequence.size(); ++i) {
      const int r = sequence[i];
      SCOPED_TRACE("call " + std::to_string(i) + ": " + layout_name(r));
      RankRun run = run_layout(problem, shards, stored, r);
      expect_equals_single_device(problem, shards, run);
      const size_t slot = std::find(forwards.begin(), forwards.end(), r) - forwards.begin();
      if (i < forwards.size()) {
        first[slot] = std::move(run);
        continue;
      }
      // The same layout again: the same bits (the storage and the inputs are the same).
      EXPECT_EQ((run.forward.y - first[slot].forward.y).cwiseAbs().maxCoeff(), 0.0);
      EXPECT_EQ((run.grads.x - first[slot].grads.x).cwiseAbs().maxCoeff(), 0.0);
      for (size_t j = 0; j < run.grads.w1.size(); ++j) {
        EXPECT_EQ((run.grads.w1[j] - first[slot].grads.w1[j]).cwiseAbs().maxCoeff(), 0.0);
      }
    }
    // No layout moved or changed a stored copy.
    for (size_t j = 0; j < stored.w1.size(); ++j) {
      EXPECT_EQ(std::memcmp(stored.w1[j].data(), before.w1[j].data(), sizeof(double) * stored.w1[j].size()), 0);
      EXPECT_EQ(std::memcmp(stored.w2[j].data(), before.w2[j].data(), sizeof(double) * stored.w2[j].size()), 0);
    }
  }
}

// ---- what a layout sends, and the choice ----

TEST(ExpertLayouts, BytesSentAreTheHeadersFormulasAndTheCostModels) {
  const int R = world().size(), me = world().rank();
  for (Formulation formulation : kFormulations) {
    for (Activation activation : {Activation::gelu, Activation::swiglu}) {
      const MoeConfig config = layer_config(formulation, activation);
      SCOPED_TRACE(name_of(config));
      const Problem problem = make_problem(config, shared_seed());
      const std::vector<int64_t> shards = even_shards(config.tokens, R);
      const ExpertParallelWeights stored = local_weights(config, problem.weights, me, R);
      const int64_t E = config.num_experts, D = config.model_dim, E_r = E / R;
      const int64_t P_e = D * w1_columns(config) + config.hidden_dim * D;
      LayoutCostModel model;
      model.bytes_per_element = 8.0;
      for (int r : valid_layouts(config, R)) {
        SCOPED_TRACE(layout_name(r));
        const RankRun run = run_layout(problem, shards, stored, r);
        const std::vector<int64_t>& kept = run.forward.kept_per_rank_expert;
        // The weight formulas of expert_layouts.h, forward and backward alike.
        const int64_t weights = r == 0 ? (R - 1) * E_r * P_e : r == 1 ? 0 : (r - 1) * E_r * P_e / r;
        EXPECT_EQ(run.forward.traffic.weight_elements, weights);
        EXPECT_EQ(run.grads.traffic.weight_elements, weights);
        // Tokens: the rows this rank's slots send to other ranks computing their expert, and the
        // rows it computes for other ranks' slots; each way once in the forward, once in the backward.
        const int group = r == 0 ? 1 : r;  // r = 1: each expert's one storing rank
        int64_t rows_out = 0, rows_in = 0;
        for (int64_t e = 0; e < E; ++e) {
          const int first_rank = static_cast<int>(e / (E_r * group)) * group;  // the ranks computing e
          const bool here = me >= first_rank && me < first_rank + group;
          if (r == 0) continue;  // no token moves
          rows_out += kept[me * E + e] * (group - (here ? 1 : 0));
          if (here) {
            for (int q = 0; q < R; ++q) rows_in += q == me ? 0 : kept[q * E + e];
          }
        }
        EXPECT_EQ(run.forward.traffic.token_elements, (rows_out + rows_in) * D);
        EXPECT_EQ(run.grads.traffic.token_elements, (rows_out + rows_in) * D);

        // The cost model fed this step's counts predicts the busiest rank's bytes exactly.
        const LayoutChoice choice = choose_layout(config, R, kept, model);
        const auto estimate = std::find_if(choice.estimates.begin(), choice.estimates.end(),
                                           [r](const LayoutEstimate& e) { return e.r == r; });
        ASSERT_NE(estimate, choice.estimates.end());
        const std::vector<int64_t> all = all_gather<int64_t>(
            world(), std::vector<int64_t>{run.forward.traffic.weight_elements + run.grads.traffic.weight_elements,
                                          run.forward.traffic.token_elements + run.grads.traffic.token_elements});
        int64_t busiest_weights = 0, busiest_tokens = 0;
        for (int p = 0; p < R; ++p) {
          busiest_weights = std::max(busiest_weights, all[2 * p]);
          busiest_tokens = std::max(busiest_tokens, all[2 * p + 1]);
        }
        EXPECT_DOUBLE_EQ(estimate->weight_bytes, 8.0 * static_cast<double>(busiest_weights));
        EXPECT_DOUBLE_EQ(estimate->token_bytes, 8.0 * static_cast<double>(busiest_tokens));
      }
    }
  }
}

TEST(ExpertLayouts, TheCostModelPicksTheCheapestLayout) {
  const int R = world().size();
  MoeConfig config = layer_config(Formulation::dropless);
  LayoutCostModel model;
  const LayoutChoice uniform = choose_layout(config, R, {}, model);
  EXPECT_EQ(uniform.by, "cost model");
  EXPECT_EQ(uniform.candidates, valid_layouts(config, R));
  ASSERT_EQ(uniform.estimates.size(), uniform.candidates.size());
  double least = uniform.estimates[0].total_us;
  for (const LayoutEstimate& estimate : uniform.estimates) {
    least = std::min(least, estimate.total_us);
    EXPECT_NEAR(estimate.total_us, estimate.communication_us + estimate.compute_us, 1e-9 * estimate.total_us);
  }
  for (const LayoutEstimate& estimate : uniform.estimates) {
    if (estimate.r == uniform.r) {
      EXPECT_EQ(estimate.total_us, least);
    }
  }
  if (R < 2) return;
  // Many tokens, small experts: gathering the experts is cheaper than moving the tokens.
  config.tokens = 1 << 20;
  EXPECT_EQ(choose_layout(config, R, {}, model).r, 0);
  // Few tokens, large experts: moving the tokens is cheaper than gathering the experts.
  config.tokens = 8;
  config.hidden_dim = 1 << 14;
  EXPECT_EQ(choose_layout(config, R, {}, model).r, 1);
}

TEST(ExpertLayouts, TheMeasuredChoiceIsTheSameOnEveryRank) {
  const int R = world().size();
  const MoeConfig config = layer_config(Formulation::dropless);
  const Problem problem = make_problem(config, shared_seed());
  const std::vector<int64_t> shards = even_shards(config.tokens, R);
  const Shard shard = shard_of(shards);
  const ExpertParallelWeights stored = local_weights(config, problem.weights, world().rank(), R);
  const std::vector<int> candidates = valid_layouts(config, R);
  const LayoutChoice choice = measure_layouts(world(), config, problem.x.middleRows(shard.offset, shard.tokens),
                                              problem.dy.middleRows(shard.offset, shard.tokens), stored, candidates, 3);
  EXPECT_EQ(choice.by, "measurement");
  EXPECT_EQ(choice.candidates, candidates);
  ASSERT_EQ(choice.measured_us.size(), candidates.size());
  for (double us : choice.measured_us) EXPECT_GT(us, 0.0);
  const auto fastest = std::min_element(choice.measured_us.begin(), choice.measured_us.end());
  EXPECT_EQ(choice.r, candidates[fastest - choice.measured_us.begin()]);
  // Every rank agrees on the times and the choice.
  std::vector<double> mine = choice.measured_us;
  mine.push_back(choice.r);
  const std::vector<double> all = all_gather<double>(world(), mine);
  for (int p = 0; p < R; ++p) {
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(all[p * mine.size() + i], mine[i]) << "rank " << p;
  }
}

// ---- bad settings: a clear error on every rank ----

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

struct RankInputs {
  MoeConfig config;
  Problem problem;
  Matrix x;
  ExpertParallelWeights stored;
};

RankInputs rank_inputs(const MoeConfig& config) {
  RankInputs s{config, make_problem(config, shared_seed()), {}, {}};
  const std::vector<int64_t> shards = even_shards(config.tokens, world().size());
  const Shard shard = shard_of(shards);
  s.x = s.problem.x.middleRows(shard.offset, shard.tokens);
  s.stored = local_weights(config, s.problem.weights, world().rank(), world().size());
  return s;
}

std::string forward_error(const RankInputs& s, const MoeConfig& config, const ExpertLayoutOptions& options) {
  return error_of([&] { expert_layout_forward(world(), config, s.x, s.stored, options); });
}

TEST(ExpertLayouts, DegreesThatDoNotDivideRanksOrHiddenAreAnErrorOnEveryRank) {
  const int R = world().size();
  const RankInputs s = rank_inputs(layer_config(Formulation::dropping));
  ExpertLayoutOptions options;
  options.r = R + 1;  // never divides R
  EXPECT_THAT(forward_error(s, s.config, options),
              HasSubstr("expert layout r = " + std::to_string(R + 1) + ": a sharding degree r > 1 must divide R = " +
                        std::to_string(R)));
  options.r = -1;
  EXPECT_THAT(forward_error(s, s.config, options), HasSubstr("r must be 0 (data parallel), 1 (expert parallel)"));
  EXPECT_THROW(check_layout(s.config, R, R + 1), std::invalid_argument);
  if (R >= 2) {
    // H = 13 is divisible by no r > 1 here; dropping needs no H % B.
    MoeConfig odd = s.config;
    odd.hidden_dim = 13;
    const RankInputs t = rank_inputs(odd);
    options.r = R;
    EXPECT_THAT(forward_error(t, odd, options),
                HasSubstr("a sharding degree r > 1 must divide H = 13 (each rank of a group computes H / r columns"));
    EXPECT_EQ(valid_layouts(odd, R), (std::vector<int>{0, 1}));
  }
  world().barrier();
}

TEST(ExpertLayouts, ExpertsNotDivisibleByRanksIsAnErrorOnEveryRank) {
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "every E divides R = 1";
  const RankInputs s = rank_inputs(layer_config(Formulation::dropless));
  MoeConfig config = s.config;
  config.num_experts = 3 * R + 1;
  for (int r : {0, 1}) {
    ExpertLayoutOptions options;
    options.r = r;
    EXPECT_THAT(forward_error(s, config, options),
                HasSubstr("E = " + std::to_string(3 * R + 1) + " is not divisible by R = " + std::to_string(R)));
  }
  EXPECT_THROW(choose_layout(config, R, {}, LayoutCostModel{}), std::invalid_argument);
  world().barrier();
}

TEST(ExpertLayouts, LayoutsOrConfigsThatDifferBetweenRanksAreAnErrorOnEveryRank) {
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const RankInputs s = rank_inputs(layer_config(Formulation::dropping));
  ExpertLayoutOptions options;
  options.r = world().rank() == 1 ? 0 : 1;
  EXPECT_THAT(forward_error(s, s.config, options),
              HasSubstr("the layouts (r, pipeline_chunks, 2DH node size) differ between ranks: rank(s) 1 disagree"));
  MoeConfig mine = s.config;
  if (world().rank() == R - 1) mine.capacity_factor = 2.0;
  options.r = 0;
  EXPECT_THAT(forward_error(s, mine, options),
              HasSubstr("the MoE configs differ between ranks: rank(s) " + std::to_string(R - 1)));
  world().barrier();
}

TEST(ExpertLayouts, PipeliningOutsideExpertParallelIsAnErrorOnEveryRank) {
  const RankInputs s = rank_inputs(layer_config(Formulation::padded));
  ExpertLayoutOptions options;
  options.r = 0;
  options.expert_parallel.pipeline_chunks = 2;
  EXPECT_THAT(forward_error(s, s.config, options),
              HasSubstr("the d-chunk pipeline and the 2DH exchange belong to the expert-parallel layout (r = 1)"));
  world().barrier();
}

TEST(ExpertLayouts, BadInputOnOneRankIsAnErrorOnEveryRank) {
  const int R = world().size();
  RankInputs s = rank_inputs(layer_config(Formulation::dropless));
  if (world().rank() == R - 1) s.x = Matrix::Ones(s.x.rows(), s.config.model_dim + 1);
  for (int r : {0, R}) {
    ExpertLayoutOptions options;
    options.r = r;
    EXPECT_THAT(forward_error(s, s.config, options), HasSubstr("rank " + std::to_string(R - 1) + ": x has shape"));
  }
  world().barrier();
}

}  // namespace
}  // namespace moe::dist
