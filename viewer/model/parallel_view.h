// parallel_view.h: the multi-GPU views of an expert-parallel run, prepared apart from drawing:
// the rank x rank byte matrix of one layer at one step, the load each rank's experts carry, and
// the time each rank spends waiting in the exchanges.
//
// What a run record holds (cuda/train/trainer.cpp writes it on rank 0, moe_train_distributed):
//   - `span` events of every rank, each rank's GPU times placed at rank 0's host time of the
//     step's start: the ranks' timelines are aligned on the step's first phase, not on a clock
//     shared by the GPUs. Times within one rank are exact; across ranks they are as close as the
//     ranks' step starts (they leave the previous step's all-reduce together).
//   - `alltoall` events per layer and step: bytes[src][dst] of the dispatch (rows to the experts'
//     ranks) and the combine (the way back), with rank 0's duration.
//
// Load across ranks. The dispatch matrix's column r is every row sent to rank r: the token copies
// its experts compute. Its max / mean over ranks is the expert-parallel imbalance: the step waits
// for the busiest rank.
//
// Idle time in the exchanges. An all-to-all returns on every rank at about the same moment, once
// the last rank has joined and the bytes have moved; a rank that arrives early spends the
// difference waiting. The k-th exchange phase of a name on one rank is the same collective as the
// k-th of that name on every other rank, so
//     idle_r = sum over the step's exchanges of (rank r's duration - the shortest rank's duration)
// measures from each rank's own clock (no cross-rank alignment needed) the time it waited for the
// others. It is a lower bound on the waiting (the fastest rank waits too, for the bytes) and it
// also holds differences in what each rank sends. The exchange phases are the spans on a stream
// named "exchange..." (moe_train_distributed) or "comm..." (the record format's name for a
// communication stream) and those whose name ends in "_exchange" (the count exchange on the
// compute stream is a collective too).
//
//   AllToAllView a = alltoall_at(run, step, "dispatch", layer);   // comm_view.h
//   RankLoad load = rank_load_at(run, step, layer);
//   ExchangeWaits waits = exchange_waits_at(run, step);
// Built into moe_viewer_model; tested by tests/viewer/test_parallel_runs.cpp.
// Dimension legend: R ranks, L layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm_view.h"  // AllToAllView
#include "run_model.h"  // RunModel, Series

namespace moe::viewer {

// The layers that have all-to-all events, ascending (-1 for events without a layer). The byte
// matrix of one layer at one step: alltoall_at(run, step, name, layer) (comm_view.h).
std::vector<int64_t> alltoall_layers(const RunModel& run);

struct RankLoad {
  int64_t step = 0;               // the recorded step shown
  int64_t ranks = 0;              // R
  std::vector<double> received;   // [R] bytes the dispatch sent to each rank (its experts' rows)
  double max_over_mean = 0;       // max_r received / mean_r received; 1 = balanced
  int64_t busiest_rank = -1;
};
// From the dispatch matrices of one layer (-1 = summed over layers) at the recorded step at or
// before `step`. ranks == 0 when the run has no dispatch all-to-all.
RankLoad rank_load_at(const RunModel& run, int64_t step, int64_t layer);
// max_over_mean per recorded step, one layer (-1 = the layers summed).
Series rank_imbalance_series(const RunModel& run, int64_t layer);

struct ExchangeWaits {
  int64_t step = 0;                 // the recorded step shown
  int64_t ranks = 0;                // R (0: the run has no exchange spans on two or more ranks)
  int64_t exchanges = 0;            // collectives found on every rank
  std::vector<double> exchange_us;  // [R] time in the matched exchange phases
  std::vector<double> idle_us;      // [R] sum of (duration - the shortest rank's duration)
  std::vector<std::string> names;   // the exchange phases' names, each once
};
bool is_exchange_span(const SpanRecord& span);
// The recorded step with spans at or before `step` (timeline_step), its exchanges matched across ranks.
ExchangeWaits exchange_waits_at(const RunModel& run, int64_t step);
// One series per rank: its idle time in the exchanges per recorded step.
std::vector<Series> exchange_idle_series(const RunModel& run);

// Exposed communication: the time a rank's compute stream waited on communication in one step,
// the spans on it named by moe::is_exposed_communication (common/run_events.h: the count
// exchanges, the waits for rows to arrive and to come back, the router's and the replicated
// gradients' all-reduce where the backward did not hide it), summed. The compute stream is the
// rows named "compute..." without the second micro-batch's suffix: with two micro-batches
// overlapped, the first one's stream, which the step's end waits on (the trainer's figure too).
// step_us is the rank's step on its own clock, from its first span's start to its last span's end.
struct ExposedCommunication {
  int64_t step = 0;                // the recorded step shown
  int64_t ranks = 0;               // R (0: no spans at that step)
  std::vector<double> exposed_us;  // [R]
  std::vector<double> step_us;     // [R]
};
bool is_first_compute_stream(const SpanRecord& span);
ExposedCommunication exposed_communication_at(const RunModel& run, int64_t step);
// One series per rank: its exposed communication per recorded step, in us.
std::vector<Series> exposed_communication_series(const RunModel& run);

// Experts placed by load (moe_train_distributed --placement eplb). At each re-plan the trainer
// writes a "placement" table, one row per MoE block: step, layer, the busiest rank's rows over the
// mean rank's expected from the loads that planned it, under the placement before and the one after,
// the replicas (slots beyond one per expert), and each rank's experts (a JSON list per rank).
struct PlacementView {
  int64_t planned_at = -1;                            // the re-plan in force at the step; -1: none yet
  int64_t layer = -1;
  std::vector<std::vector<int64_t>> experts_of_rank;  // [R] ascending
  std::vector<int64_t> copies;                        // [E] ranks holding each expert (> 1: replicated)
  double expected_before = 0, expected_after = 0;     // busiest / mean rank, from the planning loads
  std::vector<int64_t> plan_steps;                    // every re-plan of the layer, ascending
};
// The placement of `layer` in force at `step` (the last re-plan at or before it); layer -1: the
// first MoE block the table names. planned_at = -1 when the run has no such table row, or before the
// first re-plan (then the experts sit E / R a rank in id order). Malformed rows are skipped.
PlacementView placement_at(const RunModel& run, int64_t step, int64_t layer);

}  // namespace moe::viewer
