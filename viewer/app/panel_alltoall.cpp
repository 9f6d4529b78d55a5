// panel_alltoall.cpp: timeline and all-to-all timing: a per-rank, per-stream timeline of the phases
// of the scrubber's step (a training step's model phases with the MoE layer's phases nested under
// them; dispatch, expert compute, combine and copies across ranks, on one clock), the rank x rank
// byte matrix of one layer (or all) at that step, the achieved bandwidth, the load each rank's
// experts carry, and the time each rank waits in the exchanges. Data: viewer/model/comm_view.h and
// parallel_view.h.
#include <algorithm>
#include <array>
#include <cstdio>
#include <sstream>
#include <string>

#include "colormap.h"       // colorize, load_color
#include "comm_view.h"      // build_timeline, alltoall_at, alltoall_bandwidth_series
#include "panels.h"
#include "parallel_view.h"  // rank_load_at, exchange_waits_at, alltoall_layers
#include "widgets.h"

namespace moe::viewer {

namespace {

std::string Bytes(double bytes) {
  char text[32];
  if (bytes >= 1e9) std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(text, sizeof text, "%.2f MB", bytes / 1e6);
  else if (bytes >= 1e3) std::snprintf(text, sizeof text, "%.1f kB", bytes / 1e3);
  else std::snprintf(text, sizeof text, "%.0f B", bytes);
  return text;
}

std::string LayerText(int64_t layer) { return layer < 0 ? "all layers" : "layer " + std::to_string(layer); }

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

// One byte matrix as a heatmap under its name, each cell's bytes written on it when it is large
// enough to hold them.
void MatrixImage(ViewerState& state, OpenRun& run, const AllToAllView& a, const std::string& name) {
  ImGui::BeginGroup();
  ImGui::TextUnformatted(name.empty() ? "(unnamed)" : name.c_str());
  Matrix bytes;
  bytes.rows = bytes.cols = a.ranks;
  double largest = 0;
  for (double b : a.bytes) largest = std::max(largest, b);
  for (double b : a.bytes) bytes.values.push_back(largest > 0 ? static_cast<float>(b / largest) : 0.0f);
  const std::string region = RegionName(state, run, ("alltoall_bytes" + std::string(name.empty() ? "" : "_") + name).c_str());
  HeatmapTexture& texture = state.textures[region];
  const std::string key = TextureKey("bytes", run, a.step, a.layer, 0) + name;
  if (texture.key != key) texture.upload(colorize(bytes, 0.0f, 1.0f), key);
  const float side = std::clamp(static_cast<float>(a.ranks) * 80.0f, 80.0f, 260.0f);
  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  int col = 0, row = 0;
  if (HeatmapImage(texture, ImVec2(side, side), &col, &row))
    ImGui::SetTooltip("rank %d -> rank %d: %.0f bytes", row, col, a.bytes[static_cast<size_t>(row * a.ranks + col)]);
  RecordLastItem(state, region);
  // Small matrices carry their numbers: two ranks are four cells, and the reader wants the bytes.
  const float cell = side / static_cast<float>(std::max<int64_t>(1, a.ranks));
  if (cell >= 60.0f) {
    ImDrawList* draw = ImGui::GetWindowDrawList();
    for (int64_t s = 0; s < a.ranks; ++s)
      for (int64_t d = 0; d < a.ranks; ++d) {
        const double b = a.bytes[static_cast<size_t>(s * a.ranks + d)];
        const std::string text = Bytes(b);
        const ImVec2 size = ImGui::CalcTextSize(text.c_str());
        const bool light = largest > 0 && b / largest > 0.6;  // the top of the load colours is pale
        draw->AddText(ImVec2(p0.x + cell * (static_cast<float>(d) + 0.5f) - size.x / 2, p0.y + cell * (static_cast<float>(s) + 0.5f) - size.y / 2),
                      light ? IM_COL32(0, 0, 0, 255) : IM_COL32(255, 255, 255, 255), text.c_str());
      }
  }
  ImGui::EndGroup();
}

// The rank x rank bytes of the chosen all-to-all (or each of them) and layer at the step, beside
// the achieved bandwidth.
void ByteMatrix(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.alltoalls.empty()) {
    LacksData("all-to-all byte matrices (a run on one GPU exchanges nothing; moe_train_distributed on two or more "
              "ranks and lesson 06 under mpirun write them)");
    return;
  }
  const AllToAllView a = alltoall_at(m, state.step, state.alltoall_name, state.alltoall_layer);
  ImGui::Separator();
  ImGui::Text("bytes[src][dst]: %s, step %lld (%lld all-to-all events)", LayerText(a.layer).c_str(),
              static_cast<long long>(a.step), static_cast<long long>(a.events));
  HelpMarker("Row: the sending rank, column: the receiving rank. The diagonal stays on its rank (no link "
             "crossed). An unbalanced row or column is a rank that sends or receives more, because its "
             "tokens prefer remote experts or its experts are hot. The combine sends the dispatch's rows back: "
             "its matrix is the dispatch's transpose. Colour: bytes relative to the largest cell. Pick the "
             "all-to-all and the layer above; the scrubber picks the step.");
  if (m.alltoall_wrong_size > 0)
    WarningLine(std::to_string(m.alltoall_wrong_size) + " all-to-all byte matrices of this run are not " +
                std::to_string(m.summary.world_size) + " x " + std::to_string(m.summary.world_size) +
                " (run.json world_size " + std::to_string(m.summary.world_size) + "); they are drawn as recorded");
  if (a.events == 0) {
    LacksData(("all-to-all events of " + LayerText(state.alltoall_layer) + " at this step").c_str());
    return;
  }
  // Without a chosen all-to-all, each one of the step (dispatch, combine) gets its own matrix.
  std::vector<std::string> names{state.alltoall_name};
  if (state.alltoall_name.empty()) names = alltoall_names(m);
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) ImGui::SameLine(0, 16);
    MatrixImage(state, run, alltoall_at(m, state.step, names[i], state.alltoall_layer), names[i]);
  }
  ImGui::SameLine();
  ImGui::BeginGroup();
  Metric("achieved bandwidth", "%.2f GB/s", a.bandwidth_gb_per_s,
         "Bytes that crossed between ranks (the off-diagonal of the matrix) divided by the time the "
         "all-to-alls took, summed over the events shown. Compare with the link's peak (NVLink on "
         "H100/H200: about 450 GB/s per direction per GPU) to see how much the exchange wastes.");
  Metric("bytes between ranks", "%.0f", a.remote_bytes, "The off-diagonal sum: what had to cross a link.");
  Metric("time", "%.1f us", a.duration_us, "The summed duration of the all-to-all events shown (the rank that timed them).");
  for (int64_t r = 0; r < a.ranks && r < 16; ++r)
    ImGui::Text("rank %lld: sends %s, receives %s", static_cast<long long>(r), Bytes(a.send_bytes[static_cast<size_t>(r)]).c_str(),
                Bytes(a.recv_bytes[static_cast<size_t>(r)]).c_str());
  ImGui::EndGroup();
  // The series scans every all-to-all of the run: kept until the data or the name changes.
  auto& cached = state.series[RegionName(state, run, "bandwidth")];
  const std::string series_key = TextureKey("bandwidth", run, 0, 0, 0) + state.alltoall_name;
  if (cached.key != series_key) cached = {series_key, alltoall_bandwidth_series(m, state.alltoall_name)};
  ImGui::Text("achieved bandwidth per step (GB/s), all layers");
  HelpMarker("The same figure for every recorded step: dips are steps where the exchange waited.");
  CurvePlot(("bandwidth" + RegionName(state, run, "")).c_str(), state, {{"GB/s", &cached.series, RunColor(run.color_index)}},
            ImVec2(ImGui::GetContentRegionAvail().x, 70));
}

