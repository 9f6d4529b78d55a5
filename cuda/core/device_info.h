// device_info.h: which GPUs this process can use, asked without failing where there are none.
//
// Programs print the device they ran on into their run records, and GPU tests call gpu_available()
// to skip (with the reason) on machines without a GPU, such as CI.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

namespace moe::cuda {

struct DeviceInfo {
  int index = -1;
  std::string name;             // e.g. "NVIDIA H200"
  int compute_capability = 0;   // 90 for Hopper
  int multiprocessors = 0;      // SMs
  size_t global_memory_bytes = 0;
  size_t l2_cache_bytes = 0;
};

// Number of usable GPUs; 0 (never an exception) when there is no driver or no device.
int gpu_count();

// Empty when a GPU is present; otherwise the runtime's reason, for GTEST_SKIP and messages.
std::string why_no_gpu();

inline bool gpu_available() { return gpu_count() > 0; }

// A GPU benchmark's first check: without a GPU it prints the benchmark's verdict line, FAIL and
// why there is none, and gives the exit status 1; with one, nothing.
inline std::optional<int> fail_without_gpu() {
  if (gpu_available()) return std::nullopt;
  std::printf("FAIL no GPU: %s\n", why_no_gpu().c_str());
  return 1;
}

// Properties of the current device. Throws CudaError when there is none.
DeviceInfo current_device();

}  // namespace moe::cuda
