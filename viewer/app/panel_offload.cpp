// panel_offload.cpp: decoding with experts in host memory (Pre-gated MoE): the modes of one model
// side by side, then per run the copy and compute streams of the scrubber's step (stalls in red,
// every run on one time scale), the expert cache over the decode steps (hits, misses and the
// experts computed on the host), hit rate and prefetch accuracy per MoE block, and the per-step
// curves. Data: viewer/model/inference_view.h.
//
// Index: [SECTION] data, [SECTION] modes side by side, [SECTION] one run
#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>

#include "comm_view.h"       // offload_at, offload_series
#include "inference_view.h"  // build_cache_timeline, decode_mode_row, cache_image
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

const Timeline& OffloadTimeline(ViewerState& state, OpenRun& run);  // panel_alltoall.cpp

namespace {

// Step 0 of a decoding record is the prefill (the whole prompt at once); the cache views and
// the rates count the decode steps after it.
constexpr int64_t kFirstDecodeStep = 1;

// ---- [SECTION] data ----

// The run's cache view and table row, rebuilt when its data changes (a followed run grows).
const ViewerState::CachedDecode& Decode(ViewerState& state, OpenRun& run) {
  auto& cached = state.decode[RegionName(state, run, "decode")];
  const std::string key = TextureKey("decode", run, 0, 0, 0);
  if (cached.key != key) {
    cached.cache = build_cache_timeline(run.model, kFirstDecodeStep);
    cached.row = decode_mode_row(run.model, kFirstDecodeStep);
    cached.key = key;
  }
  return cached;
}

std::string Percent(double fraction) {
  if (std::isnan(fraction)) return "-";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * fraction);
  return text;
}

// ---- [SECTION] modes side by side ----

// The rows of one model's runs.
void ModelTable(const std::vector<std::pair<OpenRun*, const DecodeModeRow*>>& rows) {
  // The resident run, if open: the floor every offloaded mode is measured against.
  double resident_step_us = 0;
  // The host's column only where some run computed experts there: older records have none.
  bool any_on_host = false;
  for (const auto& [run, row] : rows) {
    if (row->mode == "gpu_only") resident_step_us = row->median_step_us;
    any_on_host = any_on_host || row->outcomes.on_host > 0;
  }
  ImGui::PushID(rows.front().second->model.c_str());
  if (!ImGui::BeginTable("decode_modes", any_on_host ? 10 : 9,
                         ImGuiTableFlags_Borders | ImGuiTableFlags_RowBg | ImGuiTableFlags_SizingFixedFit)) {
    ImGui::PopID();
    return;
  }
  for (const char* column : {"run", "mode", "slots", "hit rate", "on host", "prefetch accuracy", "copied ahead: used / wasted",
                             "stall per step", "median step", "x gpu_only"})
    if (any_on_host || std::string_view(column) != "on host") ImGui::TableSetupColumn(column);
  ImGui::TableHeadersRow();
  for (const auto& [run, row] : rows) {
    const CacheOutcomes& o = row->outcomes;
    ImGui::TableNextRow();
    ImGui::TableNextColumn();
    ImGui::TextColored(ImGui::ColorConvertU32ToFloat4(RunColor(run->color_index)), "%s", row->label.c_str());
    ImGui::TableNextColumn();
    ImGui::TextUnformatted(row->mode.c_str());
    ImGui::TableNextColumn();
    if (row->cache_slots >= 0) ImGui::Text("%lld", static_cast<long long>(row->cache_slots));
    else ImGui::TextDisabled("?");
    ImGui::TableNextColumn();
    ImGui::TextUnformatted(Percent(o.hit_rate()).c_str());
    if (any_on_host) {
      ImGui::TableNextColumn();
      if (o.on_host == 0) ImGui::TextDisabled("-");
      else ImGui::Text("%s, %.0f us per step",
                       Percent(static_cast<double>(o.on_host) / static_cast<double>(o.chosen)).c_str(), row->host_us_per_step);
    }
    ImGui::TableNextColumn();
    ImGui::TextUnformatted(Percent(o.prefetch_accuracy()).c_str());
    ImGui::TableNextColumn();
    if (o.prefetch_copies < 0) ImGui::TextDisabled("not derivable");
    else ImGui::Text("%lld: %lld / %lld", static_cast<long long>(o.prefetch_copies), static_cast<long long>(o.prefetched_used),
                     static_cast<long long>(o.prefetched_wasted()));
    ImGui::TableNextColumn();
    ImGui::Text("%.0f us", row->stall_us_per_step);
    ImGui::TableNextColumn();
    ImGui::Text("%.0f us", row->median_step_us);
    ImGui::TableNextColumn();
    if (resident_step_us > 0) ImGui::Text("%.2f", row->median_step_us / resident_step_us);
    else ImGui::TextDisabled("-");
  }
  ImGui::EndTable();
  ImGui::PopID();
}

