// tests/sim/test_sim_model.cpp: the simulator's pieces against cases worked out by hand.
//
// The calibration is sim/worked_example.h's round numbers, so every expected time can be added up
// on paper (the sums are written beside each expectation).
//   ctest --test-dir build -R Sim
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include <nlohmann/json.hpp>

#include "run_record.h"
#include "sim/calibration.h"
#include "sim/cluster.h"
#include "sim/cost_model.h"
#include "sim/layer_step.h"
#include "sim/lm_step.h"
#include "sim/routing_trace.h"
#include "sim/simulate.h"
#include "sim/step_load.h"
#include "sim/timeline.h"
#include "sim/validation.h"
#include "sim/worked_example.h"

namespace moe::sim {
namespace {

Calibration hand_calibration() { return worked_example_calibration(); }

// Two ranks, two experts, expert 0 hot: each rank routes 750 of its 1000 rows to it, 250 to expert 1.
BlockLoad hot_expert_load() {
  BlockLoad hot;
  hot.sources = 2;
  hot.experts = 2;
  hot.tokens = {750, 250, 750, 250};
  return hot;
}

LayerSpec hand_layer(int64_t experts) { return worked_example_layer(experts); }

std::filesystem::path temp_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moe_sim_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// ---- the cluster ----

TEST(SimCluster, ParsesNodesAndGpusOrRanks) {
  const Cluster a = parse_cluster("nodes=128,gpus-per-node=8");
  EXPECT_EQ(a.ranks(), 1024);
  EXPECT_EQ(a.node_of(17), 2);
  EXPECT_EQ(a.local_index(17), 1);
  EXPECT_TRUE(a.same_node(8, 15));
  EXPECT_FALSE(a.same_node(7, 8));
  const Cluster b = parse_cluster("ranks=4");
  EXPECT_EQ(b.nodes, 1);
  EXPECT_EQ(b.gpus_per_node, 4);
}

TEST(SimCluster, RefusesWhatIsNotAMachine) {
  for (const char* text : {"", "nodes=0", "nodes=2,gpus=8", "nodes=x", "ranks=4,nodes=2", "nodes=100000,gpus-per-node=8"}) {
    EXPECT_THROW(parse_cluster(text), std::invalid_argument) << text;
  }
  try {
    parse_cluster("nodes=0");
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("allowed"), std::string::npos);
  }
}

// ---- the timeline ----

TEST(SimTimeline, StreamsRunInIssueOrderAndWaitForWhatTheyName) {
  Timeline t(1);
  const Op a = t.local("a", kCompute, 10.0);
  const Op b = t.local("b", kExchange, 5.0, {a});  // starts when a ends
  const Op c = t.local("c", kCompute, 3.0);        // the compute stream is free at 10
  const Op d = t.local("d", kCompute, 1.0, {b});   // waits for b (ends at 15)
  EXPECT_DOUBLE_EQ(t.end_us(a, 0), 10);
  EXPECT_DOUBLE_EQ(t.end_us(b, 0), 15);
  EXPECT_DOUBLE_EQ(t.end_us(c, 0), 13);
  EXPECT_DOUBLE_EQ(t.end_us(d, 0), 16);
  EXPECT_DOUBLE_EQ(t.finish_step(), 16);
  EXPECT_DOUBLE_EQ(t.compute_busy_us()[0], 14);
  EXPECT_DOUBLE_EQ(t.exposed_communication_us()[0], 2);  // 13 -> 15, waiting for b
}

TEST(SimTimeline, ACollectiveWaitsForTheSlowestRank) {
  Timeline t(3);
  const Op work = t.local("work", kCompute, std::vector<double>{10, 30, 20});
  const Op exchange = t.collective("exchange", kExchange, 4.0, {work});
  for (int64_t r = 0; r < 3; ++r) EXPECT_DOUBLE_EQ(t.end_us(exchange, r), 34);
  t.local("after", kCompute, 1.0, {exchange});
  EXPECT_DOUBLE_EQ(t.finish_step(), 35);
  // Rank 0 computed 11 us and waited 24 (for rank 1 and the exchange).
  EXPECT_DOUBLE_EQ(t.compute_busy_us()[0], 11);
  EXPECT_DOUBLE_EQ(t.exposed_communication_us()[0], 24);
  EXPECT_DOUBLE_EQ(t.exposed_communication_us()[1], 4);
}

TEST(SimTimeline, TwoComputeStreamsShareTheGpuAndTheHostWaits) {
  Timeline t(1);
  const Op a = t.local("a", kCompute, 10.0);
  const Op x = t.local("x", kExchange, 20.0, {a});  // 10 -> 30
  const Op b = t.local("b", kCompute, 5.0, {x});    // 30 -> 35
  const Op c = t.local("c", kCompute2, 8.0);        // ready at 0, the GPU is free at 10: 10 -> 18
  const Op d = t.local("d", kCompute2, 15.0);       // 18 -> 30 is too short a gap: after b, 35 -> 50
  EXPECT_DOUBLE_EQ(t.end_us(b, 0), 35);
  EXPECT_DOUBLE_EQ(t.end_us(c, 0), 18);
  EXPECT_DOUBLE_EQ(t.end_us(d, 0), 50);
  t.host_waits_for(x);                              // nothing issued from here starts before 30
  const Op e = t.local("e", kCopy, 1.0);
  EXPECT_DOUBLE_EQ(t.end_us(e, 0), 31);
  EXPECT_DOUBLE_EQ(t.finish_step(), 50);
  EXPECT_DOUBLE_EQ(t.compute_busy_us()[0], 38);
  EXPECT_DOUBLE_EQ(t.exposed_communication_us()[0], 12);
}

TEST(SimTimeline, StepsFollowEachOtherAndSpansAreKeptForTheRanksAsked) {
  Timeline t(4);
  t.keep_spans_of({2});
  t.local("a", kCompute, 5.0);
  EXPECT_DOUBLE_EQ(t.finish_step(), 5);
  const Op b = t.local("b", kCompute, 2.0);
  EXPECT_DOUBLE_EQ(t.end_us(b, 3), 7);
  EXPECT_DOUBLE_EQ(t.finish_step(), 2);
  const std::vector<SimSpan> spans = t.take_spans();
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].rank, 2);
  EXPECT_DOUBLE_EQ(spans[1].start_us, 5);
  EXPECT_THROW(t.local("bad", kCompute, std::vector<double>{1.0}), std::invalid_argument);
}

