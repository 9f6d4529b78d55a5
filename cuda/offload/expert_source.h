// offload/expert_source.h: where an MoE block's expert weights come from when a model decodes.
//
// The MoE layer reads its experts through per-expert pointer tables (moe/moe_layer.h,
// MoeLayerWeights::w1 / w2: device arrays [E] -> [D, H] / [H, D]), so it does not care whether an
// expert lives in one resident tensor or in a slot of an expert cache that was filled a moment ago
// over PCIe. An ExpertSource hands the decoding model those tables, block by block:
//
//   ResidentExperts (gpu_only)   every expert of every block on the GPU: the tables never change,
//                                and the model needs no block's routing on the host
//   OffloadedExperts (offload/)  every expert in pinned host memory and a pool of GPU slots (the
//                                expert cache): acquire() copies the missing experts (on demand)
//                                and makes the compute stream wait for their copies; prefetch()
//                                starts copies early (prefetch-all, pre-gated, speculative);
//                                with host experts on, it also computes the misses its cost model
//                                picks on the host (choose_host_experts, host_forward)
//   DeviceSlotCache (offload/)   the same slots with their table on the GPU: a kernel reads each
//                                block's routing and plans its copies (acquire_on_device,
//                                prefetch_on_device), so a step never waits on the host
//   ResidentBlocks (offload/)    every expert of a few chosen blocks on the GPU (those no
//                                schedule can announce ahead, such as m_0), the other blocks
//                                from one of the two caches above
//
// The schedule (which experts to prefetch for block i+1 while block i computes: all of them, the
// pre-gate's choice, or a guess from block i+1's gate on block i's hidden state) is the decoding
// model's; the source only moves bytes and keeps the slots. A wrong guess costs a copy, never a
// different answer: the experts a block computes with are always the ones its router chose,
// bit for bit the same weights wherever they live.
//
// Dimension legend: D model width, H expert hidden width, E experts per MoE block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

// The pointer tables of one MoE block, in device memory, valid for the work the caller enqueues on
// its compute stream after acquire() and before release().
struct ExpertTables {
  const bf16* const* w1 = nullptr;  // device array [E] -> [D, H]
  const bf16* const* w2 = nullptr;  // device array [E] -> [H, D]
};

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;

  // True when acquire() needs the block's chosen experts (read back from the router to the host);
  // false when every expert is resident and `experts` is ignored (no host synchronisation).
  virtual bool needs_experts_on_host() const = 0;

  // Block `block`'s experts (ids in [0, E), sorted, unique: the experts its router chose for the
  // tokens of this step) become readable by work enqueued on `compute` after this call: missing
  // ones are copied now (on demand) and `compute` waits for their copies. The returned tables
  // point every chosen expert at its weights; the others at weights the layer never reads.
  virtual ExpertTables acquire(int64_t block, std::span<const int32_t> experts,
                               cudaStream_t compute) = 0;

  // The work on `compute` that reads block `block`'s experts has been enqueued: their slots may be
  // reused once `compute` passes this point (an event, not a host wait).
  virtual void release(int64_t block, cudaStream_t compute) = 0;

  // A hint that block `block` will soon need `experts`: start copying the missing ones without
  // making anyone wait. A resident source ignores it.
  virtual void prefetch(int64_t block, std::span<const int32_t> experts) { (void)block; (void)experts; }

  // True when every expert of block `block` stays on the GPU whatever the routing (ResidentExperts;
  // ResidentBlocks' chosen blocks): acquire() ignores `experts` for it, so the caller need not read
  // the block's routing back to the host, and a prefetch of it is ignored.
  virtual bool resident(int64_t block) const {
    (void)block;
    return false;
  }

  // ---- a slot table on the device (offload/device_slot_cache.h) ----
  // True when the decoding model calls acquire_on_device / prefetch_on_device instead of acquire /
  // prefetch: the source reads a block's routing where the router wrote it, on the device, and
  // decides its copies there, so nothing comes back to the host inside a step.
  virtual bool plans_on_device() const { return false; }
  // As acquire, for the routing top_experts [slots] (device memory; each token's K experts).
  virtual ExpertTables acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                         cudaStream_t compute) {
    (void)block, (void)top_experts, (void)slots, (void)compute;
    throw std::logic_error("this expert source plans on the host: call acquire with the block's experts");
  }
  // As prefetch, for the routing top_experts [slots] on the device (nullptr: every expert of the
  // block), enqueued after the work on `compute` that writes that routing.
  virtual void prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots, cudaStream_t compute) {
    (void)block, (void)top_experts, (void)slots, (void)compute;
  }

  // ---- experts computed on the host (offload/host_expert_choice.h) ----
  // Which of block `block`'s chosen experts (rows[i]: the rows experts[i] gets this step) the caller
  // should compute on the host with host_forward instead of acquiring them (ascending, a subset of
  // the experts not in a GPU slot), and the host time that is predicted to take. chosen_ahead: the
  // block's routing came from a pre-gate one block early, so its copies would start now, while the
  // host still computes the current block (false: the caller has just waited on the GPU for the
  // block's routing, and acquires it next). A source that never computes on the host returns none.
  struct HostPick {
    std::vector<int32_t> experts;
    double host_ms = 0;
  };
  virtual HostPick choose_host_experts(int64_t block, std::span<const int32_t> experts, std::span<const int64_t> rows,
                                       bool chosen_ahead) {
    (void)block, (void)experts, (void)rows, (void)chosen_ahead;
    return {};
  }
  // y [rows, D] = expert `expert` of block `block` on x [rows, D], on the host, fp32 in and out
  // (offload/cpu_expert.h). Throws std::logic_error for a source without host experts.
  virtual void host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                            std::span<float> y) {
    (void)block, (void)expert, (void)x, (void)rows, (void)y;
    throw std::logic_error("this expert source computes no experts on the host");
  }
};

}  // namespace moe::cuda
