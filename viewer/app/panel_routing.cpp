// panel_routing.cpp: routing imbalance: the step x expert load heatmap of a layer, the layer x
// expert heatmap at the scrubber's step, per-expert bars with the capacity line, the imbalance
// statistics over steps, and expert load per genre.
// Heatmaps are prepared by viewer/model/routing_view.h, reduced to at most a column per pixel,
// and drawn as one texture each: never a rectangle per cell.
#include <algorithm>
#include <cstdio>
#include <string>

#include "colormap.h"      // colorize, load_color
#include "routing_view.h"  // step_expert_load, layer_expert_load, expert_bars, genre_table
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {

void ShowStepExpertHeatmap(ViewerState& state, OpenRun& run, const LayerRouting& layer) {
  const float width = std::max(64.0f, ImGui::GetContentRegionAvail().x);
  const int64_t max_columns = std::clamp<int64_t>(static_cast<int64_t>(width), 1, 2048);
  const std::string key = TextureKey("steps", run, layer.layer, max_columns, state.load_scale_max);
  HeatmapTexture& texture = state.textures[RegionName(state, run, "routing_heatmap") + "/steps"];
  if (texture.key != key) texture.upload(colorize(step_expert_load(layer, max_columns), 0.0f, state.load_scale_max), key);
  const float height = std::clamp(static_cast<float>(layer.num_experts) * 6.0f, 64.0f, 256.0f);
  const ImVec2 origin = ImGui::GetCursorScreenPos();
  int col = 0, row = 0;
  const bool hovered = HeatmapImage(texture, ImVec2(width, height), &col, &row);
  RecordLastItem(state, RegionName(state, run, "routing_heatmap"));
  // The scrubber's step as a white tick above and below the heatmap.
  const int64_t n = static_cast<int64_t>(layer.rows.size());
  const auto at = std::upper_bound(layer.rows.begin(), layer.rows.end(), state.step,
                                   [](int64_t s, const RoutingRow& r) { return s < r.step; });
  const float x = origin.x + (static_cast<float>(std::max<int64_t>(0, at - layer.rows.begin() - 1)) + 0.5f) /
                                 static_cast<float>(std::max<int64_t>(1, n)) * width;
  ImGui::GetWindowDrawList()->AddTriangleFilled(ImVec2(x - 4, origin.y + height + 6), ImVec2(x + 4, origin.y + height + 6),
                                                ImVec2(x, origin.y + height), IM_COL32(255, 255, 255, 220));
  ImGui::Dummy(ImVec2(width, 6));
  if (hovered && texture.width > 0) {
    const Bucket b = bucket_range(n, texture.width, col);
    const RoutingRow& first = layer.rows[static_cast<size_t>(std::min(b.first, n - 1))];
    ImGui::BeginTooltip();
    if (b.last - b.first <= 1) {
      const int64_t tokens = row < static_cast<int>(first.tokens_per_expert.size()) ? first.tokens_per_expert[static_cast<size_t>(row)] : 0;
      ImGui::Text("step %lld, expert %d: %lld tokens", static_cast<long long>(first.step), row, static_cast<long long>(tokens));
      const double mean = first.stats.total_tokens / static_cast<double>(std::max<int64_t>(1, layer.num_experts));
      ImGui::Text("load %.3fx fair share (mean %.1f tokens per expert)", mean > 0 ? tokens / mean : 0.0, mean);
      if (row < static_cast<int>(first.dropped_per_expert.size()))
        ImGui::Text("dropped %lld", static_cast<long long>(first.dropped_per_expert[static_cast<size_t>(row)]));
    } else {
      const RoutingRow& last = layer.rows[static_cast<size_t>(b.last - 1)];
      ImGui::Text("steps %lld .. %lld (%lld recorded steps in this pixel column), expert %d",
                  static_cast<long long>(first.step), static_cast<long long>(last.step),
                  static_cast<long long>(b.last - b.first), row);
      ImGui::Text("mean load over them: see the colour; zoom with the step scrubber to see each step");
    }
    ImGui::EndTooltip();
  }
}

void ShowLayerExpertHeatmap(ViewerState& state, OpenRun& run) {
  std::vector<int64_t> layers;
  Matrix m = layer_expert_load(run.model, state.step, &layers);
  const std::string key = TextureKey("layers", run, state.step, 0, state.load_scale_max);
  HeatmapTexture& texture = state.textures[RegionName(state, run, "layer_heatmap")];
  if (texture.key != key) texture.upload(colorize(m, 0.0f, state.load_scale_max), key);
  const float width = std::max(64.0f, ImGui::GetContentRegionAvail().x);
  const float height = std::clamp(static_cast<float>(layers.size()) * 14.0f, 14.0f, 160.0f);
  int col = 0, row = 0;
  if (HeatmapImage(texture, ImVec2(width, height), &col, &row) && row < static_cast<int>(layers.size())) {
    const auto& lr = run.model.routing.at(layers[static_cast<size_t>(row)]);
    if (const RoutingRow* r = lr.row_at_or_before(state.step); r && col < static_cast<int>(r->tokens_per_expert.size()))
      ImGui::SetTooltip("layer %lld, expert %d, step %lld: %lld tokens", static_cast<long long>(lr.layer), col,
                        static_cast<long long>(r->step), static_cast<long long>(r->tokens_per_expert[static_cast<size_t>(col)]));
  }
  RecordLastItem(state, RegionName(state, run, "layer_heatmap"));
}

void ShowExpertBars(ViewerState& state, OpenRun& run, const ExpertBars& bars) {
  const float width = std::max(64.0f, ImGui::GetContentRegionAvail().x), height = 110;
  const ImVec2 p = ImGui::GetCursorScreenPos();
  ImGui::InvisibleButton("bars", ImVec2(width, height));
  RecordLastItem(state, RegionName(state, run, "expert_bars"));
  ImDrawList* draw = ImGui::GetWindowDrawList();
  draw->AddRectFilled(p, ImVec2(p.x + width, p.y + height), IM_COL32(25, 25, 30, 255));
  const size_t E = bars.tokens.size();
  double top = static_cast<double>(std::max(bars.capacity, int64_t{1}));
  for (int64_t t : bars.tokens) top = std::max(top, static_cast<double>(t));
  top *= 1.05;
  const float bar_width = width / static_cast<float>(std::max<size_t>(E, 1));
  auto y_of = [&](double v) { return p.y + height - static_cast<float>(v / top) * height; };
  for (size_t e = 0; e < E; ++e) {
    const float x0 = p.x + bar_width * static_cast<float>(e), x1 = x0 + std::max(1.0f, bar_width - 1);
    const double kept = static_cast<double>(bars.tokens[e] - bars.dropped[e]);
    draw->AddRectFilled(ImVec2(x0, y_of(kept)), ImVec2(x1, p.y + height), ToImU32(expert_color(static_cast<int64_t>(e))));
    if (bars.dropped[e] > 0)
      draw->AddRectFilled(ImVec2(x0, y_of(static_cast<double>(bars.tokens[e]))), ImVec2(x1, y_of(kept)), IM_COL32(230, 50, 50, 255));
  }
  draw->AddLine(ImVec2(p.x, y_of(bars.mean)), ImVec2(p.x + width, y_of(bars.mean)), IM_COL32(255, 255, 255, 120), 1.0f);
  if (bars.capacity >= 0)
    draw->AddLine(ImVec2(p.x, y_of(static_cast<double>(bars.capacity))), ImVec2(p.x + width, y_of(static_cast<double>(bars.capacity))),
                  IM_COL32(255, 80, 80, 255), 2.0f);
  if (ImGui::IsItemHovered() && E > 0) {
    const size_t e = std::min(E - 1, static_cast<size_t>((ImGui::GetIO().MousePos.x - p.x) / bar_width));
    ImGui::SetTooltip("expert %zu: %lld tokens routed, %lld dropped%s", e, static_cast<long long>(bars.tokens[e]),
                      static_cast<long long>(bars.dropped[e]), bars.capacity >= 0 ? "" : " (dropless: nothing dropped)");
  }
  ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
  ImGui::TextWrapped("bars: tokens per expert (red top: dropped); white line: fair share; red line: capacity C%s",
                     bars.capacity >= 0 ? "" : " (none: dropless)");
  ImGui::PopStyleColor();
}

void ShowGenres(ViewerState& state, OpenRun& run, int64_t layer) {
  const GenreTable table = genre_table(run.model, layer, state.step);
  if (!table.valid) {
    LacksData("per-genre routing (tokens_per_expert_by_genre) at this step");
    return;
  }
  const int64_t G = static_cast<int64_t>(table.genres.size()), E = table.num_experts;
  Matrix m;
  m.rows = G;
  m.cols = E;
  m.values.assign(static_cast<size_t>(G * E), 0.0f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < E; ++e)  // relative to 1/E: 1 = the genre spreads evenly over the experts
      m.values[static_cast<size_t>(g * E + e)] = static_cast<float>(table.fractions[static_cast<size_t>(g)][static_cast<size_t>(e)] * static_cast<double>(E));
  const std::string key = TextureKey("genres", run, layer, table.step, state.load_scale_max);
  HeatmapTexture& texture = state.textures[RegionName(state, run, "genre_heatmap")];
  if (texture.key != key) texture.upload(colorize(m, 0.0f, state.load_scale_max), key);
  ImGui::Text("step %lld: %lld genres in the batch", static_cast<long long>(table.step), static_cast<long long>(G));
  HelpMarker("A batch holds a few dozen sequences, so not every genre is in every recorded step. The number after "
             "a genre is its routed tokens (K per byte): a genre with few tokens gives a noisy row.");
  // Labels "belles_lettres 2394" need their width: measured, not guessed.
  std::vector<std::string> labels;
  float label_width = 0;
  for (int64_t g = 0; g < G; ++g) {
    labels.push_back(table.genres[static_cast<size_t>(g)] + " " + std::to_string(table.genre_tokens[static_cast<size_t>(g)]));
    label_width = std::max(label_width, ImGui::CalcTextSize(labels.back().c_str()).x);
  }
  label_width = std::min(label_width + 8, ImGui::GetContentRegionAvail().x * 0.45f);
  const float row_height = ImGui::GetFontSize() + 2;
  const ImVec2 p = ImGui::GetCursorScreenPos();
  ImDrawList* draw = ImGui::GetWindowDrawList();
  draw->PushClipRect(p, ImVec2(p.x + label_width - 4, p.y + row_height * static_cast<float>(G)), true);
  for (int64_t g = 0; g < G; ++g)
    draw->AddText(ImVec2(p.x, p.y + row_height * static_cast<float>(g)), IM_COL32(200, 200, 200, 255), labels[static_cast<size_t>(g)].c_str());
  draw->PopClipRect();
  ImGui::SetCursorScreenPos(ImVec2(p.x + label_width, p.y));
  int col = 0, row = 0;
  const ImVec2 size(std::max(64.0f, ImGui::GetContentRegionAvail().x), row_height * static_cast<float>(G));
  if (HeatmapImage(texture, size, &col, &row) && row < G && col < E)
    ImGui::SetTooltip("%s: %lld of its %lld routed tokens (%.1f%%) went to expert %d", table.genres[static_cast<size_t>(row)].c_str(),
                      static_cast<long long>(table.counts[static_cast<size_t>(row)][static_cast<size_t>(col)]),
                      static_cast<long long>(table.genre_tokens[static_cast<size_t>(row)]),
                      100.0 * table.fractions[static_cast<size_t>(row)][static_cast<size_t>(col)], col);
  RecordLastItem(state, RegionName(state, run, "genre_heatmap"));
  // The expert numbers under the columns.
  const ImVec2 q = ImGui::GetCursorScreenPos();
  for (int64_t e = 0; e < E && E <= 64; ++e) {
    const std::string n = std::to_string(e);
    const float x = p.x + label_width + (static_cast<float>(e) + 0.5f) * size.x / static_cast<float>(E) - ImGui::CalcTextSize(n.c_str()).x / 2;
    draw->AddText(ImVec2(x, q.y), IM_COL32(150, 150, 150, 255), n.c_str());
  }
  ImGui::Dummy(ImVec2(size.x, ImGui::GetFontSize()));
  ImGui::TextDisabled("columns: experts");
}

void ShowRunRouting(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.routing.empty()) {
    LacksData("routing events (tokens per expert per layer): nothing to show here");
    return;
  }
  auto layer_it = m.routing.find(state.layer);
  if (layer_it == m.routing.end()) {
    ImGui::TextDisabled("(no layer %d in this run; showing layer %lld)", state.layer, static_cast<long long>(m.routing.begin()->first));
    layer_it = m.routing.begin();
  }
  const LayerRouting& layer = layer_it->second;
  const ExpertBars bars = expert_bars(m, layer.layer, state.step);
  ImGui::TextWrapped("layer %lld, step %lld (recorded at or before the scrubber's %lld), E = %lld",
              static_cast<long long>(layer.layer), static_cast<long long>(bars.step), static_cast<long long>(state.step),
              static_cast<long long>(layer.num_experts));
  MetricGrid(
      {{"max/mean load", "%.3f", bars.stats.max_over_mean,
        "The busiest expert's tokens divided by the mean over experts. 1 = perfectly balanced; with "
        "capacity_factor F, an expert above F drops tokens. The slowest expert sets the layer's time."},
       {"coefficient of variation", "%.3f", bars.stats.coefficient_of_variation,
        "Standard deviation of tokens per expert divided by their mean: 0 = balanced. It is what the "
        "aux loss pushes down."},
       {"dropped fraction", "%.4f", bars.stats.dropped_fraction,
        "Tokens dropped for capacity divided by tokens routed (each token counted once per chosen expert). "
        "Dropped tokens skip the expert; only the residual carries them. Always 0 for dropless."},
       {"routing entropy", "%.3f", bars.stats.routing_entropy,
        "Entropy of the distribution of tokens over experts, divided by log(E): 1 = every expert gets the "
        "same share, 0 = one expert gets everything (router collapse)."}},
      2, 24);

  ImGui::Separator();
  ImGui::Text("step x expert load, layer %lld", static_cast<long long>(layer.layer));
  HelpMarker("Each column is a recorded step (many steps share a pixel column on long runs: the colour is "
             "their mean), each row an expert (expert 0 at the top). Colour: tokens / fair share. The "
             "white mark is the scrubber's step.");
  LoadLegend(state.load_scale_max);
  ShowStepExpertHeatmap(state, run, layer);

  ImGui::Text("layer x expert load at step %lld", static_cast<long long>(state.step));
  HelpMarker("One row per layer (layer 0 at the top), one column per expert, at the scrubber's step. "
             "Routing is decided per layer: a hot expert in one layer says nothing about the next.");
  ShowLayerExpertHeatmap(state, run);

  ImGui::Text("tokens per expert");
  HelpMarker("Bars: tokens routed to each expert at this step. The red line is the capacity C: tokens above "
             "it are dropped in the dropping formulation (the red part of a bar) and padded up to it in the "
             "padded one. The white line is the fair share T*K/E.");
  ShowExpertBars(state, run, bars);

  if (ImGui::CollapsingHeader("statistics over steps", ImGuiTreeNodeFlags_DefaultOpen)) {
    static const char* const stats[][2] = {
        {"max_over_mean", "max/mean load per step"},
        {"coefficient_of_variation", "coefficient of variation per step"},
        {"dropped_fraction", "dropped fraction per step"},
        {"routing_entropy", "routing entropy per step (normalised)"}};
    const float width = ImGui::GetContentRegionAvail().x;
    for (const auto& stat : stats) {
      const Series series = m.routing_stat_series(layer.layer, stat[0]);
      ImGui::TextUnformatted(stat[1]);
      const std::string id = std::string("routing_") + stat[0] + RegionName(state, run, "");
      CurvePlot(id.c_str(), state, {{stat[1], &series, RunColor(run.color_index)}}, ImVec2(width, 70));
    }
  }
  if (ImGui::CollapsingHeader("expert load per genre", ImGuiTreeNodeFlags_DefaultOpen)) {
    ImGui::TextDisabled("rows: genres; colour: share of the genre's tokens per expert, relative to 1/E");
    HelpMarker("Where the data carries a genre per token (code, prose, math...), this shows whether experts "
               "specialise: a genre whose row is bright on a few experts is routed mostly to them.");
    ShowGenres(state, run, layer.layer);
  }
}

}  // namespace

void ShowRoutingPanel(ViewerState& state) {
  ImGui::SetNextItemWidth(120);
  ImGui::SliderFloat("colour scale max", &state.load_scale_max, 1.0f, 8.0f, "%.1fx");
  HelpMarker("The load at which the heatmap colour saturates, in multiples of the fair share.");
  ForEachShownRun(state, "routing_runs", [&](OpenRun& run) { ShowRunRouting(state, run); });
}

}  // namespace moe::viewer
