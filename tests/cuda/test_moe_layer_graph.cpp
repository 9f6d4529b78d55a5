// test_moe_layer_graph.cpp: the MoE layer's forward + backward captured as one CUDA graph and
// replayed gives, bit for bit, what its kernels give launched one by one (the same kernels on the
// same inputs in the same order), in every formulation, at a small shape (the portable kernels,
// B = 64) and at the MoE shape of moe_train's throughput preset (B = 128: on Hopper the
// warp-specialized TMA kernels, whose per-expert tensor maps are built on the device for each
// launch). A file of its own: a replay that faults takes its whole process with it.
// Run: ctest --test-dir build -R CudaMoeLayerGraph   (skips without a GPU)
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/captured_graph.h" // CapturedGraph
#include "core/device_buffer.h"  // DeviceBuffer
#include "gpu_test_support.h"    // REQUIRE_GPU, bf16_of
#include "init.h"                // moe::ref::random_matrix, random_weights
#include "moe/block_sparse.h"    // expert_pointer_table
#include "moe/moe_layer.h"       // MoeLayerGpu
#include "moe/tensor_map.h"      // create_launch_scratch_pool

namespace {

using moe::MoeConfig;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;  // bf16_of

struct Outputs {
  std::vector<bf16> y;
  std::vector<float> dx, d_gate, d_w1, d_w2;
};

// Runs forward (+ backward unless forward_only) `replays` times captured (after one launched call,
// as the model does) or launched, on a stream of its own, and returns the last call's outputs.
Outputs run(const MoeConfig& config, bool captured, int replays, bool forward_only) {
  const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
  const int64_t W1 = moe::w1_columns(config);
  const moe::ref::MoeWeights weights = moe::ref::random_weights(config, 71);
  std::mt19937_64 rng(72);
  const Matrix x = moe::ref::random_matrix(T, D, rng), dy = moe::ref::random_matrix(T, D, rng);
  DeviceBuffer<bf16> x_gpu(bf16_of(x)), dy_gpu(bf16_of(dy)), gate(bf16_of(weights.gate_weights));
  DeviceBuffer<bf16> w1(bf16_of(weights.w1)), w2(bf16_of(weights.w2)), y(size_t(T * D));
  auto w1_table = moe::cuda::expert_pointer_table<const bf16>(w1.data(), int(E), size_t(D * W1));
  auto w2_table = moe::cuda::expert_pointer_table<const bf16>(w2.data(), int(E), size_t(H * D));
  DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * W1)), d_w2(size_t(E * H * D));
  auto d_w1_table = moe::cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * W1));
  auto d_w2_table = moe::cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
  const moe::cuda::MoeLayerWeights w{gate.data(), w1_table.data(), w2_table.data()};
  const moe::cuda::MoeLayerGradients g{dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()};

  moe::cuda::MoeLayerGpu layer(config);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto step = [&] {
    layer.forward(x_gpu.data(), w, y.data(), stream);
    if (!forward_only) layer.backward(x_gpu.data(), w, dy_gpu.data(), g, stream);
  };
  step();  // launched: first-use set-up (function attributes, the scratch pool) happens here
  std::unique_ptr<moe::cuda::CapturedGraph> graph;
  if (captured) {
    moe::cuda::create_launch_scratch_pool();
    graph = moe::cuda::CapturedGraph::capture(stream, step);
  }
  for (int i = 0; i < replays; ++i) {
    for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2}) buffer->fill_bytes(0xFF);  // NaN poison before each call
    y.fill_bytes(0xFF);
    if (graph) {
      graph->launch(stream);
    } else {
      step();
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  graph.reset();
  CUDA_CHECK(cudaStreamDestroy(stream));
  return Outputs{y.download(), dx.download(), d_gate.download(), d_w1.download(), d_w2.download()};
}

template <typename T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void check_graph(const MoeConfig& config, const std::string& name, bool forward_only = false) {
  const Outputs launched = run(config, false, 2, forward_only), replayed = run(config, true, 3, forward_only);
  EXPECT_TRUE(same_bytes(launched.y, replayed.y)) << name << ": y";
  if (forward_only) return;
  EXPECT_TRUE(same_bytes(launched.dx, replayed.dx)) << name << ": dx";
  EXPECT_TRUE(same_bytes(launched.d_gate, replayed.d_gate)) << name << ": d_gate_weights";
  EXPECT_TRUE(same_bytes(launched.d_w1, replayed.d_w1)) << name << ": d_w1";
  EXPECT_TRUE(same_bytes(launched.d_w2, replayed.d_w2)) << name << ": d_w2";
}

MoeConfig config_of(moe::Formulation formulation, moe::Activation activation, bool throughput_shape) {
  MoeConfig c;
  c.formulation = formulation;
  c.activation = activation;
  c.capacity_factor = 1.0;
  c.top_k = 2;
  c.renormalize = true;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  if (throughput_shape) {  // moe_train --preset throughput: 64 sequences of 256 bytes
    c.tokens = 16384;
    c.model_dim = 512;
    c.hidden_dim = 1024;
    c.num_experts = 16;
    c.block_size = 128;
  } else {
    c.tokens = 300;
    c.model_dim = 128;
    c.hidden_dim = 256;
    c.num_experts = 8;
    c.block_size = 64;
  }
  return c;
}

class CudaMoeLayerGraph : public ::testing::TestWithParam<std::tuple<std::string, std::string, bool>> {};

TEST_P(CudaMoeLayerGraph, ReplayEqualsLaunched) {
  REQUIRE_GPU();
  const auto& [formulation, activation, throughput_shape] = GetParam();
  const MoeConfig config = config_of(moe::parse_formulation(formulation), moe::parse_activation(activation),
                                     throughput_shape);
  check_graph(config, formulation + " " + activation + (throughput_shape ? " throughput shape" : " small shape"));
}

INSTANTIATE_TEST_SUITE_P(
    Layers, CudaMoeLayerGraph,
    ::testing::Combine(::testing::Values("dropless", "padded", "dropping"), ::testing::Values("gelu", "swiglu"),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::get<1>(info.param) +
             (std::get<2>(info.param) ? "_throughput" : "_small");
    });

// The dropless products on Hopper in each of their kernel variants (block_sparse.h's switches):
// the stream-K tail off, the weight gradients' pairs off, pairs of block rows everywhere, and the
// forward alone.
class CudaMoeLayerGraphVariants : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaMoeLayerGraphVariants, DroplessThroughputShape) {
  REQUIRE_GPU();
  const std::string variant = GetParam();
  moe::cuda::set_stream_k_tail(variant != "no_stream_k_tail");
  moe::cuda::set_weight_gradient_pairs(variant != "no_weight_gradient_pairs");
  moe::cuda::set_block_row_pairs_everywhere(variant == "block_row_pairs_everywhere");
  check_graph(config_of(moe::Formulation::dropless, moe::Activation::gelu, true), "dropless gelu " + variant,
              variant == "forward_only");
  moe::cuda::set_stream_k_tail(true);
  moe::cuda::set_weight_gradient_pairs(true);
  moe::cuda::set_block_row_pairs_everywhere(false);
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaMoeLayerGraphVariants,
                         ::testing::Values("forward_only", "no_stream_k_tail", "no_weight_gradient_pairs",
                                           "block_row_pairs_everywhere"),
                         [](const auto& info) { return info.param; });

}  // namespace
