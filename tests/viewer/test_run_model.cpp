// test_run_model.cpp: RunModel (loading, live following, bad events), the imbalance statistics and
// the run list; no window.   ctest --test-dir build -R ViewerRunModel
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <sys/stat.h>  // mkfifo

#include "run_list.h"
#include "run_model.h"
#include "synthetic_run.h"
#include "viewer_test_support.h"

namespace moe::viewer {
namespace {

using testing::TempDir;

TEST(ViewerRunModel, StatisticsOfKnownRows) {
  // Balanced: max/mean 1, CV 0, entropy 1.
  RoutingStats s = routing_stats({10, 10, 10, 10}, {});
  EXPECT_DOUBLE_EQ(s.max_over_mean, 1.0);
  EXPECT_DOUBLE_EQ(s.coefficient_of_variation, 0.0);
  EXPECT_NEAR(s.routing_entropy, 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.dropped_fraction, 0.0);
  // Everything on one expert of 4: max/mean 4, CV sqrt(3), entropy 0.
  s = routing_stats({0, 0, 0, 40}, {0, 0, 0, 30});
  EXPECT_DOUBLE_EQ(s.max_over_mean, 4.0);
  EXPECT_NEAR(s.coefficient_of_variation, std::sqrt(3.0), 1e-12);
  EXPECT_NEAR(s.routing_entropy, 0.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.dropped_fraction, 0.75);
  // Empty and all-zero rows give zeros, not NaN.
  s = routing_stats({}, {});
  EXPECT_EQ(s.max_over_mean, 0.0);
  s = routing_stats({0, 0}, {});
  EXPECT_EQ(s.routing_entropy, 0.0);
}

TEST(ViewerRunModel, LoadsSyntheticRunWithEveryEventType) {
  TempDir dir;
  SyntheticRunOptions o{.steps = 30, .experts = 8, .layers = 3, .ranks = 2, .tokens_every = 10};
  write_synthetic_run(dir.path() / "run", o);
  RunModel m = RunModel::load(dir.path() / "run");
  ASSERT_EQ(m.error, "");
  EXPECT_TRUE(m.summary.synthetic);
  EXPECT_EQ(m.first_step, 0);
  EXPECT_EQ(m.last_step, 29);
  ASSERT_EQ(m.routing.size(), 3u);
  EXPECT_EQ(m.routing.at(2).rows.size(), 30u);
  EXPECT_EQ(m.num_experts(), 8);
  EXPECT_EQ(m.step_metrics.at("loss").steps.size(), 30u);
  EXPECT_EQ(m.step_metrics.at("val_loss").steps.size(), 2u);  // every 20 steps
  EXPECT_EQ(m.topologies.size(), 3u * 3u);                    // every 10 steps, per layer
  EXPECT_EQ(m.token_samples.size(), 3u * 3u);
  EXPECT_EQ(m.spans.size(), 30u * 2u * 4u);
  EXPECT_EQ(m.alltoalls.size(), 30u * 2u);
  EXPECT_EQ(m.offloads.size(), 30u * 3u);
  EXPECT_EQ(m.events_skipped, 0);
  // Routed tokens per row are exactly T*K.
  for (const RoutingRow& r : m.routing.at(0).rows) EXPECT_EQ(r.stats.total_tokens, 4096.0 * 2);
}

TEST(ViewerRunModel, OutOfOrderAndRepeatedStepsAreSortedAndReplaced) {
  std::string events;
  for (int step : {5, 1, 3, 3})
    events += R"({"type":"routing","step":)" + std::to_string(step) + R"(,"layer":0,"tokens_per_expert":[1,)" +
              std::to_string(step) + "]}\n";
  events += R"({"type":"step","step":9,"loss":1.0})" "\n" R"({"type":"step","step":2,"loss":null})" "\n";
  RunModel m = RunModel::from_text(testing::kRunJson, events);
  ASSERT_EQ(m.error, "");
  const auto& rows = m.routing.at(0).rows;
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].step, 1);
  EXPECT_EQ(rows[1].step, 3);
  EXPECT_EQ(rows[2].step, 5);
  EXPECT_EQ(m.routing.at(0).row_at_or_before(4)->step, 3);
  EXPECT_EQ(m.routing.at(0).row_at_or_before(0)->step, 1);  // before the first: the first
  const Series& loss = m.step_metrics.at("loss");
  ASSERT_EQ(loss.steps.size(), 2u);
  EXPECT_EQ(loss.steps[0], 2.0);
  EXPECT_TRUE(std::isnan(loss.values[0]));  // null in the file: NaN, drawn as a gap
}