// ---- loads ----

TEST(SimStepLoad, TokensPlaceExpertsContiguously) {
  BlockLoad block;
  block.sources = 2;
  block.experts = 4;
  block.tokens = {1, 2, 3, 4,   // from rank 0
                  5, 6, 7, 8};  // from rank 1
  const StepLoad load = step_load_from_tokens(block, 2);
  EXPECT_DOUBLE_EQ(load.sent(0, 0), 3);   // experts 0, 1 live on rank 0
  EXPECT_DOUBLE_EQ(load.sent(0, 1), 7);
  EXPECT_DOUBLE_EQ(load.sent(1, 0), 11);
  EXPECT_DOUBLE_EQ(load.sent(1, 1), 15);
  EXPECT_EQ(load.rows_per_rank(), (std::vector<double>{14, 22}));
  EXPECT_THROW(step_load_from_tokens(block, 4), std::invalid_argument);  // 2 sources replayed on 4 ranks
  EXPECT_THROW(check_placement(6, 4), std::invalid_argument);
}

TEST(SimStepLoad, CapacityDropsRowsAndWhatWouldHaveBeenSent) {
  StepLoad load = step_load_from_shares({0.75, 0.25}, 2, 1000);
  EXPECT_DOUBLE_EQ(load.rows_per_expert[0], 1500);
  apply_capacity(load, 1000);
  EXPECT_DOUBLE_EQ(load.rows_per_expert[0], 1000);
  EXPECT_DOUBLE_EQ(load.rows_per_expert[1], 500);
  EXPECT_DOUBLE_EQ(load.sent(1, 0), 750 * 1000.0 / 1500.0);
  EXPECT_DOUBLE_EQ(load.sent(1, 1), 250);
}

// ---- the cost model, by hand ----

TEST(SimCostModel, TheExpertsFitAPlusDTimesB) {
  const CostModel model(hand_calibration(), Cluster{1, 1}, hand_layer(2));
  // A = 200 us for 2 experts x 500 rows; B = 100 us a launch for 2 experts, of which their bytes
  // explain 2 x 8 us (8 bytes a parameter, 2 x 100 x 200 parameters an expert, at 40 GB/s): 8 us
  // an expert, 84 us a launch whatever the experts.
  EXPECT_NEAR(model.launch_us_per_expert(), 8, 1e-9);
  EXPECT_NEAR(model.launch_us_fixed(), 84, 1e-9);
  const std::vector<double> rows{500, 500};
  EXPECT_NEAR(model.experts_us(rows, 1, false) + model.experts_us(rows, 1, true), 300, 1e-9);
  EXPECT_NEAR(2 * (model.experts_us(rows, 2, false) + model.experts_us(rows, 2, true)), 400, 1e-9);
}

TEST(SimCostModel, AllToAllInsideANodeFollowsTheMeasuredCurve) {
  const CostModel model(hand_calibration(), Cluster{1, 2}, hand_layer(2));
  // 1.5 MB a rank: between the curve's points (10 us a MB).
  EXPECT_NEAR(model.uniform_all_to_all_us(1.5e6), 15, 1e-9);
  // Beyond the last point, at the last segment's rate.
  EXPECT_NEAR(model.uniform_all_to_all_us(4e6), 40, 1e-9);
  // Below the first point: latency-bound.
  EXPECT_NEAR(model.uniform_all_to_all_us(1e3), 10, 1e-9);
  // More peers than the curve was measured with: 1 us each further peer.
  EXPECT_NEAR(model.intra_node_us(1e3, 5), 10 + 4 * 1.0, 1e-9);
}

TEST(SimCostModel, FlatAndHierarchicalAcrossTwoNodesByHand) {
  const Calibration calibration = hand_calibration();
  // Two nodes of one GPU: 500 rows of 200 bytes leave each rank over its NIC.
  {
    const CostModel model(calibration, Cluster{2, 1}, hand_layer(2));
    const StepLoad load = step_load_from_shares({0.5, 0.5}, 2, 1000);
    EXPECT_NEAR(model.all_to_all_us(load, 1.0, false), 5 + 100000 / 10e3 + 1, 1e-9);
  }
  // Two nodes of two GPUs, 250 rows from every rank to every rank.
  LayerSpec layer = hand_layer(4);
  const StepLoad load = step_load_from_shares({0.25, 0.25, 0.25, 0.25}, 4, 1000);
  layer.all_to_all = AllToAllKind::flat;
  const CostModel flat(calibration, Cluster{2, 2}, layer);
  // NVLink: 250 rows (50 kB) to the local peer -> below the curve: 10 us; NIC: 500 rows
  // (100 kB) to 2 peers: 5 + 10 + 2 = 17 us; both at once.
  EXPECT_NEAR(flat.all_to_all_us(load, 1.0, false), 17, 1e-9);
  layer.all_to_all = AllToAllKind::hierarchical;
  const CostModel two_d(calibration, Cluster{2, 2}, layer);
  // 2DH: inside the node 500 rows (10 us), between nodes 500 rows to 1 peer (5 + 10 + 1),
  // and two reorders of the rank's 1000 rows at 40 GB/s (2 x 200 kB / 40 GB/s = 10 us).
  EXPECT_NEAR(two_d.all_to_all_us(load, 1.0, false), 10 + 16 + 10, 1e-9);
}

TEST(SimLayerStep, TwoRanksOneStepAddUpByHand) {
  const Calibration calibration = hand_calibration();
  SimulationSpec spec;
  spec.cluster = Cluster{1, 2};
  spec.layer = hand_layer(2);
  spec.steps = 1;
  // Uniform: each rank's expert computes 1000 rows; 500 rows (100 kB) cross each way: 10 us an
  // exchange. route 10, counts 7, permute 20, out 10, experts 97.33 (a third of A = 200 and of
  // B for one expert, 8 + 84), back 10, combine 30, combine's backward 40, out 10, experts 194.67,
  // back 10, router 50, all-reduce 7, SGD 30 (one of the calibration's two experts), unnamed 454.
  const Simulation uniform = simulate(spec, calibration);
  EXPECT_NEAR(uniform.steps[0].step_us, 980, 1e-6);
  EXPECT_NEAR(uniform.steps[0].exposed_us, 54, 1e-6);
  EXPECT_NEAR(uniform.steps[0].compute_us, 926, 1e-6);
  // A trace with a hot expert: rank 0 computes 1500 rows, rank 1 500, and every collective after
  // rank 0's experts waits for it: +33.33 forward, +66.67 backward.
  const BlockLoad hot = hot_expert_load();
  RoutingTrace trace;
  trace.loads.push_back(hot);
  spec.trace = trace;
  const Simulation skewed = simulate(spec, calibration);
  EXPECT_NEAR(skewed.steps[0].step_us, 1080, 1e-6);
  EXPECT_NEAR(skewed.steps[0].straggler, 1.5, 1e-9);
}

