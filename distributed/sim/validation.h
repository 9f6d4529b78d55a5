// sim/validation.h: the simulator against what was measured. Each row of an ep_bench file (the
// layer's step at pipelining degree d, the raw all-to-all, dispatch + combine) and each training
// benchmark of the language model (moe_train_distributed --benchmark-json, lm_step.h) is predicted
// from the calibration alone and set beside the measurement.
//
// A row the calibration was made from is marked "calibration" (the one-GPU layer, the all-to-all
// curve's own points) and left out of the error summary. A row at more ranks than the calibration
// saw is a hold-out (calibrate on two GPUs, predict four).
//
// Tests: ctest -R SimValidation.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "sim/calibration.h"  // Calibration
#include "sim/routing_trace.h"  // RoutingTrace

namespace moe::sim {

struct ValidationRow {
  std::string what;     // "ep_layer d=1", "alltoall 64 MiB", "dispatch+combine 256 MiB"
  int64_t ranks = 1;
  std::string file;
  std::string device_date;  // of the measurement
  double measured_us = 0;
  double predicted_us = 0;
  bool calibration = false;  // the calibration was made from this row
  bool held_out = false;     // more ranks than the calibration saw
  double error() const { return (predicted_us - measured_us) / measured_us; }
};

// Throws std::invalid_argument naming a file that holds neither ep_bench rows nor a training
// benchmark.
// `model_routing`: the language model's own recorded routing for its rows (lm_step.h); else uniform.
std::vector<ValidationRow> validate_against_measurements(const Calibration& calibration,
                                                         const std::vector<std::filesystem::path>& files,
                                                         const RoutingTrace* model_routing = nullptr);

struct ValidationSummary {
  int64_t rows = 0;  // rows that count (not calibration)
  double median_abs_error = 0, max_abs_error = 0;
  int64_t held_out_rows = 0;
  double held_out_max_abs_error = 0;
};
ValidationSummary summarize(const std::vector<ValidationRow>& rows);

}  // namespace moe::sim
