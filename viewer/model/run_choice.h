// run_choice.h: which runs each panel shows first. A panel opens on the runs that hold its data,
// recorded GPU runs (devices naming a GPU, or kind train / infer / bench) before the lessons' CPU
// runs, then simulated runs (moe_sim), synthetic runs last; a panel that no open run feeds says
// which program writes such a run.
//
//   std::vector<RunHoldings> held;
//   for (const RunModel* m : runs) held.push_back(run_holdings(*m));
//   PanelChoice c = choose_runs("offload", held);  // c.order: indices into `held`, best first
//   if (c.with_data == 0) std::puts(panel_data_writers("offload"));
//
// No ImGui: the app's ForEachShownRun draws in this order. Built into moe_viewer_model; tested by
// tests/viewer/test_run_choice.cpp.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "run_model.h"

namespace moe::viewer {

// What one loaded run holds, per panel, and where it came from.
struct RunHoldings {
  bool gpu = false;        // recorded on a GPU (is_gpu_run)
  bool synthetic = false;  // moe_fake_run's made-up numbers
  bool simulated = false;  // moe_sim's predictions
  bool summary = false;    // run.json was read
  bool curves = false;     // "step" metrics
  bool routing = false;    // "routing" events
  bool tokens = false;     // "tokens" samples
  bool topology = false;   // "topology" events
  bool alltoall = false;   // timed "span"s or "alltoall" matrices
  bool offload = false;    // "offload" events
  bool alltoall_bytes = false;  // "alltoall" matrices (not only spans)
};

// A GPU run: kind train, infer or bench (the CUDA programs' kinds), or a device named NVIDIA /
// CUDA / H100 / H200 / A100 / GeForce / Tesla / RTX; never kind "lesson" (the lessons run on the CPU).
bool is_gpu_run(const RunSummary& summary);
RunHoldings run_holdings(const RunModel& run);

// Whether `held` feeds the panel named `panel` (the names of --panel: summary curves routing
// tokens topology alltoall offload). An unknown name: false.
bool holds_panel_data(const RunHoldings& held, std::string_view panel);

struct PanelChoice {
  std::vector<size_t> order;  // indices into the runs given, those with the panel's data first
  size_t with_data = 0;       // how many of `order`'s first entries hold the panel's data
};
// The runs in the order the panel shows them: with its data before without; in the timeline /
// all-to-all panel, runs with all-to-all matrices (lesson 06 under mpirun) first, then runs with
// spans only, decoding runs (whose spans the offload panel shows) last; then real GPU runs, other
// real runs (the lessons), simulated ones (moe_sim), synthetic ones; otherwise as given (stable).
PanelChoice choose_runs(std::string_view panel, const std::vector<RunHoldings>& runs);

// What the panel's data is ("offload events") and which programs write it, for the notice a panel
// shows when no open run holds it.
const char* panel_data_name(std::string_view panel);
const char* panel_data_writers(std::string_view panel);

}  // namespace moe::viewer
