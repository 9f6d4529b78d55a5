// distributed_lesson_support.h: what the lessons on MPI ranks share (06 expert parallelism, 07 Tutel):
// opening the run record on rank 0 once every rank agrees that it may be written. Header-only and
// apart from lesson_support.h, because only the lessons built with MPI have a communicator.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "communicator.h"    // Communicator, broadcast
#include "lesson_support.h"  // LessonOptions, lesson_run_refused, create_lesson_run

namespace moe::lessons {

// Collective. Rank 0 looks whether the run record may be written and tells the others, so that the
// ranks stop together: false means every rank should return exit code 2 (the message is on rank 0's
// stderr). Otherwise rank 0 creates the record in `writer` (world_size R, one device name per rank)
// and the other ranks leave `writer` empty.
inline bool open_lesson_run_on_ranks(dist::Communicator& comm, const LessonOptions& options,
                                     const std::string& lesson_name, const std::string& lesson_number,
                                     const MoeConfig& config, std::optional<RunWriter>& writer) {
  const int R = comm.size();
  const bool root = comm.rank() == 0;
  int32_t refused = root && lesson_run_refused(options, lesson_name) ? 1 : 0;
  dist::broadcast<int32_t>(comm, std::span<int32_t>(&refused, 1), 0);
  if (refused) return false;
  if (root) {
    std::vector<std::string> devices;
    for (int r = 0; r < R; ++r) devices.push_back("CPU rank " + std::to_string(r) + " (moe::ref, double, MPI)");
    writer.emplace(create_lesson_run(options, lesson_name, lesson_number, config, devices, R));
  }
  return true;
}

}  // namespace moe::lessons
