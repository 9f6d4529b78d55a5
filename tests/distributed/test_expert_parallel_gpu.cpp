// test_expert_parallel_gpu.cpp: the expert-parallel layer on the GPU (distributed/expert_parallel_gpu.h)
// against the single-GPU layer (cuda/moe/moe_layer.h, MoeLayerGpu) on all ranks' tokens together,
// from the same bf16 inputs: y, dx, the router gradient (all-reduced) and this rank's experts'
// weight gradients within 2e-2 relative (bf16 activations; the two layers sum in other orders),
// the routing itself exactly; in the dropless formulation at B = 64 and 128, padded and dropping
// (capacity counted over all tokens), uneven shards, a rank without tokens, experts that receive
// nothing. Tutel's pipelining: d = 2, 4, 8 give y, dx and the router gradient bit for bit equal to
// d = 1 (B = 64: the portable kernels compute a row the same way whatever rows surround it), the
// expert weight gradients (one product over all chunks' rows) within fp32 rounding. Adaptive
// pipelining: the trials run every candidate d in turn, each step's y and dx bit for bit d = 1's and
// its weight gradients within fp32 rounding, then every rank keeps the same d, one of the
// candidates, with a measured time for each. Tutel's 2DH exchange (nodes of G ranks; R = 2: G = 2,
// R = 4: G = 2 and 4) gives every output bit for bit equal to the flat exchange's, in every
// formulation and pipelined. The exchange alone (identity experts) returns every row unchanged. Bad
// settings and bad forward inputs are an error on every rank.
//
// Built twice: test_distributed_expert_parallel_gpu runs the layer over the MPI backend (ranks may
// share a GPU: rank r uses device r % devices, its rows staged through host memory);
// test_distributed_expert_parallel_gpu_nccl (MOE_TEST_NCCL_BACKEND) over NCCL, one GPU per rank.
// Without a GPU (or, for NCCL, with fewer GPUs than ranks) every GPU test skips on every rank,
// saying why; the settings checks of the MPI build still run, as they need no GPU.
//   ctest --test-dir build -R DistributedExpertParallelGpu --output-on-failure
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_parallel_gpu_nccl
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/device_buffer.h"       // DeviceBuffer
#include "core/device_info.h"         // why_no_gpu
#include "bridge/reference_bridge.h"    // round_bf16, bf16_of, matrix_of
#include "ep/expert_parallel_gpu.h"      // ExpertParallelGpu
#include "moe/block_sparse.h"         // expert_pointer_table
#include "moe/moe_layer.h"            // MoeLayerGpu: the oracle
#include "expert_problem_test_support.h"  // base_config, make_problem, shards
#include "gpu_ranks_test_support.h"  // GpuRanksTest
#include "mpi_test_support.h"         // world, shared_seed
#include "reference_cpu/init.h"       // random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // MoeWeights
#if MOE_TEST_NCCL_BACKEND
#include "comm/nccl_communicator.h"
#endif

namespace moe::dist {
namespace {

using cuda::DeviceBuffer;
using ref::Matrix;
using testing::shared_seed;
using testing::world;
using testing::base_config;
using testing::even_shards;
using testing::make_problem;
using testing::offset_of;
using testing::Problem;
using testing::relative_error;
using testing::uneven_shards;

constexpr double kTolerance = 2e-2;           // bf16 activations, fp32 accumulation
constexpr double kChunkSumTolerance = 1e-5;   // the same fp32 sums in another order

// ---- the ranks' communicator for the layer, or why there is none ----

class ExpertParallelGpuTest : public testing::GpuRanksTest<ExpertParallelGpuTest> {};

// ---- the single-GPU layer on all tokens (every rank runs it) ----

struct SingleGpuRun {
  Matrix y, dx, d_gate;         // [T, D] [T, D] [D, E]
  std::vector<Matrix> d_w1, d_w2;  // E of each
  std::vector<int> top;         // [T, K]
  double aux_loss = 0, z_loss = 0;
};

SingleGpuRun run_single_gpu(const Problem& p) {
  const MoeConfig& c = p.config;
  const int64_t T = c.tokens, D = c.model_dim, H = c.hidden_dim, E = c.num_experts;
  DeviceBuffer<bf16> x(cuda::bf16_of(p.x)), dy(cuda::bf16_of(p.dy)), gate(cuda::bf16_of(p.weights.gate_weights));
  DeviceBuffer<bf16> w1(cuda::bf16_of(p.weights.w1)), w2(cuda::bf16_of(p.weights.w2)), y(size_t(T * D));
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), int(E), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), int(E), size_t(H * D));
  DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * H)), d_w2(size_t(E * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * H));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
  cuda::MoeLayerGpu layer(c);
  const cuda::MoeLayerWeights weights{gate.data(), w1_table.data(), w2_table.data()};
  layer.forward(x.data(), weights, y.data(), nullptr);
  layer.backward(x.data(), weights, dy.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                 nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  SingleGpuRun run;
  run.y = cuda::matrix_of(y.download(), T, D);
  run.dx = cuda::matrix_of(dx.download(), T, D);
  run.d_gate = cuda::matrix_of(d_gate.download(), D, E);
  const auto d_w1_host = d_w1.download(), d_w2_host = d_w2.download();
  for (int64_t e = 0; e < E; ++e) {
    run.d_w1.push_back(cuda::matrix_of(d_w1_host, D, H, size_t(e * D * H)));
    run.d_w2.push_back(cuda::matrix_of(d_w2_host, H, D, size_t(e * H * D)));
  }
  run.top = layer.top_experts().download();
  run.aux_loss = layer.aux_loss().download()[0];
  run.z_loss = layer.z_loss().download()[0];
  return run;
}

// ---- the expert-parallel layer on this rank's shard ----

