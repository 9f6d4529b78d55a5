// test_expert_parallel_cpu.cpp: the expert-parallel layer on CPU ranks equals the single-device
// reference layer (reference_cpu/moe_layer.h) on all ranks' tokens together: forward output, aux
// and z losses, dx, the router gradient and every expert's weight gradients, within 1e-10 relative
// (double), in every formulation (dropless, padded, dropping with the single-device capacity rule),
// with GeLU and SwiGLU, with and without renormalisation; at R = 1..4 ranks with uneven shards, a
// rank without tokens, an expert that receives nothing, all tokens routed to one rank's experts;
// any E over any R (E = 3 R + 1); replicated experts (EPLB's placements, the hottest expert on every
// rank), whose rows split within a row per source; Tutel's pipelining (d = 1, 2, 4, 8) and 2D
// hierarchical exchange change no result; bad settings and placements are an error on every rank.
//   ctest --test-dir build -R DistributedExpertParallelCpu
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_cpu
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "comm/all_to_all_2dh.h"
#include "ep/expert_parallel_cpu.h"
#include "mpi_test_support.h"
#include "reference_cpu/init.h"
#include "reference_cpu/moe_layer.h"

namespace moe::dist {
namespace {

using ref::Matrix;
using testing::mix;
using testing::shared_seed;
using testing::world;

constexpr double kTolerance = 1e-10;  // double precision; only the order of sums differs

// E = 12 divides R = 1, 2, 3 and 4; T = 29 is odd and not a multiple of R or B.
MoeConfig layer_config(Formulation formulation, Activation activation = Activation::gelu, bool renormalize = false) {
  MoeConfig config;
  config.tokens = 29;
  config.model_dim = 6;
  config.hidden_dim = 4;
  config.num_experts = 12;
  config.top_k = 2;
  config.formulation = formulation;
  config.capacity_factor = 0.75;  // C = ceil(0.75 * 29 * 2 / 12) = 4: dropping really drops
  config.block_size = 2;
  config.activation = activation;
  config.renormalize = renormalize;
  config.jitter_eps = 0.1;
  config.seed = 4321;
  config.aux_loss_coef = 0.3;
  config.z_loss_coef = 0.2;
  return config;
}

// Tokens per rank as even as T allows.
std::vector<int64_t> even_shards(int64_t tokens, int ranks) {
  std::vector<int64_t> shards(ranks, tokens / ranks);
  for (int p = 0; p < tokens % ranks; ++p) ++shards[p];
  return shards;
}

// max |actual - expected| / max |expected|; 0 for empty tensors (a rank without tokens).
double relative_error(const Matrix& actual, const Matrix& expected) {
  if (expected.size() == 0) return actual.size() == 0 ? 0.0 : 1.0;
  const double scale = std::max(expected.cwiseAbs().maxCoeff(), 1e-300);
  return (actual - expected).cwiseAbs().maxCoeff() / scale;
}

struct Problem {
  MoeConfig config;
  Matrix x;   // [T, D] all ranks' tokens
  Matrix dy;  // [T, D]
  ref::MoeWeights weights;
};

// Fresh random inputs; `shape` may then steer the routing (it edits x and the weights).
Problem make_problem(const MoeConfig& config, uint64_t seed,
                     const std::function<void(Matrix&, ref::MoeWeights&)>& shape = {}) {
  std::mt19937_64 generator(seed);
  Problem problem{config, ref::random_matrix(config.tokens, config.model_dim, generator),
                  ref::random_matrix(config.tokens, config.model_dim, generator),
                  ref::random_weights(config, mix(seed, 1))};
  if (shape) shape(problem.x, problem.weights);
  return problem;
}

struct RankRun {
  ExpertParallelForward forward;
  ExpertParallelGradients grads;
};

// The layer on this rank's shard.
RankRun run_expert_parallel(const Problem& problem, const std::vector<int64_t>& shards,
                            const ExpertParallelOptions& options = {}) {
  Communicator& comm = world();
  int64_t offset = 0;
  for (int p = 0; p < comm.rank(); ++p) offset += shards[p];
  const int64_t T_r = shards[comm.rank()];
  const Matrix x = problem.x.middleRows(offset, T_r);
  const Matrix dy = problem.dy.middleRows(offset, T_r);
  const ExpertParallelWeights weights =
      options.placement ? local_weights(problem.config, problem.weights, comm.rank(), *options.placement)
                        : local_weights(problem.config, problem.weights, comm.rank(), comm.size());
  RankRun run;
  run.forward = expert_parallel_forward(comm, problem.config, x, weights, options);
  run.grads = expert_parallel_backward(comm, problem.config, x, weights, run.forward, dy);
  return run;
}

// This rank's results against the single-device layer on all tokens.
void expect_equals_single_device(const Problem& problem, const std::vector<int64_t>& shards, const RankRun& run) {
  const MoeConfig& config = problem.config;
  const Communicator& comm = world();
  const ref::LayerForward forward = ref::moe_forward(config, problem.x, problem.weights);
  const ref::LayerGradients grads = ref::moe_backward(config, problem.x, problem.weights, forward, problem.dy);
  int64_t offset = 0;
  for (int p = 0; p < comm.rank(); ++p) offset += shards[p];
  const int64_t T_r = shards[comm.rank()];

  EXPECT_EQ(run.forward.token_offset, offset);
  EXPECT_EQ(run.forward.tokens, config.tokens);
  EXPECT_LE(relative_error(run.forward.y, forward.y.middleRows(offset, T_r)), kTolerance) << "y";
  EXPECT_NEAR(run.forward.aux_loss, forward.aux_loss, kTolerance * std::abs(forward.aux_loss)) << "aux loss";
  EXPECT_NEAR(run.forward.z_loss, forward.z_loss, kTolerance * std::abs(forward.z_loss)) << "z loss";
  EXPECT_LE(relative_error(run.grads.x, grads.x.middleRows(offset, T_r)), kTolerance) << "dx";
  EXPECT_LE(relative_error(run.grads.gate_weights, grads.gate_weights), kTolerance) << "d gate_weights";
  // Each slot of this rank against its expert (a replica's gradient is its expert's whole one).
  const std::vector<int64_t>& mine = run.forward.placement.experts_of(comm.rank());
  ASSERT_EQ(run.grads.w1.size(), mine.size());
  for (size_t j = 0; j < mine.size(); ++j) {
    const int64_t e = mine[j];
    // An expert that computed nothing has zero gradients; compare absolutely there.
    if (grads.w2[e].cwiseAbs().maxCoeff() == 0.0) {
      EXPECT_EQ(run.grads.w1[j].cwiseAbs().maxCoeff(), 0.0) << "d w1 of idle expert " << e;
      EXPECT_EQ(run.grads.w2[j].cwiseAbs().maxCoeff(), 0.0) << "d w2 of idle expert " << e;
      continue;
    }
    EXPECT_LE(relative_error(run.grads.w1[j], grads.w1[e]), kTolerance) << "d w1 of expert " << e;
    EXPECT_LE(relative_error(run.grads.w2[j], grads.w2[e]), kTolerance) << "d w2 of expert " << e;
  }
  // The counts: routed before dropping, kept after, summed over ranks, as the single-device plan.
  for (int64_t e = 0; e < config.num_experts; ++e) {
    int64_t routed = 0, kept = 0;
    for (int p = 0; p < comm.size(); ++p) {
      routed += run.forward.routed_per_rank_expert[p * config.num_experts + e];
      kept += run.forward.kept_per_rank_expert[p * config.num_experts + e];
    }
    EXPECT_EQ(routed, forward.plan.tokens_per_expert[e]) << "expert " << e;
    EXPECT_EQ(kept, forward.plan.kept_per_expert[e]) << "expert " << e;
  }
  EXPECT_EQ(run.forward.dropped_slots, forward.plan.dropped_slots);
  // In one exchange without replicas, each local expert computes the rows the single-device plan
  // gives it: its kept slots, C when padded, rounded up to B when dropless.
  if (run.forward.chunks.size() == 1 && !run.forward.placement.replicated()) {
    const ref::DispatchPlan& local = run.forward.chunks[0].expert_plan;
    for (size_t j = 0; j < mine.size(); ++j) {
      EXPECT_EQ(local.rows_per_expert[j], forward.plan.rows_per_expert[mine[j]]) << "expert " << mine[j];
    }
  }
  // The rows sent to an expert's replicas add up to its kept slots, each source's split within a row;
  // a shadowed expert's rows all stay with their source.
  const ExpertPlacement& placement = run.forward.placement;
  for (int64_t e = 0; e < config.num_experts; ++e) {
    for (int source = 0; source < comm.size(); ++source) {
      int64_t sent = 0, most = 0, least = config.tokens, home = 0;
      for (int64_t slot : placement.replicas(e)) {
        const int64_t rows = run.forward.rows_per_rank_slot[source * placement.slots() + slot];
        sent += rows;
        most = std::max(most, rows);
        least = std::min(least, rows);
        if (placement.slot_rank(slot) == source) home = rows;
      }
      const int64_t kept = run.forward.kept_per_rank_expert[source * config.num_experts + e];
      EXPECT_EQ(sent, kept) << "expert " << e;
      if (placement.shadowed(e)) {
        EXPECT_EQ(home, kept) << "shadowed expert " << e << " from rank " << source;
      } else {
        EXPECT_LE(most - least, 1) << "expert " << e << " from rank " << source;
      }
    }
  }
}

// One whole check: fresh problem, the layer on the shards, the comparison.
RankRun check_case(const MoeConfig& config, const std::vector<int64_t>& shards,
                   const ExpertParallelOptions& options = {},
                   const std::function<void(Matrix&, ref::MoeWeights&)>& shape = {}) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem problem = make_problem(config, seed, shape);
  RankRun run = run_expert_parallel(problem, shards, options);
  expect_equals_single_device(problem, shards, run);
  return run;
}

const Formulation kFormulations[] = {Formulation::dropless, Formulation::padded, Formulation::dropping};

std::string name_of(const MoeConfig& config) {
  return std::string(to_string(config.formulation)) + " " + std::string(to_string(config.activation)) +
         (config.renormalize ? " renormalized" : "");
}

// ---- equal to the single-device layer ----

TEST(ExpertParallelCpu, EqualsTheSingleDeviceLayerInEveryFormulation) {
  for (Formulation formulation : kFormulations) {
    for (Activation activation : {Activation::gelu, Activation::swiglu}) {
      for (bool renormalize : {false, true}) {
        const MoeConfig config = layer_config(formulation, activation, renormalize);
        SCOPED_TRACE(name_of(config));
        check_case(config, even_shards(config.tokens, world().size()));
      }
    }
  }
}

TEST(ExpertParallelCpu, UnevenShards) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation);
    SCOPED_TRACE(name_of(config));
    // Rank p holds p + 1 parts of T: the last rank the most.
    std::vector<int64_t> shards(R);
    int64_t given = 0;
    for (int p = 0; p < R; ++p) {
      shards[p] = p + 1 == R ? config.tokens - given : config.tokens * (p + 1) / (R * (R + 1) / 2);
      given += shards[p];
    }
    check_case(config, shards);
  }
}

