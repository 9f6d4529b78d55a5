// checks.cpp: argument checks of the CPU reference (see checks.h).
#include "checks.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moe::ref {

void check_shape(std::string_view name, const Matrix& m, int64_t rows, int64_t cols,
                 std::string_view legend) {
  if (m.rows() == rows && m.cols() == cols) return;
  std::ostringstream message;
  message << name << " has shape [" << m.rows() << ", " << m.cols() << "]; expected " << legend
          << " = [" << rows << ", " << cols << "]";
  throw std::invalid_argument(message.str());
}

void check_finite(std::string_view name, const Matrix& m) {
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
      if (std::isfinite(m(i, j))) continue;
      std::ostringstream message;
      message << name << "[" << i << ", " << j << "] = " << m(i, j)
              << "; expected finite values (no NaN or Inf)";
      throw std::invalid_argument(message.str());
    }
  }
}

void check_expert_matrices(std::string_view name, const std::vector<Matrix>& matrices, int64_t count,
                           int64_t rows, int64_t cols, std::string_view legend) {
  if (static_cast<int64_t>(matrices.size()) != count) {
    std::ostringstream message;
    message << name << " has " << matrices.size() << " matrices; expected one per expert, E = "
            << count;
    throw std::invalid_argument(message.str());
  }
  for (size_t e = 0; e < matrices.size(); ++e) {
    const std::string element = std::string(name) + "[" + std::to_string(e) + "]";
    check_shape(element, matrices[e], rows, cols, legend);
    check_finite(element, matrices[e]);
  }
}

}  // namespace moe::ref