// Where the experts were at this step, when the run placed them by load (--placement eplb): each
// rank's experts, the replicated ones marked, and the steps at which the placement was planned.
void PlacementOfExperts(ViewerState& state, OpenRun& run) {
  const PlacementView placement = placement_at(run.model, state.step, state.alltoall_layer);
  if (placement.plan_steps.empty()) return;
  if (placement.planned_at < 0) {
    ImGui::Text("experts: E / R a rank in id order until the first placement by load, at step %lld",
                static_cast<long long>(placement.plan_steps.front()));
    return;
  }
  ImGui::Text("experts placed by load (EPLB), layer %lld, planned at step %lld: busiest / mean rank %.3f -> %.3f",
              static_cast<long long>(placement.layer), static_cast<long long>(placement.planned_at),
              placement.expected_before, placement.expected_after);
  HelpMarker("Every few steps the trainer counts the rows routed to each expert and places the experts again "
             "(DeepSeek's EPLB): the hottest get a copy on a second rank (marked (xN): N ranks hold it, each "
             "computing a share of its rows), then the copies are packed so that every rank carries about the "
             "same load. The two figures are the busiest rank over the mean rank that the counted loads give "
             "under the old placement and the new; the bars above show what the dispatch actually sent.");
  for (size_t r = 0; r < placement.experts_of_rank.size() && r < 16; ++r) {
    std::ostringstream line;
    line << "rank " << r << ":";
    for (int64_t e : placement.experts_of_rank[r]) {
      line << ' ' << e;
      const int64_t copies = placement.copies[static_cast<size_t>(e)];
      if (copies > 1) line << " (x" << copies << ")";
    }
    ImGui::TextUnformatted(line.str().c_str());
  }
  std::ostringstream steps;
  steps << "planned at steps:";
  for (size_t i = 0; i < placement.plan_steps.size() && i < 12; ++i) steps << ' ' << placement.plan_steps[i];
  if (placement.plan_steps.size() > 12) steps << " ... (" << placement.plan_steps.size() << " plans)";
  ImGui::TextUnformatted(steps.str().c_str());
}

