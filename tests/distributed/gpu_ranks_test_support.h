// gpu_ranks_test_support.h: whether the ranks of a multi-rank GPU test run, decided once for all of
// them, and the fixture that gives such a test its device communicator. Used by
// test_expert_parallel_gpu.cpp, test_expert_layouts_gpu.cpp and test_distributed_training.cpp, each
// built for the MPI backend (ranks may share a GPU) and for NCCL (one GPU per rank).
#pragma once

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"       // all_gather
#include "core/device_info.h"   // why_no_gpu
#include "mpi_test_support.h"   // world

// The NCCL build of a test defines MOE_TEST_NCCL_BACKEND=1 (tests/distributed/CMakeLists.txt).
#ifndef MOE_TEST_NCCL_BACKEND
#define MOE_TEST_NCCL_BACKEND 0
#endif
#if MOE_TEST_NCCL_BACKEND
#include "comm/nccl_communicator.h"  // NcclCommunicator
#endif

namespace moe::dist::testing {

inline constexpr bool kNcclBackend = MOE_TEST_NCCL_BACKEND != 0;

// Why the GPU tests cannot run on these ranks, or "" when they can: no GPU on a rank, or, with
// one_gpu_per_rank (NCCL refuses two ranks on one GPU), fewer GPUs than ranks. Every rank skips or
// none does (a rank that ran on while another skipped would wait forever in its first collective),
// and a skipping rank says so on stdout ("SKIPPED the GPU tests: ..."), before the final
// "PASS ranks=" line: CTest's skip expression asks for both. When the tests run, each rank takes GPU
// rank % GPUs. Collective.
inline std::string gpu_ranks_skip_reason(bool one_gpu_per_rank) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    (void)cudaGetLastError();
    devices = 0;
  }
  const int R = world().size(), rank = world().rank();
  std::string reason;
  if (devices == 0) {
    reason = cuda::why_no_gpu();
  } else if (one_gpu_per_rank && devices < R) {
    reason = "the NCCL backend needs one GPU per rank (NCCL refuses two ranks on one GPU): " +
             std::to_string(devices) + " GPU(s) for " + std::to_string(R) + " ranks";
  }
  const std::vector<int64_t> skips = all_gather<int64_t>(world(), reason.empty() ? 0 : 1);
  if (reason.empty() && std::count(skips.begin(), skips.end(), 1) > 0) reason = "another rank has no usable GPU";
  if (!reason.empty()) {
    std::printf("[rank %d] SKIPPED the GPU tests: %s\n", rank, reason.c_str());
    std::fflush(stdout);
    return reason;
  }
  cudaSetDevice(rank % devices);
  return reason;
}

// A test suite whose ranks run on GPUs: it skips, with the reason, on every rank unless every rank
// has its GPU (gpu_ranks_skip_reason, once for the suite), and gives the tests the communicator of
// the device data: NCCL over device buffers in the NCCL build, the MPI world over host buffers in
// the MPI build. Suite: the deriving fixture, so that each suite holds its own communicator.
template <class Suite>
class GpuRanksTest : public ::testing::Test {
 public:
  static Communicator& device_communicator() { return *state().device; }

 protected:
  static void SetUpTestSuite() {
    State& s = state();
#if !MOE_TEST_NCCL_BACKEND
    s.device = &world();  // host buffers: there even without a GPU, for tests that need none
#endif
    s.skip_reason = gpu_ranks_skip_reason(/*one_gpu_per_rank=*/kNcclBackend);
    if (!s.skip_reason.empty()) return;
#if MOE_TEST_NCCL_BACKEND
    s.nccl = std::make_unique<NcclCommunicator>(world(), /*stream=*/nullptr);
    s.device = s.nccl.get();
#else
    s.device = &world();
#endif
  }
  static void TearDownTestSuite() { state() = State{}; }
  void SetUp() override {
    if (skipped()) GTEST_SKIP() << skip_reason();
  }
  static bool skipped() { return !state().skip_reason.empty(); }
  static const std::string& skip_reason() { return state().skip_reason; }

 private:
  struct State {
    std::string skip_reason;
    std::unique_ptr<Communicator> nccl;  // the NCCL build's communicator
    Communicator* device = nullptr;
  };
  static State& state() {
    static State s;
    return s;
  }
};

}  // namespace moe::dist::testing
