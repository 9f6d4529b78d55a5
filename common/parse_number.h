// parse_number.h: the project's one reader of numbers written as text. A number is the WHOLE text
// or nothing: "12abc" is not 12, "" and "abc" are not numbers, and an integer beyond int64_t is not
// one either. Every command-line validator (command_line.h) and every value CLI11 does not reach (a
// list inside one flag's value, a config file's text) reads numbers through these two functions, so
// "what counts as a number" is decided once.
//
//   #include "parse_number.h"
//   if (const std::optional<int64_t> n = moe::parse_integer(text)) use(*n);
//
// parse_real accepts what std::stod accepts, NaN and infinities included: whether those are
// allowed is the caller's rule (a setting's check names them; command_line.h's finite_number
// rejects them). parse_integer_list reads a flag's comma-separated integers the same way.
// Tests: ctest -R CommandLine.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace moe {

// The integer that the whole of `text` spells ("12", "-3"), or nothing.
inline std::optional<int64_t> parse_integer(const std::string& text) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {  // not a number, or beyond long long
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return static_cast<int64_t>(value);
}

// The floating-point number that the whole of `text` spells ("0.8", "1e-3", "nan"), or nothing.
inline std::optional<double> parse_real(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {  // not a number, or beyond double
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return value;
}

// The integers of a comma-separated list ("1,2,4,8", a shape "256,512,1024,8,2"), each read whole;
// nothing when an item is not an integer or the list is empty.
inline std::optional<std::vector<int64_t>> parse_integer_list(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    const std::optional<int64_t> value = parse_integer(item);
    if (!value) return std::nullopt;
    values.push_back(*value);
  }
  if (values.empty() || text.back() == ',') return std::nullopt;
  return values;
}

}  // namespace moe
