// distributed_lesson_support.h: what the lessons on MPI ranks share (06 expert parallelism, 07 Tutel):
// each rank's shard of the tokens, the data every rank draws alike, the run record opened on rank 0
// once every rank agrees that it may be written, rank 0's output (tables, text, the verdict), and
// the flags of their ranks and GPU path (--gpu, --backend, --collective-timeout; the path itself is
// distributed_lesson_gpu.h, built with CUDA) and their entry, which puts every collective under the
// watchdog (distributed/comm/watchdog.h), so a rank that stops never leaves the others waiting. Header-only and apart from lesson_support.h, because
// only the lessons built with MPI have a communicator.
// Written once here so that both lessons read as their sections alone. Used by:
//   mpirun --oversubscribe -np 4 build/lessons/lesson06_expert_parallelism
//   mpirun --oversubscribe -np 4 build/lessons/lesson07_tutel
#pragma once

#include <mpi.h>  // MPI_Abort: a GPU error on one rank ends every rank

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "command_line.h"           // CLI::App, one_of
#include "comm/collective_timeout.h"  // add_collective_timeout_flag, collective_timeout
#include "comm/communicator.h"      // Communicator, broadcast
#include "comm/mpi_communicator.h"  // MpiEnvironment, MpiCommunicator
#include "comm/watchdog.h"          // CollectiveWatchdog
#include "init.h"                   // random_weights, random_matrix
#include "lesson_support.h"         // LessonOptions, lesson_run_refused, create_lesson_run, zipf_tokens, Table

namespace moe::lessons {

// A step's routing as the run record's "expert_load" event (common/run_events.h): the slots each
// source rank routed to each expert, from the layer's [R x E] count matrix in rank order. moe_sim
// replays it (--trace).
inline ExpertLoadEvent expert_load_of(int64_t step, int64_t layer, const std::vector<int64_t>& per_rank_expert, int ranks) {
  ExpertLoadEvent load{.step = step, .layer = layer};
  const size_t experts = per_rank_expert.size() / static_cast<size_t>(ranks);
  for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
    load.tokens.emplace_back(per_rank_expert.begin() + static_cast<ptrdiff_t>(r * experts),
                             per_rank_expert.begin() + static_cast<ptrdiff_t>((r + 1) * experts));
  }
  return load;
}

// ---- the ranks' flags, for parse_options' `own_flags` (lesson_support.h) ----

struct RankFlags {
  bool gpu = false;              // --gpu
  std::string backend = "auto";  // --backend auto|nccl|mpi
  double collective_timeout_seconds = dist::kDefaultCollectiveTimeoutSeconds;  // --collective-timeout S
};

// Declares --gpu, --backend and --collective-timeout on a lesson's command line (parse_options'
// `own_flags`).
inline void add_rank_flags(CLI::App& app, RankFlags& flags) {
  app.add_flag("--gpu", flags.gpu,
               "run the lesson's layer on GPU ranks (distributed/expert_parallel_gpu.h) and check it against the CPU "
               "reference, instead of the CPU ranks' tables");
  app.add_option("--backend", flags.backend, "with --gpu: auto (NCCL where each rank has its own GPU, else MPI), nccl, mpi")
      ->capture_default_str()
      ->check(one_of({"auto", "nccl", "mpi"}));
  dist::add_collective_timeout_flag(app, flags.collective_timeout_seconds);
}

// --gpu anywhere in argv: the lessons' GPU path keeps its run record in a directory of its own.
inline bool gpu_flag_given(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gpu") == 0) return true;
  }
  return false;
}

// ---- the run record ----

