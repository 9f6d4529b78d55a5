// test_views.cpp: the panels' data preparation, without a window: downsampling, colours, routing
// heatmaps and bars, topology picture, timeline merging, all-to-all bandwidth, offload counters,
// and the preparation time of a 10,000 x 64 x 8 run.   ctest --test-dir build -R ViewerViews
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "colormap.h"
#include "comm_view.h"
#include "curves_view.h"
#include "downsample.h"
#include "routing_view.h"
#include "run_model.h"
#include "run_events.h"
#include "topology_view.h"
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

TEST(ViewerViews, MinMaxColumnsKeepASpike) {
  Series s;
  for (int i = 0; i < 10000; ++i) {
    s.steps.push_back(i);
    s.values.push_back(i == 4321 ? 100.0 : 1.0);
  }
  const auto columns = downsample_min_max(s, 0, 9999, 100);
  ASSERT_EQ(columns.size(), 100u);
  double highest = 0;
  int64_t samples = 0;
  for (const CurveColumn& c : columns) {
    highest = std::max(highest, c.max);
    samples += c.samples;
    EXPECT_EQ(c.min, 1.0);
  }
  EXPECT_EQ(highest, 100.0);  // plain subsampling would lose it 99 times in 100
  EXPECT_EQ(samples, 10000);
  EXPECT_EQ(columns[43].max, 100.0);  // step 4321 falls in column 43 of 100
  EXPECT_EQ(nearest_sample(s, 4320.6), 4321);
  EXPECT_TRUE(downsample_min_max(s, 10, 0, 10).empty());
}

TEST(ViewerViews, BucketsTileExactlyAndMeansAreMeans) {
  int64_t covered = 0;
  for (int64_t i = 0; i < 7; ++i) {
    const Bucket b = bucket_range(100, 7, i);
    EXPECT_EQ(b.first, covered);
    covered = b.last;
  }
  EXPECT_EQ(covered, 100);
  Matrix m{2, 4, {1, 2, 3, 4, 5, 6, 7, 8}};
  Matrix small = downsample_mean(m, 1, 2);
  ASSERT_EQ(small.rows, 1);
  ASSERT_EQ(small.cols, 2);
  EXPECT_FLOAT_EQ(small.at(0, 0), (1 + 2 + 5 + 6) / 4.0f);
  EXPECT_FLOAT_EQ(small.at(0, 1), (3 + 4 + 7 + 8) / 4.0f);
}

TEST(ViewerViews, ColoursAreTheStopsAtTheStops) {
  EXPECT_EQ(load_color(0.0f), kLoadStops[0]);
  EXPECT_EQ(load_color(0.5f), kLoadStops[2]);
  EXPECT_EQ(load_color(1.0f), kLoadStops[4]);
  EXPECT_EQ(load_color(7.0f), kLoadStops[4]);  // clamped
  EXPECT_EQ(load_color(NAN), kNoDataColor);
  EXPECT_NE(expert_color(3), expert_color(4));
  Image image = colorize(Matrix{1, 2, {0.0f, 2.0f}}, 0.0f, 2.0f);
  ASSERT_EQ(image.rgba.size(), 8u);
  EXPECT_EQ(image.rgba[0], kLoadStops[0].r);
  EXPECT_EQ(image.rgba[4], kLoadStops[4].r);
}

RunModel HotExpertRun(int64_t steps, int64_t E, int64_t hot, int64_t layers) {
  RunModel m;
  for (int64_t layer = 0; layer < layers; ++layer)
    for (int64_t step = 0; step < steps; ++step) {
      std::vector<int64_t> tokens(static_cast<size_t>(E), 0);
      tokens[static_cast<size_t>(hot)] = 100;
      m.ingest(to_event(RoutingEvent{.step = step, .layer = layer, .tokens_per_expert = tokens}));
    }
  return m;
}

