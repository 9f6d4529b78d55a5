// test_layer_norm.cpp: LayerNorm on the GPU (cuda/model/layer_norm.h), forward and backward, against
// moe::ref::layer_norm_forward / layer_norm_backward (reference_cpu/layer_norm.h) computed in
// double from the same bf16-rounded x, gain and bias. y is bf16 (tolerance 2e-2); mean, rstd and
// every gradient are fp32 computations from exact inputs (tolerance 1e-5).
// Run: ctest --test-dir build -R CudaLayerNorm   (skips without a GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/device_buffer.h"        // DeviceBuffer
#include "gpu_test_support.h"          // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error, floats_of
#include "init.h"                      // moe::ref::random_matrix
#include "reference_cpu/layer_norm.h"  // moe::ref::layer_norm_forward / backward
#include "model/layer_norm.h"          // moe::cuda::layer_norm_forward / backward

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kBf16Tolerance = 2e-2;
constexpr double kFp32Tolerance = 1e-5;
constexpr double kEps = 1e-5;

Matrix as_float(const Matrix& m) { return m.unaryExpr([](double v) { return double(float(v)); }); }

void check_layer_norm(int64_t T, int64_t D, bool accumulate, uint64_t seed) {
  SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D) + " accumulate=" + std::to_string(accumulate));
  std::mt19937_64 rng(seed);
  // Rows with a mean away from zero, so the centring matters.
  Matrix x = moe::ref::random_matrix(T, D, rng, 2.0);
  x.array() += 0.7;
  x = round_bf16(x);
  const Matrix gain = round_bf16((moe::ref::random_matrix(1, D, rng, 0.5).array() + 1.0).matrix());
  const Matrix bias = round_bf16(moe::ref::random_matrix(1, D, rng, 0.3));
  const Matrix dy = as_float(moe::ref::random_matrix(T, D, rng));
  const Matrix dx_before = as_float(moe::ref::random_matrix(T, D, rng));  // the gradient that skips the block

  const moe::ref::LayerNormForward ref = moe::ref::layer_norm_forward(x, gain, bias, kEps);
  const moe::ref::LayerNormGradients ref_grad = moe::ref::layer_norm_backward(ref, gain, dy);
  const Matrix mean_ref = x.rowwise().mean();
  const Matrix rstd_ref = ref.rstd;
  const Matrix dx_ref = accumulate ? Matrix(dx_before + ref_grad.x) : ref_grad.x;

  DeviceBuffer<bf16> x_gpu(bf16_of(x)), gain_gpu(bf16_of(gain)), bias_gpu(bf16_of(bias)), y(size_t(T * D));
  DeviceBuffer<float> mean(static_cast<size_t>(T)), rstd(static_cast<size_t>(T)), dy_gpu(floats_of(dy));
  DeviceBuffer<float> dx(size_t(T * D)), d_gain(static_cast<size_t>(D)), d_bias(static_cast<size_t>(D));
  DeviceBuffer<float> scratch(size_t(moe::cuda::layer_norm_backward_scratch_floats(T, D)));
  for (auto* buffer : {&mean, &rstd, &d_gain, &d_bias, &scratch}) buffer->fill_bytes(0xFF);
  y.fill_bytes(0xFF);
  if (accumulate) dx.upload(floats_of(dx_before));
  else dx.fill_bytes(0xFF);

  moe::cuda::layer_norm_forward(x_gpu.data(), gain_gpu.data(), bias_gpu.data(), y.data(), mean.data(), rstd.data(), T,
                                D, float(kEps), nullptr);
  DeviceBuffer<bf16> dx_bf16(size_t(T * D));
  dx_bf16.fill_bytes(0xFF);
  moe::cuda::layer_norm_backward(dy_gpu.data(), x_gpu.data(), mean.data(), rstd.data(), gain_gpu.data(), dx.data(),
                                 d_gain.data(), d_bias.data(), scratch.data(), T, D, accumulate, nullptr,
                                 dx_bf16.data());
  CUDA_CHECK(cudaDeviceSynchronize());
  // dx_bf16 is dx's new value rounded to bf16 (to nearest even), element for element.
  const std::vector<float> dx_values = dx.download();
  std::vector<bf16> dx_rounded(dx_values.size());
  for (size_t i = 0; i < dx_values.size(); ++i) dx_rounded[i] = __float2bfloat16(dx_values[i]);
  EXPECT_EQ(0, std::memcmp(dx_bf16.download().data(), dx_rounded.data(), dx_rounded.size() * sizeof(bf16)));

  const double y_error = relative_error(matrix_of(y.download(), T, D), ref.y);
  const double mean_error = relative_error(matrix_of(mean.download(), T, 1), mean_ref);
  const double rstd_error = relative_error(matrix_of(rstd.download(), T, 1), rstd_ref);
  const double dx_error = relative_error(matrix_of(dx.download(), T, D), dx_ref);
  const double gain_error = relative_error(matrix_of(d_gain.download(), 1, D), ref_grad.gain);
  const double bias_error = relative_error(matrix_of(d_bias.download(), 1, D), ref_grad.bias);
  EXPECT_LT(y_error, kBf16Tolerance);
  EXPECT_LT(mean_error, kFp32Tolerance);
  EXPECT_LT(rstd_error, kFp32Tolerance);
  EXPECT_LT(dx_error, kFp32Tolerance);
  EXPECT_LT(gain_error, kFp32Tolerance);
  EXPECT_LT(bias_error, kFp32Tolerance);
  const bool pass = y_error < kBf16Tolerance && mean_error < kFp32Tolerance && rstd_error < kFp32Tolerance &&
                    dx_error < kFp32Tolerance && gain_error < kFp32Tolerance && bias_error < kFp32Tolerance;
  std::printf("%s layer_norm T=%lld D=%lld: y %.1e (tol %.0e); mean %.1e rstd %.1e dx %.1e d_gain %.1e d_bias %.1e "
              "(tol %.0e)\n",
              pass ? "PASS" : "FAIL", (long long)T, (long long)D, y_error, kBf16Tolerance, mean_error, rstd_error,
              dx_error, gain_error, bias_error, kFp32Tolerance);
}

