// ep_bench_harness.cpp: options, the timing loop and the table of ep_bench (see ep_bench_harness.h).
#include "ep_bench_harness.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "command_line.h"     // CLI::App, whole_number, finite_number, one_of, command_line_message
#include "core/cuda_check.h"  // CUDA_CHECK
#include "ep/expert_parallel_gpu.h"  // kMaxPipelineChunks
#include "parse_number.h"     // parse_real, parse_integer_list
#include "program_exit.h"     // check_output_path

namespace moe::dist::bench {

// ---- options ----

namespace {

// "8", "512K", "16M", "1G" (powers of 1024, as nccl-tests reads them); 0 when the text is none.
int64_t size_in_bytes(const std::string& text) {
  const size_t number_end = text.find_first_not_of("0123456789.eE+-");
  const std::optional<double> value = parse_real(text.substr(0, number_end));
  const std::string unit = number_end == std::string::npos ? "" : text.substr(number_end);
  double scale = 1;
  if (unit == "K" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) return 0;
  if (!value || !(*value > 0) || !(*value * scale < 9e18)) return 0;
  return static_cast<int64_t>(*value * scale);
}

const CLI::Validator kSize(
    [](const std::string& text) {
      return size_in_bytes(text) > 0 ? std::string() : text + ": allowed: a size such as 8, 512K, 16M or 1G";
    },
    "");

const std::vector<std::string> kVariants{"count", "alltoall", "dispatch", "layer"};

// The texts of the flags that parse_options turns into more than one field.
struct FlagTexts {
  std::string min_bytes, max_bytes;
  int64_t factor = 0;
  std::string layer, pipeline_chunks, only, formulation, placements;
};

// Every flag of ep_bench, declared once: parse_options reads them, usage() prints them.
void declare_flags(CLI::App& app, BenchOptions& o, FlagTexts& texts) {
  app.add_option("-b", texts.min_bytes, "bytes per rank, the smallest size (8, 512K, 16M, 1G; default: 1M, 16M, 64M, 256M)")
      ->check(kSize);
  app.add_option("-e", texts.max_bytes, "bytes per rank, the largest size")->check(kSize);
  app.add_option("-f", texts.factor, "the factor from one size to the next (default 2)")->check(whole_number());
  app.add_option("-w", o.warmup_runs, "warm-up runs, then at least --warmup-ms of load")->capture_default_str()
      ->check(whole_number());
  app.add_option("--warmup-ms", o.warmup_ms, "milliseconds of load before the timed runs (the clock's ramp)")
      ->capture_default_str()->check(finite_number(0, 600000));  // ten minutes at most
  app.add_option("-n", o.iterations, "timed runs; the table shows the slowest rank's median")->capture_default_str()
      ->check(whole_number());
  app.add_option("--backend", o.backend, "NCCL on device buffers, or MPI staged through host memory (default nccl)")
      ->check(one_of({"nccl", "mpi"}));
  app.add_option("--layer", texts.layer, "the layer rows' shape T,D,H,E,K, T per rank (default 16384,2048,8192,32,2)")
      ->check(whole_number_list());
  app.add_option("--block", o.layer.block_size, "B of the layer rows")->capture_default_str()->check(whole_number(1));
  app.add_option("--formulation", texts.formulation, "the layer rows' formulation: dropless, padded or dropping");
  app.add_option("--capacity-factor", o.layer.capacity_factor, "CF of padded and dropping (> 0, <= 1024)")
      ->capture_default_str()->check(finite_number(0, moe::kMaxCapacityFactor));
  app.add_option("--pipeline-chunks", texts.pipeline_chunks,
                 "Tutel's pipelining degrees d of the layer rows (default 1,2,4,8; each " +
                     whole_number_range(1, kMaxPipelineChunks).substr(std::string("an integer ").size()) + ")")
      ->check(whole_number_list(1, kMaxPipelineChunks));
  app.add_flag_callback("--no-adaptive", [&o] { o.adaptive = false; },
                        "no row of the layer choosing d itself (pipeline_chunks = 0)");
  app.add_flag("--layouts", o.layouts, "rows of the layer in Tutel's other layouts: r = 0 and every valid r > 1");
  app.add_flag("--overlap", o.overlap,
               "a row of the d = 1 step as two micro-batches of T / 2, overlapped as the language model's --overlap does");
  app.add_option("--nodes-of", o.hierarchical_ranks_per_node,
                 "Tutel's 2DH rows beside the flat ones: nodes of G ranks, G > 1 dividing R")->check(whole_number(2));
  app.add_option("--zipf", o.zipf,
                 "skewed routing in the layer rows: each token's top-K drawn from Zipf(S) over the experts (Gumbel-max); 0: none")
      ->capture_default_str()->check(finite_number(0, 8));
  app.add_option("--placements", texts.placements,
                 "layer rows at d = 1 with the experts placed so: plain (E / R in id order), eplb1, eplb2 (EPLB with "
                 "1 or 2 spare slots a rank, from a first step's loads), shadow (the busiest expert shadowed, stored on every "
                 "rank), shadow_step (FasterMoE: the experts shadowed are chosen each step from its counts, their "
                 "weights broadcast)")
      ->check(CLI::Validator(
          [](const std::string& text) {
            std::stringstream stream(text);
            for (std::string name; std::getline(stream, name, ',');) {
              if (name != "plain" && name != "eplb1" && name != "eplb2" && name != "shadow" && name != "shadow_step") {
                return text + ": allowed: plain, eplb1, eplb2, shadow or shadow_step, separated by commas";
              }
            }
            return std::string();
          },
          ""));
  app.add_option("--only", texts.only, "which rows: count,alltoall,dispatch,layer")
      ->check(CLI::Validator(
          [](const std::string& text) {
            std::stringstream stream(text);
            for (std::string name; std::getline(stream, name, ',');) {
              if (std::find(kVariants.begin(), kVariants.end(), name) == kVariants.end()) {
                return text + ": allowed: count, alltoall, dispatch or layer, separated by commas";
              }
            }
            return std::string();
          },
          ""));
  app.add_option("--out", o.out, "the rows as JSON, with device, date, R and backend");
  app.add_option("--seed", o.seed, "seed of the tokens and weights")->capture_default_str()->check(whole_number(0));
  add_collective_timeout_flag(app, o.collective_timeout_seconds);
}

constexpr const char* kDescription =
    "ep_bench: expert-parallel exchange and layer, in nccl-tests' table shape.\n"
    "  mpirun -np R ep_bench [flags]   (one rank per GPU with NCCL; ranks may share a GPU with MPI)";

}  // namespace

std::string usage() {
  BenchOptions o;
  FlagTexts texts;
  CLI::App app{kDescription, "ep_bench"};
  declare_flags(app, o, texts);
  return app.help();
}

BenchOptions parse_options(int argc, char** argv) {
  BenchOptions o;
  FlagTexts texts;
  CLI::App app{kDescription, "ep_bench"};
  declare_flags(app, o, texts);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    return o;
  } catch (const CLI::ParseError& error) {
    throw std::invalid_argument(command_line_message(error));
  }
  int64_t min_bytes = texts.min_bytes.empty() ? 0 : size_in_bytes(texts.min_bytes);
  int64_t max_bytes = texts.max_bytes.empty() ? 0 : size_in_bytes(texts.max_bytes);
  int64_t factor = texts.factor;
  if (!texts.layer.empty()) {
    const std::vector<int64_t> shape = *parse_integer_list(texts.layer);
    if (shape.size() != 5) throw std::invalid_argument("--layer: expected T,D,H,E,K (T per rank)");
    o.layer.tokens_per_rank = shape[0];
    o.layer.model_dim = shape[1];
    o.layer.hidden_dim = shape[2];
    o.layer.experts = shape[3];
    o.layer.top_k = shape[4];
  }
  if (!texts.formulation.empty()) o.layer.formulation = parse_formulation(texts.formulation);
  if (!texts.placements.empty()) {
    std::stringstream stream(texts.placements);
    for (std::string name; std::getline(stream, name, ',');) o.placements.push_back(name);
  }
  if (o.layer.capacity_factor <= 0) {
    throw std::invalid_argument("--capacity-factor " + std::to_string(o.layer.capacity_factor) + ": expected a number > 0");
  }
  if (!texts.pipeline_chunks.empty()) {
    o.pipeline_chunks.clear();
    // The flag's validator accepted the list, so it parses; hold it while the loop reads it.
    const std::vector<int64_t> degrees = parse_integer_list(texts.pipeline_chunks).value();
    for (int64_t d : degrees) o.pipeline_chunks.push_back(static_cast<int>(d));
  }
  if (!texts.only.empty()) {
    o.variants.clear();
    std::stringstream stream(texts.only);
    for (std::string name; std::getline(stream, name, ',');) o.variants.push_back(name);
  }
  if (o.backend.empty()) o.backend = "nccl";
  if (o.warmup_runs < 0 || o.iterations < 1) throw std::invalid_argument("-w must be >= 0 and -n >= 1");
  const LayerShape& L = o.layer;
  if (L.tokens_per_rank < 1 || L.model_dim < 1 || L.hidden_dim < 1 || L.experts < 1 || L.top_k < 1 || L.top_k > L.experts) {
    throw std::invalid_argument("--layer " + std::to_string(L.tokens_per_rank) + "," + std::to_string(L.model_dim) + "," +
                                std::to_string(L.hidden_dim) + "," + std::to_string(L.experts) + "," +
                                std::to_string(L.top_k) + ": expected T, D, H, E >= 1 and 1 <= K <= E");
  }
  if (!o.out.empty()) check_output_path("--out", o.out);  // before any GPU work
  if (min_bytes == 0 && max_bytes == 0 && factor == 0) {
    for (int64_t mib : {1, 16, 64, 256}) o.sizes.push_back(mib << 20);
  } else {
    if (min_bytes == 0) min_bytes = 1 << 20;
    if (max_bytes == 0) max_bytes = min_bytes;
    if (factor == 0) factor = 2;
    if (factor < 2 || max_bytes < min_bytes) {
      throw std::invalid_argument("-b, -e, -f: expected 0 < b <= e and f >= 2");
    }
    for (int64_t size = min_bytes; size <= max_bytes; size *= factor) o.sizes.push_back(size);
  }
  return o;
}