// What each rank's experts received to compute, from the dispatch matrix's columns.
void LoadAcrossRanks(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  const RankLoad load = rank_load_at(m, state.step, state.alltoall_layer);
  if (load.ranks == 0) return;  // ByteMatrix said what is missing
  ImGui::Separator();
  ImGui::Text("load across ranks: %s, step %lld: max / mean %.3f (rank %lld the busiest)", LayerText(state.alltoall_layer).c_str(),
              static_cast<long long>(load.step), load.max_over_mean, static_cast<long long>(load.busiest_rank));
  HelpMarker("The bytes the dispatch all-to-all sent to each rank (the matrix's column): the token rows its experts "
             "compute. The step waits for the busiest rank, so max / mean is the expert-parallel slowdown the "
             "routing causes: 1 is balanced, 2 means one of two ranks does all the work. The load-balancing loss "
             "pushes the router towards 1.");
  double largest = 0, total = 0;
  for (double b : load.received) {
    largest = std::max(largest, b);
    total += b;
  }
  const float width = ImGui::GetContentRegionAvail().x;
  for (int64_t r = 0; r < load.ranks && r < 16; ++r) {
    const double b = load.received[static_cast<size_t>(r)];
    char overlay[80];
    std::snprintf(overlay, sizeof overlay, "rank %lld: %s (%.1f%%)", static_cast<long long>(r), Bytes(b).c_str(),
                  total > 0 ? 100.0 * b / total : 0.0);
    ImGui::ProgressBar(largest > 0 ? static_cast<float>(b / largest) : 0.0f, ImVec2(std::min(width, 420.0f), 0), overlay);
  }
  PlacementOfExperts(state, run);
  auto& cached = state.series[RegionName(state, run, "rank_imbalance")];
  const std::string key = TextureKey("rank_imbalance", run, state.alltoall_layer, 0, 0);
  if (cached.key != key) cached = {key, rank_imbalance_series(m, state.alltoall_layer)};
  ImGui::Text("max / mean load across ranks per recorded step, %s", LayerText(state.alltoall_layer).c_str());
  HelpMarker("The same figure at every step the run recorded all-to-alls.");
  CurvePlot(("rank_imbalance" + RegionName(state, run, "")).c_str(), state,
            {{"max / mean", &cached.series, RunColor(run.color_index)}}, ImVec2(width, 70));
}