// Collective. Rank 0 looks whether the run record may be written and tells the others, so that the
// ranks stop together: false means every rank should return exit code 2 (the message is on rank 0's
// stderr). Otherwise rank 0 creates the record in `writer` (world_size R, one device name per rank)
// and the other ranks leave `writer` empty.
// `devices`: one name per rank; empty: the CPU ranks of the lessons' default path.
inline bool open_lesson_run_on_ranks(dist::Communicator& comm, const LessonOptions& options,
                                     const std::string& lesson_name, const std::string& lesson_number,
                                     const MoeConfig& config, std::optional<RunWriter>& writer,
                                     std::vector<std::string> devices = {}) {
  const int R = comm.size();
  const bool root = comm.rank() == 0;
  int32_t refused = root && lesson_run_refused(options, lesson_name) ? 1 : 0;
  dist::broadcast<int32_t>(comm, std::span<int32_t>(&refused, 1), 0);
  if (refused) return false;
  if (root) {
    if (devices.empty()) {
      for (int r = 0; r < R; ++r) devices.push_back("CPU rank " + std::to_string(r) + " (moe::ref, double, MPI)");
    }
    writer.emplace(create_lesson_run(options, lesson_name, lesson_number, config, devices, R));
  }
  return true;
}

// ---- the ranks' shards and data ----

// This rank's tokens: equal shards in token order.
struct Shard {
  int rank = 0, ranks = 1;
  int64_t offset = 0, tokens = 0;  // first global token, T_r
};

// The comm's shard of the lesson's T tokens. The lessons give each rank E / R whole experts and
// T / R tokens, so R must divide both: otherwise rank 0 says which rank counts do, on stderr, and
// the result is empty (every rank returns exit code 2).
inline std::optional<Shard> shard_tokens(const dist::Communicator& comm, const MoeConfig& config,
                                         const std::string& lesson_name) {
  const int R = comm.size(), rank = comm.rank();
  const int64_t T = config.tokens, E = config.num_experts;
  if (E % R == 0 && T % R == 0) return Shard{rank, R, rank * (T / R), T / R};
  if (rank == 0) {
    std::vector<int64_t> fitting;
    for (int64_t r = 1; r <= std::gcd(E, T); ++r) {
      if (E % r == 0 && T % r == 0) fitting.push_back(r);
    }
    std::string counts;
    for (size_t i = 0; i < fitting.size(); ++i) {
      counts += (i == 0 ? "" : i + 1 == fitting.size() ? " or " : ", ") + std::to_string(fitting[i]);
    }
    std::cerr << lesson_name << ": R = " << R << " ranks must divide E = " << E << " and T = " << T
              << "; run with -np " << counts << "\n";
  }
  return std::nullopt;
}

// The tokens and weights of lessons 06 and 07. Every rank draws the same and keeps its shard, so
// the single-device layer on all of them is the oracle. The gate is sharper than random_weights'
// so that routing is decisive.
struct LessonData {
  ref::Matrix text_x;    // [T, D] zipf_tokens: text-like, skewed routing
  ref::Matrix random_x;  // [T, D] plain random tokens; drawn only when asked (lesson 06's contrast)
  ref::Matrix dy;        // [T, D] the gradient the backward starts from
  ref::MoeWeights weights;
};

// The draws in a fixed order (text_x, random_x, dy, the gate), so one seed gives the same data on
// the CPU path and on the GPU path.
inline LessonData draw_lesson_data(const MoeConfig& config, uint64_t seed, bool with_random_tokens) {
  const int64_t T = config.tokens, D = config.model_dim;
  std::mt19937_64 generator(seed);
  LessonData data;
  data.text_x = zipf_tokens(T, D, 1000, 1.1, generator);
  if (with_random_tokens) data.random_x = ref::random_matrix(T, D, generator);
  data.dy = ref::random_matrix(T, D, generator);
  data.weights = ref::random_weights(config, seed + 1);
  data.weights.gate_weights =
      ref::random_matrix(D, config.num_experts, generator, 3.0 / std::sqrt(static_cast<double>(D)));
  return data;
}

// ---- rank 0's output ----

