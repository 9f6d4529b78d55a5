// test_model.cpp: one GPU training step of the whole transformer (cuda/model/model.h) against the
// CPU reference model (reference_cpu/model.h, optimizer.h): the loss and every gradient within bf16
// tolerance. Tiny configs (D=64, 2 heads, L=2, S=32, N=4, E=4, K=2, H=64, B=64), MoE
// in every block or every other block, dropless and padded, self-gated and pre-gated (model.h),
// GeLU experts and SwiGLU experts (W1 [D, 2H] per expert in the flat layout).
// The pre-gated cases take L = 3 or 4 where L = 2 would leave a single MoE block (nothing to
// pre-gate): every other block of 4 has MoE blocks 1 and 3, and every block of 3 has a middle MoE
// block that both receives a later gate's gradient and sends its own gate's gradient back.
// Run: ctest --test-dir build -R CudaModelGpu   (the step tests skip without a GPU; the config
// checks run anywhere)
//
// The same bytes to both: ref::init_model's weights are rounded to bf16 first, so the GPU's fp32
// masters, its bf16 copies and the reference's doubles hold the same values; what remains between
// them is the GPU's arithmetic.
//
// Tolerances, from the precision:
//   loss (and lm / aux / z parts)  1e-2 relative. The mean of T cross-entropies over fp32 logits
//                                  from bf16 activations: errors of ~1e-3 that average out.
//   each parameter's gradient      3e-2 relative (Frobenius norm per tensor). Every activation the
//                                  backward reads is stored in bf16 (2^-9 relative rounding per value)
//                                  and so is every backward GEMM operand (d_residual, d_hidden,
//                                  d_logits, the attention's d_scores); through L blocks of
//                                  LayerNorm, attention, FFN and back, a few such roundings
//                                  compound into errors of ~1e-2 on the deepest tensors (the
//                                  embeddings, block 0), the MoE layer test alone reaches a few 1e-3.
//                                  The gate's and LayerNorm's gradients are differences of nearly
//                                  equal terms, which magnifies relative error, hence 3e-2, not 2e-2.
//   AdamW                          1e-4 relative on the fp32 masters (fp32 against double, same
//                                  gradients: the GPU's own, uploaded into the reference step).
//
// Routing is the one discontinuity: top-K picks experts by comparing probabilities, and a token
// whose K-th and (K+1)-th probabilities differ by less than bf16 rounding can pick another expert on
// the GPU, which moves a whole token's contribution between experts: not a precision error. At
// initialisation the router's probabilities are nearly uniform, so the test checks that the GPU and
// the reference route every token of every MoE block identically and, if one batch has a near tie,
// draws another batch (at most kBatchTries); it reports how many it drew.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"          // CUDA_CHECK
#include "core/device_buffer.h"       // DeviceBuffer
#include "gpu_test_support.h"         // REQUIRE_GPU, bf16_init, matrix_of, relative_error
#include "infer/weights_file.h"       // gpu_config_of
#include "reference_cpu/model.h"      // moe::ref::init_model, model_forward, model_backward, parameters
#include "model/model.h"              // moe::cuda::ModelGpu
#include "reference_cpu/optimizer.h"  // moe::ref::adamw_step, clip_gradient_norm

