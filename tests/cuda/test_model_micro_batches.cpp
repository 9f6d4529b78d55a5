// test_model_micro_batches.cpp: gradient accumulation in the GPU model (cuda/model/model.h): a step
// of N = 4 sequences run as M = 2 micro-batches of 2 (forward_micro_batch, backward_micro_batch;
// the MoE blocks' expert weight gradients as one product over both micro-batches) gives the loss,
// every gradient and the AdamW update of the same step run as one batch of 4, within bf16
// tolerance. The load-balancing loss is a statistic of the tokens routed together, so its
// coefficient is 0 here (each micro-batch's would be its own); the z-loss is a mean over tokens and
// stays on. Tiny configs as test_model.cpp (D=64, 2 heads, L=2, S=32, E=4, K=2, H=64, B=64).
// Run: ctest --test-dir build -R CudaModelGpuMicroBatches   (the steps skip without a GPU; the
// config checks run anywhere)
//
// Routing is the one discontinuity (test_model.cpp says why): the two runs route 2 and 4 sequences
// with cuBLAS products of different shapes, so a token at a near tie might pick another expert in
// one of them. The test checks that every token of every MoE block is routed alike in both and, if
// not, draws other windows of the text (at most kBatchTries).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"      // CUDA_CHECK
#include "core/device_buffer.h"   // DeviceBuffer
#include "gpu_test_support.h"     // REQUIRE_GPU, bf16_init
#include "infer/weights_file.h"   // gpu_config_of
#include "model/model.h"          // moe::cuda::ModelGpu
#include "reference_cpu/model.h"  // moe::ModelConfig, moe_layer_config

namespace {

using moe::Formulation;
using moe::cuda::DeviceBuffer;
using moe::cuda::ModelGpu;
using moe::ModelConfig;
using moe::MoeLayers;
using namespace moe::test;

constexpr int64_t kBatch = 4;         // N of the step
constexpr int64_t kMicroBatches = 2;  // M
constexpr double kLossTolerance = 1e-3;      // the same arithmetic on the same tokens, summed in another order
constexpr double kGradientTolerance = 2e-2;  // bf16 activations, fp32 sums in another order (a few 1e-3 seen
                                             // between the GPU and the reference: test_model.cpp)
constexpr double kWeightTolerance = 2e-2;    // AdamW's first step moves each weight by lr * sign(g)
constexpr int kBatchTries = 8;

ModelConfig tiny_config(MoeLayers moe_layers) {
  ModelConfig c;
  c.model_dim = 64;
  c.num_layers = 2;
  c.num_heads = 2;
  c.seq_len = 32;
  c.moe_layers = moe_layers;
  c.dense_hidden_dim = 128;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_hidden_dim = 64;
  c.formulation = Formulation::dropless;
  c.block_size = 64;
  c.aux_loss_coef = 0.0;  // a batch statistic: see the file comment
  return c;
}

moe::cuda::ModelGpuConfig gpu_config(const ModelConfig& c, int64_t batch, int64_t micro_batches) {
  moe::cuda::ModelGpuConfig g = moe::cuda::gpu_config_of(c, batch);  // batch: one micro-batch's sequences
  g.micro_batches = micro_batches;
  return g;
}

// N windows of S + 1 bytes of `text`: inputs [0, S), targets [1, S + 1), row-major [N, S].
void windows(const std::string& text, size_t first, int64_t N, int64_t S, std::vector<int32_t>& inputs,
             std::vector<int32_t>& targets) {
  inputs.clear();
  targets.clear();
  for (int64_t n = 0; n < N; ++n) {
    const size_t start = first + size_t(n) * 37;
    for (int64_t s = 0; s < S; ++s) {
      inputs.push_back(static_cast<unsigned char>(text[start + size_t(s)]));
      targets.push_back(static_cast<unsigned char>(text[start + size_t(s) + 1]));
    }
  }
}

// Every MoE block's top_experts of the model's last forward, [T, K] each, in block order.
std::vector<std::vector<int>> routing(const ModelGpu& model) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::vector<int>> all;
  for (int64_t i = 0; i < model.config().num_layers; ++i) {
    if (const moe::cuda::MoeLayerGpu* layer = model.moe_layer(i)) all.push_back(layer->top_experts().download());
  }
  return all;
}

double relative(const std::vector<float>& got, const std::vector<float>& want, int64_t offset, int64_t count) {
  double diff2 = 0, ref2 = 0;
  for (int64_t i = offset; i < offset + count; ++i) {
    diff2 += (double(got[size_t(i)]) - want[size_t(i)]) * (double(got[size_t(i)]) - want[size_t(i)]);
    ref2 += double(want[size_t(i)]) * want[size_t(i)];
  }
  return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
}

