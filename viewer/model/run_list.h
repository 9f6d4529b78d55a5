// run_list.h: the runs found under a folder such as notebooks_data/runs/ or runs/ (the lesson
// tour's), for the viewer's run list. A run is a directory holding run.json.
//   for (const RunEntry& e : list_runs("notebooks_data/runs")) ...
// Built into moe_viewer_model; tested by tests/viewer/test_run_model.cpp.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace moe::viewer {

struct RunEntry {
  std::filesystem::path dir;
  std::string name;   // the directory's name
  bool live = false;  // events.jsonl changed in the last few seconds: probably still being written
  bool partial = false;  // run.json says "finished": false (run_is_partial, run_model.h)
};

// The run directories directly under `folder` (and `folder` itself if it is a run), sorted by
// name. A missing or unreadable folder gives an empty list and a message in `problem`.
std::vector<RunEntry> list_runs(const std::filesystem::path& folder, std::string* problem = nullptr);

}  // namespace moe::viewer
