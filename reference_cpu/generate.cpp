// generate.cpp: prefill, decode steps and generation with a KV cache (see generate.h).
#include "generate.h"

#include <algorithm>  // upper_bound, lower_bound over the MoE blocks
#include <numeric>    // gcd
#include <optional>
#include <set>
#include <stdexcept>
#include <string>

#include "layer_norm.h"      // layer_norm_forward
#include "moe_layer.h"       // moe_forward
#include "pregate.h"         // pregate
#include "pregated_layer.h"  // pregated_moe_forward

namespace moe::ref {

namespace {

// The MoE layer of a step of T_new tokens: dropless whatever the model was trained with (generate.h
// says why). The block size only pads each expert's rows and never changes a token's output; the
// greatest common divisor keeps it a divisor of H, which dropless needs, for a model trained with
// another formulation.
MoeConfig inference_layer_config(const ModelConfig& config, int64_t new_tokens) {
  MoeConfig layer = moe_layer_config(config, 1);
  layer.tokens = new_tokens;
  layer.formulation = Formulation::dropless;
  layer.block_size = std::gcd(layer.hidden_dim, layer.block_size);
  return layer;
}

MoeBlockRouting block_routing(int64_t block, int64_t known_in_block, const RouterOutput& router) {
  MoeBlockRouting routing;
  routing.block = block;
  routing.known_in_block = known_in_block;
  routing.top_experts = router.top_experts;
  routing.combine_weights = router.combine_weights;
  const std::set<int32_t> distinct(router.top_experts.data(), router.top_experts.data() + router.top_experts.size());
  routing.experts.assign(distinct.begin(), distinct.end());
  return routing;
}

void check_cache(const ModelConfig& config, const KvCache& cache, int64_t batch) {
  const int64_t N = static_cast<int64_t>(cache.lengths.size());
  if (N != batch) {
    throw std::invalid_argument("the step has tokens for " + std::to_string(batch) +
                                " sequences; the kv cache holds N = " + std::to_string(N));
  }
  if (cache.capacity != config.seq_len || static_cast<int64_t>(cache.layers.size()) != config.num_layers) {
    throw std::invalid_argument("the kv cache was made for another model (S = " + std::to_string(cache.capacity) + ", L = " +
                                std::to_string(cache.layers.size()) + "; the model has S = " +
                                std::to_string(config.seq_len) + ", L = " + std::to_string(config.num_layers) + ")");
  }
  for (const LayerKvCache& layer : cache.layers) {
    if (static_cast<int64_t>(layer.keys.size()) != N || static_cast<int64_t>(layer.values.size()) != N) {
      throw std::invalid_argument("the kv cache's blocks do not all hold N = " + std::to_string(N) + " sequences");
    }
    for (int64_t n = 0; n < N; ++n) {
      if (layer.keys[n].rows() != config.seq_len || layer.keys[n].cols() != config.model_dim ||
          layer.values[n].rows() != config.seq_len || layer.values[n].cols() != config.model_dim) {
        throw std::invalid_argument("the kv cache's keys and values are not [S, D] = [" + std::to_string(config.seq_len) +
                                    ", " + std::to_string(config.model_dim) + "]; make it with make_kv_cache");
      }
    }
  }
}

void check_tokens(const ModelConfig& config, const std::vector<std::vector<int32_t>>& tokens, const KvCache& cache) {
  for (size_t n = 0; n < tokens.size(); ++n) {
    if (tokens[n].empty()) {
      throw std::invalid_argument("sequence " + std::to_string(n) + " has no new tokens; every sequence needs at least one");
    }
    const int64_t end = cache.lengths[n] + static_cast<int64_t>(tokens[n].size());
    if (end > config.seq_len) {
      throw std::invalid_argument("sequence " + std::to_string(n) + " would reach " + std::to_string(end) +
                                  " positions (" + std::to_string(cache.lengths[n]) + " cached + " +
                                  std::to_string(tokens[n].size()) + " new); the context holds S = " +
                                  std::to_string(config.seq_len));
    }
    for (size_t i = 0; i < tokens[n].size(); ++i) {
      if (tokens[n][i] >= 0 && tokens[n][i] < kByteVocabulary) continue;
      throw std::invalid_argument("token " + std::to_string(i) + " of sequence " + std::to_string(n) + " = " +
                                  std::to_string(tokens[n][i]) + "; expected a byte, 0 <= value < " +
                                  std::to_string(kByteVocabulary));
    }
  }
}

}  // namespace

int64_t gate_input_block(const ModelConfig& config, int64_t block) {
  const std::vector<int64_t> moe = moe_blocks(config);
  const auto self = std::lower_bound(moe.begin(), moe.end(), block);
  if (self == moe.end() || *self != block) {
    throw std::invalid_argument("block " + std::to_string(block) + " has no MoE layer (moe_layers = " +
                                std::string(to_string(config.moe_layers)) + ")");
  }
  return config.pregated && self != moe.begin() ? *(self - 1) : block;
}

StepOutput extend(const ModelConfig& config, const ModelWeights& weights,
                  const std::vector<std::vector<int32_t>>& tokens, KvCache& cache) {
  check_model_weights(config, weights);
  check_cache(config, cache, static_cast<int64_t>(tokens.size()));
  check_tokens(config, tokens, cache);
  const int64_t N = static_cast<int64_t>(tokens.size()), D = config.model_dim;
  const std::vector<int64_t> moe = moe_blocks(config);

  StepOutput step;
  std::vector<int64_t> counts;
  for (int64_t n = 0; n < N; ++n) {
    counts.push_back(static_cast<int64_t>(tokens[n].size()));
    for (int64_t i = 0; i < counts.back(); ++i) {
      step.sequence.push_back(n);
      step.position.push_back(cache.lengths[n] + i);
    }
  }
  const int64_t T = static_cast<int64_t>(step.sequence.size());
  const MoeConfig layer = inference_layer_config(config, T);

  Matrix x(T, D);
  for (int64_t t = 0, n = 0, i = 0; t < T; ++t, ++i) {
    if (i == counts[n]) { ++n; i = 0; }
    x.row(t) = weights.token_embedding.row(tokens[n][i]) + weights.position_embedding.row(step.position[t]);
  }

  std::optional<PreGateOutput> routing;  // pre-gated: this block's routing, made one MoE block earlier
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const BlockWeights& w = weights.blocks[i];
    const LayerNormForward ln1 = layer_norm_forward(x, w.ln1.gain, w.ln1.bias, config.layer_norm_eps);
    const Matrix x_mid = x + cached_attention_forward(ln1.y, w.qkv_weights, w.out_weights, config.num_heads,
                                                      cache.lengths, counts, cache.layers[i]);
    const LayerNormForward ln2 = layer_norm_forward(x_mid, w.ln2.gain, w.ln2.bias, config.layer_norm_eps);
    if (is_moe_block(config, i)) {
      const LayerForward ffn = routing ? pregated_moe_forward(layer, ln2.y, w.moe, *routing)
                                       : moe_forward(layer, ln2.y, w.moe);
      if (!routing) step.moe.push_back(block_routing(i, i, ffn.router));  // routed by its own gate
      routing.reset();
      // Pre-gating: the next MoE block's experts, chosen here from this block's FFN input.
      const auto next = std::upper_bound(moe.begin(), moe.end(), i);
      if (config.pregated && next != moe.end()) {
        routing = pregate(layer, ln2.y, weights.blocks[*next].moe.gate_weights);
        step.moe.push_back(block_routing(*next, i, routing->router));
      }
      x = x_mid + ffn.y;
    } else {
      x = x_mid + dense_ffn_forward(ln2.y, w.ffn_w1, w.ffn_w2).out;
    }
  }
  for (int64_t n = 0; n < N; ++n) cache.lengths[n] += counts[n];