TEST(ViewerRunModel, UnusableEventsAreSkippedWithAWarningNotACrash) {
  const std::string events =
      R"({"type":"routing","step":0,"layer":1000000000000000,"tokens_per_expert":[1,2]})" "\n"
      R"({"type":"routing","step":0,"layer":0,"tokens_per_expert":[1,-2]})" "\n"
      R"({"type":"routing","step":0,"layer":0,"tokens_per_expert":[1,2],"dropped_per_expert":[1]})" "\n"
      R"({"type":"alltoall","step":0,"bytes":[[1,2],[3]],"duration_us":1})" "\n"
      R"({"type":"span","step":0,"rank":0,"stream":0,"name":"x","start_us":0,"duration_us":-5})" "\n"
      R"({"type":"routing","step":1,"layer":0,"tokens_per_expert":[3,4]})" "\n";
  RunModel m = RunModel::from_text(testing::kRunJson, events);
  EXPECT_EQ(m.error, "");
  EXPECT_EQ(m.events_skipped, 5);
  EXPECT_EQ(m.warnings.size(), 5u);
  EXPECT_NE(m.warnings[0].find("layer"), std::string::npos) << m.warnings[0];
  ASSERT_EQ(m.routing.size(), 1u);
  EXPECT_EQ(m.routing.at(0).rows.size(), 1u);
}

TEST(ViewerRunModel, OffloadHostFieldsAreReadOrTheEventSkipped) {
  // on_host and host_us (experts computed on the host) are read like experts and stall_us: a list
  // of ids within the viewer's bounds and a finite time >= 0, else the event is skipped and named.
  std::string too_many = R"({"type":"offload","step":6,"layer":0,"hits":0,"misses":0,"on_host":[)";
  for (int64_t e = 0; e <= kMaxExperts; ++e) too_many += (e ? ",0" : "0");
  too_many += "]}\n";
  const std::string events =
      R"({"type":"offload","step":1,"layer":3,"hits":1,"misses":1,"stall_us":2.5,"prefetched":[],"experts":[1,4,6,9],"on_host":[4,9],"host_us":812.25})" "\n"
      R"({"type":"offload","step":2,"layer":3,"hits":2,"misses":0,"stall_us":0,"prefetched":[5],"experts":[1,5]})" "\n"
      R"({"type":"offload","step":3,"layer":3,"hits":0,"misses":0,"on_host":[2],"host_us":-1.0})" "\n"
      R"({"type":"offload","step":4,"layer":3,"hits":0,"misses":0,"on_host":[2],"host_us":"812"})" "\n"
      R"({"type":"offload","step":5,"layer":3,"hits":0,"misses":0,"on_host":[2,-1],"host_us":1.0})" "\n" +
      too_many +
      R"({"type":"offload","step":7,"layer":3,"hits":0,"misses":0,"on_host":"2","host_us":1.0})" "\n";
  const RunModel m = RunModel::from_text(testing::kRunJson, events);
  EXPECT_EQ(m.error, "");
  ASSERT_EQ(m.offloads.size(), 2u);
  EXPECT_EQ(m.offloads[0].on_host, (std::vector<int64_t>{4, 9}));
  EXPECT_DOUBLE_EQ(m.offloads[0].host_us, 812.25);
  EXPECT_EQ(m.offloads[0].hits, 1);  // hits and misses as written: the host's experts are neither
  EXPECT_EQ(m.offloads[0].misses, 1);
  EXPECT_EQ(m.offloads[0].experts, (std::vector<int64_t>{1, 4, 6, 9}));
  // Without the fields (an older record): nothing on the host, no host time.
  EXPECT_TRUE(m.offloads[1].on_host.empty());
  EXPECT_EQ(m.offloads[1].host_us, 0.0);
  EXPECT_EQ(m.offloads[1].prefetched, (std::vector<int64_t>{5}));

  EXPECT_EQ(m.events_skipped, 5);
  ASSERT_EQ(m.warnings.size(), 5u);
  const char* expected[] = {"host_us is not a time", "'host_us' is not a number", "'on_host' holds -1",
                            "'on_host' has 4097 entries", "'on_host' is not an array"};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_NE(m.warnings[i].find("event " + std::to_string(i + 3) + " (offload) skipped"), std::string::npos) << m.warnings[i];
    EXPECT_NE(m.warnings[i].find(expected[i]), std::string::npos) << m.warnings[i];
  }
}

