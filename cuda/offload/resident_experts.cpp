// offload/resident_experts.cpp: every expert on the GPU, the gpu_only source (see resident_experts.h).
#include "offload/resident_experts.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

ResidentExperts::ResidentExperts(const PinnedExpertStore& store)
    : shape_(store.shape()), weights_(store.bytes() / sizeof(bf16)) {
  // One copy: the device layout is the store's. From pinned memory cudaMemcpy has finished when it
  // returns.
  CUDA_CHECK(cudaMemcpy(weights_.data(), store.data(), store.bytes(), cudaMemcpyHostToDevice));
  const int64_t experts = shape_.experts;
  std::vector<const bf16*> tables(static_cast<size_t>(shape_.blocks * 2 * experts));
  for (int64_t block = 0; block < shape_.blocks; ++block) {
    for (int32_t e = 0; e < experts; ++e) {
      const bf16* w1 = expert(block, e);
      tables[static_cast<size_t>((block * 2 + 0) * experts + e)] = w1;
      tables[static_cast<size_t>((block * 2 + 1) * experts + e)] = w1 + shape_.w1_elements();
    }
  }
  tables_ = DeviceBuffer<const bf16*>(tables);
  // The upload from pageable memory may still be in flight on the legacy stream, which a
  // non-blocking compute stream does not wait for: finish it here, once.
  CUDA_CHECK(cudaDeviceSynchronize());
}

void ResidentExperts::check_block(int64_t block) const {
  if (block < 0 || block >= shape_.blocks) {
    throw std::invalid_argument("resident experts: MoE block " + std::to_string(block) + " is outside [0, " +
                                std::to_string(shape_.blocks) + ")");
  }
}

const bf16* ResidentExperts::expert(int64_t block, int32_t expert) const {
  check_block(block);
  if (expert < 0 || expert >= shape_.experts) {
    throw std::invalid_argument("resident experts: expert " + std::to_string(expert) + " is outside [0, E=" +
                                std::to_string(shape_.experts) + ")");
  }
  return weights_.data() + (block * shape_.experts + expert) * shape_.expert_elements();
}

ExpertTables ResidentExperts::acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) {
  (void)experts;
  (void)compute;
  check_block(block);
  const bf16* const* tables = tables_.data() + block * 2 * shape_.experts;
  return ExpertTables{tables, tables + shape_.experts};
}

void ResidentExperts::release(int64_t block, cudaStream_t compute) {
  (void)compute;
  check_block(block);
}

}  // namespace moe::cuda
