// test_model.cpp: the CPU reference model (reference_cpu/model.h): finite-difference checks of the
// gradient of every parameter tensor (MoE in every block and every other block, dropless, dropping
// and padded, top-1 and top-2, pre-gated on and off), causality, the loss of a fresh model, the
// pre-gated routing, the flat parameter list, AdamW, clipping, the schedule and bad configs.
// Run: cmake --build build --target test_reference_cpu_model && ctest --test-dir build -R ReferenceModel
#include <gmock/gmock.h>  // HasSubstr
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numbers>
#include <set>
#include <tuple>

#include "init.h"
#include "model.h"
#include "optimizer.h"
#include "test_support.h"

namespace moe::ref {
namespace {

using ::testing::HasSubstr;
using testing::invalid_argument_message;
using testing::random_bytes;
using testing::random_test_weights;

// ---- tiny models ----

// D=8, heads=2, S=6, N=2 (T=12), E=4, H=8, B=4: every path of the model at a size where a central
// difference of every sampled entry costs two forwards of well under a millisecond.
ModelConfig tiny_config(MoeLayers moe_layers, Formulation formulation, int64_t top_k, bool pregated) {
  ModelConfig config;
  config.model_dim = 8;
  // Every other block with pre-gating needs two MoE blocks (1 and 3) to move a gate between.
  config.num_layers = moe_layers == MoeLayers::every_other_block ? 4 : 2;
  config.num_heads = 2;
  config.seq_len = 6;
  config.moe_layers = moe_layers;
  config.dense_hidden_dim = 8;
  config.num_experts = 4;
  config.top_k = top_k;
  config.expert_hidden_dim = 8;
  config.formulation = formulation;
  config.capacity_factor = 0.5;  // C = ceil(0.5 * 12 * K / 4) = 2 (K=1) or 3 (K=2): dropping drops
  config.block_size = 4;
  config.renormalize = top_k > 1;
  config.aux_loss_coef = 0.1;  // large enough that a wrong aux or z gradient shows
  config.z_loss_coef = 0.05;
  config.pregated = pregated;
  return config;
}

constexpr int64_t kBatch = 2;

// Every MoE block's top-K choice, to notice a finite difference that crossed a routing boundary.
std::vector<IndexMatrix> routing_of(const ModelForward& forward) {
  std::vector<IndexMatrix> routing;
  for (const BlockForward& block : forward.blocks) {
    if (block.moe) routing.push_back(block.moe->router.top_experts);
  }
  return routing;
}

int64_t dropped_slots(const ModelForward& forward) {
  int64_t dropped = 0;
  for (const BlockForward& block : forward.blocks) {
    if (block.moe) dropped += block.moe->plan.dropped_slots;
  }
  return dropped;
}

// ---- finite differences ----

// The entries checked in one tensor: all of a small one (<= 64 entries), else 32 spread at random.
std::vector<Eigen::Index> sample_entries(Eigen::Index size, std::mt19937_64& generator) {
  std::vector<Eigen::Index> entries;
  if (size <= 64) {
    for (Eigen::Index i = 0; i < size; ++i) entries.push_back(i);
    return entries;
  }
  std::set<Eigen::Index> chosen;
  while (chosen.size() < 32) chosen.insert(static_cast<Eigen::Index>(generator() % static_cast<uint64_t>(size)));
  return {chosen.begin(), chosen.end()};
}

struct GradientReport {
  int64_t checked = 0;
  int64_t skipped = 0;  // entries whose +-h changed a top-K choice (the loss has a step there)
};

// Compares model_backward with central differences of forward.loss on sampled entries of every
// parameter tensor; the error of a tensor is max |analytic - numeric| / max(|analytic|, |numeric|).
GradientReport expect_model_gradients(const ModelConfig& config, ModelWeights weights, const IndexMatrix& inputs,
                                      const IndexMatrix& targets, uint64_t seed) {
  const double h = 1e-5;
  const ModelForward base = model_forward(config, weights, inputs, targets);
  ModelGradients analytic = model_backward(config, weights, inputs, targets, base);
  const std::vector<IndexMatrix> base_routing = routing_of(base);

  GradientReport report;
  std::mt19937_64 generator(seed);
  for (Parameter& p : parameters(config, weights, analytic)) {
    double max_error = 0.0, scale = 0.0;
    for (const Eigen::Index entry : sample_entries(p.value->size(), generator)) {
      double& value = p.value->data()[entry];
      const double saved = value;
      value = saved + h;
      const ModelForward plus = model_forward(config, weights, inputs, targets);
      value = saved - h;
      const ModelForward minus = model_forward(config, weights, inputs, targets);
      value = saved;
      if (routing_of(plus) != base_routing || routing_of(minus) != base_routing) {
        ++report.skipped;
        continue;
      }
      const double numeric = (plus.loss - minus.loss) / (2 * h);
      const double exact = p.gradient->data()[entry];
      max_error = std::max(max_error, std::abs(exact - numeric));
      scale = std::max({scale, std::abs(exact), std::abs(numeric)});
      ++report.checked;
    }
    if (scale < 1e-9) {
      EXPECT_LT(max_error, 1e-9) << p.name << " should have a zero gradient";
    } else {
      EXPECT_LT(max_error / scale, 1e-6) << p.name << ": max_abs_err=" << max_error << " scale=" << scale;
    }
  }
  return report;
}

// ---- gradients: every parameter tensor, every variant ----

using GradientCase = std::tuple<MoeLayers, Formulation, int64_t, bool>;
class ReferenceModelGradient : public ::testing::TestWithParam<GradientCase> {};

TEST_P(ReferenceModelGradient, EveryParameterMatchesCentralDifferences) {
  const auto [moe_layers, formulation, top_k, pregated] = GetParam();
  const ModelConfig config = tiny_config(moe_layers, formulation, top_k, pregated);
  const uint64_t seed = 7000 + 1000 * static_cast<uint64_t>(moe_layers) + 100 * static_cast<uint64_t>(formulation) +
                        10 * static_cast<uint64_t>(top_k) + (pregated ? 1 : 0);
  const IndexMatrix inputs = random_bytes(kBatch, config.seq_len, seed);
  const IndexMatrix targets = random_bytes(kBatch, config.seq_len, seed + 1);
  const ModelWeights weights = random_test_weights(config, seed + 2);

  const ModelForward forward = model_forward(config, weights, inputs, targets);
  if (formulation != Formulation::dropless) {
    EXPECT_GT(dropped_slots(forward), 0) << "the capacity should really drop tokens";
  }
  EXPECT_GT(forward.aux_loss, 0.0);
  EXPECT_GT(forward.z_loss, 0.0);

  const GradientReport report = expect_model_gradients(config, weights, inputs, targets, seed + 3);
  EXPECT_GT(report.checked, 300);
  EXPECT_LE(report.skipped * 50, report.checked) << "too many finite differences crossed a routing boundary";
}

INSTANTIATE_TEST_SUITE_P(
    AllVariants, ReferenceModelGradient,
    ::testing::Combine(::testing::Values(MoeLayers::every_block, MoeLayers::every_other_block),
                       ::testing::Values(Formulation::dropless, Formulation::dropping, Formulation::padded),
                       ::testing::Values(int64_t{1}, int64_t{2}), ::testing::Bool()),
    [](const auto& info) {
      return std::string(to_string(std::get<0>(info.param))) + "_" + std::string(to_string(std::get<1>(info.param))) +
             "_top" + std::to_string(std::get<2>(info.param)) + (std::get<3>(info.param) ? "_pregated" : "_selfgated");
    });

TEST(ReferenceModelGradients, DenseModelMatchesCentralDifferences) {
  ModelConfig config = tiny_config(MoeLayers::none, Formulation::dropless, 1, false);
  const IndexMatrix inputs = random_bytes(kBatch, config.seq_len, 31);
  const IndexMatrix targets = random_bytes(kBatch, config.seq_len, 32);
  const GradientReport report =
      expect_model_gradients(config, random_test_weights(config, 33), inputs, targets, 34);
  EXPECT_EQ(report.skipped, 0);
}

// ---- forward properties ----

// Changing the bytes after position t of sequence 0 leaves its logits at positions <= t unchanged.
TEST(ReferenceModelForward, IsCausal) {
  for (Formulation formulation : {Formulation::dropless, Formulation::dropping}) {
    const ModelConfig config = tiny_config(MoeLayers::every_block, formulation, 2, true);
    const ModelWeights weights = random_test_weights(config, 41);
    const IndexMatrix inputs = random_bytes(kBatch, config.seq_len, 42);
    const IndexMatrix targets = random_bytes(kBatch, config.seq_len, 43);
    const ModelForward base = model_forward(config, weights, inputs, targets);
    for (int64_t t = 0; t + 1 < config.seq_len; ++t) {
      IndexMatrix changed = inputs;
      for (int64_t s = t + 1; s < config.seq_len; ++s) changed(0, s) = (changed(0, s) + 1 + s) % kByteVocabulary;
      const ModelForward after = model_forward(config, weights, changed, targets);
      const double scale = base.logits.cwiseAbs().maxCoeff();
      EXPECT_LT((after.logits.topRows(t + 1) - base.logits.topRows(t + 1)).cwiseAbs().maxCoeff(), 1e-12 * scale)
          << to_string(formulation) << ": positions <= " << t << " saw a later byte";
      EXPECT_GT((after.logits.row(t + 1) - base.logits.row(t + 1)).cwiseAbs().maxCoeff(), 1e-6)
          << "position " << t + 1 << " should see its own byte";
      if (formulation == Formulation::dropless) {
        // Dropless tokens never compete, so the other sequence is untouched too. With dropping, the
        // changed bytes of sequence 0 may take capacity from sequence 1, which comes later in token
        // order: token dropping couples the sequences of a batch.
        EXPECT_LT((after.logits.bottomRows(config.seq_len) - base.logits.bottomRows(config.seq_len))
                      .cwiseAbs()
                      .maxCoeff(),
                  1e-12 * scale);
      }
    }
  }
}

TEST(ReferenceModelForward, FreshModelPredictsUniformBytes) {
  ModelConfig config;  // the defaults: D=64, L=2, 4 heads, S=64, E=4, top-1 dropless
  config.moe_layers = MoeLayers::every_block;
  const ModelWeights weights = init_model(config, 2024);
  const IndexMatrix inputs = random_bytes(4, config.seq_len, 51);
  const IndexMatrix targets = random_bytes(4, config.seq_len, 52);
  const ModelForward forward = model_forward(config, weights, inputs, targets);
  EXPECT_NEAR(forward.lm_loss, std::log(256.0), 0.05);
  // Near-uniform routing: aux = E sum_e f_e P_e ~ 1 per MoE layer.
  EXPECT_NEAR(forward.aux_loss, 2.0, 0.05);
  EXPECT_NEAR(forward.loss,
              forward.lm_loss + config.aux_loss_coef * forward.aux_loss + config.z_loss_coef * forward.z_loss, 1e-15);
}

TEST(ReferenceModelForward, InitIsReproducible) {
  const ModelConfig config = tiny_config(MoeLayers::every_other_block, Formulation::dropless, 2, true);
  ModelWeights a = init_model(config, 5), b = init_model(config, 5), c = init_model(config, 6);
  ModelGradients unused = zero_weights(config);
  const std::vector<Parameter> pa = parameters(config, a, unused), pb = parameters(config, b, unused),
                               pc = parameters(config, c, unused);
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(*pa[i].value, *pb[i].value) << pa[i].name;
    if (pa[i].weight_decay) {
      EXPECT_NE(*pa[i].value, *pc[i].value) << pa[i].name;
    }
  }
}

// Block j's gate reads the LN2 output of the previous MoE block, and that routing is what block j uses.
TEST(ReferenceModelForward, PreGatedRoutingReadsThePreviousMoeInput) {
  for (MoeLayers moe_layers : {MoeLayers::every_block, MoeLayers::every_other_block}) {
    ModelConfig config = tiny_config(moe_layers, Formulation::dropless, 2, true);
    const ModelWeights weights = random_test_weights(config, 61);
    const IndexMatrix inputs = random_bytes(kBatch, config.seq_len, 62);
    const ModelForward pregated = model_forward(config, weights, inputs, inputs);
    const MoeConfig layer = moe_layer_config(config, kBatch);
    const std::vector<int64_t> moe = moe_blocks(config);
    ASSERT_GE(moe.size(), 2u);
    for (size_t j = 0; j < moe.size(); ++j) {
      const BlockForward& block = pregated.blocks[moe[j]];
      const Matrix& gate = weights.blocks[moe[j]].moe.gate_weights;
      const Matrix& router_input = j == 0 ? block.ln2.y : pregated.blocks[moe[j - 1]].ln2.y;
      EXPECT_EQ(block.moe->router.logits, route(layer, router_input, gate).logits) << "MoE block " << moe[j];
      EXPECT_EQ(block.next_routing.has_value(), j + 1 < moe.size());
    }
    // Off: every block routes its own input.
    config.pregated = false;
    const ModelForward self_gated = model_forward(config, weights, inputs, inputs);
    for (int64_t i : moe) {
      const BlockForward& block = self_gated.blocks[i];
      EXPECT_EQ(block.moe->router.logits, route(layer, block.ln2.y, weights.blocks[i].moe.gate_weights).logits);
      EXPECT_FALSE(block.next_routing.has_value());
    }
  }
}

// ---- the flat parameter list ----

TEST(ReferenceModelParameters, LayoutIsOneFixedOrderWithContiguousOffsets) {
  const ModelConfig config = tiny_config(MoeLayers::every_other_block, Formulation::dropless, 2, false);
  const std::vector<ParameterInfo> layout = parameter_layout(config);
  std::set<std::string> names;
  int64_t offset = 0;
  for (const ParameterInfo& info : layout) {
    EXPECT_TRUE(names.insert(info.name).second) << "duplicate " << info.name;
    EXPECT_EQ(info.offset, offset) << info.name;
    offset += info.rows * info.cols;
    const bool layer_norm = info.name.ends_with("gain") || info.name.ends_with("bias");
    EXPECT_EQ(info.weight_decay, !layer_norm) << info.name;
  }
  EXPECT_EQ(parameter_count(config), offset);
  EXPECT_EQ(layout.front().name, "token_embedding");
  EXPECT_EQ(layout.back().name, "final_ln.bias");
  EXPECT_TRUE(names.contains("blocks.0.ffn.w1"));      // block 0 dense
  EXPECT_TRUE(names.contains("blocks.1.moe.w2.3"));    // block 1 MoE, E = 4
  EXPECT_FALSE(names.contains("blocks.0.moe.gate"));
  // 256*8 + 6*8 + 2 dense blocks (4*8 + 8*24 + 8*8 + 8*8 + 8*8) + 2 MoE blocks
  // (4*8 + 8*24 + 8*8 + 8*4 + 4*8*8 + 4*8*8) + 2*8
  EXPECT_EQ(offset, 256 * 8 + 6 * 8 + 2 * (32 + 192 + 64 + 128) + 2 * (32 + 192 + 64 + 32 + 512) + 16);

  ModelWeights values = init_model(config, 1);
  ModelGradients gradients = zero_weights(config);
  const std::vector<Parameter> list = parameters(config, values, gradients);
  ASSERT_EQ(list.size(), layout.size());
  for (size_t i = 0; i < list.size(); ++i) {
    EXPECT_EQ(list[i].name, layout[i].name);
    EXPECT_EQ(list[i].value->rows(), layout[i].rows);
    EXPECT_EQ(list[i].gradient->cols(), layout[i].cols);
  }
  EXPECT_EQ(list[0].value, &values.token_embedding);
  // A dense block has no MoE tensors and an MoE block no dense FFN: nothing outside the list.
  EXPECT_TRUE(gradients.blocks[0].moe.w1.empty());
  EXPECT_EQ(gradients.blocks[0].moe.gate_weights.size(), 0);
  EXPECT_EQ(gradients.blocks[1].ffn_w1.size(), 0);
  EXPECT_EQ(list[0].gradient, &gradients.token_embedding);
}

// ---- optimizer ----

TEST(ReferenceModelOptimizer, AdamWMatchesAHandComputedUpdate) {
  Matrix decayed(1, 2), plain(1, 1), decayed_grad(1, 2), plain_grad(1, 1);
  decayed << 0.5, -1.0;
  plain << 0.5;
  std::vector<Parameter> params = {{"matrix", true, &decayed, &decayed_grad}, {"gain", false, &plain, &plain_grad}};
  const AdamWConfig adam;  // beta1 0.9, beta2 0.95, eps 1e-8, weight decay 0.1
  AdamWState state;
  const double lr = 0.01;

  // Step 1: m = 0.1 g, v = 0.05 g^2, so m_hat = g and v_hat = g^2: the step is lr * g / (|g| + eps).
  decayed_grad << 0.2, -0.4;
  plain_grad << 0.2;
  adamw_step(adam, lr, params, state);
  EXPECT_NEAR(decayed(0, 0), 0.5 * (1 - 0.01 * 0.1) - 0.01 * 0.2 / (0.2 + 1e-8), 1e-15);
  EXPECT_NEAR(decayed(0, 1), -1.0 * (1 - 0.01 * 0.1) + 0.01 * 0.4 / (0.4 + 1e-8), 1e-15);
  EXPECT_NEAR(plain(0, 0), 0.5 - 0.01 * 0.2 / (0.2 + 1e-8), 1e-15);  // no decay on a LayerNorm gain

  // Step 2 with g = -0.1 on the gain: m = 0.9 * 0.02 - 0.01 = 0.008, v = 0.95 * 0.002 + 0.05 * 0.01 = 0.0024,
  // m_hat = 0.008 / (1 - 0.9^2), v_hat = 0.0024 / (1 - 0.95^2).
  const double before = plain(0, 0);
  plain_grad << -0.1;
  decayed_grad << 0.0, 0.0;
  adamw_step(adam, lr, params, state);
  EXPECT_EQ(state.step, 2);
  EXPECT_NEAR(plain(0, 0), before - 0.01 * (0.008 / 0.19) / (std::sqrt(0.0024 / 0.0975) + 1e-8), 1e-15);
}

TEST(ReferenceModelOptimizer, ClippingScalesToTheGlobalNorm) {
  Matrix a(1, 1), b(1, 1), ga(1, 1), gb(1, 1);
  ga << 3.0;
  gb << 4.0;
  std::vector<Parameter> params = {{"a", true, &a, &ga}, {"b", false, &b, &gb}};
  EXPECT_DOUBLE_EQ(clip_gradient_norm(params, 10.0), 5.0);  // under the limit: untouched
  EXPECT_DOUBLE_EQ(ga(0, 0), 3.0);
  EXPECT_DOUBLE_EQ(clip_gradient_norm(params, 1.0), 5.0);
  EXPECT_DOUBLE_EQ(ga(0, 0), 0.6);
  EXPECT_DOUBLE_EQ(gb(0, 0), 0.8);
}

TEST(ReferenceModelOptimizer, WarmupThenCosineSchedule) {
  const ScheduleConfig schedule{.peak_lr = 1e-3, .warmup_steps = 10, .total_steps = 110, .min_lr_ratio = 0.1};
  EXPECT_DOUBLE_EQ(learning_rate(schedule, 0), 1e-4);      // (0 + 1) / 10 of the peak
  EXPECT_DOUBLE_EQ(learning_rate(schedule, 4), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(schedule, 9), 1e-3);      // warm-up ends at the peak
  EXPECT_DOUBLE_EQ(learning_rate(schedule, 10), 1e-3);     // cosine starts at the peak
  EXPECT_NEAR(learning_rate(schedule, 60), 1e-4 + 0.9e-3 * 0.5, 1e-18);  // half way: the midpoint
  EXPECT_NEAR(learning_rate(schedule, 35), 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-18);
  EXPECT_NEAR(learning_rate(schedule, 110), 1e-4, 1e-18);  // the end, and past it: min_lr
  EXPECT_NEAR(learning_rate(schedule, 500), 1e-4, 1e-18);
  EXPECT_THAT(invalid_argument_message([&] { learning_rate({.warmup_steps = 10, .total_steps = 10}, 0); }),
              HasSubstr("total_steps = 10; allowed: total_steps > warmup_steps = 10"));
  EXPECT_THAT(invalid_argument_message([&] { learning_rate({.peak_lr = -1.0}, 0); }), HasSubstr("peak_lr"));
}

// A few AdamW steps on one batch lower the loss: forward, backward, clipping and the optimizer fit.
TEST(ReferenceModelOptimizer, TrainingStepsLowerTheLoss) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, Formulation::dropless, 2, true);
  ModelWeights weights = init_model(config, 71);
  const IndexMatrix inputs = random_bytes(kBatch, config.seq_len, 72);
  const IndexMatrix targets = random_bytes(kBatch, config.seq_len, 73);
  const ScheduleConfig schedule{.peak_lr = 1e-2, .warmup_steps = 5, .total_steps = 30, .min_lr_ratio = 0.1};
  AdamWState state;
  double first = 0.0, last = 0.0;
  for (int64_t step = 0; step < schedule.total_steps; ++step) {
    const ModelForward forward = model_forward(config, weights, inputs, targets);
    ModelGradients gradients = model_backward(config, weights, inputs, targets, forward);
    std::vector<Parameter> params = parameters(config, weights, gradients);
    clip_gradient_norm(params, 1.0);
    adamw_step(AdamWConfig{}, learning_rate(schedule, step), params, state);
    if (step == 0) first = forward.lm_loss;
    last = forward.lm_loss;
  }
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

