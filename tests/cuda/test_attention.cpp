// test_attention.cpp: causal multi-head attention on the GPU (cuda/model/attention.h), forward and
// backward, against moe::ref::attention_forward / attention_backward (reference_cpu/attention.h)
// computed in double from the same bf16-rounded x and weights. Every GPU activation is bf16, every
// product accumulates in fp32: relative errors of a few 1e-3 are expected; the tolerance is 2e-2.
// Run: ctest --test-dir build -R CudaAttention   (skips without a GPU)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "reference_cpu/attention.h"  // moe::ref::attention_forward / backward
#include "model/attention.h"          // moe::cuda::attention_forward / backward, AttentionWorkspace
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/gemm.h"                // CublasHandle
#include "gpu_test_support.h"         // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error
#include "init.h"                     // moe::ref::random_matrix

namespace {

using moe::cuda::AttentionShape;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kTolerance = 2e-2;

void check_attention(AttentionShape shape, uint64_t seed) {
  const int64_t N = shape.batch, S = shape.seq_len, D = shape.model_dim, heads = shape.num_heads, T = N * S;
  const int64_t B = N * heads;
  SCOPED_TRACE("N=" + std::to_string(N) + " S=" + std::to_string(S) + " D=" + std::to_string(D) +
               " heads=" + std::to_string(heads));
  std::mt19937_64 rng(seed);
  // Weights scaled by 1/sqrt(D) so that q, k, v are O(1) and the softmax is neither flat nor one-hot.
  const Matrix x = round_bf16(moe::ref::random_matrix(T, D, rng));
  const Matrix qkv_weights = round_bf16(moe::ref::random_matrix(D, 3 * D, rng, 2.0 / std::sqrt(double(D))));
  const Matrix out_weights = round_bf16(moe::ref::random_matrix(D, D, rng, 1.0 / std::sqrt(double(D))));
  const Matrix d_out = round_bf16(moe::ref::random_matrix(T, D, rng));

  const moe::ref::AttentionForward ref = moe::ref::attention_forward(x, qkv_weights, out_weights, S, heads);
  const moe::ref::AttentionGradients ref_grad =
      moe::ref::attention_backward(x, qkv_weights, out_weights, ref, d_out, S, heads);
  Matrix probs_ref(B * S, S);  // the N * heads matrices [S, S] stacked, index b = n * heads + h as on the GPU
  for (int64_t b = 0; b < B; ++b) probs_ref.block(b * S, 0, S, S) = ref.probs[size_t(b)];

  DeviceBuffer<bf16> x_gpu(bf16_of(x)), qkv_w(bf16_of(qkv_weights)), out_w(bf16_of(out_weights)), d_out_gpu(bf16_of(d_out));
  DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), probs(size_t(B * S * S)), context(size_t(T * D)), out(size_t(T * D));
  DeviceBuffer<float> d_qkv_w(size_t(D * 3 * D)), d_out_w(size_t(D * D)), dx(size_t(T * D));
  moe::cuda::AttentionWorkspace workspace(shape);
  for (auto* buffer : {&qkv, &probs, &context, &out, &workspace.d_scores, &workspace.d_context, &workspace.d_qkv}) {
    buffer->fill_bytes(0xFF);
  }
  for (auto* buffer : {&d_qkv_w, &d_out_w, &dx, &workspace.scores}) buffer->fill_bytes(0xFF);

  moe::cuda::CublasHandle cublas;
  moe::cuda::attention_forward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(), probs.data(),
                               context.data(), out.data(), workspace, nullptr);
  moe::cuda::attention_backward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(), probs.data(),
                                context.data(), d_out_gpu.data(), d_qkv_w.data(), d_out_w.data(), dx.data(), workspace,
                                nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  struct Compared {
    const char* name;
    double error;
  };
  const std::vector<Compared> compared = {
      {"qkv", relative_error(matrix_of(qkv.download(), T, 3 * D), ref.qkv)},
      {"probs", relative_error(matrix_of(probs.download(), B * S, S), probs_ref)},
      {"context", relative_error(matrix_of(context.download(), T, D), ref.context)},
      {"out", relative_error(matrix_of(out.download(), T, D), ref.out)},
      {"dx", relative_error(matrix_of(dx.download(), T, D), ref_grad.x)},
      {"d_qkv_weights", relative_error(matrix_of(d_qkv_w.download(), D, 3 * D), ref_grad.qkv_weights)},
      {"d_out_weights", relative_error(matrix_of(d_out_w.download(), D, D), ref_grad.out_weights)},
  };
  double worst = 0.0;
  for (const Compared& c : compared) {
    EXPECT_LT(c.error, kTolerance) << c.name;
    worst = std::max(worst, c.error);
  }
  std::printf("%s attention N=%lld S=%lld D=%lld heads=%lld: max_rel_err=%.1e tol=%.0e\n",
              worst < kTolerance ? "PASS" : "FAIL", (long long)N, (long long)S, (long long)D, (long long)heads, worst,
              kTolerance);
}

