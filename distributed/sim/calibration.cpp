// sim/calibration.cpp: the calibration file and `moe_sim calibrate` (calibration.h).
#include "sim/calibration.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <set>
#include <stdexcept>

#include "parse_number.h"  // parse_integer

namespace moe::sim {

namespace {

constexpr const char* kFormat = "moe_sim calibration";

nlohmann::json curve_json(const Curve& curve) {
  return {{"bytes_per_rank", curve.bytes_per_rank}, {"time_us", curve.time_us}};
}

[[noreturn]] void refuse(const std::string& source, const std::string& what) {
  throw std::invalid_argument(source + ": " + what);
}

Curve curve_from(const nlohmann::json& json, const std::string& source, const std::string& field) {
  Curve curve;
  try {
    curve.bytes_per_rank = json.at("bytes_per_rank").get<std::vector<double>>();
    curve.time_us = json.at("time_us").get<std::vector<double>>();
  } catch (const nlohmann::json::exception&) {
    refuse(source, field + " needs bytes_per_rank and time_us, two lists of numbers");
  }
  if (curve.bytes_per_rank.size() != curve.time_us.size()) refuse(source, field + ": bytes_per_rank and time_us differ in length");
  for (size_t i = 0; i < curve.time_us.size(); ++i) {
    if (!(curve.bytes_per_rank[i] > 0) || !(curve.time_us[i] > 0)) refuse(source, field + ": sizes and times must be > 0");
    if (i > 0 && !(curve.bytes_per_rank[i] > curve.bytes_per_rank[i - 1])) refuse(source, field + ": sizes must ascend");
  }
  return curve;
}

// Sorts a curve's points by size (ep_bench writes them in its sweep's order).
Curve sorted(Curve curve) {
  std::vector<std::pair<double, double>> points;
  for (size_t i = 0; i < curve.time_us.size(); ++i) points.emplace_back(curve.bytes_per_rank[i], curve.time_us[i]);
  std::sort(points.begin(), points.end());
  Curve out;
  for (const auto& [bytes, us] : points) {
    out.bytes_per_rank.push_back(bytes);
    out.time_us.push_back(us);
  }
  return out;
}

nlohmann::json shape_json(const LayerShape& s) {
  return {{"tokens_per_rank", s.tokens_per_rank}, {"model_dim", s.model_dim}, {"hidden_dim", s.hidden_dim},
          {"experts", s.experts},                 {"top_k", s.top_k},         {"block_size", s.block_size}};
}

LayerShape shape_from(const nlohmann::json& j) {
  return {j.at("tokens_per_rank").get<int64_t>(), j.at("model_dim").get<int64_t>(), j.at("hidden_dim").get<int64_t>(),
          j.at("experts").get<int64_t>(),         j.at("top_k").get<int64_t>(),     j.value("block_size", int64_t{128})};
}

nlohmann::json contention_json(const OverlapContention& o) { return {{"sigma", o.sigma}, {"ranks", o.ranks}}; }

OverlapContention contention_from(const nlohmann::json& j) { return {j.at("sigma").get<double>(), j.at("ranks").get<int64_t>()}; }

nlohmann::json layer_json(const LayerCalibration& layer) {
  nlohmann::json steps = nlohmann::json::object(), phases = nlohmann::json::object();
  for (const auto& [d, us] : layer.step_us) steps[std::to_string(d)] = us;
  for (const auto& [d, by_name] : layer.phases_us) phases[std::to_string(d)] = by_name;
  nlohmann::json out = {{"shape", shape_json(layer.shape)}, {"step_us", steps}, {"phases_us", phases}};
  if (layer.overlap_contention.ranks > 0) out["overlap_contention"] = contention_json(layer.overlap_contention);
  return out;
}

LayerCalibration layer_from(const nlohmann::json& shape, const nlohmann::json& steps, const nlohmann::json& phases) {
  LayerCalibration layer{shape_from(shape), {}, {}, {}};
  for (const auto& [d, us] : steps.items()) layer.step_us[parse_integer(d).value_or(0)] = us.get<double>();
  for (const auto& [d, by_name] : phases.items()) layer.phases_us[parse_integer(d).value_or(0)] = by_name.get<std::map<std::string, double>>();
  return layer;
}

double phase(const LayerCalibration& layer, int64_t d, const char* name) {
  const auto at_d = layer.phases_us.find(d);
  if (at_d == layer.phases_us.end()) return -1;
  const auto it = at_d->second.find(name);
  return it == at_d->second.end() ? -1 : it->second;
}

// overlap_contention, sigma: with the layer pipelined in d chunks, 2 (d - 1) of each pass's 2 d
// chunk exchanges run beside a chunk's experts (every one but the first out and the last back), so
// (d - 1) / d of the step's exchange time X (ep_dispatch + ep_combine_exchange at d = 1) overlaps
// the experts. What the experts lose to it is their growth from d = 1 to d at R ranks, less their
// growth on one GPU (the chunks' own launch costs, already in the model):
//   sigma_d = [(E_R(d) - E_R(1)) - (E_1(d) - E_1(1))] / ((d - 1) / d X_R(1)),  E = ep_experts
// averaged over the d > 1 measured, at the smallest R >= 2 measured at the one-GPU layer's shape.
OverlapContention fit_overlap_contention(const LayerCalibration& one_gpu, const std::vector<std::pair<int64_t, LayerCalibration>>& layers) {
  std::optional<std::pair<int64_t, OverlapContention>> best;  // the smallest R that gives a figure
  for (const auto& [R, layer] : layers) {
    const LayerShape& s = layer.shape;
    const LayerShape& one = one_gpu.shape;
    if (s.tokens_per_rank != one.tokens_per_rank || s.model_dim != one.model_dim || s.hidden_dim != one.hidden_dim ||
        (s.experts != one.experts && s.experts != one.experts * R) || s.top_k != one.top_k || (best && best->first <= R)) {
      continue;  // another shape than the one-GPU layer's (its E spread over R, or E each), or a larger R than one fitted
    }
    const double exchange = phase(layer, 1, "ep_dispatch") + phase(layer, 1, "ep_combine_exchange");
    const double experts_1 = phase(layer, 1, "ep_experts"), one_gpu_1 = phase(one_gpu, 1, "ep_experts");
    if (exchange <= 0 || experts_1 <= 0 || one_gpu_1 <= 0) continue;
    double sum = 0;
    int n = 0;
    for (const auto& [d, phases] : layer.phases_us) {
      const double experts_d = phase(layer, d, "ep_experts"), one_gpu_d = phase(one_gpu, d, "ep_experts");
      if (d < 2 || experts_d <= 0 || one_gpu_d <= 0) continue;
      const double overlapped = static_cast<double>(d - 1) / static_cast<double>(d) * exchange;
      sum += ((experts_d - experts_1) - (one_gpu_d - one_gpu_1)) / overlapped;
      ++n;
    }
    if (n > 0) best = {R, OverlapContention{std::clamp(sum / n, 0.0, 2.0), R}};
  }
  return best ? best->second : OverlapContention{};
}

}  // namespace

double Curve::at(double bytes) const {
  if (time_us.empty()) throw std::logic_error("Curve::at: an empty curve");
  if (time_us.size() == 1 || bytes <= bytes_per_rank.front()) {
    // One point, or below the first: latency-bound (a single point scales as bandwidth above it).
    if (time_us.size() == 1 && bytes > bytes_per_rank.front()) return time_us.front() * bytes / bytes_per_rank.front();
    return time_us.front();
  }
  size_t i = 1;
  while (i + 1 < time_us.size() && bytes > bytes_per_rank[i]) ++i;
  const double x0 = bytes_per_rank[i - 1], x1 = bytes_per_rank[i], y0 = time_us[i - 1], y1 = time_us[i];
  return y0 + (y1 - y0) * (bytes - x0) / (x1 - x0);  // beyond the last point: the last segment's rate
}

Calibration Calibration::at_language_model_layer() const {
  if (!language_model.layer.measured()) throw std::invalid_argument("the calibration has no expert-parallel layer at the language model's shape");
  Calibration out = *this;
  out.layer = language_model.layer.shape;
  out.layer_step_us = language_model.layer.step_us;
  out.layer_phases_us = language_model.layer.phases_us;
  out.overlap_contention = language_model.layer.overlap_contention;
  return out;
}

Calibration Calibration::for_layer(int64_t model_dim, int64_t hidden_dim) const {
  const LayerShape& lm = language_model.layer.shape;
  const bool of_model = language_model.layer.measured() && lm.model_dim == model_dim && lm.hidden_dim == hidden_dim;
  return of_model ? at_language_model_layer() : *this;
}

Calibration Calibration::limited_to(int64_t max_ranks) const {
  Calibration out = *this;
  out.all_to_all.clear();
  for (const AllToAllCurve& c : all_to_all) {
    if (c.ranks <= max_ranks) out.all_to_all.push_back(c);
  }
  out.count_exchange_us.clear();
  for (const auto& [ranks, us] : count_exchange_us) {
    if (ranks <= max_ranks) out.count_exchange_us[ranks] = us;
  }
  if (overlap_contention.ranks > max_ranks) out.overlap_contention = {};
  if (language_model.layer.overlap_contention.ranks > max_ranks) out.language_model.layer.overlap_contention = {};
  out.gpus_measured = std::min(gpus_measured, max_ranks);
  return out;
}

nlohmann::json to_json(const Calibration& c) {
  nlohmann::json json;
  json["format"] = kFormat;
  json["version"] = kCalibrationVersion;
  json["device"] = c.device;
  json["date"] = c.date;
  json["gpus_measured"] = c.gpus_measured;
  json["made_by"] = c.made_by;
  json["sources"] = c.sources;
  const nlohmann::json layer = layer_json({c.layer, c.layer_step_us, c.layer_phases_us, c.overlap_contention});
  json["layer"] = layer["shape"];
  json["layer_step_us"] = layer["step_us"];
  json["layer_phases_us"] = layer["phases_us"];
  json["all_to_all"] = nlohmann::json::array();
  for (const AllToAllCurve& a : c.all_to_all) {
    nlohmann::json entry = curve_json(a.curve);
    entry["ranks"] = a.ranks;
    json["all_to_all"].push_back(entry);
  }
  nlohmann::json counts = nlohmann::json::object();
  for (const auto& [ranks, us] : c.count_exchange_us) counts[std::to_string(ranks)] = us;
  json["count_exchange_us"] = counts;
  if (!c.dispatch_combine_one_gpu.time_us.empty()) json["dispatch_combine_one_gpu"] = curve_json(c.dispatch_combine_one_gpu);
  json["device_copy_gbs"] = c.device_copy_gbs;
  json["host_to_device_gbs"] = c.host_to_device_gbs;
  json["intra_node_per_peer_us"] = c.intra_node_per_peer_us;
  if (c.overlap_contention.ranks > 0) json["overlap_contention"] = contention_json(c.overlap_contention);
  if (c.language_model.measured()) {
    json["language_model"] = {{"config", c.language_model.config}, {"step_ms", c.language_model.step_ms},
                              {"phase_ms", c.language_model.phase_ms}, {"tokens_per_rank", c.language_model.tokens_per_rank}};
    if (c.language_model.layer.measured()) json["language_model"]["layer"] = layer_json(c.language_model.layer);
    if (c.language_model.overlapped_step_ms > 0) json["language_model"]["overlapped_step_ms"] = c.language_model.overlapped_step_ms;
  }
  json["inter_node"] = {{"nic_gbs", c.inter_node.nic_gbs},         {"efficiency", c.inter_node.efficiency},
                        {"latency_us", c.inter_node.latency_us},   {"per_peer_us", c.inter_node.per_peer_us},
                        {"source", c.inter_node.source}};
  return json;
}

Calibration calibration_from_json(const nlohmann::json& json, const std::string& source) {
  if (!json.is_object() || json.value("format", "") != kFormat) refuse(source, "not a moe_sim calibration (its \"format\" is not \"moe_sim calibration\")");
  if (!json.contains("version") || !json["version"].is_number_integer() || json["version"].get<int64_t>() != kCalibrationVersion) {
    refuse(source, "calibration version " + (json.contains("version") ? json["version"].dump() : std::string("missing")) +
                       "; this moe_sim reads version " + std::to_string(kCalibrationVersion));
  }
  Calibration c;
  try {
    c.device = json.at("device").get<std::string>();
    c.date = json.at("date").get<std::string>();
    c.gpus_measured = json.at("gpus_measured").get<int64_t>();
    c.made_by = json.value("made_by", "");
    c.sources = json.value("sources", std::vector<std::string>{});
    const LayerCalibration layer = layer_from(json.at("layer"), json.at("layer_step_us"), json.at("layer_phases_us"));
    c.layer = layer.shape;
    c.layer_step_us = layer.step_us;
    c.layer_phases_us = layer.phases_us;
    for (const nlohmann::json& entry : json.at("all_to_all")) {
      c.all_to_all.push_back({entry.at("ranks").get<int64_t>(), curve_from(entry, source, "all_to_all")});
    }
    const nlohmann::json counts = json.value("count_exchange_us", nlohmann::json::object());
    for (const auto& [ranks, us] : counts.items()) {
      c.count_exchange_us[parse_integer(ranks).value_or(0)] = us.get<double>();
    }
    if (json.contains("dispatch_combine_one_gpu")) c.dispatch_combine_one_gpu = curve_from(json["dispatch_combine_one_gpu"], source, "dispatch_combine_one_gpu");
    c.device_copy_gbs = json.value("device_copy_gbs", 0.0);
    c.host_to_device_gbs = json.value("host_to_device_gbs", 0.0);
    c.intra_node_per_peer_us = json.value("intra_node_per_peer_us", 1.0);
    if (json.contains("overlap_contention")) c.overlap_contention = contention_from(json["overlap_contention"]);
    if (json.contains("language_model")) {
      const nlohmann::json& lm = json["language_model"];
      c.language_model = {lm.at("config"), lm.at("step_ms").get<double>(), lm.at("phase_ms").get<std::map<std::string, double>>(),
                          lm.at("tokens_per_rank").get<int64_t>(), {}};
      if (lm.contains("layer")) {
        const nlohmann::json& l = lm["layer"];
        c.language_model.layer = layer_from(l.at("shape"), l.at("step_us"), l.at("phases_us"));
        if (l.contains("overlap_contention")) c.language_model.layer.overlap_contention = contention_from(l["overlap_contention"]);
      }
      c.language_model.overlapped_step_ms = lm.value("overlapped_step_ms", 0.0);
    }
    const nlohmann::json& inter = json.at("inter_node");
    c.inter_node = {inter.at("nic_gbs").get<double>(), inter.at("efficiency").get<double>(),
                    inter.at("latency_us").get<double>(), inter.at("per_peer_us").get<double>(),
                    inter.value("source", "")};
  } catch (const nlohmann::json::exception& error) {
    refuse(source, std::string("a field is missing or of the wrong type: ") + error.what());
  }
  if (c.layer.tokens_per_rank < 1 || c.layer.model_dim < 1 || c.layer.hidden_dim < 1 || c.layer.experts < 1 ||
      c.layer.top_k < 1 || c.layer.block_size < 1) {
    refuse(source, "layer: T, D, H, E, K and B must be >= 1");
  }
  if (!c.layer_step_us.count(1) || !c.layer_phases_us.count(1)) refuse(source, "needs the layer's step on one GPU at d = 1 (layer_step_us[\"1\"], layer_phases_us[\"1\"])");
  if (c.all_to_all.empty()) refuse(source, "needs at least one all-to-all curve (R >= 2)");
  for (const AllToAllCurve& a : c.all_to_all) {
    if (a.ranks < 2 || a.curve.time_us.empty()) refuse(source, "all_to_all: each curve needs ranks >= 2 and at least one point");
  }
  if (!(c.inter_node.nic_gbs > 0) || !(c.inter_node.efficiency > 0) || c.inter_node.efficiency > 1 || c.inter_node.latency_us < 0 ||
      c.inter_node.per_peer_us < 0) {
    refuse(source, "inter_node: nic_gbs > 0, 0 < efficiency <= 1, latency_us and per_peer_us >= 0");
  }
  for (const OverlapContention& o : {c.overlap_contention, c.language_model.layer.overlap_contention}) {
    if (!(o.sigma >= 0 && o.sigma <= 2) || o.ranks < 0) refuse(source, "overlap_contention: sigma between 0 (free overlap) and 2, ranks >= 0");
  }
  if (c.language_model.overlapped_step_ms < 0) refuse(source, "language_model.overlapped_step_ms: > 0, or absent when not measured");
  std::sort(c.all_to_all.begin(), c.all_to_all.end(), [](const AllToAllCurve& a, const AllToAllCurve& b) { return a.ranks < b.ranks; });
  return c;
}

nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& flag) {
  const std::string where = flag.empty() ? path.string() : flag + " " + path.string();
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(where + ": cannot be read");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    refuse(where, std::string("not JSON: ") + error.what());
  }
}

