// test_stop_signal.cpp: SIGINT and SIGTERM become a stop request the loop reads (common/stop_signal.h).
//   ctest --test-dir build -R StopSignal
#include <gtest/gtest.h>

#include <csignal>

#include "stop_signal.h"

namespace {

// Each case runs in a child process (a death test), so a handler installed there cannot leak into
// the other tests, and the child's exit status carries what the parent checks.
TEST(StopSignal, SignalIsRememberedNotFatalAndTheSecondIsFatal) {
  EXPECT_EXIT(
      {
        moe::install_stop_handlers();
        if (moe::stop_signal() != 0) std::_Exit(10);
        std::raise(SIGTERM);  // the first: remembered, the process goes on
        if (moe::stop_signal() != SIGTERM) std::_Exit(11);
        std::raise(SIGTERM);  // the second: the default action ends the process
        std::_Exit(12);
      },
      ::testing::KilledBySignal(SIGTERM), "");
}

TEST(StopSignal, SigintIsRemembered) {
  EXPECT_EXIT(
      {
        moe::install_stop_handlers();
        std::raise(SIGINT);
        std::_Exit(moe::stop_signal() == SIGINT ? moe::exit_status_for_signal(moe::stop_signal()) : 1);
      },
      ::testing::ExitedWithCode(130), "");
}

TEST(StopSignal, ExitStatusesAndNames) {
  EXPECT_EQ(moe::exit_status_for_signal(SIGINT), 130);
  EXPECT_EQ(moe::exit_status_for_signal(SIGTERM), 143);
  EXPECT_EQ(moe::signal_name(SIGINT), "SIGINT");
  EXPECT_EQ(moe::signal_name(SIGTERM), "SIGTERM");
}

}  // namespace
