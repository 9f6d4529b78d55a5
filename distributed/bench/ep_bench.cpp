// ep_bench.cpp: the expert-parallel benchmark, in nccl-tests' shape: one harness
// (ep_bench_harness.h), one small description per row (ep_bench_variants.h), one table whose every
// row carries size, count, type, time (us), algbw, busbw and an error from a check of the data, so a
// wrong answer shows beside the speed. Rows: raw all-to-all (first, as in nccl-tests), the count
// exchange (the layer's host synchronisation), dispatch + combine of the EP layer at the same bytes,
// and the layer's training step (forward + backward + SGD on the experts) at each pipelining
// degree, then the layer choosing d itself (Tutel's adaptive pipelining by measurement,
// ExpertParallelGpu's kAdaptivePipelineChunks: never slower than d = 1, which is one of its
// candidates), with its trial times. --nodes-of G adds the
// raw all-to-all and dispatch + combine through Tutel's 2DH all-to-all (nodes of G ranks) beside
// the flat rows. --layouts adds the layer's step in Tutel's other layouts r (0: data-parallel
// experts; r > 1: sharded over r ranks along H), the table's fastest r and the cost model's.
//
//   mpirun -np 2 build/distributed/bench/ep_bench --backend nccl --out ep_bench.json   (one GPU per rank)
//   mpirun -np 4 build/distributed/bench/ep_bench --backend nccl --nodes-of 2          (2DH: 2 nodes of 2)
//   mpirun -np 2 build/distributed/bench/ep_bench --backend mpi                        (ranks may share a GPU)
//   mpirun -np 2 build/distributed/bench/ep_bench --backend nccl --only layer --layouts  (Tutel's layouts r)
//   build/distributed/bench/ep_bench --help
// --collective-timeout S (default 30): a collective that has not completed after S seconds ends the
// job with a line naming the rank and the call (distributed/comm/watchdog.h), so a rank that died
// or stopped never leaves the others waiting.
// As root, OpenMPI also wants --allow-run-as-root. The MPI backend stages every exchange through
// host memory: its timings are of PCIe copies and shared memory between processes, not of an
// interconnect, and the table says so; ranks that share a GPU check correctness only.
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK
#include "core/phase_timer.h"  // is_exposed_communication
#include "comm/device_exchange.h"  // DeviceExchange
#include "ep_bench_harness.h"
#include "ep_bench_variants.h"
#include "ep/expert_layout_choice_gpu.h"  // choose_gpu_layout: the cost model's layout
#include "file_io.h"  // write_file_atomically
#include "comm/collective_timeout.h"  // collective_timeout
#include "comm/mpi_communicator.h"
#include "comm/watchdog.h"  // CollectiveWatchdog
#if MOE_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace moe::dist::bench {
namespace {

std::string today() {
  char text[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(text, sizeof text, "%Y-%m-%d", std::localtime(&now));
  return text;
}

// Rank 0's exposed communication: the phases of its caller's stream that wait on communication
// (is_exposed_communication), summed.
double exposed_us(const std::vector<PhaseTime>& phases) {
  double sum = 0.0;
  for (const PhaseTime& phase : phases) {
    if (phase.stream == 0 && cuda::is_exposed_communication(phase.name)) sum += phase.median_us;
  }
  return sum;
}

// "#   phases ...": where rank 0's run goes, the caller's stream first, then each other stream's
// under its name (the exchange stream's, a second micro-batch's), then the exposed communication.
std::string phases_line(const std::vector<PhaseTime>& phases) {
  std::string line = "#   phases on rank 0 (median of " + std::to_string(kPhaseRuns) + " runs, us):";
  int streams = 0;
  for (const PhaseTime& phase : phases) streams = std::max(streams, phase.stream + 1);
  for (int stream = 0; stream < streams; ++stream) {
    bool named = stream == 0;
    for (const PhaseTime& phase : phases) {
      if (phase.stream != stream) continue;
      if (!named) {
        const std::string name = phase.stream_name.empty() ? "stream " + std::to_string(stream) : phase.stream_name;
        line += " | " + name + (name.starts_with(kExchangeRow) ? ", waits for the peers included:" : ":");
        named = true;
      }
      char text[96];
      std::snprintf(text, sizeof text, " %s %.1f", phase.name.c_str(), phase.median_us);
      line += text;
    }
  }
  char text[96];
  std::snprintf(text, sizeof text, " | exposed communication %.1f", exposed_us(phases));
  return line + text;
}

nlohmann::json row_json(const Row& row) {
  nlohmann::json phases = nlohmann::json::object();
  for (const PhaseTime& phase : row.phases) {  // a name seen on an earlier stream is keyed with its stream's name too
    const std::string key = phases.contains(phase.name) ? phase.name + " (" + phase.stream_name + ")" : phase.name;
    phases[key] = {{"median_us", phase.median_us}, {"stream", phase.stream}, {"stream_name", phase.stream_name}};
  }
  return {{"variant", row.variant},
          {"size_bytes", row.size_bytes},
          {"count", row.count},
          {"type", row.type},
          {"time_us", row.time_us},
          {"algbw_gbs", row.algbw_gbs},
          {"busbw_gbs", row.busbw_gbs},
          {"error", row.check.available ? nlohmann::json(row.check.error) : nlohmann::json(nullptr)},
          {"error_kind", row.check.exact ? "wrong_elements" : "relative"},
          {"host_syncs", row.host_syncs},
          {"phases_rank0", phases},
          {"exposed_communication_us_rank0", row.phases.empty() ? nlohmann::json(nullptr) : nlohmann::json(exposed_us(row.phases))}};
}

int run(int argc, char** argv, MpiCommunicator& world) {
  const int rank = world.rank(), R = world.size();
  auto say = [rank](const std::string& text) {
    if (rank == 0) std::printf("%s\n", text.c_str());
  };
  auto complain = [rank](const std::string& text) {  // bad usage: stderr, once
    if (rank == 0) std::fprintf(stderr, "%s\n", text.c_str());
  };
  BenchOptions options;
  try {
    options = parse_options(argc, argv);
  } catch (const std::exception& error) {
    complain(std::string("ep_bench: ") + error.what() + "\n" + usage());
    return 2;
  }
  if (options.help) {
    say(usage());
    return 0;
  }
  const int G = options.hierarchical_ranks_per_node;
  if (G > 1 && R % G != 0) {  // every rank sees the same R and G: every rank returns here
    complain("ep_bench: --nodes-of " + std::to_string(G) + ": G must divide the number of ranks R = " +
             std::to_string(R) + " (nodes of G consecutive ranks)");
    return 2;
  }

  // ---- one GPU per rank, or ranks sharing one ----
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  const std::vector<int64_t> all_devices = all_gather<int64_t>(world, devices);
  if (*std::min_element(all_devices.begin(), all_devices.end()) == 0) {
    complain("ep_bench: a rank sees no GPU; ep_bench times GPU exchanges (the CPU path is "
        "test_distributed_expert_parallel_cpu)");
    return 1;
  }
  const auto [local_rank, local_ranks] = world.host_rank();
  const int device = local_rank % devices;
  CUDA_CHECK(cudaSetDevice(device));
  int ranks_per_gpu = 0;  // the ranks of this host whose local rank maps to this device
  for (int r = 0; r < local_ranks; ++r) ranks_per_gpu += r % devices == device;
  const std::vector<int64_t> sharing = all_gather<int64_t>(world, ranks_per_gpu);
  const int most_sharing = static_cast<int>(*std::max_element(sharing.begin(), sharing.end()));
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, device));

