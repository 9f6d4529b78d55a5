// moe_sim: replays a run's routing through a calibrated model of GPUs, NVLink and InfiniBand, to
// predict the expert-parallel layer's training step at 1 to 65536 GPUs, and checks itself against
// the runs that were measured. Plain C++: no GPU, runs anywhere (CI included).
//
//   # simulate: 100 steps of the layer on 128 nodes of 8 GPUs, Zipf routing, as a run record
//   build/distributed/sim/moe_sim --calibration notebooks_data/sim/calibration_h200x2_2026-11-28.json
//       --cluster nodes=128,gpus-per-node=8 --routing zipf:1.2 --steps 100 --out runs/sim_1024
//   # replay a recorded run's routing
//   build/distributed/sim/moe_sim --calibration FILE --cluster nodes=2,gpus-per-node=8
//       --trace notebooks_data/runs/train_throughput_preset_300steps --out runs/sim_trace
//   # make a calibration from ep_bench's JSON (cuda/scripts/gpu_suite.sh run calibrate does it)
//   build/distributed/sim/moe_sim --calibrate-from r1.json,r2.json --calibration-out calibration.json
//   # predict measured runs from the calibration alone (lesson 09's validation table)
//   build/distributed/sim/moe_sim --calibration FILE --validate notebooks_data/bench/ep_bench_scaling_nccl_h200x4_2026-11-26.json
//   # inference: replay a recorded offloaded-decoding run through the expert cache (cache_replay.h):
//   # recorded vs replayed hits and misses, predicted vs measured decode step; then the hit rate
//   # against cache size for its routing under LRU, LFU and Belady's optimal policy
//   build/distributed/sim/moe_sim --offload-trace notebooks_data/runs/offload_switch_pregated
//   build/distributed/sim/moe_sim --offload-trace notebooks_data/runs/offload_switch_on_demand --cache-slots 8,16,32 --policy belady
//   # the same with m_0's experts held on the GPU beside the cache (moe_generate --resident-blocks 0)
//   build/distributed/sim/moe_sim --offload-trace notebooks_data/runs/offload_switch_pregated --cache-slots 8,72 --resident-blocks 0
//
// The model: distributed/sim/cost_model.h. The lesson: lessons/09_simulator.md.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "command_line.h"   // CLI11 glue: parse_command_line, validators
#include "file_io.h"        // write_file_atomically
#include "parse_number.h"   // parse_integer_list
#include "program_exit.h"   // run_program, check_output_path
#include "sim/cache_replay.h"
#include "sim/calibration.h"
#include "sim/cluster.h"
#include "sim/routing_trace.h"
#include "sim/sim_record.h"
#include "sim/simulate.h"
#include "sim/validation.h"

namespace {

struct Options {
  std::string calibration, cluster = "ranks=2", trace, routing, layer = "16384,2048,8192,0,2", all_to_all = "flat";
  int64_t experts_per_rank = 8, chunks = 1, steps = 20, blocks = 1, span_ranks = 8, seed = 1, redundant_slots = 0, layout = 1;
  double capacity_factor = 0;
  bool overlap = false, overwrite = false, shadow_per_step = false;
  std::string out, json;
  std::string calibrate_from, calibration_out, validate;
  int64_t hold_out_above = 0;
  double device_copy_gbs = 4183, host_to_device_gbs = 55.1;
  // --offload-trace: inference, the expert cache's replay (run_offload_trace)
  std::string offload_trace, cache_slots, policy, resident_blocks;
};

std::vector<std::filesystem::path> paths_of(const std::string& list) {
  std::vector<std::filesystem::path> out;
  std::stringstream stream(list);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) out.emplace_back(item);
  }
  return out;
}

// Writes an output file whole or not at all (common/file_io.h); a failure names the file.
void write_json(const std::string& path, const nlohmann::json& json) { moe::write_file_atomically(path, json.dump(1) + "\n"); }