void ModesTable(ViewerState& state) {
  std::vector<std::pair<OpenRun*, const DecodeModeRow*>> rows;
  for (OpenRun* run : state.panel_runs(state.current_panel))
    if (!run->model.offloads.empty()) rows.push_back({run, &Decode(state, *run).row});
  if (rows.empty()) return;
  // Runs of one model together, in the order they are shown.
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second->model < b.second->model; });
  ImGui::Text("modes side by side, decode steps (step 0, the prefill, left out)");
  HelpMarker("One row per open decoding run. Runs of the same model (same program, weights, D, H, E, K) are "
             "grouped under it: only those compare directly. hit rate: chosen experts the GPU computed that were "
             "already in GPU memory (resident, or copied ahead and used) / all the GPU computed. on host (shown "
             "when a run computed experts on the host): the share of the chosen experts the host computed instead "
             "of copying them in, and the host's time for them per step. prefetch accuracy: copies made ahead that the "
             "block then chose / all copies made ahead (the copies are the block's bytes / one expert's bytes, "
             "less its misses). stall: time the compute stream waited for copies. step: the median decode "
             "step's extent on the timeline, every stream. x gpu_only: the step time over the resident run's.");
  // One table per model: only runs of one model compare directly.
  for (size_t first = 0; first < rows.size();) {
    const std::string& model = rows[first].second->model;
    size_t last = first;
    while (last < rows.size() && rows[last].second->model == model) ++last;
    ImGui::TextDisabled("model: %s", model.c_str());
    ModelTable(std::vector<std::pair<OpenRun*, const DecodeModeRow*>>(rows.begin() + static_cast<long>(first),
                                                                       rows.begin() + static_cast<long>(last)));
    first = last;
  }
}

// ---- [SECTION] one run ----

void CacheLegend() {
  const float right = ImGui::GetCursorScreenPos().x + ImGui::GetContentRegionAvail().x;
  for (CacheCell cell : {CacheCell::prefetched_used, CacheCell::hit, CacheCell::miss, CacheCell::on_host,
                         CacheCell::prefetched_wasted}) {
    if (cell != CacheCell::prefetched_used) {
      ImGui::SameLine(0, 10);
      if (ImGui::GetCursorScreenPos().x + 14 + ImGui::CalcTextSize(cache_cell_name(cell)).x > right) ImGui::NewLine();
    }
    const ImVec2 q = ImGui::GetCursorScreenPos();
    const float box = ImGui::GetFontSize() * 0.7f;
    ImGui::GetWindowDrawList()->AddRectFilled(ImVec2(q.x, q.y + 3), ImVec2(q.x + box, q.y + 3 + box), ToImU32(cache_cell_color(cell)));
    ImGui::Dummy(ImVec2(box + 3, box));
    ImGui::SameLine(0, 0);
    ImGui::TextDisabled("%s", cache_cell_name(cell));
  }
}

