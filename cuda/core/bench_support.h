// bench_support.h: the small host-side pieces the benchmark programs share (moe_bench,
// offload_copy_bench, offload_bench, moe_generate): the median of timed samples, the UTC date a
// results file carries, and a flag's value read as a number, all of its text or nothing. Each
// program keeps its own flags, messages and exit codes; only these pieces are common.
// Header-only and free of CUDA, so a program includes it without linking anything more.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <exception>
#include <optional>
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

// The integer that the whole of `text` spells ("12", "-3"), or nothing: empty text, text that is
// not an integer, trailing characters ("12x") or a value beyond int64_t.
inline std::optional<int64_t> parse_integer(const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return value;
}

// The same for a floating-point number ("0.8", "1e-3").
inline std::optional<double> parse_number(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return value;
}

}  // namespace moe::cuda
