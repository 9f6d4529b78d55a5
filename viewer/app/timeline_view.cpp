// timeline_view.cpp: TimelineView, lanes of timed spans per rank and stream (widgets.h).
// Spans thinner than a pixel are merged by visible_spans(), so a frame draws at most about one
// rectangle per pixel per lane.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "colormap.h"        // expert_color, reused as a categorical palette for span names
#include "inference_view.h"  // is_stall_span
#include "widgets.h"

namespace moe::viewer {

namespace {
// A family's colour: red for the compute stream's waits for copies (a stall must stand out), the
// categorical palette otherwise, stepping over its reds.
ImU32 FamilyColor(const Timeline& timeline, int32_t family) {
  if (is_stall_span(timeline.families[static_cast<size_t>(family)])) return kStallColor;
  // The family-th palette colour whose hue (k x 137.5 degrees, expert_color) is not within 30
  // degrees of red.
  int64_t k = -1;
  for (int32_t seen = -1; seen < family;) {
    const double hue = std::fmod(static_cast<double>(++k) * 137.50776, 360.0);
    if (hue > 30 && hue < 330) ++seen;
  }
  return ToImU32(expert_color(k));
}
}  // namespace

void TimelineView(const char* id, const Timeline& timeline, ImVec2 size, double span_us) {
  ImGui::PushID(id);
  if (timeline.lanes.empty()) {
    ImGui::TextDisabled("(no spans at this step)");
    ImGui::PopID();
    return;
  }
  // As wide as the longest lane name ("compute: inside the MoE layer"), up to a third of the plot.
  float label_width = 60;
  for (const TimelineLane& lane : timeline.lanes) label_width = std::max(label_width, ImGui::CalcTextSize(lane.label.c_str()).x + 8);
  label_width = std::min(label_width, size.x / 3);
  // At least one line of text per lane: the panel grows rather than squeezing labels together.
  const float lane_height = std::clamp((size.y - 16) / static_cast<float>(timeline.lanes.size()), ImGui::GetFontSize() + 3, 24.0f);
  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  const float width = size.x - label_width;
  const double t_lo = timeline.t0, t_hi = span_us > 0 ? t_lo + span_us : std::max(timeline.t1, timeline.t0 + 1);
  const double us_per_pixel = (t_hi - t_lo) / std::max(1.0f, width);
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const ImVec2 mouse = ImGui::GetIO().MousePos;
  TimelineSpan hovered_span;  // a copy: `visible` is reused lane after lane
  const TimelineLane* hovered_lane = nullptr;
  std::vector<TimelineSpan> visible;
  for (size_t l = 0; l < timeline.lanes.size(); ++l) {
    const TimelineLane& lane = timeline.lanes[l];
    const float y = p0.y + static_cast<float>(l) * lane_height;
    draw->PushClipRect(ImVec2(p0.x, y), ImVec2(p0.x + label_width - 4, y + lane_height), true);
    draw->AddText(ImVec2(p0.x, y + 1), IM_COL32(200, 200, 200, 255), lane.label.c_str());
    draw->PopClipRect();
    if (mouse.x >= p0.x && mouse.x < p0.x + label_width && mouse.y >= y && mouse.y < y + lane_height && ImGui::IsWindowHovered())
      ImGui::SetTooltip("%s", lane.label.c_str());  // the full name where the label is cut
    draw->AddRectFilled(ImVec2(p0.x + label_width, y), ImVec2(p0.x + size.x, y + lane_height - 2), IM_COL32(30, 30, 36, 255));
    visible = visible_spans(lane, t_lo, t_hi, us_per_pixel);
    for (const TimelineSpan& s : visible) {
      const float x0 = p0.x + label_width + static_cast<float>((s.start_us - t_lo) / us_per_pixel);
      const float x1 = std::max(x0 + 1, p0.x + label_width + static_cast<float>((s.end_us - t_lo) / us_per_pixel));
      const ImU32 color = s.merged > 1 ? IM_COL32(150, 150, 150, 255) : FamilyColor(timeline, timeline.family_of[static_cast<size_t>(s.name)]);
      draw->AddRectFilled(ImVec2(x0, y), ImVec2(x1, y + lane_height - 2), color);
      if (x1 - x0 > 40) {
        draw->PushClipRect(ImVec2(x0, y), ImVec2(x1, y + lane_height), true);
        draw->AddText(ImVec2(x0 + 2, y + 1), IM_COL32(0, 0, 0, 255), timeline.names[static_cast<size_t>(s.name)].c_str());
        draw->PopClipRect();
      }
      if (mouse.x >= x0 && mouse.x < x1 && mouse.y >= y && mouse.y < y + lane_height && ImGui::IsWindowHovered()) {
        hovered_span = s;
        hovered_lane = &lane;
      }
    }
  }
  char text[64];
  const float axis_y = p0.y + static_cast<float>(timeline.lanes.size()) * lane_height;
  std::snprintf(text, sizeof text, "%.1f us", 0.0);
  draw->AddText(ImVec2(p0.x + label_width, axis_y), IM_COL32(150, 150, 150, 255), text);
  std::snprintf(text, sizeof text, "%.1f us", t_hi - t_lo);
  if (span_us > 0 && timeline.t1 < t_hi) {  // where this run's step ends on the shared scale
    const float x_end = p0.x + label_width + static_cast<float>((timeline.t1 - t_lo) / us_per_pixel);
    draw->AddLine(ImVec2(x_end, p0.y), ImVec2(x_end, axis_y), IM_COL32(220, 220, 220, 180));
  }
  draw->AddText(ImVec2(p0.x + size.x - ImGui::CalcTextSize(text).x, axis_y), IM_COL32(150, 150, 150, 255), text);
  ImGui::Dummy(ImVec2(size.x, axis_y - p0.y + ImGui::GetFontSize() + 2));
  // The names behind the colours: most phases of a 3 ms step are too narrow to carry their name.
  const float right = p0.x + size.x;
  for (size_t n = 0; n < timeline.families.size(); ++n) {
    const char* name = timeline.families[n].c_str();
    if (n > 0) {
      ImGui::SameLine(0, 10);
      if (ImGui::GetCursorScreenPos().x + 14 + ImGui::CalcTextSize(name).x > right) ImGui::NewLine();
    }
    const ImVec2 q = ImGui::GetCursorScreenPos();
    const float box = ImGui::GetFontSize() * 0.7f;
    draw->AddRectFilled(ImVec2(q.x, q.y + 3), ImVec2(q.x + box, q.y + 3 + box), FamilyColor(timeline, static_cast<int32_t>(n)));
    ImGui::Dummy(ImVec2(box + 3, box));
    ImGui::SameLine(0, 0);
    if (is_stall_span(timeline.families[n])) ImGui::TextColored(ImVec4(1.0f, 0.45f, 0.45f, 1.0f), "%s (stall)", name);
    else ImGui::TextDisabled("%s", name);
  }
  if (hovered_lane) {
    const TimelineSpan* hovered = &hovered_span;
    ImGui::BeginTooltip();
    ImGui::Text("%s: %s", hovered_lane->label.c_str(), timeline.names[static_cast<size_t>(hovered->name)].c_str());
    ImGui::Text("start %.2f us (from the step's first span), duration %.2f us", hovered->start_us - t_lo,
                hovered->end_us - hovered->start_us);
    if (hovered->merged > 1) ImGui::Text("%d spans thinner than a pixel, drawn as one (zoom in)", hovered->merged);
    ImGui::EndTooltip();
  }
  ImGui::PopID();
}

}  // namespace moe::viewer
