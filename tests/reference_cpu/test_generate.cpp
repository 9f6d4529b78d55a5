// test_generate.cpp: incremental decoding of the CPU reference model (reference_cpu/generate.h,
// kv_cache.h, sampling.h): decoding byte by byte with a KV cache gives the full-sequence forward's
// logits and routing (self-gated and pre-gated, MoE in every block and every other block, top-1 and
// top-2, a batch of prompts of different lengths), the experts each block reports, the sampling
// rules (greedy, temperature, top-k, seeds) and the errors.
// Run: cmake --build build --target test_reference_cpu_generate && ctest --test-dir build -R ReferenceGenerate
#include <gmock/gmock.h>  // HasSubstr
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "generate.h"
#include "init.h"
#include "model.h"
#include "sampling.h"
#include "test_support.h"

namespace moe::ref {
namespace {

using ::testing::HasSubstr;
using testing::invalid_argument_message;
using testing::random_bytes;
using testing::random_test_weights;
using testing::relative_error;

// ---- tiny models ----

// D=8, heads=2, S=10, E=4, H=8, B=4, dropless: small enough for many steps, long enough for a prompt
// and several decoded bytes.
ModelConfig tiny_config(MoeLayers moe_layers, int64_t top_k, bool pregated) {
  ModelConfig config;
  config.model_dim = 8;
  // Every other block with pre-gating needs two MoE blocks (1 and 3) to move a gate between.
  config.num_layers = moe_layers == MoeLayers::every_other_block ? 4 : 2;
  config.num_heads = 2;
  config.seq_len = 10;
  config.moe_layers = moe_layers;
  config.dense_hidden_dim = 8;
  config.num_experts = 4;
  config.top_k = top_k;
  config.expert_hidden_dim = 8;
  config.formulation = Formulation::dropless;
  config.block_size = 4;
  config.renormalize = top_k > 1;
  config.pregated = pregated;
  return config;
}

std::vector<int32_t> row_bytes(const IndexMatrix& bytes, int64_t n, int64_t begin, int64_t end) {
  std::vector<int32_t> out;
  for (int64_t s = begin; s < end; ++s) out.push_back(bytes(n, s));
  return out;
}

// ---- decoding equals the full-sequence forward ----

using Case = std::tuple<MoeLayers, int64_t /*top_k*/, bool /*pregated*/>;

class ReferenceGenerateOracle : public ::testing::TestWithParam<Case> {};

// Three sequences with prompts of 3, 1 and 5 bytes, then one byte per sequence per step until the
// longest reaches S: every logit row and every block's routing of every computed position equals the
// full forward's on the same bytes.
TEST_P(ReferenceGenerateOracle, DecodingByteByByteMatchesTheFullForward) {
  const auto [moe_layers, top_k, pregated] = GetParam();
  const ModelConfig config = tiny_config(moe_layers, top_k, pregated);
  const ModelWeights weights = random_test_weights(config, 11);
  const int64_t N = 3, S = config.seq_len;
  const IndexMatrix bytes = random_bytes(N, S, 12);
  const ModelForward full = model_forward(config, weights, bytes, bytes);  // targets unused here

  const std::vector<int64_t> prompt_lengths = {3, 1, 5};
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n = 0; n < N; ++n) prompts.push_back(row_bytes(bytes, n, 0, prompt_lengths[n]));
  KvCache cache = make_kv_cache(config, N);
  std::vector<StepOutput> steps = {prefill(config, weights, prompts, cache)};
  for (int64_t step = 0; step < S - 5; ++step) {
    std::vector<int32_t> next;
    for (int64_t n = 0; n < N; ++n) next.push_back(bytes(n, cache.lengths[n]));
    steps.push_back(decode_step(config, weights, next, cache));
  }
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{S - 2, S - 4, S}));

  const std::vector<int64_t> moe = moe_blocks(config);
  int64_t compared = 0;
  for (const StepOutput& step : steps) {
    ASSERT_EQ(step.moe.size(), moe.size());
    for (int64_t t = 0; t < static_cast<int64_t>(step.sequence.size()); ++t) {
      const int64_t row = step.sequence[t] * S + step.position[t];  // the full forward's token
      EXPECT_LT(relative_error(step.logits.row(t), full.logits.row(row)), 1e-10)
          << "sequence " << step.sequence[t] << " position " << step.position[t];
      for (size_t j = 0; j < moe.size(); ++j) {
        const RouterOutput& router = full.blocks[moe[j]].moe->router;
        EXPECT_EQ(step.moe[j].top_experts.row(t), router.top_experts.row(row)) << "block " << moe[j];
        EXPECT_LT(relative_error(step.moe[j].combine_weights.row(t), router.combine_weights.row(row)), 1e-10);
      }
      ++compared;
    }
  }
  EXPECT_EQ(compared, 3 + 1 + 5 + 3 * (S - 5));
}

