// test_expert_layouts_gpu.cpp: Tutel's parallelism switching on the GPU expert-parallel layer
// (distributed/expert_parallel_gpu.h, set_layout): r = 0 (data-parallel experts) and every r > 1
// (experts sharded over r ranks along H) against r = 1 of the same layer and against the CPU
// reference (ref::moe_forward / moe_backward in double on all ranks' tokens, from the same bf16
// inputs): y, dx, the router gradient, every stored expert's dW1 and dW2 on its storing rank, the
// aux and z losses, within 2e-2 relative (bf16 activations). Dropless, padded and dropping (capacity
// over all tokens), uneven shards, a rank without tokens, experts that receive nothing. Switching r
// between calls of one layer changes no result: each call equals, bit for bit, a fresh layer's call
// in that layout. Bad layouts (r not valid, H / r not a multiple of B, r != 1 with d > 1, adaptive
// d or the 2DH exchange, r differing between ranks) are an error on every rank. The choice of r, by
// cost model and by measurement, is one valid r, the same on every rank, set on the layer and
// recorded in its last step.
//
// Built twice, as test_expert_parallel_gpu.cpp: over MPI (ranks may share a GPU, staged through
// host memory) and over NCCL (MOE_TEST_NCCL_BACKEND, one GPU per rank). Without a GPU the GPU tests
// skip on every rank, saying why; the host-only checks of the layouts still run.
//   ctest --test-dir build -R DistributedExpertLayoutsGpu --output-on-failure
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts_gpu
//   mpirun -np 2 build/tests/distributed/test_distributed_expert_layouts_gpu_nccl
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_check.h"          // CUDA_CHECK
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/device_info.h"         // why_no_gpu
#include "bridge/reference_bridge.h"    // round_bf16, bf16_of, matrix_of
#include "ep/expert_layout_choice_gpu.h" // choose_gpu_layout, measure_gpu_layouts
#include "ep/expert_parallel_gpu.h"      // ExpertParallelGpu, set_layout, check_gpu_layout
#include "moe/block_sparse.h"         // expert_pointer_table
#include "expert_problem_test_support.h"  // base_config, make_problem, shards
#include "gpu_ranks_test_support.h"  // GpuRanksTest
#include "mpi_test_support.h"         // world, shared_seed
#include "reference_cpu/init.h"       // random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // moe_forward, moe_backward: the oracle
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

constexpr double kTolerance = 2e-2;  // bf16 activations, fp32 accumulation, against double

// ---- the ranks' communicator for the layer, or why there is none (as test_expert_parallel_gpu) ----

class ExpertLayoutsGpuTest : public testing::GpuRanksTest<ExpertLayoutsGpuTest> {
 protected:
  void SetUp() override {
    GpuRanksTest::SetUp();
    if (IsSkipped()) return;
    if (8 % world().size() != 0) GTEST_SKIP() << "the problems have E = 8 experts: R must divide 8";
  }
};

// ---- the layer on this rank's shard: one layer, as many calls as a test wants ----

struct LayerRun {
  Matrix y, dx, d_gate;            // [T_r, D] [T_r, D] [D, E]
  std::vector<Matrix> d_w1, d_w2;  // E_r each: this rank's stored experts
  std::vector<int> top;            // [T_r, K]
  std::vector<bf16> y_raw;         // the same as bits, for the bit-for-bit checks
  std::vector<float> dx_raw, d_gate_raw, d_w1_raw, d_w2_raw;
  ExpertParallelGpuStep step;
};

