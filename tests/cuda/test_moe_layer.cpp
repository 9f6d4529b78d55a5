// test_moe_layer.cpp: the whole MoE layer on the GPU (cuda/moe/moe_layer.h), forward and
// backward in every formulation, against the CPU reference moe::ref::moe_forward / moe_backward
// computed in double from the same bf16-rounded inputs. bf16 activations with fp32 accumulation:
// relative errors of a few 1e-3 are expected; the tolerance is 2e-2. Pre-gated: the router reads
// another tensor than the experts, against moe::ref::pregated_moe_forward / backward. Every case
// runs with GeLU experts and again with SwiGLU (W1 [D, 2H]: gate columns, then up columns), whose
// dW1 is compared over both halves.
// Run: ctest --test-dir build -R CudaMoeLayer   (skips without a GPU)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/block_sparse.h"         // expert_pointer_table
#include "core/device_buffer.h"       // DeviceBuffer
#include "gpu_test_support.h"         // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error
#include "init.h"                     // moe::ref::random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // moe::ref::moe_forward, moe_backward
#include "moe/moe_layer.h"            // MoeLayerGpu
#include "pregate.h"                  // moe::ref::pregate
#include "pregated_layer.h"           // moe::ref::pregated_moe_forward / backward

namespace {

using moe::MoeConfig;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;

using namespace moe::test;  // round_bf16, bf16_of, matrix_of, relative_error

constexpr double kTolerance = 2e-2;

// How the router is fed: from x itself, or (pre-gated) from a separate router_input.
enum class Gate { self, pregated };

// Runs the layer on the GPU and the reference on the CPU, then compares y, the losses and every
// gradient. Pre-gated, dx is the gradient through the experts alone and d_router_input the one
// through the gate; both are compared.
void check_layer(MoeConfig config, uint64_t seed, double gate_scale = 1.0, int favoured_expert = -1,
                 Gate gate = Gate::self) {
  std::mt19937_64 rng(seed);
  const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
  const int64_t W1 = moe::w1_columns(config);  // H, or 2H for SwiGLU
  moe::ref::MoeWeights weights = moe::ref::random_weights(config, seed + 1);
  weights.gate_weights *= gate_scale;
  if (favoured_expert >= 0) weights.gate_weights.col(favoured_expert).array() += 50.0;  // x > 0 below
  weights.gate_weights = round_bf16(weights.gate_weights);
  for (auto& w : weights.w1) w = round_bf16(w);
  for (auto& w : weights.w2) w = round_bf16(w);
  Matrix x = round_bf16(moe::ref::random_matrix(T, D, rng));
  if (favoured_expert >= 0) x = x.cwiseAbs();
  const Matrix dy = round_bf16(moe::ref::random_matrix(T, D, rng));
  // Drawn after dy, so that a seed gives the same x and dy with a separate router input or without.
  const bool pregated = gate == Gate::pregated;
  Matrix router_input = pregated ? round_bf16(moe::ref::random_matrix(T, D, rng)) : x;
  if (favoured_expert >= 0) router_input = router_input.cwiseAbs();

  moe::ref::LayerForward ref;
  moe::ref::LayerGradients ref_grad;
  Matrix ref_d_router_input;  // pre-gated only
  if (pregated) {
    ref = moe::ref::pregated_moe_forward(config, x, weights, moe::ref::pregate(config, router_input,
                                                                                weights.gate_weights));
    moe::ref::PreGatedGradients grads = moe::ref::pregated_moe_backward(config, x, router_input, weights, ref, dy);
    ref_grad = std::move(grads.layer);
    ref_d_router_input = std::move(grads.router_input);
  } else {
    ref = moe::ref::moe_forward(config, x, weights);
    ref_grad = moe::ref::moe_backward(config, x, weights, ref, dy);
  }

  DeviceBuffer<bf16> x_gpu(bf16_of(x)), dy_gpu(bf16_of(dy)), gate_gpu(bf16_of(weights.gate_weights));
  DeviceBuffer<bf16> router_input_gpu(bf16_of(router_input));
  DeviceBuffer<float> d_router_input(size_t(T * D));
  DeviceBuffer<bf16> w1_gpu(bf16_of(weights.w1)), w2_gpu(bf16_of(weights.w2)), y_gpu(size_t(T * D));
  ASSERT_EQ(w1_gpu.size(), size_t(E * D * W1));
  auto w1_table = moe::cuda::expert_pointer_table<const bf16>(w1_gpu.data(), int(E), size_t(D * W1));
  auto w2_table = moe::cuda::expert_pointer_table<const bf16>(w2_gpu.data(), int(E), size_t(H * D));
  DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * W1)), d_w2(size_t(E * H * D));
  auto d_w1_table = moe::cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * W1));
  auto d_w2_table = moe::cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
  for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2, &d_router_input}) buffer->fill_bytes(0xFF);  // NaN poison
  y_gpu.fill_bytes(0xFF);

  moe::cuda::MoeLayerGpu layer(config);
  const moe::cuda::MoeLayerWeights w{gate_gpu.data(), w1_table.data(), w2_table.data()};
  const bf16* const gpu_router_input = pregated ? router_input_gpu.data() : nullptr;
  float* const gpu_d_router_input = pregated ? d_router_input.data() : nullptr;
  layer.forward(x_gpu.data(), w, y_gpu.data(), nullptr, gpu_router_input);
  layer.backward(x_gpu.data(), w, dy_gpu.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                 nullptr, gpu_router_input, gpu_d_router_input);
  CUDA_CHECK(cudaDeviceSynchronize());

  // The routing must be the reference's (inputs are not near ties at these seeds).
  const std::vector<int> top = layer.top_experts().download();
  int flips = 0;
  for (int64_t i = 0; i < T * config.top_k; ++i) flips += top[size_t(i)] != ref.router.top_experts.data()[i];
  ASSERT_EQ(flips, 0) << "GPU routing differs from the reference in " << flips << " slots";

  const Matrix y = matrix_of(y_gpu.download(), T, D);
  ASSERT_TRUE(y.allFinite());
  EXPECT_LT(relative_error(y, ref.y), kTolerance) << "y";
  EXPECT_NEAR(layer.aux_loss().download()[0], ref.aux_loss, 1e-4 * std::max(1.0, ref.aux_loss));
  EXPECT_NEAR(layer.z_loss().download()[0], ref.z_loss, 1e-4 * std::max(1.0, ref.z_loss));

  const Matrix dx_got = matrix_of(dx.download(), T, D);
  ASSERT_TRUE(dx_got.allFinite());
  EXPECT_LT(relative_error(dx_got, ref_grad.x), kTolerance) << "dx";
  if (pregated) {
    const Matrix d_router_input_got = matrix_of(d_router_input.download(), T, D);
    ASSERT_TRUE(d_router_input_got.allFinite());
    EXPECT_LT(relative_error(d_router_input_got, ref_d_router_input), kTolerance) << "d_router_input";
  }
  EXPECT_LT(relative_error(matrix_of(d_gate.download(), D, E), ref_grad.gate_weights), kTolerance) << "dWg";
  const auto d_w1_host = d_w1.download(), d_w2_host = d_w2.download();
  for (int64_t e = 0; e < E; ++e) {
    const Matrix g1 = matrix_of(d_w1_host, D, W1, size_t(e * D * W1));
    const Matrix g2 = matrix_of(d_w2_host, H, D, size_t(e * H * D));
    ASSERT_TRUE(g1.allFinite() && g2.allFinite()) << "expert " << e;
    if (ref_grad.w1[e].norm() == 0) {  // an expert with no tokens: exactly zero gradient
      EXPECT_EQ(g1.norm(), 0.0) << "expert " << e;
      EXPECT_EQ(g2.norm(), 0.0) << "expert " << e;
    } else {
      EXPECT_LT(relative_error(g1, ref_grad.w1[e]), kTolerance) << "dW1 expert " << e;
      if (W1 == 2 * H) {  // SwiGLU: each half on its own (a wrong half hides less in the whole's norm)
        EXPECT_LT(relative_error(g1.leftCols(H), ref_grad.w1[e].leftCols(H)), kTolerance) << "dW1 gate, expert " << e;
        EXPECT_LT(relative_error(g1.rightCols(H), ref_grad.w1[e].rightCols(H)), kTolerance) << "dW1 up, expert " << e;
      }
      EXPECT_LT(relative_error(g2, ref_grad.w2[e]), kTolerance) << "dW2 expert " << e;
    }
  }
}

