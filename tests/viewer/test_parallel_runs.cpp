// test_parallel_runs.cpp: the multi-GPU views prepared from the language model trained on two
// H200s over NCCL (notebooks_data/runs/train_expert_parallel_2gpu, 2026-11-26) and its one-GPU
// reference, no window: per-rank timelines on one clock, the byte matrix of one layer at one step
// against the routing counts, the load across ranks, and the idle time in the exchanges; the
// throughput preset with two micro-batches overlapped: both micro-batches' rows and the exposed
// communication per rank and step.
// ctest runs it from the repository root.   ctest --test-dir build -R ViewerParallelRuns
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <tuple>

#include "comm_view.h"
#include "parallel_view.h"
#include "run_model.h"

namespace moe::viewer {
namespace {

const std::filesystem::path kRuns = "notebooks_data/runs";

class ViewerParallelRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    two_ = std::make_unique<RunModel>(RunModel::load(kRuns / "train_expert_parallel_2gpu"));
    one_ = std::make_unique<RunModel>(RunModel::load(kRuns / "train_expert_parallel_1gpu_reference"));
  }
  static void TearDownTestSuite() {
    two_.reset();
    one_.reset();
  }
  void SetUp() override {
    if (!std::filesystem::exists(kRuns / "train_expert_parallel_2gpu" / "events.jsonl"))
      GTEST_SKIP() << "notebooks_data/runs/train_expert_parallel_2gpu is not in this checkout";
    ASSERT_EQ(two_->error, "");
    ASSERT_EQ(one_->error, "");
    ASSERT_TRUE(two_->warnings.empty()) << two_->warnings.front();
  }
  static std::unique_ptr<RunModel> two_, one_;
};
std::unique_ptr<RunModel> ViewerParallelRuns::two_, ViewerParallelRuns::one_;

TEST_F(ViewerParallelRuns, RankTimelinesOnOneClock) {
  const Timeline t = build_timeline(*two_, 100, 100);
  // Per rank: the model's phases, the MoE layer's phases nested under them, the exchange stream;
  // and the all-to-all events rank 0 timed.
  std::set<int64_t> ranks;
  for (const TimelineLane& lane : t.lanes) ranks.insert(lane.rank);
  EXPECT_EQ(ranks, (std::set<int64_t>{0, 1}));
  EXPECT_EQ(t.lanes.size(), 7u);
  EXPECT_EQ(t.lanes[0].label, "rank 0 / compute");
  EXPECT_EQ(t.lanes[4].label, "rank 1 / compute");
  // Each rank's step starts at the step's origin (the ranks are placed at rank 0's host time of
  // the step's start), and both run the same phases: a step of about 3.5 ms on each.
  const double start0 = t.lanes[0].spans.front().start_us, start1 = t.lanes[4].spans.front().start_us;
  EXPECT_NEAR(start0, start1, 1.0);
  EXPECT_EQ(t.lanes[0].spans.size(), t.lanes[4].spans.size());
  const double end0 = t.lanes[0].spans.back().end_us, end1 = t.lanes[4].spans.back().end_us;
  EXPECT_NEAR(end0 - start0, end1 - start1, 50.0);
  EXPECT_GT(end0 - start0, 3000.0);
  EXPECT_LT(end0 - start0, 4000.0);
}

