// comm_view.h: the timeline, all-to-all and offload panels' data, prepared apart from drawing.
//
// A timeline is one lane per (rank, stream), each a sorted list of spans. Drawing asks
// visible_spans() for the spans in the visible time window, with spans thinner than a pixel merged
// into one (so 200,000 spans never become 200,000 rectangles in a frame).
// An all-to-all at a step is the sum of its byte matrices bytes[src][dst]; its achieved bandwidth
// is the bytes that crossed between ranks divided by the time the collective took.
//   Timeline t = build_timeline(run, step, step);
//   AllToAllView a = alltoall_at(run, step, "dispatch");
// Built into moe_viewer_model; tested by tests/viewer/test_views.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "run_model.h"  // RunModel, Series

namespace moe::viewer {

struct TimelineSpan {
  double start_us = 0, end_us = 0;
  int32_t name = 0;     // index into Timeline::names
  int32_t merged = 1;   // > 1: several spans thinner than a pixel drawn as one
};

struct TimelineLane {
  int64_t rank = 0;
  int64_t stream = 0;
  std::string label;  // "rank 0 / compute"
  std::vector<TimelineSpan> spans;  // sorted by start
};

struct Timeline {
  double t0 = 0, t1 = 0;  // earliest start, latest end (microseconds)
  std::vector<std::string> names;  // span names, each once
  // A span's colour and legend entry: its name up to the first space, so that "copy m0" ..
  // "copy m5" (one per MoE block) share one colour and the legend stays short.
  std::vector<std::string> families;
  std::vector<int32_t> family_of;  // [names] index into families
  std::vector<TimelineLane> lanes; // sorted by rank, then stream
  int64_t span_count = 0;
};

// Spans of steps [step_lo, step_hi]; all-to-all events with start_us join as lane "all-to-all".
// Lanes are labelled "rank r / <stream name>", or just the stream name when every lane is on one
// rank (a single-GPU run: "compute" and "compute: inside the MoE layer", the nested phases).
// With copy_and_compute_only, only the lanes whose stream is named compute or copy (or whose
// spans are copies, e.g. h2d_copy) are kept: the offload panel's view.
Timeline build_timeline(const RunModel& run, int64_t step_lo, int64_t step_hi, bool copy_and_compute_only = false);

// The recorded step with spans at or before `step` (the first recorded one when all are after);
// INT64_MIN when the run has no spans. Training runs time one step in a hundred.
int64_t timeline_step(const RunModel& run, int64_t step);

// The spans of `lane` overlapping [t_lo, t_hi], spans thinner than min_width_us merged with their
// neighbours.
std::vector<TimelineSpan> visible_spans(const TimelineLane& lane, double t_lo, double t_hi, double min_width_us);

struct AllToAllView {
  int64_t ranks = 0;               // R
  std::vector<double> bytes;       // [R * R] summed over the events at this step
  std::vector<double> send_bytes;  // [R] off-diagonal bytes each rank sent
  std::vector<double> recv_bytes;  // [R]
  double total_bytes = 0;
  double remote_bytes = 0;         // off-diagonal: bytes that crossed between ranks
  double duration_us = 0;          // summed durations
  double bandwidth_gb_per_s = 0;   // remote_bytes / duration (1 GB = 1e9 bytes)
  int64_t events = 0;
  int64_t step = 0;                // the recorded step shown
  int64_t layer = -1;              // the layer shown (-1: summed over the layers)
};
// The all-to-alls of the recorded step at or before `step`; name "" takes every name, layer -1
// every layer.
AllToAllView alltoall_at(const RunModel& run, int64_t step, const std::string& name, int64_t layer = -1);
std::vector<std::string> alltoall_names(const RunModel& run);
Series alltoall_bandwidth_series(const RunModel& run, const std::string& name);

struct OffloadView {
  int64_t hits = 0, misses = 0;  // the experts the GPU computed, found in a slot or copied in
  int64_t on_host = 0;           // the experts the host computed instead: neither hits nor misses
  double stall_us = 0;
  double host_us = 0;            // the host's time for them
  double hit_rate = 0;  // hits / (hits + misses): the cache's, of what the GPU computed
  int64_t events = 0;
  int64_t step = 0;
  std::vector<int64_t> prefetched;  // experts copied ahead, over the layers shown
};
// layer -1 sums all layers.
OffloadView offload_at(const RunModel& run, int64_t step, int64_t layer);
// field: "hit_rate", "misses", "hits", "stall_us"; summed over layers per step (layer -1) or one.
// The hit rate is NaN (a gap in the curve) at a step where the GPU looked up no expert: every
// chosen expert computed on the host.
Series offload_series(const RunModel& run, const std::string& field, int64_t layer);

}  // namespace moe::viewer
