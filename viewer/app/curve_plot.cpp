// curve_plot.cpp: CurvePlot, curves over steps with zoom and hover (widgets.h).
// Each frame draws one min/max column per pixel (downsample_min_max), whatever the run's length,
// a dense stretch as one filled bar per column;
// the columns are computed again only when the window, the width or the data changes, so 16 runs
// of 2000 steps x 13 metrics cost nothing while the reader just looks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "curves_view.h" // compact_number
#include "downsample.h"  // downsample_min_max, nearest_sample
#include "widgets.h"

namespace moe::viewer {

void CurvePlot(const char* id, ViewerState& state, const std::vector<CurveLine>& lines, ImVec2 size,
               const char* value_format, const SharedSteps* shared) {
  ImGui::PushID(id);
  PlotView& view = state.plots[shared ? shared->view_id : id];
  // The data's x range, for fitting.
  double data_lo = std::numeric_limits<double>::infinity(), data_hi = -data_lo;
  bool any = false;
  for (const CurveLine& line : lines)
    if (line.series && !line.series->steps.empty()) {
      any = true;
      data_lo = std::min(data_lo, line.series->steps.front());
      data_hi = std::max(data_hi, line.series->steps.back());
    }
  if (shared && any) data_lo = shared->fit_lo, data_hi = shared->fit_hi;
  if (!any || !(data_hi >= data_lo)) {
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

  // ---- reduce each line to pixel columns (kept while nothing changes), find the y range
  const int columns = std::max(1, static_cast<int>(plot_width));
  std::string key = std::to_string(view.x_lo) + ":" + std::to_string(view.x_hi) + ":" + std::to_string(columns);
  for (const CurveLine& line : lines) {
    // A series lives in its run's map (a stable address); appending changes its length.
    char part[96];
    const Series* s = line.series;
    std::snprintf(part, sizeof part, "|%p:%zu:%.17g", static_cast<const void*>(s), s ? s->values.size() : 0,
                  s && !s->values.empty() ? s->values.back() : 0.0);
    key += part;
  }
  auto& cached = state.curves[std::string(id) + "/" + std::to_string(static_cast<unsigned>(ImGui::GetID("plot")))];
  if (cached.key != key) {
    cached.columns.clear();
    for (const CurveLine& line : lines)
      cached.columns.push_back(line.series ? downsample_min_max(*line.series, view.x_lo, view.x_hi, columns) : std::vector<CurveColumn>{});
    cached.key = std::move(key);
  }
  const std::vector<std::vector<CurveColumn>>& reduced = cached.columns;
  double y_lo = std::numeric_limits<double>::infinity(), y_hi = -y_lo;
  for (const auto& line_columns : reduced)
    for (const CurveColumn& c : line_columns)
      if (c.samples) {
        y_lo = std::min(y_lo, c.min);
        y_hi = std::max(y_hi, c.max);
      }
  if (!(y_hi >= y_lo)) y_lo = 0, y_hi = 1;
  if (y_hi == y_lo) y_hi = y_lo + (y_lo == 0 ? 1 : std::abs(y_lo) * 0.1);
  const double pad = (y_hi - y_lo) * 0.05;
  y_lo -= pad;
  y_hi += pad;
  auto y_of = [&](double v) { return plot_max.y - static_cast<float>((v - y_lo) / (y_hi - y_lo)) * (plot_max.y - plot_min.y); };

  // ---- draw
  ImDrawList* draw = ImGui::GetWindowDrawList();
  // A border, no fill: the window's dark background shows through, and where OpenGL is a software
  // rasteriser (Mesa llvmpipe under Xvfb) every filled pixel of a dozen plots costs frame time.
  draw->AddRect(plot_min, plot_max, IM_COL32(90, 90, 100, 255));
  char text[64];
  // Axis labels in at most about 7 characters (4.47M, not 4.471e+06), to fit left of the plot.
  draw->AddText(ImVec2(p0.x, plot_min.y), IM_COL32(170, 170, 170, 255), compact_number(y_hi).c_str());
  draw->AddText(ImVec2(p0.x, plot_max.y - ImGui::GetFontSize()), IM_COL32(170, 170, 170, 255), compact_number(y_lo).c_str());
  draw->PushClipRect(plot_min, plot_max, true);
  for (size_t l = 0; l < lines.size(); ++l) {
    ImVec2 previous(0, 0);
    bool have_previous = false;
    int previous_column = -2;
    for (int c = 0; c < static_cast<int>(reduced[l].size()); ++c) {
      const CurveColumn& col = reduced[l][static_cast<size_t>(c)];
      if (!col.samples) continue;
      const float x = plot_min.x + static_cast<float>(c) + 0.5f;
      if (col.samples > 1 && previous_column == c - 1) {
        // A dense stretch: one filled bar per column from its min to its max, stretched to the
        // previous column's last value so the two join. A plain rectangle is two triangles,
        // far cheaper to rasterise than anti-aliased lines when every column is full.
        const float top = std::min(y_of(col.max), previous.y), bottom = std::max(y_of(col.min), previous.y);
        draw->AddRectFilled(ImVec2(x - 0.5f, top), ImVec2(x + 0.5f, std::max(bottom, top + 1.0f)), lines[l].color);
      } else {
        // Sparse samples: a line from the previous one, a bar or a dot at this one.
        if (have_previous) draw->AddLine(previous, ImVec2(x, y_of(col.first)), lines[l].color, 1.0f);  // width 1: ImGui's cheap textured anti-aliased lines
        if (col.samples > 1) draw->AddRectFilled(ImVec2(x - 0.5f, y_of(col.max)), ImVec2(x + 0.5f, y_of(col.min) + 1.0f), lines[l].color);
        else draw->AddRectFilled(ImVec2(x - 1, y_of(col.first) - 1), ImVec2(x + 1, y_of(col.first) + 1), lines[l].color);
      }
      previous = ImVec2(x, y_of(col.last));
      have_previous = true;
      previous_column = c;
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
