// sim/step_load.h: one MoE block's work on the simulated cluster, from a trace: how many rows each
// expert computes and how many rows each rank sends each other rank. Experts are placed
// contiguously, E / R a rank (expert e on rank e / (E / R)), as the expert-parallel layer places them.
//
// Two ways in:
//   - exact: a trace recorded with as many source ranks as the cluster has (tokens[s][e]);
//   - shares: every source rank routes its T K rows by the same expert shares (a synthetic trace,
//     or a recorded one replayed at another size). Rows are then expected values, not integers.
// A capacity (rows an expert may keep) turns routed rows into kept rows; what is dropped is not sent.
//
// Dimension legend: R ranks, E experts, T tokens a rank, K top-k, C capacity.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/routing_trace.h"  // BlockLoad

namespace moe::sim {

struct StepLoad {
  int64_t ranks = 1;    // R
  int64_t experts = 1;  // E
  std::vector<double> rows_per_expert;  // [E] rows each expert computes (kept rows)
  std::vector<double> rows;             // [R][R] rows rank s sends to rank t (t's experts); s = t stays local

  int64_t experts_per_rank() const { return experts / ranks; }
  double sent(int64_t s, int64_t t) const { return rows[static_cast<size_t>(s * ranks + t)]; }
  std::vector<double> rows_per_rank() const;  // [R] rows each rank's experts compute
};

// Throws std::invalid_argument unless E is a multiple of R (contiguous placement).
void check_placement(int64_t experts, int64_t ranks);

StepLoad step_load_from_tokens(const BlockLoad& load, int64_t ranks);  // needs load.sources == ranks
StepLoad step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank);

// Keeps at most `capacity` rows an expert (dropping formulations); the rows each rank sends to an
// expert's rank shrink by the same kept fraction. capacity <= 0 keeps everything (dropless).
void apply_capacity(StepLoad& load, double capacity);

// The same load with every count scaled (one chunk of d, one micro-batch of two).
StepLoad scaled(const StepLoad& load, double factor);

}  // namespace moe::sim
