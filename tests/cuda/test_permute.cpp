// test_permute.cpp: the GPU gather / scatter (cuda/moe/permute.h) against reference_cpu/permute.h
// and the combine part of moe_backward: permute with fused padding, un-permute and combine, the
// combine backward (d_expert_out, d_combine_weights) and the permute backward (dx).
// Run: ctest --test-dir build -R CudaPermute   (skips without a GPU)
//
// Rows the kernels must not read (padding and unused rows of expert_out and d_permuted_x) hold NaN,
// so reading one shows up as a NaN in the result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/bf16.h"               // bf16, to_bf16, to_float
#include "core/cuda_check.h"         // CUDA_CHECK
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/device_info.h"        // gpu_available, why_no_gpu
#include "reference_cpu/dispatch.h"  // moe::ref::plan_dispatch
#include "moe/dispatch.h"            // DispatchPlanBuffers, build_dispatch_plan (cuda/)
#include "init.h"                    // moe::ref::random_matrix
#include "reference_cpu/permute.h"   // moe::ref::permute_tokens, unpermute_and_combine
#include "routing_test_support.h"
#include "moe/permute.h"             // the launchers under test (cuda/)

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

// bf16 values and the same values as a double matrix.
struct Bf16Matrix {
  std::vector<bf16> values;
  Matrix exact;  // the bf16 values, exactly, in double
};

Bf16Matrix random_bf16(int64_t rows, int64_t cols, std::mt19937_64& generator) {
  const Matrix m = moe::ref::random_matrix(rows, cols, generator);
  Bf16Matrix out{moe::cuda::to_bf16(m.data(), size_t(m.size())), Matrix(rows, cols)};
  for (int64_t i = 0; i < m.size(); ++i) out.exact.data()[i] = __bfloat162float(out.values[size_t(i)]);
  return out;
}

std::vector<double> flat(const Matrix& m) { return std::vector<double>(m.data(), m.data() + m.size()); }

std::vector<double> flat_rows(const std::vector<bf16>& values, size_t first_row, size_t rows, size_t cols) {
  std::vector<double> out(rows * cols);
  for (size_t i = 0; i < out.size(); ++i) out[i] = __bfloat162float(values[first_row * cols + i]);
  return out;
}

// Rows past the plan's total_rows are nobody's: the kernels leave them as they were (the poison).
void expect_untouched(const char* what, const std::vector<bf16>& values, size_t first) {
  size_t changed = 0;
  for (size_t i = first; i < values.size(); ++i) {
    unsigned char bytes[sizeof(bf16)];
    std::memcpy(bytes, &values[i], sizeof(bf16));
    for (unsigned char byte : bytes) changed += byte != kFloatPoisonByte;
  }
  EXPECT_EQ(changed, 0u) << what << ": " << changed << " bytes written past the used rows";
}

