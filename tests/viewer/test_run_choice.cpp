// test_run_choice.cpp: which runs each panel shows first (viewer/model/run_choice.h); no window.
//   ctest --test-dir build -R ViewerRunChoice
#include <gtest/gtest.h>

#include <string>

#include "run_choice.h"
#include "run_model.h"

namespace moe::viewer {
namespace {

// A run in memory: run.json of `kind` on `device`, and the given event lines.
RunModel MakeRun(const std::string& kind, const std::string& device, const std::string& events) {
  const std::string info = R"({"schema_version":1,"kind":")" + kind + R"(","name":")" + kind +
                           R"(","start_time":"2026-11-25T00:00:00.000Z","devices":[")" + device + R"("]})";
  RunModel m = RunModel::from_text(info, events);
  EXPECT_EQ(m.error, "") << kind;
  return m;
}

const char* kRouting = R"({"type":"routing","step":0,"layer":0,"tokens_per_expert":[3,5]})" "\n";
const char* kOffload = R"({"type":"offload","step":0,"layer":0,"hits":3,"misses":1,"stall_us":2.5})" "\n";
const char* kStep = R"({"type":"step","step":0,"loss":2.5})" "\n";

TEST(ViewerRunChoice, GpuRunsAreKnownByKindOrDevice) {
  RunSummary s;
  s.kind = "lesson";
  s.devices = {"CPU (Eigen)"};
  EXPECT_FALSE(is_gpu_run(s));
  s.devices = {"reads GPU training runs from notebooks_data/runs"};  // lesson 08's devices line
  EXPECT_FALSE(is_gpu_run(s));
  s.kind = "";
  s.devices = {"NVIDIA H100 80GB HBM3"};
  EXPECT_TRUE(is_gpu_run(s));
  s.devices = {};
  s.kind = "infer";
  EXPECT_TRUE(is_gpu_run(s));
}

TEST(ViewerRunChoice, GpuRunSortsBeforeLessonRun) {
  // Both hold routing; the lesson run comes first in the list given, the GPU run first in the panel.
  const RunModel lesson = MakeRun("lesson", "CPU", kRouting);
  const RunModel gpu = MakeRun("train", "NVIDIA H200", kRouting);
  const PanelChoice c = choose_runs("routing", {run_holdings(lesson), run_holdings(gpu)});
  ASSERT_EQ(c.order.size(), 2u);
  EXPECT_EQ(c.order[0], 1u);
  EXPECT_EQ(c.order[1], 0u);
  EXPECT_EQ(c.with_data, 2u);
}

TEST(ViewerRunChoice, SimulatedRunIsMarkedAndSortsAfterMeasuredRuns) {
  // moe_sim's run names the calibration's GPU among its devices, but nothing ran on one: it is
  // marked simulated, is not a GPU run, and comes after the measured GPU and lesson runs.
  const std::string info = R"({"schema_version":1,"kind":"train","name":"sim","start_time":"2026-11-28T00:00:00.000Z",)"
                           R"("devices":["simulated: NVIDIA H200 x 1024"],"extra":{"simulated":true}})";
  const RunModel simulated = RunModel::from_text(info, kRouting);
  ASSERT_EQ(simulated.error, "");
  EXPECT_TRUE(simulated.summary.simulated);
  EXPECT_FALSE(simulated.summary.synthetic);
  EXPECT_FALSE(is_gpu_run(simulated.summary));
  const RunModel lesson = MakeRun("lesson", "CPU", kRouting);
  const RunModel gpu = MakeRun("train", "NVIDIA H200", kRouting);
  const PanelChoice c = choose_runs("routing", {run_holdings(simulated), run_holdings(lesson), run_holdings(gpu)});
  ASSERT_EQ(c.order.size(), 3u);
  EXPECT_EQ(c.order[0], 2u);
  EXPECT_EQ(c.order[1], 1u);
  EXPECT_EQ(c.order[2], 0u);
}

TEST(ViewerRunChoice, RunWithoutThePanelsDataIsNotAmongTheFirst) {
  // Four GPU runs without offload events ahead of one lesson run... and one offload run last in
  // the list: the offload panel shows the offload run first, even before the GPU runs.
  std::vector<RunHoldings> held;
  for (int i = 0; i < 4; ++i) held.push_back(run_holdings(MakeRun("train", "NVIDIA H200", std::string(kStep) + kRouting)));
  held.push_back(run_holdings(MakeRun("lesson", "CPU", kRouting)));
  held.push_back(run_holdings(MakeRun("infer", "NVIDIA H100 80GB HBM3", kOffload)));
  const PanelChoice offload = choose_runs("offload", held);
  EXPECT_EQ(offload.with_data, 1u);
  EXPECT_EQ(offload.order.front(), 5u);
  // The curves: the four training runs, then the rest.
  const PanelChoice curves = choose_runs("curves", held);
  EXPECT_EQ(curves.with_data, 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(holds_panel_data(held[curves.order[i]], "curves"));
  EXPECT_FALSE(holds_panel_data(held[curves.order[4]], "curves"));
  // Routing: the GPU runs, then the lesson run; the decoding run (no routing) last.
  const PanelChoice routing = choose_runs("routing", held);
  EXPECT_EQ(routing.with_data, 5u);
  EXPECT_EQ(routing.order[4], 4u);
  EXPECT_EQ(routing.order[5], 5u);
}

TEST(ViewerRunChoice, AllToAllMatricesLeadTheTimelinePanel) {
  RunHoldings gpu_spans, decoding, lesson_matrices;
  gpu_spans.gpu = decoding.gpu = true;
  gpu_spans.alltoall = decoding.alltoall = lesson_matrices.alltoall = true;
  decoding.offload = true;
  lesson_matrices.alltoall_bytes = true;
  const PanelChoice c = choose_runs("alltoall", {decoding, gpu_spans, lesson_matrices});
  EXPECT_EQ(c.order, (std::vector<size_t>{2, 1, 0}));
}

TEST(ViewerRunChoice, SyntheticRunsComeAfterRealOnes) {
  RunHoldings real, synthetic;
  real.routing = synthetic.routing = true;
  synthetic.synthetic = true;
  const PanelChoice c = choose_runs("routing", {synthetic, real});
  EXPECT_EQ(c.order[0], 1u);
}

TEST(ViewerRunChoice, EmptyPanelNamesTheProgramThatWritesItsData) {
  const RunModel lesson = MakeRun("lesson", "CPU", kRouting);
  const PanelChoice c = choose_runs("offload", {run_holdings(lesson)});
  EXPECT_EQ(c.with_data, 0u);
  EXPECT_EQ(c.order.size(), 1u);
  EXPECT_NE(std::string(panel_data_writers("offload")).find("moe_generate --run-dir"), std::string::npos);
  EXPECT_NE(std::string(panel_data_writers("offload")).find("offload_bench --record-dir"), std::string::npos);
  EXPECT_NE(std::string(panel_data_writers("alltoall")).find("lessons 06/07"), std::string::npos);
  EXPECT_NE(std::string(panel_data_writers("topology")).find("moe_train"), std::string::npos);
  EXPECT_NE(std::string(panel_data_writers("topology")).find("lesson"), std::string::npos);
  for (const char* panel : {"summary", "curves", "routing", "tokens", "topology", "alltoall", "offload"}) {
    EXPECT_STRNE(panel_data_writers(panel), "") << panel;
    EXPECT_STRNE(panel_data_name(panel), "data") << panel;
  }
}

}  // namespace
}  // namespace moe::viewer
