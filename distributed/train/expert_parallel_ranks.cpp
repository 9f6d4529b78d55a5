// expert_parallel_ranks.cpp: see expert_parallel_ranks.h.
#include "expert_parallel_ranks.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::dist {
namespace {

// One MoE block of a model on several ranks: the expert-parallel layer as the model's MoeBlockFfn.
// Its router losses are global values the layer computes on the host after the count exchange;
// they are copied into device scalars, ordered on the stream, where the model's loss reads them.
class ExpertParallelMoeFfn final : public cuda::MoeBlockFfn {
 public:
  ExpertParallelMoeFfn(Communicator& communicator, const MoeConfig& config, int64_t local_tokens,
                       const ExpertParallelGpuOptions& options)
      : layer_(communicator, config, local_tokens, options), rank_(static_cast<size_t>(communicator.rank())),
        local_tokens_(local_tokens), losses_(2) {}

  void forward(const bf16* x, const cuda::MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
               const bf16* router_input) override {
    check_no_router_input(router_input);
    layer_.forward(x, local_tokens_, {weights.gate_weights, weights.w1, weights.w2}, y, stream);
    copy_losses(stream);
  }

  // The layer's own stages: the counts sent in forward_route, received (and so the router losses
  // known) in forward_receive_counts.
  void forward_route(const bf16* x, const cuda::MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
                     const bf16* router_input) override {
    check_no_router_input(router_input);
    layer_.forward_send_counts(x, local_tokens_, {weights.gate_weights, weights.w1, weights.w2}, y, stream);
  }
  void forward_receive_counts(cudaStream_t stream) override {
    layer_.forward_receive_counts(stream);
    copy_losses(stream);
  }
  void forward_experts(cudaStream_t stream) override { layer_.forward_experts(stream); }
  void forward_combine(cudaStream_t stream) override { layer_.forward_combine(stream); }

  void backward(const bf16* x, const cuda::MoeLayerWeights& weights, const bf16* dy,
                const cuda::MoeLayerGradients& gradients, cudaStream_t stream, const bf16* router_input,
                float* d_router_input) override {
    check_no_router_input(router_input, d_router_input);
    layer_.backward(x, {weights.gate_weights, weights.w1, weights.w2}, dy,
                    {gradients.dx, gradients.d_gate_weights, gradients.d_w1, gradients.d_w2}, stream);
  }
  void backward_experts(const bf16* x, const cuda::MoeLayerWeights& weights, const bf16* dy,
                        const cuda::MoeLayerGradients& gradients, cudaStream_t stream, const bf16* router_input,
                        float* d_router_input) override {
    check_no_router_input(router_input, d_router_input);
    layer_.backward_experts(x, {weights.gate_weights, weights.w1, weights.w2}, dy,
                            {gradients.dx, gradients.d_gate_weights, gradients.d_w1, gradients.d_w2}, stream);
  }
  void backward_combine(cudaStream_t stream) override { layer_.backward_combine(stream); }

  const float* aux_loss() const override { return losses_.data(); }
  const float* z_loss() const override { return losses_.data() + 1; }
  const cuda::DeviceBuffer<int>& top_experts() const override { return layer_.top_experts(); }
  PipelineDegree pipeline_degree() const override {
    const ExpertParallelGpuStep& step = layer_.last_step();
    return {.last = step.pipeline_chunks,
            .adaptive = step.pipeline.adaptive,
            .candidates = step.pipeline.candidates,
            .trial_ms = step.pipeline.times_ms,
            .chosen = step.pipeline.chosen};
  }

