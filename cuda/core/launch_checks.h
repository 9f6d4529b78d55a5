// launch_checks.h: the host-side argument checks every routing, dispatch, topology and permute
// launcher runs before it launches anything. A bad size caught here gets a message naming the value
// and the allowed range; caught nowhere, it becomes an out-of-bounds write inside a kernel, which
// CUDA reports (if at all) as an unrelated error at some later call.
// Header-only, host code; included by cuda/moe/router.cu, moe/dispatch.cu, moe/topology.cu, moe/permute.cu.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>

namespace moe::cuda::detail {

inline void check_not_null(const char* function, const char* name, const void* pointer) {
  if (pointer == nullptr) {
    throw std::invalid_argument(std::string(function) + ": " + name + " is a null pointer");
  }
}

// A pointer argument and the name its message gives it.
struct NamedPointer {
  const char* name;
  const void* pointer;
};

// Every pointer of the list, in order: the first null one is the one named.
inline void check_not_null(const char* function, std::initializer_list<NamedPointer> pointers) {
  for (const NamedPointer& p : pointers) check_not_null(function, p.name, p.pointer);
}

// lo <= value <= hi, with `what` saying where the bound comes from (e.g. "kRouterMaxExperts").
inline void check_range(const char* function, const char* name, int64_t value, int64_t lo,
                        int64_t hi, const std::string& what = {}) {
  if (value < lo || value > hi) {
    throw std::invalid_argument(std::string(function) + ": " + name + " = " + std::to_string(value) +
                                "; expected " + std::to_string(lo) + " <= " + name +
                                " <= " + std::to_string(hi) + (what.empty() ? "" : " (" + what + ")"));
  }
}

// Index arithmetic in the kernels is int32 where the CPU reference uses int32 indices too.
inline void check_fits_int32(const char* function, const char* name, int64_t value) {
  check_range(function, name, value, 0, std::numeric_limits<int32_t>::max(),
              "the plan's indices are int32");
}

}  // namespace moe::cuda::detail
