// downsample.cpp: min/max curve columns and mean-reduced matrices (downsample.h).
#include "downsample.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moe::viewer {

std::vector<CurveColumn> downsample_min_max(const Series& series, double x_lo, double x_hi, int columns) {
  std::vector<CurveColumn> out;
  if (columns <= 0 || !(x_hi >= x_lo) || !std::isfinite(x_lo) || !std::isfinite(x_hi)) return out;
  const size_t n = std::min(series.steps.size(), series.values.size());
  out.resize(static_cast<size_t>(columns));
  const double width = (x_hi - x_lo) / columns;
  for (int c = 0; c < columns; ++c) {
    out[c].x_lo = x_lo + width * c;
    out[c].x_hi = x_lo + width * (c + 1);
  }
  // The samples are sorted by step: walk only those inside the range.
  auto begin = std::lower_bound(series.steps.begin(), series.steps.begin() + static_cast<std::ptrdiff_t>(n), x_lo);
  for (size_t i = static_cast<size_t>(begin - series.steps.begin()); i < n; ++i) {
    const double x = series.steps[i];
    if (x > x_hi) break;
    const double v = series.values[i];
    if (!std::isfinite(v)) continue;
    int c = width > 0 ? static_cast<int>((x - x_lo) / width) : 0;
    c = std::clamp(c, 0, columns - 1);
    CurveColumn& col = out[static_cast<size_t>(c)];
    if (col.samples == 0) {
      col.min = col.max = col.first = v;
    } else {
      col.min = std::min(col.min, v);
      col.max = std::max(col.max, v);
    }
    col.last = v;
    ++col.samples;
  }
  return out;
}

int64_t nearest_sample(const Series& series, double x) {
  const size_t n = std::min(series.steps.size(), series.values.size());
  if (n == 0) return -1;
  auto end = series.steps.begin() + static_cast<std::ptrdiff_t>(n);
  auto it = std::lower_bound(series.steps.begin(), end, x);
  if (it == end) return static_cast<int64_t>(n - 1);
  if (it == series.steps.begin()) return 0;
  auto before = it - 1;
  return (x - *before <= *it - x) ? before - series.steps.begin() : it - series.steps.begin();
}

Bucket bucket_range(int64_t n, int64_t m, int64_t i) {
  if (m <= 0 || n <= 0) return {};
  // Integer split so the buckets tile [0, n) exactly with sizes differing by at most one.
  return {i * n / m, (i + 1) * n / m};
}

Matrix downsample_mean(const Matrix& input, int64_t max_rows, int64_t max_cols) {
  Matrix out;
  if (input.rows <= 0 || input.cols <= 0 || max_rows <= 0 || max_cols <= 0 ||
      input.values.size() != static_cast<size_t>(input.rows * input.cols))
    return out;
  out.rows = std::min(input.rows, max_rows);
  out.cols = std::min(input.cols, max_cols);
  out.values.assign(static_cast<size_t>(out.rows * out.cols), 0.0f);
  for (int64_t r = 0; r < out.rows; ++r) {
    const Bucket rb = bucket_range(input.rows, out.rows, r);
    for (int64_t c = 0; c < out.cols; ++c) {
      const Bucket cb = bucket_range(input.cols, out.cols, c);
      double sum = 0;
      int64_t count = 0;
      for (int64_t ir = rb.first; ir < rb.last; ++ir)
        for (int64_t ic = cb.first; ic < cb.last; ++ic) {
          const float v = input.at(ir, ic);
          if (std::isnan(v)) continue;
          sum += v;
          ++count;
        }
      out.values[static_cast<size_t>(r * out.cols + c)] =
          count ? static_cast<float>(sum / count) : std::numeric_limits<float>::quiet_NaN();
    }
  }
  return out;
}

}  // namespace moe::viewer
