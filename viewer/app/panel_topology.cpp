// panel_topology.cpp: the block-sparse matrix of a step (which B x B blocks exist for each expert,
// and how much of each expert's block rows is padding), beside the rows the padded and dropping
// formulations would compute for the same routed tokens.
// One rectangle per expert (its block rows x its block columns), grid lines only when blocks are
// a few pixels wide or more: the drawing cost follows E, not the number of blocks.
#include <algorithm>

#include "colormap.h"       // expert_color
#include "routing_view.h"   // expert_bars
#include "topology_view.h"  // topology_picture, capacity_for
#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {

void ShowBlockMatrix(ViewerState& state, OpenRun& run, const TopologyPicture& p) {
  const float width = std::max(64.0f, ImGui::GetContentRegionAvail().x * 0.55f);
  const float height = std::clamp(static_cast<float>(p.block_rows) * 10.0f, 60.0f, 320.0f);
  const ImVec2 o = ImGui::GetCursorScreenPos();
  ImGui::InvisibleButton("matrix", ImVec2(width, height));
  RecordLastItem(state, RegionName(state, run, "topology_matrix"));
  ImDrawList* draw = ImGui::GetWindowDrawList();
  draw->AddRectFilled(o, ImVec2(o.x + width, o.y + height), IM_COL32(22, 22, 26, 255));
  const float block_w = width / static_cast<float>(std::max<int64_t>(1, p.block_cols));
  const float block_h = height / static_cast<float>(std::max<int64_t>(1, p.block_rows));
  const ImVec2 mouse = ImGui::GetIO().MousePos;
  const ExpertBlocks* hovered = nullptr;
  for (const ExpertBlocks& e : p.experts) {
    if (e.block_rows == 0) continue;
    const ImVec2 a(o.x + block_w * static_cast<float>(e.first_block_col), o.y + block_h * static_cast<float>(e.first_block_row));
    const ImVec2 b(a.x + block_w * static_cast<float>(e.block_cols), a.y + block_h * static_cast<float>(e.block_rows));
    draw->AddRectFilled(a, b, ToImU32(expert_color(e.expert)));
    if (e.padding_rows > 0 && p.block_size > 0) {  // padding rows: the bottom of the expert's last block row
      const float pad_h = block_h * static_cast<float>(e.padding_rows) / static_cast<float>(p.block_size);
      draw->AddRectFilled(ImVec2(a.x, b.y - pad_h), b, IM_COL32(0, 0, 0, 150));
    }
    if (block_w >= 4 && block_h >= 4) {
      for (int64_t c = 1; c < e.block_cols; ++c)
        draw->AddLine(ImVec2(a.x + block_w * static_cast<float>(c), a.y), ImVec2(a.x + block_w * static_cast<float>(c), b.y), IM_COL32(0, 0, 0, 90));
      for (int64_t r = 1; r < e.block_rows; ++r)
        draw->AddLine(ImVec2(a.x, a.y + block_h * static_cast<float>(r)), ImVec2(b.x, a.y + block_h * static_cast<float>(r)), IM_COL32(0, 0, 0, 90));
    }
    if (mouse.y >= a.y && mouse.y < b.y && ImGui::IsItemHovered()) hovered = &e;
  }
  if (hovered) {
    ImGui::BeginTooltip();
    ImGui::Text("expert %lld: block rows %lld..%lld, block columns %lld..%lld", static_cast<long long>(hovered->expert),
                static_cast<long long>(hovered->first_block_row), static_cast<long long>(hovered->first_block_row + hovered->block_rows - 1),
                static_cast<long long>(hovered->first_block_col), static_cast<long long>(hovered->first_block_col + hovered->block_cols - 1));
    ImGui::Text("%lld rows after padding, %lld tokens, %lld padding rows", static_cast<long long>(hovered->rows),
                static_cast<long long>(hovered->tokens), static_cast<long long>(hovered->padding_rows));
    ImGui::EndTooltip();
  }
}

// A horizontal bar: token rows, then padding rows, then dropped tokens (not computed), to scale.
void FormulationBar(const char* name, const FormulationRows& f, double scale, const char* help) {
  ImGui::Text("%-9s", name);
  HelpMarker(help);
  ImGui::SameLine(120);
  const ImVec2 p = ImGui::GetCursorScreenPos();
  const float width = std::max(40.0f, ImGui::GetContentRegionAvail().x - 4), h = ImGui::GetFontSize();
  auto w = [&](double rows) { return static_cast<float>(rows / scale) * width; };
  ImDrawList* draw = ImGui::GetWindowDrawList();
  const float token_w = w(static_cast<double>(f.token_rows));
  const float pad_w = w(static_cast<double>(f.computed_rows - f.token_rows));
  const float drop_w = w(static_cast<double>(f.dropped_tokens));
  draw->AddRectFilled(p, ImVec2(p.x + token_w, p.y + h), IM_COL32(80, 170, 240, 255));
  draw->AddRectFilled(ImVec2(p.x + token_w, p.y), ImVec2(p.x + token_w + pad_w, p.y + h), IM_COL32(120, 120, 120, 255));
  draw->AddRectFilled(ImVec2(p.x + token_w + pad_w, p.y), ImVec2(p.x + token_w + pad_w + drop_w, p.y + h), IM_COL32(230, 60, 60, 255));
  ImGui::Dummy(ImVec2(width, h));
  ImGui::Indent();
  ImGui::TextWrapped("computes %lld rows: %lld tokens + %lld padding (%.1f%% padding); drops %lld tokens",
              static_cast<long long>(f.computed_rows), static_cast<long long>(f.token_rows),
              static_cast<long long>(f.computed_rows - f.token_rows),
              f.computed_rows ? 100.0 * static_cast<double>(f.computed_rows - f.token_rows) / static_cast<double>(f.computed_rows) : 0.0,
              static_cast<long long>(f.dropped_tokens));
  ImGui::Unindent();
}

