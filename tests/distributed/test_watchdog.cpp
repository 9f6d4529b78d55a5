// test_watchdog.cpp: the collective watchdog (distributed/watchdog.h) in one process: a call
// disarmed in time never fires; one left armed ends the process with exit code 124 and one line that
// names the rank, the call, how long it waited and the peer where known; a call armed with a short
// timeout wakes the thread early; the abort hooks run, a removed one does not, and one that never
// returns delays the end only by the grace period. Each firing runs in a child process (a death test).
//   ctest --test-dir build -R DistributedWatchdog
//   build/tests/distributed/test_distributed_watchdog
// The jobs with a rank killed, stopped or skipping a collective: fault_rank_program.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <unistd.h>  // _exit

#include "comm/watchdog.h"

namespace moe::dist {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

class Watchdog : public ::testing::Test {
 protected:
  // The child re-executes the test binary: the watchdog's thread is never forked.
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST_F(Watchdog, CallsDisarmedInTimeNeverFire) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(200));
        for (int i = 0; i < 10000; ++i) {
          const auto armed = watchdog.arm("all_reduce_sum (MPI_Allreduce)");
        }
        {
          const auto armed = watchdog.arm("barrier (MPI_Barrier)");  // half the timeout
          std::this_thread::sleep_for(milliseconds(100));
        }
        std::this_thread::sleep_for(milliseconds(500));  // 2.5 timeouts with nothing armed
        std::fprintf(stderr, "still running\n");
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "still running");
}

TEST_F(Watchdog, FiresAfterTheDeadlineNamingRankCallAndWait) {
  const Clock::time_point start = Clock::now();
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(2, 3, milliseconds(300));
        const auto armed = watchdog.arm("all_reduce_sum (MPI_Allreduce)");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode),
      "^\\[moe watchdog\\] rank 2 of 3: all_reduce_sum \\(MPI_Allreduce\\) has not completed after 0\\.[3-9] s "
      "\\(timeout 0\\.3 s\\): a peer rank has died or stopped \\(this rank cannot tell which\\); ending rank 2 "
      "with exit code 124\n");
  const double elapsed = seconds_since(start);
  EXPECT_GT(elapsed, 0.3);
  EXPECT_LT(elapsed, 10.0) << "the child should end at its 0.3 s deadline, not at its 20 s sleep";
}

TEST_F(Watchdog, NamesThePeerWhenTheCallWaitsOnOne) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 4, milliseconds(100));
        const auto armed = watchdog.arm("receive from rank 3", /*peer=*/3);
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode),
      "rank 0 of 4: receive from rank 3 has not completed .*: rank 3, which it waits on, has died or stopped");
}

TEST_F(Watchdog, TheOldestOverdueCallIsNamedNotTheLatest) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(1, 2, milliseconds(300));
        const auto outer = watchdog.arm("all_to_all_v (MPI_Alltoallv)");
        std::this_thread::sleep_for(milliseconds(100));
        {
          const auto inner = watchdog.arm("cudaStreamSynchronize");  // disarmed in time
        }
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode), "rank 1 of 2: all_to_all_v \\(MPI_Alltoallv\\) has not completed");
}

TEST_F(Watchdog, AShortTimeoutWakesTheThreadEarly) {
  // The thread sleeps toward the 60 s default; a call armed with 0.2 s must still end at 0.2 s.
  const Clock::time_point start = Clock::now();
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(60'000));
        std::this_thread::sleep_for(milliseconds(50));  // the thread is asleep by now
        const auto armed = watchdog.arm("wait_for(stream)", milliseconds(200));
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode), "wait_for\\(stream\\) has not completed .*\\(timeout 0\\.2 s\\)");
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST_F(Watchdog, RunsTheAbortHooksBeforeEnding) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(100));
        watchdog.add_abort_hook("NCCL communicator (2 ranks)", [] { std::fprintf(stderr, "the hook ran\n"); });
        const auto armed = watchdog.arm("barrier (ncclAllReduce)");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode),
      "has not completed.*\n\\[moe watchdog\\] rank 0: aborting NCCL communicator \\(2 ranks\\)\nthe hook ran\n");
}

TEST_F(Watchdog, ARemovedHookDoesNotRun) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(100));
        const uint64_t hook = watchdog.add_abort_hook("a destroyed communicator", [] { std::_Exit(3); });
        watchdog.remove_abort_hook(hook);
        const auto armed = watchdog.arm("barrier (MPI_Barrier)");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode), "has not completed");  // 3 if the hook had run
}

TEST_F(Watchdog, AnAbortThatNeverReturnsDelaysTheEndOnlyByTheGrace) {
  const Clock::time_point start = Clock::now();
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(100), /*abort_grace=*/milliseconds(300));
        watchdog.add_abort_hook("a communicator whose abort waits on a dead peer",
                                [] { std::this_thread::sleep_for(std::chrono::hours(1)); });
        const auto armed = watchdog.arm("barrier (MPI_Barrier)");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode), "the abort did not return within 0\\.3 s; ending anyway");
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST_F(Watchdog, FailEndsTheProcessAtOnceWithTheReason) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(1, 2, milliseconds(60'000));
        watchdog.fail("wait_for(stream) on ncclAllReduce", "saw NCCL's asynchronous error 'remote process exited'");
      },
      ::testing::ExitedWithCode(kWatchdogExitCode),
      "^\\[moe watchdog\\] rank 1 of 2: wait_for\\(stream\\) on ncclAllReduce saw NCCL's asynchronous error "
      "'remote process exited'; ending rank 1 with exit code 124\n");
}

TEST_F(Watchdog, AMovedGuardDisarmsOnce) {
  EXPECT_EXIT(
      {
        CollectiveWatchdog watchdog(0, 2, milliseconds(200));
        CollectiveWatchdog::Guard kept;
        {
          CollectiveWatchdog::Guard armed = watchdog.arm("all_gather (MPI_Allgather)");
          kept = std::move(armed);  // the moved-from guard's destructor must not disarm it
        }
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode), "all_gather \\(MPI_Allgather\\) has not completed");
}

TEST_F(Watchdog, ANullWatchdogArmsNothing) {
  const auto armed = arm(nullptr, "all_reduce_sum (MPI_Allreduce)");  // a communicator without one
  SUCCEED();
}

TEST_F(Watchdog, RejectsATimeoutThatIsNotPositive) {
  EXPECT_THROW(CollectiveWatchdog(0, 1, milliseconds(0)), std::invalid_argument);
}

}  // namespace
}  // namespace moe::dist
