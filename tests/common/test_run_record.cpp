// test_run_record.cpp: run records, written and read back, followed live, and attacked with
// corrupt and random input.
//   ctest --test-dir build -R RunRecord
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "chrome_trace.h"
#include "run_record.h"
#include "temp_dir.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using moe::testing::TempDir;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void write_bytes(const fs::path& path, const std::string& bytes, bool append = false) {
  std::ofstream out(path, std::ios::binary | (append ? std::ios::app : std::ios::trunc));
  out << bytes;
}

RunInfo sample_info() {
  RunInfo info;
  info.kind = RunKind::train;
  info.name = "tiny-dropless";
  MoeConfig config;
  config.tokens = 256, config.model_dim = 64, config.hidden_dim = 128, config.num_experts = 4;
  config.top_k = 2, config.block_size = 64, config.aux_loss_coef = 0.01;
  info.moe_config = config;
  info.model = {{"layers", 2}, {"vocab", 256}};
  info.devices = {"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"};
  info.world_size = 2;
  info.git_commit = "4034e5f";
  info.extra = {{"dataset", "tiny-shakespeare"}, {"seed", 7}};
  return info;
}

// One event of every type the project writes.
std::vector<json> sample_events() {
  std::vector<json> events;
  events.push_back(step_event(1, {{"loss", 2.5}, {"val_loss", 2.6}, {"aux_loss", 0.011},
                                  {"z_loss", 0.002}, {"tokens_per_s", 1.5e6}, {"mfu", 0.41},
                                  {"lr", 3e-4}}));
  events.push_back(to_event(RoutingEvent{.step = 1, .layer = 0, .tokens_per_expert = {10, 20, 30, 4},
                                         .dropped_per_expert = {0, 0, 5, 0}, .capacity = 25,
                                         .tokens_per_expert_by_genre = {{"code", {1, 2, 3, 4}}}}));
  events.push_back(to_event(ExpertLoadEvent{.step = 1, .layer = 0, .tokens = {{6, 14, 20, 0}, {4, 6, 10, 4}}}));
  events.push_back(to_event(TopologyEvent{.step = 1, .layer = 0, .block_size = 64, .block_rows = 3,
                                          .block_cols = 2, .nnz = 6, .padding_rows = 64,
                                          .rows_per_expert = {64, 64, 64, 0}}));
  events.push_back(to_event(SpanEvent{.step = 1, .rank = 1, .stream = 2, .stream_name = "comm",
                                      .name = "dispatch", .start_us = 100.5, .duration_us = 20.25}));
  events.push_back(to_event(AllToAllEvent{.step = 1, .layer = 0, .name = "dispatch",
                                          .bytes = {{0, 100}, {200, 0}}, .duration_us = 15,
                                          .start_us = 120.0, .rank = 0}));
  events.push_back(to_event(OffloadEvent{.step = 1, .layer = 1, .hits = 3, .misses = 1,
                                         .stall_us = 12.5, .prefetched = {2, 3}}));
  events.push_back(to_event(TokensEvent{.step = 1, .layer = 0, .text = "hi!",
                                        .experts = {{0, 1}, {2, 3}, {1, 0}}}));
  events.push_back(to_event(TableEvent{.name = "capacity sweep", .columns = {"cf", "dropped"},
                                       .rows = {{1.0, 12}, {1.25, "none"}}}));
  events.push_back(to_event(VerdictEvent{.pass = true, .message = "max_rel_err=3.1e-3 tol=1e-2"}));
  return events;
}

