// chrome_trace.h: a run's timeline in the Chrome trace event format, so it opens in Perfetto
// (ui.perfetto.dev) and chrome://tracing as well as in our viewer.
//
// Each "span" event becomes a complete event {"ph":"X"} with pid = rank, tid = stream,
// ts = start_us and dur = duration_us (both microseconds, the format's unit); each rank and stream
// gets a process_name / thread_name metadata event ("rank 0", the span's stream_name or
// "stream 1"). An "alltoall" event that carries start_us is shown as a span too, on its rank's
// thread kAllToAllThread named "all-to-all", with its byte counts in "args".
//   moe::export_chrome_trace(moe::RunReader::load(dir), "trace.json");
// or from a shell:  build/common/moe_trace_export notebooks_data/runs/<name> trace.json
// A record of any size streams through ChromeTraceWriter, one event at a time (moe_trace_export
// does so): memory is the rank and stream names, never the record or the trace.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_record.h"  // RunRecord

namespace moe {

class AtomicFileWriter;  // file_io.h

inline constexpr int64_t kAllToAllThread = 1000;  // tid of all-to-all spans, apart from streams

// {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...run name...}}
nlohmann::json chrome_trace_from_events(const std::vector<nlohmann::json>& events,
                                        const nlohmann::json& run_info = nlohmann::json::object());

// Writes chrome_trace_from_events(run) to `out` atomically; returns the number of X events.
int64_t export_chrome_trace(const RunRecord& run, const std::filesystem::path& out);

// The same trace written as the events come: add() each event of the record in file order, then
// finish() (the metadata events, the closing bytes, the atomic rename over `out`). Until finish()
// the trace is a temporary file beside `out`; a writer destroyed without finish() removes it.
// Throws FileWriteError (file_io.h) when the file cannot be written.
class ChromeTraceWriter {
 public:
  ChromeTraceWriter(const std::filesystem::path& out, const nlohmann::json& run_info);
  ~ChromeTraceWriter();
  void add(const nlohmann::json& event);
  int64_t finish();  // returns the number of X events written
  int64_t complete_events() const { return complete_events_; }

 private:
  void write_trace_event(const nlohmann::json& trace_event);
  void flush();

  std::unique_ptr<AtomicFileWriter> file_;
  nlohmann::json other_data_;
  std::string pending_;  // bytes not yet handed to the file (written a megabyte at a time)
  std::set<int64_t> ranks_;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names_;  // (rank, stream) -> name
  int64_t complete_events_ = 0;
  bool first_ = true;
};

}  // namespace moe