namespace {

using moe::Formulation;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::cuda::ModelGpu;
using moe::ref::IndexMatrix;
using moe::ref::Matrix;
using moe::ModelConfig;
using moe::MoeLayers;
using namespace moe::test;

constexpr int64_t kBatch = 4;  // N
constexpr double kLossTolerance = 1e-2;
constexpr double kGradientTolerance = 3e-2;
constexpr double kOptimizerTolerance = 1e-4;
constexpr int kBatchTries = 8;

ModelConfig tiny_config(MoeLayers moe_layers, Formulation formulation) {
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
  c.formulation = formulation;
  c.capacity_factor = 1.25;  // padded: C = ceil(1.25 * T * K / E), a few tokens may be dropped
  c.block_size = 64;
  return c;
}

// The plain fields the cuda library takes (it does not link the Eigen reference): infer/weights_file.h's
// conversion.
moe::cuda::ModelGpuConfig gpu_config(const ModelConfig& c, int64_t batch) { return moe::cuda::gpu_config_of(c, batch); }

// N windows of S + 1 bytes of `text` from the given starts: inputs [0, S), targets [1, S + 1).
void windows(const std::string& text, const std::vector<size_t>& starts, int64_t S, IndexMatrix& inputs,
             IndexMatrix& targets) {
  inputs.resize(int64_t(starts.size()), S);
  targets.resize(int64_t(starts.size()), S);
  for (size_t n = 0; n < starts.size(); ++n) {
    for (int64_t s = 0; s < S; ++s) {
      inputs(int64_t(n), s) = static_cast<unsigned char>(text[starts[n] + size_t(s)]);
      targets(int64_t(n), s) = static_cast<unsigned char>(text[starts[n] + size_t(s) + 1]);
    }
  }
}

std::vector<int32_t> flat_of(const IndexMatrix& m) { return {m.data(), m.data() + m.size()}; }

// Tokens whose chosen expert set differs between the GPU's last forward and the reference's.
int routing_differences(const ModelGpu& model, const moe::ref::ModelForward& forward) {
  int differences = 0;
  for (int64_t i = 0; i < model.config().num_layers; ++i) {
    const moe::cuda::MoeLayerGpu* layer = model.moe_layer(i);
    if (layer == nullptr) continue;
    const std::vector<int> gpu = layer->top_experts().download();
    const IndexMatrix& ref = forward.blocks[size_t(i)].moe->router.top_experts;
    const int64_t K = ref.cols();
    for (int64_t t = 0; t < ref.rows(); ++t) {
      std::set<int> got(gpu.begin() + t * K, gpu.begin() + (t + 1) * K), want;
      for (int64_t k = 0; k < K; ++k) want.insert(int(ref(t, k)));
      differences += got != want;
    }
  }
  return differences;
}

struct StepCase {
  MoeLayers moe_layers;
  Formulation formulation;
  bool pregated = false;
  int64_t num_layers = 2;  // L
  moe::Activation activation = moe::Activation::gelu;
};

std::string case_name(const StepCase& c) {
  std::string name =
      std::string(moe::to_string(c.moe_layers)) + "_" + std::string(moe::to_string(c.formulation));
  if (c.pregated) name += "_pregated_L" + std::to_string(c.num_layers);
  if (c.activation != moe::Activation::gelu) name += "_" + std::string(moe::to_string(c.activation));
  return name;
}

class CudaModelGpuStep : public ::testing::TestWithParam<StepCase> {};

// One forward + backward: loss and every gradient against the reference; then one AdamW step.
TEST_P(CudaModelGpuStep, MatchesReference) {
  REQUIRE_GPU();
  ModelConfig config = tiny_config(GetParam().moe_layers, GetParam().formulation);
  config.pregated = GetParam().pregated;
  config.num_layers = GetParam().num_layers;
  config.activation = GetParam().activation;
  const int64_t S = config.seq_len, T = kBatch * S;
  const Bf16ModelWeights weights = bf16_init(config, 7);

  ModelGpu model(gpu_config(config, kBatch));
  // The layout is the reference's, entry by entry.
  const std::vector<moe::ParameterInfo> ref_layout = moe::parameter_layout(config);
  ASSERT_EQ(model.layout().size(), ref_layout.size());
  for (size_t i = 0; i < ref_layout.size(); ++i) {
    const moe::cuda::ParameterSpan& got = model.layout()[i];
    const moe::ParameterInfo& want = ref_layout[i];
    ASSERT_EQ(got.name, want.name);
    ASSERT_EQ(got.rows, want.rows) << want.name;
    ASSERT_EQ(got.cols, want.cols) << want.name;
    ASSERT_EQ(got.offset, want.offset) << want.name;
    ASSERT_EQ(got.weight_decay, want.weight_decay) << want.name;
  }
  ASSERT_EQ(model.parameter_count(), moe::parameter_count(config));
  model.upload_weights(weights.flat);

  // Random bytes (all 256 values appear), redrawn while a near tie routes a token differently.
  IndexMatrix inputs, targets;
  moe::ref::ModelForward ref_forward;
  DeviceBuffer<int32_t> tokens(static_cast<size_t>(T)), next_bytes(static_cast<size_t>(T));
  int tries = 0, differences = 0;
  std::mt19937_64 rng(11);
  do {
    std::string text(size_t(kBatch * (S + 1)), '\0');
    for (char& byte : text) byte = static_cast<char>(rng() & 0xFF);
    std::vector<size_t> starts;
    for (int64_t n = 0; n < kBatch; ++n) starts.push_back(size_t(n * (S + 1)));
    windows(text, starts, S, inputs, targets);
    tokens.upload(flat_of(inputs));
    next_bytes.upload(flat_of(targets));
    ref_forward = moe::ref::model_forward(config, weights.values, inputs, targets);
    model.poison_activations();
    model.gradients().fill_bytes(0xFF);
    model.forward(tokens.data(), next_bytes.data());
    CUDA_CHECK(cudaDeviceSynchronize());
    differences = routing_differences(model, ref_forward);
  } while (differences > 0 && ++tries < kBatchTries);
  ASSERT_EQ(differences, 0) << "every one of " << kBatchTries << " batches had a token routed differently";

  // ---- loss ----
  const double loss = model.read_loss();
  const std::vector<float> parts = model.losses().download();  // loss, lm, aux sum, z sum
  const double loss_error = std::abs(loss - ref_forward.loss) / ref_forward.loss;
  EXPECT_LT(loss_error, kLossTolerance) << "GPU " << loss << " reference " << ref_forward.loss;
  EXPECT_LT(std::abs(parts[1] - ref_forward.lm_loss) / ref_forward.lm_loss, kLossTolerance) << "lm loss";
  EXPECT_LT(std::abs(parts[2] - ref_forward.aux_loss) / ref_forward.aux_loss, kLossTolerance) << "aux loss";
  EXPECT_LT(std::abs(parts[3] - ref_forward.z_loss) / ref_forward.z_loss, kLossTolerance) << "z loss";

  // ---- every gradient, tensor by tensor ----
  model.backward();
  const std::vector<float> gpu_gradients = model.download_gradients();
  moe::ref::ModelWeights ref_values = weights.values;
  moe::ref::ModelGradients ref_gradients = moe::ref::model_backward(config, weights.values, inputs, targets, ref_forward);
  const std::vector<moe::ref::Parameter> ref_params = moe::ref::parameters(config, ref_values, ref_gradients);
  double worst = 0.0;
  std::string worst_name;
  for (size_t i = 0; i < ref_params.size(); ++i) {
    const moe::cuda::ParameterSpan& span = model.layout()[i];
    const double error =
        relative_error(matrix_of(gpu_gradients, span.rows, span.cols, size_t(span.offset)), *ref_params[i].gradient);
    EXPECT_LT(error, kGradientTolerance) << span.name;
    if (!(error <= worst)) {  // a NaN becomes the worst
      worst = error;
      worst_name = span.name;
    }
  }
  std::printf("%s %s: tries %d, loss %.5f (ref %.5f, rel %.1e, tol %.0e), worst gradient %s rel %.2e (tol %.0e), "
              "%zu tensors\n",
              loss_error < kLossTolerance && worst < kGradientTolerance ? "PASS" : "FAIL",
              case_name(GetParam()).c_str(), tries + 1, loss, ref_forward.loss, loss_error, kLossTolerance,
              worst_name.c_str(), worst, kGradientTolerance, ref_params.size());

  // ---- one AdamW step, from the GPU's own gradients on both sides ----
  const moe::cuda::OptimizerSettings settings;  // the model's defaults
  const moe::AdamWConfig adamw{settings.beta1, settings.beta2, settings.eps, settings.weight_decay};
  const float lr = 3e-3f;
  std::vector<moe::ref::Parameter> params = moe::ref::parameters(config, ref_values, ref_gradients);
  for (size_t i = 0; i < params.size(); ++i) {
    const moe::cuda::ParameterSpan& span = model.layout()[i];
    *params[i].gradient = matrix_of(gpu_gradients, span.rows, span.cols, size_t(span.offset));
  }
  const double ref_norm = moe::ref::clip_gradient_norm(params, settings.max_grad_norm);
  moe::ref::AdamWState state;
  moe::ref::adamw_step(adamw, lr, params, state);
  model.step(lr);
  const std::vector<float> masters = model.download_weights();
  const std::vector<bf16> copies = model.download_weights_bf16();
  EXPECT_LT(std::abs(model.read_grad_norm() - ref_norm) / ref_norm, kOptimizerTolerance) << "gradient norm";
  double worst_master = 0.0;
  for (size_t i = 0; i < params.size(); ++i) {
    const moe::cuda::ParameterSpan& span = model.layout()[i];
    const Matrix got = matrix_of(masters, span.rows, span.cols, size_t(span.offset));
    const double error = relative_error(got, *params[i].value);
    EXPECT_LT(error, kOptimizerTolerance) << span.name;
    if (!(error <= worst_master)) worst_master = error;
    // The update itself (new - old), looser: it is ~lr, a small difference of fp32 numbers.
    const Matrix before = matrix_of(weights.flat, span.rows, span.cols, size_t(span.offset));
    EXPECT_LT(relative_error(got - before, *params[i].value - before), 1e-2) << span.name << " update";
  }
  int copy_mismatches = 0;
  for (size_t i = 0; i < masters.size(); ++i) {
    copy_mismatches += __bfloat162float(copies[i]) != __bfloat162float(__float2bfloat16(masters[i]));
  }
  EXPECT_EQ(copy_mismatches, 0) << "bf16 copies of the masters";
  std::printf("%s %s adamw: norm %.4f (ref %.4f), worst master rel %.1e (tol %.0e), bf16 copy mismatches %d\n",
              worst_master < kOptimizerTolerance && copy_mismatches == 0 ? "PASS" : "FAIL",
              case_name(GetParam()).c_str(), model.read_grad_norm(), ref_norm, worst_master, kOptimizerTolerance,
              copy_mismatches);
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaModelGpuStep,
                         ::testing::Values(StepCase{MoeLayers::every_block, Formulation::dropless},
                                           StepCase{MoeLayers::every_other_block, Formulation::dropless},
                                           StepCase{MoeLayers::every_block, Formulation::padded},
                                           StepCase{MoeLayers::every_other_block, Formulation::padded},
                                           StepCase{MoeLayers::every_block, Formulation::dropless, true, 3},
                                           StepCase{MoeLayers::every_other_block, Formulation::dropless, true, 4},
                                           StepCase{MoeLayers::every_block, Formulation::padded, true, 2},
                                           StepCase{MoeLayers::every_other_block, Formulation::padded, true, 4},
                                           // SwiGLU experts: each formulation, and pre-gated
                                           StepCase{MoeLayers::every_block, Formulation::dropless, false, 2,
                                                    moe::Activation::swiglu},
                                           StepCase{MoeLayers::every_other_block, Formulation::padded, false, 2,
                                                    moe::Activation::swiglu},
                                           StepCase{MoeLayers::every_block, Formulation::dropping, false, 2,
                                                    moe::Activation::swiglu},
                                           StepCase{MoeLayers::every_block, Formulation::dropless, true, 3,
                                                    moe::Activation::swiglu}),
                         [](const ::testing::TestParamInfo<StepCase>& info) { return case_name(info.param); });

// kBatch windows of S bytes of one repeated sentence, and their next bytes, on the device.
struct RepeatedText {
  DeviceBuffer<int32_t> tokens, next_bytes;
  explicit RepeatedText(int64_t S) {
    std::string text;
    while (text.size() < 400) text += "the quick brown fox jumps over the lazy dog. ";
    IndexMatrix inputs, targets;
    windows(text, {0, 45, 90, 135}, S, inputs, targets);
    tokens = DeviceBuffer<int32_t>(flat_of(inputs));
    next_bytes = DeviceBuffer<int32_t>(flat_of(targets));
  }
};

// A few steps on repeated text: the model learns it, the loss falls.
TEST(CudaModelGpu, LossFallsOnRepeatedText) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_other_block, Formulation::dropless);
  const RepeatedText batch(config.seq_len);
  const DeviceBuffer<int32_t>& tokens = batch.tokens;
  const DeviceBuffer<int32_t>& next_bytes = batch.next_bytes;

  ModelGpu model(gpu_config(config, kBatch));
  model.upload_weights(bf16_init(config, 3).flat);
  std::vector<float> losses;
  for (int step = 0; step < 30; ++step) {
    model.forward(tokens.data(), next_bytes.data());
    losses.push_back(model.read_loss());
    model.backward();
    model.step(1e-2f);
  }
  for (float loss : losses) ASSERT_TRUE(std::isfinite(loss));
  const bool fell = losses.back() < 0.75f * losses.front();
  EXPECT_TRUE(fell) << "first " << losses.front() << " last " << losses.back();
  std::printf("%s loss on repeated text: step 0 %.3f, step 10 %.3f, step 29 %.3f (expected below 0.75 x the first)\n",
              fell ? "PASS" : "FAIL", losses.front(), losses[10], losses.back());
}