template <typename Function>
std::string error_of(Function&& function) {
  try {
    function();
  } catch (const RecordError& e) {
    return e.what();
  }
  return "(no RecordError thrown)";
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

// ---- writing and reading ----

TEST(RunRecord, RoundTripsInfoAndEveryEventType) {
  TempDir temp;
  const fs::path dir = temp.path() / "runs" / "tiny";
  const std::vector<json> events = sample_events();
  {
    RunWriter writer = RunWriter::create(dir, sample_info());
    for (const json& event : events) writer.append(event);
  }
  const RunRecord run = RunReader::load(dir);
  EXPECT_TRUE(run.warnings.empty());
  EXPECT_EQ(run.info["schema_version"], kRunSchemaVersion);
  EXPECT_EQ(run.info["formulation"], "dropless");  // taken from moe_config
  const RunInfo info = run.run_info();
  const RunInfo expected = sample_info();
  EXPECT_EQ(info.kind, expected.kind);
  EXPECT_EQ(info.name, expected.name);
  EXPECT_EQ(json(*info.moe_config), json(*expected.moe_config));
  EXPECT_EQ(info.model, expected.model);
  EXPECT_EQ(info.devices, expected.devices);
  EXPECT_EQ(info.world_size, 2);
  EXPECT_EQ(info.git_commit, expected.git_commit);
  EXPECT_EQ(info.extra, expected.extra);
  EXPECT_EQ(info.start_time.size(), std::string("2026-11-03T12:34:56.789Z").size()) << info.start_time;
  EXPECT_EQ(info.start_time.back(), 'Z');
  ASSERT_EQ(run.events.size(), events.size());
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(run.events[i], events[i]) << i;
}

TEST(RunRecord, NanMetricIsWrittenAsNull) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  writer.append(step_event(3, {{"loss", std::numeric_limits<double>::quiet_NaN()}}));
  writer.close();
  EXPECT_TRUE(RunReader::load(temp.path()).events.at(0)["loss"].is_null());
}

TEST(RunRecord, HalfWrittenLastLineIsIgnoredWithAWarning) {
  TempDir temp;
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    writer.append(step_event(1, {{"loss", 2.0}}));
    writer.append(step_event(2, {{"loss", 1.9}}));
  }
  write_bytes(temp.path() / "events.jsonl", R"({"type":"step","step":3,"lo)", /*append=*/true);
  const RunRecord run = RunReader::load(temp.path());
  ASSERT_EQ(run.events.size(), 2u);
  ASSERT_EQ(run.warnings.size(), 1u);
  EXPECT_CONTAINS(run.warnings[0], "half-written last line");
  EXPECT_CONTAINS(run.warnings[0], "line 3");
}

TEST(RunRecord, CompleteLastLineWithoutNewlineIsKeptWithAWarning) {
  TempDir temp;
  RunWriter::create(temp.path(), sample_info()).append(step_event(1, {{"loss", 2.0}}));
  write_bytes(temp.path() / "events.jsonl", R"({"type":"step","step":2})", true);
  const RunRecord run = RunReader::load(temp.path());
  EXPECT_EQ(run.events.size(), 2u);
  EXPECT_EQ(run.warnings.size(), 1u);
}

TEST(RunRecord, PollReturnsOnlyNewCompleteLines) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  RunReader reader(temp.path());
  EXPECT_EQ(reader.info()["name"], "tiny-dropless");
  EXPECT_TRUE(reader.poll().empty());

  writer.append(step_event(1, {{"loss", 2.0}}));
  writer.append(step_event(2, {{"loss", 1.9}}));
  std::vector<json> fresh = reader.poll();
  ASSERT_EQ(fresh.size(), 2u);
  EXPECT_EQ(fresh[1]["step"], 2);
  EXPECT_TRUE(reader.poll().empty());

  // Another process is half-way through writing a line: nothing new yet.
  const fs::path events = temp.path() / "events.jsonl";
  write_bytes(events, R"({"type":"step","step":3,)", true);
  EXPECT_TRUE(reader.poll().empty());
  EXPECT_TRUE(reader.has_partial_line());
  // The line completes (and another begins): exactly the completed one appears.
  write_bytes(events, "\"loss\":1.8}\n{\"type\":\"st", true);
  fresh = reader.poll();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0]["step"], 3);
  EXPECT_EQ(fresh[0]["loss"], 1.8);
  write_bytes(events, "ep\",\"step\":4}\n", true);
  fresh = reader.poll();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0]["step"], 4);
  EXPECT_FALSE(reader.has_partial_line());
  EXPECT_EQ(reader.offset(), fs::file_size(events));
  EXPECT_EQ(reader.lines_consumed(), 4);
}

