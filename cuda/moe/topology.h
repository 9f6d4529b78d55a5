// moe/topology.h: builds the block-sparse topology (DeviceTopology, device_plan.h) of the dropless
// formulation on the GPU, from the dropless DevicePlan, without host synchronisation: the BCSR
// offsets, row_indices and column_indices, and the transpose indices of MegaBlocks 5.1.4 that let
// the backward kernels walk the sparse matrix column by column without a transposed copy.
// The CPU oracle is reference_cpu/topology.h (make_topology); the used part of every array equals it.
// Built into moe_cuda; tested by tests/cuda/test_topology.cpp (ctest --test-dir build -R CudaTopology).
//
// Dimension legend: T tokens, H expert hidden width, E experts, K top-k, B block size.
//
// Why closed forms instead of a sort: the dropless plan rounds every expert's rows up to B, so each
// block row belongs to one expert e and holds exactly its H/B block columns. Everything is then a
// formula of row_offsets (MegaBlocks' padded_bins):
//   block row r's expert    e = the last e with row_offsets[e] <= r*B  (binary search)
//   block_row_tokens[r]     = min(B, kept_per_expert[e] - (r*B - row_offsets[e])): an expert's
//                             slots fill its first rows, its padding the last ones
//   offsets[r]              = r * H/B
//   block b                 : row b / (H/B), column e * H/B + b % (H/B)
//   column_offsets[e*H/B+j] = (row_offsets[e]/B) * H/B + j * (rows of e)/B
//   transpose_indices       : block (r, j) of expert e sits at column_offsets[e*H/B+j] + r - row_offsets[e]/B
// The reference gets the same arrays with a stable counting sort of the blocks by column; here one
// kernel writes them, a thread per block row, block column and block.
//
// Past the used part (the grids run over host-known bounds):
//   offsets[r] for r > block_rows       = nnz (so trailing block rows read as empty)
//   block_row_expert[r], r >= block_rows = -1,  block_row_tokens[r] = 0
//   row_indices, column_indices, transpose_indices past nnz = -1
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"           // bf16
#include "core/device_buffer.h"  // DeviceBuffer
#include "moe/device_plan.h"     // DevicePlan, DeviceTopology
#include "moe_config.h"          // MoeConfig

namespace moe::cuda {

// The device arrays behind a DeviceTopology, one buffer per pointer field of the same name. A
// topology that keeps no row side (row_side = false: offsets and column_indices) leaves those
// empty, and its view's pointers null.
struct TopologyArrays {
  // Sizes every array for max_block_rows block rows of blocks_per_expert blocks, over block_cols
  // block columns (max_nnz = max_block_rows * blocks_per_expert).
  void allocate(int max_block_rows, int blocks_per_expert, int block_cols, bool row_side);
  // The view of these arrays at these sizes, B = block_size.
  DeviceTopology view(int block_size, int blocks_per_expert, int block_cols, int max_block_rows) const;

  DeviceBuffer<int> block_rows;         // [1]
  DeviceBuffer<int> nnz;                // [1]
  DeviceBuffer<int> offsets;            // [max_block_rows + 1]
  DeviceBuffer<int> row_indices;        // [max_nnz]
  DeviceBuffer<int> column_indices;     // [max_nnz]
  DeviceBuffer<int> column_offsets;     // [block_cols + 1]
  DeviceBuffer<int> transpose_indices;  // [max_nnz]
  DeviceBuffer<int> block_row_expert;   // [max_block_rows]
  DeviceBuffer<int> block_row_tokens;   // [max_block_rows]
};

// Owns the DeviceTopology's arrays (TopologyArrays), sized from the dropless plan's bound
// max_rows = T*K + E*(B-1): max_block_rows = max_rows / B, max_nnz = max_block_rows * H/B.
class TopologyBuffers : public TopologyArrays {
 public:
  // validate(config); the formulation must be dropless (else std::invalid_argument).
  explicit TopologyBuffers(const MoeConfig& config);

  DeviceTopology topology() const;  // a view of the arrays
  int num_experts() const { return num_experts_; }