moe::sim::LayerSpec layer_of(const Options& o, int64_t ranks) {
  const std::vector<int64_t> shape = moe::parse_integer_list(o.layer).value();
  if (shape.size() != 5) throw std::invalid_argument("--layer " + o.layer + ": expected T,D,H,E,K (T a rank; E = 0: --experts-per-rank x R)");
  moe::sim::LayerSpec layer;
  layer.tokens_per_rank = shape[0];
  layer.model_dim = shape[1];
  layer.hidden_dim = shape[2];
  layer.experts = shape[3] == 0 ? o.experts_per_rank * ranks : shape[3];
  layer.top_k = shape[4];
  if (layer.tokens_per_rank < 1 || layer.model_dim < 1 || layer.hidden_dim < 1 || layer.experts < 1 || layer.top_k < 1 ||
      layer.top_k > layer.experts) {
    throw std::invalid_argument("--layer " + o.layer + ": expected T, D, H >= 1, E >= 0 and 1 <= K <= E");
  }
  layer.chunks = o.chunks;
  layer.capacity_factor = o.capacity_factor;
  layer.overlap = o.overlap;
  layer.redundant_slots = o.redundant_slots;
  layer.shadow_per_step = o.shadow_per_step;
  layer.layout = o.layout;
  layer.all_to_all = o.all_to_all == "2dh" ? moe::sim::AllToAllKind::hierarchical : moe::sim::AllToAllKind::flat;
  return layer;
}

int calibrate(const Options& o, const std::string& command) {
  moe::check_output_path("--calibration-out", o.calibration_out);
  moe::sim::Calibration calibration = moe::sim::calibrate_from_ep_bench(paths_of(o.calibrate_from), command);
  calibration.device_copy_gbs = o.device_copy_gbs;
  calibration.host_to_device_gbs = o.host_to_device_gbs;
  calibration.sources.push_back("device_copy_gbs " + std::to_string(o.device_copy_gbs) + ", host_to_device_gbs " +
                                std::to_string(o.host_to_device_gbs) +
                                ": --device-copy-gbs and --host-to-device-gbs (their defaults: H200, 2026-11-21, the anchor "
                                "table of notebooks_data/bench/README.md)");
  const std::filesystem::path parent = std::filesystem::path(o.calibration_out).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  write_json(o.calibration_out, moe::sim::to_json(calibration));
  std::printf("moe_sim: calibration of %s (%s, up to %lld GPUs) written to %s\n", calibration.device.c_str(),
              calibration.date.c_str(), static_cast<long long>(calibration.gpus_measured), o.calibration_out.c_str());
  return 0;
}

int validate(const Options& o) {
  moe::sim::Calibration calibration = moe::sim::load_calibration(o.calibration);
  if (o.hold_out_above > 0) calibration = calibration.limited_to(o.hold_out_above);
  // With --trace, the language model's rows take that run's routing (a record of the same model).
  std::optional<moe::sim::RoutingTrace> routing;
  if (!o.trace.empty()) routing = moe::sim::read_routing_trace(o.trace);
  const std::vector<moe::sim::ValidationRow> rows =
      moe::sim::validate_against_measurements(calibration, paths_of(o.validate), routing ? &*routing : nullptr);
  std::printf("# moe_sim validation: calibration %s (%s, %s, from up to %lld GPUs)\n", o.calibration.c_str(),
              calibration.device.c_str(), calibration.date.c_str(), static_cast<long long>(calibration.gpus_measured));
  std::printf("%-28s %3s %12s %12s %8s  %-10s %s\n", "#what", "R", "measured_us", "predicted_us", "error", "role", "measured in");
  nlohmann::json json_rows = nlohmann::json::array();
  for (const moe::sim::ValidationRow& row : rows) {
    const char* role = row.calibration ? "calibrated" : row.held_out ? "hold-out" : "predicted";
    std::printf(" %-27s %3lld %12.1f %12.1f %+7.1f%%  %-10s %s (%s)\n", row.what.c_str(), static_cast<long long>(row.ranks),
                row.measured_us, row.predicted_us, 100 * row.error(), role, row.file.c_str(), row.device_date.c_str());
    json_rows.push_back({{"what", row.what}, {"ranks", row.ranks}, {"measured_us", row.measured_us},
                         {"predicted_us", row.predicted_us}, {"error", row.error()}, {"role", role},
                         {"file", row.file}, {"measured_on", row.device_date}});
  }
  const moe::sim::ValidationSummary s = moe::sim::summarize(rows);
  std::printf("# %lld predicted rows: median |error| %.1f%%, max %.1f%%; %lld hold-out rows, max %.1f%%\n",
              static_cast<long long>(s.rows), 100 * s.median_abs_error, 100 * s.max_abs_error,
              static_cast<long long>(s.held_out_rows), 100 * s.held_out_max_abs_error);
  if (!o.json.empty()) {
    write_json(o.json, {{"calibration", o.calibration}, {"rows", json_rows},
                        {"median_abs_error", s.median_abs_error}, {"max_abs_error", s.max_abs_error},
                        {"hold_out_max_abs_error", s.held_out_max_abs_error}});
  }
  return 0;
}

