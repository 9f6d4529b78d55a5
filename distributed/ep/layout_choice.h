// layout_choice.h: Tutel's parallelism switching, the rules and the choice by cost model (Hwang et
// al., MLSys 2023): which layouts r are valid for a config on R ranks, and which one a step's
// bytes, collectives and expert FLOPs make cheapest. Plain C++ (no Eigen, no CUDA): the CPU layer
// (expert_layouts.h) and the GPU layer (expert_parallel_gpu.h, expert_layout_choice_gpu.h) share it.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, C capacity,
// R ranks, E_r = E / R; r Tutel's degree: 0 data parallel experts, 1 expert parallel, r > 1 each
// expert sharded over r ranks along H. What each layout sends is derived in expert_layouts.h.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moe_config.h"  // MoeConfig

namespace moe::dist {

// The r that are valid for this config on R ranks, ascending: 0, 1, then every r > 1 that divides
// R and H. Throws as experts_per_rank does unless R divides E.
std::vector<int> valid_layouts(const MoeConfig& config, int ranks);

// Throws std::invalid_argument saying what is allowed unless r is one of valid_layouts().
void check_layout(const MoeConfig& config, int ranks, int r);

// "r=0 data parallel", "r=1 expert parallel", "r=2 sharded over 2 ranks along H".
std::string layout_name(int r);

// ---- the choice by cost model ----

// The inputs of the cost model. A step's time on the busiest rank is
//   collectives * latency_us + bytes sent / bytes_per_us + expert FLOPs / expert_flops_per_us,
// the bytes and FLOPs those of one training step (forward + backward = 3 forward products).
struct LayoutCostModel {
  double latency_us = 10.0;             // the fixed cost of one collective
  double bytes_per_us = 10e3;           // what one rank sends per microsecond (10 GB/s)
  double expert_flops_per_us = 10e6;    // the expert products' rate (10 TFLOP/s)
  double bytes_per_element = 8.0;       // 8: double, the CPU ranks; 2: bf16 on GPUs
};

struct LayoutEstimate {
  int r = 1;
  double weight_bytes = 0;   // the busiest rank's, one step
  double token_bytes = 0;
  int collectives = 0;       // the layout's collectives a step (weights and token exchanges)
  double expert_flops = 0;   // the busiest rank's, one step
  double communication_us = 0;
  double compute_us = 0;
  double total_us = 0;
};

struct LayoutChoice {
  int r = 1;
  std::string by;                          // "cost model" or "measurement"
  std::vector<int> candidates;             // the r considered, ascending
  std::vector<LayoutEstimate> estimates;   // cost model: one per candidate
  std::vector<double> measured_us;         // measurement: one per candidate, the median over the timed
                                           // calls of the slowest rank's forward + backward
};

// The cheapest valid layout by the cost model, from the kept counts of a step (kept_per_rank_expert
// [R, E], e.g. from the previous call's forward; empty: uniform routing, T K / (R E) a rank and
// expert, at most C / R when capacity applies). Padded rows up to C count as computed rows; the
// dropless rounding up to B is left out. Pure arithmetic: every rank that passes the same inputs
// gets the same choice. Ties keep the smaller r.
LayoutChoice choose_layout(const MoeConfig& config, int ranks, std::span<const int64_t> kept_per_rank_expert,
                           const LayoutCostModel& model);

}  // namespace moe::dist
