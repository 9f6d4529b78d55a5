// offload/resident_experts.h: ResidentExperts, the ExpertSource of the gpu_only mode: every expert
// of every MoE block in one GPU allocation, the pointer tables built once.
//
// The baseline the offloading modes are measured against, in time (no copy ever waits) and in GPU
// memory (the ceiling: Pre-gated MoE, Hwang et al., ISCA 2024, reports 4.2x less GPU memory than
// keeping every expert resident). Its bytes come from the same pinned store as the offloaded
// source's, so every mode computes with the same weights bit for bit.
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns, E experts per MoE block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "core/bf16.h"                    // bf16
#include "core/device_buffer.h"           // DeviceBuffer
#include "offload/expert_source.h"        // ExpertSource, ExpertTables
#include "offload/pinned_expert_store.h"  // PinnedExpertStore, ExpertShape

namespace moe::cuda {

class ResidentExperts : public ExpertSource {
 public:
  // Copies the whole store to the GPU (store.bytes() of device memory) and builds every table.
  explicit ResidentExperts(const PinnedExpertStore& store);

  bool needs_experts_on_host() const override { return false; }
  // `experts` is ignored (every expert is resident); a block outside [0, blocks) is an
  // std::invalid_argument.
  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;

  const bf16* expert(int64_t block, int32_t expert) const;  // [D*W1 + H*D]: w1 [D, W1] then w2 [H, D]
  size_t device_bytes() const { return weights_.bytes() + tables_.bytes(); }

 private:
  void check_block(int64_t block) const;

  ExpertShape shape_;
  DeviceBuffer<bf16> weights_;        // [blocks, E, D*W1 + H*D], the store's layout
  DeviceBuffer<const bf16*> tables_;  // [blocks, 2, E]: w1 pointers, then w2 pointers
};

}  // namespace moe::cuda
