// test_hostile_runs.cpp: records that are damaged or odd but fair, and what the viewer's model
// makes of them: an all-to-all matrix of the wrong size for the run's ranks, a finite loss too large
// to plot, a line whose number is beyond double's range (the lines after it must still be read),
// and a run cut short (killed) against one that ended normally; no window.
//   ctest --test-dir build -R ViewerHostileRuns
#include <gtest/gtest.h>

#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, _exit

#include <algorithm>
#include <cmath>
#include <string>

#include "run_list.h"
#include "run_model.h"
#include "run_record.h"  // RunWriter
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

using nlohmann::json;
using testing::TempDir;

bool AnyWarningHas(const RunModel& m, const std::string& text) {
  return std::any_of(m.warnings.begin(), m.warnings.end(),
                     [&](const std::string& w) { return w.find(text) != std::string::npos; });
}

std::string AllWarnings(const RunModel& m) {
  std::string all;
  for (const std::string& w : m.warnings) all += w + "\n";
  return all;
}

const char* kTwoRankRun =
    R"({"schema_version":1,"kind":"train","name":"two","start_time":"2026-11-22T00:00:00.000Z","world_size":2})";

TEST(ViewerHostileRuns, AllToAllMatrixOfTheWrongSizeIsWarnedAboutAndStillDrawn) {
  const std::string events =
      R"({"type":"alltoall","step":1,"bytes":[[0,5],[7,0]],"duration_us":2})" "\n"
      R"({"type":"alltoall","step":2,"bytes":[[0,1,2],[3,0,4],[5,6,0]],"duration_us":2})" "\n"
      R"({"type":"alltoall","step":3,"bytes":[[9]],"duration_us":2})" "\n";
  const RunModel m = RunModel::from_text(kTwoRankRun, events);
  ASSERT_TRUE(m.error.empty()) << m.error;
  EXPECT_EQ(m.alltoall_wrong_size, 2);
  EXPECT_TRUE(AnyWarningHas(m, "a 3 x 3 byte matrix in a run of 2 ranks")) << AllWarnings(m);
  ASSERT_EQ(m.alltoalls.size(), 3u);  // every matrix kept, drawn as recorded
  EXPECT_EQ(m.alltoalls[1].ranks, 3);
  // A matrix that matches the run's ranks raises nothing.
  const RunModel fine = RunModel::from_text(kTwoRankRun, R"({"type":"alltoall","step":1,"bytes":[[0,5],[7,0]],"duration_us":2})" "\n");
  EXPECT_EQ(fine.alltoall_wrong_size, 0);
  EXPECT_TRUE(fine.warnings.empty()) << AllWarnings(fine);
}

TEST(ViewerHostileRuns, FiniteLossBeyondThePlottingRangeIsLeftOutAndCounted) {
  const std::string events =
      R"({"type":"step","step":1,"loss":2.5})" "\n"
      R"({"type":"step","step":2,"loss":1.79e308})" "\n"
      R"({"type":"step","step":3,"loss":2.25,"lr":-1.7e308})" "\n"
      R"({"type":"step","step":4,"loss":2.0,"lr":0.001})" "\n";
  const RunModel m = RunModel::from_text(testing::kRunJson, events);
  ASSERT_TRUE(m.error.empty()) << m.error;
  EXPECT_EQ(m.values_beyond_plot.at("loss"), 1);
  EXPECT_EQ(m.values_beyond_plot.at("lr"), 1);
  EXPECT_TRUE(AnyWarningHas(m, "step metric 'loss' at step 2 is 1.79e+308, beyond the plotting range")) << AllWarnings(m);
  // The rest of the curve stays, and its span is a finite number an axis can be built on.
  const Series& loss = m.step_metrics.at("loss");
  EXPECT_EQ(loss.steps, (std::vector<double>{1, 3, 4}));
  const auto [lo, hi] = std::minmax_element(loss.values.begin(), loss.values.end());
  EXPECT_TRUE(std::isfinite(*hi - *lo));
  EXPECT_EQ(m.step_metrics.at("lr").steps, (std::vector<double>{4}));
  EXPECT_EQ(m.last_step, 4);
}

