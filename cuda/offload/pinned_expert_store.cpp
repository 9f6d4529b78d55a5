// offload/pinned_expert_store.cpp: expert weights in pinned host memory (see pinned_expert_store.h).
#include "offload/pinned_expert_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace moe::cuda {

void validate(const ExpertShape& shape) {
  if (shape.blocks <= 0 || shape.experts <= 0 || shape.d_model <= 0 || shape.hidden <= 0) {
    throw std::invalid_argument("ExpertShape: blocks, E, D and H must be > 0, got blocks=" +
                                std::to_string(shape.blocks) + " E=" + std::to_string(shape.experts) +
                                " D=" + std::to_string(shape.d_model) + " H=" + std::to_string(shape.hidden));
  }
  if (shape.w1_columns != 0 && shape.w1_columns != shape.hidden && shape.w1_columns != 2 * shape.hidden) {
    throw std::invalid_argument("ExpertShape: w1_columns must be 0 (H), H or 2H, got " +
                                std::to_string(shape.w1_columns) + " with H=" + std::to_string(shape.hidden));
  }
}

size_t host_memory_available() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t kilobytes = 0;
  std::string unit;
  while (meminfo >> key >> kilobytes >> unit) {
    if (key == "MemAvailable:") return kilobytes * 1024;
  }
  return 0;
}

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  return text;
}

void check_pinned_request(size_t bytes, size_t available, double max_fraction) {
  if (available == 0) return;  // unknown: let the pin itself fail with its message
  if (static_cast<double>(bytes) <= max_fraction * static_cast<double>(available)) return;
  char fraction[16];
  std::snprintf(fraction, sizeof fraction, "%.0f%%", max_fraction * 100.0);
  throw std::runtime_error(
      "pinned expert store: " + gigabytes(static_cast<double>(bytes)) + " of pinned host memory asked, more than " +
      fraction + " of the " + gigabytes(static_cast<double>(available)) +
      " this machine has available (MemAvailable, /proc/meminfo); pinned pages cannot be swapped out, so the rest "
      "of the machine would starve. Use fewer MoE blocks or experts, or a machine with more memory.");
}

// ---- PinnedExpertStore ----

PinnedExpertStore::PinnedExpertStore(const ExpertShape& shape) : shape_(shape) {
  validate(shape_);
  const size_t bytes = shape_.total_bytes();
  const size_t available = host_memory_available();
  check_pinned_request(bytes, available);
  const cudaError_t status = cudaHostAlloc(reinterpret_cast<void**>(&data_), bytes, cudaHostAllocDefault);
  if (status != cudaSuccess) {
    data_ = nullptr;
    (void)cudaGetLastError();  // a failed pin is not sticky: clear it, so no later check reports it
    throw std::runtime_error(
        "pinned expert store: could not pin " + gigabytes(static_cast<double>(bytes)) + " of host memory (" +
        std::to_string(shape_.blocks) + " blocks x " + std::to_string(shape_.experts) + " experts x " +
        gigabytes(static_cast<double>(shape_.expert_bytes())) + "): cudaHostAlloc failed with " +
        cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + "); this machine has " +
        (available > 0 ? gigabytes(static_cast<double>(available)) : std::string("an unknown amount")) +
        " available (MemAvailable, /proc/meminfo)");
  }
}

PinnedExpertStore PinnedExpertStore::random(const ExpertShape& shape, uint64_t seed) {
  PinnedExpertStore store(shape);
  store.fill_random(seed);
  return store;
}

PinnedExpertStore::PinnedExpertStore(PinnedExpertStore&& other) noexcept
    : shape_(other.shape_), data_(std::exchange(other.data_, nullptr)) {}

