// run_model.h: one run as the viewer sees it, loaded whole or followed live, with no ImGui in sight.
//
// The run-record reader in common/ (run_record.h) checks the format; RunModel turns the checked
// events into typed series the panels draw: step metrics per name, routing counts per layer
// (with the imbalance statistics of each row, computed once at ingest), topologies, spans,
// all-to-all matrices, offload counters, token samples, tables and verdicts.
// It never throws: a run that cannot be read keeps its message in `error`, and an event whose
// values the viewer cannot use (an expert count beyond kMaxExperts, a layer index of 10^15, a
// negative count) is skipped with a line in `warnings`, so a panel can say what is wrong. So is a
// line of events.jsonl that is not a valid event (counted in bad_lines, named by its line number):
// the lines after it are read as usual.
//
//   moe::viewer::RunModel run = moe::viewer::RunModel::load("runs/lesson01_routing");
//   if (!run.error.empty()) std::fprintf(stderr, "%s\n", run.error.c_str());
//
//   moe::viewer::RunModel live = moe::viewer::RunModel::follow("notebooks_data/runs/tiny");
//   live.poll();  // each frame or so: appends the complete lines that arrived since the last call
//
// Built into moe_viewer_model (viewer/CMakeLists.txt); tested by tests/viewer/test_run_model.cpp.
// Dimension legend: E experts, L layers, R ranks, K top-k, B block size, C capacity.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe {
class RunReader;  // run_record.h, only needed by follow()
}

