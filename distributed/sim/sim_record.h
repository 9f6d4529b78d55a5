// sim/sim_record.h: a simulated run as a run record (notebooks_data/README.md), so the viewer's
// timeline, routing and summary panels show it beside measured runs. run.json says it is simulated
// (extra.simulated = true, the calibration's file, device and date, the cluster and the routing);
// the viewer marks such a run SIMULATED. Per step: a routing event per MoE block (rows each expert
// computed), the spans of the ranks the simulation kept, and a step event with the step's time,
// compute, exposed communication and straggler.
//
//   SimulatedRunRecord record("runs/sim_64", spec, calibration_path, calibration, "moe_sim ...", false);
//   Simulation run = simulate(spec, calibration, [&](const SimulatedStep& s) { record.append(s); });
#pragma once

#include <filesystem>
#include <string>

#include "run_record.h"         // RunWriter
#include "sim/calibration.h"    // Calibration
#include "sim/simulate.h"       // SimulationSpec, SimulatedStep

namespace moe::sim {

class SimulatedRunRecord {
 public:
  // Refuses (std::invalid_argument naming --out) a directory that holds a run unless overwrite.
  SimulatedRunRecord(const std::filesystem::path& dir, const SimulationSpec& spec, const std::string& calibration_file,
                     const Calibration& calibration, const std::string& command, bool overwrite);
  void append(const SimulatedStep& step);
  const std::filesystem::path& dir() const { return writer_.dir(); }

 private:
  RunWriter writer_;
};

std::string describe_routing(const SimulationSpec& spec);  // "zipf:0.8" or "trace RUN_DIR"

}  // namespace moe::sim
