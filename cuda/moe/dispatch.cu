// moe/dispatch.cu: the plan-building kernels of moe/dispatch.h: a stable counting sort of the slots
// by expert (count per block, then scatter, whose blocks each scan the counts they need), with
// capacity and the slot <-> row maps computed on the way. Build: cmake --build build-gpu --target moe_cuda.
#include "moe/dispatch.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/dependent_launch.h"  // launch_dependent, wait_for_previous_grid
#include "core/launch_checks.h"     // check_range, check_fits_int32, check_not_null
#include "moe/router.h"             // kRouterMaxExperts: the plan sorts what the router chose

namespace moe::cuda {

namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kPlanWarps = 8;  // 256 threads per block in the count and scatter kernels
constexpr int kPlanThreads = kPlanWarps * kWarpSize;
// The scatter kernel keeps a cursor per (warp, expert) in shared memory: kPlanWarps * (E + 1) ints,
// so shared memory grows linearly with E: 8.0 KiB at the limit E = 256 (the count kernel needs
// only (E + 1) ints). The limit is the router's, kRouterMaxExperts: a larger E cannot be routed.
constexpr int kMaxPlanExperts = kRouterMaxExperts;
// Every scatter block reads the whole count matrix [E+1, blocks] (below): at most this many counts
// (32 KB), so blocks = min(slots / 256, kMaxPlanCounts / (E+1)); past that each warp takes more
// slots. T*K = 16384, E = 64: 64 blocks of 256 slots, 4160 counts, 16 KB read by each block.
constexpr int kMaxPlanCounts = 8192;
static_assert(kMaxPlanExperts + 1 <= 2 * kPlanThreads, "the per-expert scans take two bins a thread");
constexpr int kCountsPerThread = kMaxPlanCounts / kPlanThreads;  // 32: the matrix in one round of loads
static_assert((kPlanWarps + 5) * (kMaxPlanExperts + 1) * 4 + kMaxPlanCounts * 4 + 2048 <= 48 * 1024,
              "the scatter's shared memory (with cub's scan storage) fits the default 48 KiB");

// Block b of the count and scatter kernels owns the slots [b * slots_per_block, (b+1) * slots_per_block);
// warp w of it owns slots_per_warp consecutive slots from b * slots_per_block + w * slots_per_warp.
// Ids outside [0, E) go to an extra bin E: it sorts after every expert, so it moves no valid slot,
// and its total is invalid_slots.
__device__ int bin_of(int expert, int num_experts) {
  return expert >= 0 && expert < num_experts ? expert : num_experts;
}

// ---- 1. count: slots per (expert, block) ----
// Shared-memory bins, then one plain store per bin: block_counts is expert-major ([E+1, blocks]),
// the order in which the sort lays the slots out. Integer atomics: exact and deterministic.
__global__ void __launch_bounds__(kPlanThreads) count_slots_kernel(const int* __restrict__ top_experts,  // [T*K]
                                                                   int* __restrict__ block_counts,  // [E+1, blocks]
                                                                   int slots, int num_experts, int slots_per_block) {
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the previous kernel is done
  extern __shared__ int bins[];  // [E+1]
  for (int bin = threadIdx.x; bin <= num_experts; bin += blockDim.x) bins[bin] = 0;
  __syncthreads();
  const int begin = blockIdx.x * slots_per_block;  // below slots: the grid is ceil(slots / slots_per_block)
  const int end = begin + min(slots_per_block, slots - begin);
  for (int slot = begin + threadIdx.x; slot < end; slot += blockDim.x) {
    atomicAdd(&bins[bin_of(top_experts[slot], num_experts)], 1);
  }
  __syncthreads();
  for (int bin = threadIdx.x; bin <= num_experts; bin += blockDim.x) {
    block_counts[bin * gridDim.x + blockIdx.x] = bins[bin];
  }
}

// ---- 2. scatter: the offsets, then each slot to its sorted position and to its row ----
// Where does block b's first slot of expert e go? After all slots of experts < e, and after those of
// expert e in blocks < b: the exclusive scan of the counts in expert-major order. Every block
// computes the part it needs from the whole count matrix (16 KB at T*K = 16384, E = 64): per bin,
// the counts of all blocks and of the blocks before this one; then two block-wide scans over the
// E+1 bins give routed_offsets (slots) and row_offsets (rows). Repeating that small scan in every block costs
// less than a separate scanning kernel: one launch and one round trip to memory fewer, and no
// single block that the whole GPU waits for. Block 0 writes the per-expert arrays of the plan.
// Rows per expert: kept (min(count, C) when dropping or padded, count when dropless), rows (kept,
// C, or kept rounded up to B: MegaBlocks' padded bins).
//
// The scatter proper is stable: inside a block, slots of one expert keep slot order (= token
// order), and blocks follow each other in the offsets. Each warp first counts its own slots per
// expert, the block turns the warp counts into per-warp start positions, and each warp walks its
// slots again, 32 at a time in slot order: __match_any_sync groups the lanes holding the same
// expert, a lane's rank in its group is the number of group lanes below it, and the group's
// lowest lane advances the cursor. A slot whose rank inside its expert is below kept_per_expert
// gets a row; the others (past capacity: "tokens past C in token order are dropped") get
// slot_row = -1.
__global__ void __launch_bounds__(kPlanThreads) scatter_slots_kernel(const int* __restrict__ top_experts,   // [T*K]
                                                                     const int* __restrict__ block_counts,  // [E+1, blocks]
                                                                     int* __restrict__ tokens_per_expert,   // [E]
                                                                     int* __restrict__ routed_offsets,      // [E+1]
                                                                     int* __restrict__ kept_per_expert,     // [E]
                                                                     int* __restrict__ row_offsets,         // [E+1]
                                                                     int* __restrict__ total_rows,          // [1]
                                                                     int* __restrict__ invalid_slots,       // [1]
                                                                     int* __restrict__ routed_slots,  // [T*K]
                                                                     int* __restrict__ row_slot,      // [max_rows]
                                                                     int* __restrict__ slot_row,      // [T*K]
                                                                     int slots, int num_experts, int slots_per_warp,
                                                                     Formulation formulation, int capacity,
                                                                     int block_size, int max_rows) {
  wait_for_previous_grid();  // dependent_launch.h: read nothing before the previous kernel is done
  using BlockScan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  extern __shared__ int plan_shared[];
  const int bins = num_experts + 1;
  int* const cursor = plan_shared;                   // [kPlanWarps, E+1]: a warp's next position per bin
  int* const bin_count = cursor + kPlanWarps * bins;  // [E+1] slots of each bin, all blocks
  int* const bin_before = bin_count + bins;           // [E+1] slots of each bin in blocks before this one
  int* const bin_start = bin_before + bins;           // [E+1] routed_offsets
  int* const bin_rows = bin_start + bins;             // [E]   row_offsets
  int* const bin_kept = bin_rows + bins;              // [E]   kept_per_expert
  int* const staged_counts = bin_kept + bins;         // [E+1, blocks] block_counts
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int blocks = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);

