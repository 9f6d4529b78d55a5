// test_cross_entropy.cpp: the loss over 256 bytes on the GPU (cuda/model/cross_entropy.h), forward and
// backward, against the cross-entropy lines of moe::ref::model_forward / model_backward
// (reference_cpu/model.cpp: logsumexp - logit[target], mean over T; d_logits = (probs - one_hot) / T),
// which are not a function of their own: the test computes the same formulas in double, here.
// Run: ctest --test-dir build -R CudaCrossEntropy   (skips without a GPU)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "model/cross_entropy.h"  // cross_entropy_forward, cross_entropy_backward
#include "core/device_buffer.h"   // DeviceBuffer
#include "gpu_test_support.h"     // REQUIRE_GPU, matrix_of, relative_error, floats_of
#include "init.h"                 // moe::ref::random_matrix

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kBf16Tolerance = 2e-2;
constexpr double kFp32Tolerance = 1e-5;
constexpr int64_t V = moe::cuda::kCrossEntropyClasses;


void check_cross_entropy(int64_t T, double logit_scale, uint64_t seed) {
  SCOPED_TRACE("T=" + std::to_string(T) + " logit_scale=" + std::to_string(logit_scale));
  std::mt19937_64 rng(seed);
  const Matrix logits = moe::ref::random_matrix(T, V, rng, logit_scale).unaryExpr([](double v) { return double(float(v)); });
  std::vector<int32_t> targets(static_cast<size_t>(T));
  for (auto& target : targets) target = int32_t(rng() % V);

  // The reference, in double, as model.cpp computes it.
  Matrix losses_ref(T, 1), d_logits_ref(T, V);
  double loss_sum = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const double row_max = logits.row(t).maxCoeff();
    const Eigen::RowVectorXd shifted = (logits.row(t).array() - row_max).exp().matrix();
    const double sum = shifted.sum();
    losses_ref(t, 0) = row_max + std::log(sum) - logits(t, targets[size_t(t)]);
    loss_sum += losses_ref(t, 0);
    d_logits_ref.row(t) = shifted / sum;
    d_logits_ref(t, targets[size_t(t)]) -= 1.0;
  }
  d_logits_ref /= double(T);
  const double mean_ref = loss_sum / double(T);

  DeviceBuffer<float> logits_gpu(floats_of(logits)), losses(static_cast<size_t>(T)), mean(1);
  DeviceBuffer<int32_t> targets_gpu(targets);
  DeviceBuffer<bf16> d_logits(size_t(T * V));
  losses.fill_bytes(0xFF);
  mean.fill_bytes(0xFF);
  d_logits.fill_bytes(0xFF);
  moe::cuda::cross_entropy_forward(logits_gpu.data(), targets_gpu.data(), losses.data(), mean.data(), T, nullptr);
  moe::cuda::cross_entropy_backward(logits_gpu.data(), targets_gpu.data(), d_logits.data(), T, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  const double losses_error = relative_error(matrix_of(losses.download(), T, 1), losses_ref);
  const double mean_error = std::abs(double(mean.download()[0]) - mean_ref) / std::abs(mean_ref);
  const double d_logits_error = relative_error(matrix_of(d_logits.download(), T, V), d_logits_ref);
  EXPECT_LT(losses_error, kFp32Tolerance);
  EXPECT_LT(mean_error, kFp32Tolerance);
  EXPECT_LT(d_logits_error, kBf16Tolerance);
  const bool pass = losses_error < kFp32Tolerance && mean_error < kFp32Tolerance && d_logits_error < kBf16Tolerance;
  std::printf("%s cross-entropy T=%lld: losses %.1e, mean %.1e (tol %.0e), d_logits %.1e (tol %.0e)\n",
              pass ? "PASS" : "FAIL", (long long)T, losses_error, mean_error, kFp32Tolerance, d_logits_error,
              kBf16Tolerance);
}

TEST(CudaCrossEntropy, MatchesReferenceOnAwkwardSizes) {
  REQUIRE_GPU();
  check_cross_entropy(1, 3.0, 1);      // one position
  check_cross_entropy(37, 1.0, 2);     // not a multiple of the 8 positions per block
  check_cross_entropy(2051, 8.0, 3);   // peaked rows; more positions than the mean's 1024 threads
}

// A target outside 0..255 makes its loss, the mean and its d_logits row NaN; other rows are untouched.
TEST(CudaCrossEntropy, TargetOutsideTheClassesGivesNan) {
  REQUIRE_GPU();
  std::mt19937_64 rng(7);
  const int64_t T = 3;
  DeviceBuffer<float> logits(floats_of(moe::ref::random_matrix(T, V, rng))), losses(static_cast<size_t>(T)), mean(1);
  DeviceBuffer<int32_t> targets(std::vector<int32_t>{10, 256, 20});
  DeviceBuffer<bf16> d_logits(size_t(T * V));
  moe::cuda::cross_entropy_forward(logits.data(), targets.data(), losses.data(), mean.data(), T, nullptr);
  moe::cuda::cross_entropy_backward(logits.data(), targets.data(), d_logits.data(), T, nullptr);
  const auto l = losses.download();
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));
  EXPECT_TRUE(std::isfinite(l[2]));
  EXPECT_TRUE(std::isnan(mean.download()[0]));
  const Matrix d = matrix_of(d_logits.download(), T, V);
  EXPECT_TRUE(d.row(0).allFinite());
  EXPECT_TRUE(d.row(1).array().isNaN().all());
  EXPECT_TRUE(d.row(2).allFinite());
}

TEST(CudaCrossEntropy, RejectsBadArguments) {
  REQUIRE_GPU();
  DeviceBuffer<float> logits(static_cast<size_t>(V)), losses(1), mean(1);
  DeviceBuffer<int32_t> targets(1);
  DeviceBuffer<bf16> d_logits(static_cast<size_t>(V));
  EXPECT_THROW(moe::cuda::cross_entropy_forward(logits.data(), targets.data(), losses.data(), mean.data(), 0, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::cross_entropy_forward(logits.data(), targets.data(), losses.data(), nullptr, 1, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::cross_entropy_backward(logits.data(), nullptr, d_logits.data(), 1, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::cross_entropy_backward(logits.data(), targets.data(), d_logits.data(), -3, nullptr),
               std::invalid_argument);
}

}  // namespace
