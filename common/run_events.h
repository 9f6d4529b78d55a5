// run_events.h: the event types of a run's events.jsonl, the contract between the programs that
// write run records and the viewer that reads them (format: notebooks_data/README.md).
//
// Every event is one JSON object on one line with a string "type" and, where it applies, an
// integer "step". Events stay plain JSON, so a program may add fields of its own and readers
// ignore what they do not know. The structs below are typed helpers for the fields the viewer
// relies on; to_event() turns one into the JSON line a RunWriter appends:
//   writer.append(moe::to_event(moe::SpanEvent{.step = 3, .rank = 0, .stream = 1,
//                                              .name = "dispatch", .start_us = 10, .duration_us = 5}));
//   writer.append(moe::step_event(3, {{"loss", 2.31}, {"lr", 3e-4}}));
// validate_event() checks the required fields of the known types (RunReader calls it on each line).
//
// Dimension legend: E experts, K top-k, R ranks, B block size.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {

// The "type" strings of the events this project writes.
namespace event_type {
inline constexpr std::string_view step = "step";
inline constexpr std::string_view routing = "routing";
inline constexpr std::string_view expert_load = "expert_load";
inline constexpr std::string_view topology = "topology";
inline constexpr std::string_view span = "span";
inline constexpr std::string_view alltoall = "alltoall";
inline constexpr std::string_view offload = "offload";
inline constexpr std::string_view tokens = "tokens";
inline constexpr std::string_view table = "table";
inline constexpr std::string_view verdict = "verdict";
}  // namespace event_type

// "step": scalar metrics of one training / inference step, flat in the object:
//   {"type":"step","step":12,"loss":2.31,"val_loss":2.40,"aux_loss":0.011,"z_loss":0.002,
//    "tokens_per_s":1.2e6,"mfu":0.41,"lr":3e-4}
// Any metric name may appear; a NaN or infinite value is written as null (JSON has no NaN).
nlohmann::json step_event(int64_t step, const std::vector<std::pair<std::string, double>>& metrics);

// "routing": where one layer's tokens went in one step.
struct RoutingEvent {
  int64_t step = 0;
  int64_t layer = 0;
  std::vector<int64_t> tokens_per_expert{};   // [E] tokens routed to each expert (before dropping)
  std::vector<int64_t> dropped_per_expert{};  // [E] of those, dropped for capacity (empty: none)
  std::optional<int64_t> capacity{};          // C rows per expert; absent for dropless
  // Optional [genre] -> [E] counts, for data sets whose tokens carry a genre (code, prose, ...).
  std::map<std::string, std::vector<int64_t>> tokens_per_expert_by_genre{};
};

// "expert_load": where one layer's tokens went in one step of a run of R ranks, per source rank:
// the routing trace moe_sim replays exactly (distributed/sim/routing_trace.h). A one-GPU run's
// "routing" event is the same trace with one source.
struct ExpertLoadEvent {
  int64_t step = 0;
  int64_t layer = 0;
  std::vector<std::vector<int64_t>> tokens{};  // [R source ranks][E] routed (before any dropping)
};

// "topology": a summary of one layer's block-sparse (BCSR) topology in the dropless formulation.
struct TopologyEvent {
  int64_t step = 0;
  int64_t layer = 0;
  int64_t block_size = 0;              // B
  int64_t block_rows = 0;              // padded rows / B
  int64_t block_cols = 0;              // H / B
  int64_t nnz = 0;                     // non-zero B x B blocks
  int64_t padding_rows = 0;            // rows added to round each expert up to a multiple of B
  std::vector<int64_t> rows_per_expert{};  // [E] rows after padding
};

// "span": one timed phase on one rank and stream, the unit of the timeline (and of Chrome trace).
// start_us counts microseconds from the run's clock origin (RunWriter::elapsed_us()); all ranks
// of a run should share that origin so their timelines line up.
struct SpanEvent {
  int64_t step = 0;
  int64_t rank = 0;
  int64_t stream = 0;       // an integer id per rank (0 = the compute stream by convention)
  std::string stream_name{};  // optional label, e.g. "compute", "comm", "copy"
  std::string name{};         // dispatch, expert_compute, combine, h2d_copy, ...
  double start_us = 0;
  double duration_us = 0;
};

