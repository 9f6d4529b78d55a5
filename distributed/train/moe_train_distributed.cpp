// moe_train_distributed.cpp: train the tiny byte-level MoE transformer on several GPUs, one process
// per rank: data parallel for every parameter but the experts, the experts spread over the ranks
// (FastMoE's expert parallelism): E / R a rank in id order, or with --placement eplb placed by
// their load and re-planned every --rebalance-every steps, hot experts replicated (DeepSeek's EPLB).
// The same settings, presets, run record and checkpoints as moe_train (cuda/train/), whose loop it
// runs (trainer.h) with this folder's ranks.
//
//   mpirun -np 2 build/distributed/train/moe_train_distributed --preset default --run-dir runs/ep2
//   mpirun -np 2 build/distributed/train/moe_train_distributed --run-dir runs/ep2 --resume
//   mpirun -np 2 build/distributed/train/moe_train_distributed --preset throughput --benchmark-steps 30
//   mpirun -np 2 build/distributed/train/moe_train_distributed --backend mpi ...   (2 ranks on 1 GPU)
//   mpirun -np 2 build/distributed/train/moe_train_distributed --placement eplb --redundant-slots 1 --rebalance-every 100 ...
//   build/distributed/train/moe_train_distributed --help
// As root OpenMPI also wants --allow-run-as-root; with more ranks than cores --oversubscribe.
//
// Flags of its own: --backend nccl|mpi (default: nccl where every rank has its own GPU, else mpi,
// which stages every exchange through host memory so that ranks may share a GPU: correct, but its
// timings are not an interconnect's), --pipeline-chunks d (Tutel's pipelining degree of the
// expert-parallel layers, default 1; 0: chosen by measurement per shape) and --collective-timeout S
// (the watchdog, distributed/watchdog.h: a collective that has not completed after S seconds, 30 by
// default, ends the job with a line naming the rank and the call, so a rank that died or stopped
// never leaves the others waiting). --batch is the global batch: each rank trains on batch / R.
// A checkpoint holds the whole model as moe_train writes it, so a run resumes on any number of
// ranks or on one GPU with moe_train.
//
// SIGINT or SIGTERM to every rank (mpirun forwards them) stops the run at the next flush of the
// losses, the same step on every rank, with a checkpoint (trainer.h); rank 0 prints the command that
// resumes it, and the status is 130 / 143.
//
// Exit status: 0 done; 2 bad usage or input (the same message on every rank, printed once);
// 1 a failure while running (the failing rank's message, then MPI_Abort ends every rank).
#include <cuda_runtime.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "core/device_info.h"      // why_no_gpu
#include "expert_parallel_ranks.h"  // ExpertParallelRanks
#include "comm/collective_timeout.h"      // add_collective_timeout_flag, collective_timeout
#include "comm/watchdog.h"               // CollectiveWatchdog
#include "fnv1a.h"                  // fnv1a_64: the configs' fingerprint
#include "comm/mpi_communicator.h"       // MpiEnvironment, MpiCommunicator
#include "command_line.h"           // CLI::App, whole_number, finite_number, one_of
#include "ep/expert_parallel_gpu.h"  // kMaxPipelineChunks, kAdaptivePipelineChunks
#include "comm/rank_agreement.h"         // check_on_every_rank, check_same_on_every_rank
#include "stop_signal.h"            // install_stop_handlers, exit_status_for_signal
#include "train/train_config.h"     // parse_arguments, validate, help_text, to_json
#include "train/trainer.h"          // train, benchmark
#if MOE_HAVE_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace {

using moe::dist::Communicator;
using moe::dist::MpiCommunicator;

struct DistributedFlags {
  std::string backend;  // "", "nccl" or "mpi"
  int pipeline_chunks = 1;
  double collective_timeout_seconds = moe::dist::kDefaultCollectiveTimeoutSeconds;
  std::vector<std::string> rest;  // moe_train's flags
};

