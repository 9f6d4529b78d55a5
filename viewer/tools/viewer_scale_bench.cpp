// viewer_scale_bench.cpp: how the viewer copes with a run of millions of steps. Writes the record
// itself (a real run's step events repeated until there are --steps of them, the run's other
// events once), then measures
//   load_s            RunModel::load of the whole record (read, parse, check, keep)
//   rss_mb, hwm_mb    resident memory after the load, and its peak (VmRSS, VmHWM of /proc/self/status)
//   prepare_ms        the curves panel's per-frame data work with nothing changed (metric order,
//                     shared step range, sampling rates): what every frame pays
//   reduce_ms         reducing every curve to min/max pixel columns: what a zoom, a resize or new
//                     data costs (the panel keeps the columns until one of those happens)
//   viewer frame_ms   with --viewer and xvfb-run: the real window's frame times on the curves panel,
//                     for each of --windows (default 1600x1000 and 1280x800); its peak memory is
//                     the larger of the viewer's and Xvfb's (wait4 of the children)
// and prints a table with the date and this machine, and writes the figures as JSON.
//
//   cmake --build build --target viewer_scale_bench moe_viewer
//   build/viewer/viewer_scale_bench --viewer build/viewer/moe_viewer
//       --json notebooks_data/bench/viewer_scale_cpu2_$(date +%F).json        # one line, from the repo root
//   build/viewer/viewer_scale_bench --steps 20000                             # a quick look
// The record goes into a temporary folder (--work DIR to choose it) that is removed afterwards.
// Not a test: nothing here passes or fails on a time; tests/viewer checks the same code for results.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "curves_view.h"    // curve_metric_order, curve_step_range, sample_spacing
#include "downsample.h"     // downsample_min_max
#include "command_line.h"   // CLI::App, parse_command_line, whole_number
#include "parse_number.h"   // parse_integer, parse_real
#include "program_exit.h"   // UsageError, check_output_path, kExitBadInput
#include "run_model.h"      // RunModel

namespace fs = std::filesystem;
using moe::viewer::RunModel;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  fs::path source = "notebooks_data/runs/train_dropless_seed1";
  fs::path work;            // "" = a fresh folder under the system's temporary directory
  fs::path json_out;        // "" = no JSON
  std::string viewer;       // "" = no real-window frames
  int64_t steps = 2'000'000;
  int columns = 1500;       // the plot width in pixels of a 1600-pixel window
  int frames = 30;
  std::vector<std::pair<int, int>> windows = {{1600, 1000}, {1280, 800}};  // --windows 1600x1000,1280x800
};

// A line of /proc/self/status in MB ("VmHWM", "VmRSS").
double proc_status_mb(const char* key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0) {
      // "VmHWM:\t  123456 kB"
      std::istringstream fields(line.substr(std::strlen(key) + 1));
      std::string kilobytes;
      fields >> kilobytes;
      return static_cast<double>(moe::parse_integer(kilobytes).value_or(0)) / 1024.0;
    }
  return 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Writes run.json and events.jsonl into `dir`: the source run's events other than "step" once,
// then `steps` step events made of the source's step events repeated, each repetition shifted
// by the source's last step so the steps keep increasing. Returns the bytes of events.jsonl.
uint64_t write_record(const fs::path& source, const fs::path& dir, int64_t steps) {
  fs::create_directories(dir);
  fs::copy_file(source / "run.json", dir / "run.json", fs::copy_options::overwrite_existing);
  std::ifstream in(source / "events.jsonl");
  if (!in) throw std::runtime_error("cannot read " + (source / "events.jsonl").string());
  std::vector<nlohmann::json> step_events;
  std::ofstream out(dir / "events.jsonl", std::ios::binary);
  std::string line;
  int64_t last_step = 0;
  while (std::getline(in, line)) {
    nlohmann::json event = nlohmann::json::parse(line);
    if (event.value("type", "") == "step") {
      last_step = std::max<int64_t>(last_step, event["step"].get<int64_t>());
      step_events.push_back(std::move(event));
    } else {
      out << line << '\n';
    }
  }
  if (step_events.empty()) throw std::runtime_error(source.string() + " has no step events to repeat");
  // Each event's text split around its step number, so writing millions of lines is string pastes.
  std::vector<std::pair<std::string, std::string>> halves;
  std::vector<int64_t> original_steps;
  for (nlohmann::json& event : step_events) {
    original_steps.push_back(event["step"].get<int64_t>());
    event["step"] = -1234567;  // a marker no metric holds
    const std::string text = event.dump();
    const size_t at = text.find("-1234567");
    halves.emplace_back(text.substr(0, at), text.substr(at + 8));
  }
  std::string buffer;
  for (int64_t i = 0; i < steps; ++i) {
    const size_t k = static_cast<size_t>(i % static_cast<int64_t>(halves.size()));
    const int64_t step = original_steps[k] + (i / static_cast<int64_t>(halves.size())) * last_step;
    buffer += halves[k].first;
    buffer += std::to_string(step);
    buffer += halves[k].second;
    buffer += '\n';
    if (buffer.size() > (1 << 20)) out << buffer, buffer.clear();
  }
  out << buffer;
  out.close();
  return fs::file_size(dir / "events.jsonl");
}