TEST(ExpertParallelCpu, RanksWithoutTokens) {
  // A rank that sends nothing still takes part: it receives its experts' rows and computes them.
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "needs two ranks (T >= 1 tokens live somewhere)";
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation);
    SCOPED_TRACE(name_of(config));
    for (int empty : {0, R - 1}) {
      SCOPED_TRACE("rank " + std::to_string(empty) + " holds no tokens");
      std::vector<int64_t> shards = even_shards(config.tokens, R - 1);
      shards.insert(shards.begin() + empty, 0);
      const RankRun run = check_case(config, shards);
      if (world().rank() == empty) {
        EXPECT_EQ(run.forward.y.rows(), 0);
        for (const ExpertParallelChunk& chunk : run.forward.chunks) {
          for (int64_t rows : chunk.send_rows) EXPECT_EQ(rows, 0);
        }
      }
    }
    // Every token on one rank.
    std::vector<int64_t> one(R, 0);
    one[R / 2] = config.tokens;
    check_case(config, one);
  }
}

// A constant first feature acts as a bias, so the router can be steered through gate_weights' first row.
void set_bias_feature(Matrix& x) { x.col(0).setOnes(); }

TEST(ExpertParallelCpu, AnExpertThatReceivesNothing) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation);
    SCOPED_TRACE(name_of(config));
    const int64_t idle_first = 1, idle_last = config.num_experts - 1;  // on rank 0 and on the last rank
    const RankRun run = check_case(config, even_shards(config.tokens, R), {}, [&](Matrix& x, ref::MoeWeights& w) {
      set_bias_feature(x);
      w.gate_weights(0, idle_first) = -50.0;
      w.gate_weights(0, idle_last) = -50.0;
    });
    for (int p = 0; p < R; ++p) {
      EXPECT_EQ(run.forward.routed_per_rank_expert[p * config.num_experts + idle_first], 0);
      EXPECT_EQ(run.forward.routed_per_rank_expert[p * config.num_experts + idle_last], 0);
    }
  }
}