struct ExpertParallelRun {
  Matrix y, dx, d_gate;            // [T_r, D] [T_r, D] [D, E]
  std::vector<Matrix> d_w1, d_w2;  // this rank's slots' (E_r experts by default)
  std::vector<int64_t> experts;    // the expert of each slot
  std::vector<int> top;            // [T_r, K]
  std::vector<bf16> y_raw;         // the same, as bits, for the pipelining's bit-for-bit check
  std::vector<float> dx_raw, d_gate_raw;
  ExpertParallelGpuStep step;
};

ExpertParallelRun run_expert_parallel(const Problem& p, const std::vector<int64_t>& shards,
                                      const ExpertParallelGpuOptions& options = {}) {
  Communicator& comm = ExpertParallelGpuTest::device_communicator();
  const MoeConfig& c = p.config;
  const int R = comm.size(), rank = comm.rank();
  const int64_t D = c.model_dim, H = c.hidden_dim, E = c.num_experts, K = c.top_k;
  const std::vector<int64_t> mine =
      options.placement ? options.placement->experts_of(rank) : contiguous_placement(E, R).experts_of(rank);
  const int64_t E_r = static_cast<int64_t>(mine.size());  // this rank's slots
  const int64_t offset = offset_of(shards, rank), T_r = shards[rank];
  DeviceBuffer<bf16> x(cuda::bf16_of(Matrix(p.x.middleRows(offset, T_r))));
  DeviceBuffer<bf16> dy(cuda::bf16_of(Matrix(p.dy.middleRows(offset, T_r))));
  DeviceBuffer<bf16> gate(cuda::bf16_of(p.weights.gate_weights));
  std::vector<Matrix> w1_local, w2_local;
  for (int64_t e : mine) {
    w1_local.push_back(p.weights.w1[e]);
    w2_local.push_back(p.weights.w2[e]);
  }
  DeviceBuffer<bf16> w1(cuda::bf16_of(w1_local)), w2(cuda::bf16_of(w2_local));
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), int(E_r), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), int(E_r), size_t(H * D));
  DeviceBuffer<bf16> y(size_t(T_r * D));
  DeviceBuffer<float> dx(size_t(T_r * D)), d_gate(size_t(D * E)), d_w1(size_t(E_r * D * H)), d_w2(size_t(E_r * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E_r), size_t(D * H));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E_r), size_t(H * D));
  for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2}) buffer->fill_bytes(0xFF);  // NaN poison
  y.fill_bytes(0xFF);

  ExpertParallelGpu layer(comm, c, *std::max_element(shards.begin(), shards.end()), options);
  const ExpertParallelGpuWeights weights{gate.data(), w1_table.data(), w2_table.data()};
  layer.forward(x.data(), T_r, weights, y.data(), nullptr);
  layer.backward(x.data(), weights, dy.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                 nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  ExpertParallelRun run;
  run.y_raw = y.download();
  run.dx_raw = dx.download();
  run.d_gate_raw = d_gate.download();
  run.y = cuda::matrix_of(run.y_raw, T_r, D);
  run.dx = cuda::matrix_of(run.dx_raw, T_r, D);
  run.d_gate = cuda::matrix_of(run.d_gate_raw, D, E);
  const auto d_w1_host = d_w1.download(), d_w2_host = d_w2.download();
  for (int64_t j = 0; j < E_r; ++j) {
    run.d_w1.push_back(cuda::matrix_of(d_w1_host, D, H, size_t(j * D * H)));
    run.d_w2.push_back(cuda::matrix_of(d_w2_host, H, D, size_t(j * H * D)));
  }
  run.experts = mine;
  const std::vector<int> top = layer.top_experts().download();
  run.top.assign(top.begin(), top.begin() + T_r * K);
  run.step = layer.last_step();
  return run;
}

// This rank's results against the single-GPU layer's on all tokens.
void expect_equals_single_gpu(const Problem& p, const std::vector<int64_t>& shards, const ExpertParallelRun& run,
                              const SingleGpuRun& single) {
  const MoeConfig& c = p.config;
  const int rank = world().rank();
  const int64_t K = c.top_k;
  const int64_t offset = offset_of(shards, rank), T_r = shards[rank];
  int flips = 0;
  for (int64_t i = 0; i < T_r * K; ++i) flips += run.top[size_t(i)] != single.top[size_t(offset * K + i)];
  ASSERT_EQ(flips, 0) << "the routing differs from the single-GPU layer's in " << flips << " slots";
  EXPECT_EQ(run.step.tokens, c.tokens);
  EXPECT_EQ(run.step.token_offset, offset);
  ASSERT_TRUE(run.y.allFinite());
  ASSERT_TRUE(run.dx.allFinite());
  ASSERT_TRUE(run.d_gate.allFinite());
  EXPECT_LT(relative_error(run.y, single.y.middleRows(offset, T_r)), kTolerance) << "y";
  EXPECT_LT(relative_error(run.dx, single.dx.middleRows(offset, T_r)), kTolerance) << "dx";
  EXPECT_LT(relative_error(run.d_gate, single.d_gate), kTolerance) << "d gate_weights (all-reduced)";
  EXPECT_NEAR(run.step.aux_loss, single.aux_loss, 1e-4 * std::max(1.0, single.aux_loss)) << "aux loss";
  EXPECT_NEAR(run.step.z_loss, single.z_loss, 1e-4 * std::max(1.0, single.z_loss)) << "z loss";
  for (size_t j = 0; j < run.experts.size(); ++j) {  // a replica's gradient is its expert's whole one
    const int64_t e = run.experts[j];
    ASSERT_TRUE(run.d_w1[j].allFinite() && run.d_w2[j].allFinite()) << "expert " << e;
    if (single.d_w1[e].norm() == 0) {  // an expert without rows: exactly zero
      EXPECT_EQ(run.d_w1[j].norm(), 0.0) << "d w1 of idle expert " << e;
      EXPECT_EQ(run.d_w2[j].norm(), 0.0) << "d w2 of idle expert " << e;
      continue;
    }
    EXPECT_LT(relative_error(run.d_w1[j], single.d_w1[e]), kTolerance) << "d w1 of expert " << e;
    EXPECT_LT(relative_error(run.d_w2[j], single.d_w2[e]), kTolerance) << "d w2 of expert " << e;
  }
}