  const LayerNormForward final_ln =
      layer_norm_forward(x, weights.final_ln.gain, weights.final_ln.bias, config.layer_norm_eps);
  step.logits = final_ln.y * weights.token_embedding.transpose();
  step.next_logits.resize(N, kByteVocabulary);
  for (int64_t n = 0, last = -1; n < N; ++n) {
    last += counts[n];
    step.next_logits.row(n) = step.logits.row(last);
  }
  return step;
}

StepOutput prefill(const ModelConfig& config, const ModelWeights& weights,
                   const std::vector<std::vector<int32_t>>& prompts, KvCache& cache) {
  for (size_t n = 0; n < cache.lengths.size(); ++n) {
    if (cache.lengths[n] != 0) {
      throw std::invalid_argument("prefill needs an empty kv cache; sequence " + std::to_string(n) + " already holds " +
                                  std::to_string(cache.lengths[n]) + " positions");
    }
  }
  return extend(config, weights, prompts, cache);
}

StepOutput decode_step(const ModelConfig& config, const ModelWeights& weights,
                       const std::vector<int32_t>& next_bytes, KvCache& cache) {
  std::vector<std::vector<int32_t>> tokens;
  for (int32_t byte : next_bytes) tokens.push_back({byte});
  return extend(config, weights, tokens, cache);
}

Generation generate(const ModelConfig& config, const ModelWeights& weights,
                    const std::vector<std::vector<int32_t>>& prompts, int64_t max_new_bytes,
                    const SamplingSettings& sampling) {
  validate(config);
  validate(sampling);
  if (prompts.empty()) throw std::invalid_argument("generate needs at least one prompt");
  if (max_new_bytes < 1) {
    throw std::invalid_argument("max_new_bytes = " + std::to_string(max_new_bytes) + "; expected >= 1");
  }
  for (size_t n = 0; n < prompts.size(); ++n) {
    if (prompts[n].empty()) throw std::invalid_argument("prompt " + std::to_string(n) + " is empty; expected 1..S bytes");
    const int64_t needed = static_cast<int64_t>(prompts[n].size()) + max_new_bytes - 1;
    if (needed > config.seq_len) {
      throw std::invalid_argument("prompt " + std::to_string(n) + " has " + std::to_string(prompts[n].size()) +
                                  " bytes; with max_new_bytes = " + std::to_string(max_new_bytes) + " it needs " +
                                  std::to_string(needed) + " positions, and the context holds S = " +
                                  std::to_string(config.seq_len));
    }
  }
  const int64_t N = static_cast<int64_t>(prompts.size());
  KvCache cache = make_kv_cache(config, N);
  ByteSampler sampler(sampling, N);
  Generation generation;
  generation.bytes.resize(N);
  generation.steps.push_back(prefill(config, weights, prompts, cache));
  for (int64_t produced = 1;; ++produced) {
    const std::vector<int32_t> next = sampler.sample(generation.steps.back().next_logits);
    for (int64_t n = 0; n < N; ++n) generation.bytes[n].push_back(next[n]);
    if (produced == max_new_bytes) break;
    generation.steps.push_back(decode_step(config, weights, next, cache));
  }
  return generation;
}

}  // namespace moe::ref
