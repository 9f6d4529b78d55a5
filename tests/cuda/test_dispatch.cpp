// test_dispatch.cpp: the GPU dispatch plan (cuda/moe/dispatch.h) against reference_cpu/dispatch.h, array
// by array and exactly, for the dropping, padded and dropless formulations, on awkward routings.
// Run: ctest --test-dir build -R CudaDispatch   (skips without a GPU)
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"         // CUDA_CHECK
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/device_info.h"        // gpu_available, why_no_gpu
#include "reference_cpu/dispatch.h"  // moe::ref::plan_dispatch
#include "moe/dispatch.h"            // DispatchPlanBuffers, build_dispatch_plan (cuda/)
#include "moe/router.h"              // kRouterMaxExperts, the plan's E limit too
#include "routing_test_support.h"

namespace {

using moe::cuda::DeviceBuffer;
using namespace moe::test;

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

moe::MoeConfig plan_config(moe::Formulation formulation, int64_t T, int64_t E, int64_t K, int64_t B,
                           double capacity_factor = 1.0) {
  moe::MoeConfig config;
  config.tokens = T;
  config.model_dim = 8;
  config.hidden_dim = B;  // a multiple of B, as dropless requires
  config.num_experts = E;
  config.top_k = K;
  config.formulation = formulation;
  config.capacity_factor = capacity_factor;
  config.block_size = B;
  return config;
}

void poison(moe::cuda::DispatchPlanBuffers& buffers) {
  for (auto* buffer : {&buffers.tokens_per_expert, &buffers.routed_offsets, &buffers.routed_slots,
                       &buffers.kept_per_expert, &buffers.row_offsets, &buffers.row_slot, &buffers.slot_row,
                       &buffers.total_rows, &buffers.invalid_slots}) {
    buffer->fill_bytes(kIntPoisonByte);
  }
}

// Builds the plan on the GPU and compares every array with the reference's.
void check_plan(moe::cuda::DispatchPlanBuffers& buffers, const moe::MoeConfig& config,
                const moe::ref::IndexMatrix& top_experts) {
  const moe::ref::DispatchPlan ref = moe::ref::plan_dispatch(config, top_experts);
  SCOPED_TRACE(std::string(moe::to_string(config.formulation)) + " T=" + std::to_string(config.tokens) +
               " E=" + std::to_string(config.num_experts) + " K=" + std::to_string(config.top_k) +
               " B=" + std::to_string(config.block_size) + " C=" + std::to_string(ref.capacity));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreate(&stream));
  DeviceBuffer<int> device_top(to_vector(top_experts));
  poison(buffers);
  moe::cuda::build_dispatch_plan(device_top.data(), buffers, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));

  EXPECT_EQ(buffers.capacity(), ref.capacity);
  EXPECT_EQ(buffers.invalid_slots.download(), std::vector<int>{0});
  expect_equal("tokens_per_expert", buffers.tokens_per_expert.download(), ref.tokens_per_expert);
  expect_equal("routed_offsets", buffers.routed_offsets.download(), ref.routed_offsets);
  expect_equal("routed_slots", buffers.routed_slots.download(), ref.routed_slots);
  expect_equal("kept_per_expert", buffers.kept_per_expert.download(), ref.kept_per_expert);
  expect_equal("row_offsets", buffers.row_offsets.download(), ref.row_offsets);
  ASSERT_EQ(buffers.total_rows.download(), std::vector<int>{static_cast<int>(ref.total_rows)});
  ASSERT_LE(ref.total_rows, buffers.max_rows()) << "the host-known bound max_rows is too small";
  const std::vector<int> row_slot = buffers.row_slot.download();
  expect_equal("row_slot (used rows)", head(row_slot, size_t(ref.total_rows)), ref.row_slot);
  expect_equal("row_slot (rows past total_rows)", tail(row_slot, size_t(ref.total_rows)),
               std::vector<int>(row_slot.size() - size_t(ref.total_rows), -1));
  expect_equal("slot_row", buffers.slot_row.download(), ref.slot_row);
  std::printf("plan %s checked: total_rows=%lld max_rows=%d dropped=%lld padding=%lld\n",
              std::string(moe::to_string(config.formulation)).c_str(), static_cast<long long>(ref.total_rows),
              buffers.max_rows(), static_cast<long long>(ref.dropped_slots), static_cast<long long>(ref.padding_rows));
}