TEST(ExpertParallelCpu, AllTokensRoutedToOneRanksExperts) {
  // The last rank's experts win every token: every other rank sends everything there and receives
  // nothing; dropping keeps the first C slots of each expert over all ranks, in token order.
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    const MoeConfig config = layer_config(formulation);
    SCOPED_TRACE(name_of(config));
    const int64_t per_rank = config.num_experts / R;
    const RankRun run = check_case(config, even_shards(config.tokens, R), {}, [&](Matrix& x, ref::MoeWeights& w) {
      set_bias_feature(x);
      for (int64_t j = 0; j < per_rank; ++j) w.gate_weights(0, (R - 1) * per_rank + j) = 40.0 + j;
    });
    const ExpertParallelChunk& chunk = run.forward.chunks[0];
    for (int p = 0; p + 1 < R; ++p) EXPECT_EQ(chunk.send_rows[p], 0) << "rows to rank " << p;
    if (world().rank() + 1 < R) {
      for (int64_t rows : chunk.recv_rows) EXPECT_EQ(rows, 0);
    }
  }
}

// ---- Tutel on the CPU path ----

TEST(ExpertParallelCpu, PipelinedChunksChangeNoResult) {
  for (Formulation formulation : kFormulations) {
    for (Activation activation : {Activation::gelu, Activation::swiglu}) {
      const MoeConfig config = layer_config(formulation, activation);
      SCOPED_TRACE(name_of(config));
      const uint64_t seed = shared_seed();
      SCOPED_TRACE("seed " + std::to_string(seed));
      const Problem problem = make_problem(config, seed);
      const std::vector<int64_t> shards = even_shards(config.tokens, world().size());
      const RankRun single = run_expert_parallel(problem, shards);
      for (int d : {1, 2, 4, 8}) {
        SCOPED_TRACE("d = " + std::to_string(d));
        ExpertParallelOptions options;
        options.pipeline_chunks = d;
        const RankRun run = run_expert_parallel(problem, shards, options);
        ASSERT_EQ(run.forward.chunks.size(), static_cast<size_t>(d));
        expect_equals_single_device(problem, shards, run);
        EXPECT_LE(relative_error(run.forward.y, single.forward.y), kTolerance) << "y against d = 1";
        EXPECT_LE(relative_error(run.grads.x, single.grads.x), kTolerance) << "dx against d = 1";
        EXPECT_LE(relative_error(run.grads.gate_weights, single.grads.gate_weights), kTolerance);
        for (size_t j = 0; j < run.grads.w1.size(); ++j) {
          EXPECT_LE((run.grads.w1[j] - single.grads.w1[j]).cwiseAbs().maxCoeff(),
                    kTolerance * std::max(1.0, single.grads.w1[j].cwiseAbs().maxCoeff()));
          EXPECT_LE((run.grads.w2[j] - single.grads.w2[j]).cwiseAbs().maxCoeff(),
                    kTolerance * std::max(1.0, single.grads.w2[j].cwiseAbs().maxCoeff()));
        }
        // The chunks together carry exactly the rows of the single exchange.
        int64_t rows = 0, single_rows = 0;
        for (const ExpertParallelChunk& chunk : run.forward.chunks) {
          for (int64_t r : chunk.send_rows) rows += r;
        }
        for (int64_t r : single.forward.chunks[0].send_rows) single_rows += r;
        EXPECT_EQ(rows, single_rows);
      }
    }
  }
}

