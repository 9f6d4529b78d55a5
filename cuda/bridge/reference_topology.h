// bridge/reference_topology.h: puts a CPU reference topology (moe::ref::make_topology) on the GPU as
// a DeviceTopology, for the tests, lessons and tools of the block-sparse kernels (block_sparse.h) that
// must feed the GPU exactly the topology the oracle used. Part of the bridge between the CPU
// reference and the GPU (this folder): include it only from targets that link moe_reference_cpu.
// (The GPU's own builder, with no host round trip, is build_topology in moe/topology.h.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "reference_cpu/topology.h"  // moe::ref::BlockSparseTopology
#include "core/device_buffer.h"      // DeviceBuffer
#include "moe/device_plan.h"         // DeviceTopology

namespace moe::cuda {

// Owns the arrays; `topology` views them. Arrays are sized by the host bounds of the contract
// (device_plan.h): max_block_rows = max_rows / B, max_nnz = max_block_rows * H/B. Past the used part
// they hold what the GPU builder writes there: offsets = nnz, every index = -1.
struct UploadedTopology {
  DeviceBuffer<int> block_rows, nnz, offsets, row_indices, column_indices, column_offsets,
      transpose_indices, block_row_expert, block_row_tokens;
  DeviceTopology topology;
};

inline UploadedTopology upload_topology(const ref::BlockSparseTopology& t, int64_t hidden_dim,
                                        int64_t max_rows) {  // T*K + E*(B-1), the plan's bound
  const int B = static_cast<int>(t.block_size);
  const int blocks_per_expert = static_cast<int>(hidden_dim / B);
  const int max_block_rows = static_cast<int>(max_rows / B);
  const int max_nnz = max_block_rows * blocks_per_expert;
  const int block_rows = static_cast<int>(t.block_rows), nnz = static_cast<int>(t.nnz);

  auto padded = [](const ref::IndexVector& used, int size, int fill) {
    std::vector<int> out(size, fill);
    std::copy(used.begin(), used.end(), out.begin());
    return out;
  };

  UploadedTopology u;
  u.block_rows = DeviceBuffer<int>(std::vector<int>{block_rows});
  u.nnz = DeviceBuffer<int>(std::vector<int>{nnz});
  u.offsets = DeviceBuffer<int>(padded(t.offsets, max_block_rows + 1, nnz));
  u.row_indices = DeviceBuffer<int>(padded(t.row_indices, max_nnz, -1));
  u.column_indices = DeviceBuffer<int>(padded(t.column_indices, max_nnz, -1));
  u.column_offsets = DeviceBuffer<int>(padded(t.column_offsets, static_cast<int>(t.block_cols) + 1, -1));
  u.transpose_indices = DeviceBuffer<int>(padded(t.transpose_indices, max_nnz, -1));
  u.block_row_expert = DeviceBuffer<int>(padded(t.block_row_expert, max_block_rows, -1));
  u.block_row_tokens = DeviceBuffer<int>(padded(t.block_row_tokens, max_block_rows, 0));

  DeviceTopology& d = u.topology;
  d.block_size = B;
  d.block_cols = static_cast<int>(t.block_cols);
  d.blocks_per_expert = blocks_per_expert;
  d.max_block_rows = max_block_rows;
  d.max_nnz = max_nnz;
  d.block_rows = u.block_rows.data();
  d.nnz = u.nnz.data();
  d.offsets = u.offsets.data();
  d.row_indices = u.row_indices.data();
  d.column_indices = u.column_indices.data();
  d.column_offsets = u.column_offsets.data();
  d.transpose_indices = u.transpose_indices.data();
  d.block_row_expert = u.block_row_expert.data();
  d.block_row_tokens = u.block_row_tokens.data();
  return u;
}

}  // namespace moe::cuda
