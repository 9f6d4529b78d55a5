// widgets.cpp: help markers, notices, legends, heatmap images, side-by-side columns (widgets.h).
#include "widgets.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "colormap.h"  // load_color, Rgba

namespace moe::viewer {

void HelpMarker(const char* text) {
  ImGui::SameLine();
  ImGui::TextDisabled("(?)");
  if (ImGui::IsItemHovered()) {
    ImGui::BeginTooltip();
    ImGui::PushTextWrapPos(ImGui::GetFontSize() * 35.0f);
    ImGui::TextUnformatted(text);
    ImGui::PopTextWrapPos();
    ImGui::EndTooltip();
  }
}

void WarningLine(const std::string& text) {
  ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.6f, 0.25f, 1.0f));
  ImGui::TextWrapped("warning: %s", text.c_str());
  ImGui::PopStyleColor();
}

void LacksData(const char* what) {
  ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(0.95f, 0.75f, 0.35f, 1.0f));
  ImGui::TextWrapped("This run has no %s.", what);
  ImGui::PopStyleColor();
}

void NoRunHolds(std::string_view panel) {
  ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(0.95f, 0.75f, 0.35f, 1.0f));
  ImGui::TextWrapped("No open run holds %s. Such a run is written by: %s.", panel_data_name(panel),
                     panel_data_writers(panel));
  ImGui::PopStyleColor();
}

void Metric(const char* name, const char* value_format, double value, const char* help) {
  ImGui::Text("%s:", name);
  ImGui::SameLine();
  ImGui::Text(value_format, value);
  HelpMarker(help);
}

void MetricGrid(std::initializer_list<MetricItem> metrics, int columns, float spacing) {
  int column = 0;
  for (const MetricItem& metric : metrics) {
    if (column > 0) ImGui::SameLine(0, spacing);
    Metric(metric.name, metric.value_format, metric.value, metric.help);
    column = (column + 1) % columns;
  }
}

ImU32 RunColor(int index) {
  // Twelve colours a reader can tell apart on the dark background; lesson 08 alone opens 16 runs,
  // so past them the hue steps by the golden angle, which keeps neighbours far apart.
  static const ImU32 colors[] = {IM_COL32(90, 170, 255, 255),  IM_COL32(255, 140, 60, 255),  IM_COL32(120, 220, 120, 255),
                                 IM_COL32(230, 90, 200, 255),  IM_COL32(240, 220, 80, 255),  IM_COL32(160, 160, 255, 255),
                                 IM_COL32(80, 220, 220, 255),  IM_COL32(255, 100, 100, 255), IM_COL32(190, 140, 90, 255),
                                 IM_COL32(200, 200, 200, 255), IM_COL32(170, 255, 60, 255),  IM_COL32(255, 170, 200, 255)};
  constexpr int kNamed = static_cast<int>(sizeof colors / sizeof colors[0]);
  if (index >= 0 && index < kNamed) return colors[index];
  const float hue = std::fmod(0.13f + 0.618034f * static_cast<float>(index), 1.0f);
  float r = 0, g = 0, b = 0;
  ImGui::ColorConvertHSVtoRGB(hue, 0.55f, 0.95f, r, g, b);
  return IM_COL32(static_cast<int>(r * 255), static_cast<int>(g * 255), static_cast<int>(b * 255), 255);
}

void RunLegend(const std::vector<OpenRun*>& runs) {
  const float right = ImGui::GetCursorScreenPos().x + ImGui::GetContentRegionAvail().x;
  for (size_t i = 0; i < runs.size(); ++i) {
    const char* label = runs[i]->model.label.c_str();
    const float item = 14 + ImGui::CalcTextSize(label).x + 16;
    if (i > 0) {
      ImGui::SameLine();
      if (ImGui::GetCursorScreenPos().x + item > right) ImGui::NewLine();
    }
    ImGui::PushID(static_cast<int>(i));
    ImGui::ColorButton("##legend", ImGui::ColorConvertU32ToFloat4(RunColor(runs[i]->color_index)),
                       ImGuiColorEditFlags_NoTooltip, ImVec2(10, 10));
    ImGui::SameLine(0, 4);
    ImGui::PushStyleColor(ImGuiCol_Text, RunColor(runs[i]->color_index));
    ImGui::TextUnformatted(label);
    ImGui::PopStyleColor();
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", runs[i]->model.dir.string().c_str());
    ImGui::PopID();
  }
}

ImU32 ToImU32(const Rgba& c) { return IM_COL32(c.r, c.g, c.b, c.a); }

