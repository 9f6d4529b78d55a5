// sim/cache_replay.h: the inference side of moe_sim. A recorded run of offloaded decoding (Pre-gated
// MoE, cuda/offload/) is replayed through the expert cache's own eviction code (ExpertSlotMap,
// cuda/offload/cache_policy.h, linked as moe_cache_policy), so that
//   - the replay of the recorded policy, slot count and prefetch hints gives the recorded hits and
//     misses step by step and block by block: the check that the replay does what the GPU did;
//   - the same expert requests replayed with LRU, LFU or Belady's optimal policy (evict the resident
//     expert whose next use is farthest in the future; it knows the future, so no policy does better)
//     at other cache sizes give the hit rate against cache size for that run's routing;
//   - the replayed copies, laid on the record's compute timeline with one copy stream at a given
//     host-to-device bandwidth, predict each decode step's time, and the stalls in it.
//
//   OffloadTrace trace = read_offload_trace("notebooks_data/runs/offload_switch_pregated");
//   CacheReplay exact = replay_recorded(trace);                      // hits, misses == the record's
//   CacheReplay floor = replay(trace, 16, ReplayPolicy::belady, false);  // demand only, 16 slots
//   StepTimePrediction t = predict_step_times(trace, exact, measured_copy_gbs(trace));
//
// What the replay needs from a record (infer/offload_recording.h writes it: moe_generate --run-dir,
// offload_bench --record-dir):
//   run.json    kind "infer"; extra.mode (on_demand, prefetch_all, pregated, speculative; gpu_only has
//               no cache and is refused), extra.cache_slots, extra.cache_policy or extra.policy (lru
//               when absent: offload_bench's default, which its records do not name); moe_config's
//               num_experts, top_k, model_dim, hidden_dim and activation (an expert's bytes).
//   events      per step (0 the prefill, then one per decode step) and MoE block an "offload" event:
//               "experts" (the ids acquired, sorted), "prefetched" (the hint given to prefetch()
//               for this block: in the previous block's acquire, or for block 0 at the step's start),
//               "hits", "misses", "prefetched_used", "stall_us", "bytes". Every step must hold every
//               block, in the order of the layers, from step 0 on: the cache's state is the whole past.
//   for times   the compute stream's "span" events (stream 0: the phases) and the waits for copies
//               (stream 2, "wait_for_copy m<j>": where each block's acquire meets the compute stream).
//
// The sequence of cache operations a step makes (InferenceModelGpu::run and moe_block, ExpertCache):
//   prefetch(0, hint_0)                                     only where the record has a hint for block 0
//   for each MoE block j:  acquire(j, experts_j); prefetch(j + 1, hint_{j+1}); release(j)
// acquire: the hits first (pin, record_use), then each miss into choose_victim() (assign, pin,
// record_use); prefetch: each hinted expert touched when resident, else copied into the victim
// (dropped when every slot is pinned), pinned while the hint is followed, then unpinned; release:
// unpin. The replay makes exactly these calls on an ExpertSlotMap.
//
// Tests: ctest --test-dir build -R SimCacheReplay. Dimension legend: E experts per MoE block, M MoE
// blocks, K top-k.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace moe::sim {

// ---- the record ----

struct OffloadBlockRecord {  // one "offload" event
  int64_t layer = 0;
  std::vector<int32_t> experts;     // acquired: sorted, unique
  std::vector<int32_t> prefetched;  // the prefetch hint for this block ([] when none)
  int64_t hits = 0, misses = 0, prefetched_used = 0, bytes = 0;
  double stall_us = 0;
};

struct RecordedSpan {
  int64_t stream = 0;  // 0 compute phases, 1 copies, 2 the compute stream's waits for copies
  std::string name;
  double start_us = 0, duration_us = 0;
};

struct OffloadTrace {
  std::string source;  // the run directory
  std::string mode;    // on_demand, prefetch_all, pregated, speculative
  std::string policy;  // lru, lfu, next_use
  int64_t cache_slots = 0;
  int64_t experts = 0;   // E
  int64_t top_k = 0;     // K
  int64_t batch = 1;
  size_t expert_bytes = 0;             // one expert's w1 + w2 in bf16
  std::vector<int64_t> layers;         // [M] the MoE blocks' layers
  std::vector<std::vector<OffloadBlockRecord>> steps;  // [steps][M]
  std::vector<std::vector<RecordedSpan>> spans;        // [steps] that step's spans