// This program's own flags, declared once: split_flags reads them, --help prints them.
void declare_flags(CLI::App& app, DistributedFlags& flags) {
  app.add_option("--backend", flags.backend,
                 "exchanges over NCCL (one GPU per rank) or MPI staged through host memory (ranks may share a GPU); "
                 "default nccl where each rank has a GPU")
      ->check(moe::one_of({"nccl", "mpi"}));
  app.add_option("--pipeline-chunks", flags.pipeline_chunks,
                 "Tutel's pipelining degree d of the expert-parallel layers, 1 to " +
                     std::to_string(moe::dist::kMaxPipelineChunks) +
                     "; 0: each layer times d = 1, 2, 4, 8 and keeps the fastest")
      ->capture_default_str()
      ->check(moe::whole_number(moe::dist::kAdaptivePipelineChunks, moe::dist::kMaxPipelineChunks));
  moe::dist::add_collective_timeout_flag(app, flags.collective_timeout_seconds);
}

constexpr const char* kDescription =
    "usage: mpirun -np R moe_train_distributed [flags] [--preset NAME] [--config FILE.json] [--setting value ...]";

// Takes this program's own flags out of the arguments, the rest (moe_train's settings) in their
// order; throws TrainConfigError naming a bad one.
DistributedFlags split_flags(const std::vector<std::string>& arguments) {
  DistributedFlags flags;
  CLI::App app{kDescription, "moe_train_distributed"};
  app.set_help_flag();  // run() answers --help on rank 0 alone
  app.allow_extras();   // moe_train's settings, for parse_arguments
  declare_flags(app, flags);
  try {
    app.parse(std::vector<std::string>(arguments.rbegin(), arguments.rend()));  // CLI11 takes them last first
  } catch (const CLI::ParseError& error) {
    throw moe::train::TrainConfigError(moe::command_line_message(error));
  }
  flags.rest = app.remaining();
  return flags;
}