TEST(ExpertParallelCpu, HierarchicalExchangeGivesTheSameBits) {
  const int R = world().size();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("G = " + std::to_string(G));
    HierarchicalAllToAll hierarchical(world(), G);
    for (Formulation formulation : kFormulations) {
      const MoeConfig config = layer_config(formulation);
      SCOPED_TRACE(name_of(config));
      const uint64_t seed = shared_seed();
      const Problem problem = make_problem(config, seed);
      const std::vector<int64_t> shards = even_shards(config.tokens, R);
      const RankRun flat = run_expert_parallel(problem, shards);
      for (int d : {1, 4}) {
        ExpertParallelOptions options;
        options.hierarchical = &hierarchical;
        options.pipeline_chunks = d;
        const RankRun run = run_expert_parallel(problem, shards, options);
        expect_equals_single_device(problem, shards, run);
        if (d == 1) {  // the exchange moves the same bits, so every result is bit-identical
          EXPECT_EQ((run.forward.y - flat.forward.y).cwiseAbs().maxCoeff(), 0.0);
          EXPECT_EQ((run.grads.x - flat.grads.x).cwiseAbs().maxCoeff(), 0.0);
          EXPECT_EQ((run.grads.gate_weights - flat.grads.gate_weights).cwiseAbs().maxCoeff(), 0.0);
        }
      }
    }
  }
}