// What the curves panel computes every frame before drawing, without the drawing.
void prepare_curves(const std::vector<const RunModel*>& runs, double& checksum) {
  const std::vector<std::string> order = moe::viewer::curve_metric_order(runs);
  const moe::viewer::StepRange range = moe::viewer::curve_step_range(runs);
  checksum += range.hi - range.lo;
  for (const std::string& metric : order)
    for (const RunModel* run : runs)
      if (auto it = run->step_metrics.find(metric); it != run->step_metrics.end())
        checksum += moe::viewer::sample_spacing(it->second);
}

// What a zoom, a resize or new data costs: every curve reduced to pixel columns.
void reduce_curves(const RunModel& run, int columns, double& checksum) {
  const moe::viewer::StepRange range = moe::viewer::curve_step_range({&run});
  for (const auto& [name, series] : run.step_metrics) {
    auto reduced = moe::viewer::downsample_min_max(series, range.lo, range.hi, columns);
    for (const auto& column : reduced) checksum += static_cast<double>(column.samples);
  }
}

struct ViewerFigures {
  bool ran = false;
  double frame_median_ms = 0, frame_p90_ms = 0, build_median_ms = 0, first_frame_ms = 0, peak_rss_mb = 0;
  std::string output;
};

// Runs the real viewer on the record under xvfb-run for `frames` frames of the curves panel and
// reads the frame times it prints; the child's peak resident memory comes from wait4.
ViewerFigures time_viewer(const std::string& viewer, const fs::path& run, const fs::path& work, int frames,
                          int width, int height) {
  ViewerFigures figures;
  const fs::path log = work / "viewer.log";
  const std::string size = std::to_string(width) + "x" + std::to_string(height);
  const std::string command = "xvfb-run -a -s '-screen 0 " + size + "x24' '" + viewer + "' '" + run.string() +
                              "' --panel curves --width " + std::to_string(width) + " --height " +
                              std::to_string(height) + " --frames " + std::to_string(frames) + " --screenshot '" +
                              (work / "curves.png").string() + "' > '" + log.string() + "' 2>&1";
  const pid_t child = fork();
  if (child == 0) {
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  rusage usage{};
  if (child < 0 || wait4(child, &status, 0, &usage) < 0) return figures;
  // ru_maxrss of the children waited for: the largest of the shell, xvfb-run, Xvfb and the viewer.
  rusage children{};
  getrusage(RUSAGE_CHILDREN, &children);
  figures.peak_rss_mb = static_cast<double>(children.ru_maxrss) / 1024.0;
  std::ifstream in(log);
  figures.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::smatch m;
  const std::regex line(R"(frame median ([0-9.]+) ms \(p90 ([0-9.]+)\), of which building the panels median ([0-9.]+) ms .*first frame ([0-9.]+) ms)");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && std::regex_search(figures.output, m, line)) {
    const auto number = [&m](size_t i) { return moe::parse_real(m[i].str()); };
    if (number(1) && number(2) && number(3) && number(4)) {
      figures.ran = true;
      figures.frame_median_ms = *number(1);
      figures.frame_p90_ms = *number(2);
      figures.build_median_ms = *number(3);
      figures.first_frame_ms = *number(4);
    }
  }
  return figures;
}

std::string today_utc() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

