// test_adamw.cpp: the optimizer step on the GPU (cuda/model/optimizer.h): the global gradient norm, clipping
// and AdamW over fp32 master weights, against moe::ref::clip_gradient_norm and moe::ref::adamw_step
// (reference_cpu/optimizer.h) over the same parameters, for several steps, with the learning rate
// of moe::learning_rate (warm-up then cosine). All fp32: tolerance 1e-5.
// Run: ctest --test-dir build -R CudaAdamW   (skips without a GPU)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/optimizer.h"          // gradient_norm, adamw_update, AdamWStep
#include "core/device_buffer.h"       // DeviceBuffer
#include "gpu_test_support.h"         // REQUIRE_GPU, matrix_of, relative_error
#include "init.h"                     // moe::ref::random_matrix
#include "reference_cpu/optimizer.h"  // moe::ref::adamw_step, clip_gradient_norm, learning_rate

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kFp32Tolerance = 1e-5;

Matrix as_float(const Matrix& m) { return m.unaryExpr([](double v) { return double(float(v)); }); }

// A few tensors shaped like the model's: matrices decay, LayerNorm-like rows do not.
struct Tensor {
  int64_t rows, cols;
  bool weight_decay;
};

void check_adamw(const std::vector<Tensor>& tensors, double max_norm, bool use_clip_scale, uint64_t seed) {
  SCOPED_TRACE("max_norm=" + std::to_string(max_norm) + " use_clip_scale=" + std::to_string(use_clip_scale));
  std::mt19937_64 rng(seed);
  const moe::AdamWConfig config{0.9, 0.95, 1e-8, 0.1};
  const moe::ScheduleConfig schedule{1e-2, 2, 6, 0.1};
  std::vector<Matrix> values, gradients;
  std::vector<int64_t> offsets;
  int64_t count = 0;
  for (const Tensor& t : tensors) {
    values.push_back(as_float(moe::ref::random_matrix(t.rows, t.cols, rng, 0.1)));
    gradients.push_back(Matrix::Zero(t.rows, t.cols));
    offsets.push_back(count);
    count += t.rows * t.cols;
  }
  std::vector<moe::ref::Parameter> params;
  for (size_t i = 0; i < tensors.size(); ++i) {
    params.push_back({"tensor." + std::to_string(i), tensors[i].weight_decay, &values[i], &gradients[i]});
  }
  const auto flat = [&](const std::vector<Matrix>& matrices) {
    std::vector<float> out(static_cast<size_t>(count));
    for (size_t i = 0; i < matrices.size(); ++i) {
      for (int64_t j = 0; j < matrices[i].size(); ++j) out[size_t(offsets[i] + j)] = float(matrices[i].data()[j]);
    }
    return out;
  };

  DeviceBuffer<float> weights(flat(values)), grads(static_cast<size_t>(count)), m(static_cast<size_t>(count));
  DeviceBuffer<float> v(static_cast<size_t>(count)), partials(static_cast<size_t>(moe::cuda::kGradientNormBlocks));
  DeviceBuffer<float> norm(1), clip_scale(1);
  DeviceBuffer<bf16> weights_bf16(static_cast<size_t>(count));
  CUDA_CHECK(cudaMemset(m.data(), 0, m.bytes()));
  CUDA_CHECK(cudaMemset(v.data(), 0, v.bytes()));
  weights_bf16.fill_bytes(0xFF);
  moe::ref::AdamWState state;

  for (int64_t step = 0; step < 4; ++step) {
    // Fresh gradients each step; a large scale on the first steps so that clipping engages.
    for (Matrix& g : gradients) g = as_float(moe::ref::random_matrix(g.rows(), g.cols(), rng, step < 2 ? 1.0 : 0.01));
    grads.upload(flat(gradients));
    norm.fill_bytes(0xFF);
    clip_scale.fill_bytes(0xFF);
    const double lr = moe::learning_rate(schedule, step);

    const double norm_ref = moe::ref::clip_gradient_norm(params, use_clip_scale ? max_norm : 0.0);
    moe::ref::adamw_step(config, lr, params, state);

    moe::cuda::gradient_norm(grads.data(), count, partials.data(), norm.data(), clip_scale.data(), float(max_norm), nullptr);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const moe::cuda::AdamWStep s{float(lr), float(config.beta1), float(config.beta2), float(config.eps),
                                   tensors[i].weight_decay ? float(config.weight_decay) : 0.0f, step + 1};
      moe::cuda::adamw_update(s, weights.data() + offsets[i], grads.data() + offsets[i], m.data() + offsets[i],
                              v.data() + offsets[i], weights_bf16.data() + offsets[i],
                              use_clip_scale ? clip_scale.data() : nullptr, tensors[i].rows * tensors[i].cols, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());

    const double norm_error = std::abs(double(norm.download()[0]) - norm_ref) / norm_ref;
    const std::vector<float> got = weights.download();
    const Matrix got_weights = matrix_of(got, 1, count);
    Matrix ref_exact(1, count);
    for (size_t i = 0; i < values.size(); ++i) {
      for (int64_t j = 0; j < values[i].size(); ++j) ref_exact(0, offsets[i] + j) = values[i].data()[j];
    }
    const double weight_error = relative_error(got_weights, ref_exact);
    const std::vector<bf16> copy = weights_bf16.download();
    int copy_mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      copy_mismatches += __bfloat162float(copy[i]) != __bfloat162float(__float2bfloat16(got[i]));
    }
    EXPECT_LT(norm_error, kFp32Tolerance) << "step " << step;
    EXPECT_LT(weight_error, kFp32Tolerance) << "step " << step;
    EXPECT_EQ(copy_mismatches, 0) << "step " << step;
    std::printf("%s adamw step %lld (lr %.2e, norm %.3f, max_norm %.2f): norm %.1e, weights %.1e (tol %.0e), "
                "bf16 copy mismatches %d\n",
                norm_error < kFp32Tolerance && weight_error < kFp32Tolerance && copy_mismatches == 0 ? "PASS" : "FAIL",
                (long long)step, lr, norm_ref, max_norm, norm_error, weight_error, kFp32Tolerance, copy_mismatches);
  }
  // The moments too, after the last step.
  Matrix m_ref(1, count), v_ref(1, count);
  for (size_t i = 0; i < values.size(); ++i) {
    for (int64_t j = 0; j < values[i].size(); ++j) {
      m_ref(0, offsets[i] + j) = state.m[i].data()[j];
      v_ref(0, offsets[i] + j) = state.v[i].data()[j];
    }
  }
  EXPECT_LT(relative_error(matrix_of(m.download(), 1, count), m_ref), kFp32Tolerance);
  EXPECT_LT(relative_error(matrix_of(v.download(), 1, count), v_ref), kFp32Tolerance);
}

