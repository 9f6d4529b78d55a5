// watchdog.cpp: the collective watchdog's thread, its guards and the way it ends a process (see
// watchdog.h).
#include "comm/watchdog.h"

#include <unistd.h>  // write, _exit

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>

namespace moe::dist {

namespace {

std::string seconds(std::chrono::nanoseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(duration).count());
  return text;
}

// One write(2) per line: no stdio lock, which a thread stuck in printf could hold.
void write_line(const std::string& line) {
  const std::string text = line + "\n";
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + written, text.size() - written);
    if (n <= 0) return;
    written += static_cast<size_t>(n);
  }
}

// Set by the first thread that ends the process; a second one (the watchdog firing while a wait
// reports an error) leaves the ending to it.
std::atomic<bool> process_ending{false};

}  // namespace

// ---- construction ----

CollectiveWatchdog::CollectiveWatchdog(int rank, int ranks, std::chrono::milliseconds timeout,
                                       std::chrono::milliseconds abort_grace)
    : rank_(rank), ranks_(ranks), timeout_(timeout), abort_grace_(abort_grace) {
  if (timeout <= std::chrono::milliseconds(0)) {
    throw std::invalid_argument("CollectiveWatchdog: timeout = " + std::to_string(timeout.count()) +
                                " ms; expected a timeout > 0");
  }
  wake_at_ = Clock::now() + timeout_;
  thread_ = std::thread([this] { watch(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

// ---- arming ----

CollectiveWatchdog::Guard CollectiveWatchdog::arm(std::string_view what, int peer) {
  return arm(what, timeout_, peer);
}

CollectiveWatchdog::Guard CollectiveWatchdog::arm(std::string_view what, std::chrono::milliseconds timeout, int peer) {
  const Clock::time_point now = Clock::now();
  uint64_t id = 0;
  bool earlier_than_planned = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = next_id_++;
    armed_.push_back(Armed{id, std::string(what), peer, now, now + timeout});
    earlier_than_planned = now + timeout < wake_at_;
  }
  // The thread sleeps until wake_at_, which is never later than now + the default timeout: a call
  // armed with the default needs no wake-up, so arming costs no system call.
  if (earlier_than_planned) wake_.notify_one();
  return Guard(this, id);
}

void CollectiveWatchdog::disarm(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = std::find_if(armed_.begin(), armed_.end(), [id](const Armed& a) { return a.id == id; });
  if (found != armed_.end()) armed_.erase(found);
}

void CollectiveWatchdog::Guard::disarm() {
  if (watchdog_ != nullptr) watchdog_->disarm(id_);
  watchdog_ = nullptr;
}

CollectiveWatchdog::Guard& CollectiveWatchdog::Guard::operator=(Guard&& other) noexcept {
  if (this != &other) {
    disarm();
    watchdog_ = other.watchdog_;
    id_ = other.id_;
    other.watchdog_ = nullptr;
  }
  return *this;
}

// ---- abort hooks ----

uint64_t CollectiveWatchdog::add_abort_hook(std::string name, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  const uint64_t id = next_hook_id_++;
  hooks_.push_back(Hook{id, std::move(name), std::move(hook)});
  return id;
}

void CollectiveWatchdog::remove_abort_hook(uint64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  const auto found = std::find_if(hooks_.begin(), hooks_.end(), [id](const Hook& h) { return h.id == id; });
  if (found != hooks_.end()) hooks_.erase(found);
}

// ---- the thread ----

void CollectiveWatchdog::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    const Clock::time_point now = Clock::now();
    Clock::time_point earliest = now + timeout_;
    const Armed* overdue = nullptr;
    for (const Armed& armed : armed_) {
      if (armed.deadline <= now) {
        overdue = &armed;
        break;
      }
      earliest = std::min(earliest, armed.deadline);
    }
    if (overdue != nullptr) {
      const std::string reason =
          "has not completed after " + seconds(now - overdue->start) + " (timeout " +
          seconds(overdue->deadline - overdue->start) + "): " +
          (overdue->peer >= 0 ? "rank " + std::to_string(overdue->peer) + ", which it waits on, has died or stopped"
                              : std::string("a peer rank has died or stopped (this rank cannot tell which)"));
      const std::string what = overdue->what;
      lock.unlock();
      fail(what, reason);
    }
    wake_at_ = earliest;
    wake_.wait_until(lock, earliest);
  }
}

void CollectiveWatchdog::fail(std::string_view what, std::string_view reason) {
  const std::string rank = "rank " + std::to_string(rank_);
  end_process("[moe watchdog] " + rank + " of " + std::to_string(ranks_) + ": " + std::string(what) + " " +
              std::string(reason) + "; ending " + rank + " with exit code " + std::to_string(kWatchdogExitCode));
}

// The line first (nothing can block it but a full pipe), then the program's buffered output and the
// abort hooks on a helper thread: an ncclCommAbort or a flush can itself wait (on a peer, on a stdio
// lock the blocked thread holds), so the process ends after abort_grace whether they returned or not.
void CollectiveWatchdog::end_process(const std::string& line) {
  if (process_ending.exchange(true)) {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // the first caller ends the process
  }
  write_line(line);
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread([this, finished] {
    std::fflush(stdout);
    {
      std::lock_guard<std::mutex> lock(hooks_mutex_);
      for (const Hook& hook : hooks_) {
        write_line("[moe watchdog] rank " + std::to_string(rank_) + ": aborting " + hook.name);
        try {
          hook.run();
        } catch (const std::exception& error) {
          write_line("[moe watchdog] rank " + std::to_string(rank_) + ": aborting " + hook.name +
                     " threw: " + error.what());
        } catch (...) {
        }
      }
    }
    finished->store(true);
  }).detach();
  const Clock::time_point give_up = Clock::now() + abort_grace_;
  while (!finished->load() && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!finished->load()) {
    write_line("[moe watchdog] rank " + std::to_string(rank_) + ": the abort did not return within " +
               seconds(abort_grace_) + "; ending anyway");
  }
  _exit(kWatchdogExitCode);
}

}  // namespace moe::dist
