// panel_curves.cpp: training curves: loss, validation loss and bits per byte, aux loss, tokens/s and
// any other step metric, every shown run overlaid in its own colour (legend on top), all plots on
// one shared step axis, with zoom and hover values. What to plot and in which order comes from
// viewer/model/curves_view.h.
#include <algorithm>
#include <cstdio>
#include <string>

#include "curves_view.h"  // curve_metric_order, sample_spacing, curve_step_range
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
  if (metric == "val_bits_per_byte")
    return "Validation loss in bits per byte of text (val_loss / ln 2 for a byte-level model): the figure "
           "lesson 08 compares across formulations at equal steps. A unigram model of the bytes scores "
           "about 4.4 on the Brown corpus.";
  if (metric == "lm_loss") return "The language-model part of the loss (cross-entropy of the next byte), without "
                                  "the router's aux and z terms: the part comparable with a dense model.";
  if (metric == "step_ms") return "GPU time of the training step in milliseconds. The first steps include "
                                  "kernel loading; steps that validate or record are slower.";
  if (metric == "grad_norm") return "Global gradient norm before clipping (recorded every few steps).";
  return "A metric the program recorded in its step events.";
}
}  // namespace

void ShowCurvesPanel(ViewerState& state) {
  // Only the runs with step metrics are overlaid, GPU runs first (run_choice.h); the rest are counted.
  size_t with_data = 0;
  std::vector<OpenRun*> shown = state.panel_runs("curves", &with_data);
  if (shown.empty()) {
    ImGui::TextWrapped("No run is open.");
    return;
  }
  if (with_data == 0) {
    NoRunHolds("curves");
    return;
  }
  const size_t without = shown.size() - with_data;
  shown.resize(with_data);
  std::vector<const RunModel*> models;
  for (OpenRun* run : shown) models.push_back(&run->model);
  RunLegend(shown);
  if (without > 0)
    ImGui::TextDisabled("(%zu more shown runs have no step metrics: no \"step\" events, nothing to plot over steps)", without);
  for (OpenRun* run : shown)
    if (run->model.bad_lines > 0)
      WarningLine(run->model.label + ": " + std::to_string(run->model.bad_lines) +
                  " lines of events.jsonl are not valid events and were skipped (their line numbers: Run summary, "
                  "Warnings); the lines after them are read");
  // Every plot shows the same steps, so a step sits at the same x in all of them; zooming one
  // zooms all (double-click fits them again).
  const StepRange range = curve_step_range(models);
  const SharedSteps shared{"curves_steps", range.lo, range.hi};
  const float width = ImGui::GetContentRegionAvail().x;
  for (const std::string& metric : curve_metric_order(models)) {
    std::vector<CurveLine> lines;
    double spacing = 0;
    for (OpenRun* run : shown) {
      auto it = run->model.step_metrics.find(metric);
      if (it == run->model.step_metrics.end()) continue;
      lines.push_back({run->model.label, &it->second, RunColor(run->color_index)});
      spacing = std::max(spacing, sample_spacing(it->second));
    }
    ImGui::Text("%s", metric.c_str());
    HelpMarker(HelpFor(metric));
    if (spacing > 1) {
      ImGui::SameLine();
      ImGui::TextDisabled("(recorded every %.0f steps; the line joins its points)", spacing);
    }
    if (lines.size() < shown.size()) {
      ImGui::SameLine();
      ImGui::TextDisabled("(%zu of %zu shown runs record it)", lines.size(), shown.size());
    }
    int64_t beyond = 0;
    for (OpenRun* run : shown)
      if (auto it = run->model.values_beyond_plot.find(metric); it != run->model.values_beyond_plot.end()) beyond += it->second;
    if (beyond > 0) {
      char limit[32];
      std::snprintf(limit, sizeof limit, "%g", kMaxPlotValue);
      WarningLine(std::to_string(beyond) + " values of " + metric + " beyond the plotting range (|value| <= " + limit +
                  ") are left out of the curve");
    }
    CurvePlot(("curve_" + metric).c_str(), state, lines, ImVec2(width, 120), "%.4g", &shared);
  }
}

}  // namespace moe::viewer
