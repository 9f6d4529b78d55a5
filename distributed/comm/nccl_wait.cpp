// nccl_wait.cpp: the host's wait for NCCL work, polling the stream and NCCL's asynchronous error
// under the watchdog (see nccl_wait.h).
#include "comm/nccl_wait.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace moe::dist {

namespace {

// A peer's failure as NCCL reports it, or an empty string while there is none.
std::string asynchronous_error(ncclComm_t communicator) {
  if (communicator == nullptr) return {};
  ncclResult_t state = ncclSuccess;
  const ncclResult_t queried = ncclCommGetAsyncError(communicator, &state);
  if (queried != ncclSuccess) state = queried;
  if (state == ncclSuccess || state == ncclInProgress) return {};
  std::string text = std::string("saw NCCL's asynchronous error '") + ncclGetErrorString(state) + "'";
  const char* detail = ncclGetLastError(communicator);
  if (detail != nullptr && *detail != '\0') text += std::string(" (") + detail + ")";
  return text + ": a peer rank has died or its connection has closed";
}

// query(): cudaSuccess once done, cudaErrorNotReady while running, anything else an error.
template <typename Query>
void poll_until_done(Query query, std::string_view what, ncclComm_t communicator, CollectiveWatchdog* watchdog) {
  cudaError_t state = query();
  if (state == cudaSuccess) return;  // already done: nothing to arm
  const auto armed = arm(watchdog, what);
  constexpr int kSpinningPolls = 2000;  // about the first 100 us on a modern host
  for (int poll = 0; state == cudaErrorNotReady; ++poll) {
    const std::string failure = asynchronous_error(communicator);
    if (!failure.empty()) {
      if (watchdog != nullptr) watchdog->fail(what, failure);
      throw std::runtime_error(std::string(what) + " " + failure);
    }
    if (poll < kSpinningPolls) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    state = query();
  }
  if (state != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": waiting on the GPU failed: " + cudaGetErrorString(state));
  }
}

}  // namespace

void wait_for(cudaStream_t stream, std::string_view what, ncclComm_t communicator, CollectiveWatchdog* watchdog) {
  poll_until_done([stream] { return cudaStreamQuery(stream); }, what, communicator, watchdog);
}

void wait_for(cudaEvent_t event, std::string_view what, ncclComm_t communicator, CollectiveWatchdog* watchdog) {
  poll_until_done([event] { return cudaEventQuery(event); }, what, communicator, watchdog);
}

}  // namespace moe::dist
