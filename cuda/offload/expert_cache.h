// offload/expert_cache.h: the expert cache of Pre-gated MoE: a pool of GPU slots, each holding one
// expert (w1 then w2, as in the pinned store), filled over PCIe on a copy stream of its own.
//
// Pre-gated MoE (Hwang et al., ISCA 2024) keeps only a few experts on the GPU: the ones a block
// needs now and the ones being fetched for the next block, so that "the expert migration of block
// i+1 overlaps the expert execution of block i". This class is that machinery, with no opinion on
// *which* experts to fetch (the decoding model's schedule decides, see expert_source.h):
//
//   acquire(block, experts)    the chosen experts become resident and pinned: hits are found in the
//                              map, misses are copied now (on demand), evicting by the policy
//   wait_for_copies(block, s)  stream s waits (cudaStreamWaitEvent) for those slots' copies: the
//                              GPU waits, the host never does
//   release(block, s)          s has enqueued every read of the block's slots: an event recorded on
//                              s marks their last use, and the slots become evictable
//   prefetch(block, experts)   copies the missing ones now, nobody waits; a hint, dropped when every
//                              slot is pinned
//
// Why the events. Three streams of work touch a slot: the copy stream writes it, the compute stream
// reads it, the host decides what goes where long before the GPU gets there. Two orderings keep the
// bytes right without a host wait:
//   write -> read   each copy records the slot's copy event; the compute stream waits on it before
//                   the block's kernels (wait_for_copies);
//   read -> write   release records a last-use event on the compute stream; before the copy stream
//                   overwrites an evicted slot it waits on that event (cudaStreamWaitEvent), so a
//                   kernel still reading the old expert is never overwritten under it.
// Both are GPU-side waits: the host runs ahead and keeps the copy engine busy.
//
// Statistics, per MoE block (statistics() waits for the outstanding copies to time them, so call it
// outside a timed loop):
//   hits / misses       chosen experts found in a slot / copied on demand by acquire
//   prefetched          experts copied by prefetch(); prefetched_used: of those, chosen by the
//                       block's next acquire before being evicted (prefetch accuracy = used / prefetched)
//   bytes_copied        host-to-device bytes of this block's experts
//   copy_ms             GPU time of those copies: CUDA events recorded on the copy stream right before
//                       and after each copy (with time_copies; bandwidth = bytes_copied / copy_ms)
//   stall_ms            GPU time the compute stream spent waiting for copies at wait_for_copies: an
//                       event on the compute stream before the waits and one after them; the first
//                       completes when compute reaches the waits, the second when the copies let it go
//   acquire_host_ms     host time inside acquire (issuing copies and waits; it never blocks)
//   host_wait_ms        host time spent blocked (OffloadedExperts' table ring, normally 0)
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns, E experts per MoE block.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "core/bf16.h"                   // bf16
#include "core/device_buffer.h"          // DeviceBuffer
#include "offload/cache_policy.h"        // CachePolicy, ExpertSlotMap
#include "offload/pinned_expert_store.h" // PinnedExpertStore

namespace moe::cuda {

struct BlockOffloadStatistics {
  int64_t acquires = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t prefetched = 0;
  int64_t prefetched_used = 0;
  int64_t prefetch_dropped = 0;  // prefetch hints not followed: every slot was pinned
  int64_t bytes_copied = 0;
  int64_t copies_timed = 0;
  double copy_ms = 0;
  double stall_ms = 0;
  double acquire_host_ms = 0;
  double host_wait_ms = 0;

  void add(const BlockOffloadStatistics& other);
  void subtract(const BlockOffloadStatistics& other);  // every counter minus other's: the counts since `other`
  double hit_rate() const;           // hits / (hits + misses); 0 when nothing was acquired
  double prefetch_accuracy() const;  // prefetched_used / prefetched; 0 when nothing was prefetched
  double copy_gb_per_s() const;      // bytes_copied / copy_ms; 0 when nothing was timed
};

struct OffloadStatistics {
  std::vector<BlockOffloadStatistics> blocks;  // [MoE blocks]
  BlockOffloadStatistics total() const;
};

class ExpertCache {
 public:
  // `slots` experts of store.expert_bytes() each, in one cudaMalloc. Throws std::invalid_argument
  // (check_cache_size's message) when slots < minimum_cache_slots(E, tokens_per_step, top_k): one
  // acquire of tokens_per_step tokens routed to top_k experts each must fit.
  // time_copies records CUDA events around every copy and stall (copy_ms, stall_ms).
  ExpertCache(const PinnedExpertStore& store, int64_t slots, CachePolicy policy, int64_t tokens_per_step,
              int64_t top_k, bool time_copies = true);
  ~ExpertCache();
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // Makes block `block`'s `experts` (ids in [0, E), sorted, unique) resident and pinned until
  // release(block): hits first, then each miss copied into the policy's victim. slot_addresses
  // [experts.size()] receives each expert's slot (w1 [D, W1] at the address, w2 [H, D] after it).
  // Throws std::invalid_argument on bad ids or when the free slots cannot hold the experts, and
  // std::logic_error when the block is already acquired; nothing changes then.
  void acquire(int64_t block, std::span<const int32_t> experts, std::span<const bf16*> slot_addresses);

