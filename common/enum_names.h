// enum_names.h: an enum's values and the names a config file or a command line spells them with, in
// one table, so that printing a value and reading a name cannot drift apart (moe_config.cpp,
// model_config.cpp). Header-only.
#pragma once

#include <array>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace moe {

template <typename Enum, size_t N>
using EnumNames = std::array<std::pair<Enum, std::string_view>, N>;

template <typename Enum, size_t N>
std::string_view name_of(const EnumNames<Enum, N>& names, Enum value) {
  for (const auto& [each, name] : names) {
    if (each == value) return name;
  }
  return "unknown";
}

// Throws std::invalid_argument "unknown <what> '<text>'; allowed: a, b, c".
template <typename Enum, size_t N>
Enum parse_name(const EnumNames<Enum, N>& names, std::string_view text, std::string_view what) {
  std::string allowed;
  for (const auto& [value, name] : names) {
    if (name == text) return value;
    allowed += (allowed.empty() ? "" : ", ") + std::string(name);
  }
  throw std::invalid_argument("unknown " + std::string(what) + " '" + std::string(text) + "'; allowed: " + allowed);
}

}  // namespace moe
