// offload/pinned_expert_store.h: every MoE block's expert weights in pinned (page-locked) host
// memory, the source every expert copy of the offload engine reads.
//
// Pre-gated MoE (Hwang et al., ISCA 2024) keeps the experts, most of an MoE model's parameters, in
// CPU memory and copies the ones a block needs over PCIe. Pinned memory is what lets such a copy run
// asynchronously at the link's full rate (55 GB/s host-to-device on an H200, against 14 GB/s from
// pageable memory: notebooks_data/bench/README.md, "Anchor figures and ceilings"): the copy engine reads it directly, with no staging through
// a driver buffer and no host thread involved.
//
// Layout: block-major, then expert, and one expert's w1 [D, W1] then w2 [H, D] back to back, so one
// expert is one contiguous copy of expert_bytes() = 2 * (D*W1 + H*D) bytes (4*D*H for a GeLU FFN,
// W1 = H: 9.4 MB at D=768, H=3072; 235 MB at D=4096, H=14336).
//
// Fill it from the model's weights (set_block: the stacked [E, D, W1] / [E, H, D] tensors of a
// safetensors file, converted to bf16) or with random weights from a seed (the system-scale
// configurations, whose figures do not depend on the values).
//
// Pinned pages cannot be swapped out, so asking for too many starves the machine: the constructor
// refuses more than 75% of the memory /proc/meminfo calls available, and a failed pin names the size
// asked and what the machine has.
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns (H for GeLU, 2H for
// SwiGLU), E experts per MoE block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

struct ExpertShape {
  int64_t blocks = 0;      // MoE blocks, numbered 0..blocks-1 (the model's blocks that have experts)
  int64_t experts = 0;     // E per block
  int64_t d_model = 0;     // D
  int64_t hidden = 0;      // H
  int64_t w1_columns = 0;  // W1: 0 means H (GeLU); 2H for SwiGLU (gate columns, then up)

  int64_t w1_width() const { return w1_columns > 0 ? w1_columns : hidden; }
  int64_t w1_elements() const { return d_model * w1_width(); }  // [D, W1]
  int64_t w2_elements() const { return hidden * d_model; }      // [H, D]
  int64_t expert_elements() const { return w1_elements() + w2_elements(); }
  size_t expert_bytes() const { return static_cast<size_t>(expert_elements()) * sizeof(bf16); }
  size_t total_bytes() const { return expert_bytes() * static_cast<size_t>(blocks * experts); }
};

// Throws std::invalid_argument unless every size is positive (and W1 is 0, H or 2H).
void validate(const ExpertShape& shape);

// MemAvailable of /proc/meminfo in bytes; 0 where it cannot be read.
size_t host_memory_available();

// Throws std::runtime_error, with both sizes, when `bytes` is more than `max_fraction` of
// `available` (no check when `available` is 0: unknown).
void check_pinned_request(size_t bytes, size_t available, double max_fraction = 0.75);

// "7.21 GB": sizes in messages and tables (10^9 bytes).
std::string gigabytes(double bytes);

class PinnedExpertStore {
 public:
  // Pins shape.total_bytes() of host memory, unfilled: fill it with set_block / set_expert or
  // fill_random before the first copy. Throws std::runtime_error when the request is too large or
  // the pin fails (both messages give the size and what the machine has).
  explicit PinnedExpertStore(const ExpertShape& shape);
  // Random weights, uniform as the CPU reference initialises them (w1 in +-1/sqrt(D), w2 in
  // +-1/sqrt(H)): the same seed gives the same bytes with any number of threads.
  static PinnedExpertStore random(const ExpertShape& shape, uint64_t seed);

  PinnedExpertStore(PinnedExpertStore&& other) noexcept;
  PinnedExpertStore& operator=(PinnedExpertStore&& other) noexcept;
  PinnedExpertStore(const PinnedExpertStore&) = delete;
  PinnedExpertStore& operator=(const PinnedExpertStore&) = delete;
  ~PinnedExpertStore();

  // One expert's weights from host arrays: w1 [D, W1], w2 [H, D], row-major.
  void set_expert(int64_t block, int32_t expert, std::span<const bf16> w1, std::span<const bf16> w2);
  // One MoE block's experts, stacked as in the safetensors file: w1 [E, D, W1], w2 [E, H, D].
  void set_block(int64_t block, std::span<const bf16> w1, std::span<const bf16> w2);
  // Every expert random from `seed` (see random()); one thread per core.
  void fill_random(uint64_t seed);

  const ExpertShape& shape() const { return shape_; }
  size_t bytes() const { return shape_.total_bytes(); }
  size_t expert_bytes() const { return shape_.expert_bytes(); }

  // One expert: [D*W1 + H*D] elements, w1 [D, W1] then w2 [H, D]. Pinned host memory.
  const bf16* expert(int64_t block, int32_t expert) const;
  const bf16* data() const { return data_; }  // [blocks, E, D*W1 + H*D]

 private:
  bf16* mutable_expert(int64_t block, int32_t expert);

  ExpertShape shape_;
  bf16* data_ = nullptr;  // cudaHostAlloc
};

}  // namespace moe::cuda