void check_case(const MoeConfig& config, const std::vector<int64_t>& shards, const ExpertParallelGpuOptions& options = {},
                double gate_scale = 1.0, int favoured_expert = -1) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(config.formulation)) + ", d = " +
               std::to_string(options.pipeline_chunks));
  const Problem problem = make_problem(config, seed, gate_scale, favoured_expert);
  const SingleGpuRun single = run_single_gpu(problem);
  const ExpertParallelRun run = run_expert_parallel(problem, shards, options);
  expect_equals_single_gpu(problem, shards, run, single);
}

// ---- equal to the single-GPU layer ----

TEST_F(ExpertParallelGpuTest, DroplessEqualsTheSingleGpuLayer) {
  MoeConfig c = base_config();
  check_case(c, even_shards(c.tokens, world().size()));
  check_case(c, uneven_shards(c.tokens, world().size()));
  c.block_size = 128;  // the Hopper kernels where the build has sm_90a
  check_case(c, uneven_shards(c.tokens, world().size()));
}

TEST_F(ExpertParallelGpuTest, PaddedAndDroppingEqualTheSingleGpuLayer) {
  MoeConfig c = base_config();
  c.formulation = Formulation::padded;
  c.capacity_factor = 2.0;
  check_case(c, uneven_shards(c.tokens, world().size()));
  check_case(c, uneven_shards(c.tokens, world().size()), {.pipeline_chunks = 2});
  c.formulation = Formulation::dropping;
  c.capacity_factor = 1.0;  // drops: capacity over all tokens, as the single-GPU layer counts it
  check_case(c, even_shards(c.tokens, world().size()), {}, /*gate_scale=*/3.0);
  check_case(c, even_shards(c.tokens, world().size()), {.pipeline_chunks = 4}, 3.0);
}

// Placements (expert_placement.h): E not divisible by R, EPLB's replicas from the single GPU's own
// routing, and the favoured expert shadowed; dropless, pipelined, and dropping.
TEST_F(ExpertParallelGpuTest, PlacementsEqualTheSingleGpuLayer) {
  const int R = world().size();
  MoeConfig c = base_config();
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    c.formulation = formulation;
    c.capacity_factor = 1.0;
    const uint64_t seed = shared_seed();
    const Problem problem = make_problem(c, seed, 1.0, /*favoured_expert=*/3);
    const SingleGpuRun single = run_single_gpu(problem);
    std::vector<double> load(c.num_experts, 0.0);
    for (int e : single.top) load[e] += 1;
    std::vector<ExpertPlacement> placements;
    if (R > 1) {
      placements.push_back(eplb_placement(load, R, 1));
      placements.push_back(contiguous_placement(c.num_experts, R).with_shadowed({3}));
    }
    for (const ExpertPlacement& placement : placements) {
      for (int chunks : {1, 2}) {
        SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(formulation)) + ", d = " +
                     std::to_string(chunks) + ", " + placement.describe());
        const ExpertParallelRun run =
            run_expert_parallel(problem, uneven_shards(c.tokens, R), {.pipeline_chunks = chunks, .placement = &placement});
        expect_equals_single_gpu(problem, uneven_shards(c.tokens, R), run, single);
      }
    }
  }
  // E = 7: no R > 1 divides it (dropless).
  MoeConfig odd = base_config();
  odd.num_experts = 7;
  const ExpertPlacement uneven = contiguous_placement(7, R);
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("E = 7, seed " + std::to_string(seed) + ", " + uneven.describe());
  const Problem problem = make_problem(odd, seed);
  const SingleGpuRun single = run_single_gpu(problem);
  const ExpertParallelRun run = run_expert_parallel(problem, even_shards(odd.tokens, R), {.placement = &uneven});
  expect_equals_single_gpu(problem, even_shards(odd.tokens, R), run, single);
}

// Shadowing decided per step (FasterMoE): a routing that favours expert 3, at a shape where moving
// its weights (D = H = 64) costs less than its rows crossing ranks, so that the step shadows it;
// every result equals the single-GPU layer, the stored experts' gradients their whole ones (the
// copies' gradients added back). Dropless, pipelined, and dropping; and a uniform routing at a
// shape whose experts are too large to shadow, where the step shadows none.
TEST_F(ExpertParallelGpuTest, ShadowingPerStepEqualsTheSingleGpuLayer) {
  const int R = world().size();
  MoeConfig c = base_config();
  c.tokens = 2000;
  c.model_dim = 64;
  c.hidden_dim = 64;
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    c.formulation = formulation;
    c.capacity_factor = 1.0;
    for (int chunks : {1, 2}) {
      const uint64_t seed = shared_seed();
      SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(formulation)) + ", d = " +
                   std::to_string(chunks));
      const Problem problem = make_problem(c, seed, 1.0, /*favoured_expert=*/3);
      const SingleGpuRun single = run_single_gpu(problem);
      const std::vector<int64_t> shards = uneven_shards(c.tokens, R);
      const ExpertParallelRun run =
          run_expert_parallel(problem, shards, {.pipeline_chunks = chunks, .shadow_per_step = true});
      expect_equals_single_gpu(problem, shards, run, single);
      const std::vector<int64_t>& shadowed = run.step.shadowed;
      if (R == 1) {
        EXPECT_TRUE(shadowed.empty()) << "one rank: nothing to shadow";
        continue;
      }
      EXPECT_TRUE(std::find(shadowed.begin(), shadowed.end(), 3) != shadowed.end()) << "the favoured expert";
      EXPECT_LT(shadowed.size(), size_t(c.num_experts));
      const ExpertPlacement plain = contiguous_placement(c.num_experts, R);
      EXPECT_EQ(shadowed, worth_shadowing(plain, run.step.routed_per_rank_expert, c.model_dim, c.hidden_dim, c.hidden_dim));
      // The storing rank of expert 3 sent it to the R - 1 others (W1 and W2, D H each).
      if (plain.slot_rank(plain.replicas(3).front()) == world().rank()) {
        EXPECT_GE(run.step.weight_elements_sent, int64_t(R - 1) * 2 * c.model_dim * c.hidden_dim);
      }
    }
  }
  // Large experts, uniform routing: nothing is worth shadowing, and the step is the plain one.
  MoeConfig large = base_config();
  const Problem problem = make_problem(large, shared_seed());
  const ExpertParallelRun run = run_expert_parallel(problem, even_shards(large.tokens, R), {.shadow_per_step = true});
  EXPECT_TRUE(run.step.shadowed.empty());
  expect_equals_single_gpu(problem, even_shards(large.tokens, R), run, run_single_gpu(problem));
}