// forward_backward_graph (core/captured_graph.h) replays the launched forward and backward: the
// same loss and gradients, bit for bit, step after step with the weights changing between steps
// (the first call runs launched, the second captures, the later ones replay).
TEST(CudaModelGpu, GraphStepEqualsTheLaunchedStep) {
  REQUIRE_GPU();
  const ModelConfig config = tiny_config(MoeLayers::every_other_block, Formulation::dropless);
  const RepeatedText batch(config.seq_len);
  const DeviceBuffer<int32_t>& tokens = batch.tokens;
  const DeviceBuffer<int32_t>& next_bytes = batch.next_bytes;
  cudaStream_t graph_stream = nullptr, launched_stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&graph_stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&launched_stream, cudaStreamNonBlocking));
  int unequal = 0;
  {
    ModelGpu graphed(gpu_config(config, kBatch), {}, graph_stream), launched(gpu_config(config, kBatch), {}, launched_stream);
    const std::vector<float> weights = bf16_init(config, 5).flat;
    graphed.upload_weights(weights);
    launched.upload_weights(weights);
    for (int step = 0; step < 4; ++step) {
      graphed.forward_backward_graph(tokens.data(), next_bytes.data());
      launched.forward(tokens.data(), next_bytes.data());
      launched.backward();
      const float a = graphed.read_loss(), b = launched.read_loss();
      unequal += !(a == b);
      unequal += graphed.download_gradients() != launched.download_gradients();
      graphed.step(1e-2f);
      launched.step(1e-2f);
    }
  }
  CUDA_CHECK(cudaStreamDestroy(graph_stream));
  CUDA_CHECK(cudaStreamDestroy(launched_stream));
  EXPECT_EQ(unequal, 0) << "steps whose loss or gradients differ between the graph and the launched step";
  std::printf("%s training step as one CUDA graph against launched: %d differences in 4 steps\n",
              unequal == 0 ? "PASS" : "FAIL", unequal);
}

