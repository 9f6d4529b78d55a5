// test_command_line.cpp: the project's command-line convention (common/command_line.h) and its one
// number reader (common/parse_number.h): numbers read whole, ranges, and messages that name the flag.
//   cmake --build build --target test_command_line && ctest --test-dir build -R CommandLine
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "command_line.h"

namespace {

// Runs `arguments` through an app of three flags; returns the exit status parse_command_line gave
// (-1: it went on) and what it printed on stderr.
struct Parsed {
  int status = -1;
  std::string error;
  uint64_t seed = 1;
  int repeat = 20;
  double warmup_ms = 1000;
  std::string routing = "both";
};
Parsed parse(std::vector<std::string> arguments) {
  Parsed parsed;
  CLI::App app{"a test program", "prog"};
  app.add_option("--seed", parsed.seed)->check(moe::whole_number(0));
  app.add_option("--repeat", parsed.repeat)->check(moe::whole_number(1, 4096));
  app.add_option("--warmup-ms", parsed.warmup_ms)->check(moe::finite_number(0));
  app.add_option("--routing", parsed.routing)->check(moe::one_of({"both", "uniform", "zipf"}));
  arguments.insert(arguments.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : arguments) argv.push_back(a.data());
  testing::internal::CaptureStderr();
  const std::optional<int> status = moe::parse_command_line(app, int(argv.size()), argv.data());
  parsed.error = testing::internal::GetCapturedStderr();
  if (status) parsed.status = *status;
  return parsed;
}

TEST(CommandLine, NumbersAreReadWhole) {
  EXPECT_EQ(moe::parse_integer("12"), 12);
  EXPECT_EQ(moe::parse_integer("-3"), -3);
  EXPECT_FALSE(moe::parse_integer("12abc"));
  EXPECT_FALSE(moe::parse_integer(""));
  EXPECT_FALSE(moe::parse_integer("99999999999999999999"));
  EXPECT_EQ(moe::parse_real("1e-3"), 1e-3);
  EXPECT_FALSE(moe::parse_real("0.5x"));
  EXPECT_TRUE(moe::parse_real("nan"));  // a number; whether it is allowed is the caller's rule
}

TEST(CommandLine, GoodValuesAreTaken) {
  const Parsed parsed = parse({"--seed", "7", "--repeat=5", "--warmup-ms", "2.5", "--routing", "zipf"});
  EXPECT_EQ(parsed.status, -1) << parsed.error;
  EXPECT_EQ(parsed.seed, 7u);
  EXPECT_EQ(parsed.repeat, 5);
  EXPECT_EQ(parsed.warmup_ms, 2.5);
  EXPECT_EQ(parsed.routing, "zipf");
}

TEST(CommandLine, BadValuesNameTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--seed"}, "prog: --seed needs a value"},
      {{"--seed", "-1"}, "prog: --seed -1: allowed: an integer >= 0"},
      {{"--seed", "12abc"}, "prog: --seed 12abc: allowed"},
      {{"--repeat", "0"}, "prog: --repeat 0: allowed: an integer from 1 to 4096"},
      {{"--warmup-ms", "nan"}, "prog: --warmup-ms nan: allowed: a finite number >= 0"},
      {{"--warmup-ms", "inf"}, "prog: --warmup-ms inf: allowed"},
      {{"--routing", "zzz"}, "prog: --routing zzz: allowed: both, uniform or zipf"},
      {{"--no-such-flag"}, "prog: unknown argument '--no-such-flag'"},
      {{"--steps", "3"}, "prog: unknown argument '--steps' (also not expected: 3)"},
  };
  for (const auto& [arguments, message] : cases) {
    const Parsed parsed = parse(arguments);
    EXPECT_EQ(parsed.status, moe::kExitBadInput) << arguments[0];
    EXPECT_NE(parsed.error.find(message), std::string::npos) << parsed.error;
  }
}

TEST(CommandLine, HelpExitsZero) { EXPECT_EQ(parse({"--help"}).status, 0); }

}  // namespace