TEST_F(ExpertParallelGpuTest, ARankWithoutTokensAndExpertsWithoutRows) {
  const int R = world().size();
  MoeConfig c = base_config();
  std::vector<int64_t> last_rank_only(R, 0);  // every rank but the last holds no token
  last_rank_only[R - 1] = c.tokens;
  check_case(c, last_rank_only);
  check_case(c, last_rank_only, {.pipeline_chunks = 2});
  // Top-1 onto expert 3: every other expert receives nothing (at R = 2, rank 1's experts too).
  c.top_k = 1;
  c.renormalize = false;
  check_case(c, even_shards(c.tokens, R), {}, 1.0, /*favoured_expert=*/3);
  check_case(c, last_rank_only, {.pipeline_chunks = 4}, 1.0, 3);
  c.formulation = Formulation::dropping;
  check_case(c, even_shards(c.tokens, R), {}, 1.0, 3);  // expert 3 keeps C of T, the rest dropped
}

// ---- two micro-batches in stages (the language model's --overlap, cuda/model/model.cu) ----

// One micro-batch's outputs on this rank, as bits.
struct MicroBatchRun {
  std::vector<bf16> y;
  std::vector<float> dx, d_gate, d_w1, d_w2;
};

// This rank's shard as two micro-batches, each rank's first T_r / 2 tokens and the rest, each its
// own layer: interleaved in stages on two streams in the model's schedule (staged), or one after
// the other through forward() and backward().
std::array<MicroBatchRun, 2> run_two_micro_batches(const Problem& p, const std::vector<int64_t>& shards, bool staged) {
  Communicator& comm = ExpertParallelGpuTest::device_communicator();
  const MoeConfig& c = p.config;
  const int R = comm.size(), rank = comm.rank();
  const int64_t D = c.model_dim, H = c.hidden_dim, E = c.num_experts, E_r = E / R;
  const int64_t offset = offset_of(shards, rank), T_r = shards[rank];
  const std::array<int64_t, 2> first{0, T_r / 2}, count{T_r / 2, T_r - T_r / 2};
  std::array<int64_t, 2> tokens{0, 0};  // each micro-batch's T over all ranks
  for (int64_t n : shards) {
    tokens[0] += n / 2;
    tokens[1] += n - n / 2;
  }
  DeviceBuffer<bf16> x(cuda::bf16_of(Matrix(p.x.middleRows(offset, T_r))));
  DeviceBuffer<bf16> dy(cuda::bf16_of(Matrix(p.dy.middleRows(offset, T_r))));
  DeviceBuffer<bf16> gate(cuda::bf16_of(p.weights.gate_weights)), y(size_t(std::max<int64_t>(1, T_r) * D));
  std::vector<Matrix> w1_local, w2_local;
  for (int64_t e = rank * E_r; e < (rank + 1) * E_r; ++e) {
    w1_local.push_back(p.weights.w1[e]);
    w2_local.push_back(p.weights.w2[e]);
  }
  DeviceBuffer<bf16> w1(cuda::bf16_of(w1_local)), w2(cuda::bf16_of(w2_local));
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), int(E_r), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), int(E_r), size_t(H * D));
  const ExpertParallelGpuWeights weights{gate.data(), w1_table.data(), w2_table.data()};
  DeviceBuffer<float> dx(size_t(std::max<int64_t>(1, T_r) * D));
  std::array<DeviceBuffer<float>, 2> d_gate, d_w1, d_w2;
  std::array<DeviceBuffer<float*>, 2> d_w1_table, d_w2_table;
  std::array<std::unique_ptr<ExpertParallelGpu>, 2> layer;
  std::array<cudaStream_t, 2> stream{};
  std::array<ExpertParallelGpuGradients, 2> gradients;
  for (int m = 0; m < 2; ++m) {
    d_gate[m] = DeviceBuffer<float>(size_t(D * E));
    d_w1[m] = DeviceBuffer<float>(size_t(E_r * D * H));
    d_w2[m] = DeviceBuffer<float>(size_t(E_r * H * D));
    d_w1_table[m] = cuda::expert_pointer_table(d_w1[m].data(), int(E_r), size_t(D * H));
    d_w2_table[m] = cuda::expert_pointer_table(d_w2[m].data(), int(E_r), size_t(H * D));
    MoeConfig half = c;
    half.tokens = tokens[m];
    layer[m] = std::make_unique<ExpertParallelGpu>(comm, half, *std::max_element(shards.begin(), shards.end()));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream[m], cudaStreamNonBlocking));
    gradients[m] = {dx.data() + first[m] * D, d_gate[m].data(), d_w1_table[m].data(), d_w2_table[m].data()};
  }
  auto rows = [&](const DeviceBuffer<bf16>& b, int m) { return b.data() + first[m] * D; };
  if (staged) {  // both halves' counts first; A's rows out, B's; A's back, B's; the backward likewise
    for (int m = 0; m < 2; ++m) layer[m]->forward_send_counts(rows(x, m), count[m], weights, y.data() + first[m] * D, stream[m]);
    for (int m = 0; m < 2; ++m) {
      layer[m]->forward_receive_counts(stream[m]);
      layer[m]->forward_experts(stream[m]);
    }
    for (int m = 0; m < 2; ++m) layer[m]->forward_combine(stream[m]);
    for (int m = 0; m < 2; ++m) layer[m]->backward_experts(rows(x, m), weights, rows(dy, m), gradients[m], stream[m]);
    for (int m = 0; m < 2; ++m) layer[m]->backward_combine(stream[m]);
  } else {
    for (int m = 0; m < 2; ++m) {
      layer[m]->forward(rows(x, m), count[m], weights, y.data() + first[m] * D, stream[0]);
      layer[m]->backward(rows(x, m), weights, rows(dy, m), gradients[m], stream[0]);
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::array<MicroBatchRun, 2> out;
  const std::vector<bf16> y_all = y.download();
  const std::vector<float> dx_all = dx.download();
  for (int m = 0; m < 2; ++m) {
    out[m].y.assign(y_all.begin() + first[m] * D, y_all.begin() + (first[m] + count[m]) * D);
    out[m].dx.assign(dx_all.begin() + first[m] * D, dx_all.begin() + (first[m] + count[m]) * D);
    out[m].d_gate = d_gate[m].download();
    out[m].d_w1 = d_w1[m].download();
    out[m].d_w2 = d_w2[m].download();
    layer[m].reset();
    CUDA_CHECK(cudaStreamDestroy(stream[m]));
  }
  return out;
}

// The language model's two-micro-batch overlap drives the layer in stages: two layers, two streams,
// their exchanges interleaved on one communicator. Each micro-batch's y, dx and gradients equal, bit
// for bit, that micro-batch run alone: the same kernels on the same rows, only the order of the
// launches between the micro-batches changes. With a rank without tokens in either micro-batch, and
// top-1 routing onto one expert so that every other expert receives nothing.
TEST_F(ExpertParallelGpuTest, TwoMicroBatchesInStagesEqualEachAlone) {
  const int R = world().size();
  MoeConfig c = base_config();  // B = 64: the portable kernels
  std::vector<int64_t> last_rank_only(R, 0);
  last_rank_only[R - 1] = c.tokens;
  for (const bool favoured : {false, true}) {
    if (favoured) {  // top-1 onto expert 3: every other expert receives nothing
      c.top_k = 1;
      c.renormalize = false;
    }
    for (const std::vector<int64_t>& shards : {uneven_shards(c.tokens, R), last_rank_only}) {
      const uint64_t seed = shared_seed();
      SCOPED_TRACE("seed " + std::to_string(seed) + (favoured ? ", top-1 onto expert 3" : "") +
                   (shards == last_rank_only ? ", only the last rank holds tokens" : ""));
      const Problem problem = make_problem(c, seed, 1.0, favoured ? 3 : -1);
      const std::array<MicroBatchRun, 2> staged = run_two_micro_batches(problem, shards, true);
      const std::array<MicroBatchRun, 2> alone = run_two_micro_batches(problem, shards, false);
      for (int m = 0; m < 2; ++m) {
        SCOPED_TRACE("micro-batch " + std::to_string(m));
        auto same_bits = [](const auto& a, const auto& b) {
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
        };
        EXPECT_TRUE(same_bits(staged[m].y, alone[m].y)) << "y";
        EXPECT_TRUE(same_bits(staged[m].dx, alone[m].dx)) << "dx";
        EXPECT_TRUE(same_bits(staged[m].d_gate, alone[m].d_gate)) << "d gate_weights";
        EXPECT_TRUE(same_bits(staged[m].d_w1, alone[m].d_w1)) << "d w1";
        EXPECT_TRUE(same_bits(staged[m].d_w2, alone[m].d_w2)) << "d w2";
        for (float v : staged[m].d_w1) ASSERT_TRUE(std::isfinite(v)) << "d w1 not finite";
      }
    }
  }
}

// ---- Tutel's pipelining ----

TEST_F(ExpertParallelGpuTest, PipelinedEqualsOneExchangeBitForBit) {
  const MoeConfig c = base_config();  // B = 64: the portable kernels
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem problem = make_problem(c, seed);
  const std::vector<int64_t> shards = uneven_shards(c.tokens, world().size());
  const ExpertParallelRun one = run_expert_parallel(problem, shards);
  for (int d : {2, 4, 8}) {
    SCOPED_TRACE("d = " + std::to_string(d));
    const ExpertParallelRun piped = run_expert_parallel(problem, shards, {.pipeline_chunks = d});
    ASSERT_EQ(piped.y_raw.size(), one.y_raw.size());
    EXPECT_EQ(std::memcmp(piped.y_raw.data(), one.y_raw.data(), one.y_raw.size() * sizeof(bf16)), 0) << "y";
    EXPECT_EQ(std::memcmp(piped.dx_raw.data(), one.dx_raw.data(), one.dx_raw.size() * sizeof(float)), 0) << "dx";
    EXPECT_EQ(std::memcmp(piped.d_gate_raw.data(), one.d_gate_raw.data(), one.d_gate_raw.size() * sizeof(float)), 0)
        << "d gate_weights";
    for (size_t j = 0; j < one.d_w1.size(); ++j) {
      EXPECT_LE(relative_error(piped.d_w1[j], one.d_w1[j]), kChunkSumTolerance) << "d w1 of local expert " << j;
      EXPECT_LE(relative_error(piped.d_w2[j], one.d_w2[j]), kChunkSumTolerance) << "d w2 of local expert " << j;
    }
    EXPECT_EQ(piped.step.rows_received, one.step.rows_received);
  }
}

// ---- adaptive pipelining ----

TEST_F(ExpertParallelGpuTest, AdaptivePipeliningTriesEveryCandidateThenKeepsOneOnEveryRank) {
  const MoeConfig c = base_config();  // B = 64: every d gives d = 1's y bit for bit
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem p = make_problem(c, seed);
  Communicator& comm = device_communicator();
  const int R = comm.size(), rank = comm.rank();
  const std::vector<int64_t> shards = uneven_shards(c.tokens, R);
  const ExpertParallelRun one = run_expert_parallel(p, shards);  // d = 1

  const int64_t D = c.model_dim, H = c.hidden_dim, E = c.num_experts, E_r = E / R;
  const int64_t offset = offset_of(shards, rank), T_r = shards[rank];
  DeviceBuffer<bf16> x(cuda::bf16_of(Matrix(p.x.middleRows(offset, T_r))));
  DeviceBuffer<bf16> dy(cuda::bf16_of(Matrix(p.dy.middleRows(offset, T_r))));
  DeviceBuffer<bf16> gate(cuda::bf16_of(p.weights.gate_weights));
  const std::vector<Matrix> w1_local(p.weights.w1.begin() + rank * E_r, p.weights.w1.begin() + (rank + 1) * E_r);
  const std::vector<Matrix> w2_local(p.weights.w2.begin() + rank * E_r, p.weights.w2.begin() + (rank + 1) * E_r);
  DeviceBuffer<bf16> w1(cuda::bf16_of(w1_local)), w2(cuda::bf16_of(w2_local)), y(size_t(T_r * D));
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), int(E_r), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), int(E_r), size_t(H * D));
  DeviceBuffer<float> dx(size_t(T_r * D)), d_gate(size_t(D * E)), d_w1(size_t(E_r * D * H)), d_w2(size_t(E_r * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E_r), size_t(D * H));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E_r), size_t(H * D));
  const ExpertParallelGpuWeights weights{gate.data(), w1_table.data(), w2_table.data()};

  ExpertParallelGpu layer(comm, c, *std::max_element(shards.begin(), shards.end()),
                          {.pipeline_chunks = kAdaptivePipelineChunks});
  const int trial_steps = int(kAdaptiveCandidates.size()) * kTrialStepsPerCandidate;
  for (int step = 0; step < trial_steps + 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    y.fill_bytes(0xFF);  // NaN poison
    dx.fill_bytes(0xFF);
    d_w1.fill_bytes(0xFF);
    d_w2.fill_bytes(0xFF);
    layer.forward(x.data(), T_r, weights, y.data(), nullptr);
    layer.backward(x.data(), weights, dy.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                   nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const ExpertParallelGpuStep& last = layer.last_step();
    EXPECT_TRUE(last.pipeline.adaptive);
    // The weight gradients: one product over every chunk's rows, whichever d this step took (the
    // chunks' slots and their walk change with d).
    const auto d_w1_host = d_w1.download(), d_w2_host = d_w2.download();
    for (int64_t j = 0; j < E_r; ++j) {
      EXPECT_LE(relative_error(cuda::matrix_of(d_w1_host, D, H, size_t(j * D * H)), one.d_w1[size_t(j)]),
                kChunkSumTolerance)
          << "d w1 of local expert " << j << " at d = " << last.pipeline_chunks;
      EXPECT_LE(relative_error(cuda::matrix_of(d_w2_host, H, D, size_t(j * H * D)), one.d_w2[size_t(j)]),
                kChunkSumTolerance)
          << "d w2 of local expert " << j << " at d = " << last.pipeline_chunks;
    }
    if (step < trial_steps) {  // the trials: each candidate in turn, kTrialStepsPerCandidate steps each
      EXPECT_EQ(last.pipeline_chunks, kAdaptiveCandidates[size_t(step / kTrialStepsPerCandidate)]);
      EXPECT_EQ(last.pipeline.chosen, 0);
    } else {  // the choice, read at the first forward after the last trial
      EXPECT_NE(last.pipeline.chosen, 0);
      EXPECT_EQ(last.pipeline_chunks, last.pipeline.chosen);
    }
    const std::vector<bf16> y_raw = y.download();
    const std::vector<float> dx_raw = dx.download();
    EXPECT_EQ(std::memcmp(y_raw.data(), one.y_raw.data(), one.y_raw.size() * sizeof(bf16)), 0)
        << "y at d = " << last.pipeline_chunks;
    EXPECT_EQ(std::memcmp(dx_raw.data(), one.dx_raw.data(), one.dx_raw.size() * sizeof(float)), 0)
        << "dx at d = " << last.pipeline_chunks;
  }
  const PipelineChoice& choice = layer.last_step().pipeline;
  ASSERT_EQ(choice.candidates, std::vector<int>(kAdaptiveCandidates.begin(), kAdaptiveCandidates.end()));
  EXPECT_NE(std::find(choice.candidates.begin(), choice.candidates.end(), choice.chosen), choice.candidates.end())
      << "chosen d = " << choice.chosen;
  for (size_t i = 0; i < choice.candidates.size(); ++i) {
    EXPECT_GT(choice.times_ms[i], 0.0) << "the time of d = " << choice.candidates[i];
  }
  const auto fastest = std::min_element(choice.times_ms.begin(), choice.times_ms.end()) - choice.times_ms.begin();
  EXPECT_EQ(choice.chosen, choice.candidates[size_t(fastest)]);
  // The same choice and the same times on every rank.
  const std::vector<int64_t> chosen = all_gather<int64_t>(world(), int64_t{choice.chosen});
  EXPECT_EQ(std::count(chosen.begin(), chosen.end(), chosen[0]), R) << "the ranks chose different d";
  const std::vector<double> times = all_gather<double>(world(), std::span<const double>(choice.times_ms));
  for (int q = 1; q < R; ++q) {
    EXPECT_TRUE(std::equal(times.begin(), times.begin() + choice.times_ms.size(),
                           times.begin() + q * choice.times_ms.size()))
        << "rank " << q << " agreed on other times";
  }
  ASSERT_EQ(layer.pipeline_choices().size(), 1u);  // one shape seen
}

