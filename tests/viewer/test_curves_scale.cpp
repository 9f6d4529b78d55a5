// test_curves_scale.cpp: curves of million-step runs, without a window. Min/max pixel columns keep
// every column's extremes; a series past its bound is cut into buckets that keep a spike and,
// per column of whole buckets, the raw minimum and maximum; the streaming reader reads what the
// in-memory one reads; a followed record that outgrows every bound keeps memory bounded, and a
// record cut shorter or replaced stops the following with a message.
//   ctest --test-dir build -R ViewerCurvesScale --output-on-failure
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include "curves_view.h"  // sample_spacing
#include "downsample.h"   // downsample_min_max
#include "run_model.h"    // RunModel, Series, add_sample
#include "synthetic_run.h"
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

using testing::TempDir;

Series noisy_series(int64_t n, uint32_t seed) {
  Series s;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> noise(0.0, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    s.steps.push_back(static_cast<double>(i));
    s.values.push_back(noise(rng));
  }
  return s;
}

TEST(ViewerCurvesScale, ColumnsKeepEachColumnsMinimumAndMaximum) {
  Series raw = noisy_series(100'003, 1);
  raw.values[54'321] = 1e6;  // a spike at one step
  const int columns = 997;
  const double lo = 0, hi = static_cast<double>(raw.steps.size() - 1);
  const auto reduced = downsample_min_max(raw, lo, hi, columns);
  ASSERT_EQ(reduced.size(), static_cast<size_t>(columns));
  // Every column's extremes, computed the slow way: each sample into its column.
  std::vector<double> low(columns, INFINITY), high(columns, -INFINITY);
  const double width = (hi - lo) / columns;
  for (size_t i = 0; i < raw.steps.size(); ++i) {
    const int c = std::min(columns - 1, static_cast<int>((raw.steps[i] - lo) / width));
    low[c] = std::min(low[c], raw.values[i]);
    high[c] = std::max(high[c], raw.values[i]);
  }
  bool spike_seen = false;
  for (int c = 0; c < columns; ++c) {
    ASSERT_GT(reduced[c].samples, 0);
    EXPECT_EQ(reduced[c].min, low[c]) << "column " << c;
    EXPECT_EQ(reduced[c].max, high[c]) << "column " << c;
    if (c > 0) {
      EXPECT_GT(reduced[c].x_lo, reduced[c - 1].x_lo);
    }
    spike_seen |= reduced[c].max == 1e6;
  }
  EXPECT_TRUE(spike_seen);
}

TEST(ViewerCurvesScale, BucketsKeepASpikeAndEachColumnsExtremesAtBoundedMemory) {
  const Series raw = [] {
    Series s = noisy_series(1'000'000, 2);
    s.values[777'777] = 50;    // a spike
    s.values[123'457] = -50;   // a dip
    s.values[500'000] = NAN;   // a step the run wrote null
    return s;
  }();
  Series kept;
  const size_t max_points = 4096;
  for (size_t i = 0; i < raw.steps.size(); ++i) {
    add_sample(kept, raw.steps[i], raw.values[i], max_points);
    ASSERT_LE(kept.steps.size(), max_points);
  }
  ASSERT_GT(kept.bucket_steps, 0);
  EXPECT_EQ(std::exp2(std::round(std::log2(kept.bucket_steps))), kept.bucket_steps) << "a power of two";
  EXPECT_EQ(kept.recorded_spacing, 1);
  EXPECT_EQ(sample_spacing(kept), 1) << "the recording rate survives the bucketing";
  for (size_t i = 1; i < kept.steps.size(); ++i) ASSERT_LT(kept.steps[i - 1], kept.steps[i]);
  // The spike and the dip are kept at their own steps.
  auto at = [&](double step) {
    auto it = std::lower_bound(kept.steps.begin(), kept.steps.end(), step);
    return it != kept.steps.end() && *it == step ? kept.values[static_cast<size_t>(it - kept.steps.begin())] : NAN;
  };
  EXPECT_EQ(at(777'777), 50);
  EXPECT_EQ(at(123'457), -50);
  // One resolution over the whole run: every bucket holds a point, the first as the last.
  const double width = kept.bucket_steps;
  const int64_t buckets = static_cast<int64_t>(std::ceil(1e6 / width));
  std::vector<int> points(static_cast<size_t>(buckets), 0);
  for (double s : kept.steps) ++points[static_cast<size_t>(s / width)];
  for (int64_t b = 0; b < buckets; ++b) ASSERT_GE(points[b], 1) << "bucket " << b;
  // Columns of whole buckets (two each) show exactly the raw minimum and maximum.
  const double hi = 1 << 20;  // a multiple of the bucket width past the last step
  const int columns = static_cast<int>(hi / (2 * width));
  const auto from_kept = downsample_min_max(kept, 0, hi, columns);
  const auto from_raw = downsample_min_max(raw, 0, hi, columns);
  ASSERT_EQ(from_kept.size(), from_raw.size());
  for (int c = 0; c < columns; ++c) {
    ASSERT_EQ(from_kept[c].samples > 0, from_raw[c].samples > 0) << "column " << c;
    if (!from_raw[c].samples) continue;
    EXPECT_EQ(from_kept[c].min, from_raw[c].min) << "column " << c;
    EXPECT_EQ(from_kept[c].max, from_raw[c].max) << "column " << c;
  }
}

TEST(ViewerCurvesScale, StreamingReadHoldsWhatTheWholeTextHolds) {
  TempDir dir;
  write_synthetic_run(dir.path() / "run", {.steps = 300, .experts = 8, .layers = 2, .ranks = 2});
  const std::string run_json = testing::read_text(dir.path() / "run" / "run.json");
  const std::string events = testing::read_text(dir.path() / "run" / "events.jsonl");
  const RunModel whole = RunModel::from_text(run_json, events);
  ASSERT_EQ(whole.error, "");
  for (uint64_t block : {uint64_t{1}, uint64_t{7}, uint64_t{4096}, uint64_t{4} << 20}) {
    const RunModel streamed = RunModel::load(dir.path() / "run", block);
    ASSERT_EQ(streamed.error, "") << "block " << block;
    EXPECT_EQ(streamed.events_total, whole.events_total) << "block " << block;
    EXPECT_EQ(streamed.events_by_type, whole.events_by_type) << "block " << block;
    ASSERT_EQ(streamed.step_metrics.size(), whole.step_metrics.size());
    for (const auto& [name, series] : whole.step_metrics) {
      EXPECT_EQ(streamed.step_metrics.at(name).steps, series.steps) << name;
      EXPECT_EQ(streamed.step_metrics.at(name).values, series.values) << name;
    }
    EXPECT_EQ(streamed.spans.size(), whole.spans.size());
  }
  // A last line without its newline: read with a warning, as the whole-text reader does.
  testing::write_text(dir.path() / "cut" / "run.json", testing::kRunJson);
  testing::write_text(dir.path() / "cut" / "events.jsonl", "{\"type\":\"step\",\"step\":0,\"loss\":3}\n{\"type\":\"step\",\"step\":1,\"loss\":2}");
  const RunModel cut = RunModel::load(dir.path() / "cut", 5);
  EXPECT_EQ(cut.error, "");
  EXPECT_EQ(cut.step_metrics.at("loss").steps.size(), 2u);
  ASSERT_EQ(cut.warnings.size(), 1u);
  EXPECT_NE(cut.warnings[0].find("no newline"), std::string::npos) << cut.warnings[0];
}

// Appends `count` step events from `first_step` on, and a span event every 100 steps.
void append_steps(const std::filesystem::path& events, int64_t first_step, int64_t count) {
  std::ofstream out(events, std::ios::app);
  for (int64_t s = first_step; s < first_step + count; ++s) {
    out << "{\"type\":\"step\",\"step\":" << s << ",\"loss\":" << (s == 4321 ? 99.0 : 1.0 + 1.0 / (1 + s)) << "}\n";
    if (s % 100 == 0)
      out << "{\"type\":\"span\",\"step\":" << s << ",\"rank\":0,\"stream\":0,\"name\":\"forward\",\"start_us\":0,\"duration_us\":5}\n";
  }
}

TEST(ViewerCurvesScale, FollowedRecordThatOutgrowsItsBoundsKeepsMemoryBounded) {
  TempDir dir;
  const auto run = dir.path() / "growing";
  RunModel m = RunModel::follow(run);
  m.max_curve_points = 1024;      // the bounds of a million-step run, scaled down
  m.max_records_per_kind = 50;
  testing::write_text(run / "run.json", testing::kRunJson);
  int64_t written = 0;
  for (int round = 0; round < 10; ++round) {
    append_steps(run / "events.jsonl", written, 5000);
    written += 5000;
    // Each poll reads at most 16 KiB: several polls catch up, each a bounded piece of work.
    int polls = 0;
    do {
      m.poll(16 << 10);
      ++polls;
      ASSERT_EQ(m.error, "");
    } while (!m.caught_up());
    EXPECT_GT(polls, 1) << "a round of 5000 steps is more than one poll's share";
    EXPECT_EQ(m.last_step, written - 1);
    ASSERT_LE(m.step_metrics.at("loss").steps.size(), 1024u);
    ASSERT_LE(m.spans.size(), 50u);
  }
  const Series& loss = m.step_metrics.at("loss");
  EXPECT_EQ(*std::max_element(loss.values.begin(), loss.values.end()), 99.0) << "the spike at step 4321 is kept";
  EXPECT_EQ(m.records_not_kept.at("span"), written / 100 - 50);
  EXPECT_EQ(m.events_by_type.at("span"), written / 100) << "counted, all of them";
  bool warned = false;
  for (const std::string& w : m.warnings) warned |= w.find("span events") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST(ViewerCurvesScale, FollowedRecordCutOrReplacedStopsWithAMessage) {
  TempDir dir;
  for (const char* change : {"cut", "replaced"}) {
    const auto run = dir.path() / change;
    testing::write_text(run / "run.json", testing::kRunJson);
    append_steps(run / "events.jsonl", 0, 100);
    RunModel m = RunModel::follow(run);
    ASSERT_EQ(m.error, "");
    ASSERT_EQ(m.last_step, 99);
    if (std::string(change) == "cut") {
      std::filesystem::resize_file(run / "events.jsonl", 100);
    } else {
      // Another file of more lines moved over the followed one (a run started again under the same name).
      append_steps(run / "new_events.jsonl", 0, 200);
      std::filesystem::rename(run / "new_events.jsonl", run / "events.jsonl");
    }
    m.poll();
    EXPECT_NE(m.error.find(std::string(change) == "cut" ? "shrank" : "replaced"), std::string::npos) << m.error;
    EXPECT_FALSE(m.live());
    EXPECT_EQ(m.last_step, 99) << "what was read stays";
  }
}

}  // namespace
}  // namespace moe::viewer