TEST(RunRecord, PollNamesTheLineOfACorruptEvent) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  RunReader reader(temp.path());
  writer.append(step_event(1, {}));
  EXPECT_EQ(reader.poll().size(), 1u);
  write_bytes(temp.path() / "events.jsonl", "{oops}\n", true);
  EXPECT_CONTAINS(error_of([&] { reader.poll(); }), "events.jsonl line 2");
}

TEST(RunRecord, CorruptMiddleLineIsAnErrorNamingFileAndLine) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()).append(step_event(1, {})); }
  write_bytes(temp.path() / "events.jsonl", "{\"type\":\"step\",\"step\":2,\x01garbage\n", true);
  write_bytes(temp.path() / "events.jsonl", "{\"type\":\"step\",\"step\":3}\n", true);
  const std::string message = error_of([&] { RunReader::load(temp.path()); });
  EXPECT_CONTAINS(message, (temp.path() / "events.jsonl").string() + " line 2");
  EXPECT_CONTAINS(message, "not valid JSON");
}

// Given a handler, the streaming reader reports a bad line (here a number beyond double's range,
// then one that is not JSON) with its line number and goes on: no later line is lost.
TEST(RunRecord, StreamingReaderSkipsBadLinesAndReadsTheLaterOnes) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()).append(step_event(1, {{"loss", 2.0}})); }
  write_bytes(temp.path() / "events.jsonl",
              "{\"type\":\"step\",\"step\":2,\"loss\":1e400}\n{oops}\n{\"type\":\"step\",\"step\":4}\n", true);
  RunReader reader(temp.path(), ReadOptions{.read_block_bytes = 7});  // lines cut across blocks too
  std::vector<int64_t> steps;
  std::vector<std::string> bad;
  do {
    reader.poll_each([&](const json& event) { steps.push_back(event["step"].get<int64_t>()); }, 1 << 20,
                     [&](const std::string& message) { bad.push_back(message); });
  } while (!reader.caught_up());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 4}));
  ASSERT_EQ(bad.size(), 2u);
  EXPECT_CONTAINS(bad[0], "events.jsonl line 2");
  EXPECT_CONTAINS(bad[0], "1e400");
  EXPECT_CONTAINS(bad[1], "events.jsonl line 3");
  // Without a handler the same record is an error naming the first bad line, as load() has it.
  RunReader strict(temp.path());
  EXPECT_CONTAINS(error_of([&] { strict.poll_each([](const json&) {}); }), "events.jsonl line 2");
  // The in-memory form takes the same handler.
  bad.clear();
  const RunRecord record = parse_run_record(read_bytes(temp.path() / "run.json"),
                                            read_bytes(temp.path() / "events.jsonl"), "mem",
                                            [&](const std::string& message) { bad.push_back(message); });
  EXPECT_EQ(record.events.size(), 2u);
  ASSERT_EQ(bad.size(), 2u);
  EXPECT_CONTAINS(bad[1], "mem/events.jsonl line 3");
}

