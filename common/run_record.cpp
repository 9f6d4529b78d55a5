// run_record.cpp: RunWriter, RunReader and run.json checks (see run_record.h).
#include "run_record.h"

#include <sys/stat.h>  // fstat: size and inode of the open events.jsonl
#include <unistd.h>    // lseek, ftruncate: cutting a line whose write failed

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>  // std::uncaught_exceptions
#include <fstream>
#include <system_error>

#include "file_io.h"  // write_file_atomically, AtomicFileWriter, read_file_capped
#include "untrusted_json.h"  // parse_untrusted_json: nesting bounded (the viewer walks JSON recursively)

namespace moe {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr const char* kRunFile = "run.json";
constexpr const char* kEventsFile = "events.jsonl";

// A short printable excerpt of a bad line for error messages (binary bytes shown as \xNN).
std::string excerpt(std::string_view line) {
  constexpr size_t kMax = 60;
  std::string out;
  for (size_t i = 0; i < line.size() && i < kMax; ++i) {
    unsigned char c = static_cast<unsigned char>(line[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (line.size() > kMax) out += "...";
  return out;
}

// Parses one JSON text; returns a message instead of throwing so callers add file and line.
std::string parse_json(std::string_view text, json& out) { return parse_untrusted_json(text, out); }

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Parses the complete lines in `text` (each ending in '\n'), handing each event to `on_event`.
// `first_line` is the 1-based number of the first line in the file. A line that is not a valid
// event throws, or, when `on_bad_line` is set, is handed to it as a message and skipped.
template <class OnEvent>
void for_each_complete_line(std::string_view text, int64_t first_line, const std::string& file,
                            OnEvent&& on_event, const BadLineHandler& on_bad_line = {}) {
  int64_t line_number = first_line;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(begin, end - begin);
    if (!is_blank(line)) {
      json event;
      std::string problem = parse_json(line, event);
      if (problem.empty()) problem = validate_event(event);
      if (!problem.empty()) {
        std::string message = file + " line " + std::to_string(line_number) + ": " + problem +
                              "; the line starts: " + excerpt(line);
        if (!on_bad_line) throw RecordError(message);
        on_bad_line(message + " (line skipped)");
      } else {
        on_event(std::move(event));
      }
    }
    begin = end + 1;
    ++line_number;
  }
}

void parse_complete_lines(std::string_view text, int64_t first_line, const std::string& file,
                          std::vector<json>& out, const BadLineHandler& on_bad_line = {}) {
  for_each_complete_line(text, first_line, file, [&](json&& event) { out.push_back(std::move(event)); },
                         on_bad_line);
}

json parse_run_json_text(std::string_view text, const std::string& file) {
  json info;
  std::string problem = parse_json(text, info);
  if (!problem.empty()) throw RecordError(file + ": " + problem);
  try {
    run_info_from_json(info);
  } catch (const RecordError& e) {
    throw RecordError(file + ": " + e.what());
  }
  return info;
}

[[noreturn]] void field_error(const char* field, const char* expected, const json& value) {
  throw RecordError(std::string("run.json field \"") + field + "\" must be " + expected + ", found " +
                    value.type_name());
}

const json* find_field(const json& j, const char* field, bool required) {
  auto it = j.find(field);
  if (it == j.end()) {
    if (required) throw RecordError(std::string("run.json: required field \"") + field + "\" is missing");
    return nullptr;
  }
  return &*it;
}

std::chrono::system_clock::time_point parse_iso8601(const std::string& text, bool& ok) {
  int year = 0, month = 0, day = 0, hour = 0, minute = 0;
  double second = 0;
  ok = std::sscanf(text.c_str(), "%d-%d-%dT%d:%d:%lfZ", &year, &month, &day, &hour, &minute,
                   &second) == 6;
  if (!ok) return {};
  using namespace std::chrono;
  const year_month_day date = std::chrono::year{year} / month / day;
  ok = date.ok();
  if (!ok) return {};
  return sys_days{date} + hours{hour} + minutes{minute} +
         duration_cast<system_clock::duration>(duration<double>{second});
}

// Replaces run.json atomically (file_io.h): a reader sees the old file or the new one, whole.
void write_run_json(const fs::path& dir, const json& run_json) {
  try {
    write_file_atomically(dir / kRunFile, run_json.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
  } catch (const FileWriteError& error) {
    throw RecordError(std::string("writing ") + (dir / kRunFile).string() + " failed: " + error.what());
  }
}

}  // namespace

// ---- run.json ----

std::string_view to_string(RunKind kind) {
  switch (kind) {
    case RunKind::train: return "train";
    case RunKind::infer: return "infer";
    case RunKind::bench: return "bench";
    case RunKind::lesson: return "lesson";
  }
  return "unknown";
}

RunKind parse_run_kind(std::string_view text) {
  for (RunKind kind : {RunKind::train, RunKind::infer, RunKind::bench, RunKind::lesson}) {
    if (text == to_string(kind)) return kind;
  }
  throw RecordError("unknown run kind '" + std::string(text) + "'; allowed: train, infer, bench, lesson");
}

json run_info_to_json(const RunInfo& info) {
  json j = {{"schema_version", kRunSchemaVersion},
            {"kind", to_string(info.kind)},
            {"name", info.name},
            {"model", info.model},
            {"devices", info.devices},
            {"world_size", info.world_size},
            {"start_time", info.start_time},
            {"extra", info.extra}};
  if (info.moe_config) j["moe_config"] = *info.moe_config;
  std::string formulation = info.formulation;
  if (formulation.empty() && info.moe_config) formulation = to_string(info.moe_config->formulation);
  if (!formulation.empty()) j["formulation"] = formulation;
  if (!info.git_commit.empty()) j["git_commit"] = info.git_commit;
  return j;
}

RunInfo run_info_from_json(const json& j) {
  if (!j.is_object()) throw RecordError(std::string("run.json must hold a JSON object, found ") + j.type_name());
  // The version comes first: a newer file may differ in every other field.
  const json* version = find_field(j, "schema_version", true);
  if (!version->is_number_integer()) field_error("schema_version", "an integer", *version);
  if (version->get<int64_t>() != kRunSchemaVersion || (version->is_number_unsigned() &&
                                                       version->get<uint64_t>() > INT64_MAX)) {
    throw RecordError("unsupported schema_version: found " + version->dump() +
                      ", this reader supports " + std::to_string(kRunSchemaVersion));
  }
  RunInfo info;
  const json* kind = find_field(j, "kind", true);
  if (!kind->is_string()) field_error("kind", "a string", *kind);
  info.kind = parse_run_kind(kind->get_ref<const std::string&>());
  const json* name = find_field(j, "name", true);
  if (!name->is_string()) field_error("name", "a string", *name);
  info.name = name->get<std::string>();
  const json* start = find_field(j, "start_time", true);
  if (!start->is_string()) field_error("start_time", "a string (ISO-8601 UTC)", *start);
  info.start_time = start->get<std::string>();

  if (const json* model = find_field(j, "model", false)) {
    if (!model->is_object()) field_error("model", "an object", *model);
    info.model = *model;
  }
  if (const json* config = find_field(j, "moe_config", false); config && !config->is_null()) {
    info.moe_config = config->get<MoeConfig>();  // from_json checks types and validate()s
  }
  if (const json* formulation = find_field(j, "formulation", false)) {
    if (!formulation->is_string()) field_error("formulation", "a string", *formulation);
    info.formulation = formulation->get<std::string>();
  }
  if (const json* devices = find_field(j, "devices", false)) {
    if (!devices->is_array()) field_error("devices", "an array of strings", *devices);
    for (const json& device : *devices) {
      if (!device.is_string()) field_error("devices", "an array of strings", device);
      info.devices.push_back(device.get<std::string>());
    }
  }
  if (const json* world = find_field(j, "world_size", false)) {
    if (!world->is_number_integer() || world->get<int64_t>() < 1) {
      field_error("world_size", "an integer >= 1", *world);
    }
    info.world_size = world->get<int64_t>();
  }
  if (const json* commit = find_field(j, "git_commit", false)) {
    if (!commit->is_string()) field_error("git_commit", "a string", *commit);
    info.git_commit = commit->get<std::string>();
  }
  if (const json* finished = find_field(j, "finished", false)) {
    if (!finished->is_boolean()) field_error("finished", "true or false", *finished);
  }
  if (const json* end = find_field(j, "end_time", false)) {
    if (!end->is_string()) field_error("end_time", "a string (ISO-8601 UTC)", *end);
  }
  if (const json* extra = find_field(j, "extra", false)) {
    if (!extra->is_object()) field_error("extra", "an object", *extra);
    info.extra = *extra;
  }
  return info;
}

std::string utc_now_iso8601() {
  using namespace std::chrono;
  auto now = floor<milliseconds>(system_clock::now());
  auto today = floor<days>(now);
  year_month_day date{today};
  hh_mm_ss time{now - today};
  char text[40];
  std::snprintf(text, sizeof text, "%04d-%02u-%02uT%02d:%02d:%02d.%03dZ", static_cast<int>(date.year()),
                static_cast<unsigned>(date.month()), static_cast<unsigned>(date.day()),
                static_cast<int>(time.hours().count()), static_cast<int>(time.minutes().count()),
                static_cast<int>(time.seconds().count()),
                static_cast<int>(time.subseconds().count()));
  return text;
}

// ---- writing ----

RunWriter::RunWriter(fs::path dir, json run_json, std::FILE* events, std::chrono::steady_clock::time_point origin)
    : dir_(std::move(dir)),
      run_json_(std::move(run_json)),
      events_(events),
      origin_(origin),
      mutex_(std::make_unique<std::mutex>()) {
  // Unbuffered: each line goes to the file in the write of its own append, so nothing of a line
  // whose write failed is left in a buffer for a later flush to add after the cut (append).
  std::setvbuf(events_, nullptr, _IONBF, 0);
}

RunWriter::RunWriter(RunWriter&& other) noexcept
    : dir_(std::move(other.dir_)),
      run_json_(std::move(other.run_json_)),
      events_(std::exchange(other.events_, nullptr)),
      origin_(other.origin_),
      mutex_(std::move(other.mutex_)) {}

RunWriter& RunWriter::operator=(RunWriter&& other) noexcept {
  if (this != &other) {
    try {
      close();  // the record replaced here ended normally
    } catch (const RecordError&) {
      close_file();
    }
    dir_ = std::move(other.dir_);
    run_json_ = std::move(other.run_json_);
    events_ = std::exchange(other.events_, nullptr);
    origin_ = other.origin_;
    mutex_ = std::move(other.mutex_);
  }
  return *this;
}

RunWriter::~RunWriter() {
  if (std::uncaught_exceptions() > 0) {
    close_file();  // the program is failing: no end event, the record reads as partial
    return;
  }
  try {
    close();
  } catch (const RecordError&) {
    // A destructor must not throw; the record just stays unmarked (partial).
  }
}

void RunWriter::close() {
  if (!events_) return;
  close_file();
  // run.json says so last, after every event is in events.jsonl.
  run_json_["finished"] = true;
  run_json_["end_time"] = utc_now_iso8601();
  write_run_json(dir_, run_json_);
}

void RunWriter::close_file() {
  if (events_) {
    std::fclose(events_);
    events_ = nullptr;
  }
}

RunWriter RunWriter::create(const fs::path& dir, RunInfo info, OnExisting on_existing) {
  const fs::path run_file = dir / kRunFile;
  const fs::path events_file = dir / kEventsFile;
  std::error_code error;
  if (on_existing == OnExisting::refuse) {
    for (const fs::path& existing : {run_file, events_file}) {
      if (fs::exists(existing, error)) {
        throw RecordError("refusing to overwrite the existing run at " + dir.string() + " (" +
                          existing.filename().string() +
                          " exists); pick a new run name, delete the directory, or pass "
                          "OnExisting::overwrite");
      }
    }
  }
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir, error)) {
    throw RecordError("cannot create the run directory " + dir.string());
  }
  if (info.start_time.empty()) info.start_time = utc_now_iso8601();
  json run_json = run_info_to_json(info);
  run_json["finished"] = false;  // close() sets it: a record left at false was cut short
  run_info_from_json(run_json);  // never write a run.json our own reader would reject

  // events.jsonl first, exclusively when refusing: if another process created the run in the
  // meantime, this fails before run.json is touched.
  std::FILE* events = std::fopen(events_file.c_str(), on_existing == OnExisting::refuse ? "wbx" : "wb");
  if (!events) {
    throw RecordError("cannot create " + events_file.string() + ": " + std::strerror(errno));
  }
  try {
    write_run_json(dir, run_json);
  } catch (...) {
    // No half run left behind: an events.jsonl without run.json is not a run to any reader, yet it
    // would make the next create refuse the directory as an existing run.
    std::fclose(events);
    fs::remove(events_file, error);
    throw;
  }
  return RunWriter(dir, run_json, events, std::chrono::steady_clock::now());
}

RunWriter RunWriter::resume_at_step(const fs::path& dir, int64_t step) {
  const fs::path events_file = dir / kEventsFile;
  std::ifstream in(events_file, std::ios::binary);
  if (!in) throw RecordError("cannot open " + events_file.string() + ": " + std::strerror(errno));
  try {
    AtomicFileWriter out(events_file);
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // no newline: the half-written last line of a crash
      const json event = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (event.is_discarded()) continue;  // not an event: the reader would stop at it
      const auto at = event.find("step");
      if (at != event.end() && at->is_number_integer() && at->get<int64_t>() > step) continue;
      line += '\n';
      out.write(line.data(), line.size());
    }
    if (in.bad()) throw RecordError("reading " + events_file.string() + " failed");
    out.commit();
  } catch (const FileWriteError& error) {
    throw RecordError("cutting the events after step " + std::to_string(step) + ": " + error.what() +
                      "; " + events_file.string() + " is unchanged");
  }
  return resume(dir);
}

