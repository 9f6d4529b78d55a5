// test_writer_faults.cpp: the checkpoint and run-record writers under the faults of a real disk:
// a full disk, a rename that does not happen, a short write, and the cut of a resumed
// run's events. After each, the last complete checkpoint must still load, the record must read as
// whole events only, and the message must name the file and the fault.
//
// A full disk is a file size limit (setrlimit RLIMIT_FSIZE) in a forked child with SIGXFSZ
// ignored: write(2) then fails with EFBIG ("File too large") part-way through, as it would with
// ENOSPC on a full disk, and the limit dies with the child. A rename that does not happen: the
// target name is held by a non-empty directory, which rename(2) refuses even for root.
//   ctest --test-dir build -R WriterFaults
#include <gtest/gtest.h>

#include <sys/resource.h>  // setrlimit
#include <sys/wait.h>      // waitpid
#include <unistd.h>        // fork, _exit

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "run_record.h"
#include "temp_dir.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using moe::testing::TempDir;

// Runs `body` in a child process whose files cannot grow past `max_file_bytes`; returns the
// child's exit status (body's return value, 0..255), or -1 if it did not exit normally.
int in_child_with_file_limit(uint64_t max_file_bytes, const std::function<int()>& body) {
  std::fflush(nullptr);  // nothing buffered in the parent is written twice
  const pid_t child = fork();
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing
    const rlimit limit{max_file_bytes, max_file_bytes};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(250);
    int status = 251;
    try {
      status = body();
    } catch (...) {
      status = 252;  // an exception the body did not expect
    }
    std::fflush(nullptr);
    _exit(status);
  }
  int raw = 0;
  waitpid(child, &raw, 0);
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<float> random_floats(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(generator);
  return values;
}

// A checkpoint of `floats` weights at `step` in `directory`, as the trainer names it.
fs::path save_step(const fs::path& directory, int64_t step, const std::vector<float>& weights) {
  CheckpointHeader header;
  header.step = step;
  const fs::path path = checkpoint_path(directory, step);
  save_checkpoint(path, header, {{"weights", weights}});
  return path;
}

// ---- checkpoints ----

TEST(WriterFaults, CheckpointOnAFullDiskLeavesTheLastOneLatestAndLoadable) {
  TempDir dir;
  const std::vector<float> old_weights = random_floats(64, 1);  // ~0.5 KB: fits under the limit
  const fs::path old_path = save_step(dir.path(), 10, old_weights);
  const std::vector<float> new_weights = random_floats(4096, 2);  // 16 KB: does not
  const fs::path message_file = dir.path() / "message.txt";

  const int status = in_child_with_file_limit(4096, [&] {
    try {
      save_step(dir.path(), 20, new_weights);
      return 1;  // the save passed the limit
    } catch (const CheckpointError& error) {
      std::ofstream(message_file) << error.what();
      return 0;
    }
  });
  ASSERT_EQ(status, 0) << "the save under a 4 KB file limit did not fail with CheckpointError";
  std::string message;
  std::getline(std::ifstream(message_file), message);
  EXPECT_TRUE(contains(message, "checkpoint_00000020.ckpt")) << message;
  EXPECT_TRUE(contains(message, "File too large")) << message;

  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path(), 20)));
  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path(), 20).string() + ".tmp")) << "the temporary is left behind";
  ASSERT_EQ(latest_checkpoint(dir.path()), old_path);
  const LoadedCheckpoint loaded = load_checkpoint(old_path, {{"weights", old_weights.size()}});
  EXPECT_EQ(loaded.header.step, 10);
  EXPECT_EQ(loaded.array("weights"), old_weights);
}

TEST(WriterFaults, CheckpointWhoseRenameFailsLeavesTheLastOneLatestAndLoadable) {
  TempDir dir;
  const std::vector<float> weights = random_floats(64, 3);
  const fs::path old_path = save_step(dir.path(), 10, weights);
  // The new checkpoint's name is taken by a non-empty directory: rename(2) over it fails.
  const fs::path blocked = checkpoint_path(dir.path(), 20);
  fs::create_directories(blocked / "inside");
  try {
    save_step(dir.path(), 20, weights);
    FAIL() << "a save whose rename cannot happen succeeded";
  } catch (const CheckpointError& error) {
    EXPECT_TRUE(contains(error.what(), "cannot rename")) << error.what();
    EXPECT_TRUE(contains(error.what(), blocked.string())) << error.what();
  }
  EXPECT_FALSE(fs::exists(blocked.string() + ".tmp")) << "the temporary is left behind";
  // latest_checkpoint looks at files only: the directory with a checkpoint's name is not one.
  ASSERT_EQ(latest_checkpoint(dir.path()), old_path);
  EXPECT_EQ(load_checkpoint(old_path, {{"weights", weights.size()}}).header.step, 10);
}

// ---- the run record ----

RunInfo small_info() {
  RunInfo info;
  info.kind = RunKind::train;
  info.name = "faults";
  info.devices = {"cpu"};
  return info;
}

