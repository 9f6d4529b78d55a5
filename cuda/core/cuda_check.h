// cuda_check.h: error checking for CUDA runtime and cuBLAS calls.
//
// Every CUDA call's return code is checked, and every kernel launch is followed by
// CUDA_CHECK(cudaGetLastError()): an exit code of 0 proves nothing on a GPU. Failures throw
// moe::cuda::CudaError with the file, line, call and the runtime's own message, so a test or a
// program reports them instead of continuing on garbage.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe::cuda {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) {
    throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " +
                    cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
}

}  // namespace moe::cuda

#define CUDA_CHECK(call) ::moe::cuda::check_cuda((call), #call, __FILE__, __LINE__)