  std::unique_ptr<Communicator> nccl;
  if (options.backend == "nccl") {
#if MOE_HAVE_NCCL
    if (most_sharing > 1) {
      complain("ep_bench: --backend nccl needs one GPU per rank (NCCL refuses two ranks on one GPU); " +
          std::to_string(R) + " ranks share " + std::to_string(devices) + " GPU(s): use --backend mpi");
      return 2;
    }
    nccl = std::make_unique<NcclCommunicator>(world, /*stream=*/nullptr, world.watchdog());
#else
    complain("ep_bench: this build has no NCCL: use --backend mpi");
    return 2;
#endif
  }
  Communicator& layer = nccl ? *nccl : static_cast<Communicator&>(world);
  DeviceExchange exchange(layer);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BenchContext ctx{world, layer, exchange, rank, R, ranks_per_gpu, double(properties.totalGlobalMem), stream, options};

  // ---- the header ----
  say("# ep_bench: expert-parallel exchange and layer (nccl-tests' columns; busbw = algbw * (R-1)/R)");
  say("# " + today() + "  ranks R=" + std::to_string(R) + "  backend " + options.backend + "  device " +
      properties.name + " (" + std::to_string(devices) + " on rank 0's host, " + std::to_string(most_sharing) +
      " rank(s) per GPU at most)");
  if (options.backend == "mpi") {
    say("# NOTE: the MPI backend stages every exchange through pinned host memory (device -> host, MPI,");
    say("#       host -> device): these timings are of PCIe copies and shared memory, not of an interconnect.");
  }
  if (most_sharing > 1) say("# NOTE: ranks share a GPU: the rows check correctness; their times are not a multi-GPU system's.");
  if (G > 1) {
    say("# 2dh rows: Tutel's 2D hierarchical all-to-all, nodes of G=" + std::to_string(G) + " consecutive ranks (N=" +
        std::to_string(R / G) + "); where the 'nodes' share one host, stage 2 crosses no slower link: the rows");
    say("#       show the price of the extra stage and copies, not the gain across real nodes.");
  }
  say("# time: the slowest rank's median of " + std::to_string(options.iterations) + " runs after " +
      std::to_string(options.warmup_runs) + " warm-up runs and " + std::to_string(int(options.warmup_ms)) +
      " ms of load; error: wrong elements summed over ranks, or the largest relative error (layer rows,");
  say("#       against the single-GPU layer on all tokens); syncs: waits of the host on the GPU in one run");