RunWriter RunWriter::resume(const fs::path& dir) {
  const fs::path events_file = dir / kEventsFile;
  json info = parse_run_json_text(read_file_capped(dir / kRunFile, ReadOptions{}.max_file_bytes),
                                  (dir / kRunFile).string());
  std::error_code error;
  // Cut a half-written last line (a crash mid-append), else the next event would be glued to it.
  if (fs::exists(events_file, error)) {
    const uint64_t size = fs::file_size(events_file, error);
    if (!error && size > 0) {
      std::FILE* file = std::fopen(events_file.c_str(), "rb");
      if (!file) throw RecordError("cannot open " + events_file.string() + ": " + std::strerror(errno));
      // Scan back from the end for the last newline, a chunk at a time.
      uint64_t keep = 0;
      uint64_t position = size;
      char chunk[4096];
      while (position > 0 && keep == 0) {
        const uint64_t start = position > sizeof chunk ? position - sizeof chunk : 0;
        const size_t length = static_cast<size_t>(position - start);
        if (std::fseek(file, static_cast<long>(start), SEEK_SET) != 0 ||
            std::fread(chunk, 1, length, file) != length) {
          std::fclose(file);
          throw RecordError("reading " + events_file.string() + " failed");
        }
        for (size_t i = length; i-- > 0;) {
          if (chunk[i] == '\n') {
            keep = start + i + 1;
            break;
          }
        }
        position = start;
      }
      std::fclose(file);
      if (keep != size) fs::resize_file(events_file, keep, error);
      if (error) throw RecordError("cannot cut the partial last line of " + events_file.string());
    }
  }
  std::FILE* events = std::fopen(events_file.c_str(), "ab");
  if (!events) throw RecordError("cannot open " + events_file.string() + ": " + std::strerror(errno));
  // The run goes on: unfinished again until this writer closes it.
  info["finished"] = false;
  info.erase("end_time");
  try {
    write_run_json(dir, info);
  } catch (...) {
    std::fclose(events);
    throw;
  }
  // Keep span times on the same clock as before the restart: origin = the run's start_time.
  auto origin = std::chrono::steady_clock::now();
  bool ok = false;
  auto start = parse_iso8601(info["start_time"].get<std::string>(), ok);
  if (ok) {
    auto since_start = std::chrono::system_clock::now() - start;
    if (since_start.count() > 0) {
      origin -= std::chrono::duration_cast<std::chrono::steady_clock::duration>(since_start);
    }
  }
  return RunWriter(dir, std::move(info), events, origin);
}

