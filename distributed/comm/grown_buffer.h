// grown_buffer.h: memory grown on demand and never shrunk: the staging and scratch buffers of the
// collectives over device buffers (device_exchange.cpp, device_all_to_all_2dh.cpp). A call reuses
// what an earlier one left when it is large enough, so the steps after the first allocate nothing
// (cudaMalloc and cudaFree may wait for the device). Nothing is allocated before the first reserve,
// so an owner that never moves device data touches no CUDA API.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moe::dist {

class GrownBuffer {
 public:
  enum class Memory {
    device,       // cudaMalloc / cudaFree
    pinned_host,  // cudaHostAlloc / cudaFreeHost: what a device copy to or from the host can use directly
  };

  // `owner` starts the message of a failed CUDA call ("DeviceExchange: cudaMalloc failed: ...").
  // Sizes are rounded up to whole units of `unit` bytes.
  GrownBuffer(Memory memory, std::string_view owner, size_t unit = 1);
  ~GrownBuffer();
  GrownBuffer(const GrownBuffer&) = delete;
  GrownBuffer& operator=(const GrownBuffer&) = delete;

  // At least `bytes` (and at least one unit: never a null pointer, even for an empty call): the
  // memory held when it is large enough, else a new allocation after freeing the old (its contents
  // are not kept). Throws std::runtime_error when CUDA fails.
  char* reserve(size_t bytes);

 private:
  Memory memory_;
  std::string owner_;
  size_t unit_;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace moe::dist
