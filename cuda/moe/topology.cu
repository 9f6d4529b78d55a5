// moe/topology.cu: the kernel of moe/topology.h: one thread per block row, block column and
// block, each a closed form of row_offsets. Build: cmake --build build-gpu --target moe_cuda.
#include "moe/topology.h"

#include <algorithm>
#include <cstdint>
#include <limits>
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

// ---- the column walk over M micro-batches (MicroBatchTopology) ----
// The same closed forms as topology_kernel, with expert e's block rows counted over every
// micro-batch: N[e] = sum_m (bins_m[e+1] - bins_m[e]) / B, and first[e] = sum_{e' < e} N[e']
// block rows before e in column-major order. Block (g = m*R + r, j) of expert e is the
//   before_m[e] + r - bins_m[e] / B
// -th block of its column, before_m[e] = micro-batch m's predecessors' block rows of e.
// Each CTA recomputes N and first in shared memory (E <= kRouterMaxExperts, M small: a few
// hundred loads of L2-resident ints), so one launch does it all, as topology_kernel does.
__global__ void __launch_bounds__(kThreads) micro_batch_topology_kernel(
    const int* __restrict__ row_offsets,   // [M, E+1] each micro-batch's bins
    int* __restrict__ block_rows_out,      // [1]
    int* __restrict__ nnz_out,             // [1]
    int* __restrict__ column_offsets,      // [block_cols + 1]
    int* __restrict__ row_indices,         // [M * R * H/B]
    int* __restrict__ transpose_indices,   // [M * R * H/B]
    int* __restrict__ block_row_expert,    // [M * R]
    int micro_batches, int num_experts, int block_size, int blocks_per_expert, int block_rows_per_micro_batch) {
  extern __shared__ int expert_counts[];  // [2E]: N[e], then first[e]
  int* const expert_block_rows = expert_counts;
  int* const first_block_row = expert_counts + num_experts;
  const int stride = num_experts + 1;  // one micro-batch's bins
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int n = 0;
    for (int m = 0; m < micro_batches; ++m) n += (row_offsets[m * stride + e + 1] - row_offsets[m * stride + e]) / block_size;
    expert_block_rows[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int e = 0; e < num_experts; ++e) {
      first_block_row[e] = sum;
      sum += expert_block_rows[e];
    }
  }
  __syncthreads();
  const int R = block_rows_per_micro_batch;
  const int all_block_rows = micro_batches * R, max_nnz = all_block_rows * blocks_per_expert;
  const int block_cols = num_experts * blocks_per_expert;
  const int used_blocks = (first_block_row[num_experts - 1] + expert_block_rows[num_experts - 1]) * blocks_per_expert;
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  if (index == 0) {
    *block_rows_out = all_block_rows;
    *nnz_out = max_nnz;
  }

  // ---- block columns ----
  if (index < block_cols) {
    const int e = index / blocks_per_expert, j = index % blocks_per_expert;
    column_offsets[index] = first_block_row[e] * blocks_per_expert + j * expert_block_rows[e];
  } else if (index == block_cols) {
    column_offsets[index] = used_blocks;
  }

  // ---- block rows: micro-batch m's block row r, or -1 past its routed ones ----
  if (index < all_block_rows) {
    const int m = index / R, r = index % R;
    const int* bins = row_offsets + m * stride;
    block_row_expert[index] = r * block_size < bins[num_experts] ? expert_of_row(bins, num_experts, r * block_size) : -1;
  }

  // ---- blocks ----
  if (index >= max_nnz) return;
  if (index >= used_blocks) transpose_indices[index] = -1;  // no used block scatters this far: no race
  const int g = index / blocks_per_expert, j = index % blocks_per_expert;
  row_indices[index] = g;
  const int m = g / R, r = g % R;
  const int* bins = row_offsets + m * stride;
  if (r * block_size >= bins[num_experts]) return;  // past micro-batch m's routed block rows
  const int e = expert_of_row(bins, num_experts, r * block_size);
  int before = 0;  // block rows of e in micro-batches 0 .. m-1
  for (int earlier = 0; earlier < m; ++earlier) {
    before += (row_offsets[earlier * stride + e + 1] - row_offsets[earlier * stride + e]) / block_size;
  }
  const int position = before + r - bins[e] / block_size;
  transpose_indices[first_block_row[e] * blocks_per_expert + j * expert_block_rows[e] + position] = index;
}