namespace moe::viewer {

// Bounds on what one event may ask the viewer to hold. An event beyond them is skipped with a
// warning: a corrupt "layer": 1e15 must not become a 10^15-entry table.
inline constexpr int64_t kMaxExperts = 4096;
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxRanks = 1024;
inline constexpr int64_t kMaxGenres = 64;
inline constexpr size_t kMaxSampleBytes = 1 << 16;
inline constexpr size_t kMaxWarnings = 50;  // further warnings are only counted
// Memory stays bounded by what can be drawn, however long a run grows (a record followed while it
// grows by gigabytes): a curve keeps at most kMaxCurvePoints points (see Series), and each other
// kind of record (routing rows, spans, topologies, ...) at most kMaxRecordsPerKind; further ones
// are counted in `records_not_kept` with one warning per kind. Real runs write those every few
// steps or once per run; it is the per-step curves that reach millions.
inline constexpr size_t kMaxCurvePoints = size_t{1} << 18;
inline constexpr size_t kMaxRecordsPerKind = 100'000;
// A step metric beyond this magnitude (1.79e308 is finite) is left out of its curve and counted in
// values_beyond_plot: the plot's axis span, max - min, must stay a finite number.
inline constexpr double kMaxPlotValue = 1e300;

// The imbalance statistics of one routing row (one layer, one step).
struct RoutingStats {
  double total_tokens = 0;       // sum over experts of tokens routed
  double max_over_mean = 0;      // max_e tokens[e] / mean_e tokens[e]; 1 = perfectly balanced
  double coefficient_of_variation = 0;  // std_e / mean_e of tokens[e]
  double dropped_fraction = 0;   // dropped / routed, 0 when nothing is dropped or recorded
  double routing_entropy = 0;    // H(tokens / total) / log(E): 1 = uniform, 0 = one expert
};
RoutingStats routing_stats(const std::vector<int64_t>& tokens_per_expert,
                           const std::vector<int64_t>& dropped_per_expert);

struct RoutingRow {
  int64_t step = 0;
  std::vector<int64_t> tokens_per_expert;   // [E]
  std::vector<int64_t> dropped_per_expert;  // [E] or empty (nothing dropped / not recorded)
  std::optional<int64_t> capacity;          // C; absent for dropless
  std::map<std::string, std::vector<int64_t>> tokens_per_expert_by_genre;  // genre -> [E]
  RoutingStats stats;
};

// One layer's routing rows in step order (a repeated step keeps its last row).
struct LayerRouting {
  int64_t layer = 0;
  int64_t num_experts = 0;       // E: the widest row seen
  std::vector<RoutingRow> rows;  // sorted by step
  const RoutingRow* row_at_or_before(int64_t step) const;  // nullptr when none
};

struct TopologyRecord {
  int64_t step = 0;
  int64_t layer = 0;
  int64_t block_size = 0;  // B
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  int64_t nnz = 0;
  int64_t padding_rows = 0;
  std::vector<int64_t> rows_per_expert;  // [E] after padding, may be empty
};

struct SpanRecord {
  int64_t step = 0;
  int64_t rank = 0;
  int64_t stream = 0;
  std::string stream_name;
  std::string name;
  double start_us = 0;
  double duration_us = 0;
};

struct AllToAllRecord {
  int64_t step = 0;
  int64_t layer = -1;  // -1: not given
  int64_t rank = 0;
  std::string name;
  int64_t ranks = 0;               // R
  std::vector<int64_t> bytes;      // [R * R], bytes[src * R + dst]
  double duration_us = 0;
  std::optional<double> start_us;
};

struct OffloadRecord {
  int64_t step = 0;
  int64_t layer = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  double stall_us = 0;
  std::vector<int64_t> prefetched;  // the experts the schedule asked to copy ahead (a hint)
  // Optional fields the decoding programs add (cuda/infer/offload_recording.cpp):
  std::vector<int64_t> experts;          // the experts the block chose
  std::optional<int64_t> prefetched_used;  // prefetch copies the block then chose
  std::optional<int64_t> bytes;            // host-to-device bytes copied for the block
  // The experts of `experts` the host computed instead of the GPU (neither hits nor misses: hits
  // and misses count what the GPU computed), and the host's time for them. Empty and 0 in records
  // of decoders that compute every expert on the GPU.
  std::vector<int64_t> on_host;
  double host_us = 0;
};

struct TokensRecord {
  int64_t step = 0;
  int64_t layer = 0;
  std::string text;
  std::vector<std::vector<int64_t>> experts;  // [bytes][K]
};

struct TableRecord {
  std::string name;
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;  // cells as text
};

struct VerdictRecord {
  bool pass = false;
  std::string message;
};

// A sampled scalar over steps: one step metric, or one routing statistic of one layer.
// A step metric holds every sample until it reaches kMaxCurvePoints. Then it is cut into buckets
// of bucket_steps steps (a power of two, [k * bucket_steps, (k + 1) * bucket_steps)) of which
// only the lowest and the highest sample stay, in step order; the width doubles each time the
// series fills up again, and later samples join their bucket as they come. The buckets tile the
// steps evenly, so the whole run is drawn at one resolution, its extremes kept: a spike at one
// step is never lost, and a plot column that covers whole buckets shows exactly the raw minimum
// and maximum. A run of 2M steps keeps at most 2^18 points per metric (buckets of 16 steps);
// zoomed in below a bucket, the plot shows the kept extremes, not every step.
struct Series {
  std::vector<double> steps;   // x, increasing
  std::vector<double> values;  // y; NaN where the run wrote null
  double bucket_steps = 0;     // 0: every sample is kept
  double recorded_spacing = 0; // sample_spacing() of the samples before the first bucketing
};

// Adds a sample in step order (a step seen before keeps the last value while every sample is
// kept; an earlier step is inserted in place) and widens the buckets while the series holds more
// than max_points. Used by RunModel::ingest.
void add_sample(Series& series, double step, double value, size_t max_points = kMaxCurvePoints);
// Doubles the bucket width (the first call makes it 2) and keeps, of each bucket, the sample with
// the lowest and the one with the highest value, in step order (one point when they are the same;
// NaN only where a bucket holds nothing else).
void halve_min_max(Series& series);

// What run.json says, flattened for the summary panel.
struct RunSummary {
  std::string name;
  std::string kind;
  std::string formulation;
  std::string start_time;
  std::string git_commit;
  int64_t world_size = 1;
  std::vector<std::string> devices;
  nlohmann::json moe_config;  // null when absent
  nlohmann::json model;
  nlohmann::json extra;
  bool synthetic = false;     // extra.synthetic: written by moe_fake_run, not a measurement
  bool simulated = false;     // extra.simulated: predicted by moe_sim from a calibration, not measured
};

// "" when the run's run.json and events.jsonl are regular files (or absent); otherwise what is
// wrong, e.g. "R/events.jsonl is not a regular file (a named pipe): the viewer reads run records
// from files". load() and poll() check it first, so a named pipe never blocks a read.
std::string odd_run_file(const std::filesystem::path& dir);

// Whether run.json (parsed) says the run did not end normally: "finished": false. A record
// without the field predates it and is not partial (notebooks_data/README.md).
bool run_is_partial(const nlohmann::json& run_json);

class RunModel {
 public:
  // Loads a whole run in one streaming pass over events.jsonl, read_block_bytes at a time (the
  // fuzz target makes that tiny). Never throws; see `error`.
  static RunModel load(const std::filesystem::path& dir, uint64_t read_block_bytes = uint64_t{4} << 20);
  // Starts following a run that may still be written; poll() brings in new events. run.json may
  // not exist yet: poll() keeps trying, and `waiting_for` says what it waits for.
  static RunModel follow(const std::filesystem::path& dir);
  // The same checks on text in memory (tests, fuzzing).
  static RunModel from_text(std::string_view run_json_text, std::string_view events_text,
                            const std::string& source = "<memory>");