// Bad configs are rejected with the field named, before any GPU memory is allocated.
TEST(CudaModelGpu, RejectsBadConfigsBeforeAllocating) {
  REQUIRE_GPU();
  // This process's own allocations, not the device's free memory (other processes, e.g. tests run
  // by ctest -j beside this one, change that).
  const auto expect_rejected = [](ModelConfig config, const std::string& field) {
    const int64_t allocations_before = moe::cuda::device_buffer_allocations();
    try {
      ModelGpu model(gpu_config(config, kBatch));
      ADD_FAILURE() << "accepted a config with a bad " << field;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(field), std::string::npos) << error.what();
      std::printf("rejected, as expected: %s\n", error.what());
    }
    EXPECT_EQ(moe::cuda::device_buffer_allocations(), allocations_before) << field << ": allocated before rejecting";
  };
  ModelConfig dense_pregated = tiny_config(MoeLayers::none, Formulation::dropless);
  dense_pregated.pregated = true;
  expect_rejected(dense_pregated, "pregated");
  ModelConfig swiglu_odd = tiny_config(MoeLayers::every_block, Formulation::padded);
  swiglu_odd.activation = moe::Activation::swiglu;
  swiglu_odd.expert_hidden_dim = 63;  // SwiGLU's pass moves bf16 pairs: H must be even
  expect_rejected(swiglu_odd, "moe.hidden_dim (H) = 63");
  ModelConfig small_blocks = tiny_config(MoeLayers::every_block, Formulation::dropless);
  small_blocks.block_size = 32;
  expect_rejected(small_blocks, "block_size");
  ModelConfig odd_heads = tiny_config(MoeLayers::every_block, Formulation::dropless);
  odd_heads.num_heads = 3;
  expect_rejected(odd_heads, "num_heads");
}

