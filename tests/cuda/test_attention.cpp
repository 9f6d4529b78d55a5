// test_attention.cpp: causal multi-head attention on the GPU (cuda/model/attention.h), forward and
// backward, with either core (fused: model/flash_attention.h; unfused: cuBLAS batched products),
// against moe::ref::attention_forward / attention_backward (reference_cpu/attention.h) computed in
// double from the same bf16-rounded x and weights. Every GPU activation is bf16, every product
// accumulates in fp32: relative errors of a few 1e-3 are expected; the tolerance is 2e-2.
// Run: ctest --test-dir build -R CudaAttention   (skips without a GPU)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "reference_cpu/attention.h"  // moe::ref::attention_forward / backward
#include "model/attention.h"          // moe::cuda::attention_forward / backward, AttentionWorkspace
#include "model/flash_attention.h"    // moe::cuda::flash_attention_forward (its own refusals)
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/gemm.h"                // CublasHandle
#include "gpu_test_support.h"         // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error
#include "init.h"                     // moe::ref::random_matrix

namespace {

using moe::cuda::AttentionCore;
using moe::cuda::AttentionSavedBuffer;
using moe::cuda::AttentionShape;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kTolerance = 2e-2;

// Each row's log-sum-exp of its visible scaled scores, from the reference's qkv: [B * S, 1].
Matrix log_sum_exp_of(const Matrix& qkv, const AttentionShape& shape) {
  const int64_t S = shape.seq_len, D = shape.model_dim, heads = shape.num_heads, d = D / heads;
  Matrix lse(shape.batch * heads * S, 1);
  for (int64_t n = 0; n < shape.batch; ++n) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < S; ++i) {
        std::vector<double> scores;
        for (int64_t j = 0; j <= i; ++j) {
          const auto q = qkv.row(n * S + i).segment(h * d, d);
          const auto k = qkv.row(n * S + j).segment(D + h * d, d);
          scores.push_back(q.dot(k) / std::sqrt(double(d)));
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double sum = 0.0;
        for (double s : scores) sum += std::exp(s - top);
        lse((n * heads + h) * S + i, 0) = top + std::log(sum);
      }
    }
  }
  return lse;
}

void check_attention(AttentionShape shape, uint64_t seed, AttentionCore core) {
  const int64_t N = shape.batch, S = shape.seq_len, D = shape.model_dim, heads = shape.num_heads, T = N * S;
  const int64_t B = N * heads;
  SCOPED_TRACE(std::string(moe::cuda::attention_core_name(core)) + " N=" + std::to_string(N) + " S=" +
               std::to_string(S) + " D=" + std::to_string(D) + " heads=" + std::to_string(heads));
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
  DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), context(size_t(T * D)), out(size_t(T * D));
  DeviceBuffer<float> d_qkv_w(size_t(D * 3 * D)), d_out_w(size_t(D * D)), dx(size_t(T * D));
  moe::cuda::AttentionWorkspace workspace(shape, core);
  AttentionSavedBuffer saved(shape, core);
  // NaNs everywhere a kernel writes: a value it forgets to write fails the comparison.
  for (auto* buffer : {&qkv, &context, &out, &workspace.d_scores, &workspace.d_context, &workspace.d_qkv}) {
    buffer->fill_bytes(0xFF);
  }
  for (auto* buffer : {&d_qkv_w, &d_out_w, &dx, &workspace.scores, &workspace.delta}) buffer->fill_bytes(0xFF);
  saved.fill_bytes(0xFF, nullptr);

  moe::cuda::CublasHandle cublas;
  moe::cuda::attention_forward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                               context.data(), out.data(), workspace, nullptr);
  moe::cuda::attention_backward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                                context.data(), d_out_gpu.data(), d_qkv_w.data(), d_out_w.data(), dx.data(), workspace,
                                nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  struct Compared {
    const char* name;
    double error;
  };
  std::vector<Compared> compared = {
      {"qkv", relative_error(matrix_of(qkv.download(), T, 3 * D), ref.qkv)},
      {"context", relative_error(matrix_of(context.download(), T, D), ref.context)},
      {"out", relative_error(matrix_of(out.download(), T, D), ref.out)},
      {"dx", relative_error(matrix_of(dx.download(), T, D), ref_grad.x)},
      {"d_qkv_weights", relative_error(matrix_of(d_qkv_w.download(), D, 3 * D), ref_grad.qkv_weights)},
      {"d_out_weights", relative_error(matrix_of(d_out_w.download(), D, D), ref_grad.out_weights)},
  };
  if (workspace.core == AttentionCore::unfused) {
    DeviceBuffer<bf16> probs_view(size_t(B * S * S));
    CUDA_CHECK(cudaMemcpy(probs_view.data(), saved.at(0).probs, probs_view.size() * sizeof(bf16), cudaMemcpyDefault));
    compared.push_back({"probs", relative_error(matrix_of(probs_view.download(), B * S, S), probs_ref)});
  } else {
    std::vector<float> lse(size_t(B * S));
    CUDA_CHECK(cudaMemcpy(lse.data(), saved.at(0).log_sum_exp, lse.size() * sizeof(float), cudaMemcpyDefault));
    Matrix lse_gpu(B * S, 1);
    for (int64_t i = 0; i < B * S; ++i) lse_gpu(i, 0) = lse[size_t(i)];
    compared.push_back({"log_sum_exp", relative_error(lse_gpu, log_sum_exp_of(ref.qkv, shape))});
  }
  double worst = 0.0;
  for (const Compared& c : compared) {
    EXPECT_LT(c.error, kTolerance) << c.name;
    worst = std::max(worst, c.error);
  }
  std::printf("%s attention (%s) N=%lld S=%lld D=%lld heads=%lld: max_rel_err=%.1e tol=%.0e\n",
              worst < kTolerance ? "PASS" : "FAIL", moe::cuda::attention_core_name(workspace.core), (long long)N,
              (long long)S, (long long)D, (long long)heads, worst, kTolerance);
}

