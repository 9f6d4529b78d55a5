// sim/validation.cpp: predictions of measured ep_bench rows (validation.h).
#include "sim/validation.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "parse_number.h"    // parse_integer
#include "sim/cost_model.h"  // CostModel
#include "sim/lm_step.h"     // predict_language_model_step
#include "sim/layer_step.h"  // issue_layer_step
#include "sim/simulate.h"    // simulate
#include "sim/step_load.h"   // top_k_shares, replicate_hot_experts, shadow_hot_experts
#include "sim/timeline.h"    // Timeline

namespace moe::sim {

namespace {

std::string size_text(double bytes) {
  const double mib = bytes / (1 << 20);
  return std::to_string(static_cast<int64_t>(std::llround(mib))) + " MiB";
}

// ep_bench's dispatch + combine: the layer's forward with identity experts, T_r = size / (K D 2).
// With the one-GPU row of the same size in the calibration, that row holds every pass but the
// network: the prediction swaps its two local exchanges and its count exchange for the cluster's.
// Without it, the passes come from the one-GPU layer's phases, scaled by tokens.
double dispatch_combine_us(const CostModel& model, const Calibration& calibration, double size_bytes) {
  const LayerSpec& layer = model.layer();
  const int64_t R = model.cluster().ranks();
  const double tokens = std::max(1.0, std::floor(size_bytes / static_cast<double>(layer.top_k * layer.model_dim * 2)));
  const std::vector<double> uniform(static_cast<size_t>(layer.experts), 1.0 / static_cast<double>(layer.experts));
  const StepLoad load = step_load_from_shares(uniform, R, tokens * static_cast<double>(layer.top_k));
  const double network = model.count_exchange_us() + model.all_to_all_us(load, 1.0, false) + model.all_to_all_us(load, 1.0, true);
  if (!calibration.dispatch_combine_one_gpu.time_us.empty()) {
    const CostModel one_gpu(calibration, Cluster{1, 1}, layer);
    const StepLoad local = step_load_from_shares(uniform, 1, tokens * static_cast<double>(layer.top_k));
    const double local_network = one_gpu.count_exchange_us() + 2 * one_gpu.all_to_all_us(local, 1.0, false);
    return calibration.dispatch_combine_one_gpu.at(size_bytes) - local_network + network;
  }
  return model.route_us(tokens) + model.permute_us(tokens) + model.combine_us(tokens) + network;
}

// The run's layer shape; files without one (older ep_bench output) ran ep_bench's default,
// T=16384 D=2048 H=8192 E=32 K=2 B=128, which is LayerSpec's default too.
LayerSpec layer_of(const nlohmann::json& run) {
  LayerSpec spec;
  if (!run.contains("layer")) return spec;
  const nlohmann::json& layer = run.at("layer");
  spec.tokens_per_rank = layer.at("tokens_per_rank").get<int64_t>();
  spec.model_dim = layer.at("model_dim").get<int64_t>();
  spec.hidden_dim = layer.at("hidden_dim").get<int64_t>();
  spec.experts = layer.at("experts").get<int64_t>();
  spec.top_k = layer.at("top_k").get<int64_t>();
  spec.block_size = layer.value("block_size", int64_t{128});
  return spec;
}

// The routing a training benchmark wrote for its timed step ("routing_tokens": per MoE block,
// [source rank][expert] slots), as a one-step trace whose layer b is MoE block b; empty without it.
RoutingTrace routing_of_benchmark(const nlohmann::json& run, const std::filesystem::path& path) {
  RoutingTrace trace;
  trace.source = path.string() + " (the timed step's routing)";
  if (!run.contains("routing_tokens") || !run["routing_tokens"].is_array()) return trace;
  int64_t block = 0;
  for (const nlohmann::json& sources : run["routing_tokens"]) {
    BlockLoad load;
    load.step = 1;
    load.layer = block++;
    load.sources = static_cast<int64_t>(sources.size());
    for (const nlohmann::json& experts : sources) {
      if (load.experts == 0) load.experts = static_cast<int64_t>(experts.size());
      if (static_cast<int64_t>(experts.size()) != load.experts) {
        throw std::invalid_argument(path.string() + ": routing_tokens of MoE block " + std::to_string(load.layer) +
                                    " has source ranks of different expert counts");
      }
      for (const nlohmann::json& count : experts) load.tokens.push_back(count.get<int64_t>());
    }
    trace.loads.push_back(std::move(load));
  }
  return trace;
}

bool is_placement_row(const std::string& variant) {
  for (const char* name : {"plain", "eplb1", "eplb2", "shadow", "shadow_step"}) {
    if (variant == std::string("ep_layer ") + name) return true;
  }
  return false;
}

std::string number_text(double x) {
  std::ostringstream out;
  out << x;
  return out.str();
}

// One step of the layer with ep_bench's placement `placement` (plain, eplb1, eplb2, shadow: the
// hottest expert stored on every rank, shadow_step: shadowing decided from the step's counts) under
// Zipf(zipf) routing (0: uniform).
double placement_row_us(const Calibration& calibration, const Cluster& cluster, LayerSpec layer, const std::string& placement,
                        double zipf) {
  const int64_t R = cluster.ranks(), E = layer.experts;
  std::vector<double> weights(static_cast<size_t>(E), 1.0);
  for (int64_t e = 0; e < E; ++e) weights[static_cast<size_t>(e)] = zipf > 0 ? std::pow(static_cast<double>(e + 1), -zipf) : 1.0;
  StepLoad load = step_load_from_shares(top_k_shares(weights, layer.top_k), R, static_cast<double>(layer.tokens_per_rank * layer.top_k));
  if (placement == "eplb1" || placement == "eplb2") replicate_hot_experts(load, placement == "eplb1" ? 1 : 2);
  if (placement == "shadow" && R > 1) {
    const int64_t hottest = std::max_element(load.rows_per_expert.begin(), load.rows_per_expert.end()) - load.rows_per_expert.begin();
    apply_placement(load, dist::contiguous_placement(E, static_cast<int>(R)).with_shadowed({hottest}));
  }
  if (placement == "shadow_step") shadow_hot_experts(load, layer.model_dim, layer.hidden_dim);
  const CostModel model(calibration, cluster, layer);
  Timeline timeline(R);
  issue_layer_step(timeline, model, load);
  return timeline.finish_step();
}

}  // namespace

std::vector<ValidationRow> validate_against_measurements(const Calibration& calibration,
                                                         const std::vector<std::filesystem::path>& files,
                                                         const RoutingTrace* model_routing) {
  std::vector<ValidationRow> rows;
  for (const std::filesystem::path& path : files) {
    const nlohmann::json json = read_json_file(path, "--validate");
    const std::vector<nlohmann::json> runs = ep_bench_runs(json);
    bool any = false;
    for (const auto& [name, run] : training_benchmarks(json)) {
      // The language model's step: predicted where the calibration holds the same model on one GPU
      // with as many tokens a GPU.
      const int64_t R = run.value("ranks", int64_t{1});
      const LanguageModelStep& one = calibration.language_model;
      if (!one.measured() || R < 1 || run.value("tokens_per_step", int64_t{0}) != one.tokens_per_rank * R) continue;
      const bool overlap = run.value("overlap", false);
      ValidationRow out;
      out.what = overlap ? "language model step, overlapped" : "language model step";
      out.ranks = R;
      out.file = path.filename().string();
      out.device_date = run.value("device", "") + ", " + run.value("date", "").substr(0, 10);
      out.measured_us = 1e3 * run.value("median_step_ms", 0.0);
      // A benchmark that wrote its timed step's routing is predicted with it; else the given trace.
      const RoutingTrace own = routing_of_benchmark(run, path);
      const RoutingTrace* routing = !own.loads.empty() ? &own : model_routing;
      try {
        out.predicted_us = 1e3 * predict_language_model_step(calibration, Cluster{1, R}, {.routing = routing, .overlap = overlap}).step_ms;
      } catch (const std::invalid_argument& error) {
        throw std::invalid_argument("--validate " + path.string() + ": " + error.what());
      }
      if (!own.loads.empty()) {
        out.what += " (its own routing)";
      } else if (model_routing != nullptr) {
        out.what += " (recorded routing)";
      }
      out.calibration = R == 1;
      out.held_out = R > calibration.gpus_measured;
      if (out.measured_us > 0) rows.push_back(out);
      any = true;
    }
    for (const nlohmann::json& run : runs) {
      if (run.value("benchmark", "") != "ep_bench" || !run.contains("rows")) continue;
      const int64_t R = run.value("ranks", int64_t{1});
      if (run.value("ranks_per_gpu", int64_t{1}) != 1) continue;  // ranks sharing a GPU: not a machine the model describes
      const std::string device_date = run.value("device", "") + ", " + run.value("date", "");
      Cluster cluster{1, R};
      for (const nlohmann::json& row : run["rows"]) {
        const std::string variant = row.value("variant", "");
        ValidationRow out;
        out.ranks = R;
        out.file = path.filename().string();
        out.device_date = device_date;
        out.measured_us = row.value("time_us", 0.0);
        out.held_out = R > calibration.gpus_measured;
        const double size = row.value("size_bytes", 0.0);
        LayerSpec layer = layer_of(run);
        const bool by_layout = variant.rfind("ep_layer r=", 0) == 0;  // Tutel's layouts (ep_bench --layouts)
        if (variant.rfind("ep_layer d=", 0) == 0 || by_layout) {
          // "ep_layer d=1 overlap": the step as two overlapped micro-batches (ep_bench --overlap)
          const std::string suffix = " overlap";
          layer.overlap = variant.ends_with(suffix);
          const std::optional<int64_t> n =
              parse_integer(variant.substr(11, variant.size() - 11 - (layer.overlap ? suffix.size() : 0)));
          if (!n) continue;
          (by_layout ? layer.layout : layer.chunks) = *n;
          SimulationSpec spec;
          spec.cluster = cluster;
          spec.layer = layer;
          spec.steps = 1;
          spec.span_ranks = 0;
          // A layer of the language model's shape is predicted from its own one-GPU measurement.
          const Calibration used = calibration.for_layer(layer.model_dim, layer.hidden_dim);
          const bool of_model = used.layer.model_dim != calibration.layer.model_dim || used.layer.hidden_dim != calibration.layer.hidden_dim;
          const double zipf = run.value("zipf", 0.0);
          out.what = variant + (zipf > 0 ? " zipf " + number_text(zipf) : "") + (of_model ? " (D=" + std::to_string(layer.model_dim) + ")" : "");
          // Under ep_bench --zipf the routing is skewed: the same step as the plain placement row's.
          out.predicted_us = zipf > 0 && !by_layout && !layer.overlap ? placement_row_us(used, cluster, layer, "plain", zipf)
                                                                      : simulate(spec, used).median_step_us();
          // The pipelined steps overlap_contention was fitted from (their phases) are calibration too.
          const bool source = std::find(calibration.sources.begin(), calibration.sources.end(), out.file) != calibration.sources.end();
          const bool contention_from_it = source && !by_layout && !layer.overlap && layer.chunks > 1 && R == used.overlap_contention.ranks;
          out.calibration = R == 1 || contention_from_it;
        } else if (is_placement_row(variant)) {
          // ep_bench --placements under --zipf S: the routing's expected counts (each token's K experts
          // drawn by Gumbel-max from Zipf(S), expert 0 the hottest), placed as the row placed them.
          const Calibration used = calibration.for_layer(layer.model_dim, layer.hidden_dim);
          const bool of_model = used.layer.model_dim != calibration.layer.model_dim || used.layer.hidden_dim != calibration.layer.hidden_dim;
          const double zipf = run.value("zipf", 0.0);
          out.what = variant + (zipf > 0 ? " zipf " + number_text(zipf) : "") +
                     (of_model ? " (D=" + std::to_string(layer.model_dim) + ")" : "");
          out.predicted_us = placement_row_us(used, cluster, layer, variant.substr(9), zipf);
          out.calibration = false;
        } else if (variant == "alltoall" && R > 1) {
          layer.experts = R;  // the raw all-to-all: equal bytes to every rank
          const CostModel model(calibration, cluster, layer);
          out.what = "alltoall " + size_text(size);
          out.predicted_us = model.uniform_all_to_all_us(size);
          out.calibration = std::any_of(calibration.all_to_all.begin(), calibration.all_to_all.end(),
                                        [&](const AllToAllCurve& c) { return c.ranks == R; });
        } else if (variant == "dispatch+combine") {
          const CostModel model(calibration, cluster, layer);
          out.what = "dispatch+combine " + size_text(size);
          out.predicted_us = dispatch_combine_us(model, calibration, size);
          out.calibration = R == 1 && !calibration.dispatch_combine_one_gpu.time_us.empty();
        } else {
          continue;
        }
        if (out.measured_us > 0) rows.push_back(out);
        any = true;
      }
    }
    if (!any) {
      throw std::invalid_argument("--validate " + path.string() + ": nothing to predict (ep_bench's ep_layer d=N, alltoall, dispatch+combine "
                                  "rows, or a training benchmark of the model the calibration holds)");
    }
  }
  return rows;
}

ValidationSummary summarize(const std::vector<ValidationRow>& rows) {
  ValidationSummary summary;
  std::vector<double> errors;
  for (const ValidationRow& row : rows) {
    if (row.calibration) continue;
    const double e = std::abs(row.error());
    errors.push_back(e);
    summary.max_abs_error = std::max(summary.max_abs_error, e);
    if (row.held_out) {
      ++summary.held_out_rows;
      summary.held_out_max_abs_error = std::max(summary.held_out_max_abs_error, e);
    }
  }
  summary.rows = static_cast<int64_t>(errors.size());
  if (!errors.empty()) {
    std::sort(errors.begin(), errors.end());
    summary.median_abs_error = errors[errors.size() / 2];
  }
  return summary;
}

}  // namespace moe::sim