void check_case(const moe::MoeConfig& config, const moe::ref::IndexMatrix& top_experts) {
  moe::cuda::DispatchPlanBuffers buffers(config);
  check_plan(buffers, config, top_experts);
}

const moe::Formulation kFormulations[] = {moe::Formulation::dropping, moe::Formulation::padded,
                                          moe::Formulation::dropless};

TEST(CudaDispatch, RandomSkewedRoutingsMatchReference) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (moe::Formulation formulation : kFormulations) {
    for (double capacity_factor : {0.5, 1.0, 2.0}) {
      check_case(plan_config(formulation, 1000, 16, 2, 64, capacity_factor), random_top_experts(1000, 16, 2, ++seed));
    }
    check_case(plan_config(formulation, 300, 8, 2, 128), random_top_experts(300, 8, 2, ++seed, 0.0));  // uniform
    check_case(plan_config(formulation, 16384, 64, 2, 128), random_top_experts(16384, 64, 2, ++seed, 0.5));
    check_case(plan_config(formulation, 16384, 64, 2, 64), random_top_experts(16384, 64, 2, ++seed, 1.5));
    check_case(plan_config(formulation, 777, 200, 8, 16), random_top_experts(777, 200, 8, ++seed, 0.3));
  }
}

TEST(CudaDispatch, AwkwardSizes) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (moe::Formulation formulation : kFormulations) {
    check_case(plan_config(formulation, 1, 1, 1, 4), random_top_experts(1, 1, 1, ++seed));       // T = E = K = 1
    check_case(plan_config(formulation, 1, 8, 2, 4), random_top_experts(1, 8, 2, ++seed));       // T = 1
    check_case(plan_config(formulation, 5, 4, 4, 2), random_top_experts(5, 4, 4, ++seed));       // K = E
    check_case(plan_config(formulation, 100, 8, 2, 64, 1.0),                                     // expert 3 empty
               random_top_experts(100, 8, 2, ++seed, 1.0, {3}));
    // All tokens on one expert: K = 1, every token picks expert 2 (E = 5 leaves four empty).
    moe::ref::IndexMatrix all_on_two = moe::ref::IndexMatrix::Constant(257, 1, 2);
    check_case(plan_config(formulation, 257, 5, 1, 64, 1.25), all_on_two);
    check_case(plan_config(formulation, 257, 1, 1, 128), moe::ref::IndexMatrix::Zero(257, 1));  // E = 1
  }
}

// The counting sort gives each block 8 warps of 32 slots per round (more rounds once the
// (expert, block) counts would pass 16384), so these cases put slot counts just off those
// multiples, one expert on every slot, E = 1 and the largest E, and capacities below some counts.
TEST(CudaDispatch, CountingSortEdges) {
  REQUIRE_GPU();
  uint64_t seed = 400;
  const int64_t max_experts = moe::cuda::kRouterMaxExperts;
  for (moe::Formulation formulation : kFormulations) {
    // T*K not a multiple of a warp (32), a block (256) or a block's round: 255, 257, 4099, 70001.
    for (int64_t T : {255, 257, 4099, 70001}) {
      check_case(plan_config(formulation, T, 16, 1, 64, 0.8), random_top_experts(T, 16, 1, ++seed, 1.2));
    }
    check_case(plan_config(formulation, 3001, 7, 3, 64, 1.0), random_top_experts(3001, 7, 3, ++seed, 0.7));
    // One expert takes every slot (K = 1), the others are empty; over capacity when dropping.
    for (int64_t T : {1, 31, 33, 1000, 50000}) {
      moe::ref::IndexMatrix last = moe::ref::IndexMatrix::Constant(T, 1, 5);
      check_case(plan_config(formulation, T, 6, 1, 64, 2.0), last);
    }
    // E = 1: every slot on expert 0, a few rounds per warp.
    check_case(plan_config(formulation, 40000, 1, 1, 128, 1.0), moe::ref::IndexMatrix::Zero(40000, 1));
    // The largest E: many (expert, block) counts, so each warp takes several rounds of 32 slots.
    check_case(plan_config(formulation, 20000, max_experts, 2, 64, 1.0),
               random_top_experts(20000, max_experts, 2, ++seed, 0.3));
    check_case(plan_config(formulation, 100000, max_experts, 1, 64, 1.0),
               random_top_experts(100000, max_experts, 1, ++seed, 1.5));
    check_case(plan_config(formulation, 77, max_experts, 8, 16, 1.0),  // most experts empty
               random_top_experts(77, max_experts, 8, ++seed, 0.0));
    // Capacity below the hot experts' counts, above the cold ones': drops inside several blocks.
    for (double capacity_factor : {0.1, 0.3, 0.9}) {
      check_case(plan_config(formulation, 9000, 32, 2, 64, capacity_factor),
                 random_top_experts(9000, 32, 2, ++seed, 2.0));
    }
    // Alternating experts inside every warp: many groups of one lane each.
    moe::ref::IndexMatrix alternating(4096, 1);
    for (int64_t t = 0; t < 4096; ++t) alternating(t, 0) = static_cast<int32_t>(t % 32 == 31 ? 3 : t % 2);
    check_case(plan_config(formulation, 4096, 4, 1, 64, 0.5), alternating);
  }
}

