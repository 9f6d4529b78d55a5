// run_record.h: write and read run records, schema version 1 (format: notebooks_data/README.md).
//
// A run is a directory, by convention notebooks_data/runs/<name>/, holding
//   run.json      what ran: kind, name, model and MoE config, devices, commit, start time
//                 (written once, atomically)
//   events.jsonl  what happened: one JSON event per line, appended as the run goes (run_events.h)
// run.json's "finished" says whether the writer closed the record (false: cut short, "partial").
// Programs write with RunWriter; tools read with RunReader, whole (load) or live (poll, which
// returns only the complete lines that arrived since the last call). The viewer streams instead
// (poll_each: each event handed over as it is parsed, a bounded piece of the file per call), so a
// record of millions of events costs only what the viewer keeps of it.
//
//   moe::RunInfo info{.kind = moe::RunKind::train, .name = "tiny-dropless", .moe_config = config};
//   auto writer = moe::RunWriter::create("notebooks_data/runs/tiny-dropless", info);
//   writer.append(moe::step_event(1, {{"loss", 2.31}}));
//
//   moe::RunRecord run = moe::RunReader::load("notebooks_data/runs/tiny-dropless");
//
// Every reading error is a moe::RecordError whose message names the file (and line); readers
// never crash on arbitrary bytes. Writers flush every line, so a reader in another process sees
// each event as soon as append() returns and a crash loses at most the line being written.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe_config.h"       // MoeConfig
#include "config_json.h"  // MoeConfig <-> JSON
#include "record_error.h"     // RecordError
#include "run_events.h"       // event types and helpers

namespace moe {

inline constexpr int64_t kRunSchemaVersion = 1;

// ---- run.json ----

enum class RunKind { train, infer, bench, lesson };
std::string_view to_string(RunKind kind);
RunKind parse_run_kind(std::string_view text);  // throws RecordError listing the allowed names

struct RunInfo {
  RunKind kind = RunKind::lesson;
  std::string name;
  std::optional<MoeConfig> moe_config;            // the MoE layer, when the run has one
  nlohmann::json model = nlohmann::json::object();  // the rest of the model: layers L, vocab, ...
  std::string formulation;          // "" = taken from moe_config when present
  std::vector<std::string> devices;  // e.g. {"NVIDIA H100 80GB HBM3"}, one per rank
  int64_t world_size = 1;            // R
  std::string git_commit;           // "" = unknown (omitted from run.json)
  std::string start_time;           // ISO-8601 UTC; "" = RunWriter::create fills in now
  nlohmann::json extra = nlohmann::json::object();  // anything else the program wants to keep
};

// run.json's object, schema_version included.
nlohmann::json run_info_to_json(const RunInfo& info);
// Checks schema_version first (an unknown one names found and supported versions), then the
// required fields and the types of the optional ones, moe_config included. Throws RecordError.
RunInfo run_info_from_json(const nlohmann::json& run_json);

// Now, as ISO-8601 UTC with milliseconds: "2026-11-03T12:34:56.789Z".
std::string utc_now_iso8601();

// ---- writing ----

enum class OnExisting {
  refuse,     // create() throws if the directory already holds run.json or events.jsonl
  overwrite,  // replace run.json and truncate events.jsonl; other files are left alone
};

class RunWriter {
 public:
  // Creates the directory (and parents) and a new run in it. Throws RecordError naming the path
  // when a run is already there, unless on_existing is OnExisting::overwrite.
  static RunWriter create(const std::filesystem::path& dir, RunInfo info,
                          OnExisting on_existing = OnExisting::refuse);
  // Reopens an existing run to keep appending (a resumed training run). A half-written last line
  // left by a crash is cut off first, so the next event starts on a line of its own.
  static RunWriter resume(const std::filesystem::path& dir);
  // resume() for a run continued from the checkpoint of `step`: first the events of later steps
  // are cut (the interrupted run wrote them after that checkpoint and the resumed run writes them
  // again; kept, those steps would appear twice), with events that carry no step and any
  // half-written last line. The cut replaces events.jsonl atomically (file_io.h), so a crash or a
  // full disk during it leaves the old file whole.
  static RunWriter resume_at_step(const std::filesystem::path& dir, int64_t step);

  RunWriter(RunWriter&& other) noexcept;
  RunWriter& operator=(RunWriter&& other) noexcept;
  RunWriter(const RunWriter&) = delete;
  RunWriter& operator=(const RunWriter&) = delete;
  ~RunWriter();

  // Appends one event as one line and flushes it. The event must pass validate_event() (else
  // RecordError: better to fail in the program than to write a line the viewer rejects).
  // Safe to call from several threads of one process; one process writes a given run.
  // A write that fails part-way (a full disk, a file size limit) throws RecordError naming the
  // file and the fault; the partial line is cut off and the writer closed, so the record ends at
  // its last complete event (RunWriter::resume continues it).
  void append(const nlohmann::json& event);

  // Microseconds since the run's start_time, from a steady clock: the clock of span start_us.
  double elapsed_us() const;

