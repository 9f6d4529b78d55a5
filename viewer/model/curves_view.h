// curves_view.h: the training-curves panel's data, prepared apart from drawing: which metrics to
// plot in which order, how often a metric was sampled, the step range the plots share, and the
// short number format of the axis labels.
//
// A training run writes its metrics at different rates: loss every step, tokens/s and the gradient
// norm every 10, validation every 100 (lesson 08's moe_train). Each metric is its own Series of the
// steps it was written at, so a sparse one is a short series, never a long one full of gaps, and
// the plot joins its points with a line.
//   std::vector<std::string> order = curve_metric_order({&run_a, &run_b});
//   double spacing = sample_spacing(run_a.step_metrics.at("val_bits_per_byte"));  // 100
// Built into moe_viewer_model; tested by tests/viewer/test_views.cpp and test_real_runs.cpp.
#pragma once

#include <string>
#include <vector>

#include "run_model.h"  // RunModel, Series

namespace moe::viewer {

// The step metrics of the runs, the ones a reader looks at first at the top (loss, validation
// loss and bits per byte, the router's losses, throughput), then the rest by name. Only metrics
// some run records are listed.
std::vector<std::string> curve_metric_order(const std::vector<const RunModel*>& runs);

// The most common gap between neighbouring samples (1: every step, 100: one in a hundred) among
// the first 1024 gaps (or as noted before the series was cut into buckets); 0 with fewer than two
// samples. Cheap enough to call every frame.
double sample_spacing(const Series& series);

// The steps the curves of these runs span together: [lo, hi], lo > hi when none has a metric.
struct StepRange {
  double lo = 1, hi = 0;
};
StepRange curve_step_range(const std::vector<const RunModel*>& runs);

// A number in at most about 7 characters for an axis label: 4.47M, 312k, 1.418, 0.0123, 2e-05.
std::string compact_number(double value);

}  // namespace moe::viewer
