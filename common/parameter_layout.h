// parameter_layout.h: the language model's parameters as one flat list, in one fixed order, and their
// initial values. The CPU reference (reference_cpu/model.h) walks its matrices in this order, the
// GPU model (cuda/model/model.h) keeps one flat fp32 buffer in it, and checkpoints and weights files
// (checkpoint.h, model_weights_file.h) store it as it is. Plain C++. Tested by
// tests/reference_cpu/test_model.cpp (ctest --test-dir build -R ReferenceModel).
//
// Dimension legend (model_config.h): V = 256, D, S, L, E, H, H_dense; w1_columns = H (GeLU) or 2H
// (SwiGLU). The order:
//   token_embedding [V, D], position_embedding [S, D],
//   per block i: blocks.i.ln1.gain [1, D], blocks.i.ln1.bias [1, D],
//                blocks.i.attention.qkv [D, 3D], blocks.i.attention.out [D, D],
//                blocks.i.ln2.gain [1, D], blocks.i.ln2.bias [1, D],
//                dense block: blocks.i.ffn.w1 [D, H_dense], blocks.i.ffn.w2 [H_dense, D]
//                MoE block:   blocks.i.moe.gate [D, E], blocks.i.moe.w1.e [D, w1_columns] for e < E,
//                             blocks.i.moe.w2.e [H, D] for e < E
//   final_ln.gain [1, D], final_ln.bias [1, D]
// A block's E expert matrices are adjacent, so expert e's W1 is one contiguous slice of the flat
// buffer (what an offload engine copies, cuda/offload).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model_config.h"  // ModelConfig

namespace moe {

// What a parameter is, for the initialisation and for the weight decay.
enum class ParameterKind {
  matrix,               // uniform, standard deviation 0.02; decayed
  residual_projection,  // writes into the residual stream: 0.02 / sqrt(2 L); decayed
  gain,                 // LayerNorm gain: ones, not decayed
  bias,                 // LayerNorm bias: zeros, not decayed
};

struct ParameterInfo {
  std::string name;     // "blocks.1.moe.w1.3"
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t offset = 0;   // first entry in a flat buffer holding every parameter in list order
  bool weight_decay = false;  // true for the matrices, false for LayerNorm gains and biases
  ParameterKind kind = ParameterKind::matrix;
  int64_t expert = -1;  // e of an expert's matrix (moe.w1.e, moe.w2.e); -1 for every other parameter
  int64_t block = -1;   // i of a block's parameter ("blocks.i.*"); -1 for the embeddings and final_ln
};

// Every parameter of the model, in the order above. Throws as validate(config) does.
std::vector<ParameterInfo> parameter_layout(const ModelConfig& config);
// Total entries, the flat buffer's size; at most kMaxParameters (model_config.h). Throws as
// validate(config) does.
int64_t parameter_count(const ModelConfig& config);

// GPT-2's initialisation, flat in list order: every matrix uniform with standard deviation 0.02,
// the projections that write into the residual stream (attention.out, ffn.w2, moe.w2.e)
// 0.02 / sqrt(2 L); LayerNorm gains 1, biases 0 (they draw nothing). Drawn from one
// std::mt19937_64(seed) with uniform.h's draw, each matrix row-major: the same numbers on every
// platform, in the CPU reference and on the GPU.
std::vector<double> initial_parameters(const ModelConfig& config, uint64_t seed);

}  // namespace moe