TEST(CudaAdamW, MatchesReferenceWithClipping) {
  REQUIRE_GPU();
  // ~70k entries: more than kGradientNormBlocks * 256, so every norm thread sums several.
  check_adamw({{256, 64, true}, {1, 64, false}, {1, 64, false}, {64, 192, true}, {37, 5, true}, {1, 13, false}}, 20.0,
              true, 1);
}

TEST(CudaAdamW, MatchesReferenceWithoutClipping) {
  REQUIRE_GPU();
  check_adamw({{1, 1, true}, {3, 7, false}, {50, 3, true}}, 0.0, false, 2);  // tiny spans, one entry
}

// Over 4 * kGradientNormBlocks * 256 float4s: the norm's unrolled loop runs, not only its remainder.
TEST(CudaAdamW, MatchesReferenceOnALargeBuffer) {
  REQUIRE_GPU();
  check_adamw({{1100, 1024, true}, {3, 3, false}}, 20.0, true, 3);
}

// Arrays at different offsets from a 16-byte boundary: no float4 can cover them alike, so every
// element goes alone; the result is the same update.
TEST(CudaAdamW, ArraysAlignedDifferentlyGoElementByElement) {
  REQUIRE_GPU();
  constexpr int64_t kCount = 1001;
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> w(kCount + 1), g(kCount + 2), m(kCount + 1, 0.0f), v(kCount + 1, 0.0f);
  for (float& x : w) x = uniform(rng);
  for (float& x : g) x = uniform(rng);
  DeviceBuffer<float> dw(w), dg(g), dm(m), dv(v);
  DeviceBuffer<bf16> copy(kCount + 1);
  const moe::cuda::AdamWStep s{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  moe::cuda::adamw_update(s, dw.data() + 1, dg.data() + 2, dm.data() + 1, dv.data() + 1, copy.data() + 1, nullptr,
                          kCount, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = dw.download();
  EXPECT_EQ(got[0], w[0]) << "the element before the span is untouched";
  for (int64_t i = 0; i < kCount; ++i) {
    // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps) plus the decay.
    const double gi = g[size_t(i) + 2], want = w[size_t(i) + 1] * (1.0 - 1e-2 * 0.1) - 1e-2 * gi / (std::abs(gi) + 1e-8);
    ASSERT_NEAR(got[size_t(i) + 1], want, 1e-5 * (1.0 + std::abs(want))) << "element " << i;
  }
}

TEST(CudaAdamW, RejectsBadArguments) {
  REQUIRE_GPU();
  DeviceBuffer<float> buffer(static_cast<size_t>(moe::cuda::kGradientNormBlocks));
  float* p = buffer.data();
  const moe::cuda::AdamWStep good{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  EXPECT_THROW(moe::cuda::gradient_norm(p, 0, p, p, p, 1.0f, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::gradient_norm(p, 4, nullptr, p, p, 1.0f, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::gradient_norm(p, 4, p, p, p, NAN, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::gradient_norm(p + 1, 4, p, p, p, 1.0f, nullptr), std::invalid_argument);  // not 16-byte aligned
  moe::cuda::AdamWStep bad = good;
  bad.step = 0;
  EXPECT_THROW(moe::cuda::adamw_update(bad, p, p, p, p, nullptr, nullptr, 4, nullptr), std::invalid_argument);
  bad = good;
  bad.beta1 = 1.0f;
  EXPECT_THROW(moe::cuda::adamw_update(bad, p, p, p, p, nullptr, nullptr, 4, nullptr), std::invalid_argument);
  bad = good;
  bad.lr = NAN;
  EXPECT_THROW(moe::cuda::adamw_update(bad, p, p, p, p, nullptr, nullptr, 4, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::adamw_update(good, p, p, nullptr, p, nullptr, nullptr, 4, nullptr), std::invalid_argument);
  EXPECT_THROW(moe::cuda::adamw_update(good, p, p, p, p, nullptr, nullptr, 0, nullptr), std::invalid_argument);
}

}  // namespace
