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
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_record.h"  // RunRecord

namespace moe {

inline constexpr int64_t kAllToAllThread = 1000;  // tid of all-to-all spans, apart from streams

// {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...run name...}}
nlohmann::json chrome_trace_from_events(const std::vector<nlohmann::json>& events,
                                        const nlohmann::json& run_info = nlohmann::json::object());

// Writes chrome_trace_from_events(run) to `out` atomically; returns the number of X events.
int64_t export_chrome_trace(const RunRecord& run, const std::filesystem::path& out);

}  // namespace moe
