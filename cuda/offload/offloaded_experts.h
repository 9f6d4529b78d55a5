// offload/offloaded_experts.h: OffloadedExperts, the ExpertSource of every offloading mode of
// Pre-gated MoE (on_demand, prefetch_all, pregated, speculative): experts in pinned host memory
// (pinned_expert_store.h), a pool of GPU slots fed by a copy stream (expert_cache.h), and the MoE
// layer's per-expert pointer tables pointing into the slots.
//
// The modes differ only in when the decoding model calls prefetch(); this class is the same for all:
//
//   for each MoE block i of a decoding step:
//     experts_i = the block's chosen experts (its router's top-K, read back to the host)
//     tables    = source.acquire(i, experts_i, compute)  // misses copied now; compute waits for copies
//     source.prefetch(i + 1, guess)                       // pre-gated: block i's pre-gate's choice;
//                                                          // prefetch-all: every expert of block i+1;
//                                                          // speculative: block i+1's gate on block
//                                                          // i's hidden state; on-demand: no call
//     enqueue block i's expert kernels on compute, reading tables.w1 / tables.w2
//     source.release(i, compute)
//
// Calling prefetch(i+1) before release(i) keeps block i's slots pinned while the next block's
// copies choose their victims, so "the expert migration of block i+1 overlaps the expert execution
// of block i" (Hwang et al., ISCA 2024) and never has to wait for it.
//
// The pointer tables: acquire writes the block's two tables [E] (w1 pointers, w2 pointers) into a
// pinned host staging buffer and copies them to the device on the compute stream, ahead of the
// kernels that read them. Experts the block did not choose point at a poison expert full of NaN,
// so a kernel that read an unchosen expert would show it in every output it touched (the tests'
// check). A wrong guess costs a copy, never a different answer: a chosen expert's slot holds its
// weights bit for bit as the store does.
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns (H for GeLU, 2H for
// SwiGLU), E experts per MoE block, K top-k.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/bf16.h"                    // bf16
#include "core/device_buffer.h"           // DeviceBuffer
#include "offload/cache_policy.h"         // CachePolicy, minimum_cache_slots
#include "offload/expert_cache.h"         // ExpertCache, OffloadStatistics
#include "offload/cpu_expert.h"           // CpuExpert
#include "offload/expert_source.h"        // ExpertSource, ExpertTables
#include "offload/host_expert_choice.h"  // HostExperts, HostExpertCosts
#include "offload/pinned_expert_store.h"  // PinnedExpertStore
#include "offload/resident_experts.h"     // ResidentExperts, the gpu_only source beside this one

namespace moe::cuda {

struct OffloadOptions {
  // The expert cache's size: in slots (experts), or in MB (10^6 bytes, rounded down to whole
  // experts); exactly one of the two.
  int64_t cache_slots = 0;
  double cache_megabytes = 0;
  CachePolicy policy = CachePolicy::lru;
  // The most tokens one acquire serves (the batch when decoding, batch * prompt length in a
  // prefill) and the router's top-K: the cache must hold minimum_cache_slots(E, tokens, K).
  int64_t max_tokens_per_step = 1;
  int64_t top_k = 1;
  bool time_copies = true;  // CUDA events around every copy and stall (ExpertCache statistics)
  // Experts computed on the host from the pinned weights (host_expert_choice.h): off, every miss,
  // or the cost model's pick; with host_threads threads (0: every hardware thread of the host).
  // The cost model's inputs: `costs` when given, else measured by the constructor
  // (measure_host_expert_costs).
  HostExperts host_experts = HostExperts::off;
  int host_threads = 0;
  HostExpertCosts costs;
  double gpu_block_ms = 0;  // HostExpertCosts::gpu_block_ms when the costs are measured here
};

// The cost model's inputs on this machine, for the store's experts: one expert's pinned copy into a
// GPU buffer (the median of 5, CUDA events), and the host's FFN of one expert on 1 .. max_rows rows
// (the median of 3 each, `expert` threads), each beside a copy of another expert, as in a decode
// step where the host and the copy engine read host memory together; and a block's round trip to
// the host (host_block_ms): its rows read back and sent up, each waited for, and the threads woken
// after a 2 ms pause (a tiny expert's call on as many threads, woken against awake). Allocates one
// expert's bytes on the GPU for the while. Measured, so noisy: given the same costs (OffloadOptions::costs) the
// choice is the same run after run.
HostExpertCosts measure_host_expert_costs(const PinnedExpertStore& store, CpuExpert& expert, int64_t max_rows);

// The slot count the options ask for. Throws std::invalid_argument when neither or both sizes are
// given (a too-small cache is the cache's error, which names the minimum).
int64_t cache_slots_of(const OffloadOptions& options, size_t expert_bytes);

class OffloadedExperts : public ExpertSource {
 public:
  // The store must outlive this object (its pinned pages are the copies' source).
  OffloadedExperts(const PinnedExpertStore& store, const OffloadOptions& options);
  ~OffloadedExperts() override;
  OffloadedExperts(const OffloadedExperts&) = delete;
  OffloadedExperts& operator=(const OffloadedExperts&) = delete;

  bool needs_experts_on_host() const override { return true; }
  // Throws std::invalid_argument for a block outside [0, blocks), expert ids outside [0, E), not
  // sorted or not unique, or more experts than the slots not held by other blocks; and
  // std::logic_error for a block acquired twice without release. Nothing changes then.
  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;
  void prefetch(int64_t block, std::span<const int32_t> experts) override;
  // The misses (experts in no slot, copies in flight count as held) split by options.host_experts.
  // The cost model's backlogs come from a model of the two queues in predicted milliseconds (below),
  // not from the wall clock, so that for the same costs the choice is the same run after run.
  HostPick choose_host_experts(int64_t block, std::span<const int32_t> experts, std::span<const int64_t> rows,
                               bool chosen_ahead) override;
  // The store's weights through the CpuExpert. Throws std::logic_error when host experts are off,
  // std::invalid_argument for a block or expert out of range or sizes that do not match.
  void host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                    std::span<float> y) override;
  HostExperts host_experts() const { return host_mode_; }
  const HostExpertCosts& host_costs() const { return costs_; }
  int host_threads() const { return cpu_ ? cpu_->threads() : 0; }

  // Per MoE block: hits, misses, prefetched, prefetched_used, bytes, copy and stall times (see
  // expert_cache.h; waits for the outstanding copies, so call it outside a timed loop).
  OffloadStatistics statistics() { return cache_.statistics(); }
  void reset_statistics() { cache_.reset_statistics(); }

  const ExpertCache& cache() const { return cache_; }
  const PinnedExpertStore& store() const { return store_; }
  const bf16* poison_expert() const { return poison_.data(); }  // [D*W1 + H*D], every value NaN
  // GPU memory this source holds: the slots, the poison expert and the pointer tables.
  size_t device_bytes() const { return cache_.bytes() + poison_.bytes() + device_tables_.bytes(); }

 private:
  // One entry of the table ring: a pinned staging pair and a device pair of tables [2, E].
  struct TableEntry {
    cudaEvent_t released = nullptr;  // recorded on compute at the release of the acquire that used it
    bool recorded = false;
    int64_t holder = -1;             // the block holding it between acquire and release
  };
  int64_t take_table_entry(double& host_wait_ms);

  const PinnedExpertStore& store_;
  ExpertCache cache_;
  DeviceBuffer<bf16> poison_;                   // [D*W1 + H*D], NaN
  int64_t experts_;                             // E
  const bf16** staging_ = nullptr;              // pinned host [ring, 2, E]
  DeviceBuffer<const bf16*> device_tables_;     // [ring, 2, E]
  std::vector<TableEntry> ring_;                // [ring] = 2 * blocks
  int64_t next_entry_ = 0;
  std::vector<int64_t> entry_of_block_;         // [blocks] -> ring entry, -1 when not acquired
  std::vector<const bf16*> slot_addresses_;     // [E] scratch for the cache's answer
  HostExperts host_mode_ = HostExperts::off;
  // The two queues, in predicted ms (costs_), for the cost model's backlogs: the host's clock moves
  // by each host expert's predicted time (and a block's host_block_ms, at its first host expert)
  // and by the GPU's time of each block (gpu_block_ms), and to
  // the copies a block waited for when the caller next waits on the GPU (a block's routing
  // read-back); the copy engine's clock moves by copy_ms per copy enqueued, from no earlier than
  // the host's clock.
  double host_clock_ms_ = 0;
  double copy_clock_ms_ = 0;
  double gpu_waits_until_ms_ = 0;   // when the copies of the last acquired block are done
  double host_pending_ms_ = 0;      // host experts chosen and not yet computed
  std::vector<double> host_block_pending_ms_;  // [blocks]: host_block_ms of a block chosen to use the host, until it does
  int64_t copies_counted_ = 0;      // cache_.copies_enqueued() when copy_clock_ms_ last moved
  void count_copies();
  std::unique_ptr<CpuExpert> cpu_;              // when host experts are on
  HostExpertCosts costs_;
};

}  // namespace moe::cuda