void check_two_micro_batches(const ModelConfig& config, uint64_t seed) {
  const int64_t S = config.seq_len, N = kBatch, M = kMicroBatches, micro_tokens = (N / M) * S;
  std::string text;
  while (text.size() < 4000) {
    text += "the cat sees the red ball. a dog follows the river, and " + std::to_string(text.size()) + " birds sing. ";
  }
  const std::vector<float> weights = bf16_init(config, seed).flat;
  constexpr float kLearningRate = 1e-3f;

  for (int attempt = 0; attempt < kBatchTries; ++attempt) {
    std::vector<int32_t> inputs, targets;
    windows(text, size_t(attempt) * 301, N, S, inputs, targets);
    DeviceBuffer<int32_t> tokens(inputs), next_bytes(targets);

    // One batch of N sequences.
    ModelGpu one(gpu_config(config, N, 1));
    one.upload_weights(weights);
    one.forward(tokens.data(), next_bytes.data());
    const float loss_one = one.read_loss();
    const std::vector<std::vector<int>> routing_one = routing(one);
    one.backward();
    const std::vector<float> gradients_one = one.download_gradients();

    // The same N sequences as M micro-batches of N / M.
    ModelGpu micro(gpu_config(config, N / M, M));
    micro.upload_weights(weights);
    double loss_micro = 0;
    int routing_differences = 0;
    for (int m = 0; m < int(M); ++m) {
      micro.forward_micro_batch(m, tokens.data() + m * micro_tokens, next_bytes.data() + m * micro_tokens);
      loss_micro += micro.read_loss() / double(M);
      const std::vector<std::vector<int>> routing_micro = routing(micro);
      for (size_t block = 0; block < routing_micro.size(); ++block) {
        const size_t slots = routing_micro[block].size();  // micro_tokens * K
        for (size_t i = 0; i < slots; ++i) routing_differences += routing_micro[block][i] != routing_one[block][m * slots + i];
      }
      micro.backward_micro_batch(m);
    }
    if (routing_differences != 0) {
      std::printf("windows from %d: %d slots routed differently (a near tie); drawing other windows\n", attempt * 301,
                  routing_differences);
      continue;
    }
    const std::vector<float> gradients_micro = micro.download_gradients();

    EXPECT_NEAR(loss_micro, loss_one, kLossTolerance * std::abs(loss_one)) << "the step's loss";
    double worst = 0;
    for (const moe::cuda::ParameterSpan& p : one.layout()) {
      const double error = relative(gradients_micro, gradients_one, p.offset, p.rows * p.cols);
      worst = std::max(worst, error);
      EXPECT_LT(error, kGradientTolerance) << "gradient of " << p.name;
    }

    // The same update: one AdamW step each from the same weights.
    one.step(kLearningRate);
    micro.step(kLearningRate);
    EXPECT_NEAR(micro.read_grad_norm(), one.read_grad_norm(), kGradientTolerance * one.read_grad_norm());
    const std::vector<float> after_one = one.download_weights(), after_micro = micro.download_weights();
    for (const moe::cuda::ParameterSpan& p : one.layout()) {
      EXPECT_LT(relative(after_micro, after_one, p.offset, p.rows * p.cols), kWeightTolerance) << "weights of " << p.name;
    }
    std::printf("%d micro-batches vs one batch: loss %.5f vs %.5f, worst gradient rel_err %.2e (tol %.0e)\n", int(M),
                loss_micro, double(loss_one), worst, kGradientTolerance);
    return;
  }
  FAIL() << "every drawn batch had a near tie in the routing";
}

TEST(CudaModelGpuMicroBatches, EveryOtherBlock) {
  REQUIRE_GPU();
  check_two_micro_batches(tiny_config(MoeLayers::every_other_block), 41);
}

TEST(CudaModelGpuMicroBatches, EveryBlock) {
  REQUIRE_GPU();
  check_two_micro_batches(tiny_config(MoeLayers::every_block), 42);
}

TEST(CudaModelGpuMicroBatches, PregatedEveryBlock) {
  REQUIRE_GPU();
  ModelConfig c = tiny_config(MoeLayers::every_block);
  c.num_layers = 3;
  c.pregated = true;
  check_two_micro_batches(c, 43);
}

// Micro-batches are one GPU and dropless; a model of M > 1 trains only through the micro-batch calls.
TEST(CudaModelGpuMicroBatchesConfig, ValidateRejectsBadMicroBatches) {
  ModelConfig c = tiny_config(MoeLayers::every_block);
  auto rejected = [](const moe::cuda::ModelGpuConfig& g, const std::string& fragment) {
    try {
      moe::cuda::validate(g);
      ADD_FAILURE() << "accepted: " << fragment;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
  };
  rejected(gpu_config(c, 2, 0), "micro_batches (M) = 0");
  rejected(gpu_config(c, 2, -2), "micro_batches (M) = -2");
  moe::cuda::ModelGpuConfig two_ranks = gpu_config(c, 2, 2);
  two_ranks.ranks = 2;
  two_ranks.moe.tokens = 2 * 2 * c.seq_len;
  rejected(two_ranks, "gradient accumulation trains on one GPU");
  c.formulation = Formulation::padded;
  rejected(gpu_config(c, 2, 2), "the dropless formulation");
  EXPECT_NO_THROW(moe::cuda::validate(gpu_config(tiny_config(MoeLayers::every_block), 2, 2)));
}

TEST(CudaModelGpuMicroBatches, PlainBackwardRefused) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_block);
  ModelGpu model(gpu_config(config, 2, 2));
  model.upload_weights(bf16_init(config, 44).flat);
  std::vector<int32_t> inputs(size_t(2 * config.seq_len), 'a'), targets(inputs.size(), 'b');
  DeviceBuffer<int32_t> tokens(inputs), next_bytes(targets);
  model.forward(tokens.data(), next_bytes.data());  // a plain forward (validation) is fine
  EXPECT_THROW(model.backward(), std::invalid_argument);
  EXPECT_THROW(model.forward_micro_batch(2, tokens.data(), next_bytes.data()), std::invalid_argument);
  model.forward_micro_batch(0, tokens.data(), next_bytes.data());
  EXPECT_THROW(model.backward_micro_batch(1), std::invalid_argument);
  model.backward_micro_batch(0);
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