TEST(CudaAttention, MatchesReferenceOnAwkwardSizes) {
  REQUIRE_GPU();
  for (AttentionCore core : {AttentionCore::unfused, AttentionCore::automatic}) {  // automatic: fused where it can
    check_attention({1, 37, 32, 1}, 1, core);    // one sequence, one head, S not a multiple of 32
    check_attention({2, 70, 96, 3}, 2, core);    // three heads of width 32
    check_attention({3, 33, 64, 4}, 3, core);    // heads of width 16 (unfused either way)
    check_attention({2, 128, 128, 2}, 4, core);  // longer rows: four warp strides per softmax row
  }
}

// The fused core at every head width it has kernels for, at lengths that end inside a 64-row tile,
// at S = 1 and with one head.
TEST(CudaAttention, FusedCoreMatchesReferenceAtEveryHeadWidth) {
  REQUIRE_GPU();
  check_attention({1, 1, 64, 1}, 11, AttentionCore::fused);     // S = 1: one key, one query
  check_attention({2, 1, 128, 2}, 12, AttentionCore::fused);
  check_attention({1, 65, 32, 1}, 13, AttentionCore::fused);    // one row into the second tile, d = 32
  check_attention({2, 100, 128, 2}, 14, AttentionCore::fused);  // d = 64, tail of 36
  check_attention({1, 130, 128, 1}, 15, AttentionCore::fused);  // d = 128, one head, three tiles
  check_attention({3, 64, 256, 2}, 16, AttentionCore::fused);   // d = 128, exactly one tile
  check_attention({2, 191, 256, 4}, 17, AttentionCore::fused);  // d = 64, three tiles, tail of 63
}

// The fused core's backward gives every output one writer: two runs give the same bits.
TEST(CudaAttention, FusedCoreIsDeterministic) {
  REQUIRE_GPU();
  const AttentionShape shape{3, 150, 128, 2};
  const int64_t T = shape.batch * shape.seq_len, D = shape.model_dim;
  std::mt19937_64 rng(21);
  DeviceBuffer<bf16> x(bf16_of(round_bf16(moe::ref::random_matrix(T, D, rng))));
  DeviceBuffer<bf16> qkv_w(bf16_of(round_bf16(moe::ref::random_matrix(D, 3 * D, rng, 0.2))));
  DeviceBuffer<bf16> out_w(bf16_of(round_bf16(moe::ref::random_matrix(D, D, rng, 0.1))));
  DeviceBuffer<bf16> d_out(bf16_of(round_bf16(moe::ref::random_matrix(T, D, rng))));
  DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), context(size_t(T * D)), out(size_t(T * D));
  DeviceBuffer<float> d_qkv_w(size_t(D * 3 * D)), d_out_w(size_t(D * D)), dx(size_t(T * D));
  moe::cuda::AttentionWorkspace workspace(shape, AttentionCore::fused);
  AttentionSavedBuffer saved(shape, AttentionCore::fused);
  moe::cuda::CublasHandle cublas;
  std::vector<std::vector<bf16>> d_qkv_runs;
  std::vector<std::vector<float>> dx_runs;
  for (int run = 0; run < 2; ++run) {
    moe::cuda::attention_forward(cublas.get(), shape, x.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                                 context.data(), out.data(), workspace, nullptr);
    moe::cuda::attention_backward(cublas.get(), shape, x.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                                  context.data(), d_out.data(), d_qkv_w.data(), d_out_w.data(), dx.data(), workspace,
                                  nullptr);
    d_qkv_runs.push_back(workspace.d_qkv.download());
    dx_runs.push_back(dx.download());
  }
  ASSERT_EQ(d_qkv_runs[0].size(), d_qkv_runs[1].size());
  EXPECT_EQ(0, std::memcmp(d_qkv_runs[0].data(), d_qkv_runs[1].data(), d_qkv_runs[0].size() * sizeof(bf16)));
  EXPECT_EQ(dx_runs[0], dx_runs[1]);
}