 private:
  int num_experts_ = 0, block_size_ = 0, block_cols_ = 0, blocks_per_expert_ = 0;
  int max_block_rows_ = 0, max_nnz_ = 0;
};

// Fills `topology` from a dropless plan (built by build_dispatch_plan) on `stream`, asynchronously.
// Throws std::invalid_argument when the plan is not dropless (capacity != 0) or its E, B or
// max_rows do not match the sizes the buffers were made for.
void build_topology(const DevicePlan& plan, TopologyBuffers& topology, cudaStream_t stream);

// ---- one topology over the rows of M micro-batches (gradient accumulation) ----
// A step of M micro-batches runs each one's forward and backward (dx, the router) on its own
// topology, and the expert weight gradients once over all of them:
//   dW2_e = sum_m hidden_{m,e}ᵀ d_out_{m,e}      dW1_e = sum_m x_{m,e}ᵀ d_pre_{m,e}
// one DSᵀD and one DDS (block_sparse.h) whose block column walk passes through every micro-batch's
// block rows of expert e, so each weight-gradient tile reduces over M times the rows of one
// micro-batch (more k-steps a tile, and the gradients written once instead of M times).
//
// The layout it walks: the operands of micro-batch m sit in slot m of one buffer each, slot m
// starting at block row m * R (dense rows m * R * B) and at block m * R * H/B, where R is one
// micro-batch's max_block_rows. Block row g = m * R + r is micro-batch m's block row r, and the
// block ids are g * H/B + j, as in one micro-batch's own BCSR order. Column e * H/B + j holds,
// top to bottom, micro-batch 0's block rows of expert e, then micro-batch 1's, and so on.
// Its arrays, as DeviceTopology means them, over M * R block rows:
//   column_offsets, transpose_indices, row_indices, block_row_tokens, block_row_expert: the column
//     walk, what DSᵀD and DDS read;
//   block_rows = M * R and nnz = M * R * H/B (bounds: the used block rows are not a prefix);
//   offsets and column_indices are not kept (the SDD and DSD run per micro-batch).
// Padding: each micro-batch pads each expert's rows to B, so the walk meets padding rows inside it
// as well as at its end. They are zero in every operand (block_sparse.h), so they add nothing; the
// products stop early only in the last block row of a column, so the others' are multiplied:
// at most (M-1) * E * (B-1) rows more than the routed ones.
class MicroBatchTopology {
 public:
  // config.tokens is one micro-batch's T; config must be dropless. micro_batches >= 1, and
  // M * R <= 65535 (a grid's y: the products' bound on block rows), else std::invalid_argument.
  MicroBatchTopology(const MoeConfig& config, int micro_batches);

  // Keeps micro-batch m's routing: its plan's row_offsets and its topology's block_row_tokens,
  // copied on `stream` (device to device), so the plan and topology may be rebuilt afterwards.
  void record(int micro_batch, const DevicePlan& plan, const TopologyBuffers& topology, cudaStream_t stream);
  // Builds the column walk from the M recorded micro-batches, on `stream`, asynchronously.
  void build(cudaStream_t stream);
  DeviceTopology topology() const;  // a view, valid after build()

  int micro_batches() const { return micro_batches_; }
  int64_t slot_rows() const { return int64_t{block_rows_per_micro_batch_} * block_size_; }  // R * B
  int64_t slot_blocks() const { return int64_t{block_rows_per_micro_batch_} * blocks_per_expert_; }  // R * H/B

  // ---- compaction: each expert's rows of all M micro-batches in one layout, padded once ----
  // The compacted layout is one batch's: expert e's routed rows of micro-batch 0, then of 1, ...,
  // one after another, then its padding up to a multiple of B, once:
  //   N_e = sum_m kept_m[e],  compacted bins[e] = sum_{e' < e} roundup(N_e', B)
  // so the products meet at most E (B - 1) padding rows instead of M E (B - 1). The rows are the
  // same rows in the same order as the slot layout's walk, without the padding between
  // micro-batches. build_compacted writes the layout's column walk (compacted_topology) and each
  // compacted row's source, the slot-layout row it copies (m * R * B + bins_m[e] + i) or -1 for a
  // padding row; gather_compacted (below) then copies an operand into the layout.
  void build_compacted(cudaStream_t stream);  // after the M record() calls
  DeviceTopology compacted_topology() const;  // a view, valid after build_compacted()
  int64_t compacted_rows() const { return int64_t{compacted_block_rows_} * block_size_; }  // M T K + E (B-1), rounded
  const int* compacted_sources() const { return compacted_sources_.data(); }  // [compacted_rows()]
  const int* compacted_bins() const { return compacted_bins_.data(); }        // [E+1]
  int num_experts() const { return num_experts_; }
  int block_size() const { return block_size_; }

 private:
  int micro_batches_ = 0, num_experts_ = 0, block_size_ = 0, blocks_per_expert_ = 0;
  int block_rows_per_micro_batch_ = 0;  // R
  int compacted_block_rows_ = 0;        // (M T K + E (B - 1)) / B
  DeviceBuffer<int> row_offsets_;       // [M, E+1] each micro-batch's padded bins
  DeviceBuffer<int> kept_;              // [M, E] each micro-batch's routed rows per expert
  TopologyArrays arrays_;               // the column walk's, over M * R block rows (no row side)
  DeviceBuffer<int> compacted_bins_;    // [E+1]
  DeviceBuffer<int> compacted_sources_; // [compacted rows]
  TopologyArrays compacted_arrays_;     // the compacted layout's column walk (no row side)
};

// Copies one operand of the expert weight gradients from the slot layout into the compacted one
// (MicroBatchTopology::build_compacted): compacted row r = src row sources[r], or zeros for a
// padding row; rows past the used ones are not written (the products never read them). `width`
// columns, a multiple of 8 (16-byte copies). blocked: both matrices are in the block layout the
// hidden activations and their gradients use (block_sparse.h: [rows / B, width / B] blocks of
// B x B, block row by block row); else row-major [rows, width].
void gather_compacted(const MicroBatchTopology& topology, const bf16* src, bf16* dst, int width, bool blocked,
                      cudaStream_t stream);

}  // namespace moe::cuda