// validate() is host code: these run without a GPU. SwiGLU experts are accepted in every formulation,
// self-gated and pre-gated, as the reference accepts them; on several ranks they are refused (the
// expert-parallel layer's experts are GeLU), with the field named.
TEST(CudaModelGpuConfig, ValidateAcceptsSwiglu) {
  for (Formulation formulation : {Formulation::dropless, Formulation::padded, Formulation::dropping}) {
    for (bool pregated : {false, true}) {
      ModelConfig config = tiny_config(MoeLayers::every_block, formulation);
      config.activation = moe::Activation::swiglu;
      config.pregated = pregated;
      EXPECT_NO_THROW(moe::validate(config));
      const moe::cuda::ModelGpuConfig gpu = gpu_config(config, kBatch);
      EXPECT_NO_THROW(moe::cuda::validate(gpu)) << moe::to_string(formulation) << (pregated ? " pre-gated" : "");
      // Each expert's W1 is [D, 2H] in the flat layout, as the reference's.
      const std::vector<moe::cuda::ParameterSpan> layout = moe::cuda::parameter_layout(gpu);
      const std::vector<moe::ParameterInfo> ref_layout = moe::parameter_layout(config);
      ASSERT_EQ(layout.size(), ref_layout.size());
      for (size_t i = 0; i < layout.size(); ++i) {
        EXPECT_EQ(layout[i].name, ref_layout[i].name);
        EXPECT_EQ(layout[i].cols, ref_layout[i].cols) << layout[i].name;
        EXPECT_EQ(layout[i].offset, ref_layout[i].offset) << layout[i].name;
      }
      const auto w1 = std::find_if(layout.begin(), layout.end(),
                                   [](const moe::cuda::ParameterSpan& s) { return s.name == "blocks.0.moe.w1.0"; });
      ASSERT_NE(w1, layout.end());
      EXPECT_EQ(w1->cols, 2 * config.expert_hidden_dim);
    }
  }
  ModelConfig config = tiny_config(MoeLayers::every_block, Formulation::dropless);
  config.activation = moe::Activation::swiglu;
  moe::cuda::ModelGpuConfig two_ranks = gpu_config(config, kBatch);
  two_ranks.ranks = 2;
  two_ranks.moe.tokens *= 2;  // all ranks' tokens
  try {
    moe::cuda::validate(two_ranks);
    ADD_FAILURE() << "accepted SwiGLU on two ranks";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("moe.activation = swiglu on 2 ranks"), std::string::npos) << error.what();
  }
}

