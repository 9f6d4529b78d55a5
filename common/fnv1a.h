// fnv1a.h: the project's one hash, 64-bit FNV-1a (Fowler, Noll, Vo). It is the checksum of the
// checkpoint format (checkpoint.h) and the fingerprint that ranks compare before a collective, so
// that every rank knows it was handed the same settings (distributed/comm/rank_agreement.h).
// Header-only; tested by tests/common/test_checkpoint.cpp (the published test vectors).
//
// FNV-1a folds one byte at a time: hash = (hash ^ byte) * prime, starting from the offset basis.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace moe {

inline constexpr uint64_t kFnv1aOffsetBasis = 14695981039346656037ull;
inline constexpr uint64_t kFnv1aPrime = 1099511628211ull;

// The hash of `size` bytes, continued from `hash`.
inline uint64_t fnv1a_64(const void* bytes, size_t size, uint64_t hash = kFnv1aOffsetBasis) {
  const unsigned char* data = static_cast<const unsigned char*>(bytes);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ data[i]) * kFnv1aPrime;
  return hash;
}

inline uint64_t fnv1a_64(std::string_view text, uint64_t hash = kFnv1aOffsetBasis) {
  return fnv1a_64(text.data(), text.size(), hash);
}

// 64-bit values, each as its eight bytes least significant first, so a fingerprint is the same
// on every host whatever its byte order.
inline uint64_t fnv1a_64_words(std::initializer_list<uint64_t> values, uint64_t hash = kFnv1aOffsetBasis) {
  for (uint64_t value : values) {
    for (int byte = 0; byte < 8; ++byte) hash = (hash ^ ((value >> (8 * byte)) & 0xff)) * kFnv1aPrime;
  }
  return hash;
}

}  // namespace moe
