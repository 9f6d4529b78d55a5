// gpu_test_support.h: what the GPU tests share: skipping without a GPU, the reference <-> bf16
// conversions of cuda/bridge/reference_bridge.h, the relative error every comparison uses, and a
// reference model's weights rounded to bf16 (test_model.cpp, test_infer.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "bridge/reference_bridge.h"  // round_bf16, bf16_of, matrix_of
#include "core/device_info.h"       // gpu_available, why_no_gpu
#include "reference_cpu/model.h"    // moe::ref::init_model, parameters (bf16_init)
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

// init_model's weights rounded to bf16, so that the GPU and the reference see the same bytes, and
// their flat fp32 list in parameters() order (what ModelGpu::upload_weights takes).
struct Bf16ModelWeights {
  ref::ModelWeights values;
  std::vector<float> flat;
};

inline Bf16ModelWeights bf16_init(const ModelConfig& config, uint64_t seed) {
  Bf16ModelWeights w{ref::init_model(config, seed), {}};
  ref::ModelGradients unused = ref::zero_weights(config);
  for (ref::Parameter& p : ref::parameters(config, w.values, unused)) {
    *p.value = round_bf16(*p.value);
    for (int64_t i = 0; i < p.value->size(); ++i) w.flat.push_back(float(p.value->data()[i]));
  }
  return w;
}

}  // namespace moe::test
