// grown_buffer.cpp: device or pinned host memory grown on demand (see grown_buffer.h).
#include "comm/grown_buffer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moe::dist {

namespace {

void check(cudaError_t result, const std::string& owner, const char* call) {
  if (result == cudaSuccess) return;
  throw std::runtime_error(owner + ": " + call + " failed: " + cudaGetErrorString(result));
}

}  // namespace

GrownBuffer::GrownBuffer(Memory memory, std::string_view owner, size_t unit)
    : memory_(memory), owner_(owner), unit_(std::max<size_t>(unit, 1)) {}

GrownBuffer::~GrownBuffer() {
  if (data_ == nullptr) return;
  if (memory_ == Memory::device) cudaFree(data_);
  else cudaFreeHost(data_);
}

char* GrownBuffer::reserve(size_t bytes) {
  const size_t units = std::max<size_t>((bytes + unit_ - 1) / unit_, 1);
  const size_t wanted = units * unit_;
  if (wanted > capacity_) {
    if (data_ != nullptr) {
      if (memory_ == Memory::device) check(cudaFree(data_), owner_, "cudaFree");
      else check(cudaFreeHost(data_), owner_, "cudaFreeHost");
    }
    data_ = nullptr;
    capacity_ = 0;
    if (memory_ == Memory::device) check(cudaMalloc(&data_, wanted), owner_, "cudaMalloc");
    else check(cudaHostAlloc(&data_, wanted, cudaHostAllocDefault), owner_, "cudaHostAlloc");
    capacity_ = wanted;
  }
  return static_cast<char*>(data_);
}

}  // namespace moe::dist
