// config_rejection.h: the one form in which every config's validate() reports a bad field
// (moe_config.cpp, model_config.cpp, optimizer_config.cpp, byte_sampling.cpp), so that their
// messages read alike.
// Header-only.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe {

// reject(field, value, allowed) throws std::invalid_argument
// "invalid <config>: <field> = <value>; allowed: <allowed>".
struct ConfigRejection {
  std::string_view config;  // "MoE config", "model config", "schedule", "sampling"

  [[noreturn]] void operator()(std::string_view field, const std::string& value, std::string_view allowed) const {
    std::ostringstream message;
    message << "invalid " << config << ": " << field << " = " << value << "; allowed: " << allowed;
    throw std::invalid_argument(message.str());
  }

  // The rule every size and count field shares: at least 1, allowed "<symbol> >= 1".
  void if_below_one(std::string_view field, int64_t value, std::string_view symbol) const {
    if (value < 1) (*this)(field, std::to_string(value), std::string(symbol) + " >= 1");
  }

  // A size with an upper limit (the documented limits of moe_config.h and model_config.h):
  // at least 1 and at most `most`, allowed "1 <= <symbol> <= <most>".
  void if_outside(std::string_view field, int64_t value, std::string_view symbol, int64_t most) const {
    if (value < 1 || value > most) {
      (*this)(field, std::to_string(value), "1 <= " + std::string(symbol) + " <= " + std::to_string(most));
    }
  }
};

// A double as a stream prints it (1e-05, nan), for the value in a rejection.
inline std::string number_text(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

}  // namespace moe