// ---- Tutel's 2DH exchange ----

// Every G > 1 that divides R: R = 2 has G = 2 (one node of 2), R = 4 has G = 2 (two nodes, both
// stages cross ranks) and G = 4.
std::vector<int> hierarchical_node_sizes(int ranks) {
  std::vector<int> sizes;
  for (int G = 2; G <= ranks; ++G) {
    if (ranks % G == 0) sizes.push_back(G);
  }
  return sizes;
}

void expect_bit_for_bit(const ExpertParallelRun& got, const ExpertParallelRun& flat) {
  ASSERT_EQ(got.y_raw.size(), flat.y_raw.size());
  EXPECT_EQ(std::memcmp(got.y_raw.data(), flat.y_raw.data(), flat.y_raw.size() * sizeof(bf16)), 0) << "y";
  EXPECT_EQ(std::memcmp(got.dx_raw.data(), flat.dx_raw.data(), flat.dx_raw.size() * sizeof(float)), 0) << "dx";
  EXPECT_EQ(std::memcmp(got.d_gate_raw.data(), flat.d_gate_raw.data(), flat.d_gate_raw.size() * sizeof(float)), 0)
      << "d gate_weights";
  for (size_t j = 0; j < flat.d_w1.size(); ++j) {
    EXPECT_TRUE(got.d_w1[j] == flat.d_w1[j]) << "d w1 of local expert " << j;
    EXPECT_TRUE(got.d_w2[j] == flat.d_w2[j]) << "d w2 of local expert " << j;
  }
  EXPECT_EQ(got.step.rows_received, flat.step.rows_received);
}

