// test_gemm.cpp: the row-major cuBLAS wrappers (cuda/core/gemm.h) and the elementwise GeLU
// (cuda/moe/activation.h) against Eigen / the CPU reference, bf16 operands, fp32 accumulation.
// Run: ctest --test-dir build -R 'CudaGemm|CudaActivation'   (skips without a GPU)
#include <gtest/gtest.h>

#include <random>

#include "moe/activation.h"      // gelu_forward, gelu_backward
#include "core/device_buffer.h"  // DeviceBuffer
#include "gpu_test_support.h"    // REQUIRE_GPU, round_bf16, bf16_of, matrix_of, relative_error
#include "expert_ffn.h"          // moe::ref::gelu
#include "core/gemm.h"           // gemm, gemm_batched, gemm_grouped
#include "init.h"                // moe::ref::random_matrix

namespace {

using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;

using namespace moe::test;  // round_bf16, bf16_of, matrix_of, relative_error

TEST(CudaGemm, RowMajorProductsWithTransposes) {
  REQUIRE_GPU();
  moe::cuda::CublasHandle handle;
  std::mt19937_64 rng(101);
  const int m = 77, n = 96, k = 40;
  for (auto [op_a, op_b] : {std::pair{moe::cuda::Op::none, moe::cuda::Op::none},
                            {moe::cuda::Op::transpose, moe::cuda::Op::none},
                            {moe::cuda::Op::none, moe::cuda::Op::transpose}}) {
    const bool ta = op_a == moe::cuda::Op::transpose, tb = op_b == moe::cuda::Op::transpose;
    const Matrix a = round_bf16(moe::ref::random_matrix(ta ? k : m, ta ? m : k, rng));
    const Matrix b = round_bf16(moe::ref::random_matrix(tb ? n : k, tb ? k : n, rng));
    DeviceBuffer<bf16> da(bf16_of(a)), db(bf16_of(b)), dc(size_t(m) * n);
    dc.fill_bytes(0xFF);
    moe::cuda::gemm(handle.get(), op_a, op_b, m, n, k, da.data(), int(a.cols()), db.data(), int(b.cols()),
                    dc.data(), n);
    const Matrix ref = (ta ? Matrix(a.transpose()) : a) * (tb ? Matrix(b.transpose()) : b);
    const Matrix got = matrix_of(dc.download(), m, n);
    ASSERT_TRUE(got.allFinite());
    EXPECT_LT(relative_error(got, ref), 1e-2) << "ta=" << ta << " tb=" << tb;
  }
}

TEST(CudaGemm, BatchedThroughPointerArraysAndGroupedWithUnequalRows) {
  REQUIRE_GPU();
  moe::cuda::CublasHandle handle;
  std::mt19937_64 rng(202);
  const int experts = 5, k = 64, n = 48;
  const std::vector<int> rows = {17, 1, 64, 30, 9};  // the grouped products' row counts
  const int capacity = 64;                           // the batched products' rows per expert
  std::vector<Matrix> a(experts), b(experts);
  std::vector<bf16> a_host, b_host;
  for (int e = 0; e < experts; ++e) {
    a[e] = round_bf16(moe::ref::random_matrix(capacity, k, rng));
    b[e] = round_bf16(moe::ref::random_matrix(k, n, rng));
    auto av = bf16_of(a[e]), bv = bf16_of(b[e]);
    a_host.insert(a_host.end(), av.begin(), av.end());
    b_host.insert(b_host.end(), bv.begin(), bv.end());
  }
  DeviceBuffer<bf16> da(a_host), db(b_host), dc(size_t(experts) * capacity * n);
  DeviceBuffer<const bf16*> a_ptr(experts), b_ptr(experts);
  DeviceBuffer<bf16*> c_ptr(experts);
  moe::cuda::fill_strided_pointers<const bf16>(da.data(), size_t(capacity) * k, experts, a_ptr.data(), nullptr);
  moe::cuda::fill_strided_pointers<const bf16>(db.data(), size_t(k) * n, experts, b_ptr.data(), nullptr);
  moe::cuda::fill_strided_pointers(dc.data(), size_t(capacity) * n, experts, c_ptr.data(), nullptr);
  bf16* const* c_out = c_ptr.data();

  dc.fill_bytes(0xFF);
  moe::cuda::gemm_batched(handle.get(), moe::cuda::Op::none, moe::cuda::Op::none, capacity, n, k,
                          a_ptr.data(), k, b_ptr.data(), n, c_out, n, experts);
  std::vector<bf16> batched = dc.download();
  dc.fill_bytes(0xFF);
  moe::cuda::gemm_grouped(handle.get(), rows, n, k, a_ptr.data(), k, b_ptr.data(), n, c_out, n);
  std::vector<bf16> grouped = dc.download();

  for (int e = 0; e < experts; ++e) {
    const std::vector<bf16> batched_e(batched.begin() + size_t(e) * capacity * n,
                                      batched.begin() + size_t(e + 1) * capacity * n);
    const std::vector<bf16> grouped_e(grouped.begin() + size_t(e) * capacity * n,
                                      grouped.begin() + size_t(e) * capacity * n + size_t(rows[e]) * n);
    const Matrix ref = a[e] * b[e];
    EXPECT_LT(relative_error(matrix_of(batched_e, capacity, n), ref), 1e-2) << "batched expert " << e;
    EXPECT_LT(relative_error(matrix_of(grouped_e, rows[e], n), ref.topRows(rows[e])), 1e-2)
        << "grouped expert " << e;
    // Rows past the group's count were not written: still the poison (NaN).
    if (rows[e] < capacity) {
      EXPECT_TRUE(std::isnan(__bfloat162float(grouped[size_t(e) * capacity * n + size_t(rows[e]) * n])));
    }
  }
}

TEST(CudaGemm, GroupedWithTransposesAndPerGroupSizes) {
  REQUIRE_GPU();
  moe::cuda::CublasHandle handle;
  std::mt19937_64 rng(252);
  // The weight gradient of a grouped FFN: dW[g] [k_rows, n] = A[g]ᵀ B[g], A[g] [rows_g, k_rows],
  // B[g] [rows_g, n]: the inner dimension differs per group.
  const std::vector<int> rows = {5, 33, 1};
  const int k_rows = 24, n = 40, groups = 3;
  std::vector<Matrix> a(groups), b(groups);
  std::vector<bf16> a_host, b_host;
  for (int g = 0; g < groups; ++g) {
    a[g] = round_bf16(moe::ref::random_matrix(rows[g], k_rows, rng));
    b[g] = round_bf16(moe::ref::random_matrix(rows[g], n, rng));
    auto av = bf16_of(a[g]), bv = bf16_of(b[g]);
    a_host.insert(a_host.end(), av.begin(), av.end());
    b_host.insert(b_host.end(), bv.begin(), bv.end());
  }
  DeviceBuffer<bf16> da(a_host), db(b_host), dc(size_t(groups) * k_rows * n);
  std::vector<const bf16*> a_ptrs, b_ptrs;
  std::vector<bf16*> c_ptrs;
  size_t a_offset = 0, b_offset = 0;
  for (int g = 0; g < groups; ++g) {
    a_ptrs.push_back(da.data() + a_offset);
    b_ptrs.push_back(db.data() + b_offset);
    c_ptrs.push_back(dc.data() + size_t(g) * k_rows * n);
    a_offset += size_t(rows[g]) * k_rows;
    b_offset += size_t(rows[g]) * n;
  }
  DeviceBuffer<const bf16*> a_table(a_ptrs), b_table(b_ptrs);
  DeviceBuffer<bf16*> c_table(c_ptrs);
  dc.fill_bytes(0xFF);
  moe::cuda::gemm_grouped(handle.get(), moe::cuda::Op::transpose, moe::cuda::Op::none,
                          std::vector<int>(groups, k_rows), std::vector<int>(groups, n), rows, a_table.data(),
                          k_rows, b_table.data(), n, c_table.data(), n);
  const std::vector<bf16> c = dc.download();
  for (int g = 0; g < groups; ++g) {
    const Matrix got = matrix_of(c, k_rows, n, size_t(g) * k_rows * n);
    ASSERT_TRUE(got.allFinite()) << "group " << g;
    EXPECT_LT(relative_error(got, Matrix(a[g].transpose() * b[g])), 1e-2) << "group " << g;
  }
  EXPECT_THROW(moe::cuda::gemm_grouped(handle.get(), moe::cuda::Op::none, moe::cuda::Op::none, {1, 2}, {3}, {4, 5},
                                       a_table.data(), k_rows, b_table.data(), n, c_table.data(), n),
               std::invalid_argument);
}

TEST(CudaActivation, GeluForwardAndBackwardMatchReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(303);
  const Matrix pre = round_bf16(moe::ref::random_matrix(33, 64, rng, 4.0));
  const Matrix d_hidden = round_bf16(moe::ref::random_matrix(33, 64, rng));
  DeviceBuffer<bf16> d_pre_in(bf16_of(pre)), d_grad(bf16_of(d_hidden)), hidden(pre.size()), d_pre(pre.size());
  hidden.fill_bytes(0xFF);
  d_pre.fill_bytes(0xFF);
  moe::cuda::gelu_forward(d_pre_in.data(), hidden.data(), size_t(pre.size()), nullptr);
  moe::cuda::gelu_backward(d_pre_in.data(), d_grad.data(), d_pre.data(), size_t(pre.size()), nullptr);
  Matrix ref_hidden = pre.unaryExpr([](double a) { return moe::ref::gelu(a); });
  Matrix ref_d_pre = d_hidden.cwiseProduct(pre.unaryExpr([](double a) { return moe::ref::gelu_derivative(a); }));
  EXPECT_LT(relative_error(matrix_of(hidden.download(), 33, 64), ref_hidden), 1e-2);
  EXPECT_LT(relative_error(matrix_of(d_pre.download(), 33, 64), ref_d_pre), 1e-2);
  EXPECT_THROW(moe::cuda::gelu_forward(d_pre_in.data(), hidden.data(), 3, nullptr), std::invalid_argument);
}

}  // namespace
