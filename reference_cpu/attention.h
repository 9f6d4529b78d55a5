// attention.h: causal multi-head self-attention, forward and backward. Part of the CPU reference
// (moe::ref), used by the reference model (model.h); tested through its finite-difference and
// causality checks (ctest --test-dir build -R ReferenceModel).
//
// Tokens are the rows of x [T, D] with T = N * S: token t = n * S + s is position s of sequence n.
// One fused projection gives the queries, keys and values, columns [Q | K | V]; head h owns columns
// [h * d, (h + 1) * d) of each part, d = D / heads:
//   qkv     = x qkv_weights                                      [T, 3D]
//   scores  = Q_h K_h^T / sqrt(d) per sequence n and head h        [S, S], -inf above the diagonal
//   probs   = softmax of each row of scores (position s sees only positions <= s)
//   context = probs V_h, the heads side by side                  [T, D]
//   out     = context out_weights                                [T, D]
// No biases: the only biases of the model are the LayerNorms'.
#pragma once

#include <vector>

#include "types.h"

namespace moe::ref {

struct AttentionForward {
  Matrix qkv;                 // [T, 3D]
  std::vector<Matrix> probs;  // N * heads matrices [S, S], index n * heads + h; zero above the diagonal
  Matrix context;             // [T, D]
  Matrix out;                 // [T, D]
};

struct AttentionGradients {
  Matrix x;            // [T, D]
  Matrix qkv_weights;  // [D, 3D]
  Matrix out_weights;  // [D, D]
};

AttentionForward attention_forward(const Matrix& x,            // [T, D], T = N * S
                                   const Matrix& qkv_weights,  // [D, 3D]
                                   const Matrix& out_weights,  // [D, D]
                                   int64_t seq_len,            // S
                                   int64_t num_heads);

AttentionGradients attention_backward(const Matrix& x,            // [T, D]
                                      const Matrix& qkv_weights,  // [D, 3D]
                                      const Matrix& out_weights,  // [D, D]
                                      const AttentionForward& forward,
                                      const Matrix& d_out,  // [T, D]
                                      int64_t seq_len, int64_t num_heads);

}  // namespace moe::ref