TEST_F(ExpertParallelGpuTest, HierarchicalExchangeEqualsFlatBitForBit) {
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "2DH needs nodes of G > 1 ranks: run with 2 or 4 ranks";
  const uint64_t seed = shared_seed();
  for (Formulation formulation : {Formulation::dropless, Formulation::padded, Formulation::dropping}) {
    MoeConfig c = base_config();
    c.formulation = formulation;
    c.capacity_factor = formulation == Formulation::dropping ? 1.0 : 2.0;
    const Problem p = make_problem(c, seed, formulation == Formulation::dropping ? 3.0 : 1.0);
    const std::vector<int64_t> shards = uneven_shards(c.tokens, R);
    for (int d : {1, 3}) {
      const ExpertParallelRun flat = run_expert_parallel(p, shards, {.pipeline_chunks = d});
      for (int G : hierarchical_node_sizes(R)) {
        SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(formulation)) + ", d = " +
                     std::to_string(d) + ", G = " + std::to_string(G));
        const ExpertParallelRun nodes =
            run_expert_parallel(p, shards, {.pipeline_chunks = d, .hierarchical_ranks_per_node = G});
        EXPECT_EQ(nodes.step.hierarchical_ranks_per_node, G);
        expect_bit_for_bit(nodes, flat);
#if MOE_TEST_NCCL_BACKEND
        // The counts come from the plan: no wait of the host beyond the count read-back.
        EXPECT_EQ(nodes.step.host_synchronisations, flat.step.host_synchronisations);
        EXPECT_EQ(nodes.step.backward_host_synchronisations, flat.step.backward_host_synchronisations);
#endif
      }
    }
  }
  // A rank without tokens, and experts that receive nothing.
  MoeConfig c = base_config();
  c.top_k = 1;
  c.renormalize = false;
  const Problem p = make_problem(c, seed, 1.0, /*favoured_expert=*/3);
  std::vector<int64_t> last_rank_only(R, 0);
  last_rank_only[R - 1] = c.tokens;
  const ExpertParallelRun flat = run_expert_parallel(p, last_rank_only, {.pipeline_chunks = 2});
  for (int G : hierarchical_node_sizes(R)) {
    SCOPED_TRACE("one rank's tokens, one expert, G = " + std::to_string(G));
    expect_bit_for_bit(run_expert_parallel(p, last_rank_only, {.pipeline_chunks = 2, .hierarchical_ranks_per_node = G}),
                       flat);
  }
}

