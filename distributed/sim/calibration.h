// sim/calibration.h: what moe_sim knows of a machine, measured on it: one JSON file per machine
// kind (notebooks_data/sim/calibration_<device>_<date>.json), made by `moe_sim calibrate` from
// ep_bench's JSON output, so that every number in it traces back to a benchmark run.
//
// What is measured (ep_bench, one NVLink host):
//   - the expert-parallel layer's step on ONE GPU (R = 1) at pipelining degrees d = 1, 2, 4, with
//     every phase's median: the cost of routing, permuting, combining, the experts' products at
//     T K / (E d) rows an expert, the router's backward, the experts' SGD, and what no phase names;
//   - the raw NCCL all-to-all's time against bytes a rank at R = 2 (and 4 where measured), and the
//     count exchange (a few hundred bytes: the latency of one small all-to-all);
//   - optionally dispatch + combine with identity experts on one GPU (the layer's passes around
//     the exchange, without a network) at a few sizes;
//   - how much an exchange slows the experts it runs beside (overlap_contention), from each layer
//     shape's phases at R = 2 and d = 1, 2, 4 against the same phases on one GPU.
// What cannot be measured on one host is published, and says where it comes from (inter_node).
//
// Tests: ctest -R SimCalibration. Format version 1; an unknown version is refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe::sim {

inline constexpr int64_t kCalibrationVersion = 1;

// time_us against bytes_per_rank, sizes ascending.
struct Curve {
  std::vector<double> bytes_per_rank;
  std::vector<double> time_us;
  // Linear between points; beyond the last, at the last segment's rate (bandwidth); below the
  // first, the first point's time (latency-bound).
  double at(double bytes) const;
};

struct AllToAllCurve {
  int64_t ranks = 2;  // measured at R ranks of one host
  Curve curve;
};

// The layer shape ep_bench measured on one GPU.
struct LayerShape {
  int64_t tokens_per_rank = 0;  // T
  int64_t model_dim = 0;        // D
  int64_t hidden_dim = 0;       // H
  int64_t experts = 0;          // E (on the one GPU)
  int64_t top_k = 0;            // K
  int64_t block_size = 128;     // B
};

// sigma: of the time an exchange's kernels run beside the experts' kernels on one GPU, the fraction
// the experts lose. 0: the two share the GPU for free (perfect overlap); 1: they take turns. Fitted
// by calibrate_from_ep_bench from the layer's pipelined steps at R = ranks (0: not measured, and
// sigma = 0), for each layer shape the calibration holds: it depends on the shape.
struct OverlapContention {
  double sigma = 0;
  int64_t ranks = 0;
};

// The expert-parallel layer's step on one GPU at one shape (ep_bench --only layer at R = 1).
struct LayerCalibration {
  LayerShape shape;
  std::map<int64_t, double> step_us;                          // [d]
  std::map<int64_t, std::map<std::string, double>> phases_us;  // [d][phase]
  OverlapContention overlap_contention;                       // from the same shape at R >= 2
  bool measured() const { return !step_us.empty(); }
};

// The language model's training step on one GPU (moe_train_distributed --benchmark-json at R = 1):
// its phases, from which lm_step.h predicts the step on R GPUs; and, when measured, the
// expert-parallel layer on one GPU at the model's MoE shape (on one rank the trainer runs the
// single-GPU MoE path instead, whose kernels differ).
struct LanguageModelStep {
  nlohmann::json config;                 // the run's settings (model_dim, num_layers, num_experts, ...)
  double step_ms = 0;                    // median
  std::map<std::string, double> phase_ms;
  int64_t tokens_per_rank = 0;           // batch x seq_len
  LayerCalibration layer;                // the expert-parallel layer at D, H, E, K of the model
  double overlapped_step_ms = 0;         // median with two micro-batches overlapped (--overlap on); 0: not measured
  bool measured() const { return step_ms > 0; }
};