  // Counts per bin, of all blocks and of the blocks before this one. The matrix is first staged in
  // shared memory: thread j loads the counts j, j + 256, ... (coalesced, and all its loads in flight
  // at once: one trip to memory, which overlaps the warp counts below); then each warp adds whole
  // bins. Integer sums: no order.
  const int entries = bins * blocks;
  int entry_count[kCountsPerThread];
#pragma unroll
  for (int i = 0; i < kCountsPerThread; ++i) {
    const int entry = static_cast<int>(threadIdx.x) + i * kPlanThreads;
    entry_count[i] = entry < entries ? block_counts[entry] : 0;
  }
  for (int i = threadIdx.x; i < kPlanWarps * bins; i += blockDim.x) cursor[i] = 0;
  __syncthreads();

  int* const warp_cursor = cursor + warp * bins;
  const long long first_slot = (static_cast<long long>(blockIdx.x) * kPlanWarps + warp) * slots_per_warp;
  const int begin = static_cast<int>(min(first_slot, 1LL * slots));
  const int end = begin + min(slots_per_warp, slots - begin);
  // Lanes past `end` take bin -1 and stay out of every group that is counted. The loops below run
  // the same trip count on every lane of a warp, as __match_any_sync and __shfl_sync need.
  for (int base = begin; base < end; base += kWarpSize) {
    const int slot = base + lane;
    const int bin = slot < end ? bin_of(top_experts[slot], num_experts) : -1;
    const unsigned peers = __match_any_sync(kFullMask, bin);
    if (bin >= 0 && lane == __ffs(peers) - 1) warp_cursor[bin] += __popc(peers);
    __syncwarp();  // the next round's group leader may be another lane
  }

#pragma unroll
  for (int i = 0; i < kCountsPerThread; ++i) {
    const int entry = static_cast<int>(threadIdx.x) + i * kPlanThreads;
    if (entry < entries) staged_counts[entry] = entry_count[i];
  }
  __syncthreads();
  for (int bin = warp; bin < bins; bin += kPlanWarps) {
    int all = 0, before = 0;
    for (int b = lane; b < blocks; b += kWarpSize) {
      const int count = staged_counts[bin * blocks + b];
      all += count;
      before += b < block ? count : 0;
    }
    all = __reduce_add_sync(kFullMask, all);
    before = __reduce_add_sync(kFullMask, before);
    if (lane == 0) {
      bin_count[bin] = all;
      bin_before[bin] = before;
    }
  }
  __syncthreads();