// The whole sequence as one prompt: the prefill alone is the full forward.
TEST_P(ReferenceGenerateOracle, PrefillOfWholeSequencesMatchesTheFullForward) {
  const auto [moe_layers, top_k, pregated] = GetParam();
  const ModelConfig config = tiny_config(moe_layers, top_k, pregated);
  const ModelWeights weights = random_test_weights(config, 21);
  const int64_t N = 2, S = config.seq_len;
  const IndexMatrix bytes = random_bytes(N, S, 22);
  const ModelForward full = model_forward(config, weights, bytes, bytes);
  KvCache cache = make_kv_cache(config, N);
  const StepOutput step = prefill(config, weights, {row_bytes(bytes, 0, 0, S), row_bytes(bytes, 1, 0, S)}, cache);
  EXPECT_LT(relative_error(step.logits, full.logits), 1e-10);
  EXPECT_LT(relative_error(step.next_logits.row(1), full.logits.row(2 * S - 1)), 1e-10);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [moe_layers, top_k, pregated] = info.param;
  return std::string(to_string(moe_layers)) + "_top" + std::to_string(top_k) + (pregated ? "_pregated" : "_self_gated");
}

INSTANTIATE_TEST_SUITE_P(Models, ReferenceGenerateOracle,
                         ::testing::Combine(::testing::Values(MoeLayers::every_block, MoeLayers::every_other_block),
                                            ::testing::Values(int64_t{1}, int64_t{2}), ::testing::Bool()),
                         case_name);

TEST(ReferenceGenerate, DenseModelMatchesTheFullForward) {
  ModelConfig config = tiny_config(MoeLayers::none, 1, false);
  const ModelWeights weights = random_test_weights(config, 31);
  const IndexMatrix bytes = random_bytes(1, config.seq_len, 32);
  const ModelForward full = model_forward(config, weights, bytes, bytes);
  KvCache cache = make_kv_cache(config, 1);
  StepOutput step = prefill(config, weights, {{bytes(0, 0)}}, cache);
  EXPECT_TRUE(step.moe.empty());
  for (int64_t s = 1; s < config.seq_len; ++s) {
    step = decode_step(config, weights, {bytes(0, s)}, cache);
    EXPECT_LT(relative_error(step.next_logits, full.logits.row(s)), 1e-10) << "position " << s;
  }
}

// ---- which experts each block needs, and when it is known ----

TEST(ReferenceGenerate, PreGatedBlocksAreKnownOneMoeBlockEarly) {
  const ModelConfig pregated = tiny_config(MoeLayers::every_other_block, 2, true);  // MoE blocks 1, 3
  EXPECT_EQ(gate_input_block(pregated, 1), 1);  // the first MoE block routes itself
  EXPECT_EQ(gate_input_block(pregated, 3), 1);
  const ModelConfig self_gated = tiny_config(MoeLayers::every_other_block, 2, false);
  EXPECT_EQ(gate_input_block(self_gated, 3), 3);
  EXPECT_THAT(invalid_argument_message([&] { gate_input_block(pregated, 2); }), HasSubstr("block 2 has no MoE layer"));

  const ModelWeights weights = random_test_weights(pregated, 41);
  KvCache cache = make_kv_cache(pregated, 2);
  const StepOutput step = prefill(pregated, weights, {{1, 2, 3}, {4, 5}}, cache);
  ASSERT_EQ(step.moe.size(), 2u);
  EXPECT_EQ(step.moe[0].block, 1);
  EXPECT_EQ(step.moe[0].known_in_block, 1);
  EXPECT_EQ(step.moe[1].block, 3);
  EXPECT_EQ(step.moe[1].known_in_block, 1);
  for (const MoeBlockRouting& routing : step.moe) {
    EXPECT_EQ(routing.top_experts.rows(), 5);
    EXPECT_EQ(routing.top_experts.cols(), 2);
    const std::set<int32_t> chosen(routing.top_experts.data(), routing.top_experts.data() + routing.top_experts.size());
    EXPECT_EQ(routing.experts, IndexVector(chosen.begin(), chosen.end()));
  }
  EXPECT_EQ(step.sequence, (std::vector<int64_t>{0, 0, 0, 1, 1}));
  EXPECT_EQ(step.position, (std::vector<int64_t>{0, 1, 2, 0, 1}));
}

