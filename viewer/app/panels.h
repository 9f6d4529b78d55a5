// panels.h: one function per panel, one panel per file (panel_<name>.cpp), as in imgui_demo.cpp.
// Each draws the shown runs side by side (ForEachShownRun) and says what a run lacks instead of
// drawing nothing. kPanels lists them in tab order with the name --panel takes.
// Part of moe_viewer.
#pragma once

#include "viewer_state.h"

namespace moe::viewer {

void ShowRunsPanel(ViewerState& state);      // panel_runs.cpp: open runs, run list, step scrubber
void ShowSummaryPanel(ViewerState& state);   // panel_summary.cpp: config, formulation, devices, tables
void ShowCurvesPanel(ViewerState& state);    // panel_curves.cpp: loss, val loss, aux loss, tokens/s
void ShowRoutingPanel(ViewerState& state);   // panel_routing.cpp: imbalance heatmaps, bars, statistics
void ShowTokensPanel(ViewerState& state);    // panel_tokens.cpp: sample text coloured by expert
void ShowTopologyPanel(ViewerState& state);  // panel_topology.cpp: block-sparse matrix vs padded/dropping
void ShowAllToAllPanel(ViewerState& state);  // panel_alltoall.cpp: timeline of phases, byte matrix, bandwidth
void ShowOffloadPanel(ViewerState& state);   // panel_offload.cpp: copy/compute streams, hits, stalls

struct PanelEntry {
  const char* name;   // for --panel
  const char* title;  // the tab's label
  void (*show)(ViewerState&);
};
inline constexpr PanelEntry kPanels[] = {
    {"summary", "Run summary", ShowSummaryPanel},     {"curves", "Training curves", ShowCurvesPanel},
    {"routing", "Routing imbalance", ShowRoutingPanel}, {"tokens", "Tokens", ShowTokensPanel},
    {"topology", "Sparse topology", ShowTopologyPanel}, {"alltoall", "Timeline / all-to-all", ShowAllToAllPanel},
    {"offload", "Offload", ShowOffloadPanel},
};

}  // namespace moe::viewer
