// panel_curves.cpp: training curves: loss, validation loss, aux loss, tokens/s and any other step
// metric, every shown run overlaid in its own colour, with zoom and hover values.
#include <set>
#include <string>

#include "panels.h"
#include "widgets.h"

namespace moe::viewer {

namespace {
const char* HelpFor(const std::string& metric) {
  if (metric == "loss") return "Training cross-entropy loss of the step (nats per token); lower is better.";
  if (metric == "val_loss") return "Loss on held-out data, measured every few steps; a gap that grows above the "
                                   "training loss means overfitting.";
  if (metric == "aux_loss") return "The load-balancing loss of Switch/GShard, E * sum_e f_e * P_e, where f_e is the "
                                   "fraction of tokens routed to expert e and P_e its mean router probability. "
                                   "It equals 1 when routing is uniform and grows as a few experts take most tokens.";
  if (metric == "z_loss") return "The router z-loss, mean over tokens of logsumexp(logits)^2: keeps router logits small.";
  if (metric == "tokens_per_s") return "Training throughput: tokens processed per second in this step.";
  if (metric == "mfu") return "Model FLOP utilisation: achieved FLOP/s over the device's peak, 0..1.";
  if (metric == "lr") return "The learning rate used in this step.";
  return "A metric the program recorded in its step events.";
}
}  // namespace

void ShowCurvesPanel(ViewerState& state) {
  std::vector<OpenRun*> shown = state.shown_runs();
  std::vector<std::string> metrics = {"loss", "val_loss", "aux_loss", "tokens_per_s"};
  std::set<std::string> seen(metrics.begin(), metrics.end());
  for (OpenRun* run : shown)
    for (const auto& [name, series] : run->model.step_metrics)
      if (seen.insert(name).second) metrics.push_back(name);
  if (shown.empty()) {
    ImGui::TextWrapped("No run is open.");
    return;
  }
  for (OpenRun* run : shown)
    if (run->model.step_metrics.empty()) {
      ImGui::PushStyleColor(ImGuiCol_Text, RunColor(run->color_index));
      ImGui::TextUnformatted(run->model.label.c_str());
      ImGui::PopStyleColor();
      ImGui::SameLine();
      LacksData("step metrics (no \"step\" events: nothing to plot over steps)");
    }
  const float width = ImGui::GetContentRegionAvail().x;
  for (const std::string& metric : metrics) {
    std::vector<CurveLine> lines;
    for (OpenRun* run : shown) {
      auto it = run->model.step_metrics.find(metric);
      if (it != run->model.step_metrics.end())
        lines.push_back({run->model.label, &it->second, RunColor(run->color_index)});
    }
    ImGui::Text("%s", metric.c_str());
    HelpMarker(HelpFor(metric));
    if (lines.empty()) {
      ImGui::SameLine();
      ImGui::TextDisabled("(no shown run records %s)", metric.c_str());
      continue;
    }
    CurvePlot(("curve_" + metric).c_str(), state, lines, ImVec2(width, 120));
  }
}

}  // namespace moe::viewer
