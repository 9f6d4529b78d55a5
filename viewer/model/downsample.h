// downsample.h: the two reductions that keep large runs smooth, done once per data change, never
// per frame: curves reduced to min/max per pixel column, matrices reduced to bounded images.
//
// A curve of 10,000 steps drawn 600 pixels wide needs 600 columns, each with the lowest and the
// highest value that falls in it (so a spike never vanishes, as it would by plain subsampling).
// A step x expert heatmap of 10,000 x 64 becomes at most max_cols x max_rows cells, each the mean
// of the cells it covers, uploaded once as a texture.
//   auto columns = moe::viewer::downsample_min_max(series, 0, 9999, 600);
//   moe::viewer::Matrix small = moe::viewer::downsample_mean(big, 1024, 256);
// Built into moe_viewer_model; tested by tests/viewer/test_downsample.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "run_model.h"  // Series

namespace moe::viewer {

// One pixel column of a curve: the samples with step in [x_lo, x_hi).
struct CurveColumn {
  double x_lo = 0, x_hi = 0;  // the column's step range
  double min = 0, max = 0;    // lowest and highest finite value in it
  double first = 0, last = 0; // the values of its first and last samples (for the joining line)
  int64_t samples = 0;        // 0: the column is empty (draw nothing)
};

// Reduces the samples of `series` with step in [x_lo, x_hi] to `columns` columns. NaN values are
// skipped. columns <= 0 or an empty range gives an empty result.
std::vector<CurveColumn> downsample_min_max(const Series& series, double x_lo, double x_hi, int columns);

// The index of the sample whose step is closest to x (for hover values), or -1 when empty.
int64_t nearest_sample(const Series& series, double x);

// A dense row-major matrix of floats: rows x cols.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;  // [rows * cols]
  float at(int64_t r, int64_t c) const { return values[static_cast<size_t>(r * cols + c)]; }
};

// Each output cell is the mean of the input cells it covers; output is at most max_rows x max_cols
// (a dimension already within its bound is kept as is). NaN cells are left out of the means.
Matrix downsample_mean(const Matrix& input, int64_t max_rows, int64_t max_cols);

// Which input indices [first, last) output index i of a dimension of n reduced to m covers.
struct Bucket { int64_t first = 0, last = 0; };
Bucket bucket_range(int64_t n, int64_t m, int64_t i);

}  // namespace moe::viewer
