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
#include "command_line.h"  // CLI::App, parse_command_line
#include "program_exit.h"  // run_program, check_output_path
#include "run_record.h"    // RunReader, RecordError

int main(int argc, char** argv) {
  std::string run_directory, out;
  CLI::App app{"usage: moe_trace_export RUN_DIR OUT.json\n"
               "  Writes the span and all-to-all events of the run in RUN_DIR (a directory with\n"
               "  run.json and events.jsonl) as a Chrome trace that opens in ui.perfetto.dev.",
               "moe_trace_export"};
  // Not ->required(): CLI11 (2.1) reports a missing required positional before an unknown flag,
  // so `moe_trace_export --no-such-flag` would answer "RUN_DIR is required". Checked below.
  app.add_option("RUN_DIR", run_directory, "the run to export");
  app.add_option("OUT.json", out, "the trace file to write");
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
  if (out.empty()) {
    std::fprintf(stderr, "moe_trace_export: needs RUN_DIR and OUT.json\n%s", app.help().c_str());
    return moe::kExitBadInput;
  }
  // Bad input, exit 2: an output that cannot be created, a run that cannot be read.
  // A failure while writing the trace, exit 1.
  moe::RunRecord run;
  try {
    moe::check_output_path("OUT.json", out, {{"RUN_DIR", run_directory}});
    run = moe::RunReader::load(run_directory);
  } catch (const std::exception& e) {  // UsageError, RecordError: each names the path and the fault
    std::fprintf(stderr, "moe_trace_export: %s\n", e.what());
    return moe::kExitBadInput;
  }
  return moe::run_program("moe_trace_export", [&] {
    for (const std::string& warning : run.warnings) std::fprintf(stderr, "warning: %s\n", warning.c_str());
    const int64_t spans = moe::export_chrome_trace(run, out);
    std::printf("wrote %s: %lld spans from %zu events of run '%s'\n", out.c_str(),
                static_cast<long long>(spans), run.events.size(),
                run.info.value("name", std::string("?")).c_str());
    if (spans == 0) std::fprintf(stderr, "note: the run has no \"span\" events; the trace is empty\n");
    return 0;
  });
}
