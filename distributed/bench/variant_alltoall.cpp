// variant_alltoall.cpp: ep_bench's raw all-to-all row (nccl-tests' alltoall.cu): every rank sends
// size / R bytes to every rank (itself included) through DeviceExchange::all_to_all_v with equal
// counts; the data is a pattern of (sender, receiver, index), checked element by element.
// bytes moved per rank = size; busbw = algbw (R - 1) / R.
#include <vector>

#include "bench_kernels.h"        // fill_exchange_pattern, count_pattern_mismatches
#include "core/device_buffer.h"  // DeviceBuffer
#include "ep_bench_variants.h"

namespace moe::dist::bench {

namespace {

class AllToAll final : public Variant {
 public:
  explicit AllToAll(BenchContext& ctx) : ctx_(ctx) {}
  std::string name() const override { return "alltoall"; }

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
    return {count * 2, count, "bf16", static_cast<double>(count * 2)};
  }

  void run(cudaStream_t stream) override {
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

  int host_syncs() const override { return ctx_.exchange.staged() ? 2 : 0; }

  void release() override {
    send_ = {};
    recv_ = {};
  }

 private:
  BenchContext& ctx_;
  int64_t per_peer_ = 0;
  std::vector<int64_t> counts_, offsets_;
  cuda::DeviceBuffer<uint16_t> send_, recv_;
  cuda::DeviceBuffer<unsigned long long> wrong_;
};

}  // namespace

std::unique_ptr<Variant> make_alltoall_variant(BenchContext& ctx) { return std::make_unique<AllToAll>(ctx); }

}  // namespace moe::dist::bench