// The time each rank waits in the exchanges, derived from every rank's exchange spans.
// A table of one row per rank (at most 16): two times in us and a share.
void RankTable(const char* id, std::array<const char*, 4> columns, const std::vector<double>& first_us,
               const std::vector<double>& second_us, const std::vector<double>& share) {
  if (!ImGui::BeginTable(id, 4, ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit)) return;
  for (const char* column : columns) ImGui::TableSetupColumn(column);
  ImGui::TableHeadersRow();
  for (size_t r = 0; r < first_us.size() && r < 16; ++r) {
    ImGui::TableNextRow();
    ImGui::TableNextColumn();
    ImGui::Text("%zu", r);
    ImGui::TableNextColumn();
    ImGui::Text("%.1f us", first_us[r]);
    ImGui::TableNextColumn();
    ImGui::Text("%.1f us", second_us[r]);
    ImGui::TableNextColumn();
    ImGui::Text("%.0f%%", 100.0 * share[r]);
  }
  ImGui::EndTable();
}

// One line per rank (at most 16) over the recorded steps, from make(run): rebuilt when the data
// changes, drawn under `title` with each rank's colour.
void PerRankCurve(ViewerState& state, OpenRun& run, const std::string& id, int64_t ranks,
                  std::vector<Series> (*make)(const RunModel&), const char* title) {
  auto region = [&](int64_t r) { return RegionName(state, run, (id + "_r" + std::to_string(r)).c_str()); };
  const std::string key = TextureKey(id.c_str(), run, 0, 0, 0);
  if (state.series[region(0)].key != key) {
    const std::vector<Series> per_rank = make(run.model);
    for (size_t r = 0; r < per_rank.size() && r < 16; ++r) state.series[region(int64_t(r))] = {key, per_rank[r]};
  }
  std::vector<CurveLine> lines;
  for (int64_t r = 0; r < ranks && r < 16; ++r) {
    const auto& entry = state.series[region(r)];
    if (entry.key == key) lines.push_back({"rank " + std::to_string(r), &entry.series, ToImU32(expert_color(r))});
  }
  ImGui::Text("%s", title);
  for (size_t r = 0; r < lines.size(); ++r) {
    ImGui::SameLine();
    ImGui::TextColored(ImGui::ColorConvertU32ToFloat4(lines[r].color), "%s", lines[r].label.c_str());
  }
  CurvePlot((id + RegionName(state, run, "")).c_str(), state, lines, ImVec2(ImGui::GetContentRegionAvail().x, 70));
}

void IdleInExchanges(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.spans.empty()) return;
  const ExchangeWaits w = exchange_waits_at(m, state.step);
  ImGui::Separator();
  if (w.exchanges == 0) {
    LacksData("exchange phases timed on two or more ranks, so no idle time in the all-to-alls (a one-GPU run waits "
              "for no one; moe_train_distributed on two or more ranks records every rank's exchange spans)");
    return;
  }
  std::string names;
  for (const std::string& n : w.names) names += (names.empty() ? "" : ", ") + n;
  ImGui::Text("idle time in the all-to-alls, step %lld", static_cast<long long>(w.step));
  HelpMarker("An all-to-all returns on every rank at about the same moment, once the last rank has joined and the "
             "bytes have moved; a rank that arrives early waits. Each rank's k-th exchange of a name is the same "
             "collective on every rank, so its idle time is its duration minus the fastest rank's, summed over the "
             "step. Measured on each rank's own clock: no cross-rank alignment is assumed. It is a lower bound "
             "(the fastest rank waits for the bytes too) and it also holds differences in what each rank sends.");
  ImGui::TextWrapped("Derived from the record: for each of the step's %lld collectives (%s), the rank's duration "
                     "minus the fastest rank's; summed.", static_cast<long long>(w.exchanges), names.c_str());
  std::vector<double> share(w.idle_us.size());
  for (size_t r = 0; r < share.size(); ++r) share[r] = w.exchange_us[r] > 0 ? w.idle_us[r] / w.exchange_us[r] : 0.0;
  RankTable("idle", {"rank", "in exchanges", "idle (waiting)", "idle share"}, w.exchange_us, w.idle_us, share);
  PerRankCurve(state, run, "idle", w.ranks, exchange_idle_series, "idle per rank per recorded step (us):");
  HelpMarker("A run's first step holds its communicator's first collective (NCCL's set-up in moe_train_distributed): "
             "a rank that reaches it early waits long there.");
}

