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

#include "core/device_buffer.h"  // DeviceBuffer
#include "moe/device_plan.h"     // DevicePlan, DeviceTopology
#include "moe_config.h"          // MoeConfig

namespace moe::cuda {

// Owns the DeviceTopology's arrays, sized from the dropless plan's bound
// max_rows = T*K + E*(B-1): max_block_rows = max_rows / B, max_nnz = max_block_rows * H/B.
class TopologyBuffers {
 public:
  // validate(config); the formulation must be dropless (else std::invalid_argument).
  explicit TopologyBuffers(const MoeConfig& config);

  DeviceTopology topology() const;  // a view of the arrays below
  int num_experts() const { return num_experts_; }

  DeviceBuffer<int> block_rows;         // [1]
  DeviceBuffer<int> nnz;                // [1]
  DeviceBuffer<int> offsets;            // [max_block_rows + 1]
  DeviceBuffer<int> row_indices;        // [max_nnz]
  DeviceBuffer<int> column_indices;     // [max_nnz]
  DeviceBuffer<int> column_offsets;     // [block_cols + 1]
  DeviceBuffer<int> transpose_indices;  // [max_nnz]
  DeviceBuffer<int> block_row_expert;   // [max_block_rows]
  DeviceBuffer<int> block_row_tokens;   // [max_block_rows]

 private:
  int num_experts_ = 0, block_size_ = 0, block_cols_ = 0, blocks_per_expert_ = 0;
  int max_block_rows_ = 0, max_nnz_ = 0;
};

// Fills `topology` from a dropless plan (built by build_dispatch_plan) on `stream`, asynchronously.
// Throws std::invalid_argument when the plan is not dropless (capacity != 0) or its E, B or
// max_rows do not match the sizes the buffers were made for.
void build_topology(const DevicePlan& plan, TopologyBuffers& topology, cudaStream_t stream);

}  // namespace moe::cuda
