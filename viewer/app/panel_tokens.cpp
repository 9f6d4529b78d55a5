// panel_tokens.cpp: a text sample with each byte on the colour of the expert it was routed to
// (its first choice), with a stripe of its second choice under it (top-2), per layer; hover a byte
// for all K experts. Lines break between words where they can.
#include <algorithm>
#include <set>

#include "colormap.h"  // expert_color
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {
void ShowRunTokens(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.token_samples.empty()) {
    LacksData("token samples (\"tokens\" events: text with the experts of each byte)");
    return;
  }
  const TokensRecord* sample = m.tokens_at(state.step, state.layer);
  if (!sample) {
    ImGui::TextDisabled("(no sample for layer %d; samples exist for other layers)", state.layer);
    return;
  }
  ImGui::Text("layer %lld, sample of step %lld, %zu bytes", static_cast<long long>(sample->layer),
              static_cast<long long>(sample->step), sample->text.size());
  HelpMarker("Each byte of the sample sits on the colour of the expert its token went to first (top-1); "
             "the thin stripe under it is its second expert (top-2). "
             "Runs of one colour over a word or over a kind of character (digits, spaces, punctuation) "
             "show what an expert has specialised in. Hover a byte for all of its K experts.");
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const ImVec2 origin = ImGui::GetCursorScreenPos();
  const float right = origin.x + std::max(100.0f, ImGui::GetContentRegionAvail().x);
  const float line_height = ImGui::GetFontSize() + 6;  // room for the text and the stripe under it
  ImVec2 p = origin;
  const ImVec2 mouse = ImGui::GetIO().MousePos;
  int hovered = -1;
  std::set<int64_t> used;
  const std::string& text = sample->text;
  const float char_width = ImGui::CalcTextSize("M").x + 1;  // the font is monospaced
  const float stripe = 3;  // the second choice's stripe at the bottom of the cell
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char byte = static_cast<unsigned char>(text[i]);
    if (byte == '\n') {
      p = ImVec2(origin.x, p.y + line_height);
      continue;
    }
    // At the start of a word, break the line if the whole word would not fit (and it fits a line).
    if (byte != ' ' && (i == 0 || text[i - 1] == ' ') && p.x > origin.x) {
      size_t end = i;
      while (end < text.size() && text[end] != ' ' && text[end] != '\n') ++end;
      const float word = char_width * static_cast<float>(end - i);
      if (p.x + word > right && word <= right - origin.x) p = ImVec2(origin.x, p.y + line_height);
    }
    const char shown[2] = {byte >= 0x20 && byte < 0x7f ? static_cast<char>(byte) : '.', 0};
    const float w = char_width;
    if (p.x + w > right) p = ImVec2(origin.x, p.y + line_height);
    const auto& choices = i < sample->experts.size() ? sample->experts[i] : std::vector<int64_t>{};
    const int64_t expert = !choices.empty() ? choices[0] : -1;
    const ImU32 background = expert >= 0 ? ToImU32(expert_color(expert)) : IM_COL32(60, 60, 60, 255);
    for (int64_t e : choices) used.insert(e);
    draw->AddRectFilled(p, ImVec2(p.x + w, p.y + line_height - 1), background);
    if (choices.size() > 1)
      draw->AddRectFilled(ImVec2(p.x, p.y + line_height - 1 - stripe), ImVec2(p.x + w, p.y + line_height - 1),
                          ToImU32(expert_color(choices[1])));
    draw->AddText(ImVec2(p.x, p.y + 2), IM_COL32(0, 0, 0, 255), shown);
    if (mouse.x >= p.x && mouse.x < p.x + w && mouse.y >= p.y && mouse.y < p.y + line_height) hovered = static_cast<int>(i);
    p.x += w;
  }
  ImGui::Dummy(ImVec2(right - origin.x, p.y - origin.y + line_height));
  RecordLastItem(state, RegionName(state, run, "tokens_text"));
  if (hovered >= 0 && ImGui::IsWindowHovered()) {
    ImGui::BeginTooltip();
    const unsigned char byte = static_cast<unsigned char>(sample->text[static_cast<size_t>(hovered)]);
    ImGui::Text("byte %d: 0x%02x '%c'", hovered, byte, byte >= 0x20 && byte < 0x7f ? byte : '.');
    if (static_cast<size_t>(hovered) < sample->experts.size()) {
      ImGui::Text("experts (best first):");
      for (int64_t e : sample->experts[static_cast<size_t>(hovered)]) {
        ImGui::SameLine();
        ImGui::Text("%lld", static_cast<long long>(e));
      }
    } else {
      ImGui::Text("no expert list for this byte (the sample has fewer lists than bytes)");
    }
    ImGui::EndTooltip();
  }
  ImGui::Text("experts in this sample:");
  for (int64_t e : used) {
    ImGui::SameLine();
    ImGui::ColorButton("##e", ImGui::ColorConvertU32ToFloat4(ToImU32(expert_color(e))), ImGuiColorEditFlags_NoTooltip, ImVec2(10, 10));
    ImGui::SameLine(0, 2);
    ImGui::Text("%lld", static_cast<long long>(e));
  }
}
}  // namespace

void ShowTokensPanel(ViewerState& state) {
  ForEachShownRun(state, "tokens_runs", [&](OpenRun& run) { ShowRunTokens(state, run); });
}

}  // namespace moe::viewer