void RunWriter::append(const json& event) {
  if (std::string problem = validate_event(event); !problem.empty()) {
    throw RecordError("RunWriter::append(" + (dir_ / kEventsFile).string() + "): " + problem);
  }
  // One dump, one write, one flush: a reader sees whole lines, a crash cuts at most this one.
  std::string line = event.dump(-1, ' ', false, json::error_handler_t::replace);
  line += '\n';
  std::lock_guard lock(*mutex_);
  if (!events_) throw RecordError("RunWriter::append on a closed writer (" + dir_.string() + ")");
  const off_t before = ::lseek(::fileno(events_), 0, SEEK_END);
  if (std::fwrite(line.data(), 1, line.size(), events_) != line.size() || std::fflush(events_) != 0) {
    // A short write (a full disk, a file size limit) leaves part of the line. Cut it off, so the
    // record ends at its last complete event, and close the writer: an event appended after a
    // lost one would leave a gap no reader could see.
    const std::string why = std::strerror(errno);
    const bool cut = before >= 0 && ::ftruncate(::fileno(events_), before) == 0;
    std::fclose(std::exchange(events_, nullptr));
    throw RecordError("writing " + (dir_ / kEventsFile).string() + " failed: " + why +
                      (cut ? "; the record ends at its last complete event" : "; its last line may be partial"));
  }
}

