// ep_bench_harness.cpp: options, the timing loop and the table of ep_bench (see ep_bench_harness.h).
#include "ep_bench_harness.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "core/cuda_check.h"  // CUDA_CHECK
#include "program_exit.h"     // check_output_path, finite_number

namespace moe::dist::bench {

// ---- options ----

namespace {

// "8", "512K", "16M", "1G" (powers of 1024, as nccl-tests reads them).
int64_t parse_size(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double scale = 1;
  if (unit == "K" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) used = 0;
  if (used == 0 || value <= 0) {
    throw std::invalid_argument(flag + " " + text + ": expected a size such as 8, 512K, 16M or 1G");
  }
  return static_cast<int64_t>(value * scale);
}

std::vector<int64_t> parse_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    try {
      size_t used = 0;
      values.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw std::invalid_argument(flag + " " + text + ": expected integers separated by commas");
    }
  }
  if (values.empty()) throw std::invalid_argument(flag + ": expected at least one value");
  return values;
}

}  // namespace

std::string usage() {
  return "ep_bench: expert-parallel exchange and layer, in nccl-tests' table shape\n"
         "  mpirun -np R ep_bench [flags]      (one rank per GPU with NCCL; ranks may share a GPU with MPI)\n"
         "  -b SIZE -e SIZE -f FACTOR   bytes per rank, min to max by a factor (default: 1M, 16M, 64M, 256M)\n"
         "  -w RUNS                     warm-up runs (default 5), then at least --warmup-ms of load (1000)\n"
         "  -n ITERATIONS               timed runs; the table shows the slowest rank's median (default 20)\n"
         "  --backend nccl|mpi          NCCL on device buffers, or MPI staged through host memory\n"
         "  --layer T,D,H,E,K           the layer rows' shape, T per rank (default 16384,2048,8192,32,2)\n"
         "  --block B --formulation dropless|padded|dropping --capacity-factor CF\n"
         "  --chunks 1,2,4,8            Tutel's pipelining degrees of the layer rows\n"
         "  --no-adaptive               no row of the layer choosing d itself (pipeline_chunks = 0)\n"
         "  --layouts                   rows of the layer in Tutel's other layouts: r = 0 and every valid r > 1\n"
         "  --nodes-of G                Tutel's 2DH rows beside the flat ones: nodes of G ranks, G > 1 dividing R\n"
         "  --only count,alltoall,dispatch,layer   which rows\n"
         "  --out FILE.json             the rows, with device, date, R and backend\n"
         "  --seed N\n";
}

BenchOptions parse_options(int argc, char** argv) {
  BenchOptions o;
  int64_t min_bytes = 0, max_bytes = 0, factor = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") o.help = true;
    else if (flag == "-b") min_bytes = parse_size(flag, value());
    else if (flag == "-e") max_bytes = parse_size(flag, value());
    else if (flag == "-f") factor = parse_list(flag, value()).at(0);
    else if (flag == "-w") o.warmup_runs = static_cast<int>(parse_list(flag, value()).at(0));
    else if (flag == "-n") o.iterations = static_cast<int>(parse_list(flag, value()).at(0));
    else if (flag == "--warmup-ms") o.warmup_ms = std::stod(value());
    else if (flag == "--backend") o.backend = value();
    else if (flag == "--layer") {
      const std::vector<int64_t> shape = parse_list(flag, value());
      if (shape.size() != 5) throw std::invalid_argument("--layer: expected T,D,H,E,K (T per rank)");
      o.layer.tokens_per_rank = shape[0];
      o.layer.model_dim = shape[1];
      o.layer.hidden_dim = shape[2];
      o.layer.experts = shape[3];
      o.layer.top_k = shape[4];
    } else if (flag == "--block") o.layer.block_size = parse_list(flag, value()).at(0);
    else if (flag == "--formulation") o.layer.formulation = parse_formulation(value());
    else if (flag == "--capacity-factor") {
      const std::string text = value();
      o.layer.capacity_factor = finite_number(flag, text);
      if (o.layer.capacity_factor <= 0) throw std::invalid_argument(flag + " " + text + ": expected a number > 0");
    }
    else if (flag == "--chunks") {
      o.pipeline_chunks.clear();
      for (int64_t d : parse_list(flag, value())) o.pipeline_chunks.push_back(static_cast<int>(d));
    } else if (flag == "--no-adaptive") {
      o.adaptive = false;
    } else if (flag == "--layouts") {
      o.layouts = true;
    } else if (flag == "--nodes-of") {
      const int64_t G = parse_list(flag, value()).at(0);
      if (G < 2) throw std::invalid_argument("--nodes-of " + std::to_string(G) + ": expected G >= 2 ranks per node");
      o.hierarchical_ranks_per_node = static_cast<int>(G);
    } else if (flag == "--only") {
      o.variants.clear();
      std::stringstream stream(value());
      std::string name;
      while (std::getline(stream, name, ',')) {
        if (name != "count" && name != "alltoall" && name != "dispatch" && name != "layer") {
          throw std::invalid_argument("--only " + name + ": expected count, alltoall, dispatch or layer");
        }
        o.variants.push_back(name);
      }
    } else if (flag == "--out") o.out = value();
    else if (flag == "--seed") {
      const int64_t seed = parse_list(flag, value()).at(0);
      if (seed < 0) throw std::invalid_argument("--seed " + std::to_string(seed) + ": expected an integer >= 0");
      o.seed = static_cast<uint64_t>(seed);
    }
    else throw std::invalid_argument("unknown flag " + flag + " (see --help)");
  }
  if (o.backend.empty()) o.backend = "nccl";
  if (o.backend != "nccl" && o.backend != "mpi") {
    throw std::invalid_argument("--backend " + o.backend + ": expected nccl or mpi");
  }
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
      auto it = std::find_if(phases.begin(), phases.end(), [&](const PhaseTime& p) { return p.name == timed.name; });
      if (it == phases.end()) {
        phases.push_back({timed.name, 0.0, timed.stream});
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