  std::vector<Row> rows;
  auto measure_all = [&](Variant& variant) {
    for (int64_t size : variant.sizes(options)) {
      rows.push_back(measure(ctx, variant, size));
      say(table_line(rows.back()));
      if (!rows.back().phases.empty()) say(phases_line(rows.back().phases));
      std::fflush(stdout);
    }
  };
  auto wanted = [&](const std::string& name) {
    return std::find(options.variants.begin(), options.variants.end(), name) != options.variants.end();
  };
  std::shared_ptr<LayerProblem> problem;
  std::vector<std::string> messages;
  if (wanted("layer")) problem = make_layer_problem(ctx, messages);  // first: its check needs the memory
  for (const std::string& message : messages) say("# " + message);
  if (problem) {
    say("# layer rows: forward + backward + SGD on the experts (learning rate 0: the same weights each run), " +
        layer_summary(*problem).description);
  }
  say(table_header());
  if (wanted("alltoall")) measure_all(*make_alltoall_variant(ctx));
  if (wanted("alltoall") && G > 1) measure_all(*make_alltoall_variant(ctx, G));
  if (wanted("count")) measure_all(*make_count_exchange_variant(ctx));
  if (wanted("dispatch")) measure_all(*make_dispatch_combine_variant(ctx));
  if (wanted("dispatch") && G > 1) measure_all(*make_dispatch_combine_variant(ctx, G));
  int adaptive = 0;  // the table's fastest fixed degree
  double adaptive_us = 0, one_chunk_us = 0;
  std::shared_ptr<PipelineChoice> layer_choice;  // the layer's own choice, with its trial times
  if (problem) {
    for (int d : options.pipeline_chunks) {
      measure_all(*make_layer_variant(ctx, problem, d));
      const double time = rows.back().time_us;
      if (d == 1) one_chunk_us = time;
      if (adaptive == 0 || time < adaptive_us) {
        adaptive = d;
        adaptive_us = time;
      }
    }
    char line[200];
    std::snprintf(line, sizeof line, "# the table's fastest pipelining degree: d = %d, %.1f us", adaptive, adaptive_us);
    say(line);
    if (one_chunk_us > 0) {
      std::snprintf(line, sizeof line, "#   against d = 1: %.1f us (%.3fx)", one_chunk_us, one_chunk_us / adaptive_us);
      say(line);
    }
    if (options.overlap) {  // the d = 1 step as two overlapped micro-batches, beside the plain one
      measure_all(*make_overlap_variant(ctx, problem));
      if (one_chunk_us > 0) {
        std::snprintf(line, sizeof line, "# two micro-batches overlapped: %.1f us against d = 1's %.1f us (%.3fx)",
                      rows.back().time_us, one_chunk_us, one_chunk_us / rows.back().time_us);
        say(line);
      }
    }
    if (options.adaptive) {
      layer_choice = std::make_shared<PipelineChoice>();
      measure_all(*make_layer_variant(ctx, problem, kAdaptivePipelineChunks, layer_choice));
      std::string trials;
      for (size_t i = 0; i < layer_choice->candidates.size(); ++i) {
        std::snprintf(line, sizeof line, "%sd=%d %.3f ms", i ? ", " : "", layer_choice->candidates[i],
                      layer_choice->times_ms[i]);
        trials += line;
      }
      std::snprintf(line, sizeof line, "# the layer's adaptive choice (pipeline_chunks = 0): d = %d, %.1f us",
                    layer_choice->chosen, rows.back().time_us);
      say(line);
      say("#   its trials, the slowest rank's best forward + backward of " + std::to_string(kTrialStepsPerCandidate) +
          " steps each: " + trials);
      if (one_chunk_us > 0) {
        std::snprintf(line, sizeof line, "#   against d = 1 in the table: %.3fx", one_chunk_us / rows.back().time_us);
        say(line);
      }
    }
  }
  nlohmann::json placement_json = nlohmann::json::array();  // --placements: each row's placement and loads
  if (problem) {
    for (const std::string& placement : options.placements) {
      auto note = std::make_shared<std::string>();
      measure_all(*make_placement_variant(ctx, problem, placement, note));
      say("# " + *note);
      placement_json.push_back({{"placement", placement}, {"time_us", rows.back().time_us}, {"note", *note}});
    }
  }
  nlohmann::json layout_json;  // --layouts: each r's time, the table's fastest, the cost model's pick
  if (problem && options.layouts) {
    const LayerSummary shape = layer_summary(*problem);
    const std::vector<int> layouts = valid_gpu_layouts(shape.config, {}, R);
    std::vector<double> layout_us;
    char line[200];
    for (int r : layouts) {
      measure_all(*make_layout_variant(ctx, problem, r));
      layout_us.push_back(rows.back().time_us);
    }
    const size_t fastest = static_cast<size_t>(std::min_element(layout_us.begin(), layout_us.end()) - layout_us.begin());
    std::snprintf(line, sizeof line, "# the table's fastest layout: r = %d, %.1f us", layouts[fastest],
                  layout_us[fastest]);
    say(line);
    ExpertParallelGpu chooser(layer, shape.config, shape.tokens_per_rank);  // the cost model reads only its settings
    const LayoutChoice modelled = choose_gpu_layout(chooser);
    std::string estimates;
    for (const LayoutEstimate& e : modelled.estimates) {
      std::snprintf(line, sizeof line, "%sr=%d %.1f us", estimates.empty() ? "" : ", ", e.r, e.total_us);
      estimates += line;
    }
    std::snprintf(line, sizeof line, "# the cost model's layout (uniform routing): r = %d; its estimates: ", modelled.r);
    say(line + estimates);
    layout_json = {{"candidates", layouts}, {"measured_us", layout_us}, {"fastest", layouts[fastest]},
                   {"cost_model_choice", modelled.r}};
  }
  // The verdict: no wrong element in the exact checks, the layer within bf16 tolerance of the
  // single-GPU layer.
  constexpr double kLayerTolerance = 2e-2;
  double wrong = 0, layer_error = 0;
  for (const Row& row : rows) {
    if (!row.check.available) continue;
    if (row.check.exact) wrong += row.check.error;
    else layer_error = std::max(layer_error, row.check.error);
  }
  const bool pass = wrong == 0 && layer_error <= kLayerTolerance;
  char verdict[200];
  std::snprintf(verdict, sizeof verdict, "%s wrong_elements=%lld layer_max_rel_err=%.2e tol=%.0e", pass ? "PASS" : "FAIL",
                static_cast<long long>(wrong), layer_error, kLayerTolerance);
  say(verdict);