// The span names that are communication their stream could not hide: the expert-parallel layer's
// count exchange (an all-gather the host waits for), the waits of a compute stream on the layer's
// exchange stream ("ep_wait_dispatch" before a chunk's experts, "ep_wait_combine" before the weighted
// combine: zero where the rows were already there), its router gradient's all-reduce, and the
// model's all-reduce of the replicated gradients. Their sum over a step on the compute stream (stream
// 0; with two micro-batches overlapped, the first one's) is the step's exposed communication, as
// ep_bench, the trainer and the viewer report it.
bool is_exposed_communication(std::string_view span_name);

// The rows a training run's spans are recorded on (cuda/train/trainer.cpp), by stream_name: the
// compute stream's phases and the MoE layer's phases inside them, the same for the second
// micro-batch's stream when two overlap, and the expert-parallel layers' exchange streams.
inline constexpr const char* kComputeRow = "compute";
inline constexpr const char* kComputeInsideMoeRow = "compute: inside the MoE layer";
inline constexpr const char* kSecondMicroBatchSuffix = ", second micro-batch";
inline constexpr const char* kExchangeRow = "exchange stream (the all-to-alls)";

// "alltoall": bytes moved by one all-to-all, bytes[src][dst] over R ranks.
struct AllToAllEvent {
  int64_t step = 0;
  std::optional<int64_t> layer{};
  std::string name = "alltoall";          // e.g. dispatch or combine
  std::vector<std::vector<int64_t>> bytes{};  // [R][R]
  double duration_us = 0;
  std::optional<double> start_us{};  // when present, the Chrome trace shows it as a span
  int64_t rank = 0;                // the rank that timed it
};

// "offload": expert-cache behaviour of one layer in one step (experts living in host memory).
struct OffloadEvent {
  int64_t step = 0;
  int64_t layer = 0;
  int64_t hits = 0;    // routed experts already resident on the GPU
  int64_t misses = 0;  // routed experts that had to be copied in
  double stall_us = 0;  // time the layer waited for copies
  std::vector<int64_t> prefetched{};  // expert ids copied in ahead of need
};

// "tokens": a text sample and the experts each of its bytes was routed to (byte-level models).
struct TokensEvent {
  int64_t step = 0;
  int64_t layer = 0;
  std::string text{};                        // UTF-8; invalid bytes are written as U+FFFD
  std::vector<std::vector<int64_t>> experts{};  // [bytes of text][K], best expert first
};

// "table": a table a lesson printed, so the viewer can show it too. Cells are numbers or strings.
struct TableEvent {
  std::string name{};
  std::vector<std::string> columns{};
  std::vector<std::vector<nlohmann::json>> rows{};  // [rows][columns]
};

// "verdict": the one PASS / FAIL line of a lesson, test or benchmark.
struct VerdictEvent {
  bool pass = false;
  std::string message{};  // e.g. "max_rel_err=3.1e-3 tol=1e-2"
  std::optional<int64_t> step{};
};

nlohmann::json to_event(const RoutingEvent& event);
nlohmann::json to_event(const ExpertLoadEvent& event);
nlohmann::json to_event(const TopologyEvent& event);
nlohmann::json to_event(const SpanEvent& event);
nlohmann::json to_event(const AllToAllEvent& event);
nlohmann::json to_event(const OffloadEvent& event);
nlohmann::json to_event(const TokensEvent& event);
nlohmann::json to_event(const TableEvent& event);
nlohmann::json to_event(const VerdictEvent& event);

// Returns "" when `event` is a JSON object with a string "type", an integer "step" if present,
// and, for the known types above, their required fields with the right JSON types; otherwise a
// message naming the first bad field. Unknown types pass (new event types need no new reader).
std::string validate_event(const nlohmann::json& event);

}  // namespace moe
