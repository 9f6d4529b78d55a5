// bf16.h: host-side conversions between float / double and __nv_bfloat16, for uploading inputs
// and comparing GPU results with the CPU reference. bf16 keeps float's exponent and 8 bits of
// mantissa: relative rounding error up to 2^-8 ~ 3.9e-3 per value, hence bf16 tolerances ~1e-2.
#pragma once

#include <cuda_bf16.h>

#include <vector>

namespace moe::cuda {

using bf16 = __nv_bfloat16;

inline std::vector<bf16> to_bf16(const std::vector<float>& values) {
  std::vector<bf16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = __float2bfloat16(values[i]);
  return out;
}

template <typename Scalar>  // float or double, e.g. an Eigen matrix's data()
std::vector<bf16> to_bf16(const Scalar* values, size_t count) {
  std::vector<bf16> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = __float2bfloat16(static_cast<float>(values[i]));
  return out;
}

inline std::vector<float> to_float(const std::vector<bf16>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = __bfloat162float(values[i]);
  return out;
}

}  // namespace moe::cuda