  // Work enqueued on `compute` after this call sees the acquired slots' bytes: `compute` waits for
  // their copies (only those it has not already waited for).
  void wait_for_copies(int64_t block, cudaStream_t compute);

  // Every read of the block's slots is enqueued on `compute`: their last use is an event there, and
  // they may be evicted (the copy stream waits on that event before overwriting one).
  void release(int64_t block, cudaStream_t compute);

  // Copies block `block`'s missing `experts` now, on the copy stream; nobody waits.
  void prefetch(int64_t block, std::span<const int32_t> experts);

  // Throws std::invalid_argument unless 0 <= block < blocks and experts are sorted, unique, in [0, E).
  void validate(int64_t block, std::span<const int32_t> experts) const;

  int64_t slots() const { return slot_map_.slots(); }
  // Copies enqueued on the copy stream since construction (on demand and prefetched), counted on the
  // host as they are enqueued: no wait.
  int64_t copies_enqueued() const { return copies_enqueued_; }
  size_t bytes() const { return pool_.bytes(); }  // GPU memory of the slots
  const bf16* slot(int64_t slot) const;           // [D*W1 + H*D]
  const ExpertSlotMap& slot_map() const { return slot_map_; }
  cudaStream_t copy_stream() const { return copy_stream_; }
  const PinnedExpertStore& store() const { return store_; }

  // Times the outstanding copies (a host wait on the copy and compute streams' events) and returns
  // the counts since construction or the last reset.
  OffloadStatistics statistics();
  void reset_statistics();
  void record_host_time(int64_t block, double acquire_ms, double wait_ms);

 private:
  enum class CopyKind { on_demand, prefetch };
  struct TimedSpan {  // two timing events on one stream, read once the second completes
    int64_t block;
    bool is_copy;     // a copy (copy_ms) or a stall (stall_ms)
    cudaEvent_t start;
    cudaEvent_t end;
  };

  void copy_into(int64_t slot, int64_t block, int32_t expert, CopyKind kind);
  cudaEvent_t take_timing_event();
  void harvest_timings(bool wait);
  int take_release_event();
  void drop_release_event(int index);

  const PinnedExpertStore& store_;
  ExpertSlotMap slot_map_;
  bool time_copies_;
  DeviceBuffer<bf16> pool_;               // [slots, D*W1 + H*D]
  cudaStream_t copy_stream_ = nullptr;
  int64_t copies_enqueued_ = 0;

  // Per slot.
  std::vector<cudaEvent_t> copied_;       // recorded on the copy stream after each copy into the slot
  std::vector<std::optional<cudaStream_t>> waited_by_;  // the stream that already waited for the last copy
  std::vector<int> last_use_;             // index into release_events_ of the slot's last release, or -1
  std::vector<bool> prefetched_unused_;   // filled by prefetch() and not chosen since

  // Per block.
  std::vector<std::vector<int64_t>> held_;  // slots pinned between acquire and release
  std::vector<bool> acquired_;

  // Release events, shared by every slot of one release and reference-counted: one record per
  // release (not per slot), reused once no slot refers to it. cudaStreamWaitEvent captures the
  // record at the time of the call, so re-recording an event never disturbs an earlier wait.
  std::vector<cudaEvent_t> release_events_;
  std::vector<int> release_event_slots_;  // how many slots refer to each
  std::vector<int> free_release_events_;

  std::vector<cudaEvent_t> free_timing_events_;
  std::deque<TimedSpan> pending_copies_;  // complete in order (one copy stream)
  std::deque<TimedSpan> pending_stalls_;  // complete in order on each compute stream
  std::vector<BlockOffloadStatistics> statistics_;  // [blocks]
};

}  // namespace moe::cuda