int simulate(const Options& o, const std::string& command) {
  moe::sim::SimulationSpec spec;
  spec.cluster = moe::sim::parse_cluster(o.cluster);
  spec.layer = layer_of(o, spec.cluster.ranks());
  const moe::sim::Calibration calibration =
      moe::sim::load_calibration(o.calibration).for_layer(spec.layer.model_dim, spec.layer.hidden_dim);
  moe::sim::check_placement(spec.layer.experts, spec.cluster.ranks());
  spec.steps = o.steps;
  spec.blocks = o.blocks;
  spec.span_ranks = o.span_ranks;
  if (!o.trace.empty()) {
    spec.trace = moe::sim::read_routing_trace(o.trace);
  } else {
    spec.synthetic = moe::sim::parse_synthetic(o.routing.empty() ? "uniform" : o.routing);
    spec.synthetic.seed = static_cast<uint64_t>(o.seed);
  }
  const std::string routing_text = moe::sim::describe_routing(spec);
  std::optional<moe::sim::SimulatedRunRecord> record;
  if (!o.out.empty()) record.emplace(o.out, spec, o.calibration, calibration, command, o.overwrite);
  const moe::sim::Simulation result = moe::sim::simulate(spec, calibration, [&](const moe::sim::SimulatedStep& step) {
    if (record) record->append(step);
  });
  double straggler = 0;
  for (const moe::sim::SimulatedStep& s : result.steps) straggler = std::max(straggler, s.straggler);
  std::printf("moe_sim: %s, layer T=%lld a rank D=%lld H=%lld E=%lld K=%lld d=%lld, %s all-to-all%s%s, routing %s\n",
              moe::sim::describe(spec.cluster).c_str(), static_cast<long long>(spec.layer.tokens_per_rank),
              static_cast<long long>(spec.layer.model_dim), static_cast<long long>(spec.layer.hidden_dim),
              static_cast<long long>(spec.layer.experts), static_cast<long long>(spec.layer.top_k),
              static_cast<long long>(spec.layer.chunks), o.all_to_all.c_str(),
              (std::string(spec.layer.overlap ? ", two micro-batches overlapped" : "") +
               (spec.layer.redundant_slots > 0 ? ", " + std::to_string(spec.layer.redundant_slots) + " redundant expert slots a rank" : "") +
               (spec.layer.shadow_per_step ? ", hot experts shadowed each step (FasterMoE's bytes test)" : ""))
                  .c_str(),
              spec.layer.capacity_factor > 0 ? (", capacity factor " + std::to_string(spec.layer.capacity_factor)).c_str() : ", dropless",
              routing_text.c_str());
  std::printf("moe_sim: %lld steps: median step %.3f ms, exposed communication %.1f%% of it, worst straggler %.2fx the mean rows (calibration: %s, %s)\n",
              static_cast<long long>(result.steps.size()), result.median_step_us() / 1e3, 100 * result.median_exposed_share(),
              straggler, calibration.device.c_str(), calibration.date.c_str());
  if (record) std::printf("moe_sim: run record in %s (simulated)\n", o.out.c_str());
  if (!o.json.empty()) {
    write_json(o.json, {{"ranks", spec.cluster.ranks()}, {"nodes", spec.cluster.nodes}, {"gpus_per_node", spec.cluster.gpus_per_node},
                        {"median_step_us", result.median_step_us()}, {"median_exposed_share", result.median_exposed_share()},
                        {"worst_straggler", straggler}, {"routing", routing_text}});
  }
  return 0;
}

// ---- inference: a recorded offloaded-decoding run through the expert cache (cache_replay.h) ----

// "8,16,32" as slot counts of at least the trace's minimum; empty: the recorded run's own.
std::vector<int64_t> cache_sizes_of(const Options& o, const moe::sim::OffloadTrace& trace) {
  if (o.cache_slots.empty()) return {trace.cache_slots};
  const std::vector<int64_t> sizes = moe::parse_integer_list(o.cache_slots).value();
  for (const int64_t slots : sizes) {
    if (slots < trace.minimum_slots()) {
      throw std::invalid_argument("--cache-slots " + std::to_string(slots) + ": below the minimum of " +
                                  std::to_string(trace.minimum_slots()) + " slots for " + trace.source +
                                  " (one acquire there asks for that many experts at once)");
    }
  }
  return sizes;
}