// The fused and unfused cores compute the same function: outputs and gradients agree closely (the
// rounding points differ: the fused core rounds p after the running maximum, not the final one).
TEST(CudaAttention, FusedAndUnfusedCoresAgree) {
  REQUIRE_GPU();
  // The throughput preset's S and head width on 2 sequences (at 4 x 256 x 512 racecheck reports
  // hazards inside cuBLAS's own projection kernels, none in ours).
  const AttentionShape shape{2, 256, 256, 4};
  const int64_t T = shape.batch * shape.seq_len, D = shape.model_dim;
  std::mt19937_64 rng(31);
  DeviceBuffer<bf16> x(bf16_of(round_bf16(moe::ref::random_matrix(T, D, rng))));
  DeviceBuffer<bf16> qkv_w(bf16_of(round_bf16(moe::ref::random_matrix(D, 3 * D, rng, 2.0 / std::sqrt(double(D))))));
  DeviceBuffer<bf16> out_w(bf16_of(round_bf16(moe::ref::random_matrix(D, D, rng, 1.0 / std::sqrt(double(D))))));
  DeviceBuffer<bf16> d_out(bf16_of(round_bf16(moe::ref::random_matrix(T, D, rng))));
  moe::cuda::CublasHandle cublas;
  std::vector<Matrix> outs, dxs;
  for (AttentionCore core : {AttentionCore::fused, AttentionCore::unfused}) {
    DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), context(size_t(T * D)), out(size_t(T * D));
    DeviceBuffer<float> d_qkv_w(size_t(D * 3 * D)), d_out_w(size_t(D * D)), dx(size_t(T * D));
    moe::cuda::AttentionWorkspace workspace(shape, core);
    AttentionSavedBuffer saved(shape, core);
    moe::cuda::attention_forward(cublas.get(), shape, x.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                                 context.data(), out.data(), workspace, nullptr);
    moe::cuda::attention_backward(cublas.get(), shape, x.data(), qkv_w.data(), out_w.data(), qkv.data(), saved.at(0),
                                  context.data(), d_out.data(), d_qkv_w.data(), d_out_w.data(), dx.data(), workspace,
                                  nullptr);
    outs.push_back(matrix_of(out.download(), T, D));
    dxs.push_back(matrix_of(dx.download(), T, D));
  }
  EXPECT_LT(relative_error(outs[0], outs[1]), 1e-2);
  EXPECT_LT(relative_error(dxs[0], dxs[1]), 2e-2);
}

// Position s must not see positions after s: changing the last position of a sequence leaves
// every earlier output of that sequence bit-identical.
TEST(CudaAttention, IsCausal) {
  REQUIRE_GPU();
  const AttentionShape shape{2, 45, 64, 2};  // heads of 32: both cores
  const int64_t T = shape.batch * shape.seq_len, D = shape.model_dim, S = shape.seq_len;
  std::mt19937_64 rng(8);
  const Matrix x = round_bf16(moe::ref::random_matrix(T, D, rng));
  DeviceBuffer<bf16> qkv_w(bf16_of(round_bf16(moe::ref::random_matrix(D, 3 * D, rng, 0.3))));
  DeviceBuffer<bf16> out_w(bf16_of(round_bf16(moe::ref::random_matrix(D, D, rng, 0.2))));
  DeviceBuffer<bf16> qkv(size_t(T * 3 * D)), context(size_t(T * D)), out(size_t(T * D));
  for (AttentionCore core : {AttentionCore::fused, AttentionCore::unfused}) {
    SCOPED_TRACE(moe::cuda::attention_core_name(core));
    moe::cuda::AttentionWorkspace workspace(shape, core);
    AttentionSavedBuffer saved(shape, core);
    moe::cuda::CublasHandle cublas;
    std::vector<Matrix> outputs;
    for (int run = 0; run < 2; ++run) {
      Matrix changed = x;
      if (run == 1) changed.row(S - 1).setConstant(3.0);  // the last position of sequence 0
      DeviceBuffer<bf16> x_gpu(bf16_of(changed));
      moe::cuda::attention_forward(cublas.get(), shape, x_gpu.data(), qkv_w.data(), out_w.data(), qkv.data(),
                                   saved.at(0), context.data(), out.data(), workspace, nullptr);
      outputs.push_back(matrix_of(out.download(), T, D));
    }
    EXPECT_EQ(outputs[0].topRows(S - 1), outputs[1].topRows(S - 1));
    EXPECT_NE(outputs[0].row(S - 1), outputs[1].row(S - 1));
  }
}