TEST(CudaDispatch, BuffersAreReusedAcrossSteps) {
  REQUIRE_GPU();
  for (moe::Formulation formulation : kFormulations) {
    const moe::MoeConfig config = plan_config(formulation, 2000, 32, 2, 64, 1.0);
    moe::cuda::DispatchPlanBuffers buffers(config);
    for (uint64_t step = 0; step < 3; ++step) {
      check_plan(buffers, config, random_top_experts(2000, 32, 2, 300 + step, 0.5 * double(step)));
    }
  }
}

TEST(CudaDispatch, MaxRowsBounds) {
  REQUIRE_GPU();
  const moe::cuda::DispatchPlanBuffers dropless(plan_config(moe::Formulation::dropless, 100, 8, 2, 64));
  EXPECT_EQ(dropless.max_rows(), 100 * 2 + 8 * 63);
  EXPECT_EQ(dropless.plan().capacity, 0);
  const moe::cuda::DispatchPlanBuffers padded(plan_config(moe::Formulation::padded, 100, 8, 2, 64, 1.5));
  EXPECT_EQ(padded.capacity(), 38);  // ceil(1.5 * 200 / 8) = 37.5 -> 38
  EXPECT_EQ(padded.max_rows(), 8 * 38);
}

TEST(CudaDispatch, InvalidExpertIdsAreCounted) {
  REQUIRE_GPU();
  const moe::MoeConfig config = plan_config(moe::Formulation::dropless, 10, 4, 1, 4);
  moe::cuda::DispatchPlanBuffers buffers(config);
  std::vector<int> top = {0, 1, 2, 3, 4, -1, 0, 1, 2, 3};  // 4 and -1 are outside [0, 4)
  DeviceBuffer<int> device_top(top);
  moe::cuda::build_dispatch_plan(device_top.data(), buffers, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(buffers.invalid_slots.download(), std::vector<int>{2});
}

TEST(CudaDispatch, BadArgumentsAreRejected) {
  REQUIRE_GPU();
  moe::MoeConfig config = plan_config(moe::Formulation::dropless, 10, 4, 5, 4);  // K > E
  EXPECT_THROW(moe::cuda::DispatchPlanBuffers{config}, std::invalid_argument);
  config = plan_config(moe::Formulation::dropping, 10, 4, 1, 4, 0.0);  // no capacity
  EXPECT_THROW(moe::cuda::DispatchPlanBuffers{config}, std::invalid_argument);
  config = plan_config(moe::Formulation::dropless, 1 << 12, moe::cuda::kRouterMaxExperts + 1, 2, 4);  // E too large
  EXPECT_THROW(moe::cuda::DispatchPlanBuffers{config}, std::invalid_argument);
  config = plan_config(moe::Formulation::dropless, 1 << 12, moe::cuda::kRouterMaxExperts, 2, 4);  // the largest E
  EXPECT_NO_THROW(moe::cuda::DispatchPlanBuffers{config});
  config = plan_config(moe::Formulation::dropless, int64_t(1) << 30, 8, 4, 4);  // T*K over int32
  EXPECT_THROW(moe::cuda::DispatchPlanBuffers{config}, std::invalid_argument);
  moe::cuda::DispatchPlanBuffers buffers(plan_config(moe::Formulation::dropless, 10, 4, 1, 4));
  EXPECT_THROW(moe::cuda::build_dispatch_plan(nullptr, buffers, nullptr), std::invalid_argument);
}

}  // namespace