  const std::filesystem::path& dir() const { return dir_; }
  // Ends the record: closes events.jsonl, then marks the run finished in run.json ("finished":
  // true and "end_time", written atomically; create() and resume() write "finished": false). The
  // destructor does the same, except while an exception unwinds the stack: a program that fails,
  // like one that is killed, leaves "finished": false, which the viewer shows as partial. A writer
  // whose append failed is already closed and marks nothing. Throws RecordError when run.json
  // cannot be written.
  void close();

 private:
  RunWriter(std::filesystem::path dir, nlohmann::json run_json, std::FILE* events,
            std::chrono::steady_clock::time_point origin);
  void close_file();  // closes events.jsonl without marking the run finished

  std::filesystem::path dir_;
  nlohmann::json run_json_;  // what run.json holds; close() adds "finished": true
  std::FILE* events_ = nullptr;
  std::chrono::steady_clock::time_point origin_;
  std::unique_ptr<std::mutex> mutex_;
};

// ---- reading ----

// Takes the message about a line of events.jsonl that is not a valid event (it names the file and
// the line). A reader given one skips such a line and goes on with the next; without one it throws.
using BadLineHandler = std::function<void(const std::string& message)>;

struct ReadOptions {
  uint64_t max_file_bytes = uint64_t{1} << 30;  // 1 GiB: larger run.json / events.jsonl are refused
                                                // by load() and poll(); poll_each() has no such limit
  uint64_t read_block_bytes = uint64_t{4} << 20;  // poll_each() reads this much at a time (the
                                                  // fuzz target makes it tiny to cut every line)
};

struct RunRecord {
  nlohmann::json info;                // run.json, checked by run_info_from_json
  std::vector<nlohmann::json> events;  // every complete event, in file order, each validated
  std::vector<std::string> warnings;   // e.g. a half-written last line that was ignored
  RunInfo run_info() const { return run_info_from_json(info); }
};

class RunReader {
 public:
  // Whole run at once. A half-written last line (no newline, not valid JSON) is ignored with a
  // warning: that is what a live or crashed run looks like. A bad line followed by more lines is
  // corruption and throws, naming the file and line number.
  static RunRecord load(const std::filesystem::path& dir, const ReadOptions& options = {});

  // Following a live run: reads and checks run.json now; events come from poll().
  explicit RunReader(std::filesystem::path dir, ReadOptions options = {});

  const nlohmann::json& info() const { return info_; }
  // The complete events appended since the last call (or since the start). A trailing partial
  // line stays pending, unread, until its newline arrives. Throws RecordError on a corrupt line,
  // or if events.jsonl shrank (the run was rewritten: open a new reader).
  std::vector<nlohmann::json> poll();
  // The streaming form of poll(), for records of any size: hands each new complete event to
  // on_event (which keeps what it needs; the JSON is gone afterwards) instead of collecting them,
  // and reads at most about max_bytes per call (whole lines; a longer line is read whole up to
  // kMaxLineBytes), so a record that grew by gigabytes is taken in bounded steps while the
  // caller keeps drawing. No limit on the file's size: memory is one chunk plus what on_event
  // keeps. Returns the number of events; caught_up() says whether the end was reached. Throws
  // RecordError on a corrupt or over-long line, or when events.jsonl shrank or was replaced by
  // another file (a different inode) since the last call. Given on_bad_line, a corrupt line (not
  // JSON, a number beyond double's range such as 1e400, a known event with a wrong field) is
  // handed to it and skipped instead, and the later lines are read: the viewer and
  // moe_trace_export show what is left of a damaged record and say which lines they left out.
  int64_t poll_each(const std::function<void(const nlohmann::json&)>& on_event,
                    uint64_t max_bytes = uint64_t{64} << 20, const BadLineHandler& on_bad_line = {});
  bool caught_up() const { return caught_up_; }
  // After the last poll_each: the trailing line that has no newline, handled as load() does (a
  // valid event is handed over with a warning, anything else only warned about). Returns the
  // warning, "" when there is no such line. For a finished run; a live one would finish it later.
  std::string finish_last_line(const std::function<void(const nlohmann::json&)>& on_event);
  static constexpr uint64_t kMaxLineBytes = uint64_t{64} << 20;  // no event is near this

  uint64_t offset() const { return offset_; }             // bytes of events.jsonl consumed
  int64_t lines_consumed() const { return lines_consumed_; }
  bool has_partial_line() const { return has_partial_line_; }  // after the last poll()

 private:
  std::filesystem::path dir_;
  ReadOptions options_;
  nlohmann::json info_;
  uint64_t offset_ = 0;
  int64_t lines_consumed_ = 0;
  bool has_partial_line_ = false;
  bool caught_up_ = false;
  uint64_t file_id_ = 0;  // events.jsonl's inode once it has been read from (0: not yet)
};

// The same checks as RunReader::load on text in memory (tests, fuzzing, other transports).
// `source` names the run in messages; on_bad_line as for RunReader::poll_each.
RunRecord parse_run_record(std::string_view run_json_text, std::string_view events_text,
                           const std::string& source = "<memory>", const BadLineHandler& on_bad_line = {});

}  // namespace moe