TEST(ViewerRunModel, UnreadableRunsSayWhy) {
  TempDir dir;
  RunModel missing = RunModel::load(dir.path() / "nothing");
  EXPECT_NE(missing.error.find("run.json"), std::string::npos) << missing.error;
  testing::write_text(dir.path() / "v9" / "run.json", R"({"schema_version":9,"kind":"train","name":"x","start_time":"t"})");
  testing::write_text(dir.path() / "v9" / "events.jsonl", "");
  RunModel future = RunModel::load(dir.path() / "v9");
  EXPECT_NE(future.error.find("9"), std::string::npos) << future.error;
  testing::write_text(dir.path() / "bad" / "run.json", testing::kRunJson);
  testing::write_text(dir.path() / "bad" / "events.jsonl", "{\"type\":\"step\",\"step\":1}\n{garbage\n{\"type\":\"step\",\"step\":2}\n");
  // A corrupt line is no reason to refuse the run: it is skipped, named, and the rest is read.
  RunModel corrupt = RunModel::load(dir.path() / "bad");
  EXPECT_TRUE(corrupt.error.empty()) << corrupt.error;
  ASSERT_EQ(corrupt.warnings.size(), 1u);
  EXPECT_NE(corrupt.warnings[0].find("line 2"), std::string::npos) << corrupt.warnings[0];
  EXPECT_EQ(corrupt.last_step, 2);
}

