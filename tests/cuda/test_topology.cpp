// test_topology.cpp: the GPU block-sparse topology (cuda/moe/topology.h) against
// reference_cpu/topology.h's make_topology, array by array and exactly, plus the documented values
// past the used part (offsets = nnz, indices = -1); and MicroBatchTopology's column walk over
// several micro-batches' topologies.
// Run: ctest --test-dir build -R CudaTopology   (skips without a GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/topology.h"            // TopologyBuffers, build_topology, MicroBatchTopology (cuda/)
#include "core/cuda_check.h"         // CUDA_CHECK
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/device_info.h"        // gpu_available, why_no_gpu
#include "reference_cpu/dispatch.h"  // moe::ref::plan_dispatch
#include "moe/dispatch.h"            // DispatchPlanBuffers, build_dispatch_plan (cuda/)
#include "routing_test_support.h"
#include "reference_cpu/topology.h"  // moe::ref::make_topology

namespace {

using moe::cuda::DeviceBuffer;
using namespace moe::test;

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

moe::MoeConfig dropless_config(int64_t T, int64_t E, int64_t K, int64_t B, int64_t H) {
  moe::MoeConfig config;
  config.tokens = T;
  config.model_dim = 8;
  config.hidden_dim = H;
  config.num_experts = E;
  config.top_k = K;
  config.formulation = moe::Formulation::dropless;
  config.block_size = B;
  return config;
}

void check_topology(const moe::MoeConfig& config, const moe::ref::IndexMatrix& top_experts) {
  SCOPED_TRACE("T=" + std::to_string(config.tokens) + " E=" + std::to_string(config.num_experts) +
               " K=" + std::to_string(config.top_k) + " B=" + std::to_string(config.block_size) +
               " H=" + std::to_string(config.hidden_dim));
  const moe::ref::DispatchPlan ref_plan = moe::ref::plan_dispatch(config, top_experts);
  const moe::ref::BlockSparseTopology ref = moe::ref::make_topology(config, ref_plan);

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreate(&stream));
  moe::cuda::DispatchPlanBuffers plan(config);
  moe::cuda::TopologyBuffers topology(config);
  for (auto* buffer : {&topology.block_rows, &topology.nnz, &topology.offsets, &topology.row_indices,
                       &topology.column_indices, &topology.column_offsets, &topology.transpose_indices,
                       &topology.block_row_expert, &topology.block_row_tokens}) {
    buffer->fill_bytes(kIntPoisonByte);
  }
  DeviceBuffer<int> device_top(to_vector(top_experts));
  moe::cuda::build_dispatch_plan(device_top.data(), plan, stream);
  moe::cuda::build_topology(plan.plan(), topology, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));

  const moe::cuda::DeviceTopology view = topology.topology();
  EXPECT_EQ(view.block_size, ref.block_size);
  EXPECT_EQ(view.block_cols, ref.block_cols);
  EXPECT_EQ(view.blocks_per_expert, config.hidden_dim / config.block_size);
  ASSERT_LE(ref.block_rows, view.max_block_rows) << "the host-known bound max_block_rows is too small";
  ASSERT_EQ(topology.block_rows.download(), std::vector<int>{int(ref.block_rows)});
  ASSERT_EQ(topology.nnz.download(), std::vector<int>{int(ref.nnz)});
  const size_t block_rows = size_t(ref.block_rows), nnz = size_t(ref.nnz);

  const std::vector<int> offsets = topology.offsets.download();
  expect_equal("offsets", head(offsets, block_rows + 1), ref.offsets);
  expect_equal("offsets past block_rows", tail(offsets, block_rows + 1),
               std::vector<int>(offsets.size() - block_rows - 1, int(ref.nnz)));
  const std::vector<int> block_row_expert = topology.block_row_expert.download();
  expect_equal("block_row_expert", head(block_row_expert, block_rows), ref.block_row_expert);
  expect_equal("block_row_expert past block_rows", tail(block_row_expert, block_rows),
               std::vector<int>(block_row_expert.size() - block_rows, -1));
  const std::vector<int> block_row_tokens = topology.block_row_tokens.download();
  expect_equal("block_row_tokens", head(block_row_tokens, block_rows), ref.block_row_tokens);
  expect_equal("block_row_tokens past block_rows", tail(block_row_tokens, block_rows),
               std::vector<int>(block_row_tokens.size() - block_rows, 0));
  expect_equal("column_offsets", topology.column_offsets.download(), ref.column_offsets);
  const std::pair<const char*, const DeviceBuffer<int>*> per_block[] = {
      {"row_indices", &topology.row_indices},
      {"column_indices", &topology.column_indices},
      {"transpose_indices", &topology.transpose_indices}};
  const std::vector<int>* ref_arrays[] = {&ref.row_indices, &ref.column_indices, &ref.transpose_indices};
  for (int i = 0; i < 3; ++i) {
    const std::vector<int> values = per_block[i].second->download();
    expect_equal(per_block[i].first, head(values, nnz), *ref_arrays[i]);
    expect_equal(std::string(per_block[i].first) + " past nnz", tail(values, nnz),
                 std::vector<int>(values.size() - nnz, -1));
  }
  std::printf("topology block_rows=%lld of max %d, nnz=%lld of max %d\n", static_cast<long long>(ref.block_rows),
              view.max_block_rows, static_cast<long long>(ref.nnz), view.max_nnz);
}