TEST(SimLayerStep, AnExchangeBesideTheExpertsSlowsThemBySigmaByHand) {
  Calibration calibration = hand_calibration();
  {
    const CostModel model(calibration, Cluster{1, 2}, hand_layer(2));
    EXPECT_NEAR(model.beside_exchange_us(100, 30), 100, 1e-9);  // sigma 0: free overlap
  }
  calibration.overlap_contention = {0.5, 2};
  const CostModel model(calibration, Cluster{1, 2}, hand_layer(2));
  EXPECT_NEAR(model.beside_exchange_us(100, 30), 115, 1e-9);   // 100 + 0.5 x 30
  EXPECT_NEAR(model.beside_exchange_us(100, 300), 150, 1e-9);  // at most the experts' own time
  // Two ranks, d = 2: each chunk's exchange is 10 us (the curve's latency floor), and its kernels
  // take as long. In each pass chunk 0's experts run beside chunk 1's way out, chunk 1's beside
  // chunk 0's way back: 2 x 0.5 x 10 us a pass, forward and backward, 20 us a step.
  SimulationSpec spec;
  spec.cluster = Cluster{1, 2};
  spec.layer = hand_layer(2);
  spec.layer.chunks = 2;
  spec.steps = 1;
  EXPECT_NEAR(model.exchange_kernels_us(step_load_from_shares({0.5, 0.5}, 2, 1000), 0.5, false), 10, 1e-9);
  const double contended = simulate(spec, calibration).median_step_us();
  calibration.overlap_contention = {};
  EXPECT_NEAR(contended - simulate(spec, calibration).median_step_us(), 20, 1e-6);
  // One GPU has no network exchange beside its experts: sigma changes nothing.
  spec.cluster = Cluster{1, 1};
  const double alone = simulate(spec, calibration).median_step_us();
  calibration.overlap_contention = {0.5, 2};
  EXPECT_NEAR(simulate(spec, calibration).median_step_us(), alone, 1e-9);
}

TEST(SimLayerStep, ReplicasOfTheHotExpertBalanceTheRanksByHand) {
  // The hot-expert trace above (expert 0: 1500 rows, expert 1: 500) with one redundant slot a rank:
  // EPLB gives each rank 2 slots, 4 in all. Replicate: expert 0 has the most rows a replica and gets
  // a second (750 each); it is then on both ranks, so expert 1 gets the last (250 each). Pack,
  // heaviest first: 0 -> rank 0, 0 -> rank 1, 1 -> rank 0, 1 -> rank 1. Both ranks compute 1000
  // rows, and every source sends half its rows for each expert to each rank: 500 rows out.
  const BlockLoad hot = hot_expert_load();
  StepLoad load = step_load_from_tokens(hot, 2);
  replicate_hot_experts(load, 1);
  EXPECT_EQ(load.replicas, 2);
  EXPECT_EQ(load.rows_per_rank(), (std::vector<double>{1000, 1000}));
  EXPECT_EQ(load.slot_rows[0], (std::vector<double>{750, 250}));
  EXPECT_EQ(load.slot_rows[1], (std::vector<double>{750, 250}));  // slots by expert id
  EXPECT_DOUBLE_EQ(load.sent(0, 1), 500);
  EXPECT_DOUBLE_EQ(load.sent(1, 0), 500);
  EXPECT_THROW(replicate_hot_experts(load, 2), std::invalid_argument);  // more slots than other experts
  // The step: the uniform step (980 us) + two expert slots a launch instead of one (8 us more,
  // a third forward, two thirds backward) + the replicas' gradients summed (640 kB a rank on the
  // curve: 10 us) + SGD on two experts instead of one (+30 us) = 1028 us, against 1080 without.
  SimulationSpec spec;
  spec.cluster = Cluster{1, 2};
  spec.layer = hand_layer(2);
  spec.layer.redundant_slots = 1;
  spec.steps = 1;
  RoutingTrace trace;
  trace.loads.push_back(hot);
  spec.trace = trace;
  const Simulation replicated = simulate(spec, hand_calibration());
  EXPECT_NEAR(replicated.steps[0].step_us, 1028, 1e-6);
  EXPECT_NEAR(replicated.steps[0].straggler, 1.0, 1e-9);
}

TEST(SimStepLoad, TopKSharesFollowGumbelMaxDrawsByHand) {
  // K = 1: the weights themselves; K = E: every expert in every token's set.
  EXPECT_NEAR(top_k_shares({3, 1}, 1)[0], 0.75, 1e-12);
  EXPECT_NEAR(top_k_shares({3, 1}, 2)[0], 0.5, 1e-12);
  EXPECT_NEAR(top_k_shares({2, 1, 1}, 3)[2], 1.0 / 3.0, 1e-12);
  // p = (1/2, 1/4, 1/4), K = 2: expert 0 is in the set with 1/2 + 2 (1/4)(1/2)/(3/4) = 5/6, each other
  // with 1/4 + (1/2)(1/4)/(1/2) + (1/4)(1/4)/(3/4) = 7/12; the shares are half of that.
  const std::vector<double> q = top_k_shares({2, 1, 1}, 2);
  EXPECT_NEAR(q[0], 5.0 / 12.0, 1e-12);
  EXPECT_NEAR(q[1], 7.0 / 24.0, 1e-12);
  EXPECT_NEAR(q[0] + q[1] + q[2], 1.0, 1e-12);
  EXPECT_THROW(top_k_shares({1, 1, 1, 1}, 4), std::invalid_argument);
}