  if (rank == 0 && !options.out.empty()) {
    nlohmann::json json;
    json["benchmark"] = "ep_bench";
    json["date"] = today();
    json["device"] = properties.name;
    json["ranks"] = R;
    json["ranks_per_gpu"] = most_sharing;
    json["backend"] = options.backend;
    json["interconnect_timings"] = options.backend == "nccl" && most_sharing == 1;
    json["iterations"] = options.iterations;
    if (problem) {
      const LayerSummary layer_shape = layer_summary(*problem);
      json["layer"] = {{"description", layer_shape.description},
                       {"tokens_per_rank", layer_shape.tokens_per_rank},
                       {"model_dim", layer_shape.config.model_dim},
                       {"hidden_dim", layer_shape.config.hidden_dim},
                       {"experts", layer_shape.config.num_experts},
                       {"top_k", layer_shape.config.top_k},
                       {"formulation", std::string(to_string(layer_shape.config.formulation))}};
      json["adaptive_pipeline_chunks"] = adaptive;
      if (layer_choice) {
        json["layer_adaptive_choice"] = {{"chosen", layer_choice->chosen},
                                         {"candidates", layer_choice->candidates},
                                         {"trial_times_ms", layer_choice->times_ms},
                                         {"trial_steps_per_candidate", kTrialStepsPerCandidate}};
      }
    }
    if (!layout_json.is_null()) json["layouts"] = layout_json;
    if (!placement_json.empty()) json["placements"] = placement_json;
    if (options.zipf > 0) json["zipf"] = options.zipf;
    json["hierarchical_ranks_per_node"] = G;
    json["notes"] = messages;
    json["rows"] = nlohmann::json::array();
    for (const Row& row : rows) json["rows"].push_back(row_json(row));
    write_file_atomically(options.out, json.dump(2) + "\n");
    say("# wrote " + options.out);
  }
  problem.reset();
  CUDA_CHECK(cudaStreamDestroy(stream));
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace moe::dist::bench

int main(int argc, char** argv) {
  moe::dist::MpiEnvironment mpi(argc, argv);
  // The watchdog first (every communicator's calls are armed on it); its timeout from the flags, a
  // bad value of which run() reports.
  double timeout_seconds = moe::dist::kDefaultCollectiveTimeoutSeconds;
  try {
    timeout_seconds = moe::dist::bench::parse_options(argc, argv).collective_timeout_seconds;
  } catch (const std::exception&) {
  }
  moe::dist::CollectiveWatchdog watchdog(mpi.world_rank(), mpi.world_size(), moe::dist::collective_timeout(timeout_seconds));
  int status = 0;
  {
    auto world = moe::dist::MpiCommunicator::world(&watchdog);
    try {
      status = moe::dist::bench::run(argc, argv, *world);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "[rank %d] ep_bench: %s\n", world->rank(), error.what());
      MPI_Abort(MPI_COMM_WORLD, 1);  // a rank that failed alone would leave the others waiting
    }
  }
  return status;
}
