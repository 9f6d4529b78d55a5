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
#include "program_exit.h"  // run_program, check_output_path
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
  // Bad input, exit 2: an output that cannot be created, a run that cannot be read.
  // A failure while writing the trace, exit 1.
  moe::RunRecord run;
  try {
    moe::check_output_path("OUT.json", argv[2]);
    run = moe::RunReader::load(argv[1]);
  } catch (const std::exception& e) {  // UsageError, RecordError: each names the path and the fault
    std::fprintf(stderr, "moe_trace_export: %s\n", e.what());
    return moe::kExitBadInput;
  }
  return moe::run_program("moe_trace_export", [&] {
    for (const std::string& warning : run.warnings) std::fprintf(stderr, "warning: %s\n", warning.c_str());
    const int64_t spans = moe::export_chrome_trace(run, argv[2]);
    std::printf("wrote %s: %lld spans from %zu events of run '%s'\n", argv[2],
                static_cast<long long>(spans), run.events.size(),
                run.info.value("name", std::string("?")).c_str());
    if (spans == 0) std::fprintf(stderr, "note: the run has no \"span\" events; the trace is empty\n");
    return 0;
  });
}
