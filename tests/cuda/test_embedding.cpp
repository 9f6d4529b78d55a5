// test_embedding.cpp: the token + position embedding on the GPU (cuda/model/embedding.h), forward and
// backward, against the embedding lines of moe::ref::model_forward / model_backward
// (reference_cpu/model.cpp), which are not a function of their own: the test computes the same
// formulas in double, here, from the same bf16-rounded tables.
// Run: ctest --test-dir build -R CudaEmbedding   (skips without a GPU)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/device_buffer.h"  // DeviceBuffer
#include "model/embedding.h"     // embedding_forward, embedding_backward
#include "gpu_test_support.h"    // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error, floats_of
#include "init.h"                // moe::ref::random_matrix

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;
using namespace moe::test;

constexpr double kBf16Tolerance = 2e-2;
constexpr double kFp32Tolerance = 1e-5;
constexpr int64_t V = moe::cuda::kEmbeddingVocabulary;

Matrix as_float(const Matrix& m) { return m.unaryExpr([](double v) { return double(float(v)); }); }

// `distinct` bytes in use: few distinct bytes make many tokens share a row of the scatter-add.
std::vector<int32_t> random_bytes(int64_t count, int distinct, std::mt19937_64& rng) {
  std::vector<int32_t> out(static_cast<size_t>(count));
  for (auto& b : out) b = int32_t((rng() % uint64_t(distinct)) * (256 / distinct));
  return out;
}

void check_embedding(int64_t N, int64_t S, int64_t D, int distinct, bool accumulate, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " S=" + std::to_string(S) + " D=" + std::to_string(D) +
               " distinct=" + std::to_string(distinct) + " accumulate=" + std::to_string(accumulate));
  std::mt19937_64 rng(seed);
  const int64_t T = N * S;
  const Matrix token_table = round_bf16(moe::ref::random_matrix(V, D, rng));
  const Matrix position_table = round_bf16(moe::ref::random_matrix(S, D, rng));
  const std::vector<int32_t> tokens = random_bytes(T, distinct, rng);
  const Matrix dx = as_float(moe::ref::random_matrix(T, D, rng));
  const Matrix d_token_before = as_float(moe::ref::random_matrix(V, D, rng));  // the tied projection's share

  // The reference, in double: model.cpp's "x0[t] = token_embedding[inputs[t]] + position_embedding[s]".
  Matrix x_ref(T, D);
  Matrix d_token_ref = accumulate ? d_token_before : Matrix::Zero(V, D);
  Matrix d_position_ref = Matrix::Zero(S, D);
  for (int64_t t = 0; t < T; ++t) {
    x_ref.row(t) = token_table.row(tokens[size_t(t)]) + position_table.row(t % S);
    d_token_ref.row(tokens[size_t(t)]) += dx.row(t);
    d_position_ref.row(t % S) += dx.row(t);
  }

  DeviceBuffer<int32_t> tokens_gpu(tokens);
  DeviceBuffer<bf16> token_gpu(bf16_of(token_table)), position_gpu(bf16_of(position_table)), x_gpu(size_t(T * D));
  DeviceBuffer<float> dx_gpu(floats_of(dx)), d_token(size_t(V * D)), d_position(size_t(S * D));
  x_gpu.fill_bytes(0xFF);
  d_position.fill_bytes(0xFF);
  if (accumulate) d_token.upload(floats_of(d_token_before));
  else d_token.fill_bytes(0xFF);

  moe::cuda::embedding_forward(tokens_gpu.data(), token_gpu.data(), position_gpu.data(), x_gpu.data(), N, S, D, nullptr);
  DeviceBuffer<float> scratch(size_t(moe::cuda::embedding_backward_scratch_floats(T, D)));
  scratch.fill_bytes(0xFF);
  moe::cuda::embedding_backward(tokens_gpu.data(), dx_gpu.data(), d_token.data(), d_position.data(), scratch.data(), N,
                                S, D, accumulate, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  const double x_error = relative_error(matrix_of(x_gpu.download(), T, D), x_ref);
  const double token_error = relative_error(matrix_of(d_token.download(), V, D), d_token_ref);
  const double position_error = relative_error(matrix_of(d_position.download(), S, D), d_position_ref);
  EXPECT_LT(x_error, kBf16Tolerance);
  EXPECT_LT(token_error, kFp32Tolerance);
  EXPECT_LT(position_error, kFp32Tolerance);
  std::printf("%s embedding N=%lld S=%lld D=%lld: x %.1e (tol %.0e), d_token %.1e, d_position %.1e (tol %.0e)\n",
              x_error < kBf16Tolerance && token_error < kFp32Tolerance && position_error < kFp32Tolerance ? "PASS"
                                                                                                          : "FAIL",
              (long long)N, (long long)S, (long long)D, x_error, kBf16Tolerance, token_error, position_error,
              kFp32Tolerance);
}

TEST(CudaEmbedding, MatchesReferenceOnAwkwardSizes) {
  REQUIRE_GPU();
  check_embedding(1, 37, 48, 256, false, 1);    // one sequence, S not a multiple of 32
  check_embedding(3, 70, 300, 256, true, 2);    // two column slices, the tied share accumulated
  check_embedding(4, 33, 64, 4, false, 3);      // four distinct bytes: long scatter-add rows
  check_embedding(2, 300, 40, 16, true, 4);     // more tokens than one tile per byte
  check_embedding(5, 431, 96, 4, false, 5);     // three segments of 1024 tokens, the last partial
}

