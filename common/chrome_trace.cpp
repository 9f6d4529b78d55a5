// chrome_trace.cpp: span and all-to-all events -> Chrome trace event format (see chrome_trace.h).
#include "chrome_trace.h"

#include <map>
#include <set>
#include <string>
#include <utility>

#include "file_io.h"  // write_file_atomically

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

}  // namespace

json chrome_trace_from_events(const std::vector<json>& events, const json& run_info) {
  json trace_events = json::array();
  std::set<int64_t> ranks;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;  // (rank, stream) -> name

  for (const json& event : events) {
    if (!event.is_object()) continue;
    auto type = event.find("type");
    if (type == event.end() || !type->is_string()) continue;

    if (*type == "span" && validate_event(event).empty()) {
      const int64_t rank = event["rank"].get<int64_t>();
      const int64_t stream = event["stream"].get<int64_t>();
      json args = {{"step", integer_or(event, "step", -1)}};
      trace_events.push_back(complete_event(event, event["name"], "span", rank, stream, std::move(args)));
      ranks.insert(rank);
      auto& name = thread_names[{rank, stream}];
      if (auto label = event.find("stream_name"); label != event.end() && label->is_string()) {
        name = label->get<std::string>();
      } else if (name.empty()) {
        name = "stream " + std::to_string(stream);
      }
    } else if (*type == "alltoall" && validate_event(event).empty() && event.contains("start_us")) {
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
      trace_events.push_back(complete_event(event, name, "alltoall", rank, kAllToAllThread, std::move(args)));
      ranks.insert(rank);
      thread_names[{rank, kAllToAllThread}] = "all-to-all";
    }
  }

  // Metadata events name the rows of the timeline.
  for (int64_t rank : ranks) {
    trace_events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                            {"args", {{"name", "rank " + std::to_string(rank)}}}});
    trace_events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                            {"args", {{"sort_index", rank}}}});
  }
  for (const auto& [key, name] : thread_names) {
    trace_events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", key.first},
                            {"tid", key.second}, {"args", {{"name", name}}}});
  }

  json other = json::object();
  if (run_info.is_object()) {
    for (const char* field : {"name", "kind", "start_time", "git_commit", "formulation"}) {
      if (auto it = run_info.find(field); it != run_info.end()) other[field] = *it;
    }
  }
  return {{"traceEvents", std::move(trace_events)}, {"displayTimeUnit", "ms"}, {"otherData", other}};
}

int64_t export_chrome_trace(const RunRecord& run, const std::filesystem::path& out) {
  const json trace = chrome_trace_from_events(run.events, run.info);
  int64_t complete_events = 0;
  for (const json& event : trace["traceEvents"]) {
    if (event["ph"] == "X") ++complete_events;
  }
  write_file_atomically(out, trace.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
  return complete_events;
}

}  // namespace moe