TEST(CudaAttention, MatchesReferenceOnAwkwardSizes) {
  REQUIRE_GPU();
  check_attention({1, 37, 32, 1}, 1);    // one sequence, one head, S not a multiple of 32
  check_attention({2, 70, 96, 3}, 2);    // three heads of width 32
  check_attention({3, 33, 64, 4}, 3);    // heads of width 16
  check_attention({2, 128, 128, 2}, 4);  // longer rows: four warp strides per softmax row
}

// Position s must not see positions after s: changing the last position of a sequence leaves
// every earlier output of that sequence bit-identical.
TEST(CudaAttention, IsCausal) {
  REQUIRE_GPU();
  const AttentionShape shape{2, 45, 32, 2};
  const int64_t T = shape.batch * shape.seq_len, D = shape.model_dim, S = shape.seq_len, B = 2 * 2;
  std::mt19937_64 rng(8);
  Matrix x = round_bf16(moe::ref::random_matrix(T, D, rng));
  DeviceBuffer<bf16> qkv_w(bf16_of(round_bf16(moe::ref::random_matrix(D, 3 * D, rng, 0.3))));
  DeviceBuffer<bf16> out_w(bf16_of(round_bf16(moe::ref::random_matrix(D, D, rng, 0.2))));
  DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), probs(size_t(B * S * S)), context(size_t(T * D)), out(size_t(T * D));
  moe::cuda::AttentionWorkspace workspace(shape);
  moe::cuda::CublasHandle cublas;
  std::vector<Matrix> outputs;
  for (int run = 0; run < 2; ++run) {
    if (run == 1) x.row(S - 1).setConstant(3.0);  // the last position of sequence 0
    DeviceBuffer<bf16> x_gpu(bf16_of(x));
    moe::cuda::attention_forward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(),
                                 probs.data(), context.data(), out.data(), workspace, nullptr);
    outputs.push_back(matrix_of(out.download(), T, D));
  }
  EXPECT_EQ(outputs[0].topRows(S - 1), outputs[1].topRows(S - 1));
  EXPECT_NE(outputs[0].row(S - 1), outputs[1].row(S - 1));
}

TEST(CudaAttention, RejectsBadArguments) {
  REQUIRE_GPU();
  EXPECT_THROW(moe::cuda::AttentionWorkspace({1, 8, 30, 4}), std::invalid_argument);  // 4 does not divide 30
  EXPECT_THROW(moe::cuda::AttentionWorkspace({0, 8, 32, 4}), std::invalid_argument);
  EXPECT_THROW(moe::cuda::AttentionWorkspace({1, 8, 32, 0}), std::invalid_argument);
  const AttentionShape shape{1, 8, 32, 4};
  moe::cuda::AttentionWorkspace workspace(shape);
  DeviceBuffer<bf16> x(size_t(8 * 32)), w(size_t(32 * 96)), qkv(size_t(8 * 96)), probs(size_t(4 * 64));
  DeviceBuffer<bf16> context(size_t(8 * 32)), out(size_t(8 * 32));
  DeviceBuffer<float> d_w(size_t(32 * 96)), dx(size_t(8 * 32));
  moe::cuda::CublasHandle cublas;
  const AttentionShape other{2, 8, 32, 4};  // not the workspace's shape
  EXPECT_THROW(moe::cuda::attention_forward(cublas.get(), other, x.data(), w.data(), w.data(), qkv.data(), probs.data(),
                                            context.data(), out.data(), workspace, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::attention_forward(cublas.get(), shape, x.data(), w.data(), w.data(), qkv.data(), nullptr,
                                            context.data(), out.data(), workspace, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::attention_backward(cublas.get(), shape, x.data(), w.data(), w.data(), qkv.data(), probs.data(),
                                             context.data(), out.data(), d_w.data(), d_w.data(), nullptr, workspace,
                                             nullptr),
               std::invalid_argument);
}

}  // namespace
