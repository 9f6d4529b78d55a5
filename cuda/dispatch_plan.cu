// dispatch_plan.cu: the plan-building kernels of dispatch_plan.h (histogram, per-expert scan, CUB's stable
// radix sort, row assignment). Build: cmake --build build-gpu --target moe_cuda.
#include "dispatch_plan.h"

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"     // CUDA_CHECK
#include "launch_checks.h"  // check_range, check_fits_int32, check_not_null

namespace moe::cuda {

namespace {

constexpr int kHistogramThreads = 256;
constexpr int kMaxHistogramExperts = 8192;  // shared-memory bins: 32 KiB
constexpr int kScanThreads = 1024;          // one block scans all E experts, 1024 at a time
constexpr int kSlotThreads = 256;

// ---- 1. histogram ----
// Bins in shared memory first: a block's slots mostly hit a few hot experts, and shared atomics on
// them are far cheaper than global ones. Integer atomics, so the counts are exact and deterministic.
__global__ void expert_histogram_kernel(const int* __restrict__ top_experts,  // [T*K]
                                        int* __restrict__ tokens_per_expert,  // [E], zeroed
                                        int* __restrict__ invalid_slots,      // [1], zeroed
                                        int slots, int num_experts) {
  extern __shared__ int bins[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) bins[e] = 0;
  __syncthreads();
  int invalid = 0;
  for (int slot = blockIdx.x * blockDim.x + threadIdx.x; slot < slots; slot += gridDim.x * blockDim.x) {
    const int expert = top_experts[slot];
    if (expert >= 0 && expert < num_experts) {
      atomicAdd(&bins[expert], 1);
    } else {
      ++invalid;
    }
  }
  if (invalid > 0) atomicAdd(invalid_slots, invalid);
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if (bins[e] > 0) atomicAdd(&tokens_per_expert[e], bins[e]);
  }
}

// ---- 2. rows per expert and the two exclusive prefix sums, in one block ----
__global__ void __launch_bounds__(kScanThreads) expert_rows_kernel(const int* __restrict__ tokens_per_expert,  // [E]
                                   int* __restrict__ routed_offsets,           // [E+1]
                                   int* __restrict__ kept_per_expert,          // [E]
                                   int* __restrict__ row_offsets,              // [E+1]
                                   int* __restrict__ total_rows,               // [1]
                                   int num_experts, Formulation formulation, int capacity,
                                   int block_size) {
  using BlockScan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  int routed_carry = 0, row_carry = 0;  // totals of the chunks before this one
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int count = e < num_experts ? tokens_per_expert[e] : 0;
    int kept = count, rows = count;
    if (formulation == Formulation::dropping) {
      kept = min(count, capacity);
      rows = kept;
    } else if (formulation == Formulation::padded) {
      kept = min(count, capacity);
      rows = capacity;  // GShard / Tutel: every expert computes C rows, empty ones are zeros
    } else {
      rows = (count + block_size - 1) / block_size * block_size;  // MegaBlocks: round up to B
    }
    if (e >= num_experts) rows = 0;
    int routed_before = 0, rows_before = 0, routed_chunk = 0, rows_chunk = 0;
    BlockScan(scan_storage).ExclusiveSum(count, routed_before, routed_chunk);
    __syncthreads();  // scan_storage is reused by the second scan
    BlockScan(scan_storage).ExclusiveSum(rows, rows_before, rows_chunk);
    __syncthreads();
    if (e < num_experts) {
      routed_offsets[e] = routed_carry + routed_before;
      kept_per_expert[e] = kept;
      row_offsets[e] = row_carry + rows_before;
    }
    routed_carry += routed_chunk;
    row_carry += rows_chunk;
  }
  if (threadIdx.x == 0) {
    routed_offsets[num_experts] = routed_carry;
    row_offsets[num_experts] = row_carry;
    *total_rows = row_carry;
  }
}