MoeConfig base_config(moe::Activation activation = moe::Activation::gelu) {
  MoeConfig c;
  c.activation = activation;
  c.tokens = 300;  // not a multiple of B
  c.model_dim = 128;
  c.hidden_dim = 256;
  c.num_experts = 8;
  c.top_k = 2;
  c.block_size = 64;
  c.renormalize = true;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

TEST(CudaMoeLayer, DroplessBlockSize64And128) {
  REQUIRE_GPU();
  MoeConfig c = base_config();
  check_layer(c, 11);
  c.block_size = 128;
  check_layer(c, 12);
}

TEST(CudaMoeLayer, PaddedAndDropping) {
  REQUIRE_GPU();
  MoeConfig c = base_config();
  c.formulation = moe::Formulation::padded;
  c.capacity_factor = 2.0;
  check_layer(c, 21);
  c.formulation = moe::Formulation::dropping;
  c.capacity_factor = 1.0;  // drops tokens: the dropped ones get zero MoE output and no gradient
  check_layer(c, 22, 3.0);
}

TEST(CudaMoeLayer, AwkwardShapes) {
  REQUIRE_GPU();
  MoeConfig c = base_config();
  c.num_experts = 1;  // E = 1, K = 1
  c.top_k = 1;
  check_layer(c, 31);
  c = base_config();
  c.tokens = 1;  // T = 1: one token, many empty experts
  check_layer(c, 32);
  c = base_config();
  c.top_k = 1;
  c.renormalize = false;
  check_layer(c, 33, 1.0, /*favoured_expert=*/3);  // all tokens on expert 3, the others empty
  c = base_config();
  c.num_experts = 4;
  c.top_k = 4;  // K = E
  check_layer(c, 34);
}

// On Hopper at B = 128 the dropless layer writes no permuted copy of x: the SDD and the DDS gather
// x's rows through the plan as they copy them (block_sparse.h, ExpertRows). The awkward cases
// again that way: K = 2, one token, every token on one expert, and a separate router input.
TEST(CudaMoeLayer, DroplessGatheredRowsB128) {
  REQUIRE_GPU();
  MoeConfig c = base_config();
  c.block_size = 128;
  if (!moe::cuda::rows_gatherable(c)) {
    GTEST_SKIP() << "the rows are gathered only on a compute capability 9.0 GPU with an sm_90a build";
  }
  check_layer(c, 51);
  c.tokens = 1;
  check_layer(c, 52);
  c = base_config();
  c.block_size = 128;
  c.top_k = 1;
  c.renormalize = false;
  check_layer(c, 53, 1.0, /*favoured_expert=*/3);
  c = base_config();
  c.block_size = 128;
  check_layer(c, 54, 1.0, -1, Gate::pregated);
}

// The gate reads another tensor than the experts (pre-gating): every formulation, and all tokens on
// one expert (the other experts empty, their gradients exactly zero).
TEST(CudaMoeLayer, PreGatedRouterInput) {
  REQUIRE_GPU();
  MoeConfig c = base_config();
  check_layer(c, 41, 1.0, -1, Gate::pregated);
  c.formulation = moe::Formulation::padded;
  c.capacity_factor = 2.0;
  check_layer(c, 42, 1.0, -1, Gate::pregated);
  c.formulation = moe::Formulation::dropping;
  c.capacity_factor = 1.0;
  check_layer(c, 43, 3.0, -1, Gate::pregated);
  c = base_config();
  c.top_k = 1;
  c.renormalize = false;
  check_layer(c, 44, 1.0, /*favoured_expert=*/3, Gate::pregated);
}

// ---- SwiGLU experts ----
// The cases above again with SwiGLU: dropless (two SDDs over W1's halves, the second with
// silu(gate) * up in its epilogue; the backward's SDD writes d_gate and d_up, two DDS fill dW1's
// halves, one DSD over [d_gate | d_up] gives dx), and padded / dropping (one [C, D] x [D, 2H]
// product per expert, then the fused SwiGLU pass of moe/activation.h).
struct SwigluCase {
  std::string name;
  MoeConfig config;
  uint64_t seed;
  double gate_scale = 1.0;
  int favoured_expert = -1;
  Gate gate = Gate::self;
};

void check_swiglu_cases(const std::vector<SwigluCase>& cases) {
  for (const SwigluCase& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_EQ(c.config.activation, moe::Activation::swiglu);
    check_layer(c.config, c.seed, c.gate_scale, c.favoured_expert, c.gate);
  }
}

MoeConfig swiglu_config(moe::Formulation formulation, int64_t block_size = 64, double capacity_factor = 1.0) {
  MoeConfig c = base_config(moe::Activation::swiglu);
  c.formulation = formulation;
  c.block_size = block_size;
  c.capacity_factor = capacity_factor;
  return c;
}

TEST(CudaMoeLayer, SwigluEveryFormulation) {
  REQUIRE_GPU();
  using moe::Formulation;
  check_swiglu_cases({
      {"dropless B=64", swiglu_config(Formulation::dropless, 64), 111},
      {"dropless B=128", swiglu_config(Formulation::dropless, 128), 112},
      {"padded cf=2", swiglu_config(Formulation::padded, 64, 2.0), 113},
      // drops tokens: the dropped ones get zero MoE output and no gradient
      {"dropping cf=1", swiglu_config(Formulation::dropping, 64, 1.0), 114, 3.0},
  });
}

TEST(CudaMoeLayer, SwigluAwkwardShapes) {
  REQUIRE_GPU();
  using moe::Formulation;
  std::vector<SwigluCase> cases;
  for (Formulation f : {Formulation::dropless, Formulation::padded}) {
    const std::string name = std::string(moe::to_string(f));
    MoeConfig c = swiglu_config(f, 64, 2.0);
    c.num_experts = 1;  // E = 1, K = 1
    c.top_k = 1;
    cases.push_back({name + " E=1 K=1", c, 131});
    c = swiglu_config(f, 64, 2.0);
    c.tokens = 1;  // T = 1: one token, many empty experts
    cases.push_back({name + " T=1", c, 132});
    c = swiglu_config(f, 64, 2.0);
    c.top_k = 1;
    c.renormalize = false;
    c.capacity_factor = 8.0;  // padded: every token fits on the one expert
    cases.push_back({name + " all tokens on expert 3", c, 133, 1.0, /*favoured_expert=*/3});
    c = swiglu_config(f, 64, 2.0);
    c.num_experts = 4;
    c.top_k = 4;  // K = E
    cases.push_back({name + " K=E", c, 134});
  }
  // Padded with H = 98: H / 2 = 49 bf16 pairs per half, so a row's up half starts mid-way through
  // an odd number of pairs (the fused pass's indexing), and T = 77 tokens, C not a round number.
  MoeConfig odd = swiglu_config(Formulation::padded, 64, 1.5);
  odd.hidden_dim = 98;
  odd.tokens = 77;
  cases.push_back({"padded H=98 T=77", odd, 135});
  check_swiglu_cases(cases);
}

TEST(CudaMoeLayer, SwigluPreGatedRouterInput) {
  REQUIRE_GPU();
  using moe::Formulation;
  check_swiglu_cases({
      {"dropless pre-gated", swiglu_config(Formulation::dropless, 64), 141, 1.0, -1, Gate::pregated},
      {"padded pre-gated", swiglu_config(Formulation::padded, 64, 2.0), 142, 1.0, -1, Gate::pregated},
      {"dropping pre-gated", swiglu_config(Formulation::dropping, 64, 1.0), 143, 3.0, -1, Gate::pregated},
  });
}

// On Hopper at B = 128 (H = 256 here) the dropless SwiGLU layer gathers x's rows in both SDDs.
TEST(CudaMoeLayer, SwigluDroplessGatheredRowsB128) {
  REQUIRE_GPU();
  MoeConfig c = swiglu_config(moe::Formulation::dropless, 128);
  if (!moe::cuda::rows_gatherable(c)) {
    GTEST_SKIP() << "the rows are gathered only on a compute capability 9.0 GPU with an sm_90a build";
  }
  MoeConfig one_token = c;
  one_token.tokens = 1;
  MoeConfig one_expert = c;
  one_expert.top_k = 1;
  one_expert.renormalize = false;
  check_swiglu_cases({
      {"gathered", c, 151},
      {"gathered T=1", one_token, 152},
      {"gathered, all tokens on expert 3", one_expert, 153, 1.0, /*favoured_expert=*/3},
      {"gathered pre-gated", c, 154, 1.0, -1, Gate::pregated},
  });
}

// A separate router_input without a d_router_input would drop the gate's gradient into dx, where
// it does not belong; the layer refuses it (and d_router_input aliasing dx) before any launch.
TEST(CudaMoeLayer, PreGatedBackwardNeedsItsOwnGradient) {
  REQUIRE_GPU();
  const MoeConfig c = base_config();
  moe::cuda::MoeLayerGpu layer(c);
  DeviceBuffer<bf16> x(size_t(c.tokens * c.model_dim)), router_input(x.size()), dy(x.size());
  DeviceBuffer<float> dx(x.size()), d_gate(size_t(c.model_dim * c.num_experts));
  DeviceBuffer<const bf16*> w_table(size_t(c.num_experts));
  DeviceBuffer<float*> d_w_table(size_t(c.num_experts));
  const moe::cuda::MoeLayerWeights w{router_input.data(), w_table.data(), w_table.data()};
  const moe::cuda::MoeLayerGradients g{dx.data(), d_gate.data(), d_w_table.data(), d_w_table.data()};
  EXPECT_THROW(layer.backward(x.data(), w, dy.data(), g, nullptr, router_input.data(), nullptr),
               std::invalid_argument);
  EXPECT_THROW(layer.backward(x.data(), w, dy.data(), g, nullptr, router_input.data(), dx.data()),
               std::invalid_argument);
}

// forward() in two halves (route, then compute_experts), as a decoding model calls them: the same
// routing, y and gradients as forward(), bit for bit, self-gated and with a separate router input,
// dropless (B = 64: the mma.sync kernels, no stream-K tail whose partial sums meet in arrival order)
// and padded, GeLU and SwiGLU. compute_experts gets no gate weights: route() has used them.
TEST(CudaMoeLayer, RouteThenComputeExpertsIsForward) {
  REQUIRE_GPU();
  using moe::Activation;
  struct Case { moe::Formulation formulation; Gate gate; Activation activation = Activation::gelu; };
  for (const Case& c : {Case{moe::Formulation::dropless, Gate::self}, Case{moe::Formulation::dropless, Gate::pregated},
                        Case{moe::Formulation::padded, Gate::self},
                        Case{moe::Formulation::dropless, Gate::self, Activation::swiglu},
                        Case{moe::Formulation::padded, Gate::pregated, Activation::swiglu}}) {
    MoeConfig config = base_config(c.activation);
    config.formulation = c.formulation;
    config.capacity_factor = 2.0;
    const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
    const int64_t W1 = moe::w1_columns(config);
    const moe::ref::MoeWeights weights = moe::ref::random_weights(config, 61);
    std::mt19937_64 rng(62);
    const Matrix x = moe::ref::random_matrix(T, D, rng), dy = moe::ref::random_matrix(T, D, rng);
    const Matrix router_input = moe::ref::random_matrix(T, D, rng);
    DeviceBuffer<bf16> x_gpu(bf16_of(x)), dy_gpu(bf16_of(dy)), router_input_gpu(bf16_of(router_input));
    DeviceBuffer<bf16> gate(bf16_of(weights.gate_weights)), w1(bf16_of(weights.w1)), w2(bf16_of(weights.w2));
    auto w1_table = moe::cuda::expert_pointer_table<const bf16>(w1.data(), int(E), size_t(D * W1));
    auto w2_table = moe::cuda::expert_pointer_table<const bf16>(w2.data(), int(E), size_t(H * D));
    const moe::cuda::MoeLayerWeights w{gate.data(), w1_table.data(), w2_table.data()};
    const bool pregated = c.gate == Gate::pregated;
    const bf16* const gate_input = pregated ? router_input_gpu.data() : x_gpu.data();

    // Everything one run produces, downloaded: y, the routing, every gradient.
    struct Run {
      std::vector<bf16> y;
      std::vector<int> top_experts;
      std::vector<float> combine_weights, dx, d_gate, d_w1, d_w2, d_router_input;
    };
    auto run = [&](bool split) {
      moe::cuda::MoeLayerGpu layer(config);
      DeviceBuffer<bf16> y(size_t(T * D));
      DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * W1)), d_w2(size_t(E * H * D));
      DeviceBuffer<float> d_router_input(size_t(T * D));
      auto d_w1_table = moe::cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * W1));
      auto d_w2_table = moe::cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
      for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2, &d_router_input}) buffer->fill_bytes(0xFF);  // NaN poison
      y.fill_bytes(0xFF);
      if (split) {
        layer.route(gate_input, gate.data(), nullptr);
        layer.compute_experts(x_gpu.data(), {nullptr, w1_table.data(), w2_table.data()}, y.data(), nullptr);
      } else {
        layer.forward(x_gpu.data(), w, y.data(), nullptr, pregated ? router_input_gpu.data() : nullptr);
      }
      layer.backward(x_gpu.data(), w, dy_gpu.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                     nullptr, pregated ? router_input_gpu.data() : nullptr,
                     pregated ? d_router_input.data() : nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      return Run{y.download(), layer.top_experts().download(), layer.combine_weights().download(), dx.download(),
                 d_gate.download(), d_w1.download(), d_w2.download(),
                 pregated ? d_router_input.download() : std::vector<float>{}};
    };
    const Run whole = run(false), halves = run(true);
    const std::string name = std::string(moe::to_string(c.formulation)) + (pregated ? " pre-gated" : " self-gated") +
                             " " + std::string(moe::to_string(c.activation));
    auto same_bytes = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    EXPECT_TRUE(same_bytes(whole.top_experts, halves.top_experts)) << name << ": top_experts";
    EXPECT_TRUE(same_bytes(whole.combine_weights, halves.combine_weights)) << name << ": combine weights";
    EXPECT_TRUE(same_bytes(whole.y, halves.y)) << name << ": y";
    EXPECT_TRUE(same_bytes(whole.dx, halves.dx)) << name << ": dx";
    EXPECT_TRUE(same_bytes(whole.d_gate, halves.d_gate)) << name << ": d_gate_weights";
    EXPECT_TRUE(same_bytes(whole.d_w1, halves.d_w1)) << name << ": d_w1";
    EXPECT_TRUE(same_bytes(whole.d_w2, halves.d_w2)) << name << ": d_w2";
    EXPECT_TRUE(same_bytes(whole.d_router_input, halves.d_router_input)) << name << ": d_router_input";
    // And the halves' output is the layer's, not NaN poison.
    const Matrix y = matrix_of(halves.y, T, D);
    EXPECT_TRUE(y.allFinite()) << name;
    EXPECT_GT(y.norm(), 0.0) << name;
  }
}

