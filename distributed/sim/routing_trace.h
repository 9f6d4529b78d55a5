// sim/routing_trace.h: where tokens went, step by step, as moe_sim replays it. A routing trace is,
// per step and MoE block, the tokens each expert received from each source rank: tokens[s][e].
//
// Where traces come from:
//   - every run record (notebooks_data/README.md): a "routing" event per block holds
//     tokens_per_expert, which is the trace of a one-GPU run (one source); an "expert_load" event
//     holds tokens[s][e] for runs of several ranks (expert_load_event below writes it);
//   - synthetic routing: uniform, Zipf(s) with a seeded order of the experts, or Zipf whose hot
//     experts drift one place every few steps.
// A trace recorded at one size is replayed at another through its shares (stretch_shares): the
// share of each expert, the load curve kept when the expert count changes.
//
//   RoutingTrace trace = read_routing_trace("notebooks_data/runs/train_throughput_preset_300steps");
//   std::vector<double> p = synthetic_shares(parse_synthetic("zipf:1.2"), 64, step);
//
// Tests: ctest -R SimRouting. Dimension legend: S source ranks, E experts, K top-k.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe::sim {

// One MoE block in one step.
struct BlockLoad {
  int64_t step = 0;
  int64_t layer = 0;
  int64_t sources = 1;          // S
  int64_t experts = 0;          // E
  std::vector<int64_t> tokens;  // [S][E] routed from source s to expert e (before any dropping)

  int64_t total() const;
  std::vector<double> shares() const;  // [E] each expert's part of all routed slots
};

struct RoutingTrace {
  std::string source;             // the run directory, or the synthetic spec
  std::vector<BlockLoad> loads;   // in step order, blocks of a step together
  std::vector<int64_t> steps() const;  // the distinct steps, ascending
};

// A block's load as the "expert_load" event of a multi-rank run (common/run_events.h).
nlohmann::json expert_load_event(const BlockLoad& load);

// The trace in a run record: its expert_load events, or else its routing events. Throws
// std::invalid_argument naming the directory when it has neither (a trace without counts) or
// when a block's counts disagree in E.
RoutingTrace read_routing_trace(const std::filesystem::path& run_dir);

struct SyntheticRouting {
  enum class Kind { uniform, zipf, drift };
  Kind kind = Kind::uniform;
  double zipf_s = 1.0;       // Zipf exponent: the i-th most popular expert gets a share ~ 1 / i^s
  int64_t drift_steps = 10;  // drift: the popularity order moves one expert every drift_steps
  uint64_t seed = 1;         // which experts are hot
};

// "uniform", "zipf:S" or "drift:S:STEPS"; throws std::invalid_argument saying what is allowed.
SyntheticRouting parse_synthetic(const std::string& text);
std::string describe(const SyntheticRouting& routing);

// [E] shares summing to 1 for one step.
std::vector<double> synthetic_shares(const SyntheticRouting& routing, int64_t experts, int64_t step);

// The same load curve over another expert count: more experts split each old one into
// neighbours of equal share, fewer merge neighbours (renormalised). Neighbours share a rank under
// the contiguous placement, so a hot expert stays a hot rank.
std::vector<double> stretch_shares(const std::vector<double>& shares, int64_t experts);

}  // namespace moe::sim