class LayerRig {
 public:
  LayerRig(const Problem& p, const std::vector<int64_t>& shards, const ExpertParallelGpuOptions& options = {})
      : config_(p.config), rank_(ExpertLayoutsGpuTest::device_communicator().rank()), shards_(shards) {
    Communicator& comm = ExpertLayoutsGpuTest::device_communicator();
    const MoeConfig& c = p.config;
    const int R = comm.size();
    const int64_t D = c.model_dim, H = c.hidden_dim, E = c.num_experts, E_r = E / R;
    const int64_t offset = offset_of(shards, rank_), T_r = shards[rank_];
    x_ = DeviceBuffer<bf16>(cuda::bf16_of(Matrix(p.x.middleRows(offset, T_r))));
    dy_ = DeviceBuffer<bf16>(cuda::bf16_of(Matrix(p.dy.middleRows(offset, T_r))));
    gate_ = DeviceBuffer<bf16>(cuda::bf16_of(p.weights.gate_weights));
    // The storage of every layout: rank q stores experts [q E_r, (q + 1) E_r) whole.
    const std::vector<Matrix> w1(p.weights.w1.begin() + rank_ * E_r, p.weights.w1.begin() + (rank_ + 1) * E_r);
    const std::vector<Matrix> w2(p.weights.w2.begin() + rank_ * E_r, p.weights.w2.begin() + (rank_ + 1) * E_r);
    w1_ = DeviceBuffer<bf16>(cuda::bf16_of(w1));
    w2_ = DeviceBuffer<bf16>(cuda::bf16_of(w2));
    w1_table_ = cuda::expert_pointer_table<const bf16>(w1_.data(), int(E_r), size_t(D * H));
    w2_table_ = cuda::expert_pointer_table<const bf16>(w2_.data(), int(E_r), size_t(H * D));
    y_ = DeviceBuffer<bf16>(size_t(std::max<int64_t>(T_r * D, 1)));
    dx_ = DeviceBuffer<float>(size_t(std::max<int64_t>(T_r * D, 1)));
    d_gate_ = DeviceBuffer<float>(size_t(D * E));
    d_w1_ = DeviceBuffer<float>(size_t(E_r * D * H));
    d_w2_ = DeviceBuffer<float>(size_t(E_r * H * D));
    d_w1_table_ = cuda::expert_pointer_table(d_w1_.data(), int(E_r), size_t(D * H));
    d_w2_table_ = cuda::expert_pointer_table(d_w2_.data(), int(E_r), size_t(H * D));
    layer_ = std::make_unique<ExpertParallelGpu>(comm, c, *std::max_element(shards.begin(), shards.end()), options);
  }

  ExpertParallelGpu& layer() { return *layer_; }
  int64_t local_tokens() const { return shards_[rank_]; }
  ExpertParallelGpuWeights weights() const { return {gate_.data(), w1_table_.data(), w2_table_.data()}; }
  ExpertParallelGpuGradients gradients() { return {dx_.data(), d_gate_.data(), d_w1_table_.data(), d_w2_table_.data()}; }
  const bf16* x() const { return x_.data(); }
  const bf16* dy() const { return dy_.data(); }
  bf16* y() { return y_.data(); }