TEST_F(ViewerParallelRuns, ByteMatrixPerLayerAndStep) {
  EXPECT_EQ(alltoall_layers(*two_), (std::vector<int64_t>{0, 1, 2, 3}));
  // bytes[src][dst] of layer 0's dispatch at step 100: rows of D=256 bf16 (512 bytes) each.
  const AllToAllView a = alltoall_at(*two_, 100, "dispatch", 0);
  ASSERT_EQ(a.ranks, 2);
  EXPECT_EQ(a.events, 1);
  EXPECT_EQ(a.layer, 0);
  EXPECT_EQ(a.bytes, (std::vector<double>{2372096, 1822208, 2333696, 1860608}));
  // Every routed token copy is dispatched once: T K = 8192 tokens x 2 rows of 512 bytes per layer.
  EXPECT_DOUBLE_EQ(a.total_bytes, 8192.0 * 2 * 512);
  // The combine sends the same rows back: its matrix is the dispatch's transpose.
  const AllToAllView back = alltoall_at(*two_, 100, "combine", 0);
  EXPECT_EQ(back.bytes, (std::vector<double>{2372096, 2333696, 1822208, 1860608}));
  // A step between recorded ones shows the one before; every layer summed is four layers' bytes.
  EXPECT_EQ(alltoall_at(*two_, 149, "dispatch", 3).step, 100);
  EXPECT_DOUBLE_EQ(alltoall_at(*two_, 100, "dispatch", -1).total_bytes, 4 * a.total_bytes);
  // The one-GPU reference exchanges nothing.
  EXPECT_EQ(alltoall_at(*one_, 100, "dispatch", 0).events, 0);
}

TEST_F(ViewerParallelRuns, LoadAcrossRanksAgreesWithRouting) {
  // Rank r computes experts [r E/R, (r+1) E/R): the rows its dispatch column receives must be the
  // tokens the routing event counts for those experts, at every recorded step and layer.
  const int64_t E = 8, R = 2, row_bytes = 256 * 2;
  int64_t checked = 0;
  for (const auto& [layer, routing] : two_->routing) {
    for (const RoutingRow& row : routing.rows) {
      const RankLoad load = rank_load_at(*two_, row.step, layer);
      ASSERT_EQ(load.ranks, R);
      ASSERT_EQ(load.step, row.step);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t tokens = std::accumulate(row.tokens_per_expert.begin() + r * E / R,
                                               row.tokens_per_expert.begin() + (r + 1) * E / R, int64_t{0});
        EXPECT_DOUBLE_EQ(load.received[static_cast<size_t>(r)], static_cast<double>(tokens * row_bytes))
            << "step " << row.step << " layer " << layer << " rank " << r;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 28);  // 7 recorded steps x 4 layers
  // Step 1 (the router untrained): layer 3 sends 15093 of 16384 rows to rank 1.
  const RankLoad first = rank_load_at(*two_, 1, 3);
  EXPECT_EQ(first.busiest_rank, 1);
  EXPECT_NEAR(first.max_over_mean, 15093.0 / 8192.0, 1e-12);
  // By step 300 the load-balancing loss has evened it out.
  EXPECT_LT(rank_load_at(*two_, 300, 3).max_over_mean, 1.05);
  const Series s = rank_imbalance_series(*two_, 3);
  EXPECT_EQ(s.steps, (std::vector<double>{1, 50, 100, 150, 200, 250, 300}));
  EXPECT_DOUBLE_EQ(s.values.front(), first.max_over_mean);
  EXPECT_EQ(rank_load_at(*one_, 100, 0).ranks, 0);
}

TEST_F(ViewerParallelRuns, IdleTimeInTheExchanges) {
  // Each MoE layer's forward has a count exchange, a dispatch and a combine; the backward, a
  // dispatch and a combine: 4 x 3 + 4 x 2 = 20 collectives per step, on both ranks.
  const ExchangeWaits w = exchange_waits_at(*two_, 100);
  ASSERT_EQ(w.ranks, 2);
  EXPECT_EQ(w.step, 100);
  EXPECT_EQ(w.exchanges, 20);
  EXPECT_EQ(w.names, (std::vector<std::string>{"ep_combine_exchange", "ep_count_exchange", "ep_dispatch"}));
  // For each collective one rank is the fastest (idle 0 there): the two ranks' idle times add up
  // to the summed differences, and neither rank is idle for the whole exchange.
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_GT(w.idle_us[static_cast<size_t>(r)], 0.0);
    EXPECT_LT(w.idle_us[static_cast<size_t>(r)], w.exchange_us[static_cast<size_t>(r)]);
  }
  EXPECT_NEAR(w.idle_us[0], 153.632, 0.01);
  EXPECT_NEAR(w.idle_us[1], 189.088, 0.01);
  // The difference of the two ranks' exchange time is the difference of their idle time: what
  // both spend (the fastest's duration) cancels.
  EXPECT_NEAR(w.exchange_us[1] - w.exchange_us[0], w.idle_us[1] - w.idle_us[0], 1e-6);
  // Rank 0's timed dispatch durations are the alltoall events' durations.
  double dispatch_us = 0;
  for (const AllToAllRecord& a : two_->alltoalls)
    if (a.step == 100 && a.name == "dispatch") dispatch_us += a.duration_us;
  double rank0_forward_dispatch = 0;
  int64_t seen = 0;
  std::vector<const SpanRecord*> dispatches;
  for (const SpanRecord& s : two_->spans)
    if (s.step == 100 && s.rank == 0 && s.name == "ep_dispatch") dispatches.push_back(&s);
  std::sort(dispatches.begin(), dispatches.end(), [](auto* a, auto* b) { return a->start_us < b->start_us; });
  for (const SpanRecord* s : dispatches)
    if (seen++ < 4) rank0_forward_dispatch += s->duration_us;  // the forward's four, before the backward's
  EXPECT_NEAR(rank0_forward_dispatch, dispatch_us, 1e-3);

  // Step 1 holds NCCL's first call: rank 1 waits 10 ms for rank 0's set-up.
  EXPECT_GT(exchange_waits_at(*two_, 1).idle_us[1], 10000.0);
  const std::vector<Series> idle = exchange_idle_series(*two_);
  ASSERT_EQ(idle.size(), 2u);
  EXPECT_EQ(idle[0].steps.size(), 7u);
  // One GPU: no exchanges, nothing to wait for.
  EXPECT_EQ(exchange_waits_at(*one_, 100).ranks, 0);
  EXPECT_TRUE(exchange_idle_series(*one_).empty());
}