  int64_t blocks() const { return static_cast<int64_t>(layers.size()); }
  // The most experts one acquire asked for: the fewest slots any replay may have.
  int64_t minimum_slots() const;
};

// Throws std::invalid_argument starting "--offload-trace DIR:" when the directory is no run record,
// is a gpu_only run, or lacks what the replay needs (above).
OffloadTrace read_offload_trace(const std::filesystem::path& run_dir);

// ---- the replay ----

enum class ReplayPolicy { lru, lfu, next_use, belady };
std::string to_string(ReplayPolicy policy);
// "lru", "lfu", "next_use", "belady"; std::invalid_argument listing them otherwise.
ReplayPolicy replay_policy_from_string(const std::string& name);

struct ReplayedCopy {  // one host-to-device copy of an expert, in the copy stream's order
  int64_t issued_in = -1;  // the MoE block whose acquire issued it; -1 the step's start
  int64_t block = 0;
  int32_t expert = 0;
  bool on_demand = true;   // acquire's miss, else a prefetch
};

struct ReplayedBlock {
  int64_t hits = 0, misses = 0;
  int64_t prefetched = 0, prefetched_used = 0, prefetch_dropped = 0;
  int64_t bytes = 0;  // (misses + prefetched) x the expert's bytes
};

struct ReplayedStep {
  std::vector<ReplayedBlock> blocks;  // [M]
  std::vector<ReplayedCopy> copies;   // every copy of the step, in issue order
};

struct CacheReplay {
  int64_t slots = 0;
  ReplayPolicy policy = ReplayPolicy::lru;
  bool prefetch = false;
  std::vector<ReplayedStep> steps;
  // hits / (hits + misses) over steps first.. (1: the decode steps, after the prefill filled the cache).
  double hit_rate(size_t first = 1) const;
  int64_t misses(size_t first = 1) const;
};

// The trace's requests through `slots` slots. prefetch: also follow the record's prefetch hints
// (LRU and LFU only: Belady's policy here is the floor of demand fetching). held: MoE blocks whose
// experts stay on the GPU beside the cache (cuda/offload/resident_blocks.h): each of their requests
// is a hit, none enters the cache, and hints for them are ignored. Throws std::invalid_argument
// naming the minimum when slots < trace.minimum_slots(), and naming what is allowed for a held
// block outside [0, M), listed twice, or every block held.
CacheReplay replay(const OffloadTrace& trace, int64_t slots, ReplayPolicy policy, bool prefetch,
                   const std::vector<int64_t>& held = {});
// The recorded run's own cache: its slots, its policy, its hints.
CacheReplay replay_recorded(const OffloadTrace& trace);

// The first place the replay's counts differ from the record's (hits, misses, prefetched_used,
// bytes), as "step S block J (layer L): hits 3 recorded, 2 replayed"; "" when every block agrees.
std::string first_difference(const OffloadTrace& trace, const CacheReplay& replay);

// ---- decode step times ----

struct StepTime {
  int64_t step = 0;
  double measured_us = 0, predicted_us = 0;
  double measured_stall_us = 0, predicted_stall_us = 0;
};

struct StepTimePrediction {
  double copy_gbs = 0;            // the bandwidth the copies were priced at
  std::vector<StepTime> steps;    // the decode steps (1..)
  double median_measured_us = 0, median_predicted_us = 0;
  double error() const;           // predicted / measured - 1, of the medians
};

// host-to-device GB/s of the record's copies: their bytes over their copy-stream spans' time.
// 0 when the record has no copy spans.
double measured_copy_gbs(const OffloadTrace& trace);

// Each decode step: the record's compute timeline with its measured stalls taken out, and the
// replay's copies laid on one copy stream (in issue order, each expert_bytes / copy_gbs, none
// starting before the acquire or step start that issued it); a block's acquire waits until every
// expert it uses that was copied in this step has landed. A prefetch that lands before the next
// block's acquire is hidden under compute; one that has not yet, and every miss, is a stall.
StepTimePrediction predict_step_times(const OffloadTrace& trace, const CacheReplay& replay, double copy_gbs);

}  // namespace moe::sim