  // One forward + backward in layout r, outputs poisoned (NaN) first.
  LayerRun run(int r) {
    const int64_t D = config_.model_dim, H = config_.hidden_dim, E = config_.num_experts, K = config_.top_k;
    const int64_t E_r = E / ExpertLayoutsGpuTest::device_communicator().size(), T_r = shards_[rank_];
    layer_->set_layout(r);
    for (auto* buffer : {&dx_, &d_gate_, &d_w1_, &d_w2_}) buffer->fill_bytes(0xFF);
    y_.fill_bytes(0xFF);
    const ExpertParallelGpuWeights weights{gate_.data(), w1_table_.data(), w2_table_.data()};
    layer_->forward(x_.data(), T_r, weights, y_.data(), nullptr);
    layer_->backward(x_.data(), weights, dy_.data(),
                     {dx_.data(), d_gate_.data(), d_w1_table_.data(), d_w2_table_.data()}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    LayerRun run;
    run.y_raw = y_.download();
    run.dx_raw = dx_.download();
    run.d_gate_raw = d_gate_.download();
    run.d_w1_raw = d_w1_.download();
    run.d_w2_raw = d_w2_.download();
    run.y_raw.resize(size_t(T_r * D));
    run.dx_raw.resize(size_t(T_r * D));
    run.y = cuda::matrix_of(run.y_raw, T_r, D);
    run.dx = cuda::matrix_of(run.dx_raw, T_r, D);
    run.d_gate = cuda::matrix_of(run.d_gate_raw, D, E);
    for (int64_t j = 0; j < E_r; ++j) {
      run.d_w1.push_back(cuda::matrix_of(run.d_w1_raw, D, H, size_t(j * D * H)));
      run.d_w2.push_back(cuda::matrix_of(run.d_w2_raw, H, D, size_t(j * H * D)));
    }
    const std::vector<int> top = layer_->top_experts().download();
    run.top.assign(top.begin(), top.begin() + T_r * K);
    run.step = layer_->last_step();
    return run;
  }

 private:
  MoeConfig config_;
  int rank_ = 0;
  std::vector<int64_t> shards_;
  DeviceBuffer<bf16> x_, dy_, gate_, w1_, w2_, y_;
  DeviceBuffer<const bf16*> w1_table_, w2_table_;
  DeviceBuffer<float> dx_, d_gate_, d_w1_, d_w2_;
  DeviceBuffer<float*> d_w1_table_, d_w2_table_;
  std::unique_ptr<ExpertParallelGpu> layer_;
};

// ---- the oracles ----

struct CpuReference {
  ref::LayerForward forward;
  ref::LayerGradients gradients;
};

CpuReference run_cpu(const Problem& p) {
  CpuReference out;
  out.forward = ref::moe_forward(p.config, p.x, p.weights);
  out.gradients = ref::moe_backward(p.config, p.x, p.weights, out.forward, p.dy);
  return out;
}

void expect_equals_cpu(const Problem& p, const std::vector<int64_t>& shards, const LayerRun& run,
                       const CpuReference& cpu) {
  const MoeConfig& c = p.config;
  const int R = world().size(), rank = world().rank();
  const int64_t K = c.top_k, E_r = c.num_experts / R;
  const int64_t offset = offset_of(shards, rank), T_r = shards[rank];
  int flips = 0;
  for (int64_t i = 0; i < T_r * K; ++i) {
    flips += run.top[size_t(i)] != cpu.forward.router.top_experts(offset + i / K, i % K);
  }
  ASSERT_EQ(flips, 0) << "the routing differs from the CPU reference's in " << flips << " slots";
  ASSERT_TRUE(run.y.allFinite() && run.dx.allFinite() && run.d_gate.allFinite());
  EXPECT_LT(relative_error(run.y, cpu.forward.y.middleRows(offset, T_r)), kTolerance) << "y";
  EXPECT_LT(relative_error(run.dx, cpu.gradients.x.middleRows(offset, T_r)), kTolerance) << "dx";
  EXPECT_LT(relative_error(run.d_gate, cpu.gradients.gate_weights), kTolerance) << "d gate_weights";
  EXPECT_NEAR(run.step.aux_loss, cpu.forward.aux_loss, 1e-4 * std::max(1.0, cpu.forward.aux_loss)) << "aux loss";
  EXPECT_NEAR(run.step.z_loss, cpu.forward.z_loss, 1e-4 * std::max(1.0, cpu.forward.z_loss)) << "z loss";
  for (int64_t j = 0; j < E_r; ++j) {
    const int64_t e = rank * E_r + j;
    ASSERT_TRUE(run.d_w1[j].allFinite() && run.d_w2[j].allFinite()) << "expert " << e;
    if (cpu.gradients.w1[e].norm() == 0) {  // an expert without rows: exactly zero
      EXPECT_EQ(run.d_w1[j].norm(), 0.0) << "d w1 of idle expert " << e;
      EXPECT_EQ(run.d_w2[j].norm(), 0.0) << "d w2 of idle expert " << e;
      continue;
    }
    EXPECT_LT(relative_error(run.d_w1[j], cpu.gradients.w1[e]), kTolerance) << "d w1 of expert " << e;
    EXPECT_LT(relative_error(run.d_w2[j], cpu.gradients.w2[e]), kTolerance) << "d w2 of expert " << e;
  }
}

void expect_close(const LayerRun& got, const LayerRun& expected) {
  ASSERT_EQ(got.top, expected.top) << "the routing is the layer's, whatever the layout";
  EXPECT_EQ(got.step.kept_per_rank_expert, expected.step.kept_per_rank_expert);
  EXPECT_EQ(got.step.aux_loss, expected.step.aux_loss);
  EXPECT_EQ(got.step.z_loss, expected.step.z_loss);
  EXPECT_LT(relative_error(got.y, expected.y), kTolerance) << "y";
  EXPECT_LT(relative_error(got.dx, expected.dx), kTolerance) << "dx";
  EXPECT_LT(relative_error(got.d_gate, expected.d_gate), kTolerance) << "d gate_weights";
  for (size_t j = 0; j < expected.d_w1.size(); ++j) {
    EXPECT_LT(relative_error(got.d_w1[j], expected.d_w1[j]), kTolerance) << "d w1 of stored expert " << j;
    EXPECT_LT(relative_error(got.d_w2[j], expected.d_w2[j]), kTolerance) << "d w2 of stored expert " << j;
  }
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_bit_for_bit(const LayerRun& got, const LayerRun& expected) {
  EXPECT_TRUE(same_bits(got.y_raw, expected.y_raw)) << "y";
  EXPECT_TRUE(same_bits(got.dx_raw, expected.dx_raw)) << "dx";
  EXPECT_TRUE(same_bits(got.d_gate_raw, expected.d_gate_raw)) << "d gate_weights";
  EXPECT_TRUE(same_bits(got.d_w1_raw, expected.d_w1_raw)) << "d w1";
  EXPECT_TRUE(same_bits(got.d_w2_raw, expected.d_w2_raw)) << "d w2";
}

// Every valid layout of one problem against r = 1 and the CPU reference.
void check_every_layout(const MoeConfig& config, const std::vector<int64_t>& shards, double gate_scale = 1.0,
                        int favoured_expert = -1) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(config.formulation)));
  const Problem problem = make_problem(config, seed, gate_scale, favoured_expert);
  const CpuReference cpu = run_cpu(problem);
  LayerRig rig(problem, shards);
  const LayerRun expert_parallel = rig.run(1);
  expect_equals_cpu(problem, shards, expert_parallel, cpu);
  const std::vector<int> layouts = valid_gpu_layouts(config, {}, world().size());
  for (int r : layouts) {
    if (r == 1) continue;
    SCOPED_TRACE(layout_name(r));
    const LayerRun run = rig.run(r);
    EXPECT_EQ(run.step.layout, r);
    expect_close(run, expert_parallel);
    expect_equals_cpu(problem, shards, run, cpu);
  }
}