  // Thread j holds bins 2j and 2j+1 (blocked, as BlockScan wants): slots, kept and rows of each.
  int count[2], kept[2], rows[2], start[2], row_start[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int bin = 2 * static_cast<int>(threadIdx.x) + i;
    count[i] = bin < bins ? bin_count[bin] : 0;
    kept[i] = count[i];
    if (formulation == Formulation::dropping) {
      kept[i] = min(count[i], capacity);
      rows[i] = kept[i];
    } else if (formulation == Formulation::padded) {
      kept[i] = min(count[i], capacity);
      rows[i] = capacity;  // GShard / Tutel: every expert computes C rows, empty ones are zeros
    } else {
      rows[i] = (count[i] + block_size - 1) / block_size * block_size;  // MegaBlocks: round up to B
    }
    if (bin >= num_experts) rows[i] = 0;  // bin E (invalid ids) owns no rows
  }
  int slots_total = 0, rows_total = 0;
  BlockScan(scan_storage).ExclusiveSum(count, start, slots_total);
  __syncthreads();  // scan_storage is reused
  BlockScan(scan_storage).ExclusiveSum(rows, row_start, rows_total);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int bin = 2 * static_cast<int>(threadIdx.x) + i;
    if (bin < bins) bin_start[bin] = start[i];
    if (bin < num_experts) {
      bin_rows[bin] = row_start[i];
      bin_kept[bin] = kept[i];
      if (block == 0) {
        tokens_per_expert[bin] = count[i];
        routed_offsets[bin] = start[i];
        kept_per_expert[bin] = kept[i];
        row_offsets[bin] = row_start[i];
      }
    } else if (bin == num_experts && block == 0) {
      routed_offsets[bin] = start[i];
      row_offsets[bin] = rows_total;
      *total_rows = rows_total;
      *invalid_slots = count[i];  // bin E
    }
  }
  __syncthreads();  // bin_start, bin_rows and bin_kept are complete
  // The rows no slot lands on get row_slot = -1: each expert's rows past its kept slots (padding:
  // up to B - 1 dropless, C - kept padded), written by block e % blocks, and the rows from
  // total_rows to max_rows, spread over all blocks. No slot lands there, so these writes never race
  // with the scatter below. (A memset of the whole array before the plan did this once: one more
  // operation in the stream, and one that a programmatic dependent launch cannot overlap.)
  for (int e = block; e < num_experts; e += blocks) {
    const int last = e + 1 < num_experts ? bin_rows[e + 1] : rows_total;
    for (int row = bin_rows[e] + bin_kept[e] + static_cast<int>(threadIdx.x); row < last; row += kPlanThreads) {
      row_slot[row] = -1;
    }
  }
  for (int row = rows_total + block * kPlanThreads + static_cast<int>(threadIdx.x); row < max_rows;
       row += blocks * kPlanThreads) {
    row_slot[row] = -1;
  }
  // Warp counts -> warp start positions: warp w starts where warps < w of this block end.
  for (int bin = threadIdx.x; bin < bins; bin += blockDim.x) {
    int position = bin_start[bin] + bin_before[bin];
    for (int w = 0; w < kPlanWarps; ++w) {
      const int count_of_warp = cursor[w * bins + bin];
      cursor[w * bins + bin] = position;
      position += count_of_warp;
    }
  }
  __syncthreads();

  for (int base = begin; base < end; base += kWarpSize) {
    const int slot = base + lane;
    const int bin = slot < end ? bin_of(top_experts[slot], num_experts) : -1;
    const unsigned peers = __match_any_sync(kFullMask, bin);
    const int leader = __ffs(peers) - 1;
    int first = 0;  // the group's first position, read and advanced by its leader alone
    if (bin >= 0 && lane == leader) {
      first = warp_cursor[bin];
      warp_cursor[bin] = first + __popc(peers);
    }
    first = __shfl_sync(kFullMask, first, leader);
    __syncwarp();
    if (bin < 0) continue;
    const int position = first + __popc(peers & ((1u << lane) - 1u));  // group lanes below this one
    routed_slots[position] = slot;
    int row = -1;  // ids outside [0, E) (bin E) and slots past capacity get no row
    if (bin < num_experts) {
      const int rank = position - bin_start[bin];
      if (rank < bin_kept[bin]) row = bin_rows[bin] + rank;
    }
    if (row >= 0) row_slot[row] = slot;
    slot_row[slot] = row;
  }
}

}  // namespace