// Dropless routing makes a sequence's logits independent of the rest of the batch.
TEST(ReferenceGenerate, ASequenceDecodesTheSameAloneOrInABatch) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, 2, true);
  const ModelWeights weights = random_test_weights(config, 51);
  const SamplingSettings sampling{.temperature = 0.8, .top_k = 20, .seed = 7};
  const Generation batch = generate(config, weights, {{10, 20, 30}, {40}, {50, 60}}, 5, sampling);
  const Generation alone = generate(config, weights, {{10, 20, 30}}, 5, sampling);
  EXPECT_EQ(batch.bytes[0], alone.bytes[0]);
  for (size_t step = 0; step < alone.steps.size(); ++step) {
    EXPECT_LT(relative_error(batch.steps[step].next_logits.row(0), alone.steps[step].next_logits), 1e-12);
  }
}

// ---- sampling ----

TEST(ReferenceGenerateSampling, GreedyTakesTheLargestLogitTiesToTheLowerByte) {
  Eigen::RowVectorXd logits = Eigen::RowVectorXd::Zero(kByteVocabulary);
  logits(7) = 2.0;
  logits(200) = 2.0;
  EXPECT_EQ(greedy_byte(logits), 7);
  ByteSampler sampler({.temperature = 0.0, .top_k = 0, .seed = 1}, 1);
  EXPECT_EQ(sampler.sample(0, logits), 7);
}

TEST(ReferenceGenerateSampling, TopKOfOneIsGreedyAtAnyTemperatureAndSeed) {
  std::mt19937_64 generator(61);
  for (uint64_t seed : {0ull, 1ull, 99ull}) {
    for (double temperature : {0.5, 1.0, 5.0}) {
      ByteSampler sampler({.temperature = temperature, .top_k = 1, .seed = seed}, 1);
      for (int trial = 0; trial < 20; ++trial) {
        const Matrix logits = random_matrix(1, kByteVocabulary, generator, 1.0);
        EXPECT_EQ(sampler.sample(0, logits.row(0)), greedy_byte(logits.row(0)));
      }
    }
  }
}

TEST(ReferenceGenerateSampling, TopKDrawsOnlyTheKMostLikelyBytesInProportion) {
  Eigen::RowVectorXd logits = Eigen::RowVectorXd::Constant(kByteVocabulary, -3.0);
  logits(9) = std::log(0.5);
  logits(3) = std::log(0.3);
  logits(250) = std::log(0.2);
  ByteSampler sampler({.temperature = 1.0, .top_k = 3, .seed = 5}, 1);
  std::map<int32_t, int> counts;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) ++counts[sampler.sample(0, logits)];
  EXPECT_EQ(counts.size(), 3u);
  EXPECT_NEAR(counts[9] / double(draws), 0.5, 0.02);
  EXPECT_NEAR(counts[3] / double(draws), 0.3, 0.02);
  EXPECT_NEAR(counts[250] / double(draws), 0.2, 0.02);

  // A temperature of 0.5 squares the ratios: 25 : 9 : 4.
  ByteSampler sharper({.temperature = 0.5, .top_k = 3, .seed = 5}, 1);
  counts.clear();
  for (int i = 0; i < draws; ++i) ++counts[sharper.sample(0, logits)];
  EXPECT_NEAR(counts[9] / double(draws), 25.0 / 38.0, 0.02);
  EXPECT_NEAR(counts[250] / double(draws), 4.0 / 38.0, 0.02);
}

// The first draw of std::mt19937_64(seed + n), by the documented rule, chooses sequence n's byte.
TEST(ReferenceGenerateSampling, DrawsFollowTheDocumentedRule) {
  Eigen::RowVectorXd logits = Eigen::RowVectorXd::Constant(kByteVocabulary, -1e3);
  logits(1) = 0.0;
  logits(2) = 0.0;  // two bytes at probability 1/2: byte 1 when u < 1/2, else byte 2
  const uint64_t seed = 123;
  ByteSampler sampler({.temperature = 1.0, .top_k = 0, .seed = seed}, 4);
  for (int64_t n = 0; n < 4; ++n) {
    std::mt19937_64 generator(seed + n);
    const double u = static_cast<double>(generator() >> 11) * 0x1.0p-53;
    EXPECT_EQ(sampler.sample(n, logits), u < 0.5 ? 1 : 2) << "sequence " << n;
  }
}