void CacheView(ViewerState& state, OpenRun& run, const CacheTimeline& cache) {
  ImGui::Text("expert cache: %zu decode steps", cache.steps.size());
  HelpMarker("Columns: decode steps. Rows: the MoE blocks, top to bottom, each a band of cells, one cell per expert "
             "the block chose or had copied ahead at that step: blue, copied ahead and chosen (the copy overlapped "
             "compute); green, chosen and already resident; red, chosen and copied on demand (the block stalled); "
             "violet, chosen and computed on the host from its copy of the weights while the GPU ran the rest (no "
             "copy, no slot); orange, copied ahead and not chosen at that step (PCIe bytes and a slot spent for nothing). The "
             "record does not say which of the cache's slots each expert took, so a band counts lookups and "
             "copies, not slots. The white line is the scrubber's step.");
  if (!cache.wasted_known) LacksData(("wasted prefetch copies that can be derived: " + cache.note).c_str());
  if (cache.steps.empty() || cache.rows_per_block == 0) return;
  HeatmapTexture& texture = state.textures[RegionName(state, run, "offload_cache")];
  const std::string key = TextureKey("offload_cache", run, 0, 0, 0);
  if (texture.key != key) texture.upload(cache_image(cache), key);
  const float label_width = ImGui::CalcTextSize("L00 ").x;
  const float width = std::max(100.0f, ImGui::GetContentRegionAvail().x - label_width);
  const float rows = static_cast<float>(cache.layers.size() * static_cast<size_t>(cache.rows_per_block));
  const float height = std::clamp(rows * 14.0f, 60.0f, 220.0f);
  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const float band = height / static_cast<float>(cache.layers.size());
  for (size_t m = 0; m < cache.layers.size(); ++m) {
    const std::string label = std::string("L").append(std::to_string(cache.layers[m]));
    draw->AddText(ImVec2(p0.x, p0.y + band * static_cast<float>(m) + (band - ImGui::GetFontSize()) / 2),
                  IM_COL32(180, 180, 180, 255), label.c_str());
  }
  ImGui::SetCursorScreenPos(ImVec2(p0.x + label_width, p0.y));
  int col = 0, row = 0;
  if (HeatmapImage(texture, ImVec2(width, height), &col, &row) && col >= 0 && row >= 0 &&
      static_cast<size_t>(col) < cache.steps.size()) {
    const size_t block = static_cast<size_t>(row) / static_cast<size_t>(cache.rows_per_block);
    if (block < cache.layers.size())
      ImGui::SetTooltip("step %lld, MoE block at layer %lld: %s", static_cast<long long>(cache.steps[static_cast<size_t>(col)]),
                        static_cast<long long>(cache.layers[block]), cache_cell_name(cache.at(static_cast<size_t>(row), static_cast<size_t>(col))));
  }
  RecordLastItem(state, RegionName(state, run, "offload_cache"));
  // Bands apart, and the scrubber's step.
  const float x0 = p0.x + label_width;
  for (size_t m = 1; m < cache.layers.size(); ++m)
    draw->AddLine(ImVec2(x0, p0.y + band * static_cast<float>(m)), ImVec2(x0 + width, p0.y + band * static_cast<float>(m)),
                  IM_COL32(10, 10, 10, 255), 2.0f);
  const auto at = std::upper_bound(cache.steps.begin(), cache.steps.end(), state.step);
  if (at != cache.steps.begin()) {
    const float column_width = width / static_cast<float>(cache.steps.size());
    const float x = x0 + column_width * (static_cast<float>(at - cache.steps.begin()) - 0.5f);
    draw->AddLine(ImVec2(x, p0.y), ImVec2(x, p0.y + height), IM_COL32(255, 255, 255, 200), 1.0f);
  }
  CacheLegend();
}

void BlockTable(const CacheTimeline& cache) {
  ImGui::Text("per MoE block, over the decode steps");
  HelpMarker("hit: chosen experts the GPU computed that it found in GPU memory / all the GPU computed. prefetch: "
             "copies made ahead that the block chose / copies made ahead ('-' where the block copies nothing ahead: "
             "the first block of pre-gating has no block before it to choose its experts). miss: on-demand copies. "
             "on host, host time (shown when the run computed experts on the host): chosen experts the host computed "
             "instead of copying them in (neither hits nor misses), and the host's time for them, summed. stall: time "
             "the compute stream waited for this block's copies, summed.");
  const bool host = cache.has_on_host;
  if (!ImGui::BeginTable("blocks", host ? 8 : 6, ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit)) return;
  for (const char* column : {"layer", "hit", "prefetch", "miss", "on host", "host time", "wasted", "stall"})
    if (host || (std::string_view(column) != "on host" && std::string_view(column) != "host time"))
      ImGui::TableSetupColumn(column);
  ImGui::TableHeadersRow();
  for (size_t m = 0; m < cache.layers.size(); ++m) {
    const CacheOutcomes& b = cache.per_block[m];
    ImGui::TableNextRow();
    ImGui::TableNextColumn();
    ImGui::Text("%lld", static_cast<long long>(cache.layers[m]));
    ImGui::TableNextColumn();
    ImGui::TextUnformatted(Percent(b.hit_rate()).c_str());
    ImGui::TableNextColumn();
    ImGui::TextUnformatted(Percent(b.prefetch_accuracy()).c_str());
    ImGui::TableNextColumn();
    ImGui::Text("%lld", static_cast<long long>(b.misses));
    if (host) {
      ImGui::TableNextColumn();
      ImGui::Text("%lld", static_cast<long long>(b.on_host));
      ImGui::TableNextColumn();
      ImGui::Text("%.0f us", b.host_us);
    }
    ImGui::TableNextColumn();
    if (b.prefetched_wasted() < 0) ImGui::TextDisabled("?");
    else ImGui::Text("%lld", static_cast<long long>(b.prefetched_wasted()));
    ImGui::TableNextColumn();
    ImGui::Text("%.0f us", b.stall_us);
  }
  ImGui::EndTable();
}