DispatchPlanBuffers::DispatchPlanBuffers(const MoeConfig& config) {
  validate(config);
  constexpr const char* function = "DispatchPlanBuffers";
  const int64_t T = config.tokens, K = config.top_k, E = config.num_experts, B = config.block_size;
  detail::check_fits_int32(function, "T * K", T * K);
  detail::check_range(function, "num_experts (E)", E, 1, kMaxPlanExperts,
                      "kRouterMaxExperts: the scatter keeps a cursor per (warp, expert) in shared memory");
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

  // One round of 32 slots per warp while the (expert, block) counts stay under kMaxPlanCounts;
  // beyond, more rounds per warp. T*K = 16384, E = 64: 64 blocks of 256 slots, 4160 counts.
  const int64_t slots = T * K;
  const int64_t max_blocks = std::max<int64_t>(1, kMaxPlanCounts / (E + 1));
  const int64_t rounds = std::max<int64_t>(1, (slots + kPlanThreads * max_blocks - 1) / (kPlanThreads * max_blocks));
  slots_per_warp_ = static_cast<int>(rounds * kWarpSize);
  plan_blocks_ = static_cast<int>((slots + kPlanWarps * slots_per_warp_ - 1) / (kPlanWarps * slots_per_warp_));

  tokens_per_expert = DeviceBuffer<int>(E);
  routed_offsets = DeviceBuffer<int>(E + 1);
  routed_slots = DeviceBuffer<int>(static_cast<size_t>(slots));
  kept_per_expert = DeviceBuffer<int>(E);
  row_offsets = DeviceBuffer<int>(E + 1);
  row_slot = DeviceBuffer<int>(static_cast<size_t>(max_rows));
  slot_row = DeviceBuffer<int>(static_cast<size_t>(slots));
  total_rows = DeviceBuffer<int>(1);
  invalid_slots = DeviceBuffer<int>(1);
  block_counts_ = DeviceBuffer<int>(static_cast<size_t>(E + 1) * plan_blocks_);
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
  const int blocks = buffers.plan_blocks_;
  const int slots_per_warp = buffers.slots_per_warp_;

  launch_dependent(count_slots_kernel, blocks, kPlanThreads, (E + 1) * sizeof(int), stream, top_experts,
                   buffers.block_counts_.data(), slots, E, kPlanWarps * slots_per_warp);
  CUDA_CHECK(cudaGetLastError());

  // cursor [8, E+1], then bin counts, counts before, starts, rows and kept: 13 (E+1) ints, and the
  // staged counts [E+1, blocks] <= kMaxPlanCounts ints: at most 45.4 KiB (E = 256), under the 48 KiB
  // a block gets without opting in.
  const size_t scatter_shared = (static_cast<size_t>(kPlanWarps + 5) * (E + 1) + size_t(E + 1) * blocks) * sizeof(int);
  launch_dependent(
      scatter_slots_kernel, blocks, kPlanThreads, scatter_shared, stream, top_experts, buffers.block_counts_.data(), buffers.tokens_per_expert.data(), buffers.routed_offsets.data(),
      buffers.kept_per_expert.data(), buffers.row_offsets.data(), buffers.total_rows.data(),
      buffers.invalid_slots.data(), buffers.routed_slots.data(), buffers.row_slot.data(), buffers.slot_row.data(),
      slots, E, slots_per_warp, buffers.formulation_, buffers.capacity_, buffers.block_size_, buffers.max_rows_);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
