// phase_timer.cu: see phase_timer.h.
#include "core/phase_timer.h"

#include <nvtx3/nvToolsExt.h>  // nvtxRangePushA, nvtxRangePop (header-only NVTX 3)

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

void PhaseTimer::name_stream(cudaStream_t stream, std::string name) {
  for (auto& [named, label] : stream_names_) {
    if (named == stream) {
      label = std::move(name);
      return;
    }
  }
  stream_names_.emplace_back(stream, std::move(name));
}

PhaseTimer::~PhaseTimer() {
  for (auto& phase : pending_) {
    cudaEventDestroy(phase.start);
    cudaEventDestroy(phase.stop);
  }
}

void PhaseTimer::begin(const char* name, cudaStream_t stream) {
  nvtxRangePushA(name);
  int stream_index = 0;
  while (stream_index < int(streams_.size()) && streams_[size_t(stream_index)] != stream) ++stream_index;
  if (stream_index == int(streams_.size())) streams_.push_back(stream);
  Pending phase{name, nullptr, nullptr, int(open_.size()), stream_index};
  CUDA_CHECK(cudaEventCreate(&phase.start));
  CUDA_CHECK(cudaEventCreate(&phase.stop));
  CUDA_CHECK(cudaEventRecord(phase.start, stream));
  open_.push_back(pending_.size());
  pending_.push_back(phase);
}

void PhaseTimer::end(cudaStream_t stream) {
  if (open_.empty()) throw CudaError("PhaseTimer::end without a matching begin");
  CUDA_CHECK(cudaEventRecord(pending_[open_.back()].stop, stream));  // the innermost open phase
  open_.pop_back();
  nvtxRangePop();
}

std::vector<TimedPhase> PhaseTimer::collect() {
  std::vector<TimedPhase> phases;
  if (!open_.empty()) {
    throw CudaError("PhaseTimer::collect while phase " + pending_[open_.back()].name + " is still open");
  }
  for (auto& phase : pending_) {
    CUDA_CHECK(cudaEventSynchronize(phase.stop));
    float start_ms = 0, duration_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&start_ms, pending_.front().start, phase.start));
    CUDA_CHECK(cudaEventElapsedTime(&duration_ms, phase.start, phase.stop));
    std::string stream_name;
    for (const auto& [named, label] : stream_names_) {
      if (named == streams_[size_t(phase.stream)]) stream_name = label;
    }
    phases.push_back({phase.name, 1000.0 * start_ms, 1000.0 * duration_ms, phase.depth, phase.stream, stream_name});
  }
  for (auto& phase : pending_) {
    cudaEventDestroy(phase.start);
    cudaEventDestroy(phase.stop);
  }
  pending_.clear();
  streams_.clear();
  return phases;
}

}  // namespace moe::cuda
