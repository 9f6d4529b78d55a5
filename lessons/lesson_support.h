// lesson_support.h: what every lesson program shares: its command line, text-like token data with
// a realistic skew, and tables printed to the terminal and kept in the run record.
//
// Lessons are teaching programs, not benchmarks: they run the CPU reference (moe::ref) on small
// sizes, print tables, print one verdict line, and write a run record the viewer opens. What they
// share lives here once, so that each lesson reads as its sections alone; every lesson links it:
//   build/lessons/lesson01_routing --out runs/lesson01_routing --overwrite
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "run_record.h"  // RunWriter, TableEvent, VerdictEvent
#include "types.h"       // moe::ref::Matrix

namespace CLI {
class App;  // CLI11 (common/command_line.h): a lesson's own flags are declared on it
}

namespace moe::lessons {

// ---- command line ----

struct LessonOptions {
  std::filesystem::path out;  // run record directory
  bool overwrite = false;     // replace a run record already at `out`
  uint64_t seed = 1;
};

// Parses --out DIR, --overwrite, --seed N, --help (common/command_line.h). Prints the usage and
// exits 0 on --help; prints one line naming the flag and exits 2 on a bad argument.
LessonOptions parse_options(int argc, char** argv, const std::string& lesson_name,
                            const std::string& default_out);

// The same for a lesson with flags of its own: `own_flags` declares them on the app (values
// go straight into the lesson's variables), so --help lists them beside every lesson's.
LessonOptions parse_options(int argc, char** argv, const std::string& lesson_name, const std::string& default_out,
                            const std::function<void(CLI::App& app)>& own_flags);

// Creates the lesson's run record at options.out (kind "lesson", the config, the devices, the
// lesson number and seed). A run already there is replaced only with --overwrite; otherwise the
// program stops with a message saying so (exit code 2), and the old run is left as it was.
RunWriter create_lesson_run(const LessonOptions& options, const std::string& lesson_name,
                            const std::string& lesson_number, const MoeConfig& config,
                            std::vector<std::string> devices = {"CPU (moe::ref, double)"});

// The same for a run of R ranks (world_size R in run.json, one device name per rank). Under
// mpirun only rank 0 calls it; the ranks agree beforehand, with lesson_run_refused, whether the
// run may be written, so that they stop together.
RunWriter create_lesson_run(const LessonOptions& options, const std::string& lesson_name,
                            const std::string& lesson_number, const MoeConfig& config,
                            std::vector<std::string> devices, int64_t world_size);

// True when a run record already exists at options.out and --overwrite was not given (the case in
// which create_lesson_run stops the program); says so on stderr.
bool lesson_run_refused(const LessonOptions& options, const std::string& lesson_name);

// ||a - reference|| / ||reference|| (Frobenius), or ||a|| when the reference is zero.
double relative_error(const ref::Matrix& a, const ref::Matrix& reference);

// ---- the lessons' cases ----

// The case of lessons 03 and 04, small enough to draw: 24 text-like tokens, 4 experts of hidden
// width 8, 4 x 4 blocks (H/B = 2 block columns per expert), top-1, dropless.
MoeConfig small_block_case();

// ---- data ----

// Tokens that look like text to a router: a vocabulary of `vocabulary` token types, each with its
// own random embedding [D], and T tokens whose types follow Zipf's law (type r has frequency
// proportional to 1 / (r + 1)^zipf_exponent, as words in real text do), plus a little noise.
// Frequent token types send many identical rows to the same experts: realistic routing skew.
ref::Matrix zipf_tokens(int64_t tokens, int64_t model_dim, int64_t vocabulary, double zipf_exponent,
                        std::mt19937_64& generator);  // [T, D]

// Per-expert counts as the run record's events take them.
std::vector<int64_t> as_int64(const std::vector<int32_t>& counts);

// ---- load statistics ----

struct LoadStats {
  double max_over_mean = 0;  // busiest expert's load / mean load (1 = perfect balance)
  double coefficient_of_variation = 0;  // std / mean of the per-expert load
  int64_t idle_experts = 0;             // experts that got no token
};
LoadStats load_stats(const std::vector<int32_t>& tokens_per_expert);  // [E]

// ---- tables ----

// A table printed with aligned columns and appended to the run record as a "table" event.
class Table {
 public:
  Table(std::string name, std::vector<std::string> columns);
  void add_row(std::vector<nlohmann::json> cells);  // numbers or strings, one per column
  void print() const;
  TableEvent event() const;

 private:
  std::string name_;
  std::vector<std::string> columns_;
  std::vector<std::vector<nlohmann::json>> rows_;
};

// Prints the table and appends it to the run record.
void show(RunWriter& writer, const Table& table);

// A horizontal bar of `width` characters for value / max_value, for per-expert load pictures.
std::string bar(double value, double max_value, int width);

// Prints the one verdict line ("PASS lesson01: ..." / "FAIL ...") and records it.
void finish(RunWriter& writer, const std::string& lesson_name, bool pass, const std::string& message);

// finish, then where the run record is. Returns the exit code.
int finish_lesson(RunWriter& writer, const std::string& lesson_name, const LessonOptions& options, bool pass,
                  const std::string& message);

// ---- the GPU part of a single-process lesson (03, 04) ----

// The run record's devices: the CPU reference, and the GPU where one is present (`gpu_name` empty:
// none).
std::vector<std::string> cpu_and_gpu_devices(const std::string& gpu_name);

// What a lesson's GPU part adds to the verdict: whether it passed, and its words on the verdict line.
struct GpuPart {
  bool pass = true;
  std::string message;
};

// The GPU part, skipped where this machine has no GPU: prints why (`why_no_gpu`), and the verdict
// line says so.
GpuPart skip_gpu_part(const std::string& why_no_gpu);
// The same where the lesson was built without CUDA.
GpuPart skip_gpu_part_not_built();

// The lesson's verdict line from its CPU part (`pass`, `message`) and its GPU part, then where the
// run record is. Returns the exit code.
int finish_with_gpu_part(RunWriter& writer, const std::string& lesson_name, const LessonOptions& options, bool pass,
                         const std::string& message, const GpuPart& gpu);

}  // namespace moe::lessons
