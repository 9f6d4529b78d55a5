// panel_summary.cpp: the run summary panel: what ran (config, formulation, devices, world size),
// what the record holds (events by type), its problems, and the lesson's tables and verdict.
#include <string>

#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {
void ShowJsonFields(const nlohmann::json& object) {
  if (!object.is_object() || object.empty()) {
    ImGui::TextDisabled("(none)");
    return;
  }
  if (ImGui::BeginTable("fields", 2, ImGuiTableFlags_BordersInnerH | ImGuiTableFlags_SizingStretchProp)) {
    for (auto it = object.begin(); it != object.end(); ++it) {
      ImGui::TableNextColumn();
      ImGui::TextUnformatted(it.key().c_str());
      ImGui::TableNextColumn();
      const std::string value = it->is_string() ? it->get<std::string>() : it->dump();
      ImGui::TextUnformatted(value.c_str());
    }
    ImGui::EndTable();
  }
}

void ShowRunSummary(OpenRun& run) {
  const RunModel& m = run.model;
  if (!m.error.empty()) {
    ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.4f, 0.4f, 1.0f));
    ImGui::TextWrapped("Cannot read this run: %s", m.error.c_str());
    ImGui::PopStyleColor();
  }
  if (!m.waiting_for.empty()) ImGui::TextWrapped("Live: waiting for %s to appear in %s", m.waiting_for.c_str(), m.dir.string().c_str());
  if (!m.has_info) return;
  const RunSummary& s = m.summary;
  if (s.synthetic) {
    ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.85f, 0.2f, 1.0f));
    ImGui::TextWrapped("SYNTHETIC RUN: made-up numbers written by moe_fake_run for the viewer's tests; not a measurement.");
    ImGui::PopStyleColor();
  }
  ImGui::Text("name: %s", s.name.c_str());
  ImGui::Text("kind: %s", s.kind.c_str());
  HelpMarker("train, infer, bench or lesson: which kind of program wrote the run.");
  ImGui::Text("formulation: %s", s.formulation.empty() ? "(not recorded)" : s.formulation.c_str());
  HelpMarker("dropping: each expert computes at most C = ceil(capacity_factor * T*K / E) tokens, the rest are dropped. "
             "padded: every expert computes exactly C rows, empty rows are zero padding (GShard, Tutel). "
             "dropless: every token is computed; each expert's rows are rounded up to the block size B and "
             "computed as block-sparse products (MegaBlocks).");
  ImGui::Text("world size: %lld", static_cast<long long>(s.world_size));
  HelpMarker("R, the number of ranks (GPUs, one process each) the run used.");
  ImGui::Text("devices: %s", s.devices.empty() ? "(not recorded)" : "");
  for (const std::string& d : s.devices) ImGui::BulletText("%s", d.c_str());
  ImGui::Text("started: %s   commit: %s", s.start_time.c_str(), s.git_commit.empty() ? "(unknown)" : s.git_commit.c_str());
  if (ImGui::CollapsingHeader("MoE config", ImGuiTreeNodeFlags_DefaultOpen)) {
    if (s.moe_config.is_object()) ShowJsonFields(s.moe_config);
    else LacksData("MoE config in run.json");
  }
  if (ImGui::CollapsingHeader("Model and extra")) {
    ShowJsonFields(s.model);
    ShowJsonFields(s.extra);
  }
  if (ImGui::CollapsingHeader("Events", ImGuiTreeNodeFlags_DefaultOpen)) {
    ImGui::Text("%lld events, steps %lld .. %lld%s", static_cast<long long>(m.events_total),
                static_cast<long long>(m.first_step), static_cast<long long>(m.last_step), m.live() ? " (live)" : "");
    for (const auto& [type, count] : m.events_by_type) ImGui::BulletText("%s: %lld", type.c_str(), static_cast<long long>(count));
    if (m.events_skipped) ImGui::Text("%lld events skipped (see warnings)", static_cast<long long>(m.events_skipped));
  }
  if (!m.warnings.empty() && ImGui::CollapsingHeader("Warnings")) {
    for (const std::string& w : m.warnings) ImGui::TextWrapped("%s", w.c_str());
    if (m.warnings_not_kept) ImGui::Text("... and %lld more", static_cast<long long>(m.warnings_not_kept));
  }
  for (const VerdictRecord& v : m.verdicts) {
    ImGui::PushStyleColor(ImGuiCol_Text, v.pass ? ImVec4(0.4f, 1.0f, 0.4f, 1.0f) : ImVec4(1.0f, 0.4f, 0.4f, 1.0f));
    ImGui::TextWrapped("%s %s", v.pass ? "PASS" : "FAIL", v.message.c_str());
    ImGui::PopStyleColor();
  }
  for (size_t t = 0; t < m.tables.size(); ++t) {
    const TableRecord& table = m.tables[t];
    ImGui::PushID(static_cast<int>(t));
    if (ImGui::CollapsingHeader(table.name.c_str())) {
      const int columns = static_cast<int>(std::min<size_t>(std::max<size_t>(table.columns.size(), 1), 64));
      if (ImGui::BeginTable("table", columns, ImGuiTableFlags_Borders | ImGuiTableFlags_RowBg | ImGuiTableFlags_ScrollX |
                                                  ImGuiTableFlags_SizingFixedFit)) {
        for (int c = 0; c < columns; ++c)
          ImGui::TableSetupColumn(c < static_cast<int>(table.columns.size()) ? table.columns[static_cast<size_t>(c)].c_str() : "");
        ImGui::TableHeadersRow();
        for (const auto& row : table.rows) {
          ImGui::TableNextRow();
          for (int c = 0; c < columns && c < static_cast<int>(row.size()); ++c) {
            ImGui::TableSetColumnIndex(c);
            ImGui::TextUnformatted(row[static_cast<size_t>(c)].c_str());
          }
        }
        ImGui::EndTable();
      }
    }
    ImGui::PopID();
  }
}
}  // namespace

void ShowSummaryPanel(ViewerState& state) {
  ForEachShownRun(state, "summary_runs", ShowRunSummary);
}

}  // namespace moe::viewer