// ---- placements: any E over any R, replicated experts ----

// E = 3 R + 1 experts: no R > 1 divides it, so some ranks hold one expert more.
TEST(ExpertParallelCpu, AnyExpertCountOverAnyRanks) {
  const int R = world().size();
  for (Formulation formulation : kFormulations) {
    MoeConfig config = layer_config(formulation);
    config.num_experts = 3 * R + 1;
    SCOPED_TRACE(name_of(config) + ", E = " + std::to_string(config.num_experts));
    const RankRun run = check_case(config, even_shards(config.tokens, R));
    EXPECT_EQ(run.forward.placement.slots_of(world().rank()), contiguous_placement(config.num_experts, R).slots_of(world().rank()));
  }
}

// The placements replicas are tested under: EPLB from the routing's own loads (1 and 2 redundant
// slots a rank), the hottest expert on every rank with its rows split over the copies, and the same
// expert shadowed (FasterMoE: every source computes its own rows of it).
std::vector<ExpertPlacement> replicated_placements(const Problem& problem, int ranks) {
  const MoeConfig& config = problem.config;
  const ref::LayerForward single = ref::moe_forward(config, problem.x, problem.weights);
  std::vector<double> load(single.plan.tokens_per_expert.begin(), single.plan.tokens_per_expert.end());
  std::vector<ExpertPlacement> out;
  const int64_t base = (config.num_experts + ranks - 1) / ranks;
  for (int64_t redundant : {1, 2}) {
    if (redundant <= config.num_experts - base) out.push_back(eplb_placement(load, ranks, redundant));
  }
  const int64_t hottest = std::max_element(load.begin(), load.end()) - load.begin();
  std::vector<std::vector<int64_t>> held;
  for (int r = 0; r < ranks; ++r) {
    std::vector<int64_t> mine = contiguous_placement(config.num_experts, ranks).experts_of(r);
    if (std::find(mine.begin(), mine.end(), hottest) == mine.end()) mine.push_back(hottest);
    held.push_back(mine);
  }
  out.emplace_back(config.num_experts, held);
  out.push_back(contiguous_placement(config.num_experts, ranks).with_shadowed({hottest}));
  return out;
}

// Replicas split an expert's rows and sum its gradients: every result still equals the single
// device's, with Tutel's chunks and with uneven shards, dropless and dropping (half the tokens on
// expert 0 makes a hot expert whose capacity really drops).
TEST(ExpertParallelCpu, ReplicatedExpertsEqualTheSingleDeviceLayer) {
  const int R = world().size();
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    for (int chunks : {1, 3}) {
      const MoeConfig config = layer_config(formulation);
      const uint64_t seed = shared_seed();
      const Problem problem = make_problem(config, seed, [](Matrix& x, ref::MoeWeights& weights) {
        x.col(0).setOnes();
        weights.gate_weights.row(0).setZero();
        weights.gate_weights(0, 0) = 2.0;  // expert 0 the favourite of most tokens
      });
      for (const ExpertPlacement& placement : replicated_placements(problem, R)) {
        SCOPED_TRACE(name_of(config) + ", d = " + std::to_string(chunks) + ", seed " + std::to_string(seed) + ", " +
                     placement.describe());
        ExpertParallelOptions options;
        options.pipeline_chunks = chunks;
        options.placement = &placement;
        std::vector<int64_t> shards = even_shards(config.tokens, R);
        if (chunks == 3 && R > 1) {  // uneven: the last rank holds a third more
          shards[0] -= 2;
          shards[R - 1] += 2;
        }
        const RankRun run = run_expert_parallel(problem, shards, options);
        expect_equals_single_device(problem, shards, run);
      }
    }
  }
}

// ---- bad settings: a clear error on every rank ----

// Runs f on every rank and returns the message of its std::invalid_argument ("" if none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

using ::testing::HasSubstr;

