// kv_cache.h: causal multi-head self-attention over a cache of the keys and values of earlier
// positions, the attention of incremental decoding (generate.h). Part of the CPU reference
// (moe::ref); tested against the full-sequence attention through the model
// (ctest --test-dir build -R ReferenceGenerate).
//
// Dimension legend (README.md): D model width, S the context (sequence length, the position
// embedding's rows), N sequences, d = D / heads the head width, T_new the tokens of one step.
//
// attention.h computes a whole sequence at once: position s reads the keys and values of positions
// 0..s, all computed in the same call. When text is generated one byte at a time, the keys and
// values of positions 0..s-1 do not change when byte s arrives (the mask is causal and the
// projection is per row), so each block keeps them: a step projects only its new rows,
//   [q | k | v] = x_new qkv_weights                                   [T_new, 3D]
// appends k and v to the sequence's cache at its next positions, and lets each new query attend to
// every cached position up to its own:
//   scores = q_h K_h[0..s]^T / sqrt(d),  context_h = softmax(scores) V_h[0..s],  out = context out_weights
// the same numbers as attention_forward's row s. The cost of a step grows with the context, not
// with the square of it.
#pragma once

#include <cstdint>
#include <vector>

#include "model_config.h"  // ModelConfig
#include "types.h"

namespace moe::ref {

// One block's cache: the key and value rows of every sequence, heads side by side as in the
// projection's K and V parts (head h owns columns [h * d, (h + 1) * d)).
struct LayerKvCache {
  std::vector<Matrix> keys;    // N x [S, D]; rows >= the sequence's length are not yet written
  std::vector<Matrix> values;  // N x [S, D]
};

struct KvCache {
  int64_t capacity = 0;            // S: the positions a sequence can hold
  std::vector<int64_t> lengths;    // [N] positions filled; the next token of sequence n goes to lengths[n]
  std::vector<LayerKvCache> layers;  // L, one per block
};

// An empty cache for `batch` sequences of config's model (every block, S positions each).
KvCache make_kv_cache(const ModelConfig& config, int64_t batch);

// The attention of one block for the new tokens of one step, writing their keys and values into
// `cache` at positions lengths[n], lengths[n] + 1, ... The rows of x are grouped by sequence:
// sequence 0's counts[0] tokens first, then sequence 1's, ... (every count >= 1). `lengths` are the
// positions filled before this step; the caller advances them once every block has run, so a
// step that fails part-way leaves the cache as it was (rows past a length are never read).
Matrix cached_attention_forward(const Matrix& x,                    // [T_new, D] LN1 of the new tokens
                                const Matrix& qkv_weights,          // [D, 3D]
                                const Matrix& out_weights,          // [D, D]
                                int64_t num_heads,
                                const std::vector<int64_t>& lengths,  // [N]
                                const std::vector<int64_t>& counts,   // [N], sum = T_new
                                LayerKvCache& cache);               // returns out [T_new, D]

}  // namespace moe::ref
