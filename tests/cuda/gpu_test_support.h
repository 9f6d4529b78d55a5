// gpu_test_support.h: what the GPU tests share: skipping without a GPU, rounding reference inputs to
// bf16 (so the CPU reference computes from exactly the values the GPU sees), moving Eigen matrices
// to and from bf16 / fp32 host vectors, and the relative error every comparison uses.
#pragma once

#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "bf16.h"         // bf16, to_bf16
#include "device_info.h"  // gpu_available, why_no_gpu
#include "types.h"        // moe::ref::Matrix

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

namespace moe::test {

using ref::Matrix;

inline Matrix round_bf16(const Matrix& m) {
  return m.unaryExpr([](double v) { return double(__bfloat162float(__float2bfloat16(float(v)))); });
}

inline std::vector<cuda::bf16> bf16_of(const Matrix& m) { return cuda::to_bf16(m.data(), size_t(m.size())); }

inline std::vector<cuda::bf16> bf16_of(const std::vector<Matrix>& matrices) {  // concatenated, e.g. [E, D, H]
  std::vector<cuda::bf16> out;
  for (const Matrix& m : matrices) {
    const auto values = bf16_of(m);
    out.insert(out.end(), values.begin(), values.end());
  }
  return out;
}

// rows x cols values of a downloaded bf16 or fp32 vector, from `offset` on.
template <typename T>
Matrix matrix_of(const std::vector<T>& values, int64_t rows, int64_t cols, size_t offset = 0) {
  Matrix m(rows, cols);
  for (int64_t i = 0; i < m.size(); ++i) {
    if constexpr (std::is_same_v<T, cuda::bf16>) m.data()[i] = __bfloat162float(values[offset + size_t(i)]);
    else m.data()[i] = values[offset + size_t(i)];
  }
  return m;
}

// ||got - ref|| / ||ref||, or ||got|| when the reference is zero.
inline double relative_error(const Matrix& got, const Matrix& ref) {
  const double norm = ref.norm();
  return norm > 0 ? (got - ref).norm() / norm : got.norm();
}

}  // namespace moe::test
