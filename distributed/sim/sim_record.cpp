// sim/sim_record.cpp: a simulated run written as a run record (sim_record.h).
#include "sim/sim_record.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "moe_config.h"    // MoeConfig
#include "program_exit.h"  // check_output_path

namespace moe::sim {

namespace {

RunWriter create_writer(const std::filesystem::path& dir, const SimulationSpec& spec, const std::string& calibration_file,
                        const Calibration& calibration, const std::string& command, bool overwrite) {
  check_output_path("--out", dir / "run.json");
  if (std::filesystem::exists(dir / "run.json") && !overwrite) {
    throw std::invalid_argument("--out " + dir.string() + " holds a run already; add --overwrite to replace it");
  }
  const LayerSpec& layer = spec.layer;
  RunInfo info;
  info.kind = RunKind::train;
  info.name = dir.filename().string();
  info.moe_config = moe_config_of(layer);
  info.world_size = spec.cluster.ranks();
  info.devices.assign(1, "simulated: " + calibration.device + " x " + std::to_string(spec.cluster.ranks()));
  info.extra = {{"simulated", true},
                {"program", "moe_sim"},
                {"command", command},
                {"cluster", {{"nodes", spec.cluster.nodes}, {"gpus_per_node", spec.cluster.gpus_per_node}}},
                {"calibration", calibration_file},
                {"calibration_device", calibration.device},
                {"calibration_date", calibration.date},
                {"routing", describe_routing(spec)},
                {"pipeline_chunks", layer.chunks},
                {"all_to_all", layer.all_to_all == AllToAllKind::hierarchical ? "2dh" : "flat"},
                {"overlap", layer.overlap},
                {"spans_of_ranks", "ranks 0.." + std::to_string(std::min(spec.span_ranks, spec.cluster.ranks()) - 1) +
                                       " and each step's busiest rank"}};
  return RunWriter::create(dir, info, overwrite ? OnExisting::overwrite : OnExisting::refuse);
}

}  // namespace

std::string describe_routing(const SimulationSpec& spec) {
  return spec.trace ? "trace " + spec.trace->source : describe(spec.synthetic);
}

SimulatedRunRecord::SimulatedRunRecord(const std::filesystem::path& dir, const SimulationSpec& spec,
                                       const std::string& calibration_file, const Calibration& calibration,
                                       const std::string& command, bool overwrite)
    : writer_(create_writer(dir, spec, calibration_file, calibration, command, overwrite)) {}

void SimulatedRunRecord::append(const SimulatedStep& step) {
  for (size_t b = 0; b < step.rows_per_expert.size(); ++b) {
    RoutingEvent routing{.step = step.step, .layer = static_cast<int64_t>(b)};
    for (double rows : step.rows_per_expert[b]) routing.tokens_per_expert.push_back(static_cast<int64_t>(std::llround(rows)));
    writer_.append(to_event(routing));
  }
  for (const SimSpan& span : step.spans) {
    writer_.append(to_event(SpanEvent{.step = step.step, .rank = span.rank, .stream = span.stream,
                                      .stream_name = stream_name(span.stream), .name = span.name,
                                      .start_us = span.start_us, .duration_us = span.duration_us}));
  }
  writer_.append(step_event(step.step, {{"step_time_ms", step.step_us / 1e3},
                                        {"compute_ms", step.compute_us / 1e3},
                                        {"exposed_communication_ms", step.exposed_us / 1e3},
                                        {"exposed_communication_share", step.exposed_share},
                                        {"straggler", step.straggler}}));
}

}  // namespace moe::sim
