// panel_offload.cpp: expert offload (Pre-gated MoE): the copy and compute streams at the
// scrubber's step, expert-cache hits and misses, and the time the layers stalled for copies.
#include <string>

#include "comm_view.h"  // offload_at, offload_series
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

const Timeline& OffloadTimeline(ViewerState& state, OpenRun& run);  // panel_alltoall.cpp

namespace {
void ShowRunOffload(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.offloads.empty()) {
    LacksData("offload events (its experts stayed in GPU memory, or it did not record the expert cache)");
    return;
  }
  const int64_t layer = -1;  // all layers summed; the cache is shared by the layers
  const OffloadView v = offload_at(m, state.step, layer);
  ImGui::Text("step %lld, all layers", static_cast<long long>(v.step));
  Metric("cache hits", "%.0f", static_cast<double>(v.hits),
         "Routed experts whose weights were already in GPU memory when the layer needed them.");
  ImGui::SameLine(0, 24);
  Metric("misses", "%.0f", static_cast<double>(v.misses),
         "Routed experts that had to be copied from host memory on demand: the layer waits for them.");
  ImGui::SameLine(0, 24);
  Metric("hit rate", "%.3f", v.hit_rate, "hits / (hits + misses). Pre-gating aims at 1: it picks block i+1's "
                                         "experts during block i, so their copies overlap compute.");
  Metric("stall", "%.1f us", v.stall_us,
         "Time the layers waited for expert copies at this step: copy time the prefetch did not hide.");
  ImGui::Text("prefetched experts: %zu", v.prefetched.size());
  HelpMarker("Experts copied in ahead of need by the pre-gate (Pre-gated MoE, Hwang et al. 2024).");

  ImGui::Text("copy and compute streams");
  HelpMarker("The compute stream and the copy stream of each rank. Copies that sit under compute are "
             "hidden; a copy that ends after compute wanted to start is a stall.");
  const Timeline& timeline = OffloadTimeline(state, run);
  if (timeline.lanes.empty()) LacksData("copy or compute spans at this step");
  else TimelineView("offload_timeline", timeline, ImVec2(ImGui::GetContentRegionAvail().x, 100));

  // Each series scans every offload event of the run: kept until the data changes.
  auto cached = [&](const char* field) -> const Series& {
    auto& entry = state.series[RegionName(state, run, "offload_") + field];
    const std::string key = TextureKey(field, run, layer, 0, 0);
    if (entry.key != key) entry = {key, offload_series(m, field, layer)};
    return entry.series;
  };
  const Series& hit_rate = cached("hit_rate");
  const Series& stall = cached("stall_us");
  const Series& misses = cached("misses");
  const std::string suffix = RegionName(state, run, "");
  const float width = ImGui::GetContentRegionAvail().x;
  ImGui::Text("hit rate per step");
  HelpMarker("Expert-cache hit rate over the run.");
  CurvePlot(("offload_hit_rate" + suffix).c_str(), state, {{"hit rate", &hit_rate, RunColor(run.color_index)}}, ImVec2(width, 80));
  ImGui::Text("misses per step");
  HelpMarker("Experts copied on demand per step, all layers.");
  CurvePlot(("offload_misses" + suffix).c_str(), state, {{"misses", &misses, RunColor(run.color_index)}}, ImVec2(width, 80));
  ImGui::Text("stall per step (us)");
  HelpMarker("Time the layers waited for copies per step.");
  CurvePlot(("offload_stall" + suffix).c_str(), state, {{"stall us", &stall, RunColor(run.color_index)}}, ImVec2(width, 80));
}
}  // namespace

void ShowOffloadPanel(ViewerState& state) {
  ForEachShownRun(state, "offload_runs", [&](OpenRun& run) { ShowRunOffload(state, run); });
}

}  // namespace moe::viewer
