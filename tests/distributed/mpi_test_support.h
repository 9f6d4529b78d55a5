// mpi_test_support.h: what the multi-rank tests share: the world communicator that
// mpi_test_main.cpp creates, a seed that every rank agrees on, and values every rank can compute
// for any other rank (so a rank knows what its peers sent without being told).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "comm/communicator.h"
#include "comm/watchdog.h"  // CollectiveWatchdog

namespace moe::dist::testing {

// Every process of the launch (mpi_test_main.cpp owns it), its collectives armed on watchdog().
Communicator& world();
// The world's watchdog, for the tests' other communicators (an NcclCommunicator) to share.
CollectiveWatchdog& watchdog();

// Fresh per call: rank 0 draws it from std::random_device and broadcasts it, so every rank uses the
// same one and a failure message can name it.
uint64_t shared_seed();

// splitmix64: a well-mixed 64-bit word from a few integers.
inline uint64_t mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t x = a;
  for (uint64_t y : {b, c, d}) {
    x += 0x9e3779b97f4a7c15ull + y * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
  }
  return x;
}

// A value made from a hash: floats in [-1, 1), never 0; integers and bf16 bit patterns spread.
template <typename Element>
Element value_from(uint64_t hash) {
  if constexpr (std::is_floating_point_v<Element>) {
    const double u = static_cast<double>(hash >> 11) * 0x1.0p-53;  // [0, 1)
    const double v = 2.0 * u - 1.0;
    return static_cast<Element>(v == 0.0 ? 0.5 : v);
  } else {
    return static_cast<Element>(hash);
  }
}

// Bitwise equality, so a NaN pattern moved intact counts as equal.
template <typename Element>
bool same_bits(const Element& a, const Element& b) {
  return std::memcmp(&a, &b, sizeof(Element)) == 0;
}

}  // namespace moe::dist::testing
