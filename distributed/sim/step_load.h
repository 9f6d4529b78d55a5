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
// Replicated hot experts: the layers' own placement by load (DeepSeek's EPLB,
// common/expert_placement.h): ceil(E / R) + S slots a rank, the spare ones filled with replicas of the
// experts with the most rows a replica, the replicas packed heaviest first onto the least loaded
// rank. Every source rank's rows for an expert are split evenly over its replicas (the expectation
// of the layers' routing rule, which splits them within a row), so the busiest rank's rows shrink
// and more rows may cross the network.
//
// Dimension legend: R ranks, E experts, T tokens a rank, K top-k, C capacity.
#pragma once

#include <cstdint>
#include <vector>

#include "expert_placement.h"  // ExpertPlacement, eplb_placement
#include "sim/routing_trace.h"    // BlockLoad

namespace moe::sim {

struct StepLoad {
  int64_t ranks = 1;    // R
  int64_t experts = 1;  // E
  std::vector<double> rows_per_expert;  // [E] rows each expert computes (kept rows), all replicas together
  std::vector<double> rows;             // [R][R] rows rank s sends to rank t (t's experts); s = t stays local
  std::vector<double> source_rows;      // [R][E] rows source rank s routes to expert e (kept rows)
  // With a placement of its own (replicas): [R] the rows of each rank's expert slots, in the
  // placement's slot order; empty without (rank r computes experts [r E / R, (r + 1) E / R) whole).
  std::vector<std::vector<double>> slot_rows;
  std::vector<std::vector<int64_t>> slot_experts;  // [R] the expert of each of those slots
  std::vector<int64_t> holders;                    // [E] ranks holding expert e (1 without replicas)
  int64_t replicas = 0;  // replicas placed beyond one an expert
  // Shadowed for this step only (shadow_hot_experts): their copies are not kept, so their weights
  // are sent before the step and their gradients returned after it, instead of summed over replicas.
  std::vector<int64_t> shadowed_this_step;  // ascending

  int64_t experts_per_rank() const { return experts / ranks; }
  double sent(int64_t s, int64_t t) const { return rows[static_cast<size_t>(s * ranks + t)]; }
  std::vector<double> rows_per_rank() const;           // [R] rows each rank's experts compute
  std::vector<double> expert_rows_of(int64_t r) const;  // rank r's experts' (or slots') rows
};

// Throws std::invalid_argument unless E is a multiple of R (contiguous placement).
void check_placement(int64_t experts, int64_t ranks);

StepLoad step_load_from_tokens(const BlockLoad& load, int64_t ranks);  // needs load.sources == ranks
StepLoad step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank);
// The same into `out`, reusing its arrays' memory (a simulation's loads from step to step).
void step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank, StepLoad& out);

// Keeps at most `capacity` rows an expert (dropping formulations); the rows each rank sends to an
// expert's rank shrink by the same kept fraction. capacity <= 0 keeps everything (dropless).
void apply_capacity(StepLoad& load, double capacity);

// The same load with every count scaled (one chunk of d, one micro-batch of two).
StepLoad scaled(const StepLoad& load, double factor);

// Tutel's layout r (cost_model.h's LayerSpec::layout) applied to the rows: r = 0, every rank computes
// every expert on its own rows and nothing crosses the network; r > 1, the ranks of a group of r
// each compute a 1 / r slice of all the group's experts, so every row for them goes to all r ranks
// (and r partial rows come back). slot_rows and rows change; r = 1 changes nothing.
void apply_layout(StepLoad& load, int64_t layout);

// Puts the experts where `placement` says and moves their rows: slot_rows, slot_experts, holders,
// rows and replicas change; rows_per_expert and source_rows stay. Throws unless the placement is of
// this load's E and R.
void apply_placement(StepLoad& load, const dist::ExpertPlacement& placement);

// EPLB with redundant_slots_per_rank spare slots a rank, from this load's rows per expert (see the
// file comment), applied. 0: nothing moves. Throws as eplb_placement does.
void replicate_hot_experts(StepLoad& load, int64_t redundant_slots_per_rank);

// FasterMoE's shadowing decided for this step, as the GPU layer's shadow_per_step decides it: the
// experts worth_shadowing picks from this load's counts (rounded to whole rows) under the
// contiguous placement, each put on every rank, where it computes that rank's own rows. D, H: the
// experts' shape (GeLU: W1 has H columns). Nothing at R = 1.
void shadow_hot_experts(StepLoad& load, int64_t model_dim, int64_t hidden_dim);

// The expected share of rows each expert gets when every token draws top_k distinct experts by
// Gumbel-max from `weights` (the Plackett-Luce law, ep_bench --zipf's sampling): [E], summing to 1.
// Exact for top_k <= 3; throws std::invalid_argument beyond.
std::vector<double> top_k_shares(const std::vector<double>& weights, int64_t top_k);

}  // namespace moe::sim
