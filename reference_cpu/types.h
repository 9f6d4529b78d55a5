// types.h: the tensor types of the CPU reference (moe::ref), shared by every file in reference_cpu/.
//
// Dimension legend (the project's one legend; see README.md):
//   T tokens, D model width, H expert hidden width, E experts, K top-k,
//   C capacity (rows per expert, dropping / padded), B block size (dropless), rows = computed rows.
// A routed slot is one (token t, choice k) pair, numbered slot = t * K + k.
//
// Everything is double precision: the reference is the oracle, so it should be the last place a
// rounding error hides. Matrices are row-major so that data() has the memory order a GPU kernel uses.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <vector>

namespace moe::ref {

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXd;
using IndexMatrix = Eigen::Matrix<int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using IndexVector = std::vector<int32_t>;  // int32, the index type the GPU kernels use

}  // namespace moe::ref