int run(const std::vector<std::string>& arguments, MpiCommunicator& world, moe::dist::CollectiveWatchdog& watchdog) {
  const int rank = world.rank(), R = world.size();
  for (const std::string& argument : arguments) {
    if (argument == "--help" || argument == "-h") {
      if (rank == 0) {
        DistributedFlags flags;
        CLI::App app{kDescription, "moe_train_distributed"};
        declare_flags(app, flags);
        std::cout << app.help() << "--batch is the global batch (a multiple of R); every other setting is moe_train's:\n"
                  << moe::train::help_text(moe::train::preset("default"));
      }
      return 0;
    }
  }

  // ---- the settings: parsed and checked on every rank, the same everywhere ----
  DistributedFlags flags;
  moe::train::TrainConfig config;
  moe::dist::check_on_every_rank(world, "settings", [&] {
    flags = split_flags(arguments);
    config = moe::train::parse_arguments(flags.rest);
    moe::train::validate(config);
    if (config.batch % R != 0) {
      throw moe::train::TrainConfigError("--batch " + std::to_string(config.batch) + " is the global batch: it must be a "
                                         "multiple of the " + std::to_string(R) + " ranks");
    }
    moe::train::check_placement(config, R);  // E >= R; --placement eplb's spare slots
    if (config.model.pregated && R > 1) {
      throw moe::train::TrainConfigError("--pregated: not on several ranks (the expert-parallel layer routes its own input)");
    }
    if (config.benchmark_steps == 0) moe::train::check_inputs(config, R);  // data, checkpoint, run directory
  });
  moe::dist::check_same_on_every_rank(world, "the settings of every rank",
                                      moe::fnv1a_64(moe::train::to_json(config).dump() + flags.backend +
                                                  std::to_string(flags.pipeline_chunks)));

  // ---- one GPU per rank, or ranks sharing one ----
  moe::dist::check_on_every_rank(world, "GPUs", [] {
    if (const std::string why = moe::cuda::why_no_gpu(); !why.empty()) throw std::runtime_error("no GPU: " + why);
  });
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const auto [local_rank, local_ranks] = world.host_rank();
  const int device = local_rank % devices;
  if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice(" + std::to_string(device) + ") failed");
  const bool own_gpu = local_ranks <= devices;
  std::vector<int32_t> own = moe::dist::all_gather<int32_t>(world, own_gpu ? 1 : 0);
  bool every_rank_own_gpu = true;
  for (int32_t o : own) every_rank_own_gpu = every_rank_own_gpu && o == 1;
  std::string backend = flags.backend.empty() ? (every_rank_own_gpu ? "nccl" : "mpi") : flags.backend;
  moe::dist::check_on_every_rank(world, "--backend", [&] {
    if (backend == "nccl" && !every_rank_own_gpu) {
      throw moe::train::TrainConfigError("--backend nccl needs one GPU per rank (NCCL refuses two ranks on one GPU); "
                                         "use --backend mpi");
    }
#if !MOE_HAVE_NCCL
    if (backend == "nccl") throw moe::train::TrainConfigError("--backend nccl: this build has no NCCL; use --backend mpi");
#endif
  });

  std::unique_ptr<Communicator> nccl;
#if MOE_HAVE_NCCL
  if (backend == "nccl") nccl = std::make_unique<moe::dist::NcclCommunicator>(world, /*stream=*/nullptr, &watchdog);
#endif
  Communicator& device_communicator = nccl ? *nccl : static_cast<Communicator&>(world);
  moe::dist::ExpertParallelGpuOptions layer_options;
  layer_options.pipeline_chunks = flags.pipeline_chunks;
  moe::dist::ExpertParallelRanks ranks(world, device_communicator, layer_options);

  if (config.benchmark_steps > 0) {
    moe::train::benchmark(config, std::cout, &ranks);
    return 0;
  }
  moe::install_stop_handlers();
  const moe::train::TrainResult result = moe::train::train(config, std::cout, &ranks);
  if (result.stopped_by_signal != 0) {  // every rank stopped after the same step (trainer.h)
    if (rank == 0) {
      std::string command = "mpirun -np " + std::to_string(R) + " moe_train_distributed";
      for (const std::string& argument : arguments) {
        if (argument != "--overwrite" && argument != "--resume") command += " " + argument;
      }
      std::fprintf(stderr, "moe_train_distributed: stopped by %s after step %lld; continue with: %s --resume\n",
                   moe::signal_name(result.stopped_by_signal).c_str(), static_cast<long long>(result.steps_done),
                   command.c_str());
    }
    return moe::exit_status_for_signal(result.stopped_by_signal);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  moe::dist::MpiEnvironment mpi(argc, argv);
  const std::vector<std::string> arguments(argv + 1, argv + argc);
  // The watchdog first (every communicator's calls are armed on it); its timeout from the flags, a
  // bad value of which run() reports on every rank.
  double timeout_seconds = DistributedFlags{}.collective_timeout_seconds;
  try {
    timeout_seconds = split_flags(arguments).collective_timeout_seconds;
  } catch (const std::exception&) {
  }
  moe::dist::CollectiveWatchdog watchdog(mpi.world_rank(), mpi.world_size(),
                                         moe::dist::collective_timeout(timeout_seconds));
  int status = 0;
  {
    auto world = MpiCommunicator::world(&watchdog);
    const int rank = world->rank();
    try {
      status = run(arguments, *world, watchdog);
    } catch (const std::invalid_argument& error) {
      // Bad usage or input, found the same way on every rank: the settings and GPUs (checked together,
      // rank_agreement.h), the run directory and the data (TrainConfigError). Printed once.
      if (rank == 0) std::fprintf(stderr, "moe_train_distributed: %s\n", error.what());
      status = 2;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "[rank %d] moe_train_distributed: %s\n", rank, error.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);  // a rank that failed alone would leave the others waiting
    }
  }
  return status;
}
