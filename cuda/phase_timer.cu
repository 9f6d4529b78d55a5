// phase_timer.cu: see phase_timer.h.
#include "phase_timer.h"

#include <nvtx3/nvToolsExt.h>  // nvtxRangePushA, nvtxRangePop (header-only NVTX 3)

#include "cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

PhaseTimer::~PhaseTimer() {
  for (auto& phase : pending_) {
    cudaEventDestroy(phase.start);
    cudaEventDestroy(phase.stop);
  }
}

void PhaseTimer::begin(const char* name, cudaStream_t stream) {
  nvtxRangePushA(name);
  if (!pending_.empty() && pending_.back().open) {
    throw CudaError("PhaseTimer::begin(" + std::string(name) + ") while phase " + pending_.back().name +
                    " is still open: phases do not nest");
  }
  Pending phase{name, nullptr, nullptr, true};
  CUDA_CHECK(cudaEventCreate(&phase.start));
  CUDA_CHECK(cudaEventCreate(&phase.stop));
  CUDA_CHECK(cudaEventRecord(phase.start, stream));
  pending_.push_back(phase);
}

void PhaseTimer::end(cudaStream_t stream) {
  if (pending_.empty() || !pending_.back().open) {
    throw CudaError("PhaseTimer::end without a matching begin");
  }
  CUDA_CHECK(cudaEventRecord(pending_.back().stop, stream));
  pending_.back().open = false;
  nvtxRangePop();
}

std::vector<TimedPhase> PhaseTimer::collect() {
  std::vector<TimedPhase> phases;
  if (!pending_.empty() && pending_.back().open) {
    throw CudaError("PhaseTimer::collect while phase " + pending_.back().name + " is still open");
  }
  for (auto& phase : pending_) {
    CUDA_CHECK(cudaEventSynchronize(phase.stop));
    float start_ms = 0, duration_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&start_ms, pending_.front().start, phase.start));
    CUDA_CHECK(cudaEventElapsedTime(&duration_ms, phase.start, phase.stop));
    phases.push_back({phase.name, 1000.0 * start_ms, 1000.0 * duration_ms});
  }
  for (auto& phase : pending_) {
    cudaEventDestroy(phase.start);
    cudaEventDestroy(phase.stop);
  }
  pending_.clear();
  return phases;
}

}  // namespace moe::cuda
