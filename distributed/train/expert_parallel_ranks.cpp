// expert_parallel_ranks.cpp: see expert_parallel_ranks.h.
#include "expert_parallel_ranks.h"

#include <cuda_runtime.h>

#include <span>
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
      : layer_(communicator, config, local_tokens, options), local_tokens_(local_tokens), losses_(2) {}

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
  void sum_replica_gradients(float* const* d_w1, float* const* d_w2, cudaStream_t stream) override {
    layer_.sum_over_replicas({nullptr, nullptr, d_w1, d_w2}, stream);
  }

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
    // Rows this rank sent each rank, over the chunks: its kept slots for the slots that rank holds.
    const ExchangePlan& plan = layer_.plan();
    std::vector<int64_t> rows(static_cast<size_t>(plan.ranks()), 0);
    for (int c = 0; c < plan.chunks(); ++c) {
      const std::span<const int64_t> sent = plan.send_rows(c);
      for (size_t p = 0; p < rows.size(); ++p) rows[p] += sent[p];
    }
    return rows;
  }
  std::vector<int64_t> expert_load() const override {
    const ExpertParallelGpuStep& step = layer_.last_step();  // [R, E] from the count exchange
    const size_t E = static_cast<size_t>(layer_.config().num_experts);
    std::vector<int64_t> load(E, 0);
    for (size_t i = 0; i < step.routed_per_rank_expert.size(); ++i) load[i % E] += step.routed_per_rank_expert[i];
    return load;
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
  // The model sums every replicated gradient itself, the replicas' with them once a step.
  layer_options_.all_reduce_router_gradient = false;
  layer_options_.sum_replica_gradients = false;
  exchange_ = std::make_unique<DeviceExchange>(device_);
}

ExpertParallelRanks::~ExpertParallelRanks() = default;

std::string ExpertParallelRanks::description() const {
  const bool nccl = device_.backend() == "nccl";
  return std::to_string(size()) + " ranks over " +
         (nccl ? std::string("NCCL") : std::string("MPI (staged through host memory: not an interconnect's timing)"));
}

std::unique_ptr<cuda::MoeBlockFfn> ExpertParallelRanks::make_moe_ffn(const MoeConfig& layer_config,
                                                                    int64_t local_tokens,
                                                                    const ExpertPlacement& placement) {
  ExpertParallelGpuOptions options = layer_options_;
  options.placement = &placement;  // the layer keeps a copy
  return std::make_unique<ExpertParallelMoeFfn>(device_, layer_config, local_tokens, options);
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