TEST(SimStepLoad, ShadowingDecidedPerStepKeepsTheHotRowsHomeByHand) {
  // The hot-expert trace (expert 0 on rank 0: 750 rows from each rank; expert 1 on rank 1: 250 from
  // each). An expert of D = 100, H = 200 holds P = 40000 weights: moving it to the other rank costs
  // P (2 + 8) = 400000 bytes, worth it past 400000 / (8 D) = 500 crossing rows. Expert 0 has 750
  // crossing (rank 1's), expert 1 250: only expert 0 is shadowed.
  StepLoad load = step_load_from_tokens(hot_expert_load(), 2);
  shadow_hot_experts(load, 100, 200);
  EXPECT_EQ(load.shadowed_this_step, std::vector<int64_t>{0});
  EXPECT_EQ(load.replicas, 0) << "a copy for one step is not summed over replicas";
  EXPECT_EQ(load.rows_per_rank(), (std::vector<double>{750, 1250}));  // rank 1: its own 750 of expert 0, and 500 of expert 1
  EXPECT_EQ(load.sent(1, 0), 0);    // nothing of rank 1's goes to rank 0 any more
  EXPECT_EQ(load.sent(0, 1), 250);  // rank 0's rows of expert 1 still go
  // Its weights out (2 P bf16 bytes = 80 kB) and its gradients back (160 kB): both under the
  // curve's first point, 10 us each.
  const CostModel model(hand_calibration(), Cluster{1, 2}, hand_layer(2));
  EXPECT_NEAR(model.shadow_weights_us(load, false), 10, 1e-9);
  EXPECT_NEAR(model.shadow_weights_us(load, true), 10, 1e-9);
  // The simulated step: the straggler falls from 1.5x the mean rows to 1.25x.
  SimulationSpec spec;
  spec.cluster = Cluster{1, 2};
  spec.layer = hand_layer(2);
  spec.steps = 1;
  RoutingTrace trace;
  trace.loads.push_back(hot_expert_load());
  spec.trace = trace;
  EXPECT_NEAR(simulate(spec, hand_calibration()).steps[0].straggler, 1.5, 1e-9);
  spec.layer.shadow_per_step = true;
  EXPECT_NEAR(simulate(spec, hand_calibration()).steps[0].straggler, 1.25, 1e-9);
  // Experts too large to pay: nothing changes.
  StepLoad large = step_load_from_tokens(hot_expert_load(), 2);
  shadow_hot_experts(large, 1000, 2000);
  EXPECT_TRUE(large.shadowed_this_step.empty());
}

TEST(SimStepLoad, TutelsLayoutsMoveTheRowsByHand) {
  // Four ranks, four experts (one a rank); source s routes 100 rows to expert s and 10 to each other.
  BlockLoad load;
  load.sources = 4;
  load.experts = 4;
  for (int s = 0; s < 4; ++s) {
    for (int e = 0; e < 4; ++e) load.tokens.push_back(s == e ? 100 : 10);
  }
  // r = 0: every rank computes all four experts on its own 130 rows; nothing leaves it.
  StepLoad all = step_load_from_tokens(load, 4);
  apply_layout(all, 0);
  EXPECT_EQ(all.expert_rows_of(1), (std::vector<double>{10, 100, 10, 10}));
  EXPECT_DOUBLE_EQ(all.sent(1, 1), 130);
  EXPECT_DOUBLE_EQ(all.sent(1, 0), 0);
  // r = 2: ranks 0 and 1 each compute half of experts 0 and 1 on all 260 rows routed to them, so
  // every source sends its rows for experts 0 and 1 to both: rank 2 sends 20 rows to each.
  StepLoad sharded = step_load_from_tokens(load, 4);
  apply_layout(sharded, 2);
  EXPECT_EQ(sharded.expert_rows_of(0), (std::vector<double>{130, 130}));
  EXPECT_EQ(sharded.expert_rows_of(1), (std::vector<double>{130, 130}));
  EXPECT_DOUBLE_EQ(sharded.sent(2, 0), 20);
  EXPECT_DOUBLE_EQ(sharded.sent(2, 1), 20);
  EXPECT_DOUBLE_EQ(sharded.sent(0, 1), 110);
  LayerSpec layer = hand_layer(4);
  layer.layout = 3;  // does not divide R = 4
  EXPECT_THROW(check_layout(layer, 4), std::invalid_argument);
}

TEST(SimLayerStep, OverlapHidesExchangesAndPipeliningSplitsThem) {
  Calibration calibration = hand_calibration();
  // Exchanges worth hiding: more than the second micro-batch's launch of the experts costs again.
  calibration.all_to_all[0].curve = Curve{{1e3, 2e6}, {1, 2000}};
  SimulationSpec spec;
  spec.cluster = Cluster{1, 4};
  spec.layer = hand_layer(4);
  spec.steps = 2;
  const double plain = simulate(spec, calibration).median_step_us();
  spec.layer.overlap = true;
  spec.span_ranks = 1;
  std::vector<SimSpan> spans;  // rank 0's, of the first step
  const Simulation overlapped = simulate(spec, calibration, [&](const SimulatedStep& step) {
    if (spans.empty()) spans = step.spans;
  });
  EXPECT_LT(overlapped.median_step_us(), plain);
  // The order that hides them: the second micro-batch's rows go out before the first's come back,
  // and travel while the first's experts run.
  auto span_of = [&](const std::string& name) {
    for (const SimSpan& span : spans) {
      if (span.name == name) return span;
    }
    ADD_FAILURE() << "no span " << name;
    return SimSpan{};
  };
  EXPECT_LT(span_of("dispatch.1").start_us, span_of("combine_exchange.0").start_us);
  EXPECT_LT(span_of("dispatch.1").start_us, span_of("experts_forward.0").start_us + span_of("experts_forward.0").duration_us);
  spec.layer.overlap = false;
  spec.layer.chunks = 2;
  EXPECT_NE(simulate(spec, calibration).median_step_us(), plain);
}

// ---- routing ----

TEST(SimRouting, SyntheticSharesSumToOneAndFollowZipf) {
  const std::vector<double> uniform = synthetic_shares(parse_synthetic("uniform"), 8, 0);
  EXPECT_NEAR(std::accumulate(uniform.begin(), uniform.end(), 0.0), 1, 1e-12);
  EXPECT_DOUBLE_EQ(uniform[3], 0.125);
  const std::vector<double> zipf = synthetic_shares(parse_synthetic("zipf:1"), 8, 0);
  EXPECT_NEAR(std::accumulate(zipf.begin(), zipf.end(), 0.0), 1, 1e-12);
  const double hottest = *std::max_element(zipf.begin(), zipf.end());
  const double coldest = *std::min_element(zipf.begin(), zipf.end());
  EXPECT_NEAR(hottest / coldest, 8.0, 1e-9);  // 1 / 1^1 against 1 / 8^1
  // Drift: the hot expert moves one place every 3 steps.
  const SyntheticRouting drift = parse_synthetic("drift:1:3");
  const auto hot = [&](int64_t step) {
    const std::vector<double> p = synthetic_shares(drift, 8, step);
    return std::max_element(p.begin(), p.end()) - p.begin();
  };
  EXPECT_EQ(hot(0), hot(2));
  EXPECT_NE(hot(0), hot(3));
}