TEST(CudaMoeLayer, BadConfigurationsFailBeforeAnyLaunch) {
  REQUIRE_GPU();
  MoeConfig c = swiglu_config(moe::Formulation::padded, 64, 2.0);
  c.hidden_dim = 99;  // SwiGLU's pass moves bf16 pairs: H must be even
  try {
    moe::cuda::MoeLayerGpu layer{c};
    FAIL() << "SwiGLU with H = 99 was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("hidden_dim (H) = 99"), std::string::npos) << error.what();
  }
  c = base_config();
  c.jitter_eps = 0.1;
  EXPECT_THROW(moe::cuda::MoeLayerGpu{c}, std::invalid_argument);
  c = base_config();
  c.block_size = 32;
  EXPECT_THROW(moe::cuda::MoeLayerGpu{c}, std::invalid_argument);
  c = base_config();
  c.hidden_dim = 100;  // not a multiple of B
  EXPECT_THROW(moe::cuda::MoeLayerGpu{c}, std::invalid_argument);
  c = base_config();
  c.top_k = 9;
  EXPECT_THROW(moe::cuda::MoeLayerGpu{c}, std::invalid_argument);
  c = base_config();  // rows x H past 32-bit indexing: refused before any allocation
  c.formulation = moe::Formulation::padded;
  c.capacity_factor = 1e7;
  EXPECT_THROW(moe::cuda::MoeLayerGpu{c}, std::invalid_argument);
  // A layer larger than the free memory is refused before any allocation (checked against a given
  // free size: taking the GPU's real memory away would disturb the tests that run beside this one).
  c = base_config();
  c.tokens = 65536;
  c.model_dim = 4096;
  c.hidden_dim = 4096;
  EXPECT_GT(moe::cuda::layer_memory_bytes(c), 4.0 * (1 << 30));  // > 4 GiB of activations
  EXPECT_NO_THROW(moe::cuda::check_layer_fits(c, size_t{64} << 30));
  try {
    moe::cuda::check_layer_fits(c, size_t{1} << 30);
    FAIL() << "a layer of " << moe::cuda::layer_memory_bytes(c) << " bytes fit in 1 GiB";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("1.00 GiB are free"), std::string::npos) << error.what();
  }
}

}  // namespace