// What rank 0 prints and records: the other ranks take part in every collective and stay silent.
class RankOutput {
 public:
  // Collective (open_lesson_run_on_ranks): empty when the run record may not be written, and then
  // every rank returns exit code 2.
  static std::optional<RankOutput> open(dist::Communicator& comm, const LessonOptions& options,
                                        const std::string& lesson_name, const std::string& lesson_number,
                                        const MoeConfig& config, std::vector<std::string> devices = {}) {
    RankOutput output(comm.rank() == 0, lesson_name, options);
    if (!open_lesson_run_on_ranks(comm, options, lesson_name, lesson_number, config, output.writer_,
                                  std::move(devices))) {
      return std::nullopt;
    }
    return output;
  }

  bool root() const { return root_; }
  RunWriter* writer() { return writer_ ? &*writer_ : nullptr; }  // rank 0's; null on the others

  void show(const Table& table) {
    if (root_) lessons::show(*writer_, table);
  }
  void say(const std::string& text) const {
    if (root_) std::cout << text;
  }
  // Rank 0 prints the verdict line and where the run record is; every rank returns the exit code.
  int finish(bool pass, const std::string& message) {
    if (root_) finish_lesson(*writer_, lesson_name_, options_, pass, message);
    return pass ? 0 : 1;
  }

 private:
  RankOutput(bool root, std::string lesson_name, LessonOptions options)
      : root_(root), lesson_name_(std::move(lesson_name)), options_(std::move(options)) {}
  bool root_ = false;
  std::string lesson_name_;
  LessonOptions options_;
  std::optional<RunWriter> writer_;
};

// ---- the lesson's entry ----

// The lesson's GPU path: given the world, its shard and the lesson's config, returns the exit code.
// Each lesson defines one; without CUDA it is no_gpu_path.
using GpuPath = std::function<int(dist::MpiCommunicator& world, const Shard& shard)>;
// The lesson's CPU path: its tables and verdict on CPU ranks, with rank 0's output open.
using CpuPath = std::function<int(dist::Communicator& comm, RankOutput& out, const Shard& shard)>;

// What a build without CUDA does on --gpu: rank 0 says why, and every rank returns 1.
inline int no_gpu_path(const dist::Communicator& world, const std::string& lesson_name) {
  if (world.rank() == 0) {
    std::cerr << lesson_name << " --gpu: this build has no CUDA (CMake found no CUDA compiler, or "
                                "MOE_ENABLE_CUDA=OFF); the CPU path runs without --gpu\n";
  }
  return 1;
}

// Everything a lesson on MPI ranks does after reading its command line: MPI up, the watchdog on
// every collective of the world and its communicators (--collective-timeout), this rank's shard
// (shard_tokens), then the GPU path on --gpu, else the CPU path with the run record open. An error
// on one rank of the GPU path ends every rank: the others would wait in the next collective.
// Returns the exit code.
inline int run_on_ranks(int argc, char** argv, const LessonOptions& options, const RankFlags& flags,
                        const std::string& lesson_name, const std::string& lesson_number, const MoeConfig& config,
                        const GpuPath& gpu_path, const CpuPath& cpu_path) {
  dist::MpiEnvironment mpi(argc, argv);
  dist::CollectiveWatchdog watchdog(mpi.world_rank(), mpi.world_size(),
                                    dist::collective_timeout(flags.collective_timeout_seconds));
  const auto world = dist::MpiCommunicator::world(&watchdog);
  const std::optional<Shard> shard = shard_tokens(*world, config, lesson_name);
  if (!shard) return 2;
  if (flags.gpu) {
    try {
      return gpu_path(*world, *shard);
    } catch (const std::exception& error) {
      std::cerr << "[rank " << world->rank() << "] " << lesson_name << " --gpu: " << error.what() << "\n";
      MPI_Abort(MPI_COMM_WORLD, 1);
      return 1;
    }
  }
  std::optional<RankOutput> out = RankOutput::open(*world, options, lesson_name, lesson_number, config);
  if (!out) return 2;
  return cpu_path(*world, *out, *shard);
}

}  // namespace moe::lessons