TEST(SimRouting, RefusesUnknownRouting) {
  for (const char* text : {"", "zipf", "zipf:-1", "zipf:nan", "drift:1", "drift:1:0", "normal"}) {
    EXPECT_THROW(parse_synthetic(text), std::invalid_argument) << text;
  }
}

TEST(SimRouting, StretchSplitsAndMergesNeighbours) {
  const std::vector<double> split = stretch_shares({0.5, 0.25, 0.25}, 6);
  EXPECT_EQ(split, (std::vector<double>{0.25, 0.25, 0.125, 0.125, 0.125, 0.125}));
  const std::vector<double> merged = stretch_shares({0.4, 0.1, 0.3, 0.2}, 2);
  EXPECT_NEAR(merged[0], 0.5, 1e-12);
  EXPECT_NEAR(merged[1], 0.5, 1e-12);
}

TEST(SimRouting, ReadsRoutingAndExpertLoadEventsAndRefusesARunWithout) {
  const std::filesystem::path dir = temp_dir("trace");
  {
    RunInfo info;
    info.kind = RunKind::train;
    info.name = "trace";
    RunWriter writer = RunWriter::create(dir / "one_gpu", info);
    writer.append(to_event(RoutingEvent{.step = 1, .layer = 0, .tokens_per_expert = {3, 1}}));
    writer.append(to_event(RoutingEvent{.step = 0, .layer = 0, .tokens_per_expert = {2, 2}}));
    RunWriter two = RunWriter::create(dir / "two_ranks", info);
    BlockLoad block;
    block.step = 4;
    block.sources = 2;
    block.experts = 2;
    block.tokens = {1, 2, 3, 4};
    two.append(expert_load_event(block));
    RunWriter none = RunWriter::create(dir / "no_counts", info);
    none.append(step_event(0, {{"loss", 1.0}}));
  }
  const RoutingTrace one = read_routing_trace(dir / "one_gpu");
  ASSERT_EQ(one.loads.size(), 2u);
  EXPECT_EQ(one.loads[0].step, 0);  // sorted by step
  EXPECT_EQ(one.loads[1].tokens, (std::vector<int64_t>{3, 1}));
  const RoutingTrace two = read_routing_trace(dir / "two_ranks");
  ASSERT_EQ(two.loads.size(), 1u);
  EXPECT_EQ(two.loads[0].sources, 2);
  EXPECT_EQ(two.loads[0].tokens, (std::vector<int64_t>{1, 2, 3, 4}));
  try {
    read_routing_trace(dir / "no_counts");
    FAIL() << "a run without counts was read";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("a trace without counts"), std::string::npos);
  }
  EXPECT_THROW(read_routing_trace(dir / "nonexistent"), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

// ---- calibration files ----

TEST(SimCalibration, RoundTripsAndRefusesOtherFiles) {
  const Calibration c = hand_calibration();
  const Calibration back = calibration_from_json(to_json(c), "test");
  EXPECT_EQ(back.device, c.device);
  EXPECT_EQ(back.layer_phases_us, c.layer_phases_us);
  EXPECT_EQ(back.all_to_all[0].curve.time_us, c.all_to_all[0].curve.time_us);
  EXPECT_EQ(back.count_exchange_us, c.count_exchange_us);
  nlohmann::json json = to_json(c);
  json["version"] = 99;
  EXPECT_THROW(calibration_from_json(json, "test"), std::invalid_argument);
  json = to_json(c);
  json.erase("layer_step_us");
  EXPECT_THROW(calibration_from_json(json, "test"), std::invalid_argument);
  json = to_json(c);
  json["all_to_all"] = nlohmann::json::array();
  EXPECT_THROW(calibration_from_json(json, "test"), std::invalid_argument);
  EXPECT_THROW(calibration_from_json(nlohmann::json{{"rows", 1}}, "test"), std::invalid_argument);
  EXPECT_TRUE(c.limited_to(1).all_to_all.empty());
}

// An ep_bench file as the benchmark writes it, reduced to what moe_sim reads.
nlohmann::json ep_bench_run(int64_t ranks, nlohmann::json rows) {
  return {{"benchmark", "ep_bench"}, {"device", "worked example (round numbers)"}, {"date", "2026-11-28"}, {"ranks", ranks},
          {"ranks_per_gpu", 1},      {"layer", {{"tokens_per_rank", 1000}, {"model_dim", 100}, {"hidden_dim", 200},
                                                 {"experts", std::max<int64_t>(2, ranks)}, {"top_k", 1}, {"block_size", 1}}},
          {"rows", rows}};
}

// ep_bench_run's layer as the simulator reads it, two micro-batches overlapped.
LayerSpec overlapped_layer_of_the_example() {
  LayerSpec layer;
  layer.tokens_per_rank = 1000;
  layer.model_dim = 100;
  layer.hidden_dim = 200;
  layer.experts = 2;
  layer.top_k = 1;
  layer.block_size = 1;
  layer.chunks = 1;
  layer.overlap = true;
  return layer;
}

TEST(SimCalibration, CalibratesFromEpBenchAndValidatesAgainstIt) {
  const std::filesystem::path dir = temp_dir("calibrate");
  const Calibration hand = hand_calibration();
  nlohmann::json phases1 = nlohmann::json::object(), phases2 = nlohmann::json::object();
  for (const auto& [name, us] : hand.layer_phases_us.at(1)) phases1[name] = {{"median_us", us}};
  for (const auto& [name, us] : hand.layer_phases_us.at(2)) phases2[name] = {{"median_us", us}};
  const nlohmann::json one = ep_bench_run(1, {{{"variant", "ep_layer d=1"}, {"size_bytes", 1}, {"time_us", 1000}, {"phases_rank0", phases1}},
                                              {{"variant", "ep_layer d=2"}, {"size_bytes", 1}, {"time_us", 1100}, {"phases_rank0", phases2}}});
  const nlohmann::json two = ep_bench_run(2, {{{"variant", "alltoall"}, {"size_bytes", 2e6}, {"time_us", 20}},
                                              {{"variant", "alltoall"}, {"size_bytes", 1e6}, {"time_us", 10}},
                                              {{"variant", "count_exchange"}, {"size_bytes", 16}, {"time_us", 7}},
                                              {{"variant", "ep_layer d=1"}, {"size_bytes", 1}, {"time_us", 940}},
                                              {{"variant", "ep_layer d=1 overlap"}, {"size_bytes", 1}, {"time_us", 990}}});
  const nlohmann::json four = ep_bench_run(4, {{{"variant", "alltoall"}, {"size_bytes", 1.5e6}, {"time_us", 20}}});
  std::ofstream(dir / "one.json") << one.dump();
  std::ofstream(dir / "runs.json") << nlohmann::json{{"runs", {two, four}}}.dump();
  std::ofstream(dir / "other.json") << nlohmann::json{{"benchmark", "moe_bench"}}.dump();
  const Calibration c = calibrate_from_ep_bench({dir / "one.json", dir / "runs.json"}, "test");
  EXPECT_EQ(c.gpus_measured, 4);
  ASSERT_EQ(c.all_to_all.size(), 2u);
  EXPECT_EQ(c.all_to_all[0].curve.bytes_per_rank, (std::vector<double>{1e6, 2e6}));  // sorted
  EXPECT_DOUBLE_EQ(c.count_exchange_us.at(2), 7);
  EXPECT_DOUBLE_EQ(c.layer_step_us.at(2), 1100);
  EXPECT_THROW(calibrate_from_ep_bench({dir / "other.json"}, "test"), std::invalid_argument);

  // Calibrated on R <= 2: the R = 2 layer row is predicted (938 us by hand, against 940), the
  // R = 2 all-to-all rows are the calibration's own, the R = 4 row is a hold-out. The overlap row is
  // the same step as two micro-batches (the simulator's layer.overlap).
  const std::vector<ValidationRow> rows = validate_against_measurements(c.limited_to(2), {dir / "one.json", dir / "runs.json"});
  ASSERT_EQ(rows.size(), 7u);
  const ValidationRow& layer = rows[4];
  EXPECT_EQ(layer.what, "ep_layer d=1");
  EXPECT_EQ(layer.ranks, 2);
  EXPECT_FALSE(layer.calibration);
  EXPECT_NEAR(layer.predicted_us, 938, 1e-6);
  const ValidationRow& overlapped = rows[5];
  EXPECT_EQ(overlapped.what, "ep_layer d=1 overlap");
  SimulationSpec spec;
  spec.cluster = Cluster{1, 2};
  spec.layer = overlapped_layer_of_the_example();
  spec.steps = 1;
  spec.span_ranks = 0;
  EXPECT_NEAR(overlapped.predicted_us, simulate(spec, c.limited_to(2)).median_step_us(), 1e-6);
  EXPECT_GT(std::abs(overlapped.predicted_us - layer.predicted_us), 1.0) << "the overlap row read as the plain one";
  EXPECT_TRUE(rows[0].calibration);  // the one-GPU layer
  EXPECT_TRUE(rows[2].calibration);  // an all-to-all point of the curve
  EXPECT_TRUE(rows[6].held_out);
  const ValidationSummary summary = summarize(rows);
  EXPECT_EQ(summary.rows, 3);
  EXPECT_EQ(summary.held_out_rows, 1);
  EXPECT_THROW(validate_against_measurements(c, {dir / "other.json"}), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

// sigma by hand: on one GPU the experts take 300 us at d = 1 and 400 at d = 2 (the chunks' own
// cost, +100); on two, 310 and 440 (+130), with 20 + 20 us of exchange at d = 1, of which half
// runs beside the experts at d = 2. sigma = (130 - 100) / (0.5 x 40) = 1.5.
TEST(SimCalibration, FitsTheOverlapContentionFromThePipelinedPhases) {
  const std::filesystem::path dir = temp_dir("contention");
  const Calibration hand = hand_calibration();
  auto phases = [](const std::map<std::string, double>& by_name) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, us] : by_name) out[name] = {{"median_us", us}};
    return out;
  };
  const nlohmann::json one =
      ep_bench_run(1, {{{"variant", "ep_layer d=1"}, {"size_bytes", 1}, {"time_us", 1000}, {"phases_rank0", phases(hand.layer_phases_us.at(1))}},
                       {{"variant", "ep_layer d=2"}, {"size_bytes", 1}, {"time_us", 1100}, {"phases_rank0", phases(hand.layer_phases_us.at(2))}}});
  const nlohmann::json two = ep_bench_run(
      2, {{{"variant", "alltoall"}, {"size_bytes", 1e6}, {"time_us", 10}},
          {{"variant", "count_exchange"}, {"size_bytes", 16}, {"time_us", 7}},
          {{"variant", "ep_layer d=1"}, {"size_bytes", 1}, {"time_us", 1000},
           {"phases_rank0", phases({{"ep_experts", 310}, {"ep_dispatch", 20}, {"ep_combine_exchange", 20}})}},
          {{"variant", "ep_layer d=2"}, {"size_bytes", 1}, {"time_us", 1150}, {"phases_rank0", phases({{"ep_experts", 440}})}}});
  std::ofstream(dir / "one.json") << one.dump();
  std::ofstream(dir / "two.json") << two.dump();
  const Calibration c = calibrate_from_ep_bench({dir / "one.json", dir / "two.json"}, "test");
  EXPECT_NEAR(c.overlap_contention.sigma, 1.5, 1e-12);
  EXPECT_EQ(c.overlap_contention.ranks, 2);
  const Calibration again = calibration_from_json(to_json(c), "round trip");
  EXPECT_DOUBLE_EQ(again.overlap_contention.sigma, 1.5);
  EXPECT_EQ(c.limited_to(1).overlap_contention.ranks, 0);  // the hold-out drops what two GPUs gave
  // The d = 2 row sigma came from is the calibration's own; d = 1 at R = 2 is still predicted.
  const std::vector<ValidationRow> rows = validate_against_measurements(c, {dir / "two.json"});
  ASSERT_EQ(rows.size(), 3u);  // the all-to-all point, d = 1, d = 2
  EXPECT_EQ(rows[1].what, "ep_layer d=1");
  EXPECT_FALSE(rows[1].calibration);
  EXPECT_EQ(rows[2].what, "ep_layer d=2");
  EXPECT_TRUE(rows[2].calibration);
  std::filesystem::remove_all(dir);
}

