// offload/device_slot_cache.h: DeviceSlotCache, an expert cache whose slot table lives on the GPU,
// so that an offloaded decode step never waits on the host and can be captured as one CUDA graph.
//
// OffloadedExperts (offloaded_experts.h) keeps its slot table on the host: each MoE block's routing
// is read back (a stream synchronisation), the host picks hits, misses and victims, and enqueues
// the copies. A block then costs a round trip through the host, and the step cannot be captured
// (a graph would replay one step's copies forever). Here the same decisions are made by a kernel:
//
//   plan     one warp reads the block's routing (top_experts, on the device), finds each chosen
//            expert's slot or evicts the least recently used one that nothing running may read,
//            writes the block's pointer tables and a list of copies
//   copy     a kernel reads the listed experts straight from pinned host memory (mapped into the
//            GPU's address space) and writes them into their slots: PCIe reads issued by SMs
//            instead of the copy engine, because a kernel can take its list from the device and a
//            cudaMemcpyAsync cannot
//
// Every call only enqueues work; nothing comes back to the host until the step's end:
//
//   acquire_on_device(i, top, compute)   on compute: wait for any prefetch copy still running, plan
//                                        block i (its misses evict the least recently used slots),
//                                        copy the misses; the block's tables are ready after it
//   prefetch_on_device(i+1, top, compute) after acquire(i): plan block i+1 without evicting block
//                                        i's slots, then copy on the cache's own stream (forked from
//                                        compute), so the copies overlap block i's experts
//
// The least-recently-used rule, exactly (tests/cuda/test_device_slot_cache.cpp replays it on the
// host): a clock counts acquires. An acquire ticks it, stamps each chosen expert that is resident
// (a hit) with the new time, then gives each missing expert, in ascending order, the slot with the
// smallest (stamp, slot index) among the slots stamped before this time (an empty slot's stamp is
// -1); that slot's old expert leaves the table. A prefetch does the same without ticking: the slots of the block that has just
// been acquired carry the current time and are never its victims; an expert it cannot place is
// dropped (counted), and its block's acquire copies it. Only an acquire writes pointer tables:
// chosen experts point at their slots, the others at a poison expert full of NaN (as
// OffloadedExperts), so a kernel that read an unchosen expert shows it.
//
// Size: every acquire must find its experts a slot, so the cache holds at least
// minimum_cache_slots(E, max_tokens, K) experts (the constructor refuses fewer); prefetches take
// what is left.
//
// Statistics stay on the GPU (per block: acquires, hits, misses, prefetch copies, prefetched experts
// later used, dropped prefetches, bytes copied) and come back with statistics(), a synchronising
// read. The copies' GPU time and the stalls are not timed (an event per copy would need the host).
//
// Dimension legend: D model width, H expert hidden width, E experts per MoE block, K top-k,
// C cache slots.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bf16.h"                    // bf16
#include "core/device_buffer.h"           // DeviceBuffer
#include "offload/expert_cache.h"         // OffloadStatistics
#include "offload/expert_source.h"        // ExpertSource, ExpertTables
#include "offload/pinned_expert_store.h"  // PinnedExpertStore

namespace moe::cuda {

struct DeviceSlotCacheOptions {
  int64_t cache_slots = 0;          // C
  int64_t max_tokens_per_step = 1;  // the most tokens one acquire serves (a prefill's N * P)
  int64_t top_k = 1;                // K
  int copy_blocks = 32;             // thread blocks of the copy kernel (its share of the SMs)
};

class DeviceSlotCache : public ExpertSource {
 public:
  // Throws std::invalid_argument when the options are out of range (C below what one acquire needs,
  // or above every expert of every block; copy_blocks outside 1..1024), and std::runtime_error when
  // the store's pinned memory is not mapped into the device's address space.
  DeviceSlotCache(const PinnedExpertStore& store, const DeviceSlotCacheOptions& options);
  ~DeviceSlotCache() override;
  DeviceSlotCache(const DeviceSlotCache&) = delete;
  DeviceSlotCache& operator=(const DeviceSlotCache&) = delete;

  bool needs_experts_on_host() const override { return false; }
  bool plans_on_device() const override { return true; }
  // The host interface of ExpertSource: refused (std::logic_error naming acquire_on_device).
  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;

  ExpertTables acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                 cudaStream_t compute) override;
  void prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots, cudaStream_t compute) override;

  OffloadStatistics statistics() const;  // synchronises with the device
  void reset_statistics();               // zeroes the counters (on the legacy stream, then waits)
  int64_t slots() const { return slots_; }
  cudaStream_t copy_stream() const { return copy_stream_; }  // the prefetches' copies run here
  size_t device_bytes() const;
  const PinnedExpertStore& store() const { return *store_; }

 private:
  void check_block(const char* function, int64_t block, int64_t slots) const;
  // The plan kernel on `stream`; returns its copy list (device).
  const int32_t* enqueue_plan(int64_t block, const int32_t* top_experts, int64_t slots, bool prefetch,
                              cudaStream_t stream);
  void enqueue_copies(const int32_t* copies, cudaStream_t stream);
  void join_prefetch(cudaStream_t compute);  // compute waits for the pending prefetch's copies, if any

  const PinnedExpertStore* store_ = nullptr;
  const bf16* host_experts_ = nullptr;  // the store's memory as the device addresses it
  int64_t blocks_ = 0, experts_ = 0, slots_ = 0, expert_elements_ = 0;
  int copy_blocks_ = 32;
  DeviceBuffer<bf16> slot_memory_;           // [C, expert_elements]
  DeviceBuffer<bf16> poison_;                // [expert_elements] NaN
  DeviceBuffer<const bf16*> tables_;         // [blocks, 2, E]: w1 pointers, then w2 pointers
  DeviceBuffer<int32_t> slot_of_;            // [blocks * E] -> slot, -1 when not resident
  DeviceBuffer<int32_t> expert_in_slot_;     // [C] -> block * E + e, -1 when empty
  DeviceBuffer<int64_t> stamp_;              // [C] the clock when last used
  DeviceBuffer<int32_t> prefetched_;         // [C] 1: filled by a prefetch, not yet used
  DeviceBuffer<int64_t> clock_;              // [1]
  DeviceBuffer<int32_t> copies_;             // [E + 1]: the count, then the listed experts' slots
  DeviceBuffer<int64_t> counters_;           // [blocks, kCounters]
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool prefetch_pending_ = false;  // a prefetch's copies were enqueued and no acquire has waited yet
};

}  // namespace moe::cuda