PinnedExpertStore& PinnedExpertStore::operator=(PinnedExpertStore&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    shape_ = other.shape_;
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

PinnedExpertStore::~PinnedExpertStore() {
  if (data_ != nullptr) cudaFreeHost(data_);  // no throw from a destructor
}

const bf16* PinnedExpertStore::expert(int64_t block, int32_t expert) const {
  if (block < 0 || block >= shape_.blocks || expert < 0 || expert >= shape_.experts) {
    throw std::invalid_argument("pinned expert store: (block " + std::to_string(block) + ", expert " +
                                std::to_string(expert) + ") is outside " + std::to_string(shape_.blocks) +
                                " blocks x " + std::to_string(shape_.experts) + " experts");
  }
  return data_ + (block * shape_.experts + expert) * shape_.expert_elements();
}

bf16* PinnedExpertStore::mutable_expert(int64_t block, int32_t expert) {
  return const_cast<bf16*>(std::as_const(*this).expert(block, expert));
}

void PinnedExpertStore::set_expert(int64_t block, int32_t expert, std::span<const bf16> w1,
                                   std::span<const bf16> w2) {
  bf16* destination = mutable_expert(block, expert);
  if (static_cast<int64_t>(w1.size()) != shape_.w1_elements() ||
      static_cast<int64_t>(w2.size()) != shape_.w2_elements()) {
    throw std::invalid_argument("pinned expert store: set_expert wants w1 [D, W1] = " +
                                std::to_string(shape_.w1_elements()) + " and w2 [H, D] = " +
                                std::to_string(shape_.w2_elements()) + " values, got " +
                                std::to_string(w1.size()) + " and " + std::to_string(w2.size()));
  }
  std::copy(w1.begin(), w1.end(), destination);
  std::copy(w2.begin(), w2.end(), destination + shape_.w1_elements());
}

void PinnedExpertStore::set_block(int64_t block, std::span<const bf16> w1, std::span<const bf16> w2) {
  const int64_t experts = shape_.experts;
  if (static_cast<int64_t>(w1.size()) != experts * shape_.w1_elements() ||
      static_cast<int64_t>(w2.size()) != experts * shape_.w2_elements()) {
    throw std::invalid_argument("pinned expert store: set_block wants w1 [E, D, W1] = " +
                                std::to_string(experts * shape_.w1_elements()) + " and w2 [E, H, D] = " +
                                std::to_string(experts * shape_.w2_elements()) + " values, got " +
                                std::to_string(w1.size()) + " and " + std::to_string(w2.size()));
  }
  for (int32_t e = 0; e < experts; ++e) {
    set_expert(block, e, w1.subspan(static_cast<size_t>(e * shape_.w1_elements()), static_cast<size_t>(shape_.w1_elements())),
               w2.subspan(static_cast<size_t>(e * shape_.w2_elements()), static_cast<size_t>(shape_.w2_elements())));
  }
}

namespace {

// splitmix64: a counter-based generator, one independent stream per (seed, block, expert, matrix),
// so the bytes do not depend on how the experts are split among threads.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale), two values (24 random bits each) per 64-bit word.
void fill_uniform(bf16* out, int64_t count, uint64_t stream, float scale) {
  uint64_t state = stream;
  constexpr float to_unit = 1.0f / 16777216.0f;  // 2^-24
  for (int64_t i = 0; i < count; i += 2) {
    const uint64_t word = splitmix64(state);
    out[i] = __float2bfloat16((static_cast<float>(word >> 40) * to_unit * 2.0f - 1.0f) * scale);
    if (i + 1 < count) {
      out[i + 1] = __float2bfloat16((static_cast<float>((word >> 16) & 0xFFFFFF) * to_unit * 2.0f - 1.0f) * scale);
    }
  }
}

}  // namespace

void PinnedExpertStore::fill_random(uint64_t seed) {
  const int64_t total = shape_.blocks * shape_.experts;
  const float w1_scale = 1.0f / std::sqrt(static_cast<float>(shape_.d_model));
  const float w2_scale = 1.0f / std::sqrt(static_cast<float>(shape_.hidden));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t index = next++; index < total; index = next++) {
      bf16* expert = data_ + index * shape_.expert_elements();
      uint64_t mix = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(index + 1));
      const uint64_t stream = splitmix64(mix);
      fill_uniform(expert, shape_.w1_elements(), stream, w1_scale);
      fill_uniform(expert + shape_.w1_elements(), shape_.w2_elements(), stream ^ 0x5851F42D4C957F2Dull, w2_scale);
    }
  };
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, total);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(work);
  work();
  for (std::thread& worker : workers) worker.join();
}

}  // namespace moe::cuda