// A bundled validation file (notebooks_data/sim/) is what the model predicts today from its calibration
// and measured runs, row for row: a change to the model shows here, and the file and lesson 09's
// table must then be made again. Returns the rows predicted now; none when the file is not in this checkout.
std::vector<ValidationRow> expect_bundled_validation(const std::string& validation, const std::string& calibration,
                                                     const std::vector<std::string>& bench_files) {
  const std::filesystem::path sim = "notebooks_data/sim", bench = "notebooks_data/bench";
  const std::filesystem::path stored_path = sim / validation;
  if (!std::filesystem::exists(stored_path)) return {};
  const nlohmann::json stored = nlohmann::json::parse(std::ifstream(stored_path));
  std::vector<std::filesystem::path> files;
  for (const std::string& name : bench_files) files.push_back(bench / name);
  const std::vector<ValidationRow> rows = validate_against_measurements(load_calibration(sim / calibration), files);
  EXPECT_EQ(rows.size(), stored.at("rows").size());
  for (size_t i = 0; i < std::min(rows.size(), stored.at("rows").size()); ++i) {
    const nlohmann::json& want = stored["rows"][i];
    EXPECT_EQ(rows[i].what, want.at("what").get<std::string>()) << "row " << i;
    EXPECT_EQ(rows[i].ranks, want.at("ranks").get<int64_t>()) << rows[i].what;
    EXPECT_DOUBLE_EQ(rows[i].measured_us, want.at("measured_us").get<double>()) << rows[i].what;
    EXPECT_NEAR(rows[i].predicted_us, want.at("predicted_us").get<double>(), 1e-6 * want.at("predicted_us").get<double>())
        << rows[i].what << " at R = " << rows[i].ranks;
  }
  return rows;
}