// The same model trained on four H200s (notebooks_data/runs/train_expert_parallel_4gpu, 2026-11-26):
// four ranks' lanes, 4 x 4 byte matrices whose every column is the rows the routing sent to that
// rank's two experts, at every recorded step and layer.
TEST(ViewerParallelRunFourGpus, LanesMatricesAndLoadAgreeWithRouting) {
  const std::filesystem::path dir = kRuns / "train_expert_parallel_4gpu";
  if (!std::filesystem::exists(dir / "events.jsonl")) GTEST_SKIP() << dir.string() << " is not in this checkout";
  const RunModel four = RunModel::load(dir);
  ASSERT_EQ(four.error, "");
  const int64_t E = 8, R = 4, row_bytes = 256 * 2;
  std::set<int64_t> ranks;
  for (const TimelineLane& lane : build_timeline(four, 100, 100).lanes) ranks.insert(lane.rank);
  EXPECT_EQ(ranks, (std::set<int64_t>{0, 1, 2, 3}));
  int64_t checked = 0;
  for (const auto& [layer, routing] : four.routing) {
    for (const RoutingRow& row : routing.rows) {
      const RankLoad load = rank_load_at(four, row.step, layer);
      ASSERT_EQ(load.ranks, R);
      const AllToAllView dispatch = alltoall_at(four, row.step, "dispatch", layer);
      ASSERT_EQ(dispatch.ranks, R);
      const int64_t routed = std::accumulate(row.tokens_per_expert.begin(), row.tokens_per_expert.end(), int64_t{0});
      EXPECT_DOUBLE_EQ(dispatch.total_bytes, static_cast<double>(routed * row_bytes)) << "step " << row.step;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t tokens = std::accumulate(row.tokens_per_expert.begin() + r * E / R,
                                               row.tokens_per_expert.begin() + (r + 1) * E / R, int64_t{0});
        EXPECT_DOUBLE_EQ(load.received[static_cast<size_t>(r)], static_cast<double>(tokens * row_bytes))
            << "step " << row.step << " layer " << layer << " rank " << r;
        double column = 0;
        for (int64_t src = 0; src < R; ++src) column += dispatch.bytes[static_cast<size_t>(src * R + r)];
        EXPECT_DOUBLE_EQ(column, static_cast<double>(tokens * row_bytes)) << "step " << row.step << " rank " << r;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 28);  // 7 recorded steps x 4 layers
}

// The language model on two H200s with two micro-batches overlapped
// (notebooks_data/runs/train_2gpu_throughput_overlap, 2026-11-28): both micro-batches' rows on both
// ranks, and every rank's exposed communication at every recorded step: more than nothing, less than
// its step, and the first micro-batch's waits summed by hand.
TEST(ViewerParallelRunOverlap, BothMicroBatchesRowsAndExposedCommunication) {
  const std::filesystem::path dir = kRuns / "train_2gpu_throughput_overlap";
  if (!std::filesystem::exists(dir / "events.jsonl")) GTEST_SKIP() << dir.string() << " is not in this checkout";
  const RunModel run = RunModel::load(dir);
  ASSERT_EQ(run.error, "");
  std::set<std::pair<int64_t, std::string>> rows;
  double by_hand = 0;
  for (const SpanRecord& s : run.spans) {
    if (s.step != 200) continue;
    rows.insert({s.rank, s.stream_name});
    const bool first_compute = s.stream_name == "compute" || s.stream_name == "compute: inside the MoE layer";
    if (s.rank == 0 && first_compute &&
        (s.name == "ep_count_exchange" || s.name == "ep_wait_dispatch" || s.name == "ep_wait_combine" ||
         s.name == "gradient_all_reduce")) {
      by_hand += s.duration_us;
    }
  }
  for (int64_t rank : {0, 1}) {
    for (const char* row : {"compute", "compute: inside the MoE layer", "compute, second micro-batch",
                            "compute: inside the MoE layer, second micro-batch", "exchange stream (the all-to-alls)",
                            "exchange stream (the all-to-alls), second micro-batch"}) {
      EXPECT_TRUE(rows.count({rank, row})) << "rank " << rank << " has no row " << row;
    }
  }
  const ExposedCommunication at_200 = exposed_communication_at(run, 200);
  ASSERT_EQ(at_200.ranks, 2);
  EXPECT_NEAR(at_200.exposed_us[0], by_hand, 1e-6);
  const std::vector<Series> series = exposed_communication_series(run);
  ASSERT_EQ(series.size(), 2u);
  for (int64_t rank : {0, 1}) {
    const Series& curve = series[static_cast<size_t>(rank)];
    ASSERT_EQ(curve.steps.size(), 11u);  // steps 1, 20, ..., 200
    for (size_t i = 0; i < curve.steps.size(); ++i) {
      const ExposedCommunication x = exposed_communication_at(run, static_cast<int64_t>(curve.steps[i]));
      EXPECT_GT(curve.values[i], 0.0) << "rank " << rank << " step " << curve.steps[i];
      EXPECT_LT(curve.values[i], x.step_us[static_cast<size_t>(rank)]) << "rank " << rank << " step " << curve.steps[i];
    }
  }
}

// The bundled run with experts placed by load (two ranks, E = 8, one spare slot a rank): plans at
// steps 100 .. 500, each of five experts a rank with two of them on both ranks; the dispatch sends
// every routed row once, whichever replica computes it.
TEST(ViewerParallelRunEplb, PlansWithReplicasAndEveryRowDispatchedOnce) {
  const std::filesystem::path dir = kRuns / "train_2ranks_eplb";
  if (!std::filesystem::exists(dir / "events.jsonl")) GTEST_SKIP() << dir.string() << " is not in this checkout";
  const RunModel run = RunModel::load(dir);
  ASSERT_EQ(run.error, "");
  const PlacementView before = placement_at(run, 60, 0);
  EXPECT_EQ(before.planned_at, -1);
  EXPECT_EQ(before.plan_steps, (std::vector<int64_t>{100, 200, 300, 400, 500}));
  for (const auto& [layer, routing] : run.routing) {
    const PlacementView plan = placement_at(run, 250, layer);
    EXPECT_EQ(plan.planned_at, 200) << "layer " << layer;
    ASSERT_EQ(plan.experts_of_rank.size(), 2u);
    EXPECT_EQ(plan.experts_of_rank[0].size(), 5u);
    EXPECT_EQ(plan.experts_of_rank[1].size(), 5u);
    ASSERT_EQ(plan.copies.size(), 8u);
    EXPECT_EQ(std::count(plan.copies.begin(), plan.copies.end(), 2), 2) << "two experts on both ranks";
    for (const RoutingRow& row : routing.rows) {
      const AllToAllView dispatch = alltoall_at(run, row.step, "dispatch", layer);
      const int64_t routed = std::accumulate(row.tokens_per_expert.begin(), row.tokens_per_expert.end(), int64_t{0});
      EXPECT_DOUBLE_EQ(dispatch.total_bytes, static_cast<double>(routed * 256 * 2)) << "step " << row.step;
    }
  }
}

TEST(ViewerParallelView, PlacementByLoadInForceAtAStep) {
  // Two re-plans of layer 1 (steps 10 and 20) and one of layer 0; a row that is not a placement is
  // skipped. At step 15 the plan of step 10 holds: expert 2 on both ranks.
  const std::string table =
      R"({"type":"table","name":"placement","columns":["step","layer","rank_max_over_mean_before","rank_max_over_mean_after","replicas","experts_of_rank"],"rows":[)"
      R"([10,0,1.5,1.02,2,[[0,1,2],[2,3,1]]],)"
      R"([10,1,1.4,1.01,2,[[0,2,3],[1,2,3]]],)"
      R"([20,1,1.2,1.0,2,[[0,1,3],[1,2,3]]],)"
      R"([30,1,1.2,1.0,2,"not a placement"]]})"
      "\n";
  const RunModel run = RunModel::from_text(
      R"({"schema_version":1,"kind":"train","name":"t","start_time":"2026-11-22T00:00:00.000Z","world_size":2})", table);
  ASSERT_EQ(run.error, "");
  const PlacementView before = placement_at(run, 5, 1);
  EXPECT_EQ(before.planned_at, -1) << "E / R in id order until step 10";
  EXPECT_EQ(before.plan_steps, (std::vector<int64_t>{10, 20}));
  const PlacementView at_15 = placement_at(run, 15, 1);
  EXPECT_EQ(at_15.planned_at, 10);
  EXPECT_EQ(at_15.experts_of_rank, (std::vector<std::vector<int64_t>>{{0, 2, 3}, {1, 2, 3}}));
  EXPECT_EQ(at_15.copies, (std::vector<int64_t>{1, 1, 2, 2}));
  EXPECT_DOUBLE_EQ(at_15.expected_before, 1.4);
  EXPECT_DOUBLE_EQ(at_15.expected_after, 1.01);
  EXPECT_EQ(placement_at(run, 99, 1).planned_at, 20) << "the bad row at step 30 is skipped";
  EXPECT_EQ(placement_at(run, 12, -1).layer, 0) << "layer -1: the first block named";
  EXPECT_EQ(placement_at(run, 12, 7).planned_at, -1) << "no such layer";
}

TEST(ViewerParallelView, RankWithoutExchangesMatchesNothing) {
  // Two ranks, but rank 1 recorded no exchange: nothing can be matched, nothing is called idle.
  const RunModel run = RunModel::from_text(
      R"({"schema_version":1,"kind":"train","name":"t","start_time":"2026-11-22T00:00:00.000Z","world_size":2})",
      R"({"type":"span","step":1,"rank":0,"stream":9,"stream_name":"exchange stream","name":"ep_dispatch","start_us":10,"duration_us":5})"
      "\n"
      R"({"type":"span","step":1,"rank":1,"stream":0,"stream_name":"compute","name":"moe","start_us":10,"duration_us":5})"
      "\n");
  ASSERT_EQ(run.error, "");
  const ExchangeWaits w = exchange_waits_at(run, 1);
  EXPECT_EQ(w.exchanges, 0);
}

TEST(ViewerParallelView, CommStreamSpansAreExchanges) {
  // Spans on a "comm" stream (the record format's example) are exchanges: per collective, each
  // rank's duration minus the fastest rank's. dispatch: 10 / 25 us, combine: 8 / 5 us.
  std::string events;
  for (const auto& [rank, name, duration] : {std::tuple{0, "dispatch", 10}, {1, "dispatch", 25}, {0, "combine", 8}, {1, "combine", 5}})
    events += R"({"type":"span","step":3,"rank":)" + std::to_string(rank) + R"(,"stream":2,"stream_name":"comm","name":")" +
              name + R"(","start_us":100,"duration_us":)" + std::to_string(duration) + "}\n";
  events += R"({"type":"span","step":3,"rank":0,"stream":0,"stream_name":"compute","name":"expert_compute","start_us":0,"duration_us":50})"
            "\n";
  const RunModel run = RunModel::from_text(
      R"({"schema_version":1,"kind":"train","name":"t","start_time":"2026-11-22T00:00:00.000Z","world_size":2})", events);
  ASSERT_EQ(run.error, "");
  const ExchangeWaits w = exchange_waits_at(run, 3);
  EXPECT_EQ(w.exchanges, 2);
  EXPECT_EQ(w.names, (std::vector<std::string>{"combine", "dispatch"}));
  EXPECT_EQ(w.idle_us, (std::vector<double>{3, 15}));
  EXPECT_EQ(w.exchange_us, (std::vector<double>{18, 30}));
}

