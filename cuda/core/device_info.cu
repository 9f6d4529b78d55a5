// device_info.cu: see device_info.h.
#include "core/device_info.h"

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

int gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return 0;
  }
  return count;
}

std::string why_no_gpu() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no usable GPU: ") + cudaGetErrorString(status);
  }
  return count > 0 ? std::string() : std::string("no GPU on this machine");
}

DeviceInfo current_device() {
  DeviceInfo info;
  CUDA_CHECK(cudaGetDevice(&info.index));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, info.index));
  info.name = prop.name;
  info.compute_capability = prop.major * 10 + prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.global_memory_bytes = prop.totalGlobalMem;
  info.l2_cache_bytes = static_cast<size_t>(prop.l2CacheSize);
  return info;
}

}  // namespace moe::cuda
