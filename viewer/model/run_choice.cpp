// run_choice.cpp: which runs each panel shows first (run_choice.h).
#include "run_choice.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace moe::viewer {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// One row per panel: its name, what its data is, who writes it.
struct PanelData {
  std::string_view panel;
  bool RunHoldings::*held;
  const char* name;
  const char* writers;
};
constexpr PanelData kPanelData[] = {
    {"summary", &RunHoldings::summary, "run.json",
     "every program given a run folder: moe_train / moe_generate --run-dir, offload_bench --record-dir, the lessons (./moe tour)"},
    {"curves", &RunHoldings::curves, "step metrics",
     "moe_train --run-dir (loss, val loss, tokens/s per step), lesson 01"},
    {"routing", &RunHoldings::routing, "routing events",
     "moe_train --run-dir, lessons 01-03 and 06 (./moe tour)"},
    {"tokens", &RunHoldings::tokens, "token samples", "moe_train --run-dir (a sample of text with its experts)"},
    {"topology", &RunHoldings::topology, "topology events",
     "moe_train --run-dir (dropless), lessons 02-04 (lesson 03: the block-sparse layout)"},
    {"alltoall", &RunHoldings::alltoall, "timed spans or all-to-all events",
     "moe_train_distributed --run-dir on two or more ranks, lessons 06/07 under mpirun (./moe tour); spans also "
     "from moe_train / moe_generate --run-dir"},
    {"offload", &RunHoldings::offload, "offload events",
     "moe_generate --run-dir / offload_bench --record-dir (experts offloaded to host memory)"},
};

const PanelData* find_panel(std::string_view panel) {
  for (const PanelData& p : kPanelData)
    if (p.panel == panel) return &p;
  return nullptr;
}

}  // namespace

bool is_gpu_run(const RunSummary& summary) {
  if (summary.simulated) return false;  // its devices name the calibration's GPU, but nothing ran on one
  if (summary.kind == "train" || summary.kind == "infer" || summary.kind == "bench") return true;
  // A lesson runs on the CPU even where its devices line mentions GPUs (lesson 08 "reads GPU
  // training runs"); device names are matched by vendor and model, not by the word "GPU".
  if (summary.kind == "lesson") return false;
  for (const std::string& device : summary.devices) {
    const std::string d = lower(device);
    for (const char* word : {"nvidia", "cuda", "h100", "h200", "a100", "geforce", "tesla", "rtx"})
      if (d.find(word) != std::string::npos) return true;
  }
  return false;
}

RunHoldings run_holdings(const RunModel& run) {
  RunHoldings h;
  h.gpu = run.has_info && is_gpu_run(run.summary);
  h.synthetic = run.summary.synthetic;
  h.simulated = run.summary.simulated;
  h.summary = run.has_info;
  h.curves = !run.step_metrics.empty();
  h.routing = !run.routing.empty();
  h.tokens = !run.token_samples.empty();
  h.topology = !run.topologies.empty();
  h.alltoall = !run.spans.empty() || !run.alltoalls.empty();
  h.offload = !run.offloads.empty();
  h.alltoall_bytes = !run.alltoalls.empty();
  return h;
}

bool holds_panel_data(const RunHoldings& held, std::string_view panel) {
  const PanelData* p = find_panel(panel);
  return p && held.*(p->held);
}

PanelChoice choose_runs(std::string_view panel, const std::vector<RunHoldings>& runs) {
  PanelChoice choice;
  for (size_t i = 0; i < runs.size(); ++i) choice.order.push_back(i);
  // Lower ranks first: with the data before without; then, in the timeline / all-to-all panel,
  // all-to-all matrices (both halves of the panel), spans, decoding runs' spans; then GPU, lesson,
  // simulated, synthetic.
  auto rank = [&](size_t i) {
    const RunHoldings& h = runs[i];
    const int origin = h.synthetic ? 3 : h.simulated ? 2 : h.gpu ? 0 : 1;
    const int detail = panel != "alltoall" ? 0 : h.alltoall_bytes ? 0 : h.offload ? 2 : 1;
    return (holds_panel_data(h, panel) ? 0 : 16) + detail * 4 + origin;
  };
  std::stable_sort(choice.order.begin(), choice.order.end(), [&](size_t a, size_t b) { return rank(a) < rank(b); });
  choice.with_data = static_cast<size_t>(std::count_if(runs.begin(), runs.end(),
                                                       [&](const RunHoldings& h) { return holds_panel_data(h, panel); }));
  return choice;
}

const char* panel_data_name(std::string_view panel) {
  const PanelData* p = find_panel(panel);
  return p ? p->name : "data";
}

const char* panel_data_writers(std::string_view panel) {
  const PanelData* p = find_panel(panel);
  return p ? p->writers : "";
}

}  // namespace moe::viewer