TEST(ExpertParallelCpu, BadPlacementsAreAnErrorOnEveryRank) {
  const int R = world().size();
  const MoeConfig config = layer_config(Formulation::dropless);
  const Problem problem = make_problem(config, shared_seed());
  const Matrix x = problem.x.middleRows(0, even_shards(config.tokens, R)[world().rank()]);
  const auto run_with = [&](const MoeConfig& c, const ExpertPlacement& placement) {
    return error_of([&] {
      ExpertParallelOptions options;
      options.placement = &placement;
      expert_parallel_forward(world(), c, x, local_weights(config, problem.weights, world().rank(), R), options);
    });
  };
  // A placement of another E.
  EXPECT_THAT(run_with(config, contiguous_placement(config.num_experts - 1, R)),
              HasSubstr("placement is of E = " + std::to_string(config.num_experts - 1)));
  // Padded with replicas: expert 0 on every rank.
  std::vector<std::vector<int64_t>> held;
  for (int r = 0; r < R; ++r) {
    std::vector<int64_t> mine = contiguous_placement(config.num_experts, R).experts_of(r);
    if (r > 0) mine.push_back(0);
    held.push_back(mine);
  }
  if (R > 1) {
    EXPECT_THAT(run_with(layer_config(Formulation::padded), ExpertPlacement(config.num_experts, held)),
                HasSubstr("a placement with replicas takes dropless or dropping"));
  }
  // Placements that differ between ranks.
  if (R > 1) {
    const ExpertPlacement mine = world().rank() == 0 ? ExpertPlacement(config.num_experts, held)
                                                     : contiguous_placement(config.num_experts, R);
    EXPECT_THAT(run_with(config, mine), HasSubstr("the expert placements"));
  }
  world().barrier();
}

TEST(ExpertParallelCpu, TopKAboveExpertsIsAnErrorOnEveryRank) {
  const int R = world().size();
  const MoeConfig good = layer_config(Formulation::dropless);
  const Problem problem = make_problem(good, shared_seed());
  MoeConfig config = good;
  config.top_k = config.num_experts + 1;
  const std::string message = error_of([&] {
    expert_parallel_forward(world(), config, problem.x.topRows(even_shards(config.tokens, R)[world().rank()]),
                            local_weights(good, problem.weights, world().rank(), R));
  });
  EXPECT_THAT(message, HasSubstr("top_k (K) = 13; allowed: 1 <= K <= E (E = 12)"));
  world().barrier();
}

TEST(ExpertParallelCpu, ConfigsThatDifferBetweenRanksAreAnErrorOnEveryRank) {
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const MoeConfig config = layer_config(Formulation::dropping);
  const Problem problem = make_problem(config, shared_seed());
  const std::vector<int64_t> shards = even_shards(config.tokens, R);
  MoeConfig mine = config;
  if (world().rank() == 1) mine.capacity_factor = 2.0;
  const std::string message = error_of([&] {
    expert_parallel_forward(world(), mine, problem.x.topRows(shards[world().rank()]),
                            local_weights(config, problem.weights, world().rank(), R));
  });
  EXPECT_THAT(message, HasSubstr("the MoE configs differ between ranks: rank(s) 1 disagree with rank 0"));
  world().barrier();
}

TEST(ExpertParallelCpu, BadInputOnOneRankIsAnErrorOnEveryRank) {
  const int R = world().size();
  const MoeConfig config = layer_config(Formulation::dropless);
  const Problem problem = make_problem(config, shared_seed());
  const std::vector<int64_t> shards = even_shards(config.tokens, R);
  const ExpertParallelWeights weights = local_weights(config, problem.weights, world().rank(), R);
  Matrix x = problem.x.topRows(shards[world().rank()]);
  if (world().rank() == R - 1) x = Matrix::Ones(x.rows(), config.model_dim + 1);  // the wrong width, on one rank
  const std::string message = error_of([&] { expert_parallel_forward(world(), config, x, weights); });
  EXPECT_THAT(message, HasSubstr("rank " + std::to_string(R - 1) + ": x has shape"));

  // Shards that do not add up to T: one row more on every rank (a matrix of its own; at R = 1 the
  // problem's x has no row to spare).
  const Matrix one_more = Matrix::Zero(shards[world().rank()] + 1, config.model_dim);
  const std::string tokens = error_of([&] { expert_parallel_forward(world(), config, one_more, weights); });
  EXPECT_THAT(tokens, HasSubstr("config.tokens says T = " + std::to_string(config.tokens)));

  // No pipelining degree below 1.
  ExpertParallelOptions options;
  options.pipeline_chunks = 0;
  const std::string chunks = error_of([&] {
    expert_parallel_forward(world(), config, problem.x.topRows(shards[world().rank()]), weights, options);
  });
  EXPECT_THAT(chunks, HasSubstr("pipeline_chunks = 0"));
  world().barrier();
}

}  // namespace
}  // namespace moe::dist
