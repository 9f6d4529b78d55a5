// offload/resident_experts.cpp: experts held on the GPU, the gpu_only source (see resident_experts.h).
#include "offload/resident_experts.h"

#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

namespace {

std::vector<int64_t> every_block(const PinnedExpertStore& store) {
  std::vector<int64_t> blocks(static_cast<size_t>(store.shape().blocks));
  std::iota(blocks.begin(), blocks.end(), int64_t{0});
  return blocks;
}

}  // namespace

ResidentExperts::ResidentExperts(const PinnedExpertStore& store) : ResidentExperts(store, every_block(store)) {}

ResidentExperts::ResidentExperts(const PinnedExpertStore& store, std::span<const int64_t> blocks)
    : shape_(store.shape()), held_(static_cast<size_t>(store.shape().blocks), -1) {
  if (blocks.empty()) throw std::invalid_argument("resident experts: no MoE block to hold; give at least one");
  for (const int64_t block : blocks) {
    if (block < 0 || block >= shape_.blocks) {
      throw std::invalid_argument("resident experts: MoE block " + std::to_string(block) + "; allowed: 0 to " +
                                  std::to_string(shape_.blocks - 1));
    }
    if (held_[static_cast<size_t>(block)] >= 0) {
      throw std::invalid_argument("resident experts: MoE block " + std::to_string(block) + " is listed twice");
    }
    held_[static_cast<size_t>(block)] = 0;
  }
  // Held blocks in ascending order, each one copy: a block's experts are contiguous in the store.
  // From pinned memory cudaMemcpy has finished when it returns.
  const int64_t experts = shape_.experts, elements = experts * shape_.expert_elements();
  weights_ = DeviceBuffer<bf16>(blocks.size() * static_cast<size_t>(elements));
  int64_t index = 0;
  for (int64_t block = 0; block < shape_.blocks; ++block) {
    if (held_[static_cast<size_t>(block)] < 0) continue;
    held_[static_cast<size_t>(block)] = index;
    CUDA_CHECK(cudaMemcpy(weights_.data() + index * elements, store.data() + block * elements,
                          static_cast<size_t>(elements) * sizeof(bf16), cudaMemcpyHostToDevice));
    ++index;
  }
  std::vector<const bf16*> tables(static_cast<size_t>(index * 2 * experts));
  for (int64_t block = 0; block < shape_.blocks; ++block) {
    const int64_t at = held_[static_cast<size_t>(block)];
    if (at < 0) continue;
    for (int32_t e = 0; e < experts; ++e) {
      const bf16* w1 = expert(block, e);
      tables[static_cast<size_t>((at * 2 + 0) * experts + e)] = w1;
      tables[static_cast<size_t>((at * 2 + 1) * experts + e)] = w1 + shape_.w1_elements();
    }
  }
  tables_ = DeviceBuffer<const bf16*>(tables);
  // The upload from pageable memory may still be in flight on the legacy stream, which a
  // non-blocking compute stream does not wait for: finish it here, once.
  CUDA_CHECK(cudaDeviceSynchronize());
}

bool ResidentExperts::resident(int64_t block) const {
  return block >= 0 && block < shape_.blocks && held_[static_cast<size_t>(block)] >= 0;
}

int64_t ResidentExperts::held_index(int64_t block) const {
  if (block < 0 || block >= shape_.blocks) {
    throw std::invalid_argument("resident experts: MoE block " + std::to_string(block) + " is outside [0, " +
                                std::to_string(shape_.blocks) + ")");
  }
  const int64_t at = held_[static_cast<size_t>(block)];
  if (at < 0) {
    throw std::invalid_argument("resident experts: MoE block " + std::to_string(block) +
                                " is not held on the GPU by this source");
  }
  return at;
}

const bf16* ResidentExperts::expert(int64_t block, int32_t expert) const {
  const int64_t at = held_index(block);
  if (expert < 0 || expert >= shape_.experts) {
    throw std::invalid_argument("resident experts: expert " + std::to_string(expert) + " is outside [0, E=" +
                                std::to_string(shape_.experts) + ")");
  }
  return weights_.data() + (at * shape_.experts + expert) * shape_.expert_elements();
}

ExpertTables ResidentExperts::acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) {
  (void)experts;
  (void)compute;
  const bf16* const* tables = tables_.data() + held_index(block) * 2 * shape_.experts;
  return ExpertTables{tables, tables + shape_.experts};
}

void ResidentExperts::release(int64_t block, cudaStream_t compute) {
  (void)compute;
  (void)held_index(block);
}

}  // namespace moe::cuda
