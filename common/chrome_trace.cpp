// chrome_trace.cpp: span and all-to-all events -> Chrome trace event format (see chrome_trace.h).
#include "chrome_trace.h"

#include <map>
#include <set>
#include <string>
#include <utility>

#include "file_io.h"  // AtomicFileWriter

namespace moe {

using nlohmann::json;

namespace {

int64_t integer_or(const json& event, const char* field, int64_t fallback) {
  auto it = event.find(field);
  return it != event.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

// A "complete" trace event (ph "X"): one bar on row (pid = rank, tid = thread) over the event's
// start_us and duration_us.
json complete_event(const json& event, const json& name, const char* category, int64_t rank, int64_t thread,
                    json args) {
  return {{"name", name},
          {"cat", category},
          {"ph", "X"},
          {"pid", rank},
          {"tid", thread},
          {"ts", event["start_us"]},
          {"dur", event["duration_us"]},
          {"args", std::move(args)}};
}

// What one event of the record adds to the trace: a complete event for a span, or for an
// all-to-all that carries start_us (null otherwise), with the rank and the thread's name noted.
json trace_event_of(const json& event, std::set<int64_t>& ranks,
                    std::map<std::pair<int64_t, int64_t>, std::string>& thread_names) {
  if (!event.is_object()) return nullptr;
  auto type = event.find("type");
  if (type == event.end() || !type->is_string()) return nullptr;

  if (*type == "span" && validate_event(event).empty()) {
    const int64_t rank = event["rank"].get<int64_t>();
    const int64_t stream = event["stream"].get<int64_t>();
    json args = {{"step", integer_or(event, "step", -1)}};
    ranks.insert(rank);
    auto& name = thread_names[{rank, stream}];
    if (auto label = event.find("stream_name"); label != event.end() && label->is_string()) {
      name = label->get<std::string>();
    } else if (name.empty()) {
      name = "stream " + std::to_string(stream);
    }
    return complete_event(event, event["name"], "span", rank, stream, std::move(args));
  }
  if (*type == "alltoall" && validate_event(event).empty() && event.contains("start_us")) {
    const int64_t rank = integer_or(event, "rank", 0);
    int64_t total = 0, sent = 0;
    const json& bytes = event["bytes"];
    for (size_t source = 0; source < bytes.size(); ++source) {
      for (const json& count : bytes[source]) {
        total += count.get<int64_t>();
        if (static_cast<int64_t>(source) == rank) sent += count.get<int64_t>();
      }
    }
    std::string name = "alltoall";
    if (auto label = event.find("name"); label != event.end() && label->is_string()) name = *label;
    json args = {{"step", integer_or(event, "step", -1)}, {"bytes_total", total}, {"bytes_sent", sent}};
    if (event.contains("layer")) args["layer"] = event["layer"];
    ranks.insert(rank);
    thread_names[{rank, kAllToAllThread}] = "all-to-all";
    return complete_event(event, name, "alltoall", rank, kAllToAllThread, std::move(args));
  }
  return nullptr;
}

// The metadata events that name the rows of the timeline.
std::vector<json> metadata_events(const std::set<int64_t>& ranks,
                                  const std::map<std::pair<int64_t, int64_t>, std::string>& thread_names) {
  std::vector<json> out;
  for (int64_t rank : ranks) {
    out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                   {"args", {{"name", "rank " + std::to_string(rank)}}}});
    out.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                   {"args", {{"sort_index", rank}}}});
  }
  for (const auto& [key, name] : thread_names) {
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", key.first},
                   {"tid", key.second}, {"args", {{"name", name}}}});
  }
  return out;
}

json other_data_of(const json& run_info) {
  json other = json::object();
  if (run_info.is_object()) {
    for (const char* field : {"name", "kind", "start_time", "git_commit", "formulation"}) {
      if (auto it = run_info.find(field); it != run_info.end()) other[field] = *it;
    }
  }
  return other;
}

std::string dump(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

json chrome_trace_from_events(const std::vector<json>& events, const json& run_info) {
  json trace_events = json::array();
  std::set<int64_t> ranks;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;
  for (const json& event : events) {
    json trace_event = trace_event_of(event, ranks, thread_names);
    if (!trace_event.is_null()) trace_events.push_back(std::move(trace_event));
  }
  for (json& meta : metadata_events(ranks, thread_names)) trace_events.push_back(std::move(meta));
  return {{"traceEvents", std::move(trace_events)}, {"displayTimeUnit", "ms"}, {"otherData", other_data_of(run_info)}};
}

int64_t export_chrome_trace(const RunRecord& run, const std::filesystem::path& out) {
  ChromeTraceWriter writer(out, run.info);
  for (const json& event : run.events) writer.add(event);
  return writer.finish();
}

// ---- ChromeTraceWriter ----

ChromeTraceWriter::ChromeTraceWriter(const std::filesystem::path& out, const json& run_info)
    : file_(std::make_unique<AtomicFileWriter>(out)), other_data_(other_data_of(run_info)) {
  pending_ = "{\"traceEvents\":[";
}

ChromeTraceWriter::~ChromeTraceWriter() = default;  // AtomicFileWriter removes an unfinished file

void ChromeTraceWriter::add(const json& event) {
  const json trace_event = trace_event_of(event, ranks_, thread_names_);
  if (trace_event.is_null()) return;
  write_trace_event(trace_event);
  ++complete_events_;
}

void ChromeTraceWriter::write_trace_event(const json& trace_event) {
  if (!first_) pending_ += ',';
  first_ = false;
  pending_ += dump(trace_event);
  if (pending_.size() >= (size_t{1} << 20)) flush();
}

void ChromeTraceWriter::flush() {
  file_->write(pending_.data(), pending_.size());
  pending_.clear();
}

int64_t ChromeTraceWriter::finish() {
  for (const json& meta : metadata_events(ranks_, thread_names_)) write_trace_event(meta);
  pending_ += "],\"displayTimeUnit\":\"ms\",\"otherData\":" + dump(other_data_) + "}\n";
  flush();
  file_->commit();
  return complete_events_;
}

}  // namespace moe