// ---- 3. the sort's values ----
__global__ void slot_numbers_kernel(int* __restrict__ slot_numbers, int slots) {  // [T*K]
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;
  if (slot < slots) slot_numbers[slot] = slot;
}

// ---- 4. rows from sorted positions ----
// Position i of the sorted slots is the (i - routed_offsets[e])-th slot of expert e in token order;
// it gets a row while that rank is below the expert's kept count. Every slot is visited once, so
// slot_row is fully written; row_slot keeps the -1 of its memset where no slot lands.
__global__ void assign_rows_kernel(const int* __restrict__ sorted_experts,   // [T*K]
                                   const int* __restrict__ routed_slots,     // [T*K]
                                   const int* __restrict__ routed_offsets,   // [E+1]
                                   const int* __restrict__ kept_per_expert,  // [E]
                                   const int* __restrict__ row_offsets,      // [E+1]
                                   int* __restrict__ row_slot,               // [max_rows], all -1
                                   int* __restrict__ slot_row,               // [T*K]
                                   int slots, int num_experts) {
  const int position = blockIdx.x * blockDim.x + threadIdx.x;
  if (position >= slots) return;
  const int expert = sorted_experts[position];
  const int slot = routed_slots[position];
  if (expert < 0 || expert >= num_experts) {  // counted in invalid_slots by the histogram
    slot_row[slot] = -1;
    return;
  }
  const int rank = position - routed_offsets[expert];
  if (rank < kept_per_expert[expert]) {
    const int row = row_offsets[expert] + rank;
    row_slot[row] = slot;
    slot_row[slot] = row;
  } else {
    slot_row[slot] = -1;  // past capacity: dropped (dropping and padded only)
  }
}

int bits_for(int largest_value) {  // bits needed to write 0 .. largest_value; at least 1
  int bits = 1;
  while (bits < 31 && (1 << bits) <= largest_value) ++bits;
  return bits;
}

}  // namespace

DispatchPlanBuffers::DispatchPlanBuffers(const MoeConfig& config) {
  validate(config);
  constexpr const char* function = "DispatchPlanBuffers";
  const int64_t T = config.tokens, K = config.top_k, E = config.num_experts, B = config.block_size;
  detail::check_fits_int32(function, "T * K", T * K);
  detail::check_range(function, "num_experts (E)", E, 1, kMaxHistogramExperts,
                      "the histogram keeps E bins in shared memory");
  int64_t capacity_rows = 0, max_rows = 0;
  if (config.formulation == Formulation::dropless) {
    max_rows = T * K + E * (B - 1);
  } else {
    capacity_rows = moe::capacity(config);
    detail::check_fits_int32(function, "capacity (C)", capacity_rows);
    max_rows = E * capacity_rows;
  }
  detail::check_fits_int32(function, "max_rows", max_rows);

  formulation_ = config.formulation;
  tokens_ = static_cast<int>(T);
  top_k_ = static_cast<int>(K);
  num_experts_ = static_cast<int>(E);
  capacity_ = static_cast<int>(capacity_rows);
  block_size_ = static_cast<int>(B);
  max_rows_ = static_cast<int>(max_rows);
  sort_end_bit_ = bits_for(num_experts_ - 1);

  const size_t slots = static_cast<size_t>(T * K);
  tokens_per_expert = DeviceBuffer<int>(E);
  routed_offsets = DeviceBuffer<int>(E + 1);
  routed_slots = DeviceBuffer<int>(slots);
  kept_per_expert = DeviceBuffer<int>(E);
  row_offsets = DeviceBuffer<int>(E + 1);
  row_slot = DeviceBuffer<int>(static_cast<size_t>(max_rows));
  slot_row = DeviceBuffer<int>(slots);
  total_rows = DeviceBuffer<int>(1);
  invalid_slots = DeviceBuffer<int>(1);
  slot_numbers_ = DeviceBuffer<int>(slots);
  sorted_experts_ = DeviceBuffer<int>(slots);

  // Asking CUB for its scratch size touches no device memory: a host-only query.
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const int*>(nullptr),
                                             static_cast<int*>(nullptr), static_cast<const int*>(nullptr),
                                             static_cast<int*>(nullptr), static_cast<int>(slots), 0,
                                             sort_end_bit_));
  sort_temp_ = DeviceBuffer<unsigned char>(temp_bytes > 0 ? temp_bytes : 1);
}