TEST(CudaTopology, MatchesReference) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  check_topology(dropless_config(1000, 16, 2, 64, 256), random_top_experts(1000, 16, 2, ++seed));    // T % B != 0
  check_topology(dropless_config(1000, 16, 2, 128, 128), random_top_experts(1000, 16, 2, ++seed));   // H = B
  check_topology(dropless_config(16384, 64, 2, 128, 512), random_top_experts(16384, 64, 2, ++seed, 0.7));
  check_topology(dropless_config(16384, 64, 2, 64, 256), random_top_experts(16384, 64, 2, ++seed, 1.5));
  check_topology(dropless_config(333, 7, 3, 16, 48), random_top_experts(333, 7, 3, ++seed));
}

TEST(CudaTopology, AwkwardRoutings) {
  REQUIRE_GPU();
  uint64_t seed = 600;
  check_topology(dropless_config(1, 1, 1, 64, 64), random_top_experts(1, 1, 1, ++seed));            // T = E = 1
  check_topology(dropless_config(1, 8, 2, 128, 256), random_top_experts(1, 8, 2, ++seed));          // T = 1
  check_topology(dropless_config(9, 4, 4, 4, 8), random_top_experts(9, 4, 4, ++seed));              // K = E
  check_topology(dropless_config(200, 8, 2, 64, 128), random_top_experts(200, 8, 2, ++seed, 1.0, {0, 5}));  // empty experts
  check_topology(dropless_config(300, 6, 1, 128, 256), moe::ref::IndexMatrix::Constant(300, 1, 5)); // one expert, last
  check_topology(dropless_config(300, 6, 1, 64, 64), moe::ref::IndexMatrix::Zero(300, 1));          // one expert, first
}

// MicroBatchTopology (topology.h): M micro-batches' topologies recorded one after another, then the
// walk over all of them. Column c must list micro-batch 0's blocks of c, then micro-batch 1's, ...,
// each id moved into its micro-batch's slot (+ m * max_nnz); every listed block's row index is its
// block row among the slots (id / (H/B)); block_row_tokens are each micro-batch's, slot by slot.
std::vector<int> download_ints(const int* device, size_t count) {
  std::vector<int> host(count);
  CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(int), cudaMemcpyDeviceToHost));
  return host;
}

