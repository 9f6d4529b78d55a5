// offload/resident_blocks.h: ResidentBlocks, an ExpertSource that keeps every expert of a few MoE
// blocks on the GPU and serves the other blocks from an expert cache (OffloadedExperts or
// DeviceSlotCache).
//
// Why: a schedule can only start a block's copies once something has named its experts. The
// pre-gate of m_j names m_{j+1}'s one block ahead, but nothing comes before m_0: its experts are
// known only after its own gate, so each step its misses are copied on demand while the GPU waits
// (at the Switch-like scale a 9.4 MB expert is 0.17 ms of PCIe, against a whole decode step of about
// 1 ms). Holding the blocks that no schedule announces costs their E experts of GPU memory once and
// removes those stalls; every other block is offloaded as before.
//
// The model reads no routing back for a resident block (ExpertSource::resident), acquires it without
// the cache, and a prefetch of it is ignored; the cache sees only the other blocks (its statistics,
// its clock and its victims are theirs). The weights are the store's, so the bits are gpu_only's.
//
// Dimension legend: E experts per MoE block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "offload/expert_source.h"        // ExpertSource, ExpertTables
#include "offload/pinned_expert_store.h"  // PinnedExpertStore
#include "offload/resident_experts.h"     // ResidentExperts

namespace moe::cuda {

class ResidentBlocks : public ExpertSource {
 public:
  // `blocks`: the MoE blocks held on the GPU (each in [0, blocks), none twice, at least one, not
  // every block: else std::invalid_argument saying what is allowed). `rest` serves the others and
  // must outlive this object, as must the store.
  ResidentBlocks(const PinnedExpertStore& store, std::span<const int64_t> blocks, ExpertSource& rest);

  bool needs_experts_on_host() const override { return rest_.needs_experts_on_host(); }
  bool plans_on_device() const override { return rest_.plans_on_device(); }
  bool resident(int64_t block) const override { return held_.resident(block) || rest_.resident(block); }

  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;
  void prefetch(int64_t block, std::span<const int32_t> experts) override;
  ExpertTables acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                 cudaStream_t compute) override;
  void prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots, cudaStream_t compute) override;
  HostPick choose_host_experts(int64_t block, std::span<const int32_t> experts, std::span<const int64_t> rows,
                               bool chosen_ahead) override;
  void host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                    std::span<float> y) override;

  const std::vector<int64_t>& blocks() const { return blocks_; }  // ascending
  size_t device_bytes() const { return held_.device_bytes(); }   // the held blocks' experts and tables

 private:
  std::vector<int64_t> blocks_;
  ResidentExperts held_;
  ExpertSource& rest_;
};

// "0,2" -> {0, 2}: the --resident-blocks flag's list, checked against M MoE blocks (each in
// [0, M), none twice, not all of them). Throws std::invalid_argument saying what is allowed.
std::vector<int64_t> parse_resident_blocks(const std::string& text, int64_t moe_blocks);

}  // namespace moe::cuda
