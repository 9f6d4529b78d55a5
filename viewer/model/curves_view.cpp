// curves_view.cpp: metric order, sampling rate, shared step range, axis numbers (curves_view.h).
#include "curves_view.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

namespace moe::viewer {

std::vector<std::string> curve_metric_order(const std::vector<const RunModel*>& runs) {
  static const char* const kFirst[] = {"loss",     "val_loss",     "val_bits_per_byte", "lm_loss", "aux_loss",
                                       "z_loss",   "tokens_per_s", "mfu",               "step_ms", "grad_norm", "lr"};
  std::set<std::string> recorded;
  for (const RunModel* run : runs)
    for (const auto& [name, series] : run->step_metrics) recorded.insert(name);
  std::vector<std::string> order;
  for (const char* name : kFirst)
    if (recorded.erase(name)) order.push_back(name);
  order.insert(order.end(), recorded.begin(), recorded.end());  // std::set: by name
  return order;
}

double sample_spacing(const Series& series) {
  // A bucketed series no longer shows its rate in its gaps; it was noted before the bucketing.
  if (series.bucket_steps > 0) return series.recorded_spacing;
  // A program sets its recording rate at the start, so the first gaps tell it; looking at no more
  // than kGapsLooked keeps this cheap enough for every frame of a million-step run.
  constexpr size_t kGapsLooked = 1024;
  std::map<double, int> gaps;
  const size_t n = std::min(series.steps.size(), kGapsLooked + 1);
  for (size_t i = 1; i < n; ++i) ++gaps[series.steps[i] - series.steps[i - 1]];
  double best = 0;
  int best_count = 0;
  for (const auto& [gap, count] : gaps)
    if (count > best_count) best = gap, best_count = count;
  return best;
}

StepRange curve_step_range(const std::vector<const RunModel*>& runs) {
  StepRange r{INFINITY, -INFINITY};
  for (const RunModel* run : runs)
    for (const auto& [name, series] : run->step_metrics)
      if (!series.steps.empty()) {
        r.lo = std::min(r.lo, series.steps.front());
        r.hi = std::max(r.hi, series.steps.back());
      }
  if (!(r.hi >= r.lo)) return {};
  return r;
}

std::string compact_number(double value) {
  char text[32];
  const double magnitude = std::abs(value);
  if (!std::isfinite(value)) std::snprintf(text, sizeof text, "%g", value);
  else if (magnitude >= 1e9) std::snprintf(text, sizeof text, "%.3gG", value / 1e9);
  else if (magnitude >= 1e6) std::snprintf(text, sizeof text, "%.3gM", value / 1e6);
  else if (magnitude >= 1e4) std::snprintf(text, sizeof text, "%.3gk", value / 1e3);
  else std::snprintf(text, sizeof text, "%.4g", value);
  return text;
}

}  // namespace moe::viewer
