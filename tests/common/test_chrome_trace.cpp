// test_chrome_trace.cpp: span and all-to-all events become Chrome trace complete events, and the
// moe_trace_export tool writes them.
//   ctest --test-dir build -R ChromeTrace
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "chrome_trace.h"
#include "run_record.h"
#include "temp_dir.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path write_sample_run(const fs::path& dir) {
  RunInfo info;
  info.kind = RunKind::bench;
  info.name = "ep-timeline";
  info.world_size = 2;
  RunWriter writer = RunWriter::create(dir, info);
  writer.append(step_event(0, {{"loss", 1.0}}));  // not a span: not in the trace
  writer.append(to_event(SpanEvent{.step = 0, .rank = 0, .stream = 0, .stream_name = "compute",
                                   .name = "expert_compute", .start_us = 10, .duration_us = 30}));
  writer.append(to_event(SpanEvent{.step = 0, .rank = 0, .stream = 1, .stream_name = "comm",
                                   .name = "dispatch", .start_us = 0, .duration_us = 9.5}));
  writer.append(to_event(SpanEvent{.step = 0, .rank = 1, .stream = 1, .name = "combine",
                                   .start_us = 41, .duration_us = 8}));
  writer.append(to_event(AllToAllEvent{.step = 0, .layer = 3, .name = "dispatch",
                                       .bytes = {{0, 100}, {300, 0}}, .duration_us = 9,
                                       .start_us = 1.0, .rank = 1}));
  writer.append(to_event(AllToAllEvent{.step = 0, .bytes = {{0, 1}, {1, 0}}, .duration_us = 2}));  // untimed
  return dir;
}

void check_trace(const json& trace) {
  ASSERT_TRUE(trace.contains("traceEvents"));
  std::vector<json> complete;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;
  std::map<int64_t, std::string> process_names;
  for (const json& event : trace["traceEvents"]) {
    if (event["ph"] == "X") complete.push_back(event);
    if (event["ph"] == "M" && event["name"] == "thread_name") {
      thread_names[{event["pid"], event["tid"]}] = event["args"]["name"];
    }
    if (event["ph"] == "M" && event["name"] == "process_name") process_names[event["pid"]] = event["args"]["name"];
  }
  ASSERT_EQ(complete.size(), 4u);  // three spans and the timed all-to-all
  EXPECT_EQ(complete[0]["name"], "expert_compute");
  EXPECT_EQ(complete[0]["pid"], 0);
  EXPECT_EQ(complete[0]["tid"], 0);
  EXPECT_EQ(complete[0]["ts"], 10.0);
  EXPECT_EQ(complete[0]["dur"], 30.0);
  EXPECT_EQ(complete[1]["name"], "dispatch");
  EXPECT_EQ(complete[1]["tid"], 1);
  EXPECT_EQ(complete[1]["dur"], 9.5);
  EXPECT_EQ(complete[2]["pid"], 1);
  EXPECT_EQ(complete[2]["ts"], 41.0);
  EXPECT_EQ(complete[3]["pid"], 1);
  EXPECT_EQ(complete[3]["tid"], kAllToAllThread);
  EXPECT_EQ(complete[3]["args"]["bytes_total"], 400);
  EXPECT_EQ(complete[3]["args"]["bytes_sent"], 300);
  EXPECT_EQ((process_names[0]), "rank 0");
  EXPECT_EQ((process_names[1]), "rank 1");
  EXPECT_EQ((thread_names[{0, 0}]), "compute");
  EXPECT_EQ((thread_names[{0, 1}]), "comm");
  EXPECT_EQ((thread_names[{1, 1}]), "stream 1");
  EXPECT_EQ((thread_names[{1, kAllToAllThread}]), "all-to-all");
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

TEST(ChromeTrace, SpansBecomeCompleteEventsWithRankStreamAndTimes) {
  moe::testing::TempDir temp;
  const fs::path run_dir = write_sample_run(temp.path() / "run");
  const RunRecord run = RunReader::load(run_dir);
  EXPECT_EQ(export_chrome_trace(run, temp.path() / "trace.json"), 4);
  const json trace = read_json(temp.path() / "trace.json");
  check_trace(trace);
  EXPECT_EQ(trace["otherData"]["name"], "ep-timeline");
}

TEST(ChromeTrace, EmptyRunGivesAnEmptyButValidTrace) {
  const json trace = chrome_trace_from_events({});
  EXPECT_TRUE(trace["traceEvents"].is_array());
  EXPECT_TRUE(trace["traceEvents"].empty());
}

// The streaming writer gives the trace the in-memory one gives, and leaves nothing behind when it
// is not finished.
TEST(ChromeTrace, StreamingWriterMatchesTheWholeRecordTrace) {
  moe::testing::TempDir temp;
  const RunRecord run = RunReader::load(write_sample_run(temp.path() / "run"));
  const fs::path out = temp.path() / "streamed.json";
  {
    ChromeTraceWriter writer(out, run.info);
    for (const json& event : run.events) writer.add(event);
    EXPECT_EQ(writer.finish(), 4);
  }
  EXPECT_EQ(read_json(out), chrome_trace_from_events(run.events, run.info));
  {
    ChromeTraceWriter abandoned(temp.path() / "abandoned.json", run.info);
    abandoned.add(run.events.front());
  }
  EXPECT_FALSE(fs::exists(temp.path() / "abandoned.json"));
  EXPECT_FALSE(fs::exists(temp.path() / "abandoned.json.tmp"));
}

int run_command(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(ChromeTrace, CommandLineToolExportsAndExplainsMistakes) {
  moe::testing::TempDir temp;
  const fs::path run_dir = write_sample_run(temp.path() / "run");
  const std::string tool = MOE_TRACE_EXPORT_PATH;
  const fs::path out = temp.path() / "out.json";
  const fs::path log = temp.path() / "log.txt";
  EXPECT_EQ(run_command("'" + tool + "' > '" + log.string() + "' 2>&1"), 2);
  std::ifstream usage(log);
  std::stringstream text;
  text << usage.rdbuf();
  EXPECT_NE(text.str().find("usage:"), std::string::npos) << text.str();

  // A run that is not there is bad input: exit 2 (common/program_exit.h).
  EXPECT_EQ(run_command("'" + tool + "' '" + (temp.path() / "absent").string() + "' '" + out.string() +
                        "' 2> /dev/null"),
            2);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(run_command("'" + tool + "' '" + run_dir.string() + "' '" + out.string() + "' > /dev/null"), 0);
  check_trace(read_json(out));

  // A bad line in the middle of the record (a number beyond double's range) is named and left
  // out; the spans after it are still exported.
  const std::string events = read_text(run_dir / "events.jsonl");
  const size_t second_line = events.find('\n') + 1;
  std::ofstream(run_dir / "events.jsonl", std::ios::binary)
      << events.substr(0, second_line) << "{\"type\":\"step\",\"step\":1,\"loss\":1e400}\n" << events.substr(second_line);
  EXPECT_EQ(run_command("'" + tool + "' '" + run_dir.string() + "' '" + out.string() + "' > /dev/null 2> '" +
                        log.string() + "'"),
            0);
  const std::string warnings = read_text(log);
  EXPECT_NE(warnings.find("events.jsonl line 2: "), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("1 lines of the record are not valid events"), std::string::npos) << warnings;
  check_trace(read_json(out));
}

}  // namespace
}  // namespace moe
