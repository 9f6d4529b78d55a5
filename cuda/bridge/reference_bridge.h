// bridge/reference_bridge.h: moving tensors between the CPU reference (Eigen, double) and the GPU (bf16),
// for the programs that run both: tests, lessons, moe_layer_dump. Header-only; include it only in
// targets that link moe_reference_cpu as well as moe_cuda (the library itself never uses Eigen).
//
// round_bf16 is how every comparison starts: the reference computes from exactly the bf16 values
// the GPU sees, so what remains between them is the GPU's arithmetic, not the inputs' rounding.
#pragma once

#include <type_traits>
#include <vector>

#include "core/bf16.h"  // bf16, to_bf16
#include "types.h"      // moe::ref::Matrix

namespace moe::cuda {

inline ref::Matrix round_bf16(const ref::Matrix& m) {
  return m.unaryExpr([](double v) { return double(__bfloat162float(__float2bfloat16(float(v)))); });
}

inline std::vector<bf16> bf16_of(const ref::Matrix& m) { return to_bf16(m.data(), size_t(m.size())); }

inline std::vector<bf16> bf16_of(const std::vector<ref::Matrix>& matrices) {  // concatenated: [E, rows, cols]
  std::vector<bf16> out;
  for (const ref::Matrix& m : matrices) {
    const auto values = bf16_of(m);
    out.insert(out.end(), values.begin(), values.end());
  }
  return out;
}

// rows x cols values of a downloaded bf16 or fp32 vector, from `offset` on.
template <typename T>
ref::Matrix matrix_of(const std::vector<T>& values, int64_t rows, int64_t cols, size_t offset = 0) {
  ref::Matrix m(rows, cols);
  for (int64_t i = 0; i < m.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>) m.data()[i] = __bfloat162float(values[offset + size_t(i)]);
    else m.data()[i] = values[offset + size_t(i)];
  }
  return m;
}

}  // namespace moe::cuda
