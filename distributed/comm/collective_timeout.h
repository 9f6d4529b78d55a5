// collective_timeout.h: the --collective-timeout flag of every program that runs on several ranks
// (moe_train_distributed, ep_bench, lessons 06 and 07), declared once so that its meaning, default
// and allowed range are the same everywhere: a collective that has not completed after S seconds
// ends the job (watchdog.h), so a rank that died or stopped never leaves the others waiting.
//
//   double seconds = moe::dist::kDefaultCollectiveTimeoutSeconds;
//   moe::dist::add_collective_timeout_flag(app, seconds);                      // --collective-timeout S
//   CollectiveWatchdog watchdog(rank, ranks, moe::dist::collective_timeout(seconds));
//
// Tests: the programs' rows (tests/programs/, ctest -R programs) and the stopped-rank rows of
// tests/distributed/ (ctest -R StoppedRank).
#pragma once

#include <chrono>
#include <cmath>

#include "command_line.h"   // CLI::App, finite_number
#include "comm/watchdog.h"  // kDefaultCollectiveTimeout

namespace moe::dist {

inline constexpr double kDefaultCollectiveTimeoutSeconds =
    std::chrono::duration<double>(kDefaultCollectiveTimeout).count();
// From 1 s (shorter would end honest waits for a slower peer) to a day.
inline constexpr double kMinCollectiveTimeoutSeconds = 1, kMaxCollectiveTimeoutSeconds = 86400;

// Declares --collective-timeout S on the app, read into `seconds` (whose value is the default shown).
inline void add_collective_timeout_flag(CLI::App& app, double& seconds) {
  app.add_option("--collective-timeout", seconds,
                 "end the job when a collective has not completed in S seconds (a rank died or stopped)")
      ->capture_default_str()
      ->check(finite_number(kMinCollectiveTimeoutSeconds, kMaxCollectiveTimeoutSeconds));
}

// The watchdog's deadline for a flag's value.
inline std::chrono::milliseconds collective_timeout(double seconds) {
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

}  // namespace moe::dist
