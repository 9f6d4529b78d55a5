// lesson_support.cpp: what every lesson program shares (see lesson_support.h), linked into each of
// build/lessons/lesson01_routing ... lesson08_quality.
#include "lesson_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "command_line.h"  // parse_command_line, whole_number
#include "init.h"          // moe::ref::random_matrix

namespace moe::lessons {

LessonOptions parse_options(int argc, char** argv, const std::string& lesson_name,
                            const std::string& default_out) {
  return parse_options(argc, argv, lesson_name, default_out, nullptr);
}

LessonOptions parse_options(int argc, char** argv, const std::string& lesson_name, const std::string& default_out,
                            const std::function<void(CLI::App& app)>& own_flags) {
  LessonOptions options;
  options.out = default_out;
  CLI::App app{"A lesson: it runs, prints its tables and one verdict line, and writes a run record.", lesson_name};
  app.add_option("--out", options.out, "run record directory")->type_name("DIR")->capture_default_str();
  app.add_flag("--overwrite", options.overwrite, "replace a run record already in DIR");
  app.add_option("--seed", options.seed, "seed of the random data")->type_name("N")->capture_default_str()->check(whole_number(0));
  if (own_flags) own_flags(app);
  if (const std::optional<int> exit_status = parse_command_line(app, argc, argv)) std::exit(*exit_status);
  return options;
}

RunWriter create_lesson_run(const LessonOptions& options, const std::string& lesson_name,
                            const std::string& lesson_number, const MoeConfig& config,
                            std::vector<std::string> devices) {
  return create_lesson_run(options, lesson_name, lesson_number, config, std::move(devices), 1);
}

bool lesson_run_refused(const LessonOptions& options, const std::string& lesson_name) {
  if (options.overwrite || !std::filesystem::exists(options.out / "run.json")) return false;
  std::cerr << lesson_name << ": a run record already exists at " << options.out.string()
            << "; run with --overwrite to replace it, or choose another --out DIR\n";
  return true;
}

RunWriter create_lesson_run(const LessonOptions& options, const std::string& lesson_name,
                            const std::string& lesson_number, const MoeConfig& config,
                            std::vector<std::string> devices, int64_t world_size) {
  RunInfo info;
  info.world_size = world_size;
  info.kind = RunKind::lesson;
  info.name = lesson_name;
  info.moe_config = config;
  info.devices = std::move(devices);
  info.extra = {{"lesson", lesson_number}, {"seed", options.seed}};
  if (!options.overwrite && std::filesystem::exists(options.out / "run.json")) {
    std::cerr << lesson_name << ": a run record already exists at " << options.out.string()
              << "; run with --overwrite to replace it, or choose another --out DIR\n";
    std::exit(2);
  }
  try {
    return RunWriter::create(options.out, info, options.overwrite ? OnExisting::overwrite : OnExisting::refuse);
  } catch (const RecordError& error) {  // e.g. a directory that cannot be written
    std::cerr << lesson_name << ": " << error.what() << "\n";
    std::exit(2);
  }
}

double relative_error(const ref::Matrix& a, const ref::Matrix& reference) {
  const double norm = reference.norm();
  return norm > 0 ? (a - reference).norm() / norm : (a - reference).norm();
}

ref::Matrix zipf_tokens(int64_t tokens, int64_t model_dim, int64_t vocabulary, double zipf_exponent,
                        std::mt19937_64& generator) {
  const ref::Matrix embeddings = ref::random_matrix(vocabulary, model_dim, generator);  // [V, D]
  std::vector<double> frequency(static_cast<size_t>(vocabulary));
  for (int64_t r = 0; r < vocabulary; ++r) frequency[r] = 1.0 / std::pow(r + 1.0, zipf_exponent);
  std::discrete_distribution<int64_t> token_type(frequency.begin(), frequency.end());
  const ref::Matrix noise = ref::random_matrix(tokens, model_dim, generator, 0.05);
  ref::Matrix x(tokens, model_dim);
  for (int64_t t = 0; t < tokens; ++t) x.row(t) = embeddings.row(token_type(generator)) + noise.row(t);
  return x;
}

std::vector<int64_t> as_int64(const std::vector<int32_t>& counts) { return {counts.begin(), counts.end()}; }

LoadStats load_stats(const std::vector<int32_t>& tokens_per_expert) {
  LoadStats stats;
  const double experts = static_cast<double>(tokens_per_expert.size());
  double sum = 0, max_load = 0;
  for (int32_t n : tokens_per_expert) {
    sum += n;
    max_load = std::max(max_load, static_cast<double>(n));
    if (n == 0) ++stats.idle_experts;
  }
  const double mean = sum / experts;
  double variance = 0;
  for (int32_t n : tokens_per_expert) variance += (n - mean) * (n - mean) / experts;
  stats.max_over_mean = mean > 0 ? max_load / mean : 0;
  stats.coefficient_of_variation = mean > 0 ? std::sqrt(variance) / mean : 0;
  return stats;
}

Table::Table(std::string name, std::vector<std::string> columns)
    : name_(std::move(name)), columns_(std::move(columns)) {}

void Table::add_row(std::vector<nlohmann::json> cells) { rows_.push_back(std::move(cells)); }

namespace {
std::string cell_text(const nlohmann::json& cell) {
  if (cell.is_string()) return cell.get<std::string>();
  if (cell.is_number_integer()) return std::to_string(cell.get<int64_t>());
  if (cell.is_number()) {
    std::ostringstream out;
    const double v = cell.get<double>();
    if (v != 0 && (std::fabs(v) < 1e-3 || std::fabs(v) >= 1e6)) {
      out << std::scientific << std::setprecision(2) << v;
    } else {
      out << std::fixed << std::setprecision(3) << v;
    }
    return out.str();
  }
  return cell.dump();
}
}  // namespace

void Table::print() const {
  std::vector<size_t> width(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) width[c] = columns_[c].size();
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], cell_text(row[c]).size());
    }
  }
  std::cout << "\n" << name_ << "\n";
  auto print_row = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < cells.size(); ++c) {
      std::cout << (c == 0 ? "  " : "  ") << std::setw(static_cast<int>(width[c])) << cells[c];
    }
    std::cout << "\n";
  };
  print_row(columns_);
  std::vector<std::string> rule;
  for (size_t w : width) rule.push_back(std::string(w, '-'));
  print_row(rule);
  for (const auto& row : rows_) {
    std::vector<std::string> cells;
    for (const auto& cell : row) cells.push_back(cell_text(cell));
    print_row(cells);
  }
}

