// run_list.cpp: find run directories under a folder (run_list.h).
#include "run_list.h"

#include <algorithm>
#include <chrono>

#include "file_io.h"         // read_file_capped
#include "run_model.h"       // run_is_partial
#include "untrusted_json.h"  // parse_untrusted_json

namespace moe::viewer {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxRunJsonBytes = uint64_t{1} << 20;  // a run.json is a few kilobytes

std::vector<RunEntry> list_runs(const fs::path& folder, std::string* problem) {
  std::vector<RunEntry> runs;
  std::error_code ec;
  auto entry_for = [](const fs::path& dir) {
    RunEntry e{dir, dir.filename().string(), false};
    std::error_code time_ec;
    const auto written = fs::last_write_time(dir / "events.jsonl", time_ec);
    if (!time_ec) e.live = fs::file_time_type::clock::now() - written < std::chrono::seconds(5);
    // run.json is small (a run that cannot be read is not partial here: opening it says why; a
    // named pipe is not read at all, it would block).
    try {
      json info;
      if (odd_run_file(dir).empty() && parse_untrusted_json(read_file_capped(dir / "run.json", kMaxRunJsonBytes), info).empty())
        e.partial = run_is_partial(info);
    } catch (const std::exception&) {
    }
    return e;
  };
  if (!fs::is_directory(folder, ec)) {
    if (problem) *problem = folder.string() + ": not a folder (no runs there yet)";
    return runs;
  }
  if (fs::exists(folder / "run.json", ec)) runs.push_back(entry_for(folder));
  fs::directory_iterator it(folder, fs::directory_options::skip_permission_denied, ec);
  if (ec) {
    if (problem) *problem = folder.string() + ": " + ec.message();
    return runs;
  }
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    std::error_code entry_ec;
    if (it->is_directory(entry_ec) && fs::exists(it->path() / "run.json", entry_ec)) runs.push_back(entry_for(it->path()));
  }
  std::sort(runs.begin(), runs.end(), [](const RunEntry& a, const RunEntry& b) { return a.name < b.name; });
  return runs;
}

}  // namespace moe::viewer
