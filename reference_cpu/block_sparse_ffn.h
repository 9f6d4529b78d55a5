// block_sparse_ffn.h: the dropless expert FFN as block-sparse products over all experts at once
// (MegaBlocks 5.1), forward and backward. Part of the CPU reference (moe::ref); it is the oracle
// for the GPU dropless path, and the tests show it equals the per-expert computation of expert_ffn.h.
//
// Concatenate the experts' weights: W1cat = [w1[0] | w1[1] | ...] [D, E*H] (for SwiGLU one such
// matrix for the gate columns and one for the up columns), W2cat = [w2[0]; w2[1]; ...] [E*H, D].
// The hidden matrix [rows, E*H] is block-diagonal by expert: only the topology's blocks are nonzero.
//   forward  : pre = SDD(permuted_x, W1cat)   hidden = act(pre)   out = DSD(hidden, W2cat)
//   backward : dW2cat = DSᵀD(hiddenᵀ, d_out)         (dsd, transpose_s, through transpose_indices)
//              d_hidden = SDD(d_out, W2catᵀ)         d_pre = act'(pre) . d_hidden (blockwise)
//              dW1cat = DDS(permuted_xᵀ, d_pre)      d_permuted_x = DSD(d_pre, W1catᵀ)
#pragma once

#include <vector>

#include "expert_ffn.h"  // ExpertGradients
#include "topology.h"    // BlockSparseTopology
#include "types.h"

namespace moe::ref {

struct BlockSparseActivations {
  Matrix pre_activation;  // [nnz*B, B] blocks of x W1cat (GeLU) or of the gate projection (SwiGLU)
  Matrix up_projection;   // [nnz*B, B] SwiGLU only: blocks of x W1cat_up; empty for GeLU
  Matrix hidden;          // [nnz*B, B] blocks of the activation
  Matrix out;             // [rows, D]
};

// Columns [first, first + count) of every expert's matrix, side by side: E x [R, *] -> [R, E*count].
Matrix concat_expert_columns(const std::vector<Matrix>& per_expert, int64_t first, int64_t count);
// Every expert's matrix stacked vertically: E x [R, C] -> [E*R, C].
Matrix concat_expert_rows(const std::vector<Matrix>& per_expert);

BlockSparseActivations block_sparse_ffn_forward(const MoeConfig& config,
                                                const BlockSparseTopology& topology,
                                                const Matrix& permuted_x,        // [rows, D]
                                                const std::vector<Matrix>& w1,   // E x [D, w1_columns]
                                                const std::vector<Matrix>& w2);  // E x [H, D]

ExpertGradients block_sparse_ffn_backward(const MoeConfig& config,
                                          const BlockSparseTopology& topology,
                                          const Matrix& permuted_x,       // [rows, D]
                                          const std::vector<Matrix>& w1,  // E x [D, w1_columns]
                                          const std::vector<Matrix>& w2,  // E x [H, D]
                                          const BlockSparseActivations& forward,
                                          const Matrix& d_out);  // [rows, D]

}  // namespace moe::ref