// What one GPU's NIC gives an all-to-all between nodes, from published figures.
struct InterNode {
  double nic_gbs = 50.0;         // GB/s a GPU, each way: 400 Gb/s NDR InfiniBand, one NIC a GPU
  double efficiency = 0.9;       // of nic_gbs that an all-to-all reaches
  double latency_us = 10.0;      // one inter-node exchange, start to first byte
  double per_peer_us = 1.0;      // each further peer a rank sends to (message set-up, small messages)
  std::string source;
};

struct Calibration {
  std::string device;      // "NVIDIA H200"
  std::string date;        // of the measurements
  int64_t gpus_measured = 0;  // the most ranks any measurement used
  std::string made_by;     // the command that wrote the file
  std::vector<std::string> sources;  // the benchmark files

  LayerShape layer;
  std::map<int64_t, double> layer_step_us;                          // [d] -> the step on one GPU
  std::map<int64_t, std::map<std::string, double>> layer_phases_us;  // [d][phase] -> median
  std::vector<AllToAllCurve> all_to_all;                            // one host, R = 2, 4, ...
  std::map<int64_t, double> count_exchange_us;                      // [R] -> the small all-to-all
  Curve dispatch_combine_one_gpu;  // identity experts at R = 1 (empty: not measured)
  double device_copy_gbs = 0;      // HBM copy, read + write counted once (0: not measured)
  double host_to_device_gbs = 0;   // pinned (0: not measured)
  double intra_node_per_peer_us = 1.0;  // what each further NVLink peer adds to a small all-to-all
  OverlapContention overlap_contention;  // the layer's (at_language_model_layer: the model's layer's)
  InterNode inter_node;
  LanguageModelStep language_model;     // not measured: step_ms = 0

  // Drops every all-to-all and count-exchange figure measured at more than max_ranks: the
  // hold-out of the validation (calibrate on two GPUs, predict four).
  Calibration limited_to(int64_t max_ranks) const;
  // The same calibration with the language model's layer as the layer (lm_step.h).
  Calibration at_language_model_layer() const;
  // The calibration a layer of width D and expert width H is simulated with: the language model's
  // layer where it was measured at that D and H (its own one-GPU step, closer than one scaled from
  // another shape), else this one.
  Calibration for_layer(int64_t model_dim, int64_t hidden_dim) const;
};

nlohmann::json to_json(const Calibration& calibration);
// Throws std::invalid_argument naming `source` and the field: a file that is not a calibration,
// of another version, or without the layer step on one GPU or any all-to-all curve.
Calibration calibration_from_json(const nlohmann::json& json, const std::string& source);
Calibration load_calibration(const std::filesystem::path& path);

// `moe_sim calibrate`: a calibration from ep_bench's --out files. Each file holds one ep_bench run
// ({"rows": ...}) or several ({"runs": [...]}); runs at R = 1 give the layer (and dispatch +
// combine), runs at R > 1 the all-to-all curve and count exchange. A moe_train_distributed
// --benchmark-json file of one rank gives the language model's step. Throws std::invalid_argument
// naming the file when nothing usable is in it or when devices differ.
Calibration calibrate_from_ep_bench(const std::vector<std::filesystem::path>& files, const std::string& made_by);

// A JSON file whole; std::invalid_argument "WHERE: cannot be read" / "WHERE: not JSON: ..." where
// WHERE is `flag path` (or the path alone when flag is empty).
nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& flag);

// The ep_bench runs in a file: {"runs": [...]} holds several, any other object is one.
std::vector<nlohmann::json> ep_bench_runs(const nlohmann::json& json);

// The training benchmarks in a file: a moe_train(_distributed) --benchmark-json object, or an object
// whose members are such objects (several runs of one call). Each has "phase_ms" and "config".
std::vector<std::pair<std::string, nlohmann::json>> training_benchmarks(const nlohmann::json& json);

}  // namespace moe::sim
