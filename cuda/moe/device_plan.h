// device_plan.h: the dispatch plan and block-sparse topology of one MoE layer step, as they live in
// GPU memory. The routing kernels (moe/router.cu, topology.cu) write them; the expert kernels
// (block_sparse.cu, the cuBLAS paths) read them. The arrays mean exactly what the CPU reference's
// DispatchPlan and BlockSparseTopology mean (reference_cpu/dispatch.h, topology.h), so tests
// compare them one to one.
//
// The counts depend on the routing, which is only known on the GPU. To avoid reading them back
// (a host synchronisation per layer), buffers and grids are sized by host-known upper bounds and
// the true counts stay in device memory: a kernel launched for max_block_rows block rows reads
// *block_rows and lets the blocks past it exit at once.
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k,
// C capacity, B block size.
#pragma once

namespace moe::cuda {

struct DevicePlan {              // every pointer is device memory
  int tokens = 0;                // T
  int top_k = 0;                 // K
  int num_experts = 0;           // E
  int capacity = 0;              // C (dropping / padded); 0 for dropless
  int block_size = 0;            // B (dropless row rounding)
  int max_rows = 0;              // host-known bound on rows: T*K + E*(B-1) dropless, E*C padded
  int* tokens_per_expert = nullptr;  // [E]     routed slots per expert, before dropping
  int* kept_per_expert = nullptr;    // [E]
  int* row_offsets = nullptr;        // [E+1]   expert e owns rows [row_offsets[e], row_offsets[e+1])
  int* row_slot = nullptr;           // [max_rows] slot t*K+k feeding each row, -1 padding / unused
  int* slot_row = nullptr;           // [T*K]   row of each slot, -1 if dropped
  int* total_rows = nullptr;         // [1]     row_offsets[E]
};

struct DeviceTopology {          // BCSR of the hidden matrix [rows, E*H] in B x B blocks
  int block_size = 0;            // B
  int block_cols = 0;            // E*H/B
  int blocks_per_expert = 0;     // H/B: every block row holds exactly this many blocks
  int max_block_rows = 0;        // host-known bound: max_rows / B
  int max_nnz = 0;               // max_block_rows * blocks_per_expert
  int* block_rows = nullptr;         // [1]
  int* nnz = nullptr;                // [1]
  int* offsets = nullptr;            // [max_block_rows + 1]
  int* row_indices = nullptr;        // [max_nnz]
  int* column_indices = nullptr;     // [max_nnz]
  int* column_offsets = nullptr;     // [block_cols + 1]
  int* transpose_indices = nullptr;  // [max_nnz]
  int* block_row_expert = nullptr;   // [max_block_rows] the expert whose rows fill each block row
  int* block_row_tokens = nullptr;   // [max_block_rows] rows of each block row that hold a routed
                                     // slot (1..B; the rest are padding); 0 past block_rows
};

}  // namespace moe::cuda
