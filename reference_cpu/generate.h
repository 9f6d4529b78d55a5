// generate.h: incremental decoding of the reference model with a KV cache: prefill a batch of
// prompts, then one byte per sequence per step, reporting which experts every MoE block chose.
// The oracle of GPU generation and of the offload engine. Part of the CPU reference
// (moe::ref); tested by tests/reference_cpu/test_generate.cpp:
//   cmake --build build --target test_reference_cpu_generate && ctest --test-dir build -R ReferenceGenerate
//
// Dimension legend (README.md): V = 256 bytes, D, L, S as in model.h; N sequences; T_new the new
// tokens of one step (the prompts' bytes in a prefill, N in a decode step); E, K, H as in MoeConfig.
//
// One step is model_forward (model.h) restricted to the new tokens: embeddings at each token's own
// position, then per block LN1 -> attention over the cache (kv_cache.h) -> LN2 -> the FFN, then the
// final LayerNorm and the tied output projection. Sequences are independent: prompts may have
// different lengths, and sequence n's next position is cache.lengths[n].
//
// Routing at inference is dropless, whatever formulation the model was trained with. A dropping or
// padded layer keeps C = ceil(capacity_factor * T * K / E) rows per expert, and T is the number of
// tokens that share the layer's batch: whether a token is dropped depends on which other tokens
// (other sequences, other positions of a prefill) are routed with it, so it is not defined for one
// decoded token. Dropless sends every token to its top-K experts (MegaBlocks), so a token's output
// depends on that token alone: decoding byte by byte gives the full-sequence forward's logits for
// any model trained dropless (and for any other whenever that forward dropped nothing).
//
// Pre-gated models (config.pregated, model.h): MoE block m_j's gate (j >= 1) reads the LN2 output
// of block m_{j-1} and is evaluated there, as in model_forward, so block m_j's experts are known
// one MoE block before it runs; block m_0 is routed by its own gate. MoeBlockRouting::known_in_block
// says where each block's choice was made: the block after which an offload engine can start
// copying that block's experts (Pre-gated MoE, Hwang et al., ISCA 2024).
//
//   KvCache cache = make_kv_cache(config, prompts.size());
//   StepOutput step = prefill(config, weights, prompts, cache);      // step.next_logits [N, V]
//   while (...) step = decode_step(config, weights, next_bytes, cache);
// or all at once: generate(config, weights, prompts, max_new_bytes, sampling) (sampling.h).
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache.h"      // KvCache
#include "model.h"         // ModelWeights
#include "model_config.h"  // ModelConfig
#include "sampling.h"      // SamplingSettings
#include "types.h"

namespace moe::ref {

// The block whose LN2 output MoE block `block` routes: the previous MoE block in a pre-gated model
// (except for the first MoE block), the block itself otherwise. Throws unless `block` is an MoE block.
int64_t gate_input_block(const ModelConfig& config, int64_t block);

// What one MoE block chose for the tokens of one step.
struct MoeBlockRouting {
  int64_t block = 0;           // the MoE block (0-based layer index)
  int64_t known_in_block = 0;  // gate_input_block(config, block): where the choice was made
  IndexMatrix top_experts;     // [T_new, K] each new token's experts, by descending probability
  Matrix combine_weights;      // [T_new, K] their weights in the combine
  IndexVector experts;         // the distinct experts of top_experts, ascending: what the block needs
};

struct StepOutput {
  std::vector<int64_t> sequence;  // [T_new] the sequence of each new token (rows grouped by sequence)
  std::vector<int64_t> position;  // [T_new] its position in that sequence
  Matrix logits;                  // [T_new, V] the next-byte logits after each new token
  Matrix next_logits;             // [N, V] the rows of each sequence's last new token
  std::vector<MoeBlockRouting> moe;  // one per MoE block, ascending block order
};

// Appends tokens[n] (every list non-empty, bytes 0..255) to sequence n of `cache` and runs them
// through the model. Throws std::invalid_argument, leaving the cache unchanged, when the cache was
// made for another batch or model, or a sequence would pass the context S.
StepOutput extend(const ModelConfig& config, const ModelWeights& weights,
                  const std::vector<std::vector<int32_t>>& tokens,  // N lists of new bytes
                  KvCache& cache);

// extend on an empty cache: the prompts, every one 1..S bytes long.
StepOutput prefill(const ModelConfig& config, const ModelWeights& weights,
                   const std::vector<std::vector<int32_t>>& prompts,  // N prompts
                   KvCache& cache);

// extend with one byte per sequence: next_bytes[n] goes to position cache.lengths[n].
StepOutput decode_step(const ModelConfig& config, const ModelWeights& weights,
                       const std::vector<int32_t>& next_bytes,  // [N]
                       KvCache& cache);

struct Generation {
  std::vector<std::vector<int32_t>> bytes;  // [N] the generated bytes of each sequence
  std::vector<StepOutput> steps;            // steps[0] the prefill, then one per decode step
};

// Prefill, sample a byte per sequence from next_logits (sampling.h), feed it back, repeat until
// every sequence has max_new_bytes new bytes. The last byte is sampled, never fed, so a prompt of
// p bytes needs p + max_new_bytes - 1 <= S; a longer one is an error naming the sequence.
Generation generate(const ModelConfig& config, const ModelWeights& weights,
                    const std::vector<std::vector<int32_t>>& prompts,  // N prompts
                    int64_t max_new_bytes, const SamplingSettings& sampling);

}  // namespace moe::ref