// ---- compaction (MicroBatchTopology::build_compacted) ----
// One thread a compacted row, and a compacted block row: N_e and the compacted bins are recomputed
// in shared memory by every CTA (E ints, M small), as the kernels above do.
__global__ void __launch_bounds__(kThreads) compact_rows_kernel(
    const int* __restrict__ row_offsets,      // [M, E+1] each micro-batch's bins
    const int* __restrict__ kept,             // [M, E]
    int* __restrict__ bins_out,               // [E+1] the compacted bins
    int* __restrict__ sources,                // [max_rows] slot-layout row, or -1
    int* __restrict__ block_row_tokens,       // [max_rows / B]
    int micro_batches, int num_experts, int block_size, int slot_rows, int max_rows) {
  extern __shared__ int shared[];  // [2E + 1]: N[e], then bins[e]
  int* const total = shared;
  int* const bins = shared + num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int n = 0;
    for (int m = 0; m < micro_batches; ++m) n += kept[m * num_experts + e];
    total[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bins[0] = 0;
    for (int e = 0; e < num_experts; ++e) bins[e + 1] = bins[e] + (total[e] + block_size - 1) / block_size * block_size;
  }
  __syncthreads();
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  if (index <= num_experts) bins_out[index] = bins[index];
  if (index < max_rows / block_size) {
    const int first = index * block_size;
    int tokens = 0;
    if (first < bins[num_experts]) {
      const int e = expert_of_row(bins, num_experts, first);
      tokens = min(block_size, total[e] - (first - bins[e]));
    }
    block_row_tokens[index] = tokens;
  }
  if (index >= max_rows) return;
  int source = -1;
  if (index < bins[num_experts]) {
    const int e = expert_of_row(bins, num_experts, index);
    int i = index - bins[e];  // expert e's i-th row over the micro-batches in order
    for (int m = 0; m < micro_batches && i < total[e]; ++m) {
      const int k = kept[m * num_experts + e];
      if (i < k) {
        source = m * slot_rows + row_offsets[m * (num_experts + 1) + e] + i;
        break;
      }
      i -= k;
    }
  }
  sources[index] = source;
}

// Element (row, column) of a [rows, width] matrix, row-major or in B x B blocks block row by block row.
__device__ inline int64_t element_of(int64_t row, int column, int width, int block_size, bool blocked) {
  if (!blocked) return row * width + column;
  return ((row / block_size) * (width / block_size) + column / block_size) * int64_t{block_size} * block_size +
         (row % block_size) * block_size + column % block_size;
}

// 16 bytes a thread, grid-stride over the used rows' chunks.
__global__ void gather_compacted_kernel(const bf16* __restrict__ src, bf16* __restrict__ dst,
                                        const int* __restrict__ sources, const int* __restrict__ bins, int num_experts,
                                        int width, int block_size, bool blocked) {
  const int chunks = width / 8;
  const int64_t used = int64_t{bins[num_experts]} * chunks;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < used; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / chunks;
    const int column = int(i % chunks) * 8;
    const int source = sources[row];
    uint4 value = make_uint4(0, 0, 0, 0);
    if (source >= 0) value = *reinterpret_cast<const uint4*>(src + element_of(source, column, width, block_size, blocked));
    *reinterpret_cast<uint4*>(dst + element_of(row, column, width, block_size, blocked)) = value;
  }
}

