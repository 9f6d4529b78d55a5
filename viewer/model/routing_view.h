// routing_view.h: the routing-imbalance panel's data, prepared apart from drawing.
//
// Load is shown as a load factor: tokens routed to an expert divided by the mean over experts in
// the same row (1 = the expert got its fair share T*K/E, 0 = idle, E = it got every token).
//   Matrix m = step_expert_load(run.routing.at(0), 1024);  // [E rows, <=1024 step buckets]
// Built into moe_viewer_model; tested by tests/viewer/test_views.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "downsample.h"  // Matrix
#include "run_model.h"   // RunModel, LayerRouting

namespace moe::viewer {

// Step x expert heatmap of one layer: rows = experts, columns = the layer's recorded rows in step
// order, reduced to at most max_columns columns by mean. Image-ready (time runs left to right).
Matrix step_expert_load(const LayerRouting& layer, int64_t max_columns);

// Layer x expert at one step (each layer's row at or before `step`): rows = layers in `layers`
// order, columns = experts. A layer without a row there is NaN.
Matrix layer_expert_load(const RunModel& run, int64_t step, std::vector<int64_t>* layers = nullptr);

// Per-expert bars at one step of one layer.
struct ExpertBars {
  int64_t step = 0;               // the recorded step shown (at or before the one asked for)
  std::vector<int64_t> tokens;    // [E]
  std::vector<int64_t> dropped;   // [E] (zeros when not recorded)
  int64_t capacity = -1;          // C; -1 for dropless / not recorded
  double mean = 0;                // mean tokens per expert (the fair share)
  RoutingStats stats;
  bool valid = false;
};
ExpertBars expert_bars(const RunModel& run, int64_t layer, int64_t step);

// Expert load per genre at one step: genre -> [E] fraction of that genre's tokens per expert.
std::map<std::string, std::vector<double>> genre_load(const RunModel& run, int64_t layer, int64_t step);

// The per-genre panel's table at one step of one layer: the genres the step's batch held (a batch
// of a few dozen sequences rarely holds all 15 Brown genres, so the set changes from step to
// step), their counts, and how much of the layer's routing they account for.
struct GenreTable {
  int64_t step = 0;                             // the recorded step shown
  int64_t num_experts = 0;                      // E: the widest row
  std::vector<std::string> genres;              // [G] in name order
  std::vector<std::vector<int64_t>> counts;     // [G][E] tokens of the genre routed to each expert
  std::vector<int64_t> genre_tokens;            // [G] routed tokens of the genre (K per byte)
  std::vector<std::vector<double>> fractions;   // [G][E] counts / genre_tokens
  std::vector<int64_t> expert_totals;           // [E] sum over genres: equals tokens_per_expert
                                                //     when every token carries a genre
  std::vector<int64_t> tokens_per_expert;       // [E] the routing row itself, to compare with
  bool valid = false;                           // a row with genres exists
};
GenreTable genre_table(const RunModel& run, int64_t layer, int64_t step);

}  // namespace moe::viewer