double RunWriter::elapsed_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

// ---- reading ----

RunRecord parse_run_record(std::string_view run_json_text, std::string_view events_text,
                           const std::string& source, const BadLineHandler& on_bad_line) {
  RunRecord record;
  record.info = parse_run_json_text(run_json_text, source + "/" + kRunFile);
  const std::string events_file = source + "/" + kEventsFile;
  const size_t last_newline = events_text.rfind('\n');
  const size_t complete = last_newline == std::string_view::npos ? 0 : last_newline + 1;
  parse_complete_lines(events_text.substr(0, complete), 1, events_file, record.events, on_bad_line);

  // What follows the last newline is a line still being written (live run) or cut by a crash.
  std::string_view tail = events_text.substr(complete);
  if (!is_blank(tail)) {
    const int64_t line_number =
        1 + static_cast<int64_t>(std::count(events_text.begin(), events_text.begin() + complete, '\n'));
    json event;
    std::string problem = parse_json(tail, event);
    if (problem.empty()) problem = validate_event(event);
    if (problem.empty()) {
      record.events.push_back(std::move(event));
      record.warnings.push_back(events_file + " line " + std::to_string(line_number) +
                                ": the last line has no newline; read it anyway");
    } else {
      record.warnings.push_back(events_file + " line " + std::to_string(line_number) +
                                ": half-written last line (" + std::to_string(tail.size()) +
                                " bytes) ignored; the run is still being written or was interrupted");
    }
  }
  return record;
}

