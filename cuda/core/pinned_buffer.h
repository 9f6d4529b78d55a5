// core/pinned_buffer.h: PinnedBuffer<T>, an array in page-locked host memory (cudaHostAlloc), the
// source or target of asynchronous copies that must not stage through pageable memory: the
// decoder's host experts read their rows from it and write their outputs into it
// (infer/inference_model.cu). Move-only, like DeviceBuffer.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t count) : count_(count) {
    if (count_ > 0) CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&data_), count_ * sizeof(T), cudaHostAllocDefault));
  }
  ~PinnedBuffer() {
    if (data_ != nullptr) cudaFreeHost(data_);  // no throw from a destructor
  }
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  T& operator[](size_t i) { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace moe::cuda