  RunModel();
  RunModel(RunModel&&) noexcept;
  RunModel& operator=(RunModel&&) noexcept;
  ~RunModel();

  // Live mode: reads the complete lines appended since the last call, at most about max_bytes of
  // them (so a record that grew by gigabytes is caught up over several calls while the window
  // keeps drawing; caught_up() says when it is). Returns the number of new events. A half-written
  // last line waits for its newline; it is not an error. A file cut shorter or replaced ends the
  // following with a message in `error`; what was read stays.
  int64_t poll(uint64_t max_bytes = uint64_t{16} << 20);
  bool caught_up() const;
  bool live() const { return reader_ != nullptr || !waiting_for.empty(); }

  // Takes one event (already checked by validate_event). Public for tests and fuzzing.
  void ingest(const nlohmann::json& event);
  void ingest_info(const nlohmann::json& run_json);

  // ---- what the panels read ----
  std::filesystem::path dir;
  std::string label;          // the run's name, or its directory's
  std::string error;          // why the run could not be read; "" = fine
  std::string waiting_for;    // live mode: what has not appeared yet ("" = nothing)
  std::vector<std::string> warnings;
  int64_t warnings_not_kept = 0;
  uint64_t version = 0;       // bumped whenever data changes; panels cache on it

  RunSummary summary;
  bool has_info = false;
  std::map<std::string, int64_t> events_by_type;
  int64_t events_total = 0;
  int64_t events_skipped = 0;
  int64_t bad_lines = 0;      // lines of events.jsonl that were not valid events: skipped, each warned about
  bool partial = false;       // run.json says "finished": false: the run was cut short (or is still running)
  int64_t alltoall_wrong_size = 0;  // alltoall matrices whose R is not run.json's world_size
  std::map<std::string, int64_t> values_beyond_plot;  // step metric -> values over kMaxPlotValue left out
  int64_t first_step = 0, last_step = -1;  // range of steps seen in any event
  std::map<std::string, int64_t> records_not_kept;  // event type -> events over max_records_per_kind
  size_t max_curve_points = kMaxCurvePoints;         // the bounds (tests make them small)
  size_t max_records_per_kind = kMaxRecordsPerKind;

  std::map<std::string, Series> step_metrics;  // metric name -> series
  std::map<int64_t, LayerRouting> routing;     // layer -> rows
  std::vector<TopologyRecord> topologies;
  std::vector<SpanRecord> spans;               // in file order
  std::vector<AllToAllRecord> alltoalls;
  std::vector<OffloadRecord> offloads;
  std::vector<TokensRecord> token_samples;
  std::vector<TableRecord> tables;
  std::vector<VerdictRecord> verdicts;

  bool has_steps() const { return last_step >= first_step; }
  int64_t num_experts() const;  // the widest routing row over all layers (0: no routing)
  // One routing statistic over steps for one layer: "max_over_mean", "coefficient_of_variation",
  // "dropped_fraction", "routing_entropy".
  Series routing_stat_series(int64_t layer, std::string_view stat) const;
  // The record closest at or before `step` (the first one when all are after), or nullptr.
  const TopologyRecord* topology_at(int64_t step, int64_t layer) const;
  const TokensRecord* tokens_at(int64_t step, int64_t layer) const;

  void warn(std::string message);
  void note_bad_line(const std::string& message);  // counts it in bad_lines and warns with it

 private:
  void note_step(int64_t step);
  bool keep_another(const std::string& type, size_t kept);  // false past max_records_per_kind
  int64_t routing_rows_ = 0;
  void ingest_or_throw(const nlohmann::json& event);
  std::unique_ptr<moe::RunReader> reader_;
};

}  // namespace moe::viewer