TEST_F(ExpertParallelGpuTest, HierarchicalAndAdaptiveTogetherEqualTheSingleGpuLayer) {
  const int R = world().size();
  const MoeConfig c = base_config();
  const int G = R > 1 ? R : 0;  // R = 1: the flat exchange
  check_case(c, uneven_shards(c.tokens, R),
             {.pipeline_chunks = kAdaptivePipelineChunks, .hierarchical_ranks_per_node = G});
}

// ---- the exchange alone ----

TEST_F(ExpertParallelGpuTest, IdentityExpertsReturnEveryRowUnchanged) {
  const MoeConfig c = base_config();
  const std::vector<int64_t> shards = uneven_shards(c.tokens, world().size());
  const uint64_t seed = shared_seed();
  const Problem p = make_problem(c, seed);
  Communicator& comm = device_communicator();
  const int64_t D = c.model_dim, K = c.top_k, T_r = shards[comm.rank()], offset = offset_of(shards, comm.rank());
  const Matrix x_local = p.x.middleRows(offset, T_r);
  DeviceBuffer<bf16> x(cuda::bf16_of(x_local)), gate(cuda::bf16_of(p.weights.gate_weights)), y(size_t(T_r * D));
  for (int d : {1, 3}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", d = " + std::to_string(d));
    ExpertParallelGpu layer(comm, c, T_r + 1, {.pipeline_chunks = d, .experts = ExpertCompute::identity});
    layer.forward(x.data(), T_r, {gate.data(), nullptr, nullptr}, y.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const int64_t rows = layer.last_step().rows_sent;
    EXPECT_EQ(rows, T_r * K);  // dropless: every slot travels
    std::vector<bf16> sent(size_t(rows * D)), returned(size_t(rows * D));
    if (rows > 0) {
      CUDA_CHECK(cudaMemcpy(sent.data(), layer.sent_rows(), sent.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(returned.data(), layer.returned_rows(), returned.size() * sizeof(bf16),
                            cudaMemcpyDeviceToHost));
    }
    EXPECT_EQ(std::memcmp(sent.data(), returned.data(), sent.size() * sizeof(bf16)), 0) << "rows changed on the way";
    // y[t] = sum_k w[t, k] x[t]: the combine weights sum to 1 (renormalized), so y = x within bf16.
    EXPECT_LT(relative_error(cuda::matrix_of(y.download(), T_r, D), x_local), kTolerance);
  }
}

// ---- errors on every rank ----

// The settings are checked before the layer touches the GPU: on the MPI build these tests run
// without one (the NCCL build needs its communicator, so one GPU per rank).
class ExpertParallelGpuSettings : public ExpertParallelGpuTest {
 protected:
  void SetUp() override {
#if MOE_TEST_NCCL_BACKEND
    if (skipped()) GTEST_SKIP() << skip_reason();
#endif
  }
};

TEST_F(ExpertParallelGpuSettings, BadSettingsAreAnErrorOnEveryRank) {
  const int R = world().size();
  Communicator& comm = device_communicator();
  auto expect_error = [&](const MoeConfig& config, const ExpertParallelGpuOptions& options, const std::string& text) {
    try {
      ExpertParallelGpu layer(comm, config, 10, options);
      ADD_FAILURE() << "expected an error containing \"" << text << "\"";
    } catch (const std::invalid_argument& error) {
      EXPECT_THAT(error.what(), ::testing::HasSubstr(text));
    }
  };
  MoeConfig c = base_config();
  if (R > 1) {
    c.num_experts = R + 1;  // E % R != 0
    expect_error(c, {}, "is not divisible by R");
    c = base_config();
    c.seed = static_cast<uint64_t>(world().rank());  // a config that differs between ranks
    expect_error(c, {}, "differ between ranks");
    c = base_config();
  }
  c.activation = Activation::swiglu;
  expect_error(c, {}, "allowed on the GPU: gelu");
  c = base_config();
  c.block_size = 32;
  expect_error(c, {}, "allowed for dropless: 64 or 128");
  expect_error(base_config(), {.pipeline_chunks = -1}, "pipeline_chunks (d) = -1");
  // A node size that does not divide R (R + 1 never does), and a negative one.
  const int bad_nodes = R + 1;
  expect_error(base_config(), {.hierarchical_ranks_per_node = bad_nodes},
               "hierarchical_ranks_per_node (G) = " + std::to_string(bad_nodes) + " with R = " + std::to_string(R));
  expect_error(base_config(), {.hierarchical_ranks_per_node = -2}, "hierarchical_ranks_per_node (G) = -2");
  // Placements: of another E; padded with replicas.
  const ExpertPlacement other = contiguous_placement(base_config().num_experts - 1, R);
  expect_error(base_config(), {.placement = &other}, "the placement is of E = " + std::to_string(other.experts()));
  if (R > 1) {
    c = base_config();
    c.formulation = Formulation::padded;
    const ExpertPlacement shadowed = contiguous_placement(c.num_experts, R).with_shadowed({0});
    expect_error(c, {.placement = &shadowed}, "a placement with replicas takes dropless or dropping");
  }
  // Shadowing per step: the FFN experts, not padded, a placement without replicas, layout r = 1.
  expect_error(base_config(), {.experts = ExpertCompute::identity, .shadow_per_step = true}, "the identity experts have no weights");
  c = base_config();
  c.formulation = Formulation::padded;
  expect_error(c, {.shadow_per_step = true}, "shadow_per_step with the padded formulation");
  if (R > 1) {
    const ExpertPlacement shadowed = contiguous_placement(base_config().num_experts, R).with_shadowed({0});
    expect_error(base_config(), {.placement = &shadowed, .shadow_per_step = true}, "a placement that has replicas");
    // The layouts: r = 1 only (set_layout checks r with check_gpu_layout, on every rank).
    EXPECT_EQ(valid_gpu_layouts(base_config(), {.shadow_per_step = true}, R), std::vector<int>{1});
    try {
      check_gpu_layout(base_config(), {.shadow_per_step = true}, R, 0);
      ADD_FAILURE() << "layout r = 0 with shadow_per_step";
    } catch (const std::invalid_argument& error) {
      EXPECT_THAT(error.what(), ::testing::HasSubstr("with shadow_per_step"));
    }
  }
}

TEST_F(ExpertParallelGpuTest, BadForwardInputIsAnErrorOnEveryRank) {
  const MoeConfig c = base_config();
  Communicator& comm = device_communicator();
  const int R = comm.size(), rank = comm.rank();
  const std::vector<int64_t> shards = even_shards(c.tokens, R);
  const Problem p = make_problem(c, shared_seed());
  const int64_t D = c.model_dim, E_r = c.num_experts / R, H = c.hidden_dim;
  const int64_t T_r = shards[rank], offset = offset_of(shards, rank);
  DeviceBuffer<bf16> x(cuda::bf16_of(Matrix(p.x.middleRows(offset, T_r)))), y(size_t(T_r * D));
  DeviceBuffer<bf16> gate(cuda::bf16_of(p.weights.gate_weights));
  DeviceBuffer<bf16> w(size_t(E_r * D * H));
  auto w1 = cuda::expert_pointer_table<const bf16>(w.data(), int(E_r), size_t(D * H));
  auto w2 = cuda::expert_pointer_table<const bf16>(w.data(), int(E_r), size_t(H * D));
  const ExpertParallelGpuWeights weights{gate.data(), w1.data(), w2.data()};
  ExpertParallelGpu layer(comm, c, T_r, {});
  // One token fewer on rank 0: the shards no longer add up to T.
  try {
    layer.forward(x.data(), rank == 0 ? T_r - 1 : T_r, weights, y.data(), nullptr);
    ADD_FAILURE() << "expected an error: the shards do not add up to T";
  } catch (const std::invalid_argument& error) {
    EXPECT_THAT(error.what(), ::testing::HasSubstr("config.tokens says T = 300"));
  }
  // More tokens than the layer was made for, on the last rank only: every rank names it.
  try {
    layer.forward(x.data(), rank == R - 1 ? T_r + 1 : T_r, weights, y.data(), nullptr);
    ADD_FAILURE() << "expected an error: local_tokens above max_local_tokens on rank " << R - 1;
  } catch (const std::invalid_argument& error) {
    EXPECT_THAT(error.what(), ::testing::HasSubstr("rank " + std::to_string(R - 1) + ": local_tokens outside"));
  }
  // The layer still works after both.
  EXPECT_NO_THROW(layer.forward(x.data(), T_r, weights, y.data(), nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace moe::dist