TEST(CudaLayerNorm, MatchesReferenceOnAwkwardSizes) {
  REQUIRE_GPU();
  check_layer_norm(1, 48, false, 1);     // one row: one partial chunk
  check_layer_norm(37, 96, true, 2);     // the residual gradient accumulated
  check_layer_norm(200, 300, false, 3);  // four row chunks, the last partial; two column slices
  check_layer_norm(130, 1000, true, 4);  // wide rows
  check_layer_norm(3, 4096, false, 5);   // a decode step's rows: six staged rows a block
  check_layer_norm(2, 30000, true, 6);   // too wide to stage in 48 KB: read from global memory
  // The fused backward (D = 128 G, G <= 8): one pass gives dx and the chunk's parameter partials.
  check_layer_norm(1, 128, false, 7);    // one row of one 128-column group
  check_layer_norm(100, 384, true, 8);   // two chunks, the second partial; G = 3
  check_layer_norm(77, 512, false, 9);   // the throughput preset's width
  check_layer_norm(65, 1024, true, 10);  // the widest fused row; a chunk of one row
  check_layer_norm(64, 1152, false, 11); // G = 9: the two-kernel path
}

// The staged forward (a row copied into shared memory first) and the unstaged one (x misaligned by
// one element, so it cannot be read in 16-byte pieces) add in the same order: the same bits.
TEST(CudaLayerNorm, StagedAndUnstagedForwardGiveTheSameBits) {
  REQUIRE_GPU();
  for (const int64_t D : {64, 1000, 4096}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const int64_t T = 19;
    std::mt19937_64 rng{static_cast<uint64_t>(D)};
    Matrix x = moe::ref::random_matrix(T, D, rng, 2.0);
    x.array() += 0.7;
    std::vector<bf16> values = bf16_of(x);
    std::vector<bf16> shifted(values.size() + 1);
    std::copy(values.begin(), values.end(), shifted.begin() + 1);
    DeviceBuffer<bf16> aligned(values), misaligned(shifted);
    DeviceBuffer<bf16> gain(bf16_of(moe::ref::random_matrix(1, D, rng))), bias(bf16_of(moe::ref::random_matrix(1, D, rng)));
    std::vector<std::vector<float>> means, rstds;
    std::vector<std::vector<bf16>> ys;
    for (const bf16* input : {aligned.data(), misaligned.data() + 1}) {
      DeviceBuffer<bf16> y(size_t(T * D));
      DeviceBuffer<float> mean(static_cast<size_t>(T)), rstd(static_cast<size_t>(T));
      moe::cuda::layer_norm_forward(input, gain.data(), bias.data(), y.data(), mean.data(), rstd.data(), T, D, 1e-5f,
                                    nullptr);
      ys.push_back(y.download());
      means.push_back(mean.download());
      rstds.push_back(rstd.download());
    }
    EXPECT_EQ(0, std::memcmp(ys[0].data(), ys[1].data(), ys[0].size() * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(means[0].data(), means[1].data(), means[0].size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(rstds[0].data(), rstds[1].data(), rstds[0].size() * sizeof(float)));
  }
}

TEST(CudaLayerNorm, ParameterGradientsAreBitwiseDeterministic) {
  REQUIRE_GPU();
  for (const int64_t D : {129, 512}) {  // the two-kernel path, then the fused one
    SCOPED_TRACE("D=" + std::to_string(D));
    std::mt19937_64 rng(9);
    const int64_t T = 333;
    DeviceBuffer<bf16> x(bf16_of(moe::ref::random_matrix(T, D, rng))), gain(bf16_of(moe::ref::random_matrix(1, D, rng)));
    DeviceBuffer<bf16> bias(bf16_of(moe::ref::random_matrix(1, D, rng))), y(size_t(T * D));
    DeviceBuffer<float> mean(static_cast<size_t>(T)), rstd(static_cast<size_t>(T)), dx(size_t(T * D));
    DeviceBuffer<float> dy(floats_of(moe::ref::random_matrix(T, D, rng))), d_gain(static_cast<size_t>(D));
    DeviceBuffer<float> d_bias(static_cast<size_t>(D)), scratch(size_t(moe::cuda::layer_norm_backward_scratch_floats(T, D)));
    moe::cuda::layer_norm_forward(x.data(), gain.data(), bias.data(), y.data(), mean.data(), rstd.data(), T, D, 1e-5f,
                                  nullptr);
    std::vector<float> first_gain, first_bias;
    for (int run = 0; run < 2; ++run) {
      moe::cuda::layer_norm_backward(dy.data(), x.data(), mean.data(), rstd.data(), gain.data(), dx.data(), d_gain.data(),
                                     d_bias.data(), scratch.data(), T, D, false, nullptr);
      const auto g = d_gain.download(), b = d_bias.download();
      if (run == 0) {
        first_gain = g;
        first_bias = b;
      } else {
        EXPECT_EQ(0, std::memcmp(g.data(), first_gain.data(), g.size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(b.data(), first_bias.data(), b.size() * sizeof(float)));
      }
    }
  }
}

TEST(CudaLayerNorm, RejectsBadArguments) {
  REQUIRE_GPU();
  DeviceBuffer<bf16> x(size_t(4 * 8)), gain(size_t(8)), y(size_t(4 * 8));
  DeviceBuffer<float> stats(size_t(4)), dx(size_t(4 * 8)), d_param(size_t(8)), scratch(size_t(64));
  EXPECT_THROW(moe::cuda::layer_norm_forward(x.data(), gain.data(), gain.data(), y.data(), stats.data(), stats.data(), 0,
                                             8, 1e-5f, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::layer_norm_forward(x.data(), gain.data(), gain.data(), y.data(), stats.data(), stats.data(), 4,
                                             8, 0.0f, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::layer_norm_forward(x.data(), nullptr, gain.data(), y.data(), stats.data(), stats.data(), 4, 8,
                                             1e-5f, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::layer_norm_backward(dx.data(), x.data(), stats.data(), stats.data(), gain.data(), dx.data(),
                                              d_param.data(), d_param.data(), nullptr, 4, 8, false, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::layer_norm_backward(dx.data(), x.data(), stats.data(), stats.data(), gain.data(), dx.data(),
                                              d_param.data(), d_param.data(), scratch.data(), 4, -8, false, nullptr),
               std::invalid_argument);
}

}  // namespace
