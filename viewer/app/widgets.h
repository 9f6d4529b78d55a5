// widgets.h: the small drawing pieces the panels share: the "(?)" help marker, the "this run has
// no ..." notice, metric lines, heatmap images with hover, curve plots with zoom, a timeline, and
// the side-by-side run columns. Each draws with ImGui only; what it draws was prepared by
// viewer/model/.
// Part of moe_viewer.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <imgui.h>

#include "colormap.h"     // Rgba
#include "comm_view.h"    // Timeline
#include "run_model.h"    // Series
#include "viewer_state.h" // ViewerState, OpenRun

namespace moe::viewer {

// [SECTION] help and notices
void HelpMarker(const char* text);  // a "(?)" that shows `text` when hovered
void LacksData(const char* what);   // "This run has no <what>." in a muted colour
void WarningLine(const std::string& text);  // "warning: <text>" in the warning colour, wrapped
// "No open run holds <the panel's data>. Such a run is written by: <programs>." (run_choice.h)
void NoRunHolds(std::string_view panel);
// "name: value (?)" on one line.
void Metric(const char* name, const char* value_format, double value, const char* help);
// Metric's arguments, for MetricGrid.
struct MetricItem {
  const char* name;
  const char* value_format;
  double value;
  const char* help;
};
// The metrics in rows of `columns`, `spacing` pixels apart within a row.
void MetricGrid(std::initializer_list<MetricItem> metrics, int columns, float spacing);

// [SECTION] colours
ImU32 RunColor(int index);  // distinct for the first 12 runs, then spread around the hue circle
// The shown runs' colours and names, flowing over as many lines as the width needs.
void RunLegend(const std::vector<OpenRun*>& runs);
ImU32 ToImU32(const Rgba& c);
void LoadLegend(float scale_max);  // the colour bar of the load heatmaps, 0 .. scale_max x fair share

// [SECTION] heatmaps
// Draws a texture stretched to `size`; returns true when hovered, with the cell under the mouse
// (in texture cells) in hovered_col / hovered_row.
bool HeatmapImage(const HeatmapTexture& texture, ImVec2 size, int* hovered_col, int* hovered_row);

// [SECTION] curves
struct CurveLine {
  std::string label;
  const Series* series = nullptr;
  ImU32 color = 0;
};
// Plots that share one step window (the training curves: zoom one, all follow). Without it a plot
// has its own window, fitted to its own lines.
struct SharedSteps {
  const char* view_id;    // the PlotView they share (ViewerState::plots)
  double fit_lo, fit_hi;  // the steps a fit shows (all of their lines together)
};
// A plot of several series over steps with min/max-per-pixel reduction, mouse-wheel zoom, drag to
// pan, double-click to fit, hover values and a marker at the current step (click sets the step).
// A sparse series (validation every 100 steps) is drawn as a line through its points. The pixel
// columns are kept between frames until the window, the width or a line's data changes.
void CurvePlot(const char* id, ViewerState& state, const std::vector<CurveLine>& lines, ImVec2 size,
               const char* value_format = "%.4g", const SharedSteps* shared = nullptr);

// [SECTION] timeline
// Lanes of spans from the timeline's first start (microseconds); hover shows a span's name and
// times. span_us > 0 fixes the width of time shown, so runs side by side share one scale (a
// shorter step ends short of the right edge); 0 fits the timeline. Spans of the compute stream
// waiting for expert copies (is_stall_span) are drawn in kStallColor.
void TimelineView(const char* id, const Timeline& timeline, ImVec2 size, double span_us = 0);
inline constexpr ImU32 kStallColor = IM_COL32(235, 40, 40, 255);

// [SECTION] keys and regions
// A texture's key: what it shows and the run's data version, so it is re-uploaded only on change.
std::string TextureKey(const char* what, const OpenRun& run, int64_t a, int64_t b, float scale);
// The region name the screenshot tests look up: `base` for the first shown run, "base#1" for the
// second, ...
std::string RegionName(const ViewerState& state, const OpenRun& run, const char* base);
// Records the last ImGui item's rectangle under `name` (ViewerState::regions).
void RecordLastItem(ViewerState& state, const std::string& name);

// [SECTION] side by side
// Calls draw(run) for each shown run, in a column per run when there are several, at most
// kMaxRunColumns of them (the first ones in the panel's order).
inline constexpr size_t kMaxRunColumns = 4;
void ForEachShownRun(ViewerState& state, const char* table_id, const std::function<void(OpenRun&)>& draw);

}  // namespace moe::viewer