// ---- every layout equals r = 1 and the CPU reference ----

TEST_F(ExpertLayoutsGpuTest, EveryLayoutEqualsExpertParallelAndTheCpuReferenceDropless) {
  MoeConfig c = base_config();
  check_every_layout(c, even_shards(c.tokens, world().size()));
  check_every_layout(c, uneven_shards(c.tokens, world().size()));
  c.block_size = 128;  // Hopper's kernels where the build has sm_90a; r = 2 only where H / 2 = 128
  check_every_layout(c, uneven_shards(c.tokens, world().size()));
}

TEST_F(ExpertLayoutsGpuTest, EveryLayoutEqualsExpertParallelAndTheCpuReferencePaddedAndDropping) {
  MoeConfig c = base_config();
  c.formulation = Formulation::padded;
  c.capacity_factor = 2.0;
  check_every_layout(c, uneven_shards(c.tokens, world().size()));
  c.formulation = Formulation::dropping;
  c.capacity_factor = 1.0;  // drops: capacity over all tokens in token order
  check_every_layout(c, even_shards(c.tokens, world().size()), /*gate_scale=*/3.0);
}

TEST_F(ExpertLayoutsGpuTest, EveryLayoutWithARankWithoutTokensAndExpertsWithoutRows) {
  const int R = world().size();
  MoeConfig c = base_config();
  std::vector<int64_t> last_rank_only(R, 0);
  last_rank_only[R - 1] = c.tokens;
  check_every_layout(c, last_rank_only);
  // Top-1 onto expert 3: every other expert receives nothing.
  c.top_k = 1;
  c.renormalize = false;
  check_every_layout(c, even_shards(c.tokens, R), 1.0, /*favoured_expert=*/3);
  c.formulation = Formulation::dropping;
  check_every_layout(c, even_shards(c.tokens, R), 1.0, 3);
  c.formulation = Formulation::padded;
  check_every_layout(c, last_rank_only, 1.0, 3);
}