// validate(config), and the formulation dropless: the block-sparse topology exists only there.
void validate_dropless(const char* function, const MoeConfig& config) {
  validate(config);
  if (config.formulation != Formulation::dropless) {
    throw std::invalid_argument(std::string(function) + ": formulation is " +
                                std::string(to_string(config.formulation)) +
                                "; the block-sparse topology exists only for the dropless formulation");
  }
}

}  // namespace

// ---- TopologyArrays ----

void TopologyArrays::allocate(int max_block_rows, int blocks_per_expert, int block_cols, bool row_side) {
  const size_t block_rows_bound = static_cast<size_t>(max_block_rows);
  const size_t max_nnz = block_rows_bound * static_cast<size_t>(blocks_per_expert);
  block_rows = DeviceBuffer<int>(1);
  nnz = DeviceBuffer<int>(1);
  if (row_side) {
    offsets = DeviceBuffer<int>(block_rows_bound + 1);
    column_indices = DeviceBuffer<int>(max_nnz);
  }
  row_indices = DeviceBuffer<int>(max_nnz);
  column_offsets = DeviceBuffer<int>(static_cast<size_t>(block_cols) + 1);
  transpose_indices = DeviceBuffer<int>(max_nnz);
  block_row_expert = DeviceBuffer<int>(block_rows_bound);
  block_row_tokens = DeviceBuffer<int>(block_rows_bound);
}

DeviceTopology TopologyArrays::view(int block_size, int blocks_per_expert, int block_cols, int max_block_rows) const {
  // The view hands out non-const pointers: the kernels that build the topology write through them.
  auto writable = [](const DeviceBuffer<int>& array) { return const_cast<int*>(array.data()); };
  return DeviceTopology{.block_size = block_size,
                        .block_cols = block_cols,
                        .blocks_per_expert = blocks_per_expert,
                        .max_block_rows = max_block_rows,
                        .max_nnz = max_block_rows * blocks_per_expert,
                        .block_rows = writable(block_rows),
                        .nnz = writable(nnz),
                        .offsets = writable(offsets),
                        .row_indices = writable(row_indices),
                        .column_indices = writable(column_indices),
                        .column_offsets = writable(column_offsets),
                        .transpose_indices = writable(transpose_indices),
                        .block_row_expert = writable(block_row_expert),
                        .block_row_tokens = writable(block_row_tokens)};
}

// ---- TopologyBuffers ----

TopologyBuffers::TopologyBuffers(const MoeConfig& config) {
  constexpr const char* function = "TopologyBuffers";
  validate_dropless(function, config);
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
  allocate(max_block_rows_, blocks_per_expert_, block_cols_, /*row_side=*/true);
}

DeviceTopology TopologyBuffers::topology() const {
  return view(block_size_, blocks_per_expert_, block_cols_, max_block_rows_);
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
  detail::check_not_null(function, {{"plan.row_offsets", plan.row_offsets}, {"plan.total_rows", plan.total_rows},
                                    {"plan.kept_per_expert", plan.kept_per_expert}});

  const int threads = std::max({view.max_block_rows + 1, view.block_cols + 1, view.max_nnz});
  launch_dependent(
      topology_kernel, blocks_for(threads), kThreads, (2 * plan.num_experts + 1) * sizeof(int), stream, plan.row_offsets, plan.kept_per_expert, plan.total_rows, view.block_rows, view.nnz, view.offsets,
      view.block_row_expert, view.block_row_tokens, view.column_offsets, view.row_indices, view.column_indices,
      view.transpose_indices, plan.num_experts, view.block_size, view.blocks_per_expert, view.max_block_rows,
      view.block_cols, view.max_nnz);
  CUDA_CHECK(cudaGetLastError());
}

// ---- MicroBatchTopology ----