void ShowRunTopology(ViewerState& state, OpenRun& run) {
  const RunModel& m = run.model;
  if (m.topologies.empty()) {
    LacksData("topology events (the dropless formulation's block-sparse layout)");
    return;
  }
  const TopologyRecord* t = m.topology_at(state.step, state.layer);
  if (!t) {
    ImGui::TextDisabled("(no topology for layer %d)", state.layer);
    return;
  }
  const ExpertBars bars = expert_bars(m, t->layer, t->step);
  const bool same_step = bars.valid && bars.step == t->step;
  const RoutingRow* row = nullptr;
  if (auto it = m.routing.find(t->layer); it != m.routing.end() && same_step) row = it->second.row_at_or_before(t->step);
  const TopologyPicture p = topology_picture(*t, same_step ? bars.tokens : std::vector<int64_t>{}, capacity_for(m, row));
  ImGui::TextWrapped("layer %lld, step %lld: B = %lld, %lld x %lld blocks, %lld non-zero (%.1f%% of the dense matrix)",
              static_cast<long long>(t->layer), static_cast<long long>(t->step), static_cast<long long>(p.block_size),
              static_cast<long long>(p.block_rows), static_cast<long long>(p.block_cols), static_cast<long long>(p.nnz),
              p.block_rows * p.block_cols > 0 ? 100.0 * static_cast<double>(p.nnz) / static_cast<double>(p.block_rows * p.block_cols) : 0.0);
  HelpMarker("The dropless formulation (MegaBlocks) computes all experts as one block-sparse matrix "
             "[rows, E*H] in B x B blocks. Each expert's tokens are rounded up to a multiple of B rows, so "
             "every block row belongs to one expert, and its non-zero blocks are that expert's H/B columns: "
             "the matrix is block-diagonal. Dark bands: padding rows added by the rounding.");
  if (!p.problem.empty()) ImGui::TextColored(ImVec4(0.95f, 0.75f, 0.35f, 1.0f), "%s", p.problem.c_str());
  ShowBlockMatrix(state, run, p);
  ImGui::SameLine();
  ImGui::BeginGroup();
  ImGui::Text("padding rows: %lld", static_cast<long long>(p.padding_rows));
  HelpMarker("Rows that hold no token, added so each expert's rows fill whole B-row blocks. At most B-1 per expert.");
  if (p.have_tokens) ImGui::Text("routed tokens: %lld", static_cast<long long>(p.dropless.token_rows));
  ImGui::EndGroup();

  ImGui::Separator();
  ImGui::Text("the same routed tokens in each formulation");
  HelpMarker("Blue: rows holding a token, computed. Grey: padding rows, computed for nothing. Red: tokens "
             "dropped, not computed at all (their output is only the residual). All bars share one scale.");
  if (!p.have_tokens) {
    LacksData("routing event at this topology's step, so the formulations cannot be compared");
    return;
  }
  double scale = static_cast<double>(p.dropless.computed_rows);
  scale = std::max(scale, static_cast<double>(p.padded.computed_rows + p.padded.dropped_tokens));
  scale = std::max(scale, static_cast<double>(p.dropping.computed_rows + p.dropping.dropped_tokens));
  FormulationBar("dropless", p.dropless, std::max(scale, 1.0),
                 "Every token computed; only the rounding to B adds padding.");
  if (!p.capacity) return;
  ImGui::Text("capacity C = %lld rows per expert", static_cast<long long>(*p.capacity));
  HelpMarker("C = ceil(capacity_factor * T*K / E), from the routing event or the run's MoE config.");
  FormulationBar("padded", p.padded, std::max(scale, 1.0),
                 "Every expert computes exactly C rows (GShard, Tutel): tokens beyond C are dropped, empty rows padded.");
  FormulationBar("dropping", p.dropping, std::max(scale, 1.0),
                 "Every expert computes min(tokens, C) rows: no padding, tokens beyond C are dropped.");
}

}  // namespace

void ShowTopologyPanel(ViewerState& state) {
  ForEachShownRun(state, "topology_runs", [&](OpenRun& run) { ShowRunTopology(state, run); });
}

}  // namespace moe::viewer