// ---- switching ----

TEST_F(ExpertLayoutsGpuTest, SwitchingLayoutsBetweenCallsChangesNoResult) {
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    MoeConfig c = base_config();
    c.formulation = formulation;
    c.capacity_factor = 1.0;
    const uint64_t seed = shared_seed();
    SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::string(to_string(formulation)));
    const Problem problem = make_problem(c, seed);
    const std::vector<int64_t> shards = uneven_shards(c.tokens, world().size());
    const std::vector<int> layouts = valid_gpu_layouts(c, {}, world().size());
    // Each layout in a fresh layer: the expected bits.
    std::vector<LayerRun> fresh;
    for (int r : layouts) {
      LayerRig rig(problem, shards);
      fresh.push_back(rig.run(r));
    }
    // One layer through every layout, forwards and back again, twice.
    LayerRig rig(problem, shards);
    std::vector<size_t> order;
    for (size_t i = 0; i < layouts.size(); ++i) order.push_back(i);
    for (size_t i = layouts.size(); i-- > 0;) order.push_back(i);
    for (size_t i = 0; i < layouts.size(); ++i) order.push_back((i * 2 + 1) % layouts.size());
    for (size_t i : order) {
      SCOPED_TRACE("switched to " + layout_name(layouts[i]));
      const LayerRun run = rig.run(layouts[i]);
      expect_bit_for_bit(run, fresh[i]);
    }
  }
}

// ---- the choice ----