void LoadLegend(float scale_max) {
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const ImVec2 p = ImGui::GetCursorScreenPos();
  const float width = 160, height = 10;
  const int steps = 32;
  for (int i = 0; i < steps; ++i) {
    const float t0 = static_cast<float>(i) / steps, t1 = static_cast<float>(i + 1) / steps;
    draw->AddRectFilled(ImVec2(p.x + t0 * width, p.y), ImVec2(p.x + t1 * width, p.y + height),
                        ToImU32(load_color(t0)));
  }
  ImGui::Dummy(ImVec2(width, height));
  ImGui::SameLine();
  ImGui::Text("0 .. %.1fx fair share", scale_max);
  HelpMarker("Heatmap colour: an expert's tokens divided by the mean over experts in the same row "
             "(its fair share T*K/E). Dark: idle. Teal: about its share (when the scale is 0..2x). "
             "Pale yellow: the top of the scale or more (a hot expert). Grey: no data.");
}

bool HeatmapImage(const HeatmapTexture& texture, ImVec2 size, int* hovered_col, int* hovered_row) {
  const ImVec2 p = ImGui::GetCursorScreenPos();
  if (texture.empty()) {
    ImGui::Dummy(size);
    return false;
  }
  ImGui::Image(texture.id(), size);
  if (!ImGui::IsItemHovered()) return false;
  const ImVec2 m = ImGui::GetIO().MousePos;
  *hovered_col = std::clamp(static_cast<int>((m.x - p.x) / size.x * static_cast<float>(texture.width)), 0, texture.width - 1);
  *hovered_row = std::clamp(static_cast<int>((m.y - p.y) / size.y * static_cast<float>(texture.height)), 0, texture.height - 1);
  return true;
}

void ForEachShownRun(ViewerState& state, const char* table_id, const std::function<void(OpenRun&)>& draw) {
  size_t with_data = 0;
  std::vector<OpenRun*> shown = state.panel_runs(state.current_panel, &with_data);
  if (shown.empty()) {
    ImGui::TextWrapped("No run is open. Open one from the Runs panel on the left, or name run directories "
                       "on the command line (moe_viewer runs/lesson01_routing).");
    return;
  }
  if (with_data == 0) NoRunHolds(state.current_panel);
  // A run that could not be read says why, in every panel (and main() printed it on the terminal).
  auto draw_or_explain = [&](OpenRun& run) {
    if (!run.model.error.empty()) {
      ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.4f, 0.4f, 1.0f));
      ImGui::TextWrapped("Cannot read %s: %s", run.model.label.c_str(), run.model.error.c_str());
      ImGui::PopStyleColor();
    }
    draw(run);
  };
  if (shown.size() == 1) {
    ImGui::PushID(shown[0]);
    draw_or_explain(*shown[0]);
    ImGui::PopID();
    return;
  }
  const int columns = static_cast<int>(std::min<size_t>(shown.size(), kMaxRunColumns));
  if (ImGui::BeginTable(table_id, columns, ImGuiTableFlags_BordersInnerV | ImGuiTableFlags_Resizable)) {
    for (int i = 0; i < columns; ++i) {
      ImGui::TableNextColumn();
      ImGui::PushID(shown[static_cast<size_t>(i)]);
      ImGui::PushStyleColor(ImGuiCol_Text, RunColor(shown[static_cast<size_t>(i)]->color_index));
      ImGui::TextUnformatted(shown[static_cast<size_t>(i)]->model.label.c_str());
      ImGui::PopStyleColor();
      draw_or_explain(*shown[static_cast<size_t>(i)]);
      ImGui::PopID();
    }
    ImGui::EndTable();
  }
  if (shown.size() > kMaxRunColumns)
    ImGui::TextDisabled("(%zu runs shown, %zu with %s; the first %zu are drawn side by side, those with it first)",
                        shown.size(), with_data, panel_data_name(state.current_panel), kMaxRunColumns);
}

std::string TextureKey(const char* what, const OpenRun& run, int64_t a, int64_t b, float scale) {
  char key[160];
  std::snprintf(key, sizeof key, "%s/%p/%lld/%lld/%llu/%.3f", what, static_cast<const void*>(&run),
                static_cast<long long>(a), static_cast<long long>(b),
                static_cast<unsigned long long>(run.model.version), scale);
  return key;
}

// The region name the screenshot tests look up: "routing_heatmap" for the first shown run,
// "routing_heatmap#1" for the second, ...
std::string RegionName(const ViewerState& state, const OpenRun& run, const char* base) {
  const auto shown = state.panel_runs(state.current_panel);
  const auto it = std::find(shown.begin(), shown.end(), &run);
  const long index = it == shown.end() ? 0 : static_cast<long>(it - shown.begin());
  return index == 0 ? std::string(base) : std::string(base) + "#" + std::to_string(index);
}

void RecordLastItem(ViewerState& state, const std::string& name) {
  const ImVec2 a = ImGui::GetItemRectMin(), b = ImGui::GetItemRectMax();
  state.record_region(name, a.x, a.y, b.x, b.y);
}

}  // namespace moe::viewer
