// fuzz_run_record.cpp: the libFuzzer target of the run-record reader, as the viewer uses it.
// Each input is a run: the bytes before the first form feed (0x0c, never JSON whitespace) are
// run.json, the rest events.jsonl; an input without a form feed is events.jsonl under a fixed,
// valid run.json. The input is read two ways, which must agree:
//   - from memory: parse_run_record + RunModel::from_text (the whole text at once);
//   - from a file: RunModel::load, the streaming reader (RunReader::poll_each), with a read block
//     of 1 to 64 bytes chosen by the input's length, so block edges cut lines everywhere.
// Then every curve is checked (steps increasing, values as long as steps), halved
// (halve_min_max keeps the extremes) and reduced to pixel columns. AddressSanitizer watches
// memory; a broken check aborts, which libFuzzer reports with the input.
//
//   CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DMOE_ENABLE_CUDA=OFF -DMOE_BUILD_FUZZERS=ON
//   cmake --build build-fuzz --target fuzz_run_record
//   tests/viewer/fuzz_seed_corpus.sh build-fuzz/fuzz_corpus        # seeds from notebooks_data/runs
//   build-fuzz/tests/viewer/fuzz_run_record -runs=1000000 -max_len=4096 build-fuzz/fuzz_corpus
// CTest runs it bounded (ViewerFuzzRunRecord, -runs=20000) where MOE_BUILD_FUZZERS is on.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "curves_view.h"  // curve_metric_order, sample_spacing, curve_step_range
#include "downsample.h"   // downsample_min_max, nearest_sample
#include "run_model.h"    // RunModel, halve_min_max

namespace {

using moe::viewer::RunModel;
using moe::viewer::Series;

constexpr std::string_view kFixedRunJson =
    R"({"schema_version":1,"kind":"train","name":"fuzz","start_time":"2026-11-22T00:00:00.000Z"})";

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_run_record: check failed: %s\n", what);
    std::abort();
  }
}

void check_series(const Series& series) {
  check(series.steps.size() == series.values.size(), "a series has as many values as steps");
  for (size_t i = 1; i < series.steps.size(); ++i) check(series.steps[i - 1] < series.steps[i], "steps increase");
}

// The extremes of a series survive halving, and it stays sorted and no longer.
void check_halving(const Series& series) {
  Series halved = series;
  moe::viewer::halve_min_max(halved);
  check_series(halved);
  check(halved.steps.size() <= series.steps.size(), "halving never adds points");
  double low = INFINITY, high = -INFINITY, halved_low = INFINITY, halved_high = -INFINITY;
  for (double v : series.values)
    if (!std::isnan(v)) low = std::min(low, v), high = std::max(high, v);
  for (double v : halved.values)
    if (!std::isnan(v)) halved_low = std::min(halved_low, v), halved_high = std::max(halved_high, v);
  check(low == halved_low && high == halved_high, "halving keeps the lowest and the highest value");
}

void exercise(const RunModel& model) {
  const std::vector<const RunModel*> runs{&model};
  moe::viewer::curve_metric_order(runs);
  const moe::viewer::StepRange range = moe::viewer::curve_step_range(runs);
  for (const auto& [name, series] : model.step_metrics) {
    check_series(series);
    check_halving(series);
    moe::viewer::sample_spacing(series);
    moe::viewer::nearest_sample(series, range.lo);
    const auto columns = moe::viewer::downsample_min_max(series, range.lo, range.hi, 7);
    for (size_t c = 1; c < columns.size(); ++c) check(columns[c - 1].x_lo <= columns[c].x_lo, "columns in step order");
  }
  for (const auto& [layer, routing] : model.routing)
    for (const char* stat : {"max_over_mean", "routing_entropy"})
      check_series(model.routing_stat_series(layer, stat));
}

// A file per process, on tmpfs where there is one: a million inputs write a million files.
const std::filesystem::path& run_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    std::filesystem::path d = base / ("fuzz_run_record_" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t feed = input.find('\f');
  const std::string_view run_json = feed == std::string_view::npos ? kFixedRunJson : input.substr(0, feed);
  const std::string_view events = feed == std::string_view::npos ? input : input.substr(feed + 1);

  const RunModel from_memory = RunModel::from_text(run_json, events, "fuzz");
  exercise(from_memory);

  std::ofstream(run_dir() / "run.json", std::ios::binary | std::ios::trunc).write(run_json.data(), static_cast<std::streamsize>(run_json.size()));
  std::ofstream(run_dir() / "events.jsonl", std::ios::binary | std::ios::trunc).write(events.data(), static_cast<std::streamsize>(events.size()));
  const RunModel streamed = RunModel::load(run_dir(), 1 + size % 64);
  exercise(streamed);

  // The two readers agree: both refuse, or both hold the same events and curves.
  check(from_memory.error.empty() == streamed.error.empty(), "memory and stream agree on refusing");
  if (from_memory.error.empty()) {
    check(from_memory.events_total == streamed.events_total, "memory and stream read as many events");
    check(from_memory.warnings.size() == streamed.warnings.size(), "memory and stream warn alike");
    check(from_memory.step_metrics.size() == streamed.step_metrics.size(), "memory and stream hold the same metrics");
    for (const auto& [name, series] : from_memory.step_metrics) {
      auto it = streamed.step_metrics.find(name);
      check(it != streamed.step_metrics.end() && it->second.steps == series.steps, "memory and stream hold the same steps");
    }
  }
  return 0;
}