TEST(ReferenceGenerateSampling, GenerationIsDeterministicGivenTheSeed) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, 1, false);
  const ModelWeights weights = init_model(config, 71);  // near-uniform logits: the draws decide
  const std::vector<std::vector<int32_t>> prompts = {{'a', 'b'}, {'c'}};
  const SamplingSettings sampling{.temperature = 1.0, .top_k = 0, .seed = 3};
  const Generation first = generate(config, weights, prompts, 8, sampling);
  const Generation again = generate(config, weights, prompts, 8, sampling);
  EXPECT_EQ(first.bytes, again.bytes);
  EXPECT_EQ(first.steps.size(), 8u);
  SamplingSettings other = sampling;
  other.seed = 4;
  EXPECT_NE(generate(config, weights, prompts, 8, other).bytes, first.bytes);

  // Greedy: every byte is the argmax of the logits it was sampled from, and is fed back.
  const Generation greedy = generate(config, weights, prompts, 8, {.temperature = 0.0, .top_k = 0, .seed = 0});
  for (size_t step = 0; step < greedy.steps.size(); ++step) {
    for (int64_t n = 0; n < 2; ++n) {
      EXPECT_EQ(greedy.bytes[n][step], greedy_byte(greedy.steps[step].next_logits.row(n)));
    }
  }
  // top-k = 1 generates the greedy text.
  EXPECT_EQ(generate(config, weights, prompts, 8, {.temperature = 1.0, .top_k = 1, .seed = 9}).bytes, greedy.bytes);
}

// ---- bad input ----

TEST(ReferenceGenerate, BadInputIsAClearErrorAndLeavesTheCacheUnchanged) {
  const ModelConfig config = tiny_config(MoeLayers::every_block, 1, false);
  const ModelWeights weights = random_test_weights(config, 81);
  KvCache cache = make_kv_cache(config, 2);
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1, 2}}, cache); }),
              HasSubstr("tokens for 1 sequences; the kv cache holds N = 2"));
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1, 2}, {}}, cache); }),
              HasSubstr("sequence 1 has no new tokens"));
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1, 256}, {3}}, cache); }),
              HasSubstr("token 1 of sequence 0 = 256; expected a byte"));
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1}, std::vector<int32_t>(11, 5)}, cache); }),
              HasSubstr("sequence 1 would reach 11 positions (0 cached + 11 new); the context holds S = 10"));
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{0, 0}));

  prefill(config, weights, {std::vector<int32_t>(9, 1), {2}}, cache);
  decode_step(config, weights, {3, 4}, cache);  // sequence 0 is now full
  EXPECT_THAT(invalid_argument_message([&] { decode_step(config, weights, {3, 4}, cache); }),
              HasSubstr("sequence 0 would reach 11 positions (10 cached + 1 new); the context holds S = 10"));
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{10, 2}));
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1}, {2}}, cache); }),
              HasSubstr("prefill needs an empty kv cache"));

  ModelConfig other = config;
  other.seq_len = 12;
  KvCache wrong = make_kv_cache(other, 2);
  EXPECT_THAT(invalid_argument_message([&] { prefill(config, weights, {{1}, {2}}, wrong); }),
              HasSubstr("the kv cache was made for another model (S = 12"));

  EXPECT_THAT(invalid_argument_message([&] { generate(config, weights, {{1, 2, 3}}, 9, {}); }),
              HasSubstr("prompt 0 has 3 bytes; with max_new_bytes = 9 it needs 11 positions, and the context holds S = 10"));
  EXPECT_THAT(invalid_argument_message([&] { generate(config, weights, {{1}}, 2, {.temperature = -1.0}); }),
              HasSubstr("temperature = -1"));
  EXPECT_THAT(invalid_argument_message([&] { generate(config, weights, {{1}}, 2, {.temperature = 1.0, .top_k = 257}); }),
              HasSubstr("top_k = 257"));
  EXPECT_THAT(invalid_argument_message([&] { generate(config, weights, {{1}}, 0, {}); }), HasSubstr("max_new_bytes = 0"));
}

// A model trained with dropping decodes dropless: the same as its full forward run dropless.
TEST(ReferenceGenerate, AModelTrainedWithDroppingDecodesDropless) {
  ModelConfig dropping = tiny_config(MoeLayers::every_block, 2, false);
  dropping.formulation = Formulation::dropping;
  dropping.capacity_factor = 0.5;
  dropping.block_size = 3;  // not a divisor of H = 8: the step uses a block size that is
  const ModelWeights weights = random_test_weights(dropping, 91);
  ModelConfig dropless = dropping;
  dropless.formulation = Formulation::dropless;
  dropless.block_size = 4;
  const IndexMatrix bytes = random_bytes(1, dropping.seq_len, 92);
  const ModelForward full = model_forward(dropless, weights, bytes, bytes);
  const Generation greedy = generate(dropping, weights, {row_bytes(bytes, 0, 0, 4)}, 1, {});
  EXPECT_LT(relative_error(greedy.steps[0].logits, full.logits.topRows(4)), 1e-10);
}

}  // namespace
}  // namespace moe::ref