// run.json says whether the run ended: "finished": false from create() on, true once the writer
// closes; a writer destroyed by an exception (the program failing) leaves it false, and resume()
// makes it false again until the resumed run closes.
TEST(RunRecord, RunJsonMarksARunFinishedOnlyWhenItsWriterCloses) {
  TempDir temp;
  const auto finished = [&] {
    const json info = json::parse(read_bytes(temp.path() / "run.json"));
    return info.at("finished").get<bool>();
  };
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    writer.append(step_event(1, {}));
    EXPECT_FALSE(finished());  // still running
  }
  EXPECT_TRUE(finished());
  EXPECT_TRUE(json::parse(read_bytes(temp.path() / "run.json")).at("end_time").is_string());
  EXPECT_EQ(RunReader::load(temp.path()).events.size(), 1u);  // the events are as written

  try {
    RunWriter writer = RunWriter::resume(temp.path());
    EXPECT_FALSE(finished());
    writer.append(step_event(2, {}));
    throw std::runtime_error("the program fails mid-run");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(finished());
  EXPECT_FALSE(json::parse(read_bytes(temp.path() / "run.json")).contains("end_time"));

  RunWriter::resume(temp.path()).close();
  EXPECT_TRUE(finished());
  EXPECT_EQ(RunReader::load(temp.path()).events.size(), 2u);

  // A run.json field of the wrong type is refused like any other.
  json info = json::parse(read_bytes(temp.path() / "run.json"));
  info["finished"] = "yes";
  write_bytes(temp.path() / "run.json", info.dump());
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), "\"finished\" must be true or false");
}

TEST(RunRecord, EventWithWrongFieldTypeIsAnErrorNamingTheField) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()); }
  write_bytes(temp.path() / "events.jsonl",
              R"({"type":"span","rank":0,"stream":0,"name":"combine","start_us":"soon","duration_us":1})"
              "\n",
              true);
  const std::string message = error_of([&] { RunReader::load(temp.path()); });
  EXPECT_CONTAINS(message, "line 1");
  EXPECT_CONTAINS(message, "start_us");
  write_bytes(temp.path() / "events.jsonl", R"({"type":"step","step":1.5})" "\n");
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), "\"step\" must be an integer");
  write_bytes(temp.path() / "events.jsonl", R"({"step":1})" "\n");
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), "no \"type\"");
}

TEST(RunRecord, UnknownEventTypesAndExtraFieldsPass) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  writer.append({{"type", "future_thing"}, {"step", 1}, {"whatever", {1, 2}}});
  json step = step_event(2, {{"loss", 1.0}});
  step["my_metric"] = "note";
  writer.append(step);
  writer.close();
  EXPECT_EQ(RunReader::load(temp.path()).events.size(), 2u);
}

TEST(RunRecord, WriterRefusesEventsTheReaderWouldReject) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  EXPECT_CONTAINS(error_of([&] { writer.append({{"step", 1}}); }), "no \"type\"");
  EXPECT_CONTAINS(error_of([&] { writer.append({{"type", "routing"}, {"layer", 0}}); }), "tokens_per_expert");
  EXPECT_CONTAINS(error_of([&] { writer.append({{"type", "expert_load"}, {"layer", 0}, {"tokens", {1, 2}}}); }),
                  "\"tokens\" must be");
  EXPECT_CONTAINS(error_of([&] { writer.append(json::array()); }), "object");
}

TEST(RunRecord, UnknownSchemaVersionNamesFoundAndSupported) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()); }
  json info = json::parse(read_bytes(temp.path() / "run.json"));
  info["schema_version"] = 2;
  write_bytes(temp.path() / "run.json", info.dump());
  const std::string message = error_of([&] { RunReader::load(temp.path()); });
  EXPECT_CONTAINS(message, "found 2");
  EXPECT_CONTAINS(message, "supports 1");
  EXPECT_CONTAINS(message, "run.json");
  EXPECT_CONTAINS(error_of([&] { RunReader reader(temp.path()); }), "found 2");
}

TEST(RunRecord, MissingRunJsonIsAnError) {
  TempDir temp;
  write_bytes(temp.path() / "events.jsonl", "{\"type\":\"step\",\"step\":1}\n");
  const std::string message = error_of([&] { RunReader::load(temp.path()); });
  EXPECT_CONTAINS(message, "run.json is missing");
  EXPECT_CONTAINS(error_of([&] { RunReader reader(temp.path() / "nowhere"); }), "run.json is missing");
}

