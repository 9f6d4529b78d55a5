// viewer_state.cpp: the shared state's helpers (viewer_state.h).
#include "viewer_state.h"

#include <algorithm>
#include <cstdio>

namespace moe::viewer {

int64_t ViewerState::first_step() const {
  int64_t first = INT64_MAX;
  for (const auto& run : runs)
    if (run->shown && run->model.has_steps()) first = std::min(first, run->model.first_step);
  return first;
}

int64_t ViewerState::last_step() const {
  int64_t last = INT64_MIN;
  for (const auto& run : runs)
    if (run->shown && run->model.has_steps()) last = std::max(last, run->model.last_step);
  return last;
}

void ViewerState::settle_step() {
  const int64_t first = first_step(), last = last_step();
  if (first > last) return;
  if (follow_latest) step = last;
  step = std::clamp(step, first, last);
}

std::vector<OpenRun*> ViewerState::shown_runs() const {
  std::vector<OpenRun*> out;
  for (const auto& run : runs)
    if (run->shown) out.push_back(run.get());
  return out;
}

std::vector<OpenRun*> ViewerState::panel_runs(std::string_view panel, size_t* with_data) const {
  const std::vector<OpenRun*> shown = shown_runs();
  std::vector<RunHoldings> held;
  for (const OpenRun* run : shown) held.push_back(run_holdings(run->model));
  const PanelChoice choice = choose_runs(panel, held);
  if (with_data) *with_data = choice.with_data;
  std::vector<OpenRun*> out;
  for (size_t i : choice.order) out.push_back(shown[i]);
  return out;
}

void ViewerState::record_region(const std::string& name, float x0, float y0, float x1, float y1) {
  for (Region& r : regions)
    if (r.name == name) {
      r = {name, x0, y0, x1, y1};
      return;
    }
  regions.push_back({name, x0, y0, x1, y1});
}

OpenRun& open_run(ViewerState& state, const std::filesystem::path& dir, bool follow) {
  auto run = std::make_unique<OpenRun>();
  run->model = follow ? RunModel::follow(dir) : RunModel::load(dir);
  run->color_index = static_cast<int>(state.runs.size());
  const RunModel& m = run->model;
  if (!m.error.empty()) std::fprintf(stderr, "moe_viewer: %s\n", m.error.c_str());
  for (const std::string& w : m.warnings) std::fprintf(stderr, "moe_viewer: %s: warning: %s\n", m.label.c_str(), w.c_str());
  if (m.summary.synthetic)
    std::fprintf(stderr, "moe_viewer: %s is a SYNTHETIC run (made-up numbers from moe_fake_run)\n", m.label.c_str());
  if (m.summary.simulated)
    std::fprintf(stderr, "moe_viewer: %s is a SIMULATED run (predicted by moe_sim, not measured)\n", m.label.c_str());
  state.runs.push_back(std::move(run));
  return *state.runs.back();
}

void refresh_run_list(ViewerState& state) {
  state.listed_runs.clear();
  state.listing_problems.clear();
  for (const auto& folder : state.run_folders) {
    std::string problem;
    for (RunEntry& e : list_runs(folder, &problem)) state.listed_runs.push_back(std::move(e));
    if (!problem.empty()) state.listing_problems.push_back(problem);
  }
}

}  // namespace moe::viewer
