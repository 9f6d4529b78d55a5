// bench_support.h: the small host-side pieces the benchmark programs share (moe_bench,
// offload_copy_bench, offload_bench): the median of timed samples and the UTC date a results file
// carries. Their flags are read by common/command_line.h.
// Header-only and free of CUDA, so a program includes it without linking anything more.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <string>
#include <vector>

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

}  // namespace moe::cuda