TEST(ViewerHostileRuns, BadLineIsCountedByItsNumberAndTheLaterLinesAreRead) {
  TempDir dir;
  const std::string events =
      R"({"type":"step","step":1,"loss":2.5})" "\n"
      R"({"type":"step","step":2,"loss":1e400})" "\n"
      R"({"type":"step","step":3,"loss":2.25})" "\n"
      "\x01garbage\n"
      R"({"type":"step","step":5,"loss":2.0})" "\n";
  testing::write_text(dir.path() / "run.json", testing::kRunJson);
  testing::write_text(dir.path() / "events.jsonl", events);
  // Read whole, streamed in tiny blocks, and from memory: the same answer.
  for (const RunModel& m : {RunModel::load(dir.path()), RunModel::load(dir.path(), 5),
                            RunModel::from_text(testing::kRunJson, events)}) {
    ASSERT_TRUE(m.error.empty()) << m.error;
    EXPECT_EQ(m.bad_lines, 2);
    EXPECT_TRUE(AnyWarningHas(m, "events.jsonl line 2")) << AllWarnings(m);
    EXPECT_TRUE(AnyWarningHas(m, "events.jsonl line 4")) << AllWarnings(m);
    EXPECT_EQ(m.step_metrics.at("loss").steps, (std::vector<double>{1, 3, 5}));
    EXPECT_EQ(m.last_step, 5);
  }
  // Followed live, a bad line that arrives later is skipped the same way and the following goes on.
  RunModel live = RunModel::follow(dir.path());
  EXPECT_EQ(live.bad_lines, 2);
  testing::write_text(dir.path() / "events.jsonl", events + "{\"type\":\"step\",\"step\":6,\"loss\":-1e999}\n" +
                                                       "{\"type\":\"step\",\"step\":7,\"loss\":1.5}\n");
  live.poll();
  EXPECT_TRUE(live.error.empty()) << live.error;
  EXPECT_EQ(live.bad_lines, 3);
  EXPECT_TRUE(AnyWarningHas(live, "events.jsonl line 6")) << AllWarnings(live);
  EXPECT_EQ(live.last_step, 7);
}

// A lesson killed mid-run: the child process writes a few events and dies without closing its
// writer (no destructor runs under _exit), as under kill -9.
TEST(ViewerHostileRuns, KilledRunIsPartialAndAClosedOneIsNot) {
  TempDir dir;
  RunInfo info{.kind = RunKind::lesson, .name = "cut"};
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    RunWriter writer = RunWriter::create(dir.path() / "cut", info);
    writer.append(step_event(1, {{"loss", 2.0}}));
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  info.name = "whole";
  { RunWriter::create(dir.path() / "whole", info).append(step_event(1, {{"loss", 2.0}})); }
  // A record from before the "finished" field: neither partial nor finished, read as before.
  testing::write_text(dir.path() / "old" / "run.json", testing::kRunJson);
  testing::write_text(dir.path() / "old" / "events.jsonl", "{\"type\":\"step\",\"step\":1}\n");

  const RunModel cut = RunModel::load(dir.path() / "cut");
  ASSERT_TRUE(cut.error.empty()) << cut.error;
  EXPECT_TRUE(cut.partial);
  EXPECT_EQ(cut.last_step, 1);
  EXPECT_FALSE(RunModel::load(dir.path() / "whole").partial);
  EXPECT_FALSE(RunModel::load(dir.path() / "old").partial);

  const std::vector<RunEntry> listed = list_runs(dir.path());
  ASSERT_EQ(listed.size(), 3u);
  for (const RunEntry& e : listed) EXPECT_EQ(e.partial, e.name == "cut") << e.name;
}

TEST(ViewerHostileRuns, FollowedRunStopsBeingPartialWhenItsWriterCloses) {
  TempDir dir;
  RunWriter writer = RunWriter::create(dir.path(), RunInfo{.kind = RunKind::train, .name = "live"});
  writer.append(step_event(1, {{"loss", 2.0}}));
  RunModel live = RunModel::follow(dir.path());
  EXPECT_TRUE(live.partial);
  live.poll();
  EXPECT_TRUE(live.partial);
  writer.append(step_event(2, {{"loss", 1.9}}));
  writer.close();
  live.poll();
  EXPECT_FALSE(live.partial);
  EXPECT_EQ(live.last_step, 2);
}

}  // namespace
}  // namespace moe::viewer
