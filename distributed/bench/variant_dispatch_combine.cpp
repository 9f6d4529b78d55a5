// variant_dispatch_combine.cpp: ep_bench's dispatch + combine row: the expert-parallel layer's
// forward with identity experts (ExpertCompute::identity): route T_r tokens, the count exchange,
// gather the rows in send order, all-to-all-v to the experts' ranks, straight back, combine. The
// layer shape's D, E, K; T_r = size / (K D 2 bytes), so a rank dispatches `size` bytes (dropless:
// every slot travels) and gets as many back: bytes moved per rank = 2 size. Checked: the rows that
// came back equal, bit for bit, the rows that went out. With G > 1 the layer's exchanges go through
// Tutel's 2DH all-to-all (options.hierarchical_ranks_per_node): the same bytes, the same check.
#include <algorithm>
#include <cmath>
#include <string>

#include "bench_kernels.h"        // fill_uniform, count_mismatches
#include "core/device_buffer.h"  // DeviceBuffer
#include "ep_bench_variants.h"
#include "ep/expert_parallel_gpu.h"  // ExpertParallelGpu

namespace moe::dist::bench {

namespace {

class DispatchCombine final : public ExchangeVariant {
 public:
  DispatchCombine(BenchContext& ctx, int ranks_per_node) : ExchangeVariant(ctx, ranks_per_node, "dispatch+combine") {}

  Prepared prepare(int64_t size_bytes) override {
    const LayerShape& shape = ctx_.options.layer;
    const int64_t D = shape.model_dim, K = shape.top_k, E = shape.experts;
    tokens_ = std::max<int64_t>(1, size_bytes / (K * D * 2));
    MoeConfig config;
    config.tokens = tokens_ * ctx_.ranks;
    config.model_dim = D;
    config.hidden_dim = shape.hidden_dim;
    config.num_experts = E;
    config.top_k = K;
    config.block_size = shape.block_size;
    config.formulation = Formulation::dropless;
    config.renormalize = true;
    layer_ = std::make_unique<ExpertParallelGpu>(
        ctx_.layer, config, tokens_,
        ExpertParallelGpuOptions{.pipeline_chunks = 1,
                                 .experts = ExpertCompute::identity,
                                 .hierarchical_ranks_per_node = ranks_per_node_});
    x_ = cuda::DeviceBuffer<bf16>(static_cast<size_t>(tokens_ * D));
    y_ = cuda::DeviceBuffer<bf16>(static_cast<size_t>(tokens_ * D));
    gate_ = cuda::DeviceBuffer<bf16>(static_cast<size_t>(D * E));
    wrong_ = cuda::DeviceBuffer<unsigned long long>(1);
    const uint64_t seed = ctx_.options.seed;
    fill_uniform(x_.data(), x_.size(), seed + 11, static_cast<uint64_t>(ctx_.rank * tokens_ * D), 1.0f, ctx_.stream);
    fill_uniform(gate_.data(), gate_.size(), seed + 12, 0, 1.0f / std::sqrt(static_cast<float>(D)), ctx_.stream);
    const int64_t bytes = tokens_ * K * D * 2;
    return {bytes, tokens_, "bf16", 2.0 * static_cast<double>(bytes)};
  }

  void run(cudaStream_t stream) override {
    layer_->forward(x_.data(), tokens_, {gate_.data(), nullptr, nullptr}, y_.data(), stream);
  }

  Check check() override {
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    wrong_.fill_bytes(0, ctx_.stream);
    const size_t count = static_cast<size_t>(layer_->last_step().rows_sent * ctx_.options.layer.model_dim);
    count_mismatches(reinterpret_cast<const uint16_t*>(layer_->sent_rows()),
                     reinterpret_cast<const uint16_t*>(layer_->returned_rows()), count, wrong_.data(), ctx_.stream);
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    return {static_cast<double>(wrong_.download()[0]), true, {}, true};
  }

  int host_syncs() const override { return layer_ ? layer_->last_step().host_synchronisations : 0; }

  std::vector<PhaseTime> phases(cudaStream_t stream) override {
    cuda::PhaseTimer timer;
    layer_->set_phase_timer(&timer);
    std::vector<PhaseTime> result = median_phases(timer, kPhaseRuns, [&] {
      ctx_.host.barrier();
      run(stream);
    });
    layer_->set_phase_timer(nullptr);
    return result;
  }

  void release() override {
    layer_.reset();
    x_ = {};
    y_ = {};
  }

 private:
  int64_t tokens_ = 0;
  std::unique_ptr<ExpertParallelGpu> layer_;
  cuda::DeviceBuffer<bf16> x_, y_, gate_;
  cuda::DeviceBuffer<unsigned long long> wrong_;
};

}  // namespace

std::unique_ptr<Variant> make_dispatch_combine_variant(BenchContext& ctx, int ranks_per_node) {
  return std::make_unique<DispatchCombine>(ctx, ranks_per_node);
}

}  // namespace moe::dist::bench