DevicePlan DispatchPlanBuffers::plan() const {
  DevicePlan view;
  view.tokens = tokens_;
  view.top_k = top_k_;
  view.num_experts = num_experts_;
  view.capacity = capacity_;
  view.block_size = block_size_;
  view.max_rows = max_rows_;
  // The view hands out non-const pointers: the kernels that build the plan write through them.
  view.tokens_per_expert = const_cast<int*>(tokens_per_expert.data());
  view.kept_per_expert = const_cast<int*>(kept_per_expert.data());
  view.row_offsets = const_cast<int*>(row_offsets.data());
  view.row_slot = const_cast<int*>(row_slot.data());
  view.slot_row = const_cast<int*>(slot_row.data());
  view.total_rows = const_cast<int*>(total_rows.data());
  return view;
}

void build_dispatch_plan(const int* top_experts, DispatchPlanBuffers& buffers, cudaStream_t stream) {
  detail::check_not_null("build_dispatch_plan", "top_experts", top_experts);
  const int slots = buffers.tokens_ * buffers.top_k_;
  const int E = buffers.num_experts_;

  CUDA_CHECK(cudaMemsetAsync(buffers.tokens_per_expert.data(), 0, buffers.tokens_per_expert.bytes(), stream));
  CUDA_CHECK(cudaMemsetAsync(buffers.invalid_slots.data(), 0, buffers.invalid_slots.bytes(), stream));
  // 0xFF bytes make every int -1: padding rows and rows past total_rows.
  buffers.row_slot.fill_bytes(0xFF, stream);

  // Enough blocks to fill the GPU at large T*K, few enough that each block's shared histogram
  // absorbs many slots before it touches global memory.
  const int histogram_blocks = std::min((slots + kHistogramThreads - 1) / kHistogramThreads, 1024);
  expert_histogram_kernel<<<histogram_blocks, kHistogramThreads, E * sizeof(int), stream>>>(
      top_experts, buffers.tokens_per_expert.data(), buffers.invalid_slots.data(), slots, E);
  CUDA_CHECK(cudaGetLastError());

  expert_rows_kernel<<<1, kScanThreads, 0, stream>>>(
      buffers.tokens_per_expert.data(), buffers.routed_offsets.data(), buffers.kept_per_expert.data(),
      buffers.row_offsets.data(), buffers.total_rows.data(), E, buffers.formulation_, buffers.capacity_,
      buffers.block_size_);
  CUDA_CHECK(cudaGetLastError());

  const unsigned slot_blocks = static_cast<unsigned>((slots + kSlotThreads - 1) / kSlotThreads);
  slot_numbers_kernel<<<slot_blocks, kSlotThreads, 0, stream>>>(buffers.slot_numbers_.data(), slots);
  CUDA_CHECK(cudaGetLastError());

  size_t temp_bytes = buffers.sort_temp_.bytes();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(buffers.sort_temp_.data(), temp_bytes, top_experts,
                                             buffers.sorted_experts_.data(), buffers.slot_numbers_.data(),
                                             buffers.routed_slots.data(), slots, 0, buffers.sort_end_bit_,
                                             stream));

  assign_rows_kernel<<<slot_blocks, kSlotThreads, 0, stream>>>(
      buffers.sorted_experts_.data(), buffers.routed_slots.data(), buffers.routed_offsets.data(),
      buffers.kept_per_expert.data(), buffers.row_offsets.data(), buffers.row_slot.data(),
      buffers.slot_row.data(), slots, E);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