// One four-GPU host's calibration (from its one and two GPUs) and its runs on one, two and four.
TEST(SimCalibration, TheBundledOneHostValidationIsWhatTheModelPredicts) {
  std::vector<std::string> files;
  for (const char* name : {"ep_bench_calibrate_r1", "train_brown_step300_r1", "train_brown_step300_overlap_r1",
                           "ep_bench_calibrate_lm_layer_r1", "ep_bench_calibrate_lm_layer_r2", "ep_bench_calibrate_lm_layer_r4",
                           "ep_bench_calibrate_r2", "ep_bench_calibrate_r4", "train_brown_step300_r2",
                           "train_brown_step300_overlap_r2", "train_brown_step300_r4", "train_brown_step300_overlap_r4"}) {
    files.push_back(std::string(name) + "_h200x4_2026-11-29.json");
  }
  const std::vector<ValidationRow> rows =
      expect_bundled_validation("validation_h200x4_2026-11-29.json", "calibration_h200x2_2026-11-29.json", files);
  if (rows.empty()) GTEST_SKIP() << "notebooks_data/sim/validation_h200x4_2026-11-29.json is not in this checkout";
  const ValidationSummary summary = summarize(rows);
  EXPECT_EQ(summary.rows, 23);  // 26 measured beyond one GPU, 3 of them (R = 2, d > 1) sigma's own
  EXPECT_EQ(summary.held_out_rows, 15);
  EXPECT_LT(summary.median_abs_error, 0.05) << "the median target";
  EXPECT_LT(summary.held_out_max_abs_error, 0.15) << "the hold-out target";
}

// The placements: every placement row of ep_bench under Zipf routing on another host of the kind.
TEST(SimCalibration, TheBundledPlacementValidationIsWhatTheModelPredicts) {
  std::vector<std::string> files;
  for (const char* name : {"zipf1.0_lm_shape", "zipf1.0_tutel_shape", "zipf1.2_lm_shape", "zipf1.2_tutel_shape"}) {
    files.push_back("ep_bench_placements_" + std::string(name) + "_h200x2_2026-11-29.json");
  }
  const std::vector<ValidationRow> rows =
      expect_bundled_validation("validation_placements_h200x2_2026-11-29.json", "calibration_h200x2_2026-11-29.json", files);
  if (rows.empty()) GTEST_SKIP() << "notebooks_data/sim/validation_placements_h200x2_2026-11-29.json is not in this checkout";
  const ValidationSummary summary = summarize(rows);
  EXPECT_EQ(summary.rows, 24);
  EXPECT_LT(summary.median_abs_error, 0.05) << "the median target";
  EXPECT_LT(summary.max_abs_error, 0.10) << "each row's target";
}