void ShowRunOffload(ViewerState& state, OpenRun& run, double timeline_span_us) {
  const RunModel& m = run.model;
  if (m.offloads.empty()) {
    LacksData("offload events: its experts stayed in GPU memory, or its program did not record the expert cache "
              "(moe_generate --run-dir and offload_bench --record-dir write them)");
    return;
  }
  const int64_t layer = -1;  // all layers summed; the cache is shared by the layers
  const OffloadView v = offload_at(m, state.step, layer);
  const ViewerState::CachedDecode& decode = Decode(state, run);
  ImGui::Text("step %lld, all MoE blocks%s", static_cast<long long>(v.step), v.step == 0 ? " (the prefill)" : "");
  const MetricItem hits_metric{"hits", "%.0f", static_cast<double>(v.hits),
                               "Chosen experts whose weights were already in GPU memory when the block needed them."};
  const MetricItem misses_metric{"misses", "%.0f", static_cast<double>(v.misses),
                                 "Chosen experts copied from host memory on demand: the block waits for them."};
  const MetricItem stall_metric{"stall", "%.0f us", v.stall_us,
                                "Time the compute stream waited for expert copies at this step: copy time the prefetch did not hide."};
  // The host's share only for a run that computed experts there (at any step: the grid keeps its
  // layout while the scrubber moves).
  if (decode.cache.has_on_host || v.on_host > 0)
    MetricGrid({hits_metric, misses_metric,
                {"on host", "%.0f", static_cast<double>(v.on_host),
                 "Chosen experts computed on the host from its copy of the weights instead of copied in: neither "
                 "hits nor misses."},
                {"host time", "%.0f us", v.host_us,
                 "The host's time for its experts at this step, overlapped with the GPU's work on the rest."},
                stall_metric},
               5, 16);
  else
    MetricGrid({hits_metric, misses_metric, stall_metric}, 3, 16);

  ImGui::Text("copy and compute streams");
  HelpMarker("The compute stream, the copy stream and the compute stream's waits for copies ('compute waits'). A copy "
             "under compute is hidden; red is a stall: the compute stream waiting for a copy to land. 'copy mJ' is an "
             "on-demand copy for MoE block J, 'prefetch mJ' a copy made ahead. Every run is drawn on the same time "
             "scale, the longest step shown; the white line ends this run's step.");
  const Timeline& timeline = OffloadTimeline(state, run);
  if (timeline.lanes.empty()) LacksData("copy or compute spans at this step");
  else TimelineView("offload_timeline", timeline, ImVec2(ImGui::GetContentRegionAvail().x, 90), timeline_span_us);

  ImGui::Spacing();
  CacheView(state, run, decode.cache);
  ImGui::Spacing();
  BlockTable(decode.cache);

  // Each series scans every offload event of the run: kept until the data changes.
  auto cached = [&](const char* field) -> const Series& {
    auto& entry = state.series[RegionName(state, run, "offload_") + field];
    const std::string key = TextureKey(field, run, layer, 0, 0);
    if (entry.key != key) entry = {key, offload_series(m, field, layer)};
    return entry.series;
  };
  const Series& hit_rate = cached("hit_rate");
  const Series& stall = cached("stall_us");
  const std::string suffix = RegionName(state, run, "");
  const float width = ImGui::GetContentRegionAvail().x;
  ImGui::Text("hit rate per step");
  HelpMarker("Expert-cache hit rate over the run, all blocks, of the experts the GPU computed (a gap where the host "
             "computed every one); step 0 is the prefill.");
  CurvePlot(("offload_hit_rate" + suffix).c_str(), state, {{"hit rate", &hit_rate, RunColor(run.color_index)}}, ImVec2(width, 70));
  ImGui::Text("stall per step (us)");
  HelpMarker("Time the blocks waited for copies per step.");
  CurvePlot(("offload_stall" + suffix).c_str(), state, {{"stall us", &stall, RunColor(run.color_index)}}, ImVec2(width, 70));
}

}  // namespace

void ShowOffloadPanel(ViewerState& state) {
  ModesTable(state);
  // One time scale for the timelines side by side: the longest step drawn.
  double span_us = 0;
  const std::vector<OpenRun*> runs = state.panel_runs(state.current_panel);
  for (size_t i = 0; i < runs.size() && i < kMaxRunColumns; ++i)
    if (!runs[i]->model.offloads.empty()) {
      const Timeline& t = OffloadTimeline(state, *runs[i]);
      span_us = std::max(span_us, t.t1 - t.t0);
    }
  ForEachShownRun(state, "offload_runs", [&](OpenRun& run) { ShowRunOffload(state, run, span_us); });
}

}  // namespace moe::viewer
