// moe/topology.cu: the kernel of moe/topology.h: one thread per block row, block column and
// block, each a closed form of row_offsets. Build: cmake --build build-gpu --target moe_cuda.
#include "moe/topology.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/dependent_launch.h"  // launch_dependent, wait_for_previous_grid
#include "core/launch_checks.h"     // check_fits_int32, check_range

namespace moe::cuda {

namespace {

constexpr int kThreads = 256;

// The expert owning dense row `row`: the last e with row_offsets[e] <= row. Empty experts have
// row_offsets[e] == row_offsets[e+1] and are skipped, because the search takes the LAST such e.
__device__ int expert_of_row(const int* row_offsets, int num_experts, int row) {  // [E+1]
  int low = 0, high = num_experts;  // answer in [low, high)
  while (high - low > 1) {
    const int middle = (low + high) / 2;
    if (row_offsets[middle] <= row) low = middle; else high = middle;
  }
  return low;
}

// Where block (local block row i, block column j) of expert e lands in column-major order.
__device__ int transposed_position(const int* row_offsets, int e, int j, int i, int block_size,
                                   int blocks_per_expert) {
  const int first_block_row = row_offsets[e] / block_size;
  const int expert_block_rows = (row_offsets[e + 1] - row_offsets[e]) / block_size;
  return first_block_row * blocks_per_expert + j * expert_block_rows + i;
}

// One kernel, three index spaces over one grid: thread i fills block row i (offsets,
// block_row_expert, block_row_tokens), block column i (column_offsets) and block i (row_indices,
// column_indices, transpose_indices). Block i's expert comes from its own binary search over
// row_offsets, not from block_row_expert: no thread waits for another, so one launch does it all
// (two kernels took 3.7 + 3.1 us on an H200 at T*K = 16384, E = 64, B = 128, most of it launch
// and latency; this one takes 3.8 us, ncu with caches flushed). row_offsets and kept_per_expert
// are first copied to shared memory, where the searches run.
__global__ void __launch_bounds__(kThreads) topology_kernel(const int* __restrict__ row_offsets,      // [E+1]
                                                            const int* __restrict__ kept_per_expert,  // [E]
                                                            const int* __restrict__ total_rows,       // [1]
                                                            int* __restrict__ block_rows_out,         // [1]
                                                            int* __restrict__ nnz_out,                // [1]
                                                            int* __restrict__ offsets,            // [max_block_rows + 1]
                                                            int* __restrict__ block_row_expert,   // [max_block_rows]
                                                            int* __restrict__ block_row_tokens,   // [max_block_rows]
                                                            int* __restrict__ column_offsets,     // [block_cols + 1]
                                                            int* __restrict__ row_indices,        // [max_nnz]
                                                            int* __restrict__ column_indices,     // [max_nnz]
                                                            int* __restrict__ transpose_indices,  // [max_nnz]
                                                            int num_experts, int block_size, int blocks_per_expert,
                                                            int max_block_rows, int block_cols, int max_nnz) {
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the previous kernel is done
  // row_offsets [E+1] and kept_per_expert [E], with total_rows, in one round of loads.
  extern __shared__ int plan_counts[];
  const int total = *total_rows;
  for (int i = threadIdx.x; i < 2 * num_experts + 1; i += blockDim.x) {
    plan_counts[i] = i <= num_experts ? row_offsets[i] : kept_per_expert[i - num_experts - 1];
  }
  __syncthreads();
  const int* const bins = plan_counts;                  // row_offsets
  const int* const kept = plan_counts + num_experts + 1;  // kept_per_expert
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  const int block_rows = total / block_size;
  const int nnz = block_rows * blocks_per_expert;
  if (index == 0) {
    *block_rows_out = block_rows;
    *nnz_out = nnz;
  }

  // ---- block rows ----
  if (index <= max_block_rows) offsets[index] = min(index, block_rows) * blocks_per_expert;
  if (index < max_block_rows) {
    const int e = index < block_rows ? expert_of_row(bins, num_experts, index * block_size) : -1;
    block_row_expert[index] = e;
    block_row_tokens[index] = e < 0 ? 0 : min(block_size, kept[e] - (index * block_size - bins[e]));
  }

  // ---- block columns ----
  if (index < block_cols) {
    const int e = index / blocks_per_expert, j = index % blocks_per_expert;
    column_offsets[index] = transposed_position(bins, e, j, 0, block_size, blocks_per_expert);
  } else if (index == block_cols) {
    column_offsets[index] = nnz;
  }

  // ---- blocks, in row-major BCSR order ----
  if (index >= max_nnz) return;
  if (index >= nnz) {
    // No used block scatters to a position >= nnz, so these writes never race with the scatter.
    row_indices[index] = -1;
    column_indices[index] = -1;
    transpose_indices[index] = -1;
    return;
  }
  const int block_row = index / blocks_per_expert, j = index % blocks_per_expert;
  const int e = expert_of_row(bins, num_experts, block_row * block_size);
  row_indices[index] = block_row;
  column_indices[index] = e * blocks_per_expert + j;
  const int local_block_row = block_row - bins[e] / block_size;
  transpose_indices[transposed_position(bins, e, j, local_block_row, block_size, blocks_per_expert)] = index;
}

unsigned blocks_for(int count) { return static_cast<unsigned>((count + kThreads - 1) / kThreads); }

}  // namespace

TopologyBuffers::TopologyBuffers(const MoeConfig& config) {
  validate(config);
  constexpr const char* function = "TopologyBuffers";
  if (config.formulation != Formulation::dropless) {
    throw std::invalid_argument(std::string(function) + ": formulation is " +
                                std::string(to_string(config.formulation)) +
                                "; the block-sparse topology exists only for the dropless formulation");
  }
  const int64_t T = config.tokens, K = config.top_k, E = config.num_experts, B = config.block_size;
  const int64_t blocks_per_expert = config.hidden_dim / B;  // validate(): H % B == 0 when dropless
  const int64_t max_rows = T * K + E * (B - 1);
  const int64_t max_block_rows = max_rows / B;
  detail::check_fits_int32(function, "max_rows = T*K + E*(B-1)", max_rows);
  detail::check_fits_int32(function, "block_cols = E*H/B", E * blocks_per_expert);
  detail::check_fits_int32(function, "max_nnz = max_block_rows * H/B", max_block_rows * blocks_per_expert);
  num_experts_ = static_cast<int>(E);
  block_size_ = static_cast<int>(B);
  blocks_per_expert_ = static_cast<int>(blocks_per_expert);
  block_cols_ = static_cast<int>(E * blocks_per_expert);
  max_block_rows_ = static_cast<int>(max_block_rows);
  max_nnz_ = static_cast<int>(max_block_rows * blocks_per_expert);

  block_rows = DeviceBuffer<int>(1);
  nnz = DeviceBuffer<int>(1);
  offsets = DeviceBuffer<int>(static_cast<size_t>(max_block_rows_) + 1);
  row_indices = DeviceBuffer<int>(static_cast<size_t>(max_nnz_));
  column_indices = DeviceBuffer<int>(static_cast<size_t>(max_nnz_));
  column_offsets = DeviceBuffer<int>(static_cast<size_t>(block_cols_) + 1);
  transpose_indices = DeviceBuffer<int>(static_cast<size_t>(max_nnz_));
  block_row_expert = DeviceBuffer<int>(static_cast<size_t>(max_block_rows_));
  block_row_tokens = DeviceBuffer<int>(static_cast<size_t>(max_block_rows_));
}

DeviceTopology TopologyBuffers::topology() const {
  DeviceTopology view;
  view.block_size = block_size_;
  view.block_cols = block_cols_;
  view.blocks_per_expert = blocks_per_expert_;
  view.max_block_rows = max_block_rows_;
  view.max_nnz = max_nnz_;
  view.block_rows = const_cast<int*>(block_rows.data());
  view.nnz = const_cast<int*>(nnz.data());
  view.offsets = const_cast<int*>(offsets.data());
  view.row_indices = const_cast<int*>(row_indices.data());
  view.column_indices = const_cast<int*>(column_indices.data());
  view.column_offsets = const_cast<int*>(column_offsets.data());
  view.transpose_indices = const_cast<int*>(transpose_indices.data());
  view.block_row_expert = const_cast<int*>(block_row_expert.data());
  view.block_row_tokens = const_cast<int*>(block_row_tokens.data());
  return view;
}

void build_topology(const DevicePlan& plan, TopologyBuffers& buffers, cudaStream_t stream) {
  constexpr const char* function = "build_topology";
  if (plan.capacity != 0) {
    throw std::invalid_argument(std::string(function) + ": plan.capacity = " + std::to_string(plan.capacity) +
                                "; expected 0, a dropless plan (the topology exists only for dropless)");
  }
  const DeviceTopology view = buffers.topology();
  detail::check_range(function, "plan.num_experts (E)", plan.num_experts, buffers.num_experts(),
                      buffers.num_experts(), "the E the TopologyBuffers were made for");
  detail::check_range(function, "plan.block_size (B)", plan.block_size, view.block_size, view.block_size,
                      "the B the TopologyBuffers were made for");
  detail::check_range(function, "plan.max_rows", plan.max_rows, 0,
                      static_cast<int64_t>(view.max_block_rows) * view.block_size + view.block_size - 1,
                      "the TopologyBuffers' max_block_rows * B (+ B-1)");
  detail::check_not_null(function, "plan.row_offsets", plan.row_offsets);
  detail::check_not_null(function, "plan.total_rows", plan.total_rows);
  detail::check_not_null(function, "plan.kept_per_expert", plan.kept_per_expert);

  const int threads = std::max({view.max_block_rows + 1, view.block_cols + 1, view.max_nnz});
  launch_dependent(
      topology_kernel, blocks_for(threads), kThreads, (2 * plan.num_experts + 1) * sizeof(int), stream, plan.row_offsets, plan.kept_per_expert, plan.total_rows, view.block_rows, view.nnz, view.offsets,
      view.block_row_expert, view.block_row_tokens, view.column_offsets, view.row_indices, view.column_indices,
      view.transpose_indices, plan.num_experts, view.block_size, view.blocks_per_expert, view.max_block_rows,
      view.block_cols, view.max_nnz);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