int run_offload_trace(const Options& o) {
  const moe::sim::OffloadTrace trace = moe::sim::read_offload_trace(o.offload_trace);
  std::vector<moe::sim::ReplayPolicy> policies = {moe::sim::ReplayPolicy::lru, moe::sim::ReplayPolicy::lfu,
                                                  moe::sim::ReplayPolicy::next_use, moe::sim::ReplayPolicy::belady};
  if (!o.policy.empty()) {
    try {
      policies = {moe::sim::replay_policy_from_string(o.policy)};
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(std::string("--policy: ") + error.what());
    }
  }
  const std::vector<int64_t> sizes = cache_sizes_of(o, trace);
  const std::vector<int64_t> held =
      o.resident_blocks.empty() ? std::vector<int64_t>{} : moe::parse_integer_list(o.resident_blocks).value();

  // The recorded cache, replayed: the counts must agree, block by block.
  const moe::sim::CacheReplay exact = moe::sim::replay_recorded(trace);
  const std::string difference = moe::sim::first_difference(trace, exact);
  int64_t recorded_hits = 0, recorded_misses = 0, replayed_hits = 0, replayed_misses = 0;
  for (size_t s = 0; s < trace.steps.size(); ++s) {
    for (size_t j = 0; j < trace.steps[s].size(); ++j) {
      recorded_hits += trace.steps[s][j].hits, recorded_misses += trace.steps[s][j].misses;
      replayed_hits += exact.steps[s].blocks[j].hits, replayed_misses += exact.steps[s].blocks[j].misses;
    }
  }
  std::printf("moe_sim: %s: mode %s, %lld slots (%s), E=%lld, %lld MoE blocks, %lld steps (0 the prefill), %.1f MB an expert\n",
              trace.source.c_str(), trace.mode.c_str(), static_cast<long long>(trace.cache_slots), trace.policy.c_str(),
              static_cast<long long>(trace.experts), static_cast<long long>(trace.blocks()),
              static_cast<long long>(trace.steps.size()), static_cast<double>(trace.expert_bytes) / 1e6);
  std::printf("replay of the recorded cache: hits %lld recorded, %lld replayed; misses %lld recorded, %lld replayed: %s\n",
              static_cast<long long>(recorded_hits), static_cast<long long>(replayed_hits),
              static_cast<long long>(recorded_misses), static_cast<long long>(replayed_misses),
              difference.empty() ? "equal in every step and block" : ("DIFFERENT at " + difference).c_str());

  // The decode step: the copies priced at the record's own rate, then at the pinned bandwidth of
  // --calibration (or --host-to-device-gbs): what the copy engine reached here, and what it could.
  std::vector<std::pair<double, std::string>> rates;
  if (const double measured = moe::sim::measured_copy_gbs(trace); measured > 0) rates.emplace_back(measured, "the record's copies");
  if (!o.calibration.empty()) {
    rates.emplace_back(moe::sim::load_calibration(o.calibration).host_to_device_gbs, "--calibration's host_to_device_gbs");
  } else {
    rates.emplace_back(o.host_to_device_gbs, "--host-to-device-gbs");
  }
  for (const auto& [copy_gbs, rate_from] : rates) {
    const moe::sim::StepTimePrediction time = moe::sim::predict_step_times(trace, exact, copy_gbs);
    std::printf("decode step (median of %zu): measured %.3f ms, predicted %.3f ms (%+.1f%%), copies at %.1f GB/s (%s)\n",
                time.steps.size(), time.median_measured_us / 1e3, time.median_predicted_us / 1e3, 100 * time.error(),
                copy_gbs, rate_from.c_str());
  }

  // Hit rate against cache size, demand fetching only (no prefetch), over the decode steps, and
  // the decode step and tokens/s each gives: the record's compute with the replay's copies at the
  // first rate above.
  const double copy_gbs = rates.front().first;
  std::string held_text;
  for (const int64_t block : held) held_text += (held_text.empty() ? "" : ",") + std::to_string(block);
  std::printf("hit rate over the decode steps (the prefill fills the cache), demand fetching only%s; the decode step\n"
              "predicted from it (copies at %.1f GB/s) and tokens/s at batch %lld:\n%8s",
              held.empty() ? "" : (", MoE blocks " + held_text + " held on the GPU (their requests are hits)").c_str(),
              copy_gbs, static_cast<long long>(trace.batch), "slots");
  for (const moe::sim::ReplayPolicy policy : policies) std::printf(" %34s", moe::sim::to_string(policy).c_str());
  std::printf("\n");
  nlohmann::json rows = nlohmann::json::array();
  for (const int64_t slots : sizes) {
    std::printf("%8lld", static_cast<long long>(slots));
    for (const moe::sim::ReplayPolicy policy : policies) {
      moe::sim::CacheReplay run;
      try {
        run = moe::sim::replay(trace, slots, policy, /*prefetch=*/false, held);
      } catch (const std::invalid_argument& error) {
        throw std::invalid_argument(std::string("--resident-blocks: ") + error.what());
      }
      const double step_us = moe::sim::predict_step_times(trace, run, copy_gbs).median_predicted_us;
      const double tokens_per_second = step_us > 0 ? static_cast<double>(trace.batch) * 1e6 / step_us : 0.0;
      std::printf(" %6.1f%% %4lld miss %6.3f ms %6.0f tok/s", 100 * run.hit_rate(), static_cast<long long>(run.misses()),
                  step_us / 1e3, tokens_per_second);
      rows.push_back({{"slots", slots}, {"policy", moe::sim::to_string(policy)}, {"hit_rate", run.hit_rate()},
                      {"misses", run.misses()}, {"decode_step_us", step_us}, {"tokens_per_second", tokens_per_second}});
    }
    std::printf("\n");
  }
  if (!o.json.empty()) {
    write_json(o.json, {{"offload_trace", trace.source}, {"replay_equal", difference.empty()}, {"resident_blocks", held},
                        {"hit_rates", rows}});
  }
  return difference.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return moe::run_program("moe_sim", [&] {
    Options o;
    CLI::App app{"moe_sim: the expert-parallel layer's training step at 1 to 65536 GPUs, from a calibration measured on a few "
                 "(distributed/sim/cost_model.h; lessons/09_simulator.md)",
                 "moe_sim"};
    app.add_option("--calibration", o.calibration, "the machine's calibration JSON (moe_sim --calibrate-from)");
    app.add_option("--cluster", o.cluster, "nodes=N,gpus-per-node=G, or ranks=R for one node")->capture_default_str();
    app.add_option("--trace", o.trace, "a run record whose routing is replayed (its expert_load or routing events)");
    app.add_option("--routing", o.routing, "synthetic routing: uniform, zipf:S or drift:S:STEPS (default uniform)");
    app.add_option("--seed", o.seed, "which experts synthetic routing makes hot")->capture_default_str()->check(moe::whole_number(0));
    app.add_option("--layer", o.layer, "T,D,H,E,K: T tokens a rank; E = 0 means --experts-per-rank x R")
        ->capture_default_str()->check(moe::whole_number_list(0));
    app.add_option("--experts-per-rank", o.experts_per_rank, "experts a rank when --layer's E is 0")
        ->capture_default_str()->check(moe::whole_number(1, 1 << 20));
    app.add_option("--pipeline-chunks", o.chunks, "Tutel's pipelining degree d")->capture_default_str()->check(moe::whole_number(1, 64));
    app.add_option("--all-to-all", o.all_to_all, "flat or 2dh (Tutel's 2D hierarchical)")->capture_default_str()->check(moe::one_of({"flat", "2dh"}));
    app.add_flag("--overlap", o.overlap, "two micro-batches, one's exchanges under the other's compute");
    app.add_option("--layout", o.layout, "Tutel's layout r: 1 expert parallel, 0 every rank every expert, r > 1 experts sharded over r ranks")
        ->capture_default_str()->check(moe::whole_number(0, 1 << 20));
    app.add_option("--redundant-slots", o.redundant_slots, "spare expert slots a rank, filled with replicas of the hot experts (EPLB, common/expert_placement.h)")
        ->capture_default_str()->check(moe::whole_number(0, 1 << 20));
    app.add_flag("--shadow-per-step", o.shadow_per_step,
                 "FasterMoE's shadowing decided each step: the experts whose crossing rows outweigh their weights are "
                 "sent to every rank and computed there on each rank's own rows (the GPU layer's shadow_per_step)");
    app.add_option("--capacity-factor", o.capacity_factor, "0: dropless; else each expert keeps C = f T R K / E rows")
        ->capture_default_str()->check(moe::finite_number(0, 1e6));
    app.add_option("--steps", o.steps, "steps to simulate")->capture_default_str()->check(moe::whole_number(1, 1000000));
    app.add_option("--blocks", o.blocks, "MoE blocks a step (synthetic routing)")->capture_default_str()->check(moe::whole_number(1, 1024));
    app.add_option("--span-ranks", o.span_ranks, "ranks whose timelines the record keeps (and the busiest)")
        ->capture_default_str()->check(moe::whole_number(0, 1024));
    app.add_option("--out", o.out, "write the simulated run as a run record here (the viewer opens it)");
    app.add_flag("--overwrite", o.overwrite, "replace a run already in --out");
    app.add_option("--json", o.json, "also write the summary (or the validation table) as JSON here");
    app.add_option("--calibrate-from", o.calibrate_from, "ep_bench JSON files, comma-separated: write a calibration from them");
    app.add_option("--calibration-out", o.calibration_out, "where --calibrate-from writes the calibration");
    app.add_option("--device-copy-gbs", o.device_copy_gbs, "HBM copy bandwidth for the calibration (2DH's reorders)")
        ->capture_default_str()->check(moe::finite_number(1, 1e6));
    app.add_option("--host-to-device-gbs", o.host_to_device_gbs, "pinned host-to-device bandwidth for the calibration")
        ->capture_default_str()->check(moe::finite_number(1, 1e6));
    app.add_option("--validate", o.validate, "ep_bench JSON files, comma-separated: predict their rows and print the errors");
    app.add_option("--hold-out-above", o.hold_out_above, "with --validate: forget the calibration's figures above R ranks")
        ->check(moe::whole_number(1, 1 << 20));
    // Inference: the expert cache of offloaded decoding (cache_replay.h).
    app.add_option("--offload-trace", o.offload_trace,
                   "replay a recorded offloaded-decoding run (moe_generate --run-dir, offload_bench --record-dir): "
                   "recorded vs replayed hits and misses, predicted vs measured decode step (copies at the record's rate "
                   "and at --calibration's or --host-to-device-gbs's), hit rate against cache size");
    app.add_option("--cache-slots", o.cache_slots, "with --offload-trace: cache sizes N[,N...] for the hit-rate table "
                   "(default the recorded run's)")->check(moe::whole_number_list(1));
    app.add_option("--policy", o.policy, "with --offload-trace: lru, lfu, next_use or belady (default all four)");
    app.add_option("--resident-blocks", o.resident_blocks,
                   "with --offload-trace: MoE blocks N[,N...] held on the GPU beside the cache in the hit-rate table (as "
                   "moe_generate --resident-blocks): their requests are hits and never enter the cache")
        ->check(moe::whole_number_list(0));
    if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
    // Before the work, not after; an output is never one of the inputs (a trace, a calibration).
    const std::vector<moe::ProgramInput> inputs{{"--trace", o.trace}, {"--calibration", o.calibration},
                                                {"--offload-trace", o.offload_trace}};
    if (!o.json.empty()) moe::check_output_path("--json", o.json, inputs);
    if (!o.out.empty()) moe::check_output_path("--out", std::filesystem::path(o.out) / "run.json", inputs);
    if (!o.offload_trace.empty()) return run_offload_trace(o);
    if (!o.cache_slots.empty() || !o.policy.empty() || !o.resident_blocks.empty()) {
      throw std::invalid_argument("--cache-slots, --policy and --resident-blocks need --offload-trace RUN_DIR");
    }
    std::string command = "moe_sim";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
    if (!o.calibrate_from.empty()) {
      if (o.calibration_out.empty()) throw std::invalid_argument("--calibrate-from needs --calibration-out FILE");
      return calibrate(o, command);
    }
    if (o.calibration.empty()) throw std::invalid_argument("--calibration FILE is needed (or --calibrate-from to make one)");
    if (!o.trace.empty() && !o.routing.empty()) throw std::invalid_argument("--trace and --routing: give one routing, not both");
    if (!o.validate.empty()) return validate(o);
    return simulate(o, command);
  });
}
