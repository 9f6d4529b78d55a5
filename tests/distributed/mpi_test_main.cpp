// mpi_test_main.cpp: GoogleTest's main for tests that run under mpiexec, one process per rank.
//
// Every rank runs every test. Rank 0 prints GoogleTest's usual report; the other ranks print only
// their failures, each line tagged with the rank. At the end the ranks sum their failure flags, so
// a test that fails on any one rank makes every rank exit non-zero: mpiexec, and so CTest, report
// it whichever rank saw it. The world communicator has a watchdog (distributed/watchdog.h): a test
// left waiting in a collective for kTestCollectiveTimeout ends its rank with a line naming the call,
// and mpiexec then ends the others (CTest's TIMEOUT is the last bound).
//   mpirun -np 4 build/tests/distributed/test_distributed_communicator
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "comm/mpi_communicator.h"
#include "mpi_test_support.h"
#include "comm/watchdog.h"

namespace moe::dist::testing {

namespace {
Communicator* world_communicator = nullptr;
CollectiveWatchdog* world_watchdog = nullptr;

// Far above any honest wait of these tests (they run in seconds), far below CTest's TIMEOUT (300 s).
constexpr std::chrono::milliseconds kTestCollectiveTimeout{120'000};

// The failures of one rank other than 0, tagged with its rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};
}  // namespace

Communicator& world() { return *world_communicator; }
CollectiveWatchdog& watchdog() { return *world_watchdog; }

uint64_t shared_seed() {
  int64_t seed = 0;  // int64 on the wire: the same 64 bits
  if (world().rank() == 0) {
    std::random_device device;
    seed = static_cast<int64_t>((static_cast<uint64_t>(device()) << 32) ^ device());
  }
  broadcast(world(), std::span<int64_t>(&seed, 1), 0);
  return static_cast<uint64_t>(seed);
}

}  // namespace moe::dist::testing

int main(int argc, char** argv) {
  moe::dist::MpiEnvironment mpi(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  int any_failed = 0;
  {
    moe::dist::CollectiveWatchdog watchdog(mpi.world_rank(), mpi.world_size(),
                                           moe::dist::testing::kTestCollectiveTimeout);
    auto world = moe::dist::MpiCommunicator::world(&watchdog);
    moe::dist::testing::world_communicator = world.get();
    moe::dist::testing::world_watchdog = &watchdog;
    const int rank = world->rank(), ranks = world->size();
    if (rank != 0) {
      ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new moe::dist::testing::RankFailurePrinter(rank));
    }
    const int failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;
    int64_t failed_ranks = failed_here;
    moe::dist::all_reduce_sum(*world, std::span<int64_t>(&failed_ranks, 1));
    any_failed = failed_ranks > 0;
    if (rank == 0) {
      std::printf("%s ranks=%d failed_ranks=%lld\n", any_failed ? "FAIL" : "PASS", ranks,
                  static_cast<long long>(failed_ranks));
    }
    moe::dist::testing::world_communicator = nullptr;
    moe::dist::testing::world_watchdog = nullptr;
  }
  return any_failed;
}