// ---- measuring one row ----

std::vector<PhaseTime> median_phases(cuda::PhaseTimer& timer, int runs, const std::function<void()>& run) {
  std::vector<PhaseTime> phases;                // in the order first seen
  std::vector<std::vector<double>> per_run_us;  // [phase][run]
  for (int r = 0; r < runs; ++r) {
    run();
    for (const cuda::TimedPhase& timed : timer.collect()) {
      if (timed.depth != 0) continue;  // a nested phase is inside its parent's time
      auto it = std::find_if(phases.begin(), phases.end(),
                             [&](const PhaseTime& p) { return p.name == timed.name && p.stream == timed.stream; });
      if (it == phases.end()) {
        phases.push_back({timed.name, 0.0, timed.stream, timed.stream_name});
        per_run_us.emplace_back(static_cast<size_t>(runs), 0.0);
        it = phases.end() - 1;
      }
      per_run_us[static_cast<size_t>(it - phases.begin())][static_cast<size_t>(r)] += timed.duration_us;
    }
  }
  for (size_t i = 0; i < phases.size(); ++i) {
    std::vector<double>& times = per_run_us[i];
    std::sort(times.begin(), times.end());
    phases[i].median_us = times[times.size() / 2];
  }
  return phases;
}

Row measure(BenchContext& ctx, Variant& variant, int64_t size_bytes) {
  const Prepared prepared = variant.prepare(size_bytes);
  const cudaStream_t stream = ctx.stream;

  // Warm-up: the runs, then more until every rank has been busy for warmup_ms (all ranks decide
  // together, or a rank would run a collective its peers do not).
  const auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < ctx.options.warmup_runs; ++i) variant.run(stream);
  while (true) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double busy = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    const std::vector<double> all = all_gather<double>(ctx.host, busy);
    if (*std::min_element(all.begin(), all.end()) >= ctx.options.warmup_ms) break;
    for (int i = 0; i < 4; ++i) variant.run(stream);
  }

  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times_us;
  for (int i = 0; i < ctx.options.iterations; ++i) {
    ctx.host.barrier();
    CUDA_CHECK(cudaEventRecord(start, stream));
    variant.run(stream);
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times_us.push_back(1000.0 * ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times_us.begin(), times_us.end());
  const double median = times_us[times_us.size() / 2];

  Row row;
  row.variant = variant.name();
  row.size_bytes = prepared.size_bytes;
  row.count = prepared.count;
  row.type = prepared.type;
  row.check = variant.check();
  row.host_syncs = variant.host_syncs();
  row.phases = variant.phases(stream);
  variant.release();

  // The slowest rank's median; the errors of all ranks.
  const std::vector<double> medians = all_gather<double>(ctx.host, median);
  row.time_us = *std::max_element(medians.begin(), medians.end());
  const std::vector<double> errors = all_gather<double>(ctx.host, row.check.error);
  row.check.error = row.check.exact ? 0.0 : *std::max_element(errors.begin(), errors.end());
  if (row.check.exact) {
    for (double e : errors) row.check.error += e;
  }
  const std::vector<int64_t> available = all_gather<int64_t>(ctx.host, row.check.available ? 1 : 0);
  row.check.available = std::count(available.begin(), available.end(), 0) == 0;
  row.algbw_gbs = prepared.bytes_moved / (row.time_us * 1e-6) / 1e9;
  row.busbw_gbs = row.algbw_gbs * static_cast<double>(ctx.ranks - 1) / static_cast<double>(ctx.ranks);
  return row;
}

// ---- the table ----

std::string table_header() {
  char line[256];
  std::snprintf(line, sizeof line, "#%-26s %12s %10s %6s %11s %11s %11s %9s %6s", "variant", "size(B)", "count", "type",
                "time(us)", "algbw(GB/s)", "busbw(GB/s)", "error", "syncs");
  return line;
}

std::string table_line(const Row& row) {
  char error[32];
  if (!row.check.available) std::snprintf(error, sizeof error, "n/a");
  else if (row.check.exact) std::snprintf(error, sizeof error, "%.0f", row.check.error);
  else std::snprintf(error, sizeof error, "%.2e", row.check.error);
  char line[256];
  std::snprintf(line, sizeof line, " %-26s %12lld %10lld %6s %11.1f %11.2f %11.2f %9s %6d", row.variant.c_str(),
                static_cast<long long>(row.size_bytes), static_cast<long long>(row.count), row.type.c_str(),
                row.time_us, row.algbw_gbs, row.busbw_gbs, error, row.host_syncs);
  return line;
}

}  // namespace moe::dist::bench