TEST(RunRecord, WrongTypesOfRequiredRunFieldsAreErrors) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()); }
  const json good = json::parse(read_bytes(temp.path() / "run.json"));
  const std::vector<std::pair<std::string, json>> cases = {
      {"name", 5}, {"kind", "training"}, {"start_time", nullptr}, {"schema_version", "1"},
      {"world_size", 0}, {"devices", {1, 2}}, {"moe_config", {{"tokens", 1}}}, {"extra", 3}};
  for (const auto& [field, value] : cases) {
    json bad = good;
    bad[field] = value;
    write_bytes(temp.path() / "run.json", bad.dump());
    EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), field == "moe_config" ? "model_dim" : field);
  }
  json no_name = good;
  no_name.erase("name");
  write_bytes(temp.path() / "run.json", no_name.dump());
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), "\"name\" is missing");
}

TEST(RunRecord, CreateRefusesToClobberAnExistingRun) {
  TempDir temp;
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    writer.append(step_event(1, {{"loss", 2.0}}));
  }
  const std::string run_before = read_bytes(temp.path() / "run.json");
  const std::string events_before = read_bytes(temp.path() / "events.jsonl");
  RunInfo other = sample_info();
  other.name = "other";
  const std::string message = error_of([&] { RunWriter::create(temp.path(), other); });
  EXPECT_CONTAINS(message, "refusing to overwrite");
  EXPECT_CONTAINS(message, temp.path().string());
  EXPECT_EQ(read_bytes(temp.path() / "run.json"), run_before);
  EXPECT_EQ(read_bytes(temp.path() / "events.jsonl"), events_before);

  { RunWriter::create(temp.path(), other, OnExisting::overwrite); }
  const RunRecord run = RunReader::load(temp.path());
  EXPECT_EQ(run.info["name"], "other");
  EXPECT_TRUE(run.events.empty());
}

TEST(RunRecord, ResumeAppendsAfterCuttingAPartialLine) {
  TempDir temp;
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    writer.append(step_event(1, {}));
    writer.append(step_event(2, {}));
  }
  write_bytes(temp.path() / "events.jsonl", R"({"type":"step","st)", true);  // the crash
  {
    RunWriter writer = RunWriter::resume(temp.path());
    EXPECT_GE(writer.elapsed_us(), 0.0);
    writer.append(step_event(3, {}));
  }
  const RunRecord run = RunReader::load(temp.path());
  EXPECT_TRUE(run.warnings.empty());
  ASSERT_EQ(run.events.size(), 3u);
  EXPECT_EQ(run.events[2]["step"], 3);
  EXPECT_CONTAINS(error_of([&] { RunWriter::resume(temp.path() / "absent"); }), "run.json");
}

TEST(RunRecord, FilesOverTheSizeLimitAreRefused) {
  TempDir temp;
  RunWriter writer = RunWriter::create(temp.path(), sample_info());
  for (int step = 0; step < 200; ++step) writer.append(step_event(step, {{"loss", 1.0}}));
  writer.close();
  const ReadOptions small{.max_file_bytes = 300};
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path(), {.max_file_bytes = 2000}); }),
                  "larger than the limit of 2000 bytes");
  EXPECT_CONTAINS(error_of([&] { RunReader reader(temp.path(), small); }), "limit");
  RunReader reader(temp.path(), {.max_file_bytes = 2000});
  EXPECT_CONTAINS(error_of([&] { reader.poll(); }), "events.jsonl is larger than the limit");
}

TEST(RunRecord, DeeplyNestedJsonIsRefused) {
  TempDir temp;
  { RunWriter::create(temp.path(), sample_info()); }
  write_bytes(temp.path() / "events.jsonl", std::string(100000, '[') + "\n{\"type\":\"x\"}\n");
  EXPECT_CONTAINS(error_of([&] { RunReader::load(temp.path()); }), "nested deeper");
}

// ---- robustness: arbitrary bytes never crash the reader ----