TEST(ViewerRunModel, OddFilesSayWhatTheyAreAndNeverBlock) {
  // events.jsonl as a named pipe: opening it to read would wait for a writer that never comes.
  TempDir dir;
  const auto pipe_run = dir.path() / "pipe";
  testing::write_text(pipe_run / "run.json", testing::kRunJson);
  ASSERT_EQ(mkfifo((pipe_run / "events.jsonl").c_str(), 0600), 0);
  RunModel loaded = RunModel::load(pipe_run);
  EXPECT_NE(loaded.error.find("events.jsonl is not a regular file (a named pipe)"), std::string::npos) << loaded.error;
  EXPECT_EQ(loaded.error.find("no such file"), std::string::npos) << loaded.error;
  RunModel followed = RunModel::follow(pipe_run);
  EXPECT_NE(followed.error.find("a named pipe"), std::string::npos) << followed.error;
  EXPECT_FALSE(followed.live());
  // A directory where a file should be: run.json, then events.jsonl.
  std::filesystem::create_directories(dir.path() / "dir_info" / "run.json");
  RunModel info_dir = RunModel::load(dir.path() / "dir_info");
  EXPECT_NE(info_dir.error.find("run.json is not a regular file (a directory)"), std::string::npos) << info_dir.error;
  testing::write_text(dir.path() / "dir_events" / "run.json", testing::kRunJson);
  std::filesystem::create_directories(dir.path() / "dir_events" / "events.jsonl");
  RunModel events_dir = RunModel::load(dir.path() / "dir_events");
  EXPECT_NE(events_dir.error.find("events.jsonl is not a regular file (a directory)"), std::string::npos) << events_dir.error;
  // A followed run whose events.jsonl is replaced by a pipe: following stops with the message.
  const auto live = dir.path() / "live";
  testing::write_text(live / "run.json", testing::kRunJson);
  testing::write_text(live / "events.jsonl", "{\"type\":\"step\",\"step\":0,\"loss\":3}\n");
  RunModel m = RunModel::follow(live);
  EXPECT_EQ(m.error, "");
  EXPECT_EQ(m.last_step, 0);
  std::filesystem::remove(live / "events.jsonl");
  ASSERT_EQ(mkfifo((live / "events.jsonl").c_str(), 0600), 0);
  EXPECT_EQ(m.poll(), 0);
  EXPECT_NE(m.error.find("a named pipe"), std::string::npos) << m.error;
  EXPECT_FALSE(m.live());
  EXPECT_EQ(m.last_step, 0);  // what was read stays
  // Regular files, or none yet, are not odd.
  testing::write_text(dir.path() / "fine" / "run.json", testing::kRunJson);
  EXPECT_EQ(odd_run_file(dir.path() / "fine"), "");
  testing::write_text(dir.path() / "fine" / "events.jsonl", "");
  EXPECT_EQ(odd_run_file(dir.path() / "fine"), "");
}

TEST(ViewerRunModel, FollowsALiveRunLineByLine) {
  TempDir dir;
  const auto run = dir.path() / "live";
  RunModel m = RunModel::follow(run);
  EXPECT_TRUE(m.live());
  EXPECT_EQ(m.waiting_for, "run.json");
  EXPECT_EQ(m.poll(), 0);  // nothing yet: not an error
  EXPECT_EQ(m.error, "");
  testing::write_text(run / "run.json", testing::kRunJson);
  testing::write_text(run / "events.jsonl", "{\"type\":\"step\",\"step\":0,\"loss\":3}\n{\"type\":\"step\",\"st");
  EXPECT_EQ(m.poll(), 1);  // the half-written second line waits
  EXPECT_EQ(m.error, "");
  EXPECT_EQ(m.last_step, 0);
  const uint64_t version = m.version;
  {
    std::ofstream out(run / "events.jsonl", std::ios::app);
    out << "ep\":1,\"loss\":2.5}\n";
  }
  EXPECT_EQ(m.poll(), 1);
  EXPECT_EQ(m.last_step, 1);
  EXPECT_GT(m.version, version);
  EXPECT_EQ(m.step_metrics.at("loss").values.back(), 2.5);
  // The file rewritten shorter under the reader: a message, and following stops.
  testing::write_text(run / "events.jsonl", "");
  m.poll();
  EXPECT_NE(m.error.find("shrank"), std::string::npos) << m.error;
  EXPECT_FALSE(m.live());
}

TEST(ViewerRunModel, RunListFindsRunDirectories) {
  TempDir dir;
  write_synthetic_run(dir.path() / "b", {.steps = 2, .experts = 2, .layers = 1, .ranks = 1});
  write_synthetic_run(dir.path() / "a", {.steps = 2, .experts = 2, .layers = 1, .ranks = 1});
  std::filesystem::create_directories(dir.path() / "not_a_run");
  const auto runs = list_runs(dir.path());
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].name, "a");
  EXPECT_EQ(runs[1].name, "b");
  std::string problem;
  EXPECT_TRUE(list_runs(dir.path() / "missing", &problem).empty());
  EXPECT_NE(problem.find("missing"), std::string::npos);
}

}  // namespace
}  // namespace moe::viewer
