// offload/resident_experts.h: ResidentExperts, the ExpertSource of the gpu_only mode: every expert
// of every MoE block in one GPU allocation, the pointer tables built once.
//
// The baseline the offloading modes are measured against, in time (no copy ever waits) and in GPU
// memory (the ceiling: Pre-gated MoE, Hwang et al., ISCA 2024, reports 4.2x less GPU memory than
// keeping every expert resident). Its bytes come from the same pinned store as the offloaded
// source's, so every mode computes with the same weights bit for bit.
//
// Given a list of blocks, it holds only those (ResidentBlocks, resident_blocks.h, serves the rest
// from an expert cache).
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns, E experts per MoE block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/bf16.h"                    // bf16
#include "core/device_buffer.h"           // DeviceBuffer
#include "offload/expert_source.h"        // ExpertSource, ExpertTables
#include "offload/pinned_expert_store.h"  // PinnedExpertStore, ExpertShape

namespace moe::cuda {

class ResidentExperts : public ExpertSource {
 public:
  // Copies the whole store to the GPU (store.bytes() of device memory) and builds every table.
  explicit ResidentExperts(const PinnedExpertStore& store);
  // Only the MoE blocks listed (each in [0, blocks), none twice, at least one; else
  // std::invalid_argument naming what is allowed): E experts of device memory a block.
  ResidentExperts(const PinnedExpertStore& store, std::span<const int64_t> blocks);

  bool needs_experts_on_host() const override { return false; }
  bool resident(int64_t block) const override;
  // `experts` is ignored (every expert is resident); a block this source does not hold is an
  // std::invalid_argument.
  ExpertTables acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) override;
  void release(int64_t block, cudaStream_t compute) override;

  const bf16* expert(int64_t block, int32_t expert) const;  // [D*W1 + H*D]: w1 [D, W1] then w2 [H, D]
  size_t device_bytes() const { return weights_.bytes() + tables_.bytes(); }

 private:
  int64_t held_index(int64_t block) const;  // the block's place in weights_; throws for a block not held

  ExpertShape shape_;
  std::vector<int64_t> held_;         // [blocks]: the block's place in weights_, or -1
  DeviceBuffer<bf16> weights_;        // [held blocks, E, D*W1 + H*D], each block as in the store
  DeviceBuffer<const bf16*> tables_;  // [held blocks, 2, E]: w1 pointers, then w2 pointers
};

}  // namespace moe::cuda
