// variant_count_exchange.cpp: ep_bench's count-exchange row: the expert-parallel layer's one host
// synchronisation per forward. Each rank's routing summary (2 E + 2 int32 words, device memory) is
// gathered into every rank's host memory (DeviceExchange::all_gather_to_host), as the layer does;
// its time is what a forward pays to know the R x E counts. size = the bytes gathered on a rank.
#include <vector>

#include "core/device_buffer.h"  // DeviceBuffer
#include "ep_bench_variants.h"
#include "ep/expert_parallel_kernels.h"  // routing_summary_words

namespace moe::dist::bench {

namespace {

class CountExchange final : public Variant {
 public:
  explicit CountExchange(BenchContext& ctx)
      : ctx_(ctx), words_(routing_summary_words(ctx.options.layer.experts)) {}
  std::string name() const override { return "count_exchange"; }
  std::vector<int64_t> sizes(const BenchOptions&) const override { return {ctx_.ranks * words_ * 4}; }

  Prepared prepare(int64_t) override {
    std::vector<int32_t> mine(static_cast<size_t>(words_));
    for (int64_t i = 0; i < words_; ++i) mine[i] = expected(ctx_.rank, i);
    summary_ = cuda::DeviceBuffer<int32_t>(mine);
    gathered_.assign(static_cast<size_t>(ctx_.ranks * words_), -1);
    const int64_t bytes = ctx_.ranks * words_ * 4;
    return {bytes, words_, "int32", static_cast<double>(bytes)};
  }

  void run(cudaStream_t stream) override {
    ctx_.exchange.all_gather_to_host(summary_.data(), gathered_.data(), words_, DataType::int32, stream);
  }

  Check check() override {
    double wrong = 0;
    for (int p = 0; p < ctx_.ranks; ++p) {
      for (int64_t i = 0; i < words_; ++i) wrong += gathered_[p * words_ + i] != expected(p, i);
    }
    return {wrong, true, {}, true};
  }

  int host_syncs() const override { return 1; }

 private:
  static int32_t expected(int rank, int64_t i) { return static_cast<int32_t>(rank * 1000003 + i); }

  BenchContext& ctx_;
  int64_t words_;
  cuda::DeviceBuffer<int32_t> summary_;
  std::vector<int32_t> gathered_;
};

}  // namespace

std::unique_ptr<Variant> make_count_exchange_variant(BenchContext& ctx) {
  return std::make_unique<CountExchange>(ctx);
}

}  // namespace moe::dist::bench