RunRecord RunReader::load(const fs::path& dir, const ReadOptions& options) {
  const fs::path run_file = dir / kRunFile;
  std::error_code error;
  if (!fs::is_regular_file(run_file, error)) {
    throw RecordError(dir.string() + " is not a run: " + run_file.string() + " is missing");
  }
  std::string run_text = read_file_capped(run_file, options.max_file_bytes);
  std::string events_text;
  // A run whose program has not appended anything yet may lack events.jsonl: that is no error.
  if (fs::exists(dir / kEventsFile, error)) {
    events_text = read_file_capped(dir / kEventsFile, options.max_file_bytes);
  }
  return parse_run_record(run_text, events_text, dir.string());
}

RunReader::RunReader(fs::path dir, ReadOptions options) : dir_(std::move(dir)), options_(options) {
  const fs::path run_file = dir_ / kRunFile;
  std::error_code error;
  if (!fs::is_regular_file(run_file, error)) {
    throw RecordError(dir_.string() + " is not a run: " + run_file.string() + " is missing");
  }
  info_ = parse_run_json_text(read_file_capped(run_file, options_.max_file_bytes), run_file.string());
}

std::vector<json> RunReader::poll() {
  std::vector<json> events;
  const fs::path events_file = dir_ / kEventsFile;
  std::FILE* file = std::fopen(events_file.c_str(), "rb");
  if (!file) return events;  // not created yet
  std::string fresh;
  bool failed = false;
  if (std::fseek(file, 0, SEEK_END) != 0) failed = true;
  const long end = failed ? -1 : std::ftell(file);
  if (end < 0) failed = true;
  if (!failed && static_cast<uint64_t>(end) < offset_) {
    std::fclose(file);
    throw RecordError(events_file.string() + " shrank from " + std::to_string(offset_) + " to " +
                      std::to_string(end) + " bytes: the run was rewritten; open a new reader");
  }
  if (!failed && static_cast<uint64_t>(end) > options_.max_file_bytes) {
    std::fclose(file);
    throw RecordError(events_file.string() + " is larger than the limit of " +
                      std::to_string(options_.max_file_bytes) +
                      " bytes; raise ReadOptions::max_file_bytes if this file is expected");
  }
  if (!failed && std::fseek(file, static_cast<long>(offset_), SEEK_SET) != 0) failed = true;
  if (!failed) {
    // Read what is there now; the file may keep growing, the next poll picks that up.
    fresh.resize(static_cast<size_t>(static_cast<uint64_t>(end) - offset_));
    fresh.resize(std::fread(fresh.data(), 1, fresh.size(), file));
  }
  std::fclose(file);
  if (failed) throw RecordError("reading " + events_file.string() + " failed");

  const size_t last_newline = fresh.rfind('\n');
  const size_t complete = last_newline == std::string::npos ? 0 : last_newline + 1;
  parse_complete_lines(std::string_view(fresh).substr(0, complete), lines_consumed_ + 1,
                       events_file.string(), events);
  offset_ += complete;
  lines_consumed_ += std::count(fresh.begin(), fresh.begin() + static_cast<std::ptrdiff_t>(complete), '\n');
  has_partial_line_ = complete < fresh.size();
  return events;
}

