// curve_plot.cpp: CurvePlot, curves over steps with zoom and hover (widgets.h).
// Each frame draws one min/max column per pixel (downsample_min_max), whatever the run's length.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "downsample.h"  // downsample_min_max, nearest_sample
#include "widgets.h"

namespace moe::viewer {

void CurvePlot(const char* id, ViewerState& state, const std::vector<CurveLine>& lines, ImVec2 size,
               const char* value_format) {
  ImGui::PushID(id);
  PlotView& view = state.plots[id];
  // The data's x range, for fitting.
  double data_lo = std::numeric_limits<double>::infinity(), data_hi = -data_lo;
  for (const CurveLine& line : lines)
    if (line.series && !line.series->steps.empty()) {
      data_lo = std::min(data_lo, line.series->steps.front());
      data_hi = std::max(data_hi, line.series->steps.back());
    }
  if (!(data_hi >= data_lo)) {
    ImGui::TextDisabled("(no samples)");
    ImGui::PopID();
    return;
  }
  if (data_hi == data_lo) data_hi = data_lo + 1;
  if (view.auto_fit) {
    view.x_lo = data_lo;
    view.x_hi = data_hi;
  }

  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  const float label_width = 58;
  const ImVec2 plot_min(p0.x + label_width, p0.y);
  const ImVec2 plot_max(p0.x + size.x, p0.y + size.y);
  const float plot_width = plot_max.x - plot_min.x;
  ImGui::InvisibleButton("plot", size);
  const bool hovered = ImGui::IsItemHovered();
  ImGuiIO& io = ImGui::GetIO();

  // ---- interaction: wheel zooms around the mouse, drag pans, double-click fits, click sets step
  auto x_of = [&](double step) { return plot_min.x + static_cast<float>((step - view.x_lo) / (view.x_hi - view.x_lo)) * plot_width; };
  auto step_of = [&](float x) { return view.x_lo + (x - plot_min.x) / plot_width * (view.x_hi - view.x_lo); };
  if (hovered && !state.screenshot) {
    if (io.MouseWheel != 0) {
      const double anchor = step_of(io.MousePos.x);
      const double factor = io.MouseWheel > 0 ? 0.8 : 1.25;
      view.x_lo = anchor - (anchor - view.x_lo) * factor;
      view.x_hi = anchor + (view.x_hi - anchor) * factor;
      view.auto_fit = false;
    }
    if (ImGui::IsMouseDragging(ImGuiMouseButton_Left)) {
      const double shift = -io.MouseDelta.x / plot_width * (view.x_hi - view.x_lo);
      view.x_lo += shift;
      view.x_hi += shift;
      view.auto_fit = false;
    } else if (ImGui::IsMouseReleased(ImGuiMouseButton_Left) && std::abs(ImGui::GetMouseDragDelta().x) < 2) {
      state.step = static_cast<int64_t>(std::llround(step_of(io.MousePos.x)));
      state.follow_latest = false;
    }
    if (ImGui::IsMouseDoubleClicked(ImGuiMouseButton_Left)) view.auto_fit = true;
  }
  if (view.x_hi - view.x_lo < 1) view.x_hi = view.x_lo + 1;

  // ---- reduce each line to pixel columns, find the y range
  const int columns = std::max(1, static_cast<int>(plot_width));
  std::vector<std::vector<CurveColumn>> reduced;
  double y_lo = std::numeric_limits<double>::infinity(), y_hi = -y_lo;
  for (const CurveLine& line : lines) {
    reduced.push_back(line.series ? downsample_min_max(*line.series, view.x_lo, view.x_hi, columns) : std::vector<CurveColumn>{});
    for (const CurveColumn& c : reduced.back())
      if (c.samples) {
        y_lo = std::min(y_lo, c.min);
        y_hi = std::max(y_hi, c.max);
      }
  }
  if (!(y_hi >= y_lo)) y_lo = 0, y_hi = 1;
  if (y_hi == y_lo) y_hi = y_lo + (y_lo == 0 ? 1 : std::abs(y_lo) * 0.1);
  const double pad = (y_hi - y_lo) * 0.05;
  y_lo -= pad;
  y_hi += pad;
  auto y_of = [&](double v) { return plot_max.y - static_cast<float>((v - y_lo) / (y_hi - y_lo)) * (plot_max.y - plot_min.y); };

  // ---- draw
  ImDrawList* draw = ImGui::GetWindowDrawList();
  draw->AddRectFilled(plot_min, plot_max, IM_COL32(25, 25, 30, 255));
  draw->AddRect(plot_min, plot_max, IM_COL32(90, 90, 100, 255));
  char text[64];
  std::snprintf(text, sizeof text, value_format, y_hi);
  draw->AddText(ImVec2(p0.x, plot_min.y), IM_COL32(170, 170, 170, 255), text);
  std::snprintf(text, sizeof text, value_format, y_lo);
  draw->AddText(ImVec2(p0.x, plot_max.y - ImGui::GetFontSize()), IM_COL32(170, 170, 170, 255), text);
  draw->PushClipRect(plot_min, plot_max, true);
  for (size_t l = 0; l < lines.size(); ++l) {
    ImVec2 previous(0, 0);
    bool have_previous = false;
    for (int c = 0; c < static_cast<int>(reduced[l].size()); ++c) {
      const CurveColumn& col = reduced[l][static_cast<size_t>(c)];
      if (!col.samples) continue;
      const float x = plot_min.x + static_cast<float>(c) + 0.5f;
      if (have_previous) draw->AddLine(previous, ImVec2(x, y_of(col.first)), lines[l].color, 1.0f);  // width 1: ImGui's cheap textured anti-aliased lines
      if (col.samples > 1) draw->AddLine(ImVec2(x, y_of(col.min)), ImVec2(x, y_of(col.max)), lines[l].color, 1.0f);
      else draw->AddRectFilled(ImVec2(x - 1, y_of(col.first) - 1), ImVec2(x + 1, y_of(col.first) + 1), lines[l].color);
      previous = ImVec2(x, y_of(col.last));
      have_previous = true;
    }
  }
  // The scrubber's step.
  const float step_x = x_of(static_cast<double>(state.step));
  draw->AddLine(ImVec2(step_x, plot_min.y), ImVec2(step_x, plot_max.y), IM_COL32(255, 255, 255, 90), 1.0f);
  draw->PopClipRect();
  std::snprintf(text, sizeof text, "step %.0f", view.x_lo);
  draw->AddText(ImVec2(plot_min.x + 2, plot_max.y + 1), IM_COL32(150, 150, 150, 255), text);
  std::snprintf(text, sizeof text, "%.0f", view.x_hi);
  draw->AddText(ImVec2(plot_max.x - ImGui::CalcTextSize(text).x, plot_max.y + 1), IM_COL32(150, 150, 150, 255), text);
  ImGui::Dummy(ImVec2(size.x, ImGui::GetFontSize()));

  // ---- hover: the exact values of the samples nearest the mouse
  if (hovered && io.MousePos.x >= plot_min.x) {
    const double x = step_of(io.MousePos.x);
    draw->AddLine(ImVec2(io.MousePos.x, plot_min.y), ImVec2(io.MousePos.x, plot_max.y), IM_COL32(255, 255, 255, 60));
    ImGui::BeginTooltip();
    for (const CurveLine& line : lines) {
      if (!line.series) continue;
      const int64_t i = nearest_sample(*line.series, x);
      if (i < 0) continue;
      ImGui::PushStyleColor(ImGuiCol_Text, line.color);
      ImGui::Text("%s", line.label.c_str());
      ImGui::PopStyleColor();
      ImGui::SameLine();
      std::snprintf(text, sizeof text, value_format, line.series->values[static_cast<size_t>(i)]);
      ImGui::Text("step %.0f: %s", line.series->steps[static_cast<size_t>(i)], text);
    }
    ImGui::TextDisabled("wheel: zoom, drag: pan, double-click: fit, click: set step");
    ImGui::EndTooltip();
  }
  ImGui::PopID();
}

}  // namespace moe::viewer
