// moe/dispatch.h: builds the dispatch plan (DevicePlan, device_plan.h) of the dropping, padded and
// dropless formulations on the GPU from the router's top_experts, with no host synchronisation.
// The CPU oracle is reference_cpu/dispatch.h: every array here equals its DispatchPlan namesake.
// Built into moe_cuda; tested by tests/cuda/test_dispatch.cpp (ctest --test-dir build -R CudaDispatch).
//
// Dimension legend: T tokens, E experts, K top-k, C capacity, B block size. Slot = t * K + k.
//
// A stable counting sort of the T*K slots by expert (the keys are expert ids in [0, E), so no
// radix passes are needed), in two kernels on the caller's stream:
//   1. count: each block counts its chunk of consecutive slots per expert (shared-memory bins).
//   2. scatter: each block first derives, from all blocks' counts, the exclusive sum of the counts
//      in expert-major order, (expert 0, block 0), (0, 1), ..., (1, 0), ...: where its first slot
//      of each expert goes. From the same counts: tokens_per_expert and routed_offsets; then
//      kept_per_expert (min(count, C) when dropping or padded, count when dropless), rows per expert
//      (kept, C, or kept rounded up to B: MegaBlocks' padded bins), row_offsets and total_rows
//      (block 0 writes them). Then the block writes its slots to their sorted positions in slot
//      order (a slot's rank among the earlier slots of its expert in its block, from
//      __match_any_sync and per-warp counts in shared memory). Stable, so inside one expert the
//      slots keep increasing slot order, which is token order: capacity then drops the LAST tokens
//      of an over-full expert, exactly as the reference does. The same kernel assigns rows: the slot
//      whose rank inside its expert is below kept_per_expert gets row_slot[row] = slot,
//      slot_row[slot] = row; else slot_row = -1.
// Every step is integer counting in a fixed order, so the plan is the same bits on every run.
// Why not a library radix sort (cub::DeviceRadixSort): with E <= 256 the counts of one pass are the
// whole sort, and the rows fall out of the scatter: two kernels, where the radix
// sort needed a histogram, a scan, the sort's own launches and a separate row pass. Why no scan
// kernel between the two: a single scanning block was the slowest of three, and the scan of E+1
// totals is cheap enough to repeat in each block. H200, ncu, T*K = 16384, E = 64, caches flushed:
// count 2.8 + scan 6.6 + scatter 4.4 us before, count 2.8 + scatter 6.0 us now.
// The scatter also sets row_slot to -1 on the rows no slot lands on, the padding rows AND the
// unused rows past total_rows, so a kernel launched over max_rows treats both alike.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstddef>

#include "core/device_buffer.h"  // DeviceBuffer
#include "moe/device_plan.h"     // DevicePlan
#include "moe_config.h"          // MoeConfig, Formulation

namespace moe::cuda {

// Owns the DevicePlan's arrays and the sort's (expert, block) counts, sized once from host-known bounds and reused
// every step:
//   max_rows = T*K + E*(B-1)  dropless: each expert adds at most B-1 padding rows to its T*K share
//            = E*C            dropping and padded: no expert owns more than C rows
class DispatchPlanBuffers {
 public:
  // validate(config); sizes from config.tokens, top_k, num_experts, formulation, capacity, block_size.
  // E <= kRouterMaxExperts (moe/router.h): the sort keeps a cursor per (warp, expert) in shared memory.
  explicit DispatchPlanBuffers(const MoeConfig& config);

  DevicePlan plan() const;  // a view of the arrays below, for the kernels that read the plan
  Formulation formulation() const { return formulation_; }
  int tokens() const { return tokens_; }
  int top_k() const { return top_k_; }
  int num_experts() const { return num_experts_; }
  int capacity() const { return capacity_; }
  int block_size() const { return block_size_; }
  int max_rows() const { return max_rows_; }

  DeviceBuffer<int> tokens_per_expert;  // [E]
  DeviceBuffer<int> routed_offsets;     // [E+1]  exclusive prefix sum of tokens_per_expert
  DeviceBuffer<int> routed_slots;       // [T*K]  every slot, grouped by expert, token order inside
  DeviceBuffer<int> kept_per_expert;    // [E]
  DeviceBuffer<int> row_offsets;        // [E+1]
  DeviceBuffer<int> row_slot;           // [max_rows] -1 for padding rows and rows past total_rows
  DeviceBuffer<int> slot_row;           // [T*K]  -1 for a dropped slot
  DeviceBuffer<int> total_rows;         // [1]
  DeviceBuffer<int> invalid_slots;      // [1]    slots whose expert id is outside [0, E); must be 0,
                                        //        else the plan's contents are undefined

 private:
  friend void build_dispatch_plan(const int* top_experts, DispatchPlanBuffers& buffers,
                                  cudaStream_t stream);
  Formulation formulation_ = Formulation::dropless;
  int tokens_ = 0, top_k_ = 0, num_experts_ = 0, capacity_ = 0, block_size_ = 0, max_rows_ = 0;
  int slots_per_warp_ = 32;             // the count and scatter kernels' partition of the slots
  int plan_blocks_ = 1;                 // their grid: ceil(T*K / (8 warps * slots_per_warp_))
  DeviceBuffer<int> block_counts_;      // [E+1, plan_blocks_] slots per (expert, block), expert-major;
                                        //   row E holds the ids outside [0, E)
};

// Fills `buffers` from top_experts [T, K] (T, K, E as given to the buffers' constructor), on
// `stream`, asynchronously. Expert ids must lie in [0, E); ids outside are counted in
// buffers.invalid_slots (read it in a test or a debug build; reading it every step would be the
// host synchronisation this design avoids).
void build_dispatch_plan(const int* top_experts,  // [T, K]
                         DispatchPlanBuffers& buffers, cudaStream_t stream);

}  // namespace moe::cuda