TEST(ViewerViews, HotExpertHeatmapHasOneBrightRow) {
  RunModel m = HotExpertRun(5000, 8, 3, 2);
  Matrix load = step_expert_load(m.routing.at(0), 256);
  ASSERT_EQ(load.rows, 8);
  ASSERT_EQ(load.cols, 256);
  for (int64_t c = 0; c < load.cols; ++c)
    for (int64_t e = 0; e < 8; ++e) EXPECT_FLOAT_EQ(load.at(e, c), e == 3 ? 8.0f : 0.0f);
  Matrix layers = layer_expert_load(m, 10);
  ASSERT_EQ(layers.rows, 2);
  EXPECT_FLOAT_EQ(layers.at(1, 3), 8.0f);
  EXPECT_FLOAT_EQ(layers.at(1, 2), 0.0f);
  const ExpertBars bars = expert_bars(m, 0, 99999);
  ASSERT_TRUE(bars.valid);
  EXPECT_EQ(bars.step, 4999);
  EXPECT_DOUBLE_EQ(bars.stats.max_over_mean, 8.0);
  EXPECT_EQ(bars.capacity, -1);
}

TEST(ViewerViews, GenreLoadIsAFractionPerGenre) {
  RunModel m;
  m.ingest(to_event(RoutingEvent{.step = 0, .layer = 0, .tokens_per_expert = {4, 4},
                                 .tokens_per_expert_by_genre = {{"code", {3, 1}}, {"prose", {0, 0}}}}));
  auto g = genre_load(m, 0, 0);
  EXPECT_DOUBLE_EQ(g.at("code")[0], 0.75);
  EXPECT_DOUBLE_EQ(g.at("prose")[1], 0.0);
}

TEST(ViewerViews, TopologyPictureAndFormulations) {
  // E = 3, B = 4, H/B = 2 block columns per expert. Tokens 5, 0, 8: dropless rows 8, 0, 8.
  TopologyRecord t{.step = 0, .layer = 0, .block_size = 4, .block_rows = 4, .block_cols = 6, .nnz = 8,
                   .padding_rows = 3, .rows_per_expert = {8, 0, 8}};
  TopologyPicture p = topology_picture(t, {5, 0, 8}, 4);
  ASSERT_TRUE(p.valid);
  EXPECT_EQ(p.problem, "");
  EXPECT_EQ(p.cols_per_expert, 2);
  EXPECT_EQ(p.block_cols, 6);
  ASSERT_EQ(p.experts.size(), 3u);
  EXPECT_EQ(p.experts[2].first_block_row, 2);
  EXPECT_EQ(p.experts[2].first_block_col, 4);
  EXPECT_EQ(p.experts[0].padding_rows, 3);
  EXPECT_EQ(p.dropless.computed_rows, 16);
  EXPECT_EQ(p.dropless.token_rows, 13);
  EXPECT_EQ(p.padded.computed_rows, 12);   // 3 experts x C = 4
  EXPECT_EQ(p.padded.token_rows, 8);       // 4 + 0 + 4
  EXPECT_EQ(p.padded.dropped_tokens, 5);   // 1 + 0 + 4
  EXPECT_EQ(p.dropping.computed_rows, 8);
  EXPECT_EQ(p.dropping.dropped_tokens, 5);
  // Without tokens or capacity the picture says what is missing.
  EXPECT_NE(topology_picture(t, {}, std::nullopt).problem, "");
  EXPECT_NE(topology_picture(t, {5, 0, 8}, std::nullopt).problem.find("capacity"), std::string::npos);
  // A topology whose rows do not add up is flagged, not trusted.
  t.block_rows = 7;
  EXPECT_NE(topology_picture(t, {5, 0, 8}, 4).problem.find("does not match"), std::string::npos);
}

TEST(ViewerViews, CapacityFromTheRunConfig) {
  RunModel m = RunModel::from_text(
      R"({"schema_version":1,"kind":"train","name":"c","start_time":"t","moe_config":{"tokens":8,"model_dim":4,"hidden_dim":8,"num_experts":4,"top_k":1,"formulation":"dropping","capacity_factor":1.5,"block_size":4}})",
      R"({"type":"routing","step":0,"layer":0,"tokens_per_expert":[5,1,1,1]})" "\n");
  ASSERT_EQ(m.error, "");
  const RoutingRow* row = m.routing.at(0).row_at_or_before(0);
  EXPECT_EQ(capacity_for(m, row), 3);  // ceil(1.5 * 8 / 4)
}

