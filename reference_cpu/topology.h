// topology.h: the block-sparse topology of the dropless expert computation (MegaBlocks 5.1.4),
// exactly the metadata a GPU kernel builds, so tests compare arrays one to one.
// Part of the CPU reference (moe::ref); built into moe_reference_cpu, tested by tests/reference_cpu.
//
// The hidden activations of all experts form one matrix [rows, E*H], tiled in B x B blocks. The
// dropless plan rounds every expert's rows up to B, so each block row holds the rows of exactly one
// expert e, and its nonzero blocks are that expert's H/B block columns e*H/B ... (e+1)*H/B - 1.
// Blocks are numbered in row-major order (BCSR):
//   offsets           [block_rows + 1]  block ids of block row r are offsets[r] .. offsets[r+1]-1
//   row_indices       [nnz]             block row of each block
//   column_indices    [nnz]             block column of each block
//   column_offsets    [block_cols + 1]  entries of block column c in transpose_indices
//   transpose_indices [nnz]             block ids in column-major order: walking block column c
//                                       through transpose_indices visits its blocks top to bottom.
//   block_row_expert  [block_rows]      the expert whose rows fill block row r
//   block_row_tokens  [block_rows]      how many of block row r's B rows hold a routed slot; the
//                                       backward's weight-gradient products skip the rest, which
//                                       are padding (zero in every operand of the FFN)
// The transpose indices let a kernel read the sparse matrix as its transpose (the DSᵀD products of
// the backward pass) without ever storing a transposed copy of the values.
#pragma once

#include "dispatch.h"  // DispatchPlan
#include "types.h"

namespace moe::ref {

struct BlockSparseTopology {
  int64_t block_size = 0;  // B
  int64_t block_rows = 0;  // rows / B
  int64_t block_cols = 0;  // E * H / B
  int64_t nnz = 0;         // nonzero B x B blocks
  IndexVector offsets;            // [block_rows + 1]
  IndexVector row_indices;        // [nnz]
  IndexVector column_indices;     // [nnz]
  IndexVector column_offsets;     // [block_cols + 1]
  IndexVector transpose_indices;  // [nnz]
  IndexVector block_row_expert;   // [block_rows] the expert whose rows fill each block row
  IndexVector block_row_tokens;   // [block_rows] how many of its B rows hold a routed slot (1..B):
                                  // an expert's rows come first in its padded bin, so only the
                                  // last block row of an expert has padding (B - tokens rows)

  int64_t rows() const { return block_rows * block_size; }  // rows of the dense matrix
  int64_t cols() const { return block_cols * block_size; }  // E * H
};

// Builds the topology of a dropless plan; throws std::invalid_argument for any other formulation.
BlockSparseTopology make_topology(const MoeConfig& config, const DispatchPlan& plan);

}  // namespace moe::ref
