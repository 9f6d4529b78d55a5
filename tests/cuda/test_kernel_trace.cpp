// test_kernel_trace.cpp: cuda/bench/kernel_trace.h, the CUPTI kernel trace behind moe_bench
// --kernel-trace. The summary's arithmetic and the name shortening run everywhere; the trace itself
// needs a GPU (skipped with the reason where none is present).
#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>

#include "moe/activation.h"  // gelu_forward: a kernel to trace
#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "gpu_test_support.h"
#include "bench/kernel_trace.h"

namespace moe::test {
namespace {

using bench::KernelRecord;
using cuda::bf16;
using cuda::DeviceBuffer;

TEST(KernelTrace, SummaryCutsRunsAndTakesMedians) {
  // Three runs of kernels a, b; times in ns. Run 1 has a slow b and a long gap before its a.
  const std::vector<KernelRecord> records = {
      {"a", 0, 1000},      {"b", 1500, 3500},   // run 0: a 1 us, gap 0.5 us, b 2 us
      {"a", 4000, 5000},   {"b", 5100, 9100},   // run 1: gap 0.5 us before a, b 4 us after 0.1 us
      {"a", 10000, 11000}, {"b", 11300, 13300}, // run 2: gap 0.9 us before a, b 2 us after 0.3 us
  };
  const bench::KernelTraceSummary s = bench::summarize_runs(records, 3);
  ASSERT_EQ(s.kernels.size(), 2u);
  EXPECT_EQ(s.runs, 3);
  EXPECT_EQ(s.kernels[0].name, "a");
  EXPECT_DOUBLE_EQ(s.kernels[0].median_ms, 0.001);
  EXPECT_DOUBLE_EQ(s.kernels[1].median_ms, 0.002);             // median of 2, 4, 2 us
  EXPECT_DOUBLE_EQ(s.kernels[0].median_gap_before_ms, 0.0007);  // runs 1 and 2 only: 0.5, 0.9 us
  EXPECT_DOUBLE_EQ(s.kernels[1].median_gap_before_ms, 0.0003);  // 0.5, 0.1, 0.3 us
  EXPECT_DOUBLE_EQ(s.sum_kernels_ms, 0.003);
  EXPECT_DOUBLE_EQ(s.sum_gaps_ms, 0.001);
  EXPECT_DOUBLE_EQ(s.median_span_ms, 0.005);  // start to next start: 4, 6 us
}

TEST(KernelTrace, SharesGroupByNameAndPutTheMostTimeFirst) {
  // Two steps whose launches differ: b twice in step 0, once in step 1, and c only in step 1.
  const std::vector<KernelRecord> records = {
      {"a", 0, 1000}, {"b", 1000, 4000}, {"b", 4000, 5000},  // step 0: a 1 us, b 3 + 1 us
      {"a", 6000, 8000}, {"c", 8000, 8500}, {"b", 9000, 11000},  // step 1: a 2 us, c 0.5 us, b 2 us
  };
  const std::vector<bench::KernelShare> shares = bench::kernel_shares(records, 2);
  ASSERT_EQ(shares.size(), 3u);
  EXPECT_EQ(shares[0].name, "b");
  EXPECT_DOUBLE_EQ(shares[0].ms_per_step, 0.003);  // (3 + 1 + 2) us over 2 steps
  EXPECT_DOUBLE_EQ(shares[0].launches_per_step, 1.5);
  EXPECT_EQ(shares[1].name, "a");
  EXPECT_DOUBLE_EQ(shares[1].ms_per_step, 0.0015);
  EXPECT_EQ(shares[2].name, "c");
  EXPECT_DOUBLE_EQ(shares[2].launches_per_step, 0.5);
  EXPECT_THROW(bench::kernel_shares(records, 0), std::invalid_argument);
}

TEST(KernelTrace, SummaryRejectsRunsThatDoNotMatch) {
  const std::vector<KernelRecord> records = {{"a", 0, 1}, {"b", 2, 3}, {"a", 4, 5}, {"c", 6, 7}};
  EXPECT_THROW(bench::summarize_runs(records, 2), std::invalid_argument);  // run 1 has c where b was
  EXPECT_THROW(bench::summarize_runs(records, 3), std::invalid_argument);  // 4 kernels into 3 runs
  EXPECT_THROW(bench::summarize_runs({}, 1), std::invalid_argument);       // nothing traced
}

TEST(KernelTrace, ShortNamesKeepTheProblem) {
  EXPECT_EQ(bench::short_kernel_name("void moe::cuda::block_sparse_detail::ws_kernel<4, true, "
                                     "moe::cuda::block_sparse_detail::SddProblem<(moe::cuda::Layout)0, "
                                     "(moe::cuda::SddEpilogue)1>, (moe::cuda::WsCluster)0>(int, float*)"),
            "ws_kernel<SddProblem<(Layout)0, (SddEpilogue)1>>");
  EXPECT_EQ(bench::short_kernel_name("void moe::cuda::gelu_kernel(const bf16*, bf16*, long)"), "gelu_kernel");
  EXPECT_EQ(bench::short_kernel_name("void moe::cuda::(anonymous namespace)::build_maps(int)"), "build_maps");
  EXPECT_EQ(bench::short_kernel_name("memset"), "memset");
}

TEST(KernelTrace, RecordsEveryLaunchInOrder) {
  REQUIRE_GPU();
  constexpr size_t n = size_t{1} << 22;
  DeviceBuffer<bf16> pre(n), out(n);
  pre.fill_bytes(0x3F);
  constexpr int runs = 4;
  std::vector<KernelRecord> records;
  {
    // CUPTI serves one client: under compute-sanitizer, ncu or nsys the trace cannot start.
    std::optional<bench::KernelTrace> started;
    try {
      started.emplace();
    } catch (const std::runtime_error& error) {
      GTEST_SKIP() << "CUPTI is taken by another tool (a sanitizer or profiler attached): " << error.what();
    }
    bench::KernelTrace& trace = *started;
    for (int r = 0; r < runs; ++r) {
      out.fill_bytes(0xFF);  // a memset, then two kernels
      cuda::gelu_forward(pre.data(), out.data(), n, nullptr);
      cuda::gelu_forward(out.data(), pre.data(), n, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    records = trace.take();
    EXPECT_TRUE(trace.take().empty());  // taken once
    EXPECT_THROW(bench::KernelTrace(), std::logic_error) << "one trace at a time";
  }
  ASSERT_EQ(records.size(), size_t(3 * runs));
  for (size_t i = 1; i < records.size(); ++i) {
    EXPECT_GE(records[i].start_ns, records[i - 1].end_ns) << "one stream: each starts after the one before";
  }
  const bench::KernelTraceSummary s = bench::summarize_runs(records, runs);
  ASSERT_EQ(s.kernels.size(), 3u);
  EXPECT_EQ(s.kernels[0].name, "memset");
  EXPECT_NE(s.kernels[1].name.find("gelu"), std::string::npos) << s.kernels[1].name;
  EXPECT_GT(s.kernels[1].median_ms, 0.0);
  EXPECT_GE(s.median_span_ms, s.sum_kernels_ms);
}

}  // namespace
}  // namespace moe::test
