// uniform.h: the project's one reproducible uniform draw. Values come from std::mt19937_64 with our
// own (word >> 11) * 2^-53, not from <random>'s distributions, whose algorithms differ between
// standard libraries: the same seed gives the same numbers on every platform, so a GPU program can
// regenerate what the CPU reference drew (reference_cpu/init.h, parameter_layout.h's initial values).
#pragma once

#include <random>

namespace moe {

// Uniform in [-scale, scale).
inline double uniform_symmetric(std::mt19937_64& generator, double scale) {
  const double u = static_cast<double>(generator() >> 11) * 0x1.0p-53;  // [0, 1), 53 random bits
  return scale * (2.0 * u - 1.0);
}

}  // namespace moe