MicroBatchTopology::MicroBatchTopology(const MoeConfig& config, int micro_batches) {
  constexpr const char* function = "MicroBatchTopology";
  validate_dropless(function, config);
  detail::check_range(function, "micro_batches (M)", micro_batches, 1, std::numeric_limits<int32_t>::max());
  const int64_t T = config.tokens, K = config.top_k, E = config.num_experts, B = config.block_size;
  const int64_t blocks_per_expert = config.hidden_dim / B;
  const int64_t R = (T * K + E * (B - 1)) / B;  // one micro-batch's max_block_rows (TopologyBuffers)
  detail::check_range(function, "M * max_block_rows (the block rows of all micro-batches)", micro_batches * R, 0, 65535,
                      "65535, a grid's y dimension: fewer micro-batches or fewer tokens per micro-batch");
  detail::check_fits_int32(function, "M * max_nnz", micro_batches * R * blocks_per_expert);
  micro_batches_ = micro_batches;
  num_experts_ = static_cast<int>(E);
  block_size_ = static_cast<int>(B);
  blocks_per_expert_ = static_cast<int>(blocks_per_expert);
  block_rows_per_micro_batch_ = static_cast<int>(R);
  row_offsets_ = DeviceBuffer<int>(static_cast<size_t>(micro_batches) * (E + 1));
  kept_ = DeviceBuffer<int>(static_cast<size_t>(micro_batches) * E);
  arrays_.allocate(static_cast<int>(micro_batches * R), blocks_per_expert_, static_cast<int>(E * blocks_per_expert),
                   /*row_side=*/false);
  compacted_block_rows_ = static_cast<int>((micro_batches * T * K + E * (B - 1)) / B);  // <= M * R
  compacted_bins_ = DeviceBuffer<int>(static_cast<size_t>(E + 1));
  compacted_sources_ = DeviceBuffer<int>(static_cast<size_t>(compacted_block_rows_) * static_cast<size_t>(B));
  compacted_arrays_.allocate(compacted_block_rows_, blocks_per_expert_, static_cast<int>(E * blocks_per_expert),
                             /*row_side=*/false);
}