TEST(SimLanguageModel, TheStepOnTwoGpusSwapsTheLocalExchangesForTheClusters) {
  // One MoE block of the worked example's layer (D = 100, H = 200, E = 2, K = 1, 1000 tokens a
  // GPU): on two GPUs its count exchange (7 us) and four all-to-alls of 500 rows (10 us each) add
  // 47 us; the one-GPU run's local exchanges (0.3 ms) and optimizer go; the optimizer comes back for
  // the rank's parameters (one of the two experts) and the dense gradients are all-reduced: the
  // block's under the 1 ms backward, the embeddings' after it, exposed (below the curve's first
  // point: 10 us). One GPU's prediction is its measured step.
  Calibration c = hand_calibration();
  c.language_model.config = {{"model_dim", 100}, {"num_layers", 1},       {"num_heads", 4}, {"seq_len", 10},
                             {"num_experts", 2}, {"top_k", 1},            {"expert_hidden_dim", 200},
                             {"block_size", 1},  {"dense_hidden_dim", 64}, {"batch", 100}};
  c.language_model.step_ms = 10;
  c.language_model.phase_ms = {{"attention", 2}, {"moe/ep_dispatch", 0.1}, {"moe/ep_combine_exchange", 0.1},
                               {"moe/ep_count_exchange", 0.1}, {"optimizer", 1.0}, {"backward_attention", 1.0}};
  c.language_model.tokens_per_rank = 1000;
  EXPECT_DOUBLE_EQ(predict_language_model_step(c, Cluster{1, 1}).step_ms, 10);
  const LanguageModelPrediction two = predict_language_model_step(c, Cluster{1, 2});
  EXPECT_NEAR(two.moe_ms, 0.047, 1e-12);
  EXPECT_NEAR(two.all_reduce_ms, 0.010, 1e-12);
  EXPECT_GT(two.optimizer_ms, 0.5);  // the two experts are most of the parameters
  EXPECT_LT(two.optimizer_ms, 1.0);
  EXPECT_NEAR(two.step_ms, 10 - 0.3 - 1.0 + two.moe_ms + two.optimizer_ms + two.all_reduce_ms, 1e-12);
  // With the expert-parallel layer measured at the model's shape on one GPU (the worked example's
  // layer itself), the MoE block is that layer's two-GPU step, 980 us, without its SGD (30 us) and
  // its router all-reduce (7 us: the model sums the router's gradient with the block's others), in
  // place of the one-GPU run's MoE path (moe + backward_moe = 3 ms). The step runs on the timeline:
  // one block, so its gradients' sum waits for its backward and nothing hides it.
  c.language_model.phase_ms["moe"] = 1.0;
  c.language_model.phase_ms["backward_moe"] = 2.0;
  c.language_model.layer = {c.layer, c.layer_step_us, c.layer_phases_us, {}};
  const LanguageModelPrediction layer = predict_language_model_step(c, Cluster{1, 2});
  EXPECT_NEAR(layer.moe_ms, 0.943, 1e-9);
  EXPECT_NEAR(layer.step_ms, 10 - 3.0 - 1.0 + 0.943 + layer.optimizer_ms + layer.all_reduce_ms, 1e-9);
  EXPECT_GT(layer.all_reduce_ms, two.all_reduce_ms);
  // Two micro-batches overlapped need the overlapped one-GPU step; with it, one GPU's prediction is
  // that step, and on two GPUs each half's exchanges run while the other half computes: the step
  // costs less than the plain one plus what halving costs on one GPU (1 ms here).
  EXPECT_THROW(predict_language_model_step(c, Cluster{1, 2}, {.overlap = true}), std::invalid_argument);
  c.language_model.overlapped_step_ms = 11;
  EXPECT_DOUBLE_EQ(predict_language_model_step(c, Cluster{1, 1}, {.overlap = true}).step_ms, 11);
  const LanguageModelPrediction overlapped = predict_language_model_step(c, Cluster{1, 2}, {.overlap = true});
  EXPECT_GT(overlapped.step_ms, layer.step_ms);
  EXPECT_LT(overlapped.step_ms, layer.step_ms * 1.1);
  // Weak scaling: the same model with E experts, a multiple of the ranks. With 4 experts each rank
  // updates 2, all the one-GPU run's experts: the optimizer takes its one-GPU time.
  EXPECT_THROW(predict_language_model_step(c, Cluster{1, 2}, {.experts = 3}), std::invalid_argument);
  const LanguageModelPrediction four = predict_language_model_step(c, Cluster{1, 2}, {.experts = 4});
  EXPECT_GT(four.moe_ms, 0);
  EXPECT_GT(four.optimizer_ms, layer.optimizer_ms);
  EXPECT_NEAR(four.optimizer_ms, 1.0, 1e-12);
  c.language_model = {};
  EXPECT_THROW(predict_language_model_step(c, Cluster{1, 2}), std::invalid_argument);
}

TEST(SimLanguageModel, ABenchmarkIsPredictedWithTheRoutingOfItsTimedStep) {
  // The model above with the layer measured at its shape. A two-GPU benchmark that wrote its timed
  // step's routing ("routing_tokens", [block][source rank][expert]) is predicted with it: every
  // slot on expert 0 puts all rows on rank 0, which then computes twice the uniform routing's rows,
  // so its step is longer than the same benchmark's without the routing.
  const std::filesystem::path dir = temp_dir("own_routing");
  Calibration c = hand_calibration();
  c.language_model.config = {{"model_dim", 100}, {"num_layers", 1},       {"num_heads", 4}, {"seq_len", 10},
                             {"num_experts", 2}, {"top_k", 1},            {"expert_hidden_dim", 200},
                             {"block_size", 1},  {"dense_hidden_dim", 64}, {"batch", 100}};
  c.language_model.step_ms = 10;
  c.language_model.phase_ms = {{"attention", 2}, {"moe", 1.0}, {"backward_moe", 2.0}, {"optimizer", 1.0}};
  c.language_model.tokens_per_rank = 1000;
  c.language_model.layer = {c.layer, c.layer_step_us, c.layer_phases_us, {}};
  nlohmann::json run = {{"ranks", 2}, {"tokens_per_step", 2000}, {"median_step_ms", 9.0}, {"device", "test GPU"},
                        {"date", "2026-11-28"}, {"config", c.language_model.config}, {"phase_ms", {{"attention", 2}}}};
  std::ofstream(dir / "uniform.json") << run.dump();
  run["routing_tokens"] = {{{1000, 0}, {1000, 0}}};
  std::ofstream(dir / "skewed.json") << run.dump();
  const std::vector<ValidationRow> rows = validate_against_measurements(c, {dir / "uniform.json", dir / "skewed.json"});
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].what, "language model step");
  EXPECT_EQ(rows[1].what, "language model step (its own routing)");
  EXPECT_GT(rows[1].predicted_us, rows[0].predicted_us + 100);
  run["routing_tokens"] = {{{1000, 0}, {1000}}};  // source ranks of different expert counts
  std::ofstream(dir / "bad.json") << run.dump();
  EXPECT_THROW(validate_against_measurements(c, {dir / "bad.json"}), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

TEST(SimSimulate, AThousandRanksAHundredStepsStayCheap) {
  // The scale the lesson uses: 128 nodes of 8 GPUs. Bounded work, no timing asserted: the steps
  // are all there and the busiest rank of a Zipf routing straggles.
  SimulationSpec spec;
  spec.cluster = Cluster{128, 8};
  spec.layer = hand_layer(2048);
  spec.steps = 3;
  spec.synthetic = parse_synthetic("zipf:0.8");
  spec.span_ranks = 2;
  int64_t spans = 0;
  const Simulation run = simulate(spec, hand_calibration(), [&](const SimulatedStep& step) { spans += static_cast<int64_t>(step.spans.size()); });
  ASSERT_EQ(run.steps.size(), 3u);
  EXPECT_GT(run.steps[0].straggler, 1.5);
  EXPECT_GT(spans, 0);
  for (const SimulatedStep& step : run.steps) EXPECT_GT(step.step_us, 0);
}

}  // namespace
}  // namespace moe::sim
