// gpu_test_support.h: what the GPU tests share: skipping without a GPU, the reference <-> bf16
// conversions of cuda/core/reference_bridge.h, and the relative error every comparison uses.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "core/reference_bridge.h"  // round_bf16, bf16_of, matrix_of
#include "core/device_info.h"       // gpu_available, why_no_gpu
#include "types.h"                  // moe::ref::Matrix

#define REQUIRE_GPU() \
  if (!moe::cuda::gpu_available()) GTEST_SKIP() << moe::cuda::why_no_gpu()

namespace moe::test {

using ref::Matrix;

using cuda::bf16_of;  // from reference_bridge.h
using cuda::matrix_of;
using cuda::round_bf16;

// The values of m as fp32, in storage order: an fp32 device input built from a reference matrix.
inline std::vector<float> floats_of(const Matrix& m) {
  std::vector<float> out(static_cast<size_t>(m.size()));
  for (int64_t i = 0; i < m.size(); ++i) out[static_cast<size_t>(i)] = static_cast<float>(m.data()[i]);
  return out;
}

// ||got - ref|| / ||ref||, or ||got|| when the reference is zero.
inline double relative_error(const Matrix& got, const Matrix& ref) {
  const double norm = ref.norm();
  return norm > 0 ? (got - ref).norm() / norm : got.norm();
}

}  // namespace moe::test
