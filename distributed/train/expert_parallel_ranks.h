// expert_parallel_ranks.h: the model's other ranks (cuda/model/model_ranks.h) over this folder's
// communicators: MoE blocks as FastMoE's expert-parallel layer (expert_parallel_gpu.h), the
// replicated gradients summed through DeviceExchange (NCCL on device buffers, or MPI staged through
// pinned host memory where ranks share a GPU), host collectives over MPI. moe_train_distributed
// (this folder) is its program; tests/distributed/test_distributed_training.cpp its test.
//
// Dimension legend: R ranks, T_r this rank's tokens, T = R T_r, E experts, d chunks. Each MoE block's
// experts sit where the model's placement of that block says (model.h, common/expert_placement.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"         // Communicator
#include "comm/device_exchange.h"      // DeviceExchange
#include "ep/expert_parallel_gpu.h"  // ExpertParallelGpuOptions
#include "model/model_ranks.h"    // ModelRanks, MoeBlockFfn

namespace moe::dist {

class ExpertParallelRanks final : public cuda::ModelRanks {
 public:
  // host: collectives over host buffers (the MPI world); device: the communicator of the layers'
  // exchanges and the gradient sums (NCCL, one GPU per rank, or the same MPI world). Both must span
  // the same ranks in the same order and outlive this object. `layer_options` go to every MoE block
  // (the router gradient's all-reduce is the model's: turned off here).
  ExpertParallelRanks(Communicator& host, Communicator& device, const ExpertParallelGpuOptions& layer_options = {});
  ~ExpertParallelRanks() override;

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  std::string description() const override;

  std::unique_ptr<cuda::MoeBlockFfn> make_moe_ffn(const MoeConfig& layer_config, int64_t local_tokens,
                                                  const ExpertPlacement& placement) override;
  void all_reduce_sum(float* data, int64_t count, cudaStream_t stream) override;
  void all_reduce_sum(double* data, int64_t count, cudaStream_t stream) override;

  void host_all_reduce_sum(std::vector<double>& values) override;
  std::vector<float> host_all_gather(const std::vector<float>& mine) override;
  std::vector<int32_t> host_all_gather(const std::vector<int32_t>& mine) override;
  void barrier() override;

 private:
  Communicator& host_;
  Communicator& device_;
  ExpertParallelGpuOptions layer_options_;
  std::unique_ptr<DeviceExchange> exchange_;  // the gradient sums
};

}  // namespace moe::dist
