// viewer_state.h: everything the panels share: the open runs, the step and layer being looked at,
// plot zoom, the textures made from heatmaps, and the rectangles of named regions (which the
// screenshot tests read to know where to look in the picture). No globals: main.cpp owns one
// ViewerState and passes it to every panel.
// Part of moe_viewer (viewer/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm_view.h"        // Timeline
#include "downsample.h"       // CurveColumn
#include "heatmap_texture.h"  // HeatmapTexture
#include "inference_view.h"   // CacheTimeline, DecodeModeRow
#include "run_choice.h"       // choose_runs
#include "run_list.h"         // RunEntry
#include "run_model.h"        // RunModel

namespace moe::viewer {

struct OpenRun {
  RunModel model;
  bool shown = true;     // drawn in the panels (side by side when several are shown)
  double last_poll = 0;  // live mode: when poll() last ran (glfwGetTime seconds)
  int color_index = 0;   // its colour in overlaid curves
};

// The visible window of a curve plot, in steps; auto_fit follows the data.
struct PlotView {
  double x_lo = 0, x_hi = 1;
  bool auto_fit = true;
};

// A rectangle of the frame, in pixels from the top left, named for the screenshot tests.
struct Region {
  std::string name;
  float x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

struct ViewerState {
  std::vector<std::unique_ptr<OpenRun>> runs;
  std::vector<std::filesystem::path> run_folders;  // listed in the runs panel
  std::vector<RunEntry> listed_runs;
  std::vector<std::string> listing_problems;

  int64_t step = 0;            // the step every panel shows (the scrubber)
  bool follow_latest = true;   // keep the scrubber on the newest step (live runs)
  bool playing = false;
  int layer = 0;               // L index the per-layer views show
  float load_scale_max = 2.0f; // heatmap colour scale: 0 .. this many times the fair share
  std::string alltoall_name;   // "" = every all-to-all of the step

  std::map<std::string, PlotView> plots;
  std::map<std::string, HeatmapTexture> textures;  // keyed by what they show (see panels)
  struct CachedTimeline {
    std::string key;
    int64_t step = 0;  // the recorded step it shows
    Timeline timeline;
  };
  std::map<std::string, CachedTimeline> timelines;  // rebuilt when the step or the data changes
  struct CachedSeries {
    std::string key;
    Series series;
  };
  std::map<std::string, CachedSeries> series;  // derived series too costly to rebuild each frame
  struct CachedDecode {
    std::string key;
    CacheTimeline cache;  // the expert cache over the decode steps
    DecodeModeRow row;    // the run's line in the modes-side-by-side table
  };
  std::map<std::string, CachedDecode> decode;  // the offload panel's, per run
  int64_t alltoall_layer = -1;  // the layer of the byte matrix and the load across ranks (-1: all)
  struct CachedCurves {
    std::string key;  // the plot's step window and width, and each line's series and length
    std::vector<std::vector<CurveColumn>> columns;  // one list of pixel columns per line
  };
  std::map<std::string, CachedCurves> curves;  // a plot's reduced lines, kept while nothing moves
  struct TableSort {
    std::string table;  // the compared table sorted ("" = file order)
    int column = 0;
    bool ascending = true;
  };
  TableSort summary_sort;  // the summary panel's comparison table, sorted by a header click
  std::vector<Region> regions;
  std::string selected_panel;  // the tab to select on the next frame ("" = leave as is)
  std::string current_panel;   // the panel being drawn (its --panel name): orders panel_runs()
  bool screenshot = false;     // headless: no interaction, fixed layout
  bool scrub = false;          // headless benchmark: move the step every frame (re-prepares views)

  // Puts `step` on the newest step while follow_latest is on, and inside the shown runs' range.
  // Called every frame before the panels (also when the runs panel with the scrubber is not drawn,
  // as in a one-panel screenshot).
  void settle_step();
  // The step range over the shown runs (first > last when none has steps).
  int64_t first_step() const;
  int64_t last_step() const;
  std::vector<OpenRun*> shown_runs() const;
  // The shown runs in the order `panel` draws them (run_choice.h): those holding its data first,
  // GPU runs before the lessons'; `with_data` gets how many lead the list with the data.
  std::vector<OpenRun*> panel_runs(std::string_view panel, size_t* with_data = nullptr) const;
  void record_region(const std::string& name, float x0, float y0, float x1, float y1);
};

// Opens a run (loaded whole, or followed live) and echoes its problems on the terminal.
OpenRun& open_run(ViewerState& state, const std::filesystem::path& dir, bool follow);
// Re-reads the run folders' listings.
void refresh_run_list(ViewerState& state);

}  // namespace moe::viewer