// WIDTHxHEIGHT[,WIDTHxHEIGHT...], each > 0; nothing when the text is not that.
std::optional<std::vector<std::pair<int, int>>> parse_windows(const std::string& text) {
  std::vector<std::pair<int, int>> windows;
  for (const char* p = text.c_str(); *p;) {
    int w = 0, h = 0, used = 0;
    if (std::sscanf(p, "%dx%d%n", &w, &h, &used) != 2 || w <= 0 || h <= 0) return std::nullopt;
    windows.emplace_back(w, h);
    p += used;
    if (*p == ',') ++p;
  }
  return windows;
}

// The flags into `o`; the exit status when the program should stop here (--help, a bad flag).
std::optional<int> parse_options(int argc, char** argv, Options& o) {
  std::string windows;
  CLI::App app{"viewer_scale_bench: how the viewer copes with a run of millions of steps", "viewer_scale_bench"};
  app.add_option("--steps", o.steps, "step events of the record (a real run's, repeated)")->capture_default_str()
      ->check(moe::whole_number(1));
  app.add_option("--source", o.source, "RUN_DIR whose step events are repeated")->capture_default_str();
  app.add_option("--work", o.work, "DIR for the record (default: a temporary folder, removed afterwards)");
  app.add_option("--json", o.json_out, "OUT.json: the figures as JSON");
  app.add_option("--viewer", o.viewer, "build/viewer/moe_viewer: also the real window's frame times (under xvfb-run)");
  app.add_option("--windows", windows, "WIDTHxHEIGHT[,WIDTHxHEIGHT...] (default 1600x1000,1280x800)")
      ->check(CLI::Validator(
          [](const std::string& text) {
            return parse_windows(text) ? std::string() : text + ": allowed: WIDTHxHEIGHT[,WIDTHxHEIGHT...], each > 0";
          },
          ""));
  app.add_option("--columns", o.columns, "step columns drawn")->capture_default_str()->check(moe::whole_number(1));
  app.add_option("--frames", o.frames, "frames timed per window")->capture_default_str()->check(moe::whole_number(2));
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return exit_status;
  if (!windows.empty()) o.windows = *parse_windows(windows);
  if (!o.json_out.empty()) moe::check_output_path("--json", o.json_out);
  // The default source is relative to the repository root: say so rather than fail on a copy.
  for (const char* file : {"run.json", "events.jsonl"}) {
    std::error_code error;
    if (!fs::is_regular_file(o.source / file, error))
      throw moe::UsageError("--source " + o.source.string() + ": no " + file +
                            " there; run from the repository root or pass --source RUN_DIR, a recorded run");
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    if (const std::optional<int> exit_status = parse_options(argc, argv, options)) return *exit_status;
  } catch (const moe::UsageError& error) {
    std::fprintf(stderr, "viewer_scale_bench: %s\n", error.what());
    return moe::kExitBadInput;
  }
  const bool own_work = options.work.empty();
  if (own_work) options.work = fs::temp_directory_path() / ("viewer_scale_bench_" + std::to_string(getpid()));
  const fs::path run_dir = options.work / "scale_run";
  int status = 0;
  nlohmann::json result;
  try {
    auto start = Clock::now();
    const uint64_t bytes = write_record(options.source, run_dir, options.steps);
    const double write_s = ms_since(start) / 1000;
    std::printf("wrote %lld step events, %.0f MB, in %.1f s\n", static_cast<long long>(options.steps), bytes / 1e6, write_s);
    std::fflush(stdout);

    // The writer's buffers are gone; the peak counted from here is the load's.
    const double rss_before_mb = proc_status_mb("VmRSS");
    start = Clock::now();
    RunModel run = RunModel::load(run_dir);
    const double load_s = ms_since(start) / 1000;
    if (!run.error.empty()) throw std::runtime_error("load failed: " + run.error);
    const double rss_mb = proc_status_mb("VmRSS");
    const double hwm_mb = proc_status_mb("VmHWM");
    size_t curve_points = 0;
    for (const auto& [name, series] : run.step_metrics) curve_points += series.steps.size();

    double checksum = 0;
    std::vector<double> prepare_ms, reduce_ms;
    for (int i = 0; i < options.frames; ++i) {
      auto t = Clock::now();
      prepare_curves({&run}, checksum);
      prepare_ms.push_back(ms_since(t));
    }
    for (int i = 0; i < 5; ++i) {
      auto t = Clock::now();
      reduce_curves(run, options.columns, checksum);
      reduce_ms.push_back(ms_since(t));
    }

    std::vector<ViewerFigures> viewer_runs;
    if (!options.viewer.empty())
      for (const auto& [width, height] : options.windows)
        viewer_runs.push_back(time_viewer(options.viewer, run_dir, options.work, options.frames, width, height));

    const std::string date = today_utc();
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    std::printf("\nviewer_scale_bench, %s, %ld CPU cores, record of %lld step events (%.0f MB)\n", date.c_str(),
                cores, static_cast<long long>(options.steps), bytes / 1e6);
    std::printf("%-34s %12s %10s\n", "figure", "value", "target");
    std::printf("%-34s %12.2f %10s\n", "load (s)", load_s, "<= 8");
    std::printf("%-34s %12.0f %10s\n", "resident after load (MB)", rss_mb, "");
    std::printf("%-34s %12.0f %10s\n", "peak resident (MB)", hwm_mb, "<= 600");
    std::printf("%-34s %12zu %10s\n", "curve points kept", curve_points, "");
    std::printf("%-34s %12.3f %10s\n", "curves prepare per frame (ms)", median(prepare_ms), "");
    std::printf("%-34s %12.2f %10s\n", "curves reduce to columns (ms)", median(reduce_ms), "");
    for (size_t w = 0; w < viewer_runs.size(); ++w) {
      const ViewerFigures& viewer = viewer_runs[w];
      const std::string size = std::to_string(options.windows[w].first) + "x" + std::to_string(options.windows[w].second);
      if (!viewer.ran) {
        std::printf("viewer run (%s) failed or printed no frame times:\n%s\n", size.c_str(), viewer.output.c_str());
        status = 1;
        continue;
      }
      std::printf("%-34s %12.2f %10s\n", ("viewer " + size + " frame median (ms)").c_str(), viewer.frame_median_ms, "<= 16");
      std::printf("%-34s %12.2f %10s\n", ("viewer " + size + " frame p90 (ms)").c_str(), viewer.frame_p90_ms, "");
      std::printf("%-34s %12.2f %10s\n", ("viewer " + size + " building (ms)").c_str(), viewer.build_median_ms, "");
      std::printf("%-34s %12.1f %10s\n", ("viewer " + size + " first frame (ms)").c_str(), viewer.first_frame_ms, "");
      std::printf("%-34s %12.0f %10s\n", ("viewer " + size + " peak RSS (MB)").c_str(), viewer.peak_rss_mb, "<= 600");
    }
    std::printf("(checksum %.6g)\n", checksum);

    result = {{"benchmark", "viewer_scale_bench"}, {"date", date}, {"cpu_cores", cores},
              {"source", options.source.string()}, {"step_events", options.steps}, {"events_bytes", bytes},
              {"load_s", load_s}, {"rss_before_load_mb", rss_before_mb}, {"rss_after_load_mb", rss_mb},
              {"peak_rss_mb", hwm_mb}, {"curve_points_kept", curve_points},
              {"curves_prepare_ms_median", median(prepare_ms)}, {"curves_reduce_ms_median", median(reduce_ms)},
              {"columns", options.columns}, {"frames", options.frames},
              {"targets", {{"load_s", 8}, {"frame_ms", 16}, {"peak_rss_mb", 600}}}};
    for (size_t w = 0; w < viewer_runs.size(); ++w) {
      const ViewerFigures& viewer = viewer_runs[w];
      if (!viewer.ran) continue;
      result["viewer"].push_back(
          {{"window", std::to_string(options.windows[w].first) + "x" + std::to_string(options.windows[w].second)},
           {"panel", "curves"}, {"display", "Xvfb, Mesa llvmpipe"},
           {"frame_median_ms", viewer.frame_median_ms}, {"frame_p90_ms", viewer.frame_p90_ms},
           {"build_median_ms", viewer.build_median_ms}, {"first_frame_ms", viewer.first_frame_ms},
           {"peak_rss_mb_viewer_or_xvfb", viewer.peak_rss_mb}});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "viewer_scale_bench: %s\n", e.what());
    status = 1;
  }
  if (own_work) {
    std::error_code ignored;
    fs::remove_all(options.work, ignored);
  } else {
    std::error_code ignored;
    fs::remove_all(run_dir, ignored);
  }
  if (status == 0 && !options.json_out.empty()) {
    std::ofstream(options.json_out) << result.dump(2) << "\n";
    std::printf("wrote %s\n", options.json_out.c_str());
  }
  return status;
}
