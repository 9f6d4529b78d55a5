// command_line.h: how every program here reads its command line. A program declares its flags on a
// CLI::App (CLI11: the declarations give --help, the conversions and the checks) and hands it to
// parse_command_line, which holds the project's convention (common/program_exit.h):
//   --help, -h       the usage on stdout, exit 0
//   any bad flag     one line on stderr, `program: <message naming the flag as typed>`, exit 2:
//                      --seed needs a value
//                      --seed -1: allowed: an integer >= 0
//                      unknown argument '--no-such-flag'
// The validators below read numbers whole (parse_number.h): "12abc", "nan" and "inf" are refused
// with the flag in the message, as are values outside the allowed range.
//
//   CLI::App app{"what the program does", "moe_bench"};
//   app.add_option("--repeat", repeat, "timed runs per row")->capture_default_str()->check(moe::whole_number(1));
//   if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
//
// CLI11 2.1 (Debian's libcli11-dev, or third_party/CLI11 where it is not installed) collects a
// flag's required value whatever it looks like, so `--seed -1` reaches the validator as "-1".
// Tests: ctest -R CommandLine; tests/programs/ holds every program to the convention.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>  // CLI::App, CLI::Validator, CLI::ParseError

#include "parse_number.h"  // parse_integer, parse_real, parse_integer_list
#include "program_exit.h"  // kExitBadInput

namespace moe {

// ---- what a flag allows, in words ----

// "an integer from 1 to 64", "an integer >= 0", "an integer": the words of every message and help
// line about a whole-number flag, so a range is written once, where the flag is declared.
inline std::string whole_number_range(int64_t lo, int64_t hi) {
  constexpr int64_t lowest = std::numeric_limits<int64_t>::min(), highest = std::numeric_limits<int64_t>::max();
  if (lo != lowest && hi != highest) return "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  if (lo != lowest) return "an integer >= " + std::to_string(lo);
  if (hi != highest) return "an integer <= " + std::to_string(hi);
  return "an integer";
}

inline std::string finite_number_range(double lo, double hi) {
  auto text = [](double x) {
    std::string s = std::to_string(x);
    s.erase(s.find_last_not_of('0') + 1);  // 0.500000 -> 0.5, 1.000000 -> 1.
    if (s.back() == '.') s.pop_back();
    return s;
  };
  const bool low = std::isfinite(lo), high = std::isfinite(hi);
  if (low && high) return "a finite number from " + text(lo) + " to " + text(hi);
  if (low) return "a finite number >= " + text(lo);
  if (high) return "a finite number <= " + text(hi);
  return "a finite number";
}

// ---- validators: the text as typed, before CLI11 converts it ----
// A validator's message is "TEXT: allowed: ..."; parse_command_line puts the flag in front.

// A whole number in [lo, hi].
inline CLI::Validator whole_number(int64_t lo = std::numeric_limits<int64_t>::min(),
                                   int64_t hi = std::numeric_limits<int64_t>::max()) {
  const std::string allowed = whole_number_range(lo, hi);
  return CLI::Validator(
      [lo, hi, allowed](const std::string& text) {
        const std::optional<int64_t> value = parse_integer(text);
        return value && *value >= lo && *value <= hi ? std::string() : text + ": allowed: " + allowed;
      },
      "");
}

// A finite number in [lo, hi]: "nan" and "inf" are refused.
inline CLI::Validator finite_number(double lo = -std::numeric_limits<double>::infinity(),
                                    double hi = std::numeric_limits<double>::infinity()) {
  const std::string allowed = finite_number_range(lo, hi);
  return CLI::Validator(
      [lo, hi, allowed](const std::string& text) {
        const std::optional<double> value = parse_real(text);
        const bool ok = value && std::isfinite(*value) && *value >= lo && *value <= hi;
        return ok ? std::string() : text + ": allowed: " + allowed;
      },
      "");
}

// Comma-separated integers, each in [lo, hi] ("1,2,4,8").
inline CLI::Validator whole_number_list(int64_t lo = std::numeric_limits<int64_t>::min(),
                                        int64_t hi = std::numeric_limits<int64_t>::max()) {
  std::string range = whole_number_range(lo, hi).substr(std::string("an integer").size());  // " from 1 to 64"
  const std::string allowed = "integers separated by commas" + (range.empty() ? "" : "," + range.replace(0, 1, " each "));
  return CLI::Validator(
      [lo, hi, allowed](const std::string& text) {
        const std::optional<std::vector<int64_t>> values = parse_integer_list(text);
        bool ok = values.has_value();
        for (int64_t value : values.value_or(std::vector<int64_t>{})) ok = ok && value >= lo && value <= hi;
        return ok ? std::string() : text + ": allowed: " + allowed;
      },
      "");
}

// One of a list of words ("uniform", "zipf", "both").
inline CLI::Validator one_of(std::vector<std::string> choices) {
  std::string allowed, listed;
  for (size_t i = 0; i < choices.size(); ++i) {
    allowed += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
    listed += (i == 0 ? "" : "|") + choices[i];
  }
  return CLI::Validator(
      [choices, allowed](const std::string& text) {
        for (const std::string& choice : choices) {
          if (text == choice) return std::string();
        }
        return text + ": allowed: " + allowed;
      },
      listed);
}

// ---- parsing ----

// The one-line message for a CLI11 parse error, with the flag as the user typed it in front.
inline std::string command_line_message(const CLI::ParseError& error) {
  const std::string what = error.what();
  const size_t colon = what.find(": ");
  // CLI11: "--seed: 1 required INT missing" (the value is missing).
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&error) != nullptr && colon != std::string::npos &&
      what.size() > 8 && what.compare(what.size() - 8, 8, " missing") == 0) {
    return what.substr(0, colon) + " needs a value";
  }
  // CLI11: "--seed: -1: allowed: ..." (a validator's message after the flag's name).
  if (dynamic_cast<const CLI::ValidationError*>(&error) != nullptr && colon != std::string::npos) {
    return what.substr(0, colon) + " " + what.substr(colon + 2);
  }
  // CLI11 2.1: "The following arguments were not expected: 3 --steps" for `--steps 3`, the
  // arguments last first.
  if (dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr && colon != std::string::npos) {
    std::istringstream listed(what.substr(colon + 2));
    std::vector<std::string> extras;
    for (std::string word; listed >> word;) extras.insert(extras.begin(), word);
    std::string rest;
    for (size_t i = 1; i < extras.size(); ++i) rest += (i == 1 ? "" : " ") + extras[i];
    return "unknown argument '" + (extras.empty() ? std::string() : extras.front()) + "'" +
           (rest.empty() ? "" : " (also not expected: " + rest + ")");
  }
  return what;
}

// Parses argv into `app`'s declarations. Returns nothing when the program should go on; otherwise
// the exit status after printing: 0 after the usage for --help, kExitBadInput after one line naming
// the bad flag.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& error) {
    std::fprintf(stderr, "%s: %s\n%s --help lists the flags\n", app.get_name().c_str(),
                 command_line_message(error).c_str(), app.get_name().c_str());
    return kExitBadInput;
  }
  return std::nullopt;
}

// The same for arguments already in a vector, the program's name not among them.
inline std::optional<int> parse_command_line(CLI::App& app, const std::vector<std::string>& arguments) {
  std::vector<char*> argv{const_cast<char*>(app.get_name().c_str())};
  for (const std::string& argument : arguments) argv.push_back(const_cast<char*>(argument.c_str()));
  return parse_command_line(app, static_cast<int>(argv.size()), argv.data());
}

}  // namespace moe