void check_permute(moe::Formulation formulation, int T, int E, int K, int D, int B, double capacity_factor,
                   uint64_t seed) {
  SCOPED_TRACE(std::string(moe::to_string(formulation)) + " T=" + std::to_string(T) + " E=" + std::to_string(E) +
               " K=" + std::to_string(K) + " D=" + std::to_string(D) + " B=" + std::to_string(B));
  moe::MoeConfig config;
  config.tokens = T;
  config.model_dim = D;
  config.hidden_dim = B;
  config.num_experts = E;
  config.top_k = K;
  config.formulation = formulation;
  config.capacity_factor = capacity_factor;
  config.block_size = B;
  const moe::ref::IndexMatrix top_experts = random_top_experts(T, E, K, seed, 0.8);
  const moe::ref::DispatchPlan ref_plan = moe::ref::plan_dispatch(config, top_experts);
  const size_t rows = size_t(ref_plan.total_rows);

  std::mt19937_64 generator(seed + 1);
  const Bf16Matrix x = random_bf16(T, D, generator);
  const Bf16Matrix dy = random_bf16(T, D, generator);
  Matrix combine_weights = moe::ref::random_matrix(T, K, generator);  // any sign: the kernels must not care
  const std::vector<float> combine_float = to_float_vector(combine_weights);
  for (int64_t i = 0; i < combine_weights.size(); ++i) combine_weights.data()[i] = combine_float[size_t(i)];

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreate(&stream));
  moe::cuda::DispatchPlanBuffers plan_buffers(config);
  DeviceBuffer<int> device_top(to_vector(top_experts));
  moe::cuda::build_dispatch_plan(device_top.data(), plan_buffers, stream);
  const moe::cuda::DevicePlan plan = plan_buffers.plan();
  const size_t max_rows = size_t(plan.max_rows);

  // Expert outputs and permuted-x gradients: random in the used rows that hold a slot, NaN in the
  // padding and unused rows, which no kernel may read.
  const Bf16Matrix expert_out_used = random_bf16(int64_t(max_rows), D, generator);
  const Bf16Matrix d_permuted_used = random_bf16(int64_t(max_rows), D, generator);
  std::vector<bf16> expert_out = expert_out_used.values, d_permuted = d_permuted_used.values;
  const bf16 nan = __float2bfloat16(std::numeric_limits<float>::quiet_NaN());
  for (size_t r = 0; r < max_rows; ++r) {
    if (r < rows && ref_plan.row_slot[r] >= 0) continue;
    for (int c = 0; c < D; ++c) expert_out[r * D + c] = d_permuted[r * D + c] = nan;
  }
  Matrix expert_out_ref = expert_out_used.exact.topRows(int64_t(rows));
  Matrix d_permuted_ref = d_permuted_used.exact.topRows(int64_t(rows));
  for (size_t r = 0; r < rows; ++r) {
    if (ref_plan.row_slot[r] < 0) expert_out_ref.row(int64_t(r)).setZero(), d_permuted_ref.row(int64_t(r)).setZero();
  }

  DeviceBuffer<bf16> device_x(x.values), device_dy(dy.values), device_expert_out(expert_out),
      device_d_permuted(d_permuted);
  DeviceBuffer<float> device_combine(combine_float);
  DeviceBuffer<bf16> permuted_x(max_rows * D), y(size_t(T) * D), d_expert_out(max_rows * D);
  DeviceBuffer<float> d_combine(size_t(T) * K), dx(size_t(T) * D), dx_accumulated(size_t(T) * D);
  for (auto* buffer : {&permuted_x, &y, &d_expert_out}) buffer->fill_bytes(kFloatPoisonByte, stream);
  for (auto* buffer : {&d_combine, &dx}) buffer->fill_bytes(kFloatPoisonByte, stream);
  const Matrix dx_start = moe::ref::random_matrix(T, D, generator);
  dx_accumulated.upload(to_float_vector(dx_start));

  moe::cuda::permute_tokens(plan, device_x.data(), permuted_x.data(), D, stream);
  moe::cuda::unpermute_and_combine(plan, device_combine.data(), device_expert_out.data(), y.data(), D, stream);
  moe::cuda::combine_backward(plan, device_combine.data(), device_dy.data(), device_expert_out.data(),
                              d_expert_out.data(), d_combine.data(), D, stream);
  moe::cuda::permute_backward(plan, device_d_permuted.data(), dx.data(), D, false, stream);
  moe::cuda::permute_backward(plan, device_d_permuted.data(), dx_accumulated.data(), D, true, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));

  // ---- permute: an exact copy; padding rows are zero, rows past total_rows untouched ----
  const Matrix permuted_ref = moe::ref::permute_tokens(ref_plan, x.exact);
  const std::vector<bf16> permuted = permuted_x.download();
  const std::vector<double> permuted_used = flat_rows(permuted, 0, rows, size_t(D));
  expect_close("permuted_x (an exact copy)", permuted_used, flat(permuted_ref), 0.0);
  expect_untouched("permuted_x rows past total_rows", permuted, rows * D);

  // ---- un-permute and combine: fp32 sums, one bf16 rounding ----
  const Matrix y_ref = moe::ref::unpermute_and_combine(ref_plan, combine_weights, expert_out_ref);
  expect_close("y", flat_rows(y.download(), 0, size_t(T), size_t(D)), flat(y_ref), 1e-2);

  // ---- combine backward, as moe_backward computes it ----
  Matrix d_expert_out_ref = Matrix::Zero(int64_t(max_rows), D);
  Matrix d_combine_ref = Matrix::Zero(T, K);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const int row = ref_plan.slot_row[size_t(t) * K + k];
      if (row < 0) continue;
      d_expert_out_ref.row(row) = combine_weights(t, k) * dy.exact.row(t);
      d_combine_ref(t, k) = dy.exact.row(t).dot(expert_out_ref.row(row));
    }
  }
  const std::vector<bf16> d_expert_out_values = d_expert_out.download();
  expect_close("d_expert_out", flat_rows(d_expert_out_values, 0, rows, size_t(D)),
               flat(Matrix(d_expert_out_ref.topRows(int64_t(rows)))), 1e-2);
  expect_untouched("d_expert_out rows past total_rows", d_expert_out_values, rows * D);
  expect_close("d_combine_weights", d_combine.download(), flat(d_combine_ref), 1e-5);

  // ---- permute backward: each token sums its rows ----
  Matrix dx_ref = Matrix::Zero(T, D);
  for (size_t r = 0; r < rows; ++r) {
    const int slot = ref_plan.row_slot[r];
    if (slot >= 0) dx_ref.row(slot / K) += d_permuted_ref.row(int64_t(r));
  }
  expect_close("dx", dx.download(), flat(dx_ref), 1e-5);
  expect_close("dx (accumulate)", dx_accumulated.download(), flat(Matrix(dx_ref + dx_start)), 1e-5);
}