TEST_F(ExpertLayoutsGpuTest, TheChoiceIsOneValidLayoutOnEveryRankAndIsRecorded) {
  const MoeConfig c = base_config();
  const uint64_t seed = shared_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Problem problem = make_problem(c, seed);
  const std::vector<int64_t> shards = uneven_shards(c.tokens, world().size());
  const std::vector<int> valid = valid_gpu_layouts(c, {}, world().size());
  LayerRig rig(problem, shards);
  ExpertParallelGpu& layer = rig.layer();
  auto expect_agreed = [&](const LayoutChoice& choice, const std::string& by) {
    EXPECT_EQ(choice.by, by);
    EXPECT_EQ(choice.candidates, valid);
    EXPECT_NE(std::find(valid.begin(), valid.end(), choice.r), valid.end()) << "r = " << choice.r;
    EXPECT_EQ(layer.layout(), choice.r);
    const std::vector<int64_t> everyone = all_gather<int64_t>(world(), int64_t{choice.r});
    EXPECT_EQ(std::count(everyone.begin(), everyone.end(), everyone[0]), world().size()) << "r differs between ranks";
  };

  const LayoutChoice modelled = choose_gpu_layout(layer);  // before any forward: uniform routing
  expect_agreed(modelled, "cost model");
  EXPECT_EQ(modelled.estimates.size(), valid.size());
  const LayerRun after_model = rig.run(modelled.r);
  EXPECT_EQ(after_model.step.layout, modelled.r);

  const LayoutChoice measured = measure_gpu_layouts(layer, rig.x(), rig.local_tokens(), rig.weights(), rig.y(),
                                                    rig.dy(), rig.gradients(), nullptr, {}, 2);
  expect_agreed(measured, "measurement");
  ASSERT_EQ(measured.measured_us.size(), valid.size());
  for (double us : measured.measured_us) EXPECT_GT(us, 0.0);
  // The next step runs in the chosen layout and says how it was chosen.
  const ExpertParallelGpuWeights weights = rig.weights();
  layer.forward(rig.x(), rig.local_tokens(), weights, rig.y(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(layer.last_step().layout, measured.r);
  EXPECT_EQ(layer.last_step().layout_choice.by, "measurement");
  EXPECT_EQ(layer.last_step().layout_choice.measured_us, measured.measured_us);
}

// ---- errors on every rank ----

TEST(ExpertLayoutsGpuSettings, ValidLayoutsFollowTheRules) {
  const int R = world().size();
  if (8 % R != 0) GTEST_SKIP() << "the problems have E = 8 experts: R must divide 8";
  MoeConfig c = base_config();  // H = 256, B = 64
  std::vector<int> expected{0, 1};
  for (int r = 2; r <= R; ++r) {
    if (R % r == 0) expected.push_back(r);  // H / r = 128, 64 (r = 2, 4) are multiples of 64
  }
  EXPECT_EQ(valid_gpu_layouts(c, {}, R), expected);
  EXPECT_EQ(valid_gpu_layouts(c, {.pipeline_chunks = 2}, R), std::vector<int>{1});
  EXPECT_EQ(valid_gpu_layouts(c, {.pipeline_chunks = kAdaptivePipelineChunks}, R), std::vector<int>{1});
  c.block_size = 128;  // only r with H / r a multiple of 128: r = 2
  expected = {0, 1};
  if (R % 2 == 0) expected.push_back(2);
  EXPECT_EQ(valid_gpu_layouts(c, {}, R), expected);
  c.formulation = Formulation::padded;  // cuBLAS takes any H / r
  expected = {0, 1};
  for (int r = 2; r <= R; ++r) {
    if (R % r == 0) expected.push_back(r);
  }
  EXPECT_EQ(valid_gpu_layouts(c, {}, R), expected);
}

TEST_F(ExpertLayoutsGpuTest, BadLayoutsAreAnErrorOnEveryRank) {
  Communicator& comm = device_communicator();
  const int R = comm.size();
  auto expect_error = [&](const MoeConfig& config, const ExpertParallelGpuOptions& options, int r,
                          const std::string& text) {
    ExpertParallelGpu layer(comm, config, config.tokens, options);
    try {
      layer.set_layout(r);
      ADD_FAILURE() << "expected an error containing \"" << text << "\" for r = " << r;
    } catch (const std::invalid_argument& error) {
      EXPECT_THAT(error.what(), ::testing::HasSubstr(text));
    }
    EXPECT_EQ(layer.layout(), 1) << "a refused layout leaves the layer as it was";
  };
  const MoeConfig c = base_config();
  expect_error(c, {}, -1, "expert layout r = -1");
  expect_error(c, {}, R + 1, "expert layout r = " + std::to_string(R + 1));  // never divides R
  expect_error(c, {.pipeline_chunks = 2}, 0, "belong to the expert-parallel layout r = 1");
  expect_error(c, {.pipeline_chunks = kAdaptivePipelineChunks}, 0, "belong to the expert-parallel layout r = 1");
  expect_error(c, {.experts = ExpertCompute::identity}, 0, "identity experts");
  if (R > 1) {
    expect_error(c, {.hierarchical_ranks_per_node = R}, 0, "belong to the expert-parallel layout r = 1");
    // r = 2 divides R and H, but H / r = 64 is not a multiple of B = 128 (dropless).
    if (R % 2 == 0) {
      MoeConfig wide_blocks = c;
      wide_blocks.hidden_dim = 128;
      wide_blocks.block_size = 128;
      expect_error(wide_blocks, {}, 2, "not a multiple of B = 128");
    }
    // r that differs between ranks: rank 0 asks for 0, the others for 1.
    expect_error(c, {}, world().rank() == 0 ? 0 : 1, "differ between ranks");
  }
}

}  // namespace
}  // namespace moe::dist