std::vector<nlohmann::json> ep_bench_runs(const nlohmann::json& json) {
  if (json.contains("runs") && json["runs"].is_array()) return json["runs"].get<std::vector<nlohmann::json>>();
  return {json};
}

Calibration load_calibration(const std::filesystem::path& path) {
  return calibration_from_json(read_json_file(path, ""), path.string());
}

std::vector<std::pair<std::string, nlohmann::json>> training_benchmarks(const nlohmann::json& json) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  auto is_benchmark = [](const nlohmann::json& j) {
    return j.is_object() && j.contains("phase_ms") && j["phase_ms"].is_object() && j.contains("config") && j.contains("median_step_ms");
  };
  if (is_benchmark(json)) {
    out.emplace_back("", json);
  } else if (json.is_object()) {
    for (const auto& [name, member] : json.items()) {
      if (is_benchmark(member)) out.emplace_back(name, member);
    }
  }
  return out;
}

Calibration calibrate_from_ep_bench(const std::vector<std::filesystem::path>& files, const std::string& made_by) {
  Calibration c;
  c.made_by = made_by;
  std::map<int64_t, Curve> curves;  // [R]
  Curve dispatch_combine;
  std::vector<LayerCalibration> one_gpu_layers;  // each R = 1 layer run
  std::vector<std::pair<int64_t, LayerCalibration>> many_gpu_layers;  // (R, its layer) at R >= 2: overlap_contention
  double overlapped_step_ms = 0;  // the language model with two micro-batches overlapped, one GPU
  for (const std::filesystem::path& path : files) {
    const std::string source = path.string();
    const nlohmann::json json = read_json_file(path, "");
    const std::vector<nlohmann::json> runs = ep_bench_runs(json);
    bool used = false;
    for (const auto& [name, run] : training_benchmarks(json)) {  // the language model on one GPU
      if (run.value("ranks", int64_t{0}) != 1) continue;
      used = true;
      if (run.value("overlap", false)) {  // two micro-batches overlapped: what halving the batch costs
        overlapped_step_ms = run.value("median_step_ms", 0.0);
        continue;
      }
      const nlohmann::json& config = run.at("config");
      c.language_model = {config, run.value("median_step_ms", 0.0), run.at("phase_ms").get<std::map<std::string, double>>(),
                          config.value("batch", int64_t{0}) * config.value("seq_len", int64_t{0}), {}};
    }
    for (const nlohmann::json& run : runs) {
      bool run_used = false, layer_started = false;
      std::optional<LayerCalibration> pipelined;  // this run's layer at R >= 2
      if (run.value("benchmark", "") != "ep_bench" || !run.contains("rows")) continue;
      const int64_t R = run.value("ranks", int64_t{0});
      const std::string device = run.value("device", "");
      if (c.device.empty()) c.device = device;
      if (device != c.device) refuse(source, "measured on " + device + ", the other files on " + c.device + ": one calibration is one machine kind");
      c.date = std::max(c.date, run.value("date", std::string{}));
      for (const nlohmann::json& row : run["rows"]) {
        const std::string variant = row.value("variant", "");
        const double bytes = row.value("size_bytes", 0.0), us = row.value("time_us", 0.0);
        if (R == 1 && variant.rfind("ep_layer d=", 0) == 0) {
          const int64_t d = parse_integer(variant.substr(11)).value_or(0);
          if (d < 1) continue;
          if (!layer_started) one_gpu_layers.push_back({shape_from(run.at("layer")), {}, {}, {}});
          layer_started = true;
          LayerCalibration& layer = one_gpu_layers.back();
          layer.step_us[d] = us;
          std::map<std::string, double>& phases = layer.phases_us[d];
          phases.clear();
          const nlohmann::json timed = row.value("phases_rank0", nlohmann::json::object());
          for (const auto& [name, phase] : timed.items()) phases[name] = phase.value("median_us", 0.0);
          run_used = true;
        } else if (R >= 2 && variant.rfind("ep_layer d=", 0) == 0) {
          // The d rows (not "d=1 overlap") of a layer run at R ranks: its phases.
          const std::optional<int64_t> d = parse_integer(variant.substr(11));
          if (!d || *d < 1) continue;
          if (!pipelined) pipelined = LayerCalibration{shape_from(run.at("layer")), {}, {}, {}};
          pipelined->step_us[*d] = us;
          const nlohmann::json timed = row.value("phases_rank0", nlohmann::json::object());
          for (const auto& [name, phase] : timed.items()) pipelined->phases_us[*d][name] = phase.value("median_us", 0.0);
          run_used = true;
        } else if (R == 1 && variant == "dispatch+combine") {
          dispatch_combine.bytes_per_rank.push_back(bytes);
          dispatch_combine.time_us.push_back(us);
          run_used = true;
        } else if (R >= 2 && variant == "alltoall") {
          curves[R].bytes_per_rank.push_back(bytes);
          curves[R].time_us.push_back(us);
          run_used = true;
        } else if (R >= 2 && variant == "count_exchange") {
          c.count_exchange_us[R] = us;
          run_used = true;
        }
      }
      if (pipelined) many_gpu_layers.emplace_back(R, std::move(*pipelined));
      if (run_used) c.gpus_measured = std::max(c.gpus_measured, R);
      used = used || run_used;
    }
    if (!used) {
      refuse(source, "no ep_bench row moe_sim calibrates from (the layer's d rows, alltoall or count_exchange at R >= 2, "
                     "dispatch+combine at R = 1) and no training benchmark of one rank");
    }
    c.sources.push_back(path.filename().string());
  }
  if (overlapped_step_ms > 0 && !c.language_model.measured()) {
    throw std::invalid_argument("moe_sim calibrate: an overlapped language model step on one GPU (--overlap on) needs the plain one beside it");
  }
  c.language_model.overlapped_step_ms = overlapped_step_ms;
  // The R = 1 layers: the one at the language model's D and H (when there is a model) is its layer;
  // the first other one is the calibration's layer.
  for (const LayerCalibration& layer : one_gpu_layers) {
    const nlohmann::json& model = c.language_model.config;
    const bool of_model = c.language_model.measured() && layer.shape.model_dim == model.value("model_dim", int64_t{0}) &&
                          layer.shape.hidden_dim == model.value("expert_hidden_dim", int64_t{0});
    if (of_model) {
      c.language_model.layer = layer;
    } else if (c.layer_step_us.empty()) {
      c.layer = layer.shape;
      c.layer_step_us = layer.step_us;
      c.layer_phases_us = layer.phases_us;
    }
  }
  for (auto& [R, curve] : curves) c.all_to_all.push_back({R, sorted(curve)});
  if (!dispatch_combine.time_us.empty()) c.dispatch_combine_one_gpu = sorted(dispatch_combine);
  // What each further NVLink peer adds to a small all-to-all: the smallest sizes of the two
  // largest host sizes measured, when there are two.
  if (c.all_to_all.size() >= 2) {
    const AllToAllCurve& a = c.all_to_all[c.all_to_all.size() - 2];
    const AllToAllCurve& b = c.all_to_all.back();
    const double extra = (b.curve.time_us.front() - a.curve.time_us.front()) / static_cast<double>(b.ranks - a.ranks);
    if (extra > 0) c.intra_node_per_peer_us = extra;
  }
  c.overlap_contention = fit_overlap_contention({c.layer, c.layer_step_us, c.layer_phases_us, {}}, many_gpu_layers);
  if (c.language_model.layer.measured()) {
    c.language_model.layer.overlap_contention = fit_overlap_contention(c.language_model.layer, many_gpu_layers);
  }
  c.inter_node.source =
      "published, not measured here: 400 Gb/s NDR InfiniBand, one NIC a GPU (50 GB/s each way); DeepEP reports "
      "43-58 GB/s a GPU for its inter-node dispatch and combine over CX7 (efficiency 0.9 of the link); latency and "
      "per-peer cost are the model's assumptions, not measurements";
  if (c.layer_step_us.empty()) throw std::invalid_argument("moe_sim calibrate: no file holds the layer's step on one GPU (ep_bench at R = 1 with --only layer)");
  if (c.all_to_all.empty()) throw std::invalid_argument("moe_sim calibrate: no file holds the raw all-to-all at R >= 2 (ep_bench --only alltoall)");
  return c;
}

}  // namespace moe::sim
