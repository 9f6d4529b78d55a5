// inference_view.h: the offload panel's data for decoding with experts in host memory, prepared
// apart from drawing: the expert cache over the decode steps, hit rate and prefetch accuracy per
// MoE block, and one summary row per run so the modes of one model sit side by side.
//
// What a run record holds (cuda/infer/offload_recording.cpp writes it, from offload_bench and
// moe_generate): per decode step and MoE block the experts the block chose, how many were hits
// (already in a GPU slot) and misses (copied on demand while the block waited), the experts the
// host computed instead from its pinned copy of the weights (`on_host`, and the host's time for
// them, `host_us`; a decoder that computes every expert on the GPU leaves them out), the experts the
// schedule asked to copy ahead (`prefetched`, a hint the cache may drop when every slot is pinned),
// how many prefetch copies the block then chose (`prefetched_used`), and the bytes copied for the
// block. A chosen expert has one of three outcomes: a hit, a miss, or computed on the host; hits
// and misses count only what the GPU computed. Which slot held which expert is not recorded, so the
// cache view has one cell per expert lookup or copy, not one per slot:
//   prefetched and used    chosen, and copied in ahead by a prefetch: the copy overlapped compute
//   hit                    chosen, already resident from an earlier step
//   miss                   chosen, copied on demand: the block stalled for it
//   computed on the host   chosen, not in a slot, and computed by the host while the GPU ran the
//                          rest: no copy and no slot, the host's time instead
//   prefetched and wasted  copied in ahead, not chosen at that step: PCIe bytes and a slot spent
//                          for nothing (unless a later step chooses it while it is still resident:
//                          the speculative mode's prefetched_used sometimes counts such a copy at the
//                          next step, so over a run the wasted copies are copies - used)
// The prefetch copies are not a field of their own: they are the block's copies (bytes / one
// expert's bytes, from the model's D, H and activation, bf16 weights) less its misses (an expert
// computed on the host is not copied). The counts are checked to be whole and consistent; where
// they are not, `wasted_known` is false and `note` says why, and the wasted cells are left out
// rather than guessed.
//
//   CacheTimeline c = build_cache_timeline(run, 1);  // the decode steps (step 0 is the prefill)
//   DecodeModeRow row = decode_mode_row(run, 1);
// Built into moe_viewer_model; tested by tests/viewer/test_inference_runs.cpp.
// Dimension legend: D model width, H expert hidden width, E experts per MoE block, M MoE blocks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "colormap.h"   // Rgba, Image
#include "run_model.h"  // RunModel, OffloadRecord

namespace moe::viewer {

// What one cell of the cache view shows (the order cells are stacked in within a block's column).
enum class CacheCell : uint8_t { empty = 0, prefetched_used, hit, miss, on_host, prefetched_wasted };
const char* cache_cell_name(CacheCell cell);

// The expert-cache outcomes of one block at one step, or summed over steps or blocks.
// The hit rate is the cache's, the rate offload_bench prints (cuda/offload/expert_cache.h): of the
// experts the GPU computed (hits + misses), those already in a slot. The experts computed on the
// host are in neither term, as they are in neither of the record's counts; on_host / chosen is the
// share of the chosen experts the host took.
struct CacheOutcomes {
  int64_t chosen = 0;             // experts the block(s) chose: hits + misses + on_host
  int64_t resident_hits = 0;      // hits not owed to a prefetch of this step
  int64_t prefetched_used = 0;
  int64_t misses = 0;
  int64_t on_host = 0;            // chosen experts computed on the host: neither hits nor misses
  int64_t prefetch_copies = 0;    // experts copied ahead; -1 when not derivable
  int64_t bytes = 0;              // host-to-device bytes copied
  double stall_us = 0;            // time compute waited for copies
  double host_us = 0;             // the host's time for its experts (overlapped with the GPU's work)
  void add(const CacheOutcomes& other);
  // prefetch_copies - prefetched_used (never below 0); -1 when the copies are not derivable.
  int64_t prefetched_wasted() const;
  int64_t on_gpu() const { return chosen - on_host; }  // the experts the GPU computed: hits + misses
  // (resident_hits + prefetched_used) / on_gpu(); NaN when the GPU computed none.
  double hit_rate() const;
  double prefetch_accuracy() const;  // prefetched_used / prefetch_copies; NaN when nothing was copied ahead
};

struct CacheTimeline {
  std::vector<int64_t> layers;    // [M] the MoE blocks' layer indices, ascending
  std::vector<int64_t> steps;     // the recorded steps shown, ascending
  int64_t rows_per_block = 0;     // the most cells a block filled at one step
  // [M * rows_per_block][steps], row-major: block m's cells at step s are rows
  // m * rows_per_block .. + rows_per_block - 1 of column s, stacked in CacheCell order.
  std::vector<CacheCell> cells;
  std::vector<CacheOutcomes> per_block;  // [M] summed over the steps shown
  CacheOutcomes total;
  int64_t expert_bytes = 0;   // one expert's bytes (w1 and w2 in bf16); 0 when the model is not known
  bool wasted_known = false;  // the prefetch copies could be derived for every event
  bool has_chosen_experts = false;  // the record lists each block's chosen experts
  bool has_on_host = false;   // some block computed experts on the host
  std::string note;           // why wasted_known is false ("" when it is true)
  CacheCell at(size_t row, size_t column) const { return cells[row * steps.size() + column]; }
};
// From the run's offload events at steps >= first_step. A run without offload events gives
// an empty view (layers empty).
CacheTimeline build_cache_timeline(const RunModel& run, int64_t first_step);

// The cells' colours: a miss is red like the stall it causes on the timeline; an expert computed on
// the host is violet, apart from the GPU's outcomes (blue, green, red).
Rgba cache_cell_color(CacheCell cell);
// One pixel per cell: image row r is the view's row r, column s its step s.
Image cache_image(const CacheTimeline& view);

// One expert's bytes as the expert cache copies them: w1 [D, W1] and w2 [H, D] in bf16, W1 = H
// (GeLU) or 2H (SwiGLU). 0 when run.json has no moe_config with D and H.
int64_t offloaded_expert_bytes(const RunModel& run);

// One run's decode, for the modes-side-by-side table.
struct DecodeModeRow {
  std::string label;      // the run's name
  std::string mode;       // run.json extra.mode ("on_demand", "pregated", ...), or "?"
  std::string model;      // what the runs being compared must share (see decode_model_key)
  int64_t decode_steps = 0;
  int64_t cache_slots = -1;     // extra.cache_slots; -1 when not recorded
  CacheOutcomes outcomes;       // summed over the decode steps and blocks
  double median_step_us = 0;    // median over decode steps of the step's extent on the timeline
  double stall_us_per_step = 0; // outcomes.stall_us / decode_steps
  double host_us_per_step = 0;  // outcomes.host_us / decode_steps
};
// "program scale D=.. H=.. E=.. K=.." from run.json: the runs of one model in different modes
// share it (offload_switch_* do; generate_pregated_* do; the self-gated model's run does not).
std::string decode_model_key(const RunModel& run);
DecodeModeRow decode_mode_row(const RunModel& run, int64_t first_step);

// Spans that are the compute stream waiting for expert copies ("wait_for_copy m3"): the stalls
// the offload timeline draws in red.
bool is_stall_span(const std::string& name);

}  // namespace moe::viewer
