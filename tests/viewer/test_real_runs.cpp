// test_real_runs.cpp: the panels' data prepared from two real training runs of lesson 08
// (notebooks_data/runs/train_dropless_seed1 and train_dense_seed1, 2000 steps on an H200), no
// window: the sparse validation curve, the per-genre routing against tokens_per_expert, the
// two-row timeline with the MoE layer's phases nested under the model's, the token sample, the
// block-sparse topology and the summary tables compared. The runs are loaded once for the suite.
// ctest runs it from the repository root.   ctest --test-dir build -R ViewerRealRuns
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "comm_view.h"
#include "curves_view.h"
#include "downsample.h"
#include "routing_view.h"
#include "run_model.h"
#include "summary_view.h"
#include "topology_view.h"

namespace moe::viewer {
namespace {

const std::filesystem::path kRuns = "notebooks_data/runs";

class ViewerRealRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto start = std::chrono::steady_clock::now();
    dropless_ = std::make_unique<RunModel>(RunModel::load(kRuns / "train_dropless_seed1"));
    dense_ = std::make_unique<RunModel>(RunModel::load(kRuns / "train_dense_seed1"));
    load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  static void TearDownTestSuite() {
    dropless_.reset();
    dense_.reset();
  }
  void SetUp() override {
    if (!std::filesystem::exists(kRuns / "train_dropless_seed1" / "events.jsonl"))
      GTEST_SKIP() << "notebooks_data/runs/train_dropless_seed1 is not in this checkout";
    ASSERT_EQ(dropless_->error, "");
    ASSERT_EQ(dense_->error, "");
  }
  static std::unique_ptr<RunModel> dropless_, dense_;
  static double load_seconds_;
};
std::unique_ptr<RunModel> ViewerRealRuns::dropless_, ViewerRealRuns::dense_;
double ViewerRealRuns::load_seconds_ = 0;

TEST_F(ViewerRealRuns, LoadsWhole) {
  const RunModel& m = *dropless_;
  EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
  EXPECT_EQ(m.events_skipped, 0);
  EXPECT_EQ(m.first_step, 1);
  EXPECT_EQ(m.last_step, 2000);
  EXPECT_EQ(m.events_by_type.at("step"), 2020);  // 2000 training steps + 20 validations
  EXPECT_EQ(m.summary.formulation, "dropless");
  // How long the two runs took is printed, not asserted (timings belong in benchmarks).
  std::printf("loaded two runs of ~0.75 MB each in %.3f s\n", load_seconds_);
}

TEST_F(ViewerRealRuns, SparseValidationCurveHasItsTwentyPoints) {
  const Series& val = dropless_->step_metrics.at("val_bits_per_byte");
  ASSERT_EQ(val.steps.size(), 20u);  // every 100 steps, a series of its own: no 1980 gaps
  EXPECT_EQ(val.steps.front(), 100);
  EXPECT_EQ(val.steps.back(), 2000);
  for (double v : val.values) EXPECT_TRUE(std::isfinite(v) && v > 1 && v < 5) << v;
  EXPECT_EQ(sample_spacing(val), 100);
  EXPECT_EQ(dropless_->step_metrics.at("val_loss").steps.size(), 20u);
  EXPECT_EQ(dropless_->step_metrics.at("loss").steps.size(), 2000u);
  EXPECT_EQ(sample_spacing(dropless_->step_metrics.at("loss")), 1);
  EXPECT_EQ(dropless_->step_metrics.at("tokens_per_s").steps.size(), 200u);
  EXPECT_EQ(sample_spacing(dropless_->step_metrics.at("grad_norm")), 10);
  // On the shared axis of the curves (steps 1..2000, 1200 pixels) the validation curve is 20
  // columns with one sample each, which the plot joins with a line; the loss fills the plot.
  const StepRange range = curve_step_range({dropless_.get(), dense_.get()});
  EXPECT_EQ(range.lo, 1);
  EXPECT_EQ(range.hi, 2000);
  int filled = 0;
  for (const CurveColumn& c : downsample_min_max(val, range.lo, range.hi, 1200)) filled += c.samples > 0;
  EXPECT_EQ(filled, 20);
  filled = 0;
  for (const CurveColumn& c : downsample_min_max(dropless_->step_metrics.at("loss"), range.lo, range.hi, 1200)) filled += c.samples > 0;
  EXPECT_EQ(filled, 1200);
  // The curves a reader looks for come first.
  const auto order = curve_metric_order({dropless_.get(), dense_.get()});
  ASSERT_GE(order.size(), 3u);
  EXPECT_EQ(order[0], "loss");
  EXPECT_EQ(order[1], "val_loss");
  EXPECT_EQ(order[2], "val_bits_per_byte");
}

TEST_F(ViewerRealRuns, GenreLoadSumsMatchTokensPerExpert) {
  const RunModel& m = *dropless_;
  ASSERT_EQ(m.routing.size(), 4u);  // L = 4 MoE layers
  int checked = 0;
  for (const auto& [layer, lr] : m.routing) {
    ASSERT_EQ(lr.rows.size(), 21u);  // steps 1, 100, 200, ..., 2000
    EXPECT_EQ(lr.num_experts, 8);
    for (const RoutingRow& row : lr.rows) {
      const GenreTable g = genre_table(m, layer, row.step);
      ASSERT_TRUE(g.valid);
      EXPECT_EQ(g.step, row.step);
      EXPECT_GE(g.genres.size(), 10u);
      EXPECT_LE(g.genres.size(), 15u);  // the Brown corpus has 15 genres; a batch holds some
      EXPECT_EQ(g.expert_totals, row.tokens_per_expert) << "layer " << layer << " step " << row.step;
      int64_t routed = 0;
      for (size_t i = 0; i < g.genres.size(); ++i) {
        routed += g.genre_tokens[i];
        double sum = 0;
        for (double f : g.fractions[i]) sum += f;
        EXPECT_NEAR(sum, 1.0, 1e-12) << g.genres[i];
      }
      EXPECT_EQ(routed, 32 * 256 * 2);  // N sequences x S bytes x K experts
      ++checked;
    }
  }
  EXPECT_EQ(checked, 84);
  EXPECT_FALSE(genre_table(*dense_, 0, 2000).valid);  // the dense model routes nothing
  EXPECT_TRUE(dense_->routing.empty());
  EXPECT_TRUE(dense_->token_samples.empty());
}

TEST_F(ViewerRealRuns, TimelineHasTwoRowsWithTheMoeLayerNested) {
  const RunModel& m = *dropless_;
  EXPECT_EQ(timeline_step(m, 2000), 2000);
  EXPECT_EQ(timeline_step(m, 1999), 1900);  // a step in a hundred is timed
  EXPECT_EQ(timeline_step(m, 0), 1);
  const Timeline t = build_timeline(m, 2000, 2000);
  ASSERT_EQ(t.lanes.size(), 2u);
  EXPECT_EQ(t.lanes[0].label, "compute");  // one rank: no "rank 0 / " in front
  EXPECT_EQ(t.lanes[1].label, "compute: inside the MoE layer");
  EXPECT_GT(t.t1 - t.t0, 1000.0);  // a step of the tiny model: a few milliseconds
  EXPECT_LT(t.t1 - t.t0, 20000.0);
  // Every inner phase lies within a moe or backward_moe span of the outer row.
  int moe_spans = 0;
  for (const TimelineSpan& s : t.lanes[0].spans) moe_spans += t.names[static_cast<size_t>(s.name)] == "moe";
  EXPECT_EQ(moe_spans, 4);  // one per block
  for (const TimelineSpan& inner : t.lanes[1].spans) {
    bool inside = false;
    for (const TimelineSpan& outer : t.lanes[0].spans) {
      const std::string& name = t.names[static_cast<size_t>(outer.name)];
      if ((name == "moe" || name == "backward_moe") && inner.start_us >= outer.start_us - 0.5 && inner.end_us <= outer.end_us + 0.5)
        inside = true;
    }
    EXPECT_TRUE(inside) << t.names[static_cast<size_t>(inner.name)] << " at " << inner.start_us - t.t0 << " us";
  }
  const Timeline dense = build_timeline(*dense_, 2000, 2000);
  ASSERT_EQ(dense.lanes.size(), 1u);  // no MoE layer: nothing nested
  EXPECT_EQ(dense.lanes[0].label, "compute");
}

TEST_F(ViewerRealRuns, TokenSampleAndTopology) {
  const RunModel& m = *dropless_;
  const TokensRecord* sample = m.tokens_at(2000, 0);
  ASSERT_NE(sample, nullptr);
  EXPECT_EQ(sample->step, 2000);
  ASSERT_EQ(sample->text.size(), 120u);
  ASSERT_EQ(sample->experts.size(), 120u);
  for (const auto& choice : sample->experts) {
    ASSERT_EQ(choice.size(), 2u);  // top-2
    EXPECT_NE(choice[0], choice[1]);
    for (int64_t e : choice) EXPECT_TRUE(e >= 0 && e < 8) << e;
  }
  const TopologyRecord* t = m.topology_at(2000, 3);
  ASSERT_NE(t, nullptr);
  const ExpertBars bars = expert_bars(m, 3, 2000);
  ASSERT_TRUE(bars.valid);
  const TopologyPicture p = topology_picture(*t, bars.tokens, capacity_for(m, m.routing.at(3).row_at_or_before(2000)));
  EXPECT_EQ(p.problem, "");
  EXPECT_EQ(p.cols_per_expert, 4);  // H / B = 512 / 128
  EXPECT_EQ(p.dropless.token_rows, 32 * 256 * 2);
  EXPECT_EQ(p.dropless.computed_rows, p.dropless.token_rows + p.padding_rows);
}

TEST_F(ViewerRealRuns, SummaryTablesCompareOneRowPerRun) {
  const std::vector<const RunModel*> runs = {dropless_.get(), dense_.get()};
  EXPECT_EQ(shared_table_names(runs), std::vector<std::string>{"summary"});
  TableComparison c = compare_tables(runs, "summary");
  EXPECT_EQ(c.runs, 2);
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.columns.front(), "run");
  size_t bits = 0;
  for (size_t i = 0; i < c.columns.size(); ++i)
    if (c.columns[i] == "val_bits_per_byte") bits = i;
  ASSERT_GT(bits, 0u);
  EXPECT_EQ(c.rows[0][0], "lesson08 dropless seed 1");
  for (const auto& row : c.rows) {
    const double v = std::strtod(row[bits].c_str(), nullptr);
    EXPECT_TRUE(v > 1.5 && v < 2.5) << row[bits];
    // The table's last validation equals the curve's last point.
  }
  const double last_val = dropless_->step_metrics.at("val_bits_per_byte").values.back();
  EXPECT_NEAR(std::strtod(c.rows[0][bits].c_str(), nullptr), last_val, 1e-5);
  sort_rows(c, bits, false);
  EXPECT_GE(std::strtod(c.rows[0][bits].c_str(), nullptr), std::strtod(c.rows[1][bits].c_str(), nullptr));
}

}  // namespace
}  // namespace moe::viewer
