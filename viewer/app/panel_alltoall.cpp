// panel_alltoall.cpp: timeline and all-to-all timing: a per-rank, per-stream timeline of the phases
// of the scrubber's step (a training step's model phases with the MoE layer's phases nested under
// them; dispatch, expert compute, combine and copies across ranks), the rank x rank byte matrix, and the achieved bandwidth.
#include <algorithm>
#include <string>

#include "colormap.h"   // colorize
#include "comm_view.h"  // build_timeline, alltoall_at, alltoall_bandwidth_series
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {

const Timeline& CachedStepTimeline(ViewerState& state, OpenRun& run, bool copy_and_compute_only) {
  const std::string key = TextureKey(copy_and_compute_only ? "offload_timeline" : "timeline", run, state.step, 0, 0);
  auto& cached = state.timelines[RegionName(state, run, copy_and_compute_only ? "offload" : "alltoall")];
  if (cached.key != key) {
    // The step shown: the recorded step with spans at or before the scrubber's.
    const int64_t step = timeline_step(run.model, state.step);
    cached.step = step;
    cached.timeline = build_timeline(run.model, step, step, copy_and_compute_only);
    cached.key = key;
  }
  return cached.timeline;
}

void ShowRunAllToAll(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  const Timeline& timeline = CachedStepTimeline(state, run, false);
  if (m.spans.empty()) ImGui::Text("timeline of the step, per rank and stream");
  else ImGui::Text("timeline of step %lld, per rank and stream", static_cast<long long>(state.timelines[RegionName(state, run, "alltoall")].step));
  HelpMarker("One lane per (rank, stream). A single-GPU training run has two: 'compute' holds the model's "
             "phases (embedding, attention, moe, lm_head, backward_..., optimizer) and 'compute: inside the MoE "
             "layer' the phases nested inside each moe span (router, plan, dispatch, expert_compute, combine), "
             "right under it. Runs time one step in a hundred: the scrubber shows the recorded step at or "
             "before it. Expert parallelism (FastMoE, Tutel): each rank sends its tokens to "
             "the ranks that own their experts (dispatch all-to-all), computes its local experts, and sends "
             "the results back (combine). A rank that finishes early waits at the next all-to-all for the "
             "slowest one: look for gaps before a dispatch or combine. Grey: spans too thin to draw, merged.");
  if (m.spans.empty() && m.alltoalls.empty()) {
    LacksData("timed spans or all-to-all events (its program timed no phases)");
    return;
  }
  if (m.spans.empty()) LacksData("timed spans (only all-to-all totals)");
  TimelineView("timeline", timeline, ImVec2(std::max(200.0f, ImGui::GetContentRegionAvail().x), 160));
  RecordLastItem(state, RegionName(state, run, "timeline"));

  if (m.alltoalls.empty()) {
    LacksData("all-to-all byte matrices");
    return;
  }
  const AllToAllView a = alltoall_at(m, state.step, state.alltoall_name);
  ImGui::Separator();
  ImGui::Text("bytes[src][dst] at step %lld (%lld all-to-all events)", static_cast<long long>(a.step), static_cast<long long>(a.events));
  HelpMarker("Row: the sending rank, column: the receiving rank. The diagonal stays on its rank (no link "
             "crossed). An unbalanced row or column is a rank that sends or receives more, because its "
             "tokens prefer remote experts or its experts are hot. Colour: bytes relative to the largest cell.");
  Matrix bytes;
  bytes.rows = bytes.cols = a.ranks;
  double largest = 0;
  for (double b : a.bytes) largest = std::max(largest, b);
  for (double b : a.bytes) bytes.values.push_back(largest > 0 ? static_cast<float>(b / largest) : 0.0f);
  HeatmapTexture& texture = state.textures[RegionName(state, run, "alltoall_bytes")];
  const std::string key = TextureKey("bytes", run, a.step, 0, 0) + state.alltoall_name;
  if (texture.key != key) texture.upload(colorize(bytes, 0.0f, 1.0f), key);
  const float side = std::clamp(static_cast<float>(a.ranks) * 24.0f, 48.0f, 220.0f);
  int col = 0, row = 0;
  if (HeatmapImage(texture, ImVec2(side, side), &col, &row))
    ImGui::SetTooltip("rank %d -> rank %d: %.0f bytes", row, col, a.bytes[static_cast<size_t>(row * a.ranks + col)]);
  RecordLastItem(state, RegionName(state, run, "alltoall_bytes"));
  ImGui::SameLine();
  ImGui::BeginGroup();
  Metric("achieved bandwidth", "%.2f GB/s", a.bandwidth_gb_per_s,
         "Bytes that crossed between ranks (the off-diagonal of the matrix) divided by the time the "
         "all-to-alls took, summed over the events of the step. Compare with the link's peak (NVLink on "
         "H100/H200: about 450 GB/s per direction per GPU) to see how much the exchange wastes.");
  Metric("bytes between ranks", "%.0f", a.remote_bytes, "The off-diagonal sum: what had to cross a link.");
  Metric("time", "%.1f us", a.duration_us, "The summed duration of the all-to-all events of the step.");
  for (int64_t r = 0; r < a.ranks && r < 16; ++r)
    ImGui::Text("rank %lld: sends %.0f, receives %.0f bytes", static_cast<long long>(r), a.send_bytes[static_cast<size_t>(r)],
                a.recv_bytes[static_cast<size_t>(r)]);
  ImGui::EndGroup();
  // The series scans every all-to-all of the run: kept until the data or the name changes.
  auto& cached = state.series[RegionName(state, run, "bandwidth")];
  const std::string series_key = TextureKey("bandwidth", run, 0, 0, 0) + state.alltoall_name;
  if (cached.key != series_key) cached = {series_key, alltoall_bandwidth_series(m, state.alltoall_name)};
  const Series& bandwidth = cached.series;
  ImGui::Text("achieved bandwidth per step (GB/s)");
  HelpMarker("The same figure for every recorded step: dips are steps where the exchange waited.");
  CurvePlot(("bandwidth" + RegionName(state, run, "")).c_str(), state, {{"GB/s", &bandwidth, RunColor(run.color_index)}},
            ImVec2(ImGui::GetContentRegionAvail().x, 80));
}

}  // namespace

void ShowAllToAllPanel(ViewerState& state) {
  std::vector<std::string> names;
  for (OpenRun* run : state.shown_runs())
    for (const std::string& n : alltoall_names(run->model))
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  if (!names.empty()) {
    ImGui::SetNextItemWidth(160);
    if (ImGui::BeginCombo("all-to-all", state.alltoall_name.empty() ? "(all of the step)" : state.alltoall_name.c_str())) {
      if (ImGui::Selectable("(all of the step)", state.alltoall_name.empty())) state.alltoall_name.clear();
      for (const std::string& n : names)
        if (ImGui::Selectable(n.c_str(), n == state.alltoall_name)) state.alltoall_name = n;
      ImGui::EndCombo();
    }
    HelpMarker("Which all-to-all to show: dispatch (tokens to their experts' ranks) or combine (results back).");
  }
  ForEachShownRun(state, "alltoall_runs", [&](OpenRun& run) { ShowRunAllToAll(state, run); });
}

// Shared with panel_offload.cpp: the copy and compute lanes of the step.
const Timeline& OffloadTimeline(ViewerState& state, OpenRun& run) { return CachedStepTimeline(state, run, true); }

}  // namespace moe::viewer
