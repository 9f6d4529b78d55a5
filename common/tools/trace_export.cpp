// trace_export.cpp: the command-line tool moe_trace_export, a run's timeline as a Chrome trace.
//
//   cmake --build build --target moe_trace_export
//   build/common/moe_trace_export notebooks_data/runs/<name> trace.json
// then open trace.json in https://ui.perfetto.dev (or chrome://tracing): one process per rank,
// one thread per CUDA stream, one slice per span (dispatch, expert_compute, combine, ...).
#include <cstdio>
#include <exception>
#include <string>

#include "chrome_trace.h"  // export_chrome_trace
#include "run_record.h"    // RunReader, RecordError

constexpr const char* usage_text =
    "usage: moe_trace_export RUN_DIR OUT.json\n"
    "  Writes the span and all-to-all events of the run in RUN_DIR (a directory with\n"
    "  run.json and events.jsonl) as a Chrome trace that opens in ui.perfetto.dev.\n";

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    if (arg.size() > 1 && arg[0] == '-') {
      std::fprintf(stderr, "moe_trace_export: unknown flag %s (it takes no flags but --help)\n%s", arg.c_str(),
                   usage_text);
      return 2;
    }
  }
  if (argc != 3) {
    std::fprintf(stderr, "moe_trace_export: needs RUN_DIR and OUT.json, got %d arguments\n%s", argc - 1, usage_text);
    return 2;
  }
  try {
    const moe::RunRecord run = moe::RunReader::load(argv[1]);
    for (const std::string& warning : run.warnings) std::fprintf(stderr, "warning: %s\n", warning.c_str());
    const int64_t spans = moe::export_chrome_trace(run, argv[2]);
    std::printf("wrote %s: %lld spans from %zu events of run '%s'\n", argv[2],
                static_cast<long long>(spans), run.events.size(),
                run.info.value("name", std::string("?")).c_str());
    if (spans == 0) std::fprintf(stderr, "note: the run has no \"span\" events; the trace is empty\n");
  } catch (const moe::RecordError& e) {
    std::fprintf(stderr, "moe_trace_export: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_trace_export: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