int64_t RunReader::poll_each(const std::function<void(const json&)>& on_event, uint64_t max_bytes,
                             const BadLineHandler& on_bad_line) {
  const fs::path events_file = dir_ / kEventsFile;
  caught_up_ = true;
  has_partial_line_ = false;
  std::FILE* file = std::fopen(events_file.c_str(), "rb");
  if (!file) return 0;  // not created yet
  // Closed on every path out, exceptions from on_event included.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(file, &std::fclose);
  struct stat info {};
  if (fstat(fileno(file), &info) != 0) throw RecordError("reading " + events_file.string() + " failed");
  const uint64_t end = static_cast<uint64_t>(info.st_size);
  const uint64_t id = static_cast<uint64_t>(info.st_ino);
  if (file_id_ != 0 && id != file_id_) {
    throw RecordError(events_file.string() + " was replaced by another file after " + std::to_string(offset_) +
                      " bytes were read: the run was rewritten; open it again");
  }
  if (end < offset_) {
    throw RecordError(events_file.string() + " shrank from " + std::to_string(offset_) + " to " +
                      std::to_string(end) + " bytes: the run was rewritten; open it again");
  }
  file_id_ = id;
  if (fseeko(file, static_cast<off_t>(offset_), SEEK_SET) != 0) {
    throw RecordError("reading " + events_file.string() + " failed");
  }
  // Read blocks, parse the complete lines of each, carry a cut line over to the next block.
  // `buffer` always holds the bytes from offset_ on that are read but not yet parsed.
  const size_t block = static_cast<size_t>(std::max<uint64_t>(options_.read_block_bytes, 1));
  std::string buffer;
  uint64_t parsed_this_call = 0;
  int64_t events = 0;
  while (offset_ + buffer.size() < end && parsed_this_call < max_bytes) {
    const size_t carried = buffer.size();
    const size_t want = static_cast<size_t>(std::min<uint64_t>({block, std::max<uint64_t>(max_bytes, 1), end - offset_ - carried}));
    buffer.resize(carried + want);
    const size_t got = std::fread(buffer.data() + carried, 1, want, file);
    buffer.resize(carried + got);
    if (got == 0) break;  // the file was cut under us; the next call sees that it shrank
    // Only the new bytes can hold a newline: the carried ones had none (a long line read in
    // many blocks is searched once, not once per block).
    const size_t new_newline = std::string_view(buffer).substr(carried).rfind('\n');
    const size_t last_newline = new_newline == std::string_view::npos ? std::string::npos : carried + new_newline;
    if (last_newline == std::string::npos) {
      // One long line (or a partial last one) goes on into the next block.
      if (buffer.size() > kMaxLineBytes) {
        throw RecordError(events_file.string() + " line " + std::to_string(lines_consumed_ + 1) +
                          " is longer than " + std::to_string(kMaxLineBytes >> 20) +
                          " MiB without a newline: not a run record's event");
      }
      continue;
    }
    const size_t complete = last_newline + 1;
    const std::string_view lines(buffer.data(), complete);
    for_each_complete_line(lines, lines_consumed_ + 1, events_file.string(), [&](json&& event) {
      on_event(event);
      ++events;
    }, on_bad_line);
    offset_ += complete;
    parsed_this_call += complete;
    lines_consumed_ += std::count(lines.begin(), lines.end(), '\n');
    buffer.erase(0, complete);
  }
  caught_up_ = offset_ + buffer.size() >= end;
  has_partial_line_ = !buffer.empty();
  return events;
}