TEST(ViewerViews, TimelineLanesAndMergedThinSpans) {
  RunModel m;
  for (int i = 0; i < 1000; ++i)
    m.ingest(to_event(SpanEvent{.step = 0, .rank = 1, .stream = 0, .stream_name = "compute", .name = "tiny",
                                .start_us = i * 1.0, .duration_us = 0.5}));
  m.ingest(to_event(SpanEvent{.step = 0, .rank = 0, .stream = 2, .stream_name = "copy", .name = "h2d_copy",
                              .start_us = 0, .duration_us = 100}));
  m.ingest(to_event(SpanEvent{.step = 1, .rank = 0, .stream = 0, .name = "later", .start_us = 5000, .duration_us = 1}));
  Timeline t = build_timeline(m, 0, 0);
  ASSERT_EQ(t.lanes.size(), 2u);
  EXPECT_EQ(t.lanes[0].rank, 0);
  EXPECT_EQ(t.lanes[1].label, "rank 1 / compute");
  EXPECT_EQ(t.span_count, 1001);
  EXPECT_DOUBLE_EQ(t.t1, 999.5);
  // 1000 us over 100 pixels: spans of 0.5 us every 1 us merge into about one span per pixel or less.
  const auto visible = visible_spans(t.lanes[1], t.t0, t.t1, 10.0);
  EXPECT_LE(visible.size(), 100u);
  int64_t merged = 0;
  for (const auto& s : visible) merged += s.merged;
  EXPECT_EQ(merged, 1000);
  // Zoomed in, nothing merges.
  EXPECT_EQ(visible_spans(t.lanes[1], 100, 110, 0.01).size(), 11u);
  EXPECT_EQ(build_timeline(m, 0, 0, true).lanes.size(), 2u);  // compute and copy lanes
}

TEST(ViewerViews, AThinSpanAfterAWideOneKeepsBothNames) {
  // A 40 us router then a 7 us dispatch at 10 us per pixel: the dispatch is thin but must not
  // turn the router grey; two thin spans in a row still merge.
  TimelineLane lane;
  lane.spans = {{0, 40, 0, 1}, {41, 48, 1, 1}, {48.5, 49, 2, 1}, {60, 100, 3, 1}};
  const auto visible = visible_spans(lane, 0, 100, 10.0);
  ASSERT_EQ(visible.size(), 3u);
  EXPECT_EQ(visible[0].merged, 1);
  EXPECT_EQ(visible[0].end_us, 40);
  EXPECT_EQ(visible[1].merged, 2);  // dispatch + the 0.5 us span after it
  EXPECT_EQ(visible[2].name, 3);
}

TEST(ViewerViews, OneRankTimelineLanesAreNamedByStream) {
  RunModel m;
  m.ingest(to_event(SpanEvent{.step = 5, .rank = 0, .stream = 0, .stream_name = "compute", .name = "moe", .start_us = 0, .duration_us = 10}));
  m.ingest(to_event(SpanEvent{.step = 5, .rank = 0, .stream = 1, .stream_name = "compute: inside the MoE layer",
                              .name = "router", .start_us = 1, .duration_us = 3}));
  const Timeline t = build_timeline(m, 5, 5);
  ASSERT_EQ(t.lanes.size(), 2u);
  EXPECT_EQ(t.lanes[0].label, "compute");
  EXPECT_EQ(t.lanes[1].label, "compute: inside the MoE layer");
  EXPECT_EQ(timeline_step(m, 100), 5);
  EXPECT_EQ(timeline_step(m, 0), 5);  // before the first timed step: the first one
  EXPECT_EQ(timeline_step(RunModel{}, 3), INT64_MIN);
}

TEST(ViewerViews, CurveHelpers) {
  EXPECT_EQ(compact_number(4471000), "4.47M");
  EXPECT_EQ(compact_number(31200), "31.2k");
  EXPECT_EQ(compact_number(1.41807), "1.418");
  EXPECT_EQ(compact_number(2e-05), "2e-05");
  Series s{{0, 10, 20, 30, 35}, {1, 1, 1, 1, 1}};
  EXPECT_EQ(sample_spacing(s), 10);
  EXPECT_EQ(sample_spacing(Series{{3}, {1}}), 0);
  RunModel a, b;
  a.ingest(step_event(3, {{"zeta", 1.0}, {"loss", 2.0}}));
  b.ingest(step_event(9, {{"val_bits_per_byte", 1.0}, {"alpha", 1.0}}));
  EXPECT_EQ(curve_metric_order({&a, &b}), (std::vector<std::string>{"loss", "val_bits_per_byte", "alpha", "zeta"}));
  const StepRange r = curve_step_range({&a, &b});
  EXPECT_EQ(r.lo, 3);
  EXPECT_EQ(r.hi, 9);
  EXPECT_GT(curve_step_range({}).lo, curve_step_range({}).hi);
}

