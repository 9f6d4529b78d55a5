// panel_runs.cpp: the runs panel on the left: the open runs (shown or not, live or not, their
// problems), the runs found under the run folders, and the step scrubber and layer every other
// panel follows.
#include <algorithm>
#include <cstring>

#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {
void ShowStepScrubber(ViewerState& state) {
  const int64_t first = state.first_step(), last = state.last_step();
  if (first > last) {
    ImGui::TextDisabled("(no shown run has steps)");
    return;
  }
  state.settle_step();
  ImGui::Text("step");
  HelpMarker("The step every panel shows. A panel shows the last step its run recorded at or before it. "
             "'latest' keeps it on the newest step, which is what you want for a live run.");
  long long step = state.step;
  ImGui::SetNextItemWidth(-1);
  if (ImGui::DragScalar("##step", ImGuiDataType_S64, &step, std::max(1.0f, static_cast<float>(last - first) / 400.0f), &first, &last)) {
    state.step = step;
    state.follow_latest = false;
  }
  if (ImGui::ArrowButton("##back", ImGuiDir_Left)) state.step = std::max(first, state.step - 1), state.follow_latest = false;
  ImGui::SameLine();
  if (ImGui::ArrowButton("##forward", ImGuiDir_Right)) state.step = std::min(last, state.step + 1), state.follow_latest = false;
  ImGui::SameLine();
  if (ImGui::Button(state.playing ? "pause" : "play")) state.playing = !state.playing, state.follow_latest = false;
  ImGui::SameLine();
  ImGui::Checkbox("latest", &state.follow_latest);
  if (state.playing && !state.screenshot) {
    state.step += std::max<int64_t>(1, (last - first) / 600);
    if (state.step >= last) state.playing = false;
  }
  ImGui::SetNextItemWidth(100);
  ImGui::InputInt("layer", &state.layer);
  state.layer = std::clamp(state.layer, 0, static_cast<int>(kMaxLayers - 1));
  HelpMarker("L index of the layer the per-layer views show (routing, tokens, topology).");
}

void ShowOpenRuns(ViewerState& state) {
  for (size_t i = 0; i < state.runs.size(); ++i) {
    OpenRun& run = *state.runs[i];
    ImGui::PushID(static_cast<int>(i));
    ImGui::ColorButton("##c", ImGui::ColorConvertU32ToFloat4(RunColor(run.color_index)), ImGuiColorEditFlags_NoTooltip, ImVec2(10, 10));
    ImGui::SameLine();
    ImGui::Checkbox(run.model.label.c_str(), &run.shown);
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", run.model.dir.string().c_str());
    if (run.model.live()) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(0.4f, 1.0f, 0.4f, 1.0f), "live");
    }
    if (run.model.summary.synthetic) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(1.0f, 0.85f, 0.2f, 1.0f), "SYNTHETIC");
    }
    if (run.model.summary.simulated) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(0.45f, 0.85f, 1.0f, 1.0f), "SIMULATED");
    }
    if (run.model.partial && !run.model.live()) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(1.0f, 0.6f, 0.25f, 1.0f), "partial");
    }
    if (!run.model.error.empty()) ImGui::TextColored(ImVec4(1.0f, 0.4f, 0.4f, 1.0f), "error: see Run summary");
    else if (!run.model.waiting_for.empty()) ImGui::TextDisabled("waiting for %s", run.model.waiting_for.c_str());
    else ImGui::TextDisabled("  %lld events, steps %lld..%lld", static_cast<long long>(run.model.events_total),
                             static_cast<long long>(run.model.first_step), static_cast<long long>(run.model.last_step));
    ImGui::PopID();
  }
}

void ShowRunList(ViewerState& state) {
  if (ImGui::Button("refresh")) refresh_run_list(state);
  HelpMarker("Runs found in the run folders (--runs-dir; by default runs/ of the lesson tour and "
             "notebooks_data/runs/). 'open' loads a run whole; 'follow' reads it live, as it is written.");
  for (const std::string& p : state.listing_problems) ImGui::TextDisabled("%s", p.c_str());
  for (size_t i = 0; i < state.listed_runs.size(); ++i) {
    const RunEntry& e = state.listed_runs[i];
    ImGui::PushID(static_cast<int>(i) + 10000);
    const bool open = std::any_of(state.runs.begin(), state.runs.end(), [&](const auto& r) { return r->model.dir == e.dir; });
    ImGui::BeginDisabled(open);
    if (ImGui::SmallButton("open")) open_run(state, e.dir, false);
    ImGui::SameLine();
    if (ImGui::SmallButton("follow")) open_run(state, e.dir, true);
    ImGui::EndDisabled();
    ImGui::SameLine();
    ImGui::TextUnformatted(e.name.c_str());
    if (e.live) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(0.4f, 1.0f, 0.4f, 1.0f), "(being written)");
    } else if (e.partial) {
      ImGui::SameLine();
      ImGui::TextColored(ImVec4(1.0f, 0.6f, 0.25f, 1.0f), "(partial)");
    }
    ImGui::PopID();
  }
}
}  // namespace

void ShowRunsPanel(ViewerState& state) {
  ShowStepScrubber(state);
  ImGui::Separator();
  ImGui::Text("open runs");
  HelpMarker("Tick the runs to show; several ticked runs are drawn side by side in every panel "
             "(dropless beside dropping, for instance) and overlaid in the training curves.");
  ShowOpenRuns(state);
  ImGui::Separator();
  ImGui::Text("run folders");
  ShowRunList(state);
  ImGui::Separator();
  ImGui::TextDisabled("%.1f fps", static_cast<double>(ImGui::GetIO().Framerate));
}

}  // namespace moe::viewer