std::string mutate(std::string text, std::mt19937_64& random) {
  std::uniform_int_distribution<int> byte(0, 255);
  const int edits = 1 + static_cast<int>(random() % 4);
  for (int e = 0; e < edits && !text.empty(); ++e) {
    const size_t at = random() % text.size();
    switch (random() % 6) {
      case 0: text[at] = static_cast<char>(byte(random)); break;                           // flip
      case 1: text.insert(at, 1, static_cast<char>(byte(random))); break;                   // insert
      case 2: text.erase(at, 1 + random() % 8); break;                                      // delete
      case 3: text.resize(at); break;                                                        // truncate
      case 4: text.insert(at, text.substr(random() % text.size(), random() % 32)); break;   // repeat
      case 5: text[at] = "{}[]\",:\n0-e."[random() % 13]; break;                             // syntax
    }
  }
  return text;
}

TEST(RunRecordFuzz, MutatedAndRandomInputsLoadOrThrowRecordError) {
  TempDir temp;
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    for (const json& event : sample_events()) writer.append(event);
  }
  const std::string run_text = read_bytes(temp.path() / "run.json");
  const std::string events_text = read_bytes(temp.path() / "events.jsonl");
  std::mt19937_64 random(20261103);
  int loaded = 0, rejected = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string run = run_text, events = events_text;
    switch (i % 4) {
      case 0: events = mutate(events, random); break;
      case 1: run = mutate(run, random); break;
      case 2: run = mutate(run, random), events = mutate(events, random); break;
      case 3: {  // pure noise
        events.assign(random() % 512, '\0');
        for (char& c : events) c = static_cast<char>(random());
        break;
      }
    }
    try {
      const RunRecord record = parse_run_record(run, events, "fuzz");
      // Whatever loads must be safe for the consumers too.
      (void)chrome_trace_from_events(record.events, record.info).dump();
      ++loaded;
    } catch (const RecordError&) {
      ++rejected;
    }
  }
  EXPECT_GT(loaded, 100);
  EXPECT_GT(rejected, 100);

  // The file-based follower on mutated files, a few hundred times.
  for (int i = 0; i < 300; ++i) {
    write_bytes(temp.path() / "events.jsonl", mutate(events_text, random));
    if (i % 3 == 0) write_bytes(temp.path() / "run.json", mutate(run_text, random));
    else write_bytes(temp.path() / "run.json", run_text);
    try {
      RunReader reader(temp.path());
      reader.poll();
      reader.poll();
    } catch (const RecordError&) {
    }
  }
}

// ---- a large record ----
// A 10 MB record (about the size of a long training run's) loads whole: every line written comes
// back. How long it takes is printed, not asserted: timings belong in benchmarks, and a loaded CI
// machine would make a bound flaky.
TEST(RunRecordLarge, TenMegabytesLoadCompletely) {
  TempDir temp;
  int64_t written = 0;
  {
    RunWriter writer = RunWriter::create(temp.path(), sample_info());
    std::vector<int64_t> counts(64, 17);
    int64_t step = 0;
    while (fs::file_size(temp.path() / "events.jsonl") < 10'000'000) {
      for (int i = 0; i < 100; ++i, ++step) {
        writer.append(step_event(step, {{"loss", 2.0 / (1 + step)}, {"lr", 3e-4}, {"tokens_per_s", 1.2e6}}));
        writer.append(to_event(RoutingEvent{.step = step, .layer = i % 4, .tokens_per_expert = counts,
                                            .dropped_per_expert = counts}));
        writer.append(to_event(SpanEvent{.step = step, .rank = i % 2, .stream = 1, .name = "expert_compute",
                                         .start_us = 10.0 * step, .duration_us = 7.5}));
        written += 3;
      }
    }
  }
  const auto start = std::chrono::steady_clock::now();
  const RunRecord run = RunReader::load(temp.path());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("loaded %zu events (%.1f MB) in %.3f s\n", run.events.size(),
              fs::file_size(temp.path() / "events.jsonl") / 1e6, seconds);
  ASSERT_EQ(int64_t(run.events.size()), written);
  EXPECT_TRUE(run.warnings.empty());
  EXPECT_EQ(run.events.back()["type"], "span");
  EXPECT_EQ(run.events.back()["step"], written / 3 - 1);
}

}  // namespace
}  // namespace moe
