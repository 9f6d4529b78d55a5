// watchdog.h: a rank that dies or stops mid-step never leaves the other ranks hanging.
//
// A collective returns only when every rank of the communicator has joined it. If one rank is killed
// the launcher notices (OpenMPI's mpirun ends the job and names the rank and its signal), but a rank
// that stops without dying (SIGSTOP, a deadlock, a skipped call, a GPU kernel that never ends) leaves
// its peers waiting forever in MPI or on a stream that NCCL work never completes. The watchdog turns
// that wait into an error that ends the job:
//
//   - a communicator arms it with a name before a blocking call and disarms it after (a cheap guard:
//     one lock, one small vector entry; no thread wakes while collectives end in time);
//   - a background thread sleeps until the earliest deadline; when a collective is still armed then,
//     it prints one line on stderr, e.g.
//       [moe watchdog] rank 0 of 3: all_reduce_sum (MPI_Allreduce) has not completed after 5.0 s
//       (timeout 5.0 s): a peer rank has died or stopped (this rank cannot tell which); ending rank 0
//       with exit code 124
//     runs the abort hooks (ncclCommAbort for each registered NCCL communicator, bounded by a grace
//     period, since an abort can itself wait on a peer), and ends the process with _exit(124). The
//     launcher then ends the other ranks: mpirun kills the whole job when one process exits non-zero.
//
// The thread never calls MPI, so MPI_THREAD_FUNNELED (what MpiEnvironment asks for) is enough: the
// thread that blocks in MPI stays the only one that calls it. Ending with _exit after flushing, and
// not with an exception, is deliberate: the blocked thread cannot be interrupted, and a rank whose
// peer is gone cannot finish MPI anyway.
//
// The timeout must be longer than the longest honest wait in a collective, which includes the work
// an imbalanced peer does before it joins (a rank that waits for a slower one counts that time too).
// The default, kDefaultCollectiveTimeout = 30 s, ends a hung job well within a minute; programs take
// it as a flag (`--collective-timeout SECONDS`, collective_timeout.h), not from the environment.
//
//   CollectiveWatchdog watchdog(mpi.world_rank(), mpi.world_size());      // before the communicators
//   auto world = MpiCommunicator::world(&watchdog);                        // its collectives are armed
//   NcclCommunicator nccl(*world, stream, &watchdog);                      // registers ncclCommAbort
//
// Used by mpi_communicator.h and nccl_communicator.h; the wait on NCCL work: nccl_wait.h.
// Tests: tests/distributed/test_watchdog.cpp (the thread itself), fault_rank_program.cpp under
// run_fault.cmake (3 ranks, one killed, stopped or skipping a collective):
//   ctest --test-dir build -R 'Watchdog|FaultRank' --output-on-failure
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace moe::dist {

inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30'000};
// The exit code of a rank that the watchdog ends (124, as coreutils' `timeout` uses for a timeout).
inline constexpr int kWatchdogExitCode = 124;

class CollectiveWatchdog {
 public:
  // rank and ranks name this process in the message (its rank in the launch, R). timeout: each
  // armed call's deadline unless arm() is given another. abort_grace: how long the abort hooks may
  // run before the process ends anyway.
  CollectiveWatchdog(int rank, int ranks, std::chrono::milliseconds timeout = kDefaultCollectiveTimeout,
                     std::chrono::milliseconds abort_grace = std::chrono::milliseconds(5'000));
  ~CollectiveWatchdog();  // stops the thread; every guard and hook must be gone by then
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  int rank() const { return rank_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Disarms on destruction. Movable, so a function can return one.
  class Guard {
   public:
    Guard() = default;
    Guard(Guard&& other) noexcept : watchdog_(other.watchdog_), id_(other.id_) { other.watchdog_ = nullptr; }
    Guard& operator=(Guard&& other) noexcept;
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { disarm(); }
    void disarm();

   private:
    friend class CollectiveWatchdog;
    Guard(CollectiveWatchdog* watchdog, uint64_t id) : watchdog_(watchdog), id_(id) {}
    CollectiveWatchdog* watchdog_ = nullptr;
    uint64_t id_ = 0;
  };

  // `what` names the call in the message ("all_reduce_sum (MPI_Allreduce)"). peer >= 0: the rank
  // this call waits on, where one is known (a receive from one peer); the message then names it.
  [[nodiscard]] Guard arm(std::string_view what, int peer = -1);
  [[nodiscard]] Guard arm(std::string_view what, std::chrono::milliseconds timeout, int peer = -1);

  // What must be undone before the process ends (ncclCommAbort of one communicator). Runs on a
  // helper thread when the watchdog fires; the id removes it again (the communicator's destructor).
  uint64_t add_abort_hook(std::string name, std::function<void()> hook);
  void remove_abort_hook(uint64_t id);

  // Ends the process now, from any thread, as a timeout does: the line "[moe watchdog] rank r of R:
  // <what> <reason>; ending rank r with exit code 124", the abort hooks, _exit. For an error that a
  // wait detects itself (NCCL's asynchronous error of a peer that went away).
  [[noreturn]] void fail(std::string_view what, std::string_view reason);

 private:
  using Clock = std::chrono::steady_clock;
  struct Armed {
    uint64_t id;
    std::string what;
    int peer;
    Clock::time_point start, deadline;
  };
  struct Hook {
    uint64_t id;
    std::string name;
    std::function<void()> run;
  };

  void disarm(uint64_t id);
  void watch();  // the thread
  [[noreturn]] void end_process(const std::string& line);

  const int rank_, ranks_;
  const std::chrono::milliseconds timeout_, abort_grace_;

  std::mutex mutex_;  // guards armed_, next_id_, wake_at_, stopping_
  std::condition_variable wake_;
  std::vector<Armed> armed_;
  uint64_t next_id_ = 1;
  Clock::time_point wake_at_;  // when the thread next looks; arm() wakes it only for an earlier deadline
  bool stopping_ = false;

  std::mutex hooks_mutex_;  // held while the hooks run, so a hook is never removed while it runs
  std::vector<Hook> hooks_;
  uint64_t next_hook_id_ = 1;

  std::thread thread_;
};

// A guard from `watchdog`, or an empty one when it is null (a communicator without a watchdog).
inline CollectiveWatchdog::Guard arm(CollectiveWatchdog* watchdog, std::string_view what, int peer = -1) {
  return watchdog ? watchdog->arm(what, peer) : CollectiveWatchdog::Guard();
}

}  // namespace moe::dist