// How long each rank's compute stream waited on communication in the step, and per recorded step.
void ExposedCommunicationView(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.spans.empty()) return;
  const ExposedCommunication x = exposed_communication_at(m, state.step);
  if (x.ranks < 2) return;  // one GPU waits on no exchange
  ImGui::Separator();
  ImGui::Text("exposed communication, step %lld", static_cast<long long>(x.step));
  HelpMarker("The time the compute stream waited on communication: the count exchanges, the waits for the rows to "
             "arrive at the experts (ep_wait_dispatch) and to come back (ep_wait_combine), and the gradients' "
             "all-reduce where the backward did not hide it. With two micro-batches overlapped (--overlap, the default on several GPUs), the "
             "first one's stream, which the step's end waits on. This is the part of the step that hiding "
             "communication behind compute can still take away.");
  std::vector<double> share(x.exposed_us.size());
  for (size_t r = 0; r < share.size(); ++r) share[r] = x.step_us[r] > 0 ? x.exposed_us[r] / x.step_us[r] : 0.0;
  RankTable("exposed", {"rank", "exposed", "step", "share"}, x.exposed_us, x.step_us, share);
  PerRankCurve(state, run, "exposed", x.ranks, exposed_communication_series,
               "exposed communication per rank per recorded step (us):");
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
             "slowest one: look for gaps before a dispatch or combine. Grey: spans too thin to draw, merged. "
             "Several ranks share one time axis: moe_train_distributed places each rank's GPU times from rank 0's "
             "host time at the step's start, so the lanes are aligned on the step's first phase (the ranks leave "
             "the previous step's all-reduce together), not on a clock the GPUs share.");
  if (m.spans.empty() && m.alltoalls.empty()) {
    LacksData("timed spans or all-to-all events (its program timed no phases)");
    return;
  }
  if (m.spans.empty()) LacksData("timed spans (only all-to-all totals)");
  TimelineView("timeline", timeline, ImVec2(std::max(200.0f, ImGui::GetContentRegionAvail().x), 160));
  RecordLastItem(state, RegionName(state, run, "timeline"));

  ByteMatrix(state, run);
  LoadAcrossRanks(state, run);
  IdleInExchanges(state, run);
  ExposedCommunicationView(state, run);
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
    std::vector<int64_t> layers;
    for (OpenRun* run : state.shown_runs())
      for (int64_t l : alltoall_layers(run->model))
        if (l >= 0 && std::find(layers.begin(), layers.end(), l) == layers.end()) layers.push_back(l);
    std::sort(layers.begin(), layers.end());
    if (!layers.empty()) {
      ImGui::SameLine(0, 20);
      ImGui::SetNextItemWidth(120);
      if (ImGui::BeginCombo("layer", LayerText(state.alltoall_layer).c_str())) {
        if (ImGui::Selectable("all layers", state.alltoall_layer < 0)) state.alltoall_layer = -1;
        for (int64_t l : layers)
          if (ImGui::Selectable(LayerText(l).c_str(), l == state.alltoall_layer)) state.alltoall_layer = l;
        ImGui::EndCombo();
      }
      HelpMarker("The MoE layer whose byte matrix and load across ranks to show (moe_viewer --layer N), or all "
                 "layers summed.");
    }
  }
  ForEachShownRun(state, "alltoall_runs", [&](OpenRun& run) { ShowRunAllToAll(state, run); });
}

// Shared with panel_offload.cpp: the copy and compute lanes of the step.
const Timeline& OffloadTimeline(ViewerState& state, OpenRun& run) { return CachedStepTimeline(state, run, true); }

}  // namespace moe::viewer
