// untrusted_json.h: JSON from files a user hands the project (weights, checkpoints, configs, run
// records, the corpus index). Its nesting is bounded before it is parsed, because the JSON library
// walks a value recursively when it serialises or compares it: a few hundred kilobytes of "[[[..."
// would otherwise exhaust the stack inside an error message. And an error message quotes an excerpt
// of a value, never the whole of it.
//
//   nlohmann::json header;
//   if (const std::string why = parse_untrusted_json(text, header); !why.empty()) fail(path, why);
//   fail(path, "data_offsets is " + json_excerpt(entry["data_offsets"]) + "; expected [begin, end]");
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace moe {

// The deepest nesting any reader accepts; the project's own files nest a few levels.
constexpr int kMaxJsonNesting = 64;

// The deepest nesting of arrays and objects in `text` (brackets inside strings do not count).
int json_nesting_depth(std::string_view text);

// Parses `text` into `out`. Returns "" on success, else why not (nested deeper than
// kMaxJsonNesting, or the parser's message), leaving `out` unchanged.
std::string parse_untrusted_json(std::string_view text, nlohmann::json& out);

// At most max_chars of `value`'s JSON text, "..." where it was cut. `value` must have bounded
// nesting (from parse_untrusted_json, or built by the program).
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 120);

}  // namespace moe
