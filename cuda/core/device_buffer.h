// device_buffer.h: DeviceBuffer<T>, an owning array in GPU memory (plain cudaMalloc), with copies
// to and from host vectors. Every GPU program and test of the project holds its tensors in these.
// device_buffer_allocations() counts the buffers this process has allocated, so that a test of
// "rejected before allocating anything" counts its own process's allocations (the device's free
// memory, cudaMemGetInfo, changes with whatever else runs on the GPU). set_device_buffer_fill() lets
// a test give every new buffer a known content, so that a result which changes with it shows a read
// of memory that was never written.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

namespace detail {
inline std::atomic<int64_t> device_buffer_allocations{0};
inline std::atomic<int> device_buffer_fill{-1};
}  // namespace detail

// How many DeviceBuffer allocations (cudaMalloc calls) this process has made so far.
inline int64_t device_buffer_allocations() { return detail::device_buffer_allocations.load(); }

// For tests: every DeviceBuffer allocated from now on starts with each byte equal to `byte` (0..255),
// or, with -1 (the default), with whatever cudaMalloc's memory held: zeros in a fresh process, the
// last owner's data after a free. Process-wide.
inline void set_device_buffer_fill(int byte) { detail::device_buffer_fill = byte; }

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) {
      CUDA_CHECK(cudaMalloc(&data_, count_ * sizeof(T)));
      ++detail::device_buffer_allocations;
      if (const int fill = detail::device_buffer_fill.load(); fill >= 0) fill_bytes(fill);
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  // upload, download and fill_bytes without a stream have completed when they return, so work on
  // any stream enqueued afterwards sees their bytes. This has to be explicit: the streams the
  // programs compute on are non-blocking (they never wait for the default stream), a cudaMemcpy
  // from pageable memory returns once the bytes are staged, before they reach the GPU, and a
  // cudaMemset of device memory returns before it runs. A kernel on another stream could read
  // some of the old bytes: a model's first step would then sometimes see part of its initial
  // weights missing. Download reads what the stream that wrote the buffer has finished: the caller
  // synchronises that stream first.
  void upload(const std::vector<T>& host) {
    if (host.size() != count_) throw CudaError("DeviceBuffer::upload: size mismatch");
    if (count_ == 0) return;
    CUDA_CHECK(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte` (0xFF poisons floats with NaN and ints with -1 before a test):
  // done when it returns, or, given a stream, ordered in that stream.
  void fill_bytes(int byte) {
    if (count_ == 0) return;
    CUDA_CHECK(cudaMemset(data_, byte, bytes()));
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  void fill_bytes(int byte, cudaStream_t stream) {
    if (count_ > 0) CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }

 private:
  void release() {
    if (data_ != nullptr) cudaFree(data_);  // no throw from a destructor
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace moe::cuda