TableEvent Table::event() const { return TableEvent{name_, columns_, rows_}; }

void show(RunWriter& writer, const Table& table) {
  table.print();
  writer.append(to_event(table.event()));
}

std::string bar(double value, double max_value, int width) {
  const int filled = max_value > 0 ? static_cast<int>(std::lround(width * value / max_value)) : 0;
  return std::string(static_cast<size_t>(std::clamp(filled, 0, width)), '#');
}

void finish(RunWriter& writer, const std::string& lesson_name, bool pass, const std::string& message) {
  std::cout << "\n" << (pass ? "PASS " : "FAIL ") << lesson_name << ": " << message << "\n";
  writer.append(to_event(VerdictEvent{.pass = pass, .message = message, .step = std::nullopt}));
}

MoeConfig small_block_case() {
  MoeConfig config;
  config.tokens = 24;      // T
  config.model_dim = 8;    // D
  config.hidden_dim = 8;   // H: H/B = 2 block columns per expert
  config.num_experts = 4;  // E
  config.top_k = 1;        // K
  config.block_size = 4;   // B
  config.capacity_factor = 1.0;
  config.formulation = Formulation::dropless;
  return config;
}

std::vector<std::string> cpu_and_gpu_devices(const std::string& gpu_name) {
  std::vector<std::string> devices = {"CPU (moe::ref, double)"};
  if (!gpu_name.empty()) devices.push_back(gpu_name);
  return devices;
}

GpuPart skip_gpu_part(const std::string& why_no_gpu) {
  std::cout << "\nGPU part skipped (" << why_no_gpu << ").\n";
  return {true, "GPU part skipped (no GPU)"};
}

GpuPart skip_gpu_part_not_built() {
  std::cout << "\nGPU part skipped: this build has no CUDA (CMake found no CUDA compiler, or "
               "MOE_ENABLE_CUDA=OFF).\n";
  return {true, "GPU part skipped (built without CUDA)"};
}

int finish_lesson(RunWriter& writer, const std::string& lesson_name, const LessonOptions& options, bool pass,
                  const std::string& message) {
  finish(writer, lesson_name, pass, message);
  std::cout << "run record: " << options.out.string() << "\n";
  return pass ? 0 : 1;
}

int finish_with_gpu_part(RunWriter& writer, const std::string& lesson_name, const LessonOptions& options, bool pass,
                         const std::string& message, const GpuPart& gpu) {
  return finish_lesson(writer, lesson_name, options, pass && gpu.pass, message + "; " + gpu.message);
}

}  // namespace moe::lessons