TEST(WriterFaults, RecordOnAFullDiskEndsAtItsLastCompleteEventAndResumes) {
  TempDir dir;
  const fs::path run = dir.path() / "run";
  {
    RunWriter writer = RunWriter::create(run, small_info());
    for (int64_t step = 1; step <= 3; ++step) writer.append(step_event(step, {{"loss", 1.0 / double(step)}}));
  }
  const uint64_t limit = fs::file_size(run / "events.jsonl") + 300;  // room for a few more lines
  const fs::path message_file = dir.path() / "message.txt";

  // The child appends until the limit stops it, then tries once more; its status is how many
  // appends succeeded (or 200 + a code for what went wrong).
  const int appended = in_child_with_file_limit(limit, [&] {
    RunWriter writer = RunWriter::resume(run);
    int done = 0;
    try {
      for (int64_t step = 4; step < 100; ++step) {
        writer.append(step_event(step, {{"loss", 1.0 / double(step)}, {"lr", 3e-4}}));
        ++done;
      }
      return 200;  // never stopped
    } catch (const RecordError& error) {
      std::ofstream(message_file) << error.what();
    }
    try {
      writer.append(step_event(100, {{"loss", 0.01}}));
      return 201;  // appended after a lost event
    } catch (const RecordError&) {
    }
    return done;
  });
  ASSERT_GT(appended, 0) << "status " << appended;
  ASSERT_LT(appended, 96) << "status " << appended;
  std::string message;
  std::getline(std::ifstream(message_file), message);
  EXPECT_TRUE(contains(message, "events.jsonl")) << message;
  EXPECT_TRUE(contains(message, "File too large")) << message;
  EXPECT_TRUE(contains(message, "ends at its last complete event")) << message;

  // Whole events only, no warning of a partial line: steps 1 .. 3 + appended.
  RunRecord record = RunReader::load(run);
  EXPECT_TRUE(record.warnings.empty()) << record.warnings.front();
  ASSERT_EQ(record.events.size(), size_t(3 + appended));
  for (size_t i = 0; i < record.events.size(); ++i) EXPECT_EQ(record.events[i]["step"], int64_t(i + 1));

  // With room again, the run goes on where the record ends.
  {
    RunWriter writer = RunWriter::resume(run);
    writer.append(step_event(4 + appended, {{"loss", 0.5}}));
  }
  record = RunReader::load(run);
  ASSERT_EQ(record.events.size(), size_t(4 + appended));
  EXPECT_EQ(record.events.back()["step"], int64_t(4 + appended));
}

TEST(WriterFaults, RunCreatedOnAFullDiskLeavesNoHalfRun) {
  TempDir dir;
  const fs::path run = dir.path() / "run";
  const int status = in_child_with_file_limit(16, [&] {  // run.json is larger than 16 bytes
    try {
      RunWriter::create(run, small_info());
      return 1;
    } catch (const RecordError& error) {
      return contains(error.what(), "run.json") ? 0 : 2;
    }
  });
  ASSERT_EQ(status, 0);
  EXPECT_FALSE(fs::exists(run / "run.json"));
  EXPECT_FALSE(fs::exists(run / "events.jsonl")) << "a half run would block the next create";
  RunWriter writer = RunWriter::create(run, small_info());  // the retry is not refused
  writer.append(step_event(1, {{"loss", 1.0}}));
}

// ---- resuming at a checkpoint's step ----

// A record as an interrupted run leaves it: steps 1..8 with a routing event at step 4 and 8, a
// table without a step, and a half-written last line.
fs::path interrupted_run(const fs::path& run) {
  RunWriter writer = RunWriter::create(run, small_info());
  for (int64_t step = 1; step <= 8; ++step) {
    writer.append(step_event(step, {{"loss", 1.0 / double(step)}}));
    if (step % 4 == 0) {
      writer.append(to_event(RoutingEvent{.step = step, .layer = 0, .tokens_per_expert = {1, 2},
                                          .dropped_per_expert = {0, 0}, .capacity = 4}));
    }
  }
  writer.append(to_event(TableEvent{.name = "note", .columns = {"a"}, .rows = {{1}}}));
  writer.close();
  std::ofstream(run / "events.jsonl", std::ios::app) << R"({"type": "step", "step": 9, "lo)";
  return run;
}

TEST(WriterFaults, ResumeAtStepCutsLaterStepsAndTheHalfLineSoNoStepAppearsTwice) {
  TempDir dir;
  const fs::path run = interrupted_run(dir.path() / "run");
  {
    RunWriter writer = RunWriter::resume_at_step(run, 5);  // the checkpoint of step 5
    for (int64_t step = 6; step <= 8; ++step) writer.append(step_event(step, {{"loss", 1.0 / double(step)}}));
  }
  const RunRecord record = RunReader::load(run);
  EXPECT_TRUE(record.warnings.empty()) << record.warnings.front();
  std::vector<int64_t> steps;
  int routing = 0, tables = 0;
  for (const auto& event : record.events) {
    if (event["type"] == "step") steps.push_back(event["step"].get<int64_t>());
    routing += event["type"] == "routing";
    tables += event["type"] == "table";
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(routing, 1) << "the routing of step 4 stays, that of step 8 goes";
  EXPECT_EQ(tables, 1) << "an event without a step stays";
}

TEST(WriterFaults, ResumeAtStepOnAFullDiskLeavesTheRecordAsItWas) {
  TempDir dir;
  const fs::path run = interrupted_run(dir.path() / "run");
  const std::string before = [&] {
    std::ifstream in(run / "events.jsonl", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }();
  const int status = in_child_with_file_limit(64, [&] {  // the cut copy cannot be written
    try {
      RunWriter::resume_at_step(run, 5);
      return 1;
    } catch (const RecordError& error) {
      return contains(error.what(), "is unchanged") && contains(error.what(), "File too large") ? 0 : 2;
    }
  });
  ASSERT_EQ(status, 0);
  std::ifstream in(run / "events.jsonl", std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), before);
  EXPECT_FALSE(fs::exists(run / "events.jsonl.tmp"));
}

}  // namespace
}  // namespace moe