TEST(ViewerParallelView, ExposedCommunicationIsTheFirstComputeStreamsWaits) {
  // Rank 0: a count exchange (4 us) and two waits (10 + 6 us) on the compute streams, a wait on the
  // second micro-batch's stream (7 us: not counted) and a dispatch on the exchange stream (30 us:
  // not a wait of the compute stream). Rank 1: one wait of 2 us. The step: first start to last end.
  std::string events;
  for (const auto& [rank, stream, name, start, duration] :
       {std::tuple{0, "compute", "moe", 0, 100}, {0, "compute: inside the MoE layer", "ep_count_exchange", 5, 4},
        {0, "compute: inside the MoE layer", "ep_wait_dispatch", 10, 10},
        {0, "compute: inside the MoE layer", "ep_wait_combine", 60, 6},
        {0, "compute, second micro-batch: inside the MoE layer", "ep_wait_dispatch", 20, 7},
        {0, "exchange stream (the all-to-alls)", "ep_dispatch", 10, 30}, {1, "compute", "moe", 3, 90},
        {1, "compute: inside the MoE layer", "ep_wait_combine", 50, 2}})
    events += R"({"type":"span","step":7,"rank":)" + std::to_string(rank) + R"(,"stream":0,"stream_name":")" + stream +
              R"(","name":")" + name + R"(","start_us":)" + std::to_string(start) + R"(,"duration_us":)" +
              std::to_string(duration) + "}\n";
  const RunModel run = RunModel::from_text(
      R"({"schema_version":1,"kind":"train","name":"t","start_time":"2026-11-22T00:00:00.000Z","world_size":2})", events);
  ASSERT_EQ(run.error, "");
  const ExposedCommunication x = exposed_communication_at(run, 7);
  ASSERT_EQ(x.ranks, 2);
  EXPECT_EQ(x.exposed_us, (std::vector<double>{20, 2}));
  EXPECT_EQ(x.step_us, (std::vector<double>{100, 90}));
  const std::vector<Series> series = exposed_communication_series(run);
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[1].steps, (std::vector<double>{7}));
  EXPECT_EQ(series[1].values, (std::vector<double>{2}));
}

}  // namespace
}  // namespace moe::viewer
