// panel_summary.cpp: the run summary panel: what ran (config, formulation, devices, world size),
// what the record holds (events by type), its problems, and the lesson's tables and verdict; with
// several runs shown, their tables of one name compared in one sortable table on top.
#include <algorithm>
#include <string>
#include <vector>

#include "panels.h"
#include "summary_view.h"  // compare_tables, shared_table_names, sort_rows
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

// The rows of an open table, one cell per column: a row shorter than the table leaves its last
// cells empty, a longer one is cut at the table's `columns`.
void ShowTableRows(const std::vector<std::vector<std::string>>& rows, int columns) {
  for (const auto& row : rows) {
    ImGui::TableNextRow();
    for (int c = 0; c < columns && c < static_cast<int>(row.size()); ++c) {
      ImGui::TableSetColumnIndex(c);
      ImGui::TextUnformatted(row[static_cast<size_t>(c)].c_str());
    }
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
  if (m.partial)
    WarningLine(m.live() ? "PARTIAL RUN so far: run.json says \"finished\": false; it is still being written"
                         : "PARTIAL RUN: run.json says \"finished\": false: the program was killed or failed before "
                           "closing its record (or it is still running), so the record ends early");
  if (s.synthetic) {
    ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.85f, 0.2f, 1.0f));
    ImGui::TextWrapped("SYNTHETIC RUN: made-up numbers written by moe_fake_run for the viewer's tests; not a measurement.");
    ImGui::PopStyleColor();
  }
  if (s.simulated) {
    ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(0.45f, 0.85f, 1.0f, 1.0f));
    ImGui::TextWrapped("SIMULATED RUN: predicted by moe_sim (distributed/sim/) from a calibration measured on a few GPUs "
                       "(see extra: calibration, its device and date); its times are a model's, not measurements.");
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
    else if (s.formulation == "dense") ImGui::TextDisabled("(a dense model: no MoE layer to configure)");
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
    if (m.bad_lines)
      WarningLine(std::to_string(m.bad_lines) + " lines of events.jsonl are not valid events and were skipped "
                  "(each named under Warnings); the lines after them are read");
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
    // A one-row table (a training run's "summary") reads better turned on its side in a narrow column.
    if (table.rows.size() == 1 && ImGui::CollapsingHeader(table.name.c_str(), ImGuiTreeNodeFlags_DefaultOpen)) {
      if (ImGui::BeginTable("table", 2, ImGuiTableFlags_BordersInnerH | ImGuiTableFlags_SizingStretchProp)) {
        const auto& row = table.rows[0];
        for (size_t c = 0; c < table.columns.size() || c < row.size(); ++c) {
          ImGui::TableNextColumn();
          ImGui::TextUnformatted(c < table.columns.size() ? table.columns[c].c_str() : "");
          ImGui::TableNextColumn();
          ImGui::TextUnformatted(c < row.size() ? row[c].c_str() : "");
        }
        ImGui::EndTable();
      }
    } else if (table.rows.size() != 1 && ImGui::CollapsingHeader(table.name.c_str())) {
      const int columns = static_cast<int>(std::min<size_t>(std::max<size_t>(table.columns.size(), 1), 64));
      if (ImGui::BeginTable("table", columns, ImGuiTableFlags_Borders | ImGuiTableFlags_RowBg | ImGuiTableFlags_ScrollX |
                                                  ImGuiTableFlags_SizingFixedFit)) {
        for (int c = 0; c < columns; ++c)
          ImGui::TableSetupColumn(c < static_cast<int>(table.columns.size()) ? table.columns[static_cast<size_t>(c)].c_str() : "");
        ImGui::TableHeadersRow();
        ShowTableRows(table.rows, columns);
        ImGui::EndTable();
      }
    }
    ImGui::PopID();
  }
}

// The shown runs' tables of one name under each other, one row per run, sortable by any column
// (click a header): 16 training runs' validation bits per byte side by side in one table.
void ShowComparison(ViewerState& state, const std::vector<const RunModel*>& runs, const std::string& name) {
  TableComparison table = compare_tables(runs, name);
  const std::string header = "compare: " + name + " of " + std::to_string(table.runs) + " runs";
  if (!ImGui::CollapsingHeader(header.c_str(), ImGuiTreeNodeFlags_DefaultOpen)) return;
  const int columns = static_cast<int>(std::min<size_t>(table.columns.size(), 64));
  const float height = std::min(ImGui::GetTextLineHeightWithSpacing() * static_cast<float>(table.rows.size() + 2), 360.0f);
  ImGui::PushID(name.c_str());
  if (ImGui::BeginTable("comparison", columns, ImGuiTableFlags_Borders | ImGuiTableFlags_RowBg | ImGuiTableFlags_ScrollX |
                                                   ImGuiTableFlags_ScrollY | ImGuiTableFlags_Sortable | ImGuiTableFlags_SizingFixedFit,
                        ImVec2(0, height))) {
    ImGui::TableSetupScrollFreeze(1, 1);
    for (int c = 0; c < columns; ++c) ImGui::TableSetupColumn(table.columns[static_cast<size_t>(c)].c_str());
    ImGui::TableHeadersRow();
    if (ImGuiTableSortSpecs* sort = ImGui::TableGetSortSpecs(); sort && sort->SpecsCount > 0) {
      const ImGuiTableColumnSortSpecs& spec = sort->Specs[0];
      state.summary_sort = {name, spec.ColumnIndex, spec.SortDirection == ImGuiSortDirection_Ascending};
    }
    if (state.summary_sort.table == name)
      sort_rows(table, static_cast<size_t>(state.summary_sort.column), state.summary_sort.ascending);
    ShowTableRows(table.rows, columns);
    ImGui::EndTable();
  }
  ImGui::PopID();
}
}  // namespace

void ShowSummaryPanel(ViewerState& state) {
  std::vector<const RunModel*> runs;
  for (OpenRun* run : state.shown_runs()) runs.push_back(&run->model);
  for (const std::string& name : shared_table_names(runs)) ShowComparison(state, runs, name);
  ForEachShownRun(state, "summary_runs", ShowRunSummary);
}

}  // namespace moe::viewer
