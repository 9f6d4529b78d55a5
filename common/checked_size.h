// checked_size.h: sizes computed from untrusted numbers (a file's header, a config) in checked
// 64-bit arithmetic: a product or sum that would overflow, or a negative factor, gives nothing
// rather than a wrapped value, so a reader can refuse it before anything is allocated. Tensor and
// array shapes (safetensors.cpp, npy.cpp) and a model config's parameter count (model_config.cpp,
// which the checkpoint and weights-file readers compare with what the file holds) size through it.
// Header-only. Tested by tests/common/test_reader_limits.cpp (ctest --test-dir build -R CheckedSize).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>

namespace moe {

// a * b, or nothing when either is negative or the product exceeds 2^63 - 1.
inline std::optional<int64_t> checked_multiply(int64_t a, int64_t b) {
  int64_t product = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// a + b, or nothing when either is negative or the sum exceeds 2^63 - 1.
inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// The product of `factors` (1 for none), or nothing when a factor is negative or the product
// exceeds 2^63 - 1. A zero factor makes the product 0 whatever the others are.
inline std::optional<int64_t> checked_product(std::span<const int64_t> factors) {
  for (int64_t factor : factors) {
    if (factor < 0) return std::nullopt;
    if (factor == 0) return 0;
  }
  int64_t product = 1;
  for (int64_t factor : factors) {
    if (__builtin_mul_overflow(product, factor, &product)) return std::nullopt;
  }
  return product;
}

inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  return checked_product(std::span<const int64_t>(factors.begin(), factors.size()));
}

}  // namespace moe