TEST(CudaEmbedding, BackwardIsBitwiseDeterministic) {
  REQUIRE_GPU();
  std::mt19937_64 rng(11);
  const int64_t N = 8, S = 97, D = 96, T = N * S;
  DeviceBuffer<int32_t> tokens(random_bytes(T, 8, rng));
  DeviceBuffer<float> dx(floats_of(moe::ref::random_matrix(T, D, rng)));
  DeviceBuffer<float> d_token(size_t(V * D)), d_position(size_t(S * D));
  DeviceBuffer<float> scratch(size_t(moe::cuda::embedding_backward_scratch_floats(T, D)));
  std::vector<float> first_token, first_position;
  for (int run = 0; run < 2; ++run) {
    d_token.fill_bytes(0xFF);
    d_position.fill_bytes(0xFF);
    moe::cuda::embedding_backward(tokens.data(), dx.data(), d_token.data(), d_position.data(), scratch.data(), N, S, D,
                                  false, nullptr);
    if (run == 0) {
      first_token = d_token.download();
      first_position = d_position.download();
    } else {
      const auto token = d_token.download(), position = d_position.download();
      EXPECT_EQ(0, std::memcmp(token.data(), first_token.data(), token.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(position.data(), first_position.data(), position.size() * sizeof(float)));
    }
  }
}

// The order embedding.h states: each byte's rows of dx added in ascending token order within each
// segment of 1024 tokens, one after another in fp32, then the segments' sums added in segment order.
// The host's float sums in that order give the same bits. T = 2155: three segments, the last partial.
TEST(CudaEmbedding, TokenGradientAddsRowsInTheStatedOrder) {
  REQUIRE_GPU();
  std::mt19937_64 rng(12);
  const int64_t N = 5, S = 431, D = 300, T = N * S;
  const int64_t segment = moe::cuda::kEmbeddingSegmentTokens, segments = (T + segment - 1) / segment;
  const std::vector<int32_t> bytes = random_bytes(T, 4, rng);
  const std::vector<float> dx_host = floats_of(moe::ref::random_matrix(T, D, rng));
  std::vector<float> partial(size_t(segments * V * D), 0.0f), expected(size_t(V * D), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < D; ++j) {
      partial[size_t(((t / segment) * V + bytes[size_t(t)]) * D + j)] += dx_host[size_t(t * D + j)];
    }
  }
  for (int64_t k = 0; k < segments; ++k) {
    for (int64_t i = 0; i < V * D; ++i) expected[size_t(i)] += partial[size_t(k * V * D + i)];
  }
  DeviceBuffer<int32_t> tokens(bytes);
  DeviceBuffer<float> dx(dx_host), d_token(size_t(V * D)), d_position(size_t(S * D));
  DeviceBuffer<float> scratch(size_t(moe::cuda::embedding_backward_scratch_floats(T, D)));
  d_token.fill_bytes(0xFF);
  moe::cuda::embedding_backward(tokens.data(), dx.data(), d_token.data(), d_position.data(), scratch.data(), N, S, D,
                                false, nullptr);
  const std::vector<float> got = d_token.download();
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)));
}

// A byte outside 0..255 gives a NaN row (the loss turns NaN) instead of a read outside the table.
TEST(CudaEmbedding, ByteOutsideTheTableGivesNanRow) {
  REQUIRE_GPU();
  std::mt19937_64 rng(5);
  const int64_t N = 1, S = 5, D = 8;
  DeviceBuffer<int32_t> tokens(std::vector<int32_t>{65, 300, 66, -1, 255});
  DeviceBuffer<bf16> token_table(bf16_of(moe::ref::random_matrix(V, D, rng)));
  DeviceBuffer<bf16> position_table(bf16_of(moe::ref::random_matrix(S, D, rng))), x(size_t(N * S * D));
  x.fill_bytes(0xFF);
  moe::cuda::embedding_forward(tokens.data(), token_table.data(), position_table.data(), x.data(), N, S, D, nullptr);
  const Matrix out = matrix_of(x.download(), S, D);
  for (int64_t s = 0; s < S; ++s) {
    const bool bad = s == 1 || s == 3;
    for (int64_t j = 0; j < D; ++j) EXPECT_EQ(bad, std::isnan(out(s, j))) << "s=" << s << " j=" << j;
  }
}

TEST(CudaEmbedding, RejectsBadArguments) {
  REQUIRE_GPU();
  DeviceBuffer<int32_t> tokens(size_t(4));
  DeviceBuffer<bf16> table(size_t(V * 8)), x(size_t(4 * 8));
  DeviceBuffer<float> dx(size_t(4 * 8)), d_table(size_t(V * 8));
  EXPECT_THROW(moe::cuda::embedding_forward(tokens.data(), table.data(), table.data(), x.data(), 0, 4, 8, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::embedding_forward(tokens.data(), table.data(), table.data(), x.data(), 1, 4, 0, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::embedding_forward(nullptr, table.data(), table.data(), x.data(), 1, 4, 8, nullptr),
               std::invalid_argument);
  DeviceBuffer<float> scratch(size_t(moe::cuda::embedding_backward_scratch_floats(4, 8)));
  EXPECT_THROW(moe::cuda::embedding_backward(tokens.data(), dx.data(), d_table.data(), nullptr, scratch.data(), 1, 4, 8,
                                             false, nullptr),
               std::invalid_argument);
  EXPECT_THROW(moe::cuda::embedding_backward(tokens.data(), dx.data(), d_table.data(), d_table.data(), nullptr, 1, 4, 8,
                                             false, nullptr),
               std::invalid_argument);  // no scratch
  EXPECT_THROW(moe::cuda::embedding_backward(tokens.data(), dx.data(), d_table.data(), d_table.data(), scratch.data(), 1,
                                             -4, 8, false, nullptr),
               std::invalid_argument);
}

}  // namespace