// ---- bad configs and inputs ----

std::string config_error(const std::function<void(ModelConfig&)>& change) {
  ModelConfig config = tiny_config(MoeLayers::every_block, Formulation::dropless, 1, false);
  change(config);
  return invalid_argument_message([&] { validate(config); });
}

TEST(ReferenceModelConfig, BadConfigsNameTheFieldAndWhatIsAllowed) {
  EXPECT_EQ(config_error([](ModelConfig&) {}), "");
  EXPECT_THAT(config_error([](ModelConfig& c) { c.num_heads = 3; }),
              HasSubstr("num_heads = 3; allowed: a divisor of model_dim D = 8"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.model_dim = 0; }), HasSubstr("model_dim (D) = 0"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.num_layers = 0; }), HasSubstr("num_layers (L) = 0"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.seq_len = 0; }), HasSubstr("seq_len (S) = 0"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.layer_norm_eps = 0.0; }), HasSubstr("layer_norm_eps"));
  EXPECT_THAT(config_error([](ModelConfig& c) {
                c.moe_layers = MoeLayers::every_other_block;
                c.num_layers = 1;
              }),
              HasSubstr("L >= 2"));
  EXPECT_THAT(config_error([](ModelConfig& c) {
                c.moe_layers = MoeLayers::every_other_block;
                c.dense_hidden_dim = 0;
              }),
              HasSubstr("dense_hidden_dim (H_dense) = 0"));
  EXPECT_THAT(config_error([](ModelConfig& c) {
                c.moe_layers = MoeLayers::none;
                c.pregated = true;
              }),
              HasSubstr("pregated"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.top_k = 5; }),
              HasSubstr("MoE layer: invalid MoE config: top_k (K) = 5; allowed: 1 <= K <= E (E = 4)"));
  EXPECT_THAT(config_error([](ModelConfig& c) { c.block_size = 3; }), HasSubstr("multiple of block_size B = 3"));
  // A dense model ignores the MoE fields.
  EXPECT_EQ(config_error([](ModelConfig& c) {
              c.moe_layers = MoeLayers::none;
              c.top_k = 99;
            }),
            "");
  EXPECT_EQ(parse_moe_layers("every_other_block"), MoeLayers::every_other_block);
  EXPECT_THAT(invalid_argument_message([] { parse_moe_layers("alternate"); }),
              HasSubstr("allowed: every_block, every_other_block, none"));
}