TEST(CudaAttention, RejectsBadArguments) {
  REQUIRE_GPU();
  EXPECT_THROW(moe::cuda::AttentionWorkspace({1, 8, 30, 4}), std::invalid_argument);  // 4 does not divide 30
  EXPECT_THROW(moe::cuda::AttentionWorkspace({0, 8, 32, 4}), std::invalid_argument);
  EXPECT_THROW(moe::cuda::AttentionWorkspace({1, 8, 32, 0}), std::invalid_argument);
  // The fused core asked for a head width it has no kernels for (8 here); automatic falls back.
  EXPECT_THROW(moe::cuda::AttentionWorkspace({1, 8, 32, 4}, AttentionCore::fused), std::invalid_argument);
  EXPECT_EQ(moe::cuda::AttentionWorkspace({1, 8, 32, 4}).core, AttentionCore::unfused);
  EXPECT_EQ(moe::cuda::AttentionWorkspace({1, 8, 64, 2}).core, AttentionCore::fused);
  const AttentionShape shape{1, 8, 32, 4};
  moe::cuda::AttentionWorkspace workspace(shape);
  AttentionSavedBuffer saved(shape, AttentionCore::unfused);
  const moe::cuda::AttentionSaved probs = saved.at(0);
  DeviceBuffer<bf16> x(size_t(8 * 32)), w(size_t(32 * 96)), qkv(size_t(8 * 96));
  DeviceBuffer<bf16> context(size_t(8 * 32)), out(size_t(8 * 32));
  DeviceBuffer<float> d_w(size_t(32 * 96)), dx(size_t(8 * 32));
  moe::cuda::CublasHandle cublas;
  const AttentionShape other{2, 8, 32, 4};  // not the workspace's shape
  EXPECT_THROW(moe::cuda::attention_forward(cublas.get(), other, x.data(), w.data(), w.data(), qkv.data(), probs,
                                            context.data(), out.data(), workspace, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::attention_forward(cublas.get(), shape, x.data(), w.data(), w.data(), qkv.data(), {},
                                            context.data(), out.data(), workspace, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::attention_backward(cublas.get(), shape, x.data(), w.data(), w.data(), qkv.data(), probs,
                                             context.data(), out.data(), d_w.data(), d_w.data(), nullptr, workspace,
                                             nullptr),
               std::invalid_argument);

  // The fused core called directly: a head width without kernels, a null pointer, a pointer that
  // 16-byte copies cannot read.
  const AttentionShape fused{1, 8, 64, 1};  // d = 64
  DeviceBuffer<bf16> fused_qkv(size_t(8 * 3 * 64 + 8)), fused_context(size_t(8 * 64));
  DeviceBuffer<float> lse(size_t(8));
  EXPECT_THROW(moe::cuda::flash_attention_forward({1, 8, 64, 4}, fused_qkv.data(), fused_context.data(), lse.data(),
                                                  nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::flash_attention_forward(fused, nullptr, fused_context.data(), lse.data(), nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::flash_attention_forward(fused, fused_qkv.data() + 1, fused_context.data(), lse.data(),
                                                  nullptr),
               std::invalid_argument);
  moe::cuda::flash_attention_forward(fused, fused_qkv.data() + 8, fused_context.data(), lse.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());  // 8 bf16 = 16 bytes in: aligned, runs
  // The backward reads the context 16 bytes at a time too (the delta).
  DeviceBuffer<bf16> fused_d_context(size_t(8 * 64)), fused_d_qkv(size_t(8 * 3 * 64));
  DeviceBuffer<float> fused_delta(size_t(8));
  EXPECT_THROW(moe::cuda::flash_attention_backward(fused, fused_qkv.data(), fused_context.data() + 1, lse.data(),
                                                   fused_d_context.data(), fused_delta.data(), fused_d_qkv.data(),
                                                   nullptr),
               std::invalid_argument);
}

}  // namespace