void MicroBatchTopology::record(int micro_batch, const DevicePlan& plan, const TopologyBuffers& topology,
                                cudaStream_t stream) {
  constexpr const char* function = "MicroBatchTopology::record";
  detail::check_range(function, "micro_batch", micro_batch, 0, micro_batches_ - 1, "M - 1");
  const DeviceTopology view = topology.topology();
  detail::check_range(function, "plan.num_experts (E)", plan.num_experts, num_experts_, num_experts_,
                      "the E the MicroBatchTopology was made for");
  detail::check_range(function, "topology.max_block_rows", view.max_block_rows, block_rows_per_micro_batch_,
                      block_rows_per_micro_batch_, "one micro-batch's max_block_rows, as made for");
  detail::check_not_null(function, "plan.row_offsets", plan.row_offsets);
  const size_t bins = static_cast<size_t>(num_experts_) + 1, R = static_cast<size_t>(block_rows_per_micro_batch_);
  CUDA_CHECK(cudaMemcpyAsync(row_offsets_.data() + micro_batch * bins, plan.row_offsets, bins * sizeof(int),
                             cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(arrays_.block_row_tokens.data() + micro_batch * R, view.block_row_tokens,
                             R * sizeof(int), cudaMemcpyDeviceToDevice, stream));
  detail::check_not_null(function, "plan.kept_per_expert", plan.kept_per_expert);
  CUDA_CHECK(cudaMemcpyAsync(kept_.data() + micro_batch * static_cast<size_t>(num_experts_), plan.kept_per_expert,
                             static_cast<size_t>(num_experts_) * sizeof(int), cudaMemcpyDeviceToDevice, stream));
}

void MicroBatchTopology::build(cudaStream_t stream) {
  const int all_block_rows = micro_batches_ * block_rows_per_micro_batch_;
  const int block_cols = num_experts_ * blocks_per_expert_;
  const int threads = std::max({all_block_rows, block_cols + 1, all_block_rows * blocks_per_expert_});
  micro_batch_topology_kernel<<<blocks_for(threads), kThreads, 2 * num_experts_ * sizeof(int), stream>>>(
      row_offsets_.data(), arrays_.block_rows.data(), arrays_.nnz.data(), arrays_.column_offsets.data(),
      arrays_.row_indices.data(), arrays_.transpose_indices.data(), arrays_.block_row_expert.data(), micro_batches_,
      num_experts_, block_size_, blocks_per_expert_, block_rows_per_micro_batch_);
  CUDA_CHECK(cudaGetLastError());
}

void MicroBatchTopology::build_compacted(cudaStream_t stream) {
  const int rows = compacted_block_rows_ * block_size_;
  const int slot_rows = block_rows_per_micro_batch_ * block_size_;
  compact_rows_kernel<<<blocks_for(std::max(rows, num_experts_ + 1)), kThreads,
                        (2 * num_experts_ + 1) * sizeof(int), stream>>>(
      row_offsets_.data(), kept_.data(), compacted_bins_.data(), compacted_sources_.data(),
      compacted_arrays_.block_row_tokens.data(), micro_batches_, num_experts_, block_size_, slot_rows, rows);
  CUDA_CHECK(cudaGetLastError());
  // The compacted layout's column walk: the slot layout's closed forms for one "micro-batch" whose
  // bins are the compacted ones.
  const int block_cols = num_experts_ * blocks_per_expert_;
  const int threads = std::max({compacted_block_rows_, block_cols + 1, compacted_block_rows_ * blocks_per_expert_});
  micro_batch_topology_kernel<<<blocks_for(threads), kThreads, 2 * num_experts_ * sizeof(int), stream>>>(
      compacted_bins_.data(), compacted_arrays_.block_rows.data(), compacted_arrays_.nnz.data(),
      compacted_arrays_.column_offsets.data(), compacted_arrays_.row_indices.data(),
      compacted_arrays_.transpose_indices.data(), compacted_arrays_.block_row_expert.data(), 1, num_experts_,
      block_size_, blocks_per_expert_, compacted_block_rows_);
  CUDA_CHECK(cudaGetLastError());
}

DeviceTopology MicroBatchTopology::compacted_topology() const {
  return compacted_arrays_.view(block_size_, blocks_per_expert_, num_experts_ * blocks_per_expert_,
                                compacted_block_rows_);
}

void gather_compacted(const MicroBatchTopology& topology, const bf16* src, bf16* dst, int width, bool blocked,
                      cudaStream_t stream) {
  constexpr const char* function = "gather_compacted";
  detail::check_not_null(function, "src", src);
  detail::check_not_null(function, "dst", dst);
  if (width <= 0 || width % 8 != 0 || (blocked && width % topology.block_size() != 0)) {
    throw std::invalid_argument(std::string(function) + ": width = " + std::to_string(width) +
                                "; allowed: a positive multiple of 8 (and of B when blocked)");
  }
  const int64_t chunks = topology.compacted_rows() * (width / 8);
  constexpr int64_t kMostBlocks = 2048;  // grid-stride beyond this: enough CTAs to fill any GPU
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, kMostBlocks));
  gather_compacted_kernel<<<std::max(blocks, 1u), kThreads, 0, stream>>>(
      src, dst, topology.compacted_sources(), topology.compacted_bins(), topology.num_experts(), width,
      topology.block_size(), blocked);
  CUDA_CHECK(cudaGetLastError());
}

DeviceTopology MicroBatchTopology::topology() const {
  // offsets and column_indices stay null: the walk has no row side
  return arrays_.view(block_size_, blocks_per_expert_, num_experts_ * blocks_per_expert_,
                      micro_batches_ * block_rows_per_micro_batch_);
}

}  // namespace moe::cuda