TEST(ReferenceModelConfig, BadInputsAndWeightsAreNamed) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, Formulation::dropless, 1, false);
  const ModelWeights weights = init_model(config, 81);
  IndexMatrix inputs = random_bytes(kBatch, config.seq_len, 82);
  const IndexMatrix targets = random_bytes(kBatch, config.seq_len, 83);
  inputs(1, 2) = 256;
  EXPECT_THAT(invalid_argument_message([&] { model_forward(config, weights, inputs, targets); }),
              HasSubstr("inputs[1, 2] = 256; expected a byte"));
  const IndexMatrix short_inputs = random_bytes(kBatch, config.seq_len - 1, 84);
  EXPECT_THAT(invalid_argument_message([&] { model_forward(config, weights, short_inputs, targets); }),
              HasSubstr("inputs has shape [2, 5]; expected [N, S] with N >= 1, S = 6"));
  ModelWeights broken = weights;
  broken.blocks[1].moe.w2[2](0, 0) = std::nan("");
  EXPECT_THAT(invalid_argument_message([&] { model_forward(config, broken, targets, targets); }),
              HasSubstr("blocks.1.moe.w2.2[0, 0] = nan"));
  broken = weights;
  broken.blocks[0].qkv_weights.resize(8, 8);
  EXPECT_THAT(invalid_argument_message([&] { model_forward(config, broken, targets, targets); }),
              HasSubstr("blocks.0.attention.qkv has shape [8, 8]"));
}

}  // namespace
}  // namespace moe::ref