TEST(CudaPermute, MatchesReferenceInEveryFormulation) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  for (moe::Formulation formulation :
       {moe::Formulation::dropping, moe::Formulation::padded, moe::Formulation::dropless}) {
    check_permute(formulation, 1000, 16, 2, 256, 64, 0.75, ++seed);  // 16-byte path, drops
    check_permute(formulation, 333, 8, 2, 13, 128, 1.0, ++seed);     // D % 8 != 0: the one-value path
    check_permute(formulation, 1, 4, 2, 64, 64, 1.0, ++seed);        // T = 1
    check_permute(formulation, 50, 4, 4, 40, 16, 1.0, ++seed);       // K = E
    check_permute(formulation, 7, 1, 1, 24, 4, 2.0, ++seed);         // E = 1
    check_permute(formulation, 100, 8, 8, 1000, 32, 1.0, ++seed);    // D not a multiple of 256
  }
  check_permute(moe::Formulation::dropless, 16384, 64, 2, 128, 128, 1.0, ++seed);  // a realistic batch
}

TEST(CudaPermute, BadArgumentsAreRejected) {
  REQUIRE_GPU();
  moe::MoeConfig config;
  config.tokens = 10;
  config.model_dim = 8;
  config.hidden_dim = 4;
  config.num_experts = 4;
  config.top_k = 2;
  config.block_size = 4;
  moe::cuda::DispatchPlanBuffers buffers(config);
  const moe::cuda::DevicePlan plan = buffers.plan();
  DeviceBuffer<bf16> a(4096), b(4096);
  DeviceBuffer<float> f(4096);
  EXPECT_THROW(moe::cuda::permute_tokens(plan, a.data(), b.data(), 0, nullptr), std::invalid_argument);  // D = 0
  EXPECT_THROW(moe::cuda::permute_tokens(plan, nullptr, b.data(), 8, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::unpermute_and_combine(plan, nullptr, a.data(), b.data(), 8, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::combine_backward(plan, f.data(), a.data(), a.data(), b.data(), nullptr, 8, nullptr),
               std::invalid_argument);
  moe::cuda::DevicePlan empty_plan;  // T = 0
  EXPECT_THROW(moe::cuda::permute_backward(empty_plan, a.data(), f.data(), 8, false, nullptr), std::invalid_argument);
}

}  // namespace
