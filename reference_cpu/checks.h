// checks.h: argument checks shared by the public functions of the CPU reference.
//
// Every public entry point validates the config first (moe::validate), then shapes, then values,
// and throws std::invalid_argument whose message names the argument, what was seen and what is
// allowed, e.g. "x has shape [5, 7]; expected [T, D] = [5, 8]".
#pragma once

#include <string_view>
#include <vector>

#include "types.h"  // Matrix

namespace moe::ref {

// Throws unless m is [rows, cols]; legend names the expected shape in the dimension legend ("[T, D]").
void check_shape(std::string_view name, const Matrix& m, int64_t rows, int64_t cols,
                 std::string_view legend);

// Throws on the first NaN or Inf in m, naming its position and value.
void check_finite(std::string_view name, const Matrix& m);

// Throws unless there are `count` matrices, each [rows, cols] and finite; names them name[e].
void check_expert_matrices(std::string_view name, const std::vector<Matrix>& matrices, int64_t count,
                           int64_t rows, int64_t cols, std::string_view legend);

}  // namespace moe::ref