void check_micro_batch_walk(const moe::MoeConfig& config, const std::vector<moe::ref::IndexMatrix>& routings) {
  const int M = int(routings.size());
  SCOPED_TRACE("M=" + std::to_string(M) + " T=" + std::to_string(config.tokens) + " E=" +
               std::to_string(config.num_experts) + " B=" + std::to_string(config.block_size));
  moe::cuda::DispatchPlanBuffers plan(config);
  moe::cuda::TopologyBuffers topology(config);
  moe::cuda::MicroBatchTopology walk(config, M);
  const moe::cuda::DeviceTopology one = topology.topology();
  const int R = one.max_block_rows, HB = one.blocks_per_expert, columns = one.block_cols;
  EXPECT_EQ(walk.slot_rows(), int64_t{R} * config.block_size);
  EXPECT_EQ(walk.slot_blocks(), int64_t{R} * HB);
  std::vector<std::vector<int>> want(static_cast<size_t>(columns));
  std::vector<int> want_tokens(size_t(M) * R);
  for (int m = 0; m < M; ++m) {
    DeviceBuffer<int> top(to_vector(routings[size_t(m)]));
    moe::cuda::build_dispatch_plan(top.data(), plan, nullptr);
    moe::cuda::build_topology(plan.plan(), topology, nullptr);
    walk.record(m, plan.plan(), topology, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int> offsets = topology.column_offsets.download(), transpose = topology.transpose_indices.download();
    const std::vector<int> tokens = topology.block_row_tokens.download();
    for (int c = 0; c < columns; ++c) {
      for (int i = offsets[size_t(c)]; i < offsets[size_t(c) + 1]; ++i) want[size_t(c)].push_back(transpose[size_t(i)] + m * R * HB);
    }
    std::copy(tokens.begin(), tokens.end(), want_tokens.begin() + ptrdiff_t(m) * R);
  }
  walk.build(nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const moe::cuda::DeviceTopology view = walk.topology();
  ASSERT_EQ(view.max_block_rows, M * R);
  ASSERT_EQ(view.max_nnz, M * R * HB);
  ASSERT_EQ(view.block_cols, columns);
  const std::vector<int> offsets = download_ints(view.column_offsets, size_t(columns) + 1);
  const std::vector<int> transpose = download_ints(view.transpose_indices, size_t(view.max_nnz));
  const std::vector<int> rows = download_ints(view.row_indices, size_t(view.max_nnz));
  EXPECT_EQ(download_ints(view.block_row_tokens, size_t(M) * R), want_tokens);
  EXPECT_EQ(offsets[0], 0);
  size_t listed = 0;
  for (int c = 0; c < columns; ++c) {
    const std::vector<int> got(transpose.begin() + offsets[size_t(c)], transpose.begin() + offsets[size_t(c) + 1]);
    EXPECT_EQ(got, want[size_t(c)]) << "column " << c;
    for (int block : got) EXPECT_EQ(rows[size_t(block)], block / HB) << "block " << block;
    listed += got.size();
  }
  EXPECT_EQ(size_t(offsets[size_t(columns)]), listed);
}

TEST(CudaTopology, MicroBatchWalk) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  std::vector<moe::ref::IndexMatrix> routings;
  for (int m = 0; m < 3; ++m) routings.push_back(random_top_experts(300, 6, 2, ++seed));
  check_micro_batch_walk(dropless_config(300, 6, 2, 64, 128), routings);
  check_micro_batch_walk(dropless_config(300, 6, 2, 64, 128), {routings[0]});  // M = 1: the topology's own walk
  routings = {random_top_experts(200, 8, 2, ++seed, 1.0, {0, 5}), random_top_experts(200, 8, 2, ++seed, 1.0, {3}),
              random_top_experts(200, 8, 2, ++seed, 1.0, {0, 3})};  // experts empty in some micro-batches
  check_micro_batch_walk(dropless_config(200, 8, 2, 128, 256), routings);
  routings = {moe::ref::IndexMatrix::Constant(1, 1, 2), moe::ref::IndexMatrix::Constant(1, 1, 0),
              moe::ref::IndexMatrix::Constant(1, 1, 2), moe::ref::IndexMatrix::Constant(1, 1, 3)};  // T = 1
  check_micro_batch_walk(dropless_config(1, 4, 1, 64, 64), routings);
}

TEST(CudaTopology, BadArgumentsAreRejected) {
  REQUIRE_GPU();
  moe::MoeConfig dropping = dropless_config(100, 8, 2, 64, 128);
  dropping.formulation = moe::Formulation::dropping;
  EXPECT_THROW(moe::cuda::TopologyBuffers{dropping}, std::invalid_argument);
  moe::MoeConfig bad_hidden = dropless_config(100, 8, 2, 64, 100);  // H not a multiple of B
  EXPECT_THROW(moe::cuda::TopologyBuffers{bad_hidden}, std::invalid_argument);

  moe::cuda::TopologyBuffers topology(dropless_config(100, 8, 2, 64, 128));
  moe::cuda::DispatchPlanBuffers dropping_plan(dropping);
  EXPECT_THROW(moe::cuda::build_topology(dropping_plan.plan(), topology, nullptr), std::invalid_argument);
  moe::cuda::DispatchPlanBuffers other_experts(dropless_config(100, 16, 2, 64, 128));
  EXPECT_THROW(moe::cuda::build_topology(other_experts.plan(), topology, nullptr), std::invalid_argument);
  moe::cuda::DispatchPlanBuffers other_block(dropless_config(100, 8, 2, 32, 128));
  EXPECT_THROW(moe::cuda::build_topology(other_block.plan(), topology, nullptr), std::invalid_argument);
  moe::cuda::DispatchPlanBuffers more_tokens(dropless_config(10000, 8, 2, 64, 128));
  EXPECT_THROW(moe::cuda::build_topology(more_tokens.plan(), topology, nullptr), std::invalid_argument);
}

}  // namespace
