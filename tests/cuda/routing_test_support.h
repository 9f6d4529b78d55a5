// routing_test_support.h: helpers shared by the routing, dispatch, topology and permute GPU tests
// (tests/cuda/test_router.cpp, test_dispatch.cpp, test_topology.cpp, test_permute.cpp): random
// routings, the reference plan of a routing, and comparisons that print one verdict line.
// Host C++ only (compiled by g++); the tests skip where no GPU is present.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/device_buffer.h"  // DeviceBuffer
#include "types.h"               // moe::ref::Matrix, IndexMatrix

namespace moe::test {

// Uniform in [0, 1) from the project's portable recipe (reference_cpu/init.h).
inline double uniform(std::mt19937_64& generator) {
  return static_cast<double>(generator() >> 11) * 0x1.0p-53;
}

// K distinct experts per token, drawn without replacement with weights 1 / (e + 1)^skew, so low
// experts are popular (over capacity) and high ones rare. Experts in `banned` are never chosen
// (an expert with no tokens). Needs K <= E - banned.size().
inline ref::IndexMatrix random_top_experts(int64_t tokens, int64_t num_experts, int64_t top_k,
                                           uint64_t seed, double skew = 1.0,
                                           const std::vector<int>& banned = {}) {
  std::mt19937_64 generator(seed);
  ref::IndexMatrix top(tokens, top_k);
  std::vector<double> weight(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e) weight[e] = 1.0 / std::pow(static_cast<double>(e + 1), skew);
    for (int e : banned) weight[e] = 0.0;
    for (int64_t k = 0; k < top_k; ++k) {
      double total = 0.0;
      for (double w : weight) total += w;
      double pick = uniform(generator) * total;
      int64_t chosen = 0;
      while (chosen < num_experts - 1 && (weight[chosen] == 0.0 || pick >= weight[chosen])) {
        pick -= weight[chosen];
        ++chosen;
      }
      while (weight[chosen] == 0.0) --chosen;  // rounding at the end of the walk
      top(t, k) = static_cast<int32_t>(chosen);
      weight[chosen] = 0.0;
    }
  }
  return top;
}

inline std::vector<int> to_vector(const ref::IndexMatrix& matrix) {
  return std::vector<int>(matrix.data(), matrix.data() + matrix.size());
}

inline std::vector<float> to_float_vector(const ref::Matrix& matrix) {
  std::vector<float> out(matrix.size());
  for (int64_t i = 0; i < matrix.size(); ++i) out[i] = static_cast<float>(matrix.data()[i]);
  return out;
}

// Largest |gpu - ref| over the largest |ref| (a norm-wise relative error: element-wise relative
// errors blow up on values near zero, which cancellations produce); NaN anywhere fails.
// Prints the project's one-line verdict.
template <typename Gpu, typename Ref>
void expect_close(const std::string& name, const std::vector<Gpu>& gpu, const std::vector<Ref>& ref,
                  double tolerance) {
  ASSERT_EQ(gpu.size(), ref.size()) << name;
  double max_error = 0.0, max_ref = 0.0;
  size_t worst = 0;
  bool finite = true;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double g = static_cast<double>(gpu[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(g)) {
      finite = false;
      worst = i;
      break;
    }
    max_ref = std::max(max_ref, std::abs(r));
    if (std::abs(g - r) > max_error) {
      max_error = std::abs(g - r);
      worst = i;
    }
  }
  const double relative = max_error / std::max(max_ref, 1e-30);
  const bool pass = finite && relative <= tolerance;
  std::printf("%s %s max_rel_err=%.3g tol=%.3g (n=%zu)\n", pass ? "PASS" : "FAIL", name.c_str(), relative,
              tolerance, gpu.size());
  EXPECT_TRUE(finite) << name << ": non-finite value at index " << worst;
  EXPECT_LE(relative, tolerance) << name << ": worst index " << worst << " gpu " << static_cast<double>(gpu[worst])
                                 << " ref " << static_cast<double>(ref[worst]);
}

// Exact equality of integer arrays, reporting the first difference.
inline void expect_equal(const std::string& name, const std::vector<int>& gpu, const std::vector<int>& ref) {
  ASSERT_EQ(gpu.size(), ref.size()) << name;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (gpu[i] != ref[i]) {
      ADD_FAILURE() << name << "[" << i << "] = " << gpu[i] << " on the GPU, " << ref[i] << " in the reference";
      return;
    }
  }
}

template <typename T>
std::vector<T> head(const std::vector<T>& values, size_t count) {
  return std::vector<T>(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(std::min(count, values.size())));
}

template <typename T>
std::vector<T> tail(const std::vector<T>& values, size_t from) {
  return std::vector<T>(values.begin() + static_cast<std::ptrdiff_t>(std::min(from, values.size())), values.end());
}

// Integer outputs are poisoned with 0x7F bytes (0x7F7F7F7F), not 0xFF: -1 is a legitimate plan
// value (padding rows, dropped slots), so a kernel that forgot to write it would go unnoticed.
inline constexpr int kIntPoisonByte = 0x7F;
inline constexpr int kFloatPoisonByte = 0xFF;  // NaN

}  // namespace moe::test
