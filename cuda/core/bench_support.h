// bench_support.h: the small host-side pieces the benchmark programs share (moe_bench,
// offload_copy_bench, offload_bench): the median of timed samples, the UTC date a results file
// carries, and writing that file. Their flags are read by common/command_line.h.
// Header-only and free of CUDA, so a program includes it without linking anything more.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "file_io.h"  // write_file_atomically

namespace moe::cuda {

// The median of `values` (the mean of the middle two for an even count); 0 when there are none.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The current time in UTC, written with strftime's `format` ("%Y-%m-%d", "%Y-%m-%dT%H:%M:%SZ").
inline std::string utc_now(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[64];
  std::strftime(text, sizeof text, format, &tm);
  return text;
}

// Writes a benchmark's results as indented JSON, whole or not at all (a full disk leaves the old
// file), and says where.
inline void write_results(const std::string& path, const nlohmann::json& results) {
  moe::write_file_atomically(path, results.dump(2) + "\n");
  std::printf("results written to %s\n", path.c_str());
}

}  // namespace moe::cuda
