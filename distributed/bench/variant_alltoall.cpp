// variant_alltoall.cpp: ep_bench's raw all-to-all row (nccl-tests' alltoall.cu): every rank sends
// size / R bytes to every rank (itself included) through DeviceExchange::all_to_all_v with equal
// counts; the data is a pattern of (sender, receiver, index), checked element by element.
// bytes moved per rank = size; busbw = algbw (R - 1) / R. With G > 1, the same exchange through
// Tutel's 2DH all-to-all (DeviceHierarchicalAllToAll; equal counts: the count matrix is known).
#include <memory>
#include <string>
#include <vector>

#include "bench_kernels.h"        // fill_exchange_pattern, count_pattern_mismatches
#include "core/device_buffer.h"  // DeviceBuffer
#include "comm/device_all_to_all_2dh.h"  // DeviceHierarchicalAllToAll
#include "ep_bench_variants.h"

namespace moe::dist::bench {

namespace {

class AllToAll final : public ExchangeVariant {
 public:
  AllToAll(BenchContext& ctx, int ranks_per_node) : ExchangeVariant(ctx, ranks_per_node, "alltoall") {}

  Prepared prepare(int64_t size_bytes) override {
    const int R = ctx_.ranks;
    per_peer_ = size_bytes / 2 / R;  // bf16 elements to each rank
    const int64_t count = per_peer_ * R;
    send_ = cuda::DeviceBuffer<uint16_t>(static_cast<size_t>(count));
    recv_ = cuda::DeviceBuffer<uint16_t>(static_cast<size_t>(count));
    wrong_ = cuda::DeviceBuffer<unsigned long long>(1);
    for (int p = 0; p < R; ++p) {
      fill_exchange_pattern(send_.data() + p * per_peer_, static_cast<size_t>(per_peer_), ctx_.rank, p, ctx_.stream);
    }
    recv_.fill_bytes(0xFF, ctx_.stream);
    counts_.assign(R, per_peer_);
    offsets_.resize(R);
    for (int p = 0; p < R; ++p) offsets_[p] = p * per_peer_;
    if (ranks_per_node_ > 1) {
      if (!hierarchical_) hierarchical_ = std::make_unique<DeviceHierarchicalAllToAll>(ctx_.exchange, ranks_per_node_);
      matrix_.assign(static_cast<size_t>(R) * R, per_peer_);
      hierarchical_->reserve(matrix_, DataType::bfloat16);
    }
    return {count * 2, count, "bf16", static_cast<double>(count * 2)};
  }

  void run(cudaStream_t stream) override {
    if (hierarchical_) {
      const int64_t waits = hierarchical_->host_waits();
      hierarchical_->all_to_all_v(send_.data(), offsets_, recv_.data(), offsets_, matrix_, DataType::bfloat16, stream);
      host_syncs_ = static_cast<int>(hierarchical_->host_waits() - waits);
      return;
    }
    ctx_.exchange.all_to_all_v(send_.data(), counts_, offsets_, recv_.data(), counts_, offsets_, DataType::bfloat16,
                               stream);
  }

  Check check() override {
    wrong_.fill_bytes(0, ctx_.stream);
    for (int s = 0; s < ctx_.ranks; ++s) {
      count_pattern_mismatches(recv_.data() + s * per_peer_, static_cast<size_t>(per_peer_), s, ctx_.rank,
                               wrong_.data(), ctx_.stream);
    }
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    return {static_cast<double>(wrong_.download()[0]), true, {}, true};
  }

  int host_syncs() const override { return hierarchical_ ? host_syncs_ : ctx_.exchange.staged() ? 2 : 0; }

  void release() override {
    send_ = {};
    recv_ = {};
  }

 private:
  std::unique_ptr<DeviceHierarchicalAllToAll> hierarchical_;
  std::vector<int64_t> matrix_;  // [R * R] elements from rank s to rank t: per_peer_ everywhere
  int host_syncs_ = 0;
  int64_t per_peer_ = 0;
  std::vector<int64_t> counts_, offsets_;
  cuda::DeviceBuffer<uint16_t> send_, recv_;
  cuda::DeviceBuffer<unsigned long long> wrong_;
};

}  // namespace

std::unique_ptr<Variant> make_alltoall_variant(BenchContext& ctx, int ranks_per_node) {
  return std::make_unique<AllToAll>(ctx, ranks_per_node);
}

}  // namespace moe::dist::bench
