// trace_export.cpp: the command-line tool moe_trace_export, a run's timeline as a Chrome trace.
//
//   cmake --build build --target moe_trace_export
//   build/common/moe_trace_export notebooks_data/runs/<name> trace.json
// then open trace.json in https://ui.perfetto.dev (or chrome://tracing): one process per rank,
// one thread per CUDA stream, one slice per span (dispatch, expert_compute, combine, ...).
// The record is streamed (memory stays flat however large it is); a line of events.jsonl that is
// not a valid event is named on stderr and left out, and the rest is exported.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "chrome_trace.h"  // ChromeTraceWriter
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
  // The record streams through: one block of events.jsonl at a time, each event turned into its
  // trace event and written out, so memory does not grow with the record.
  std::optional<moe::RunReader> reader;
  try {
    moe::check_output_path("OUT.json", out, {{"RUN_DIR", run_directory}});
    reader.emplace(run_directory, moe::ReadOptions{.read_block_bytes = uint64_t{1} << 20});
  } catch (const std::exception& e) {  // UsageError, RecordError: each names the path and the fault
    std::fprintf(stderr, "moe_trace_export: %s\n", e.what());
    return moe::kExitBadInput;
  }
  return moe::run_program("moe_trace_export", [&] {
    moe::ChromeTraceWriter trace(out, reader->info());
    int64_t events = 0, bad_lines = 0;
    const auto add = [&](const nlohmann::json& event) {
      trace.add(event);
      ++events;
    };
    // A line that is not a valid event is named and skipped; the lines after it are exported.
    const auto skip = [&](const std::string& message) {
      std::fprintf(stderr, "warning: %s\n", message.c_str());
      ++bad_lines;
    };
    do reader->poll_each(add, uint64_t{16} << 20, skip); while (!reader->caught_up());
    if (const std::string warning = reader->finish_last_line(add); !warning.empty())
      std::fprintf(stderr, "warning: %s\n", warning.c_str());
    const int64_t spans = trace.finish();
    std::printf("wrote %s: %lld spans from %lld events of run '%s'\n", out.c_str(), static_cast<long long>(spans),
                static_cast<long long>(events), reader->info().value("name", std::string("?")).c_str());
    if (bad_lines > 0)
      std::fprintf(stderr, "warning: %lld lines of the record are not valid events and were left out (named above)\n",
                   static_cast<long long>(bad_lines));
    if (spans == 0) std::fprintf(stderr, "note: the run has no \"span\" events; the trace is empty\n");
    return 0;
  });
}