// validate() is host code: these run without a GPU. Pre-gating is accepted wherever there are MoE
// blocks, as the reference accepts it, and refused for a dense model, as the reference refuses it.
TEST(CudaModelGpuConfig, ValidateAcceptsPregatedWithMoeBlocks) {
  for (MoeLayers moe_layers : {MoeLayers::every_block, MoeLayers::every_other_block}) {
    for (Formulation formulation : {Formulation::dropless, Formulation::padded}) {
      ModelConfig config = tiny_config(moe_layers, formulation);
      config.pregated = true;
      EXPECT_NO_THROW(moe::validate(config));
      EXPECT_NO_THROW(moe::cuda::validate(gpu_config(config, kBatch)))
          << moe::to_string(moe_layers) << " " << moe::to_string(formulation);
    }
  }
}

TEST(CudaModelGpuConfig, ValidateRejectsPregatedDenseModel) {
  const auto expect_rejected = [](const ModelConfig& config, const std::string& field) {
    EXPECT_THROW(moe::validate(config), std::invalid_argument) << field << " (the reference)";
    try {
      moe::cuda::validate(gpu_config(config, kBatch));
      ADD_FAILURE() << "accepted a config with a bad " << field;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(field), std::string::npos) << error.what();
      std::printf("rejected, as expected: %s\n", error.what());
    }
  };
  ModelConfig dense_pregated = tiny_config(MoeLayers::none, Formulation::dropless);
  dense_pregated.pregated = true;
  expect_rejected(dense_pregated, "pregated");
  ModelConfig odd_heads = tiny_config(MoeLayers::every_block, Formulation::dropless);
  odd_heads.pregated = true;
  odd_heads.num_heads = 3;
  expect_rejected(odd_heads, "num_heads");
}

}  // namespace