std::string RunReader::finish_last_line(const std::function<void(const json&)>& on_event) {
  if (!has_partial_line_) return "";
  const fs::path events_file = dir_ / kEventsFile;
  std::string tail;
  {
    std::FILE* file = std::fopen(events_file.c_str(), "rb");
    if (!file) return "";
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(file, &std::fclose);
    struct stat info {};
    if (fstat(fileno(file), &info) != 0 || static_cast<uint64_t>(info.st_size) <= offset_ ||
        fseeko(file, static_cast<off_t>(offset_), SEEK_SET) != 0)
      return "";
    tail.resize(static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(info.st_size) - offset_, kMaxLineBytes)));
    tail.resize(std::fread(tail.data(), 1, tail.size(), file));
  }
  has_partial_line_ = false;
  if (is_blank(tail)) return "";
  const std::string where = events_file.string() + " line " + std::to_string(lines_consumed_ + 1);
  json event;
  std::string problem = parse_json(tail, event);
  if (problem.empty()) problem = validate_event(event);
  if (!problem.empty()) {
    return where + ": half-written last line (" + std::to_string(tail.size()) +
           " bytes) ignored; the run is still being written or was interrupted";
  }
  on_event(event);
  offset_ += tail.size();
  return where + ": the last line has no newline; read it anyway";
}

}  // namespace moe