  std::vector<int64_t> rows_sent_per_rank() const override {
    // Rows this rank sent each rank: its kept slots for that rank's experts (its row of the count matrix).
    const ExpertParallelGpuStep& step = layer_.last_step();
    const int64_t E = layer_.config().num_experts, E_r = layer_.experts_per_rank(), R = E / E_r;
    const size_t me = rank_;
    std::vector<int64_t> rows(static_cast<size_t>(R), 0);
    for (int64_t e = 0; e < E; ++e) rows[static_cast<size_t>(e / E_r)] += step.kept_per_rank_expert[me * E + e];
    return rows;
  }
  void set_phase_timer(cuda::PhaseTimer* timer, int lane) override {
    layer_.set_phase_timer(timer, lane == 0 ? std::string(kExchangeRow) : std::string(kExchangeRow) + kSecondMicroBatchSuffix);
  }

 private:
  static void check_no_router_input(const bf16* router_input, const float* d_router_input = nullptr) {
    if (router_input != nullptr || d_router_input != nullptr) {
      throw std::invalid_argument("expert-parallel MoE block: a separate router input (pre-gating) is not supported");
    }
  }
  // The last forward's router losses (host values after the count exchange) into device scalars.
  void copy_losses(cudaStream_t stream) {
    host_losses_[0] = static_cast<float>(layer_.last_step().aux_loss);
    host_losses_[1] = static_cast<float>(layer_.last_step().z_loss);
    // Pageable source: the copy is staged before the call returns, so host_losses_ may change after.
    CUDA_CHECK(cudaMemcpyAsync(losses_.data(), host_losses_, sizeof host_losses_, cudaMemcpyHostToDevice, stream));
  }

  ExpertParallelGpu layer_;
  size_t rank_;
  int64_t local_tokens_;
  cuda::DeviceBuffer<float> losses_;  // [2] aux, z
  float host_losses_[2] = {0.0f, 0.0f};
};

}  // namespace

ExpertParallelRanks::ExpertParallelRanks(Communicator& host, Communicator& device,
                                         const ExpertParallelGpuOptions& layer_options)
    : host_(host), device_(device), layer_options_(layer_options) {
  if (host.size() != device.size() || host.rank() != device.rank()) {
    throw std::invalid_argument("ExpertParallelRanks: the host communicator is rank " + std::to_string(host.rank()) +
                                " of " + std::to_string(host.size()) + ", the device one rank " +
                                std::to_string(device.rank()) + " of " + std::to_string(device.size()) +
                                "; they must span the same ranks in the same order");
  }
  layer_options_.all_reduce_router_gradient = false;  // the model sums every replicated gradient itself
  exchange_ = std::make_unique<DeviceExchange>(device_);
}

ExpertParallelRanks::~ExpertParallelRanks() = default;

std::string ExpertParallelRanks::description() const {
  const bool nccl = device_.backend() == "nccl";
  return std::to_string(size()) + " ranks over " +
         (nccl ? std::string("NCCL") : std::string("MPI (staged through host memory: not an interconnect's timing)"));
}

std::unique_ptr<cuda::MoeBlockFfn> ExpertParallelRanks::make_moe_ffn(const MoeConfig& layer_config,
                                                                    int64_t local_tokens) {
  return std::make_unique<ExpertParallelMoeFfn>(device_, layer_config, local_tokens, layer_options_);
}

void ExpertParallelRanks::all_reduce_sum(float* data, int64_t count, cudaStream_t stream) {
  exchange_->all_reduce_sum(data, data, count, DataType::float32, stream);
}

void ExpertParallelRanks::all_reduce_sum(double* data, int64_t count, cudaStream_t stream) {
  exchange_->all_reduce_sum(data, data, count, DataType::float64, stream);
}

void ExpertParallelRanks::host_all_reduce_sum(std::vector<double>& values) {
  dist::all_reduce_sum(host_, std::span<double>(values));
}

std::vector<float> ExpertParallelRanks::host_all_gather(const std::vector<float>& mine) {
  return dist::all_gather(host_, std::span<const float>(mine));
}

std::vector<int32_t> ExpertParallelRanks::host_all_gather(const std::vector<int32_t>& mine) {
  return dist::all_gather(host_, std::span<const int32_t>(mine));
}

void ExpertParallelRanks::barrier() { host_.barrier(); }

}  // namespace moe::dist
