// distributed_lesson_support.h: what the lessons on MPI ranks share (06 expert parallelism, 07 Tutel):
// opening the run record on rank 0 once every rank agrees that it may be written, and the flags of
// their GPU path (--gpu, --backend; the path itself is distributed_lesson_gpu.h, built with CUDA).
// Header-only and apart from lesson_support.h, because only the lessons built with MPI have a
// communicator.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "command_line.h"          // CLI::App, one_of
#include "comm/communicator.h"    // Communicator, broadcast
#include "lesson_support.h"  // LessonOptions, lesson_run_refused, create_lesson_run

namespace moe::lessons {

// ---- the GPU path's flags, for parse_options' `own_flags` (lesson_support.h) ----

struct GpuFlags {
  bool gpu = false;              // --gpu
  std::string backend = "auto";  // --backend auto|nccl|mpi
};

// Declares --gpu and --backend on a lesson's command line (parse_options' `own_flags`).
inline void add_gpu_flags(CLI::App& app, GpuFlags& flags) {
  app.add_flag("--gpu", flags.gpu,
               "run the lesson's layer on GPU ranks (distributed/expert_parallel_gpu.h) and check it against the CPU "
               "reference, instead of the CPU ranks' tables");
  app.add_option("--backend", flags.backend, "with --gpu: auto (NCCL where each rank has its own GPU, else MPI), nccl, mpi")
      ->capture_default_str()
      ->check(one_of({"auto", "nccl", "mpi"}));
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

}  // namespace moe::lessons
