// sim/simulate.h: a whole simulated run: for every step, every MoE block's load on the cluster (from
// a recorded trace or synthetic routing), issued on the timeline; per step the slowest rank's time,
// the compute and the exposed communication, and how unequal the ranks' expert rows were.
//
//   SimulationSpec spec{.cluster = parse_cluster("nodes=8,gpus-per-node=8"), .steps = 100};
//   spec.layer.experts = 8 * spec.cluster.ranks();
//   Simulation run = simulate(spec, load_calibration("notebooks_data/sim/calibration_....json"));
//
// A recorded trace of as many ranks as the cluster is replayed exactly (tokens[s][e]); any other is
// replayed through each step's expert shares, stretched to the cluster's E (routing_trace.h), with
// T K rows a rank. Steps past the trace's end wrap around to its start.
//
// Tests: ctest -R SimSimulate.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sim/calibration.h"    // Calibration
#include "sim/cluster.h"        // Cluster
#include "sim/cost_model.h"     // LayerSpec
#include "sim/routing_trace.h"  // RoutingTrace, SyntheticRouting
#include "sim/timeline.h"       // SimSpan

namespace moe::sim {

struct SimulationSpec {
  Cluster cluster;
  LayerSpec layer;
  int64_t steps = 10;
  int64_t blocks = 1;                  // MoE blocks a step, for synthetic routing (a trace has its own)
  std::optional<RoutingTrace> trace;   // else `synthetic`
  SyntheticRouting synthetic;
  int64_t span_ranks = 8;              // keep the spans of ranks 0 .. span_ranks - 1 and the busiest rank
};

struct SimulatedStep {
  int64_t step = 0;
  double step_us = 0;                 // the slowest rank's end
  double compute_us = 0;              // the busiest rank's compute-stream time
  double exposed_us = 0;              // the median rank's wait on communication
  double exposed_share = 0;           // exposed_us / step_us
  double straggler = 1;               // the most rows a rank computes over the mean, worst block
  std::vector<std::vector<double>> rows_per_expert;  // [block][E] what each expert computed
  std::vector<SimSpan> spans;
};

struct Simulation {
  std::vector<SimulatedStep> steps;
  double median_step_us() const;
  double median_exposed_share() const;
};

// Calls on_step after each step when given (a run record written as it goes).
Simulation simulate(const SimulationSpec& spec, const Calibration& calibration,
                    const std::function<void(const SimulatedStep&)>& on_step = {});

}  // namespace moe::sim