TEST(ViewerViews, AllToAllBandwidthIsOffDiagonalBytesOverTime) {
  RunModel m;
  m.ingest(to_event(AllToAllEvent{.step = 3, .name = "dispatch", .bytes = {{100, 1000}, {3000, 100}}, .duration_us = 2}));
  m.ingest(to_event(AllToAllEvent{.step = 3, .name = "combine", .bytes = {{0, 1000}, {1000, 0}}, .duration_us = 2}));
  AllToAllView a = alltoall_at(m, 10, "");
  EXPECT_EQ(a.step, 3);
  EXPECT_EQ(a.events, 2);
  EXPECT_DOUBLE_EQ(a.remote_bytes, 6000);
  EXPECT_DOUBLE_EQ(a.total_bytes, 6200);
  EXPECT_DOUBLE_EQ(a.bandwidth_gb_per_s, 6000.0 / 4e-6 / 1e9);
  EXPECT_DOUBLE_EQ(a.send_bytes[1], 4000);
  EXPECT_DOUBLE_EQ(alltoall_at(m, 3, "dispatch").remote_bytes, 4000);
  EXPECT_EQ(alltoall_bandwidth_series(m, "").values.size(), 1u);
}

TEST(ViewerViews, OffloadCountersSumOverLayers) {
  RunModel m;
  m.ingest(to_event(OffloadEvent{.step = 1, .layer = 0, .hits = 3, .misses = 1, .stall_us = 10}));
  m.ingest(to_event(OffloadEvent{.step = 1, .layer = 1, .hits = 1, .misses = 3, .stall_us = 30}));
  OffloadView v = offload_at(m, 1, -1);
  EXPECT_EQ(v.hits, 4);
  EXPECT_DOUBLE_EQ(v.hit_rate, 0.5);
  EXPECT_DOUBLE_EQ(v.stall_us, 40);
  EXPECT_DOUBLE_EQ(offload_at(m, 1, 0).hit_rate, 0.75);
  EXPECT_EQ(offload_series(m, "stall_us", -1).values.at(0), 40.0);
}

// The smoothness requirement's data side: everything a frame of the routing panel needs from a
// 10,000-step x 64-expert x 8-layer run is prepared in a few milliseconds, once per data change.
TEST(ViewerViews, LargeRunPreparationIsFast) {
  RunModel m;
  const int64_t steps = 10000, E = 64, L = 8;
  for (int64_t step = 0; step < steps; ++step)
    for (int64_t layer = 0; layer < L; ++layer) {
      std::vector<int64_t> tokens(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) tokens[static_cast<size_t>(e)] = 100 + (e * 7 + step + layer) % 50;
      m.ingest(to_event(RoutingEvent{.step = step, .layer = layer, .tokens_per_expert = tokens}));
    }
  const auto start = std::chrono::steady_clock::now();
  Matrix heatmap = step_expert_load(m.routing.at(5), 1024);
  Image image = colorize(heatmap, 0.0f, 2.0f);
  Matrix layers = layer_expert_load(m, 5000);
  Series cv = m.routing_stat_series(5, "coefficient_of_variation");
  auto columns = downsample_min_max(cv, 0, steps - 1, 1200);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("prepared a 10000 x 64 step x expert heatmap (-> %lld x %lld), the 8 x 64 layer heatmap and a "
              "1200-column curve in %.2f ms\n", static_cast<long long>(heatmap.rows), static_cast<long long>(heatmap.cols), ms);
  EXPECT_EQ(image.width, 1024);
  EXPECT_EQ(image.height, 64);
  EXPECT_EQ(layers.rows, 8);
  EXPECT_EQ(columns.size(), 1200u);
  EXPECT_LT(ms, 500.0);  // generous for Debug builds and loaded CI machines; Release is ~10 ms
}

}  // namespace
}  // namespace moe::viewer
