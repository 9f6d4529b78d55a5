// stop_signal.h: SIGINT (Ctrl-C) and SIGTERM (`kill`, a job scheduler's stop) as a request to end
// a long run cleanly instead of at once: the training loop finishes the step in flight, writes a
// checkpoint, flushes its run record, says how to resume, and the program exits 128 + the signal
// (130 for SIGINT, 143 for SIGTERM), the status a shell expects of a program a signal ended.
//
// The handler does one thing, the only kind of work a signal handler may safely do: it stores the
// signal's number in a volatile std::sig_atomic_t. The loop reads it between steps. The handler is
// installed with SA_RESETHAND, so a second Ctrl-C ends the program at once (the default action)
// for a user who does not want to wait for the checkpoint.
//
//   moe::install_stop_handlers();
//   while (training) { step(); if (moe::stop_signal() != 0) { checkpoint(); break; } }
//   return moe::exit_status_for_signal(moe::stop_signal());
// Used by moe_train and moe_train_distributed (cuda/train/trainer.cpp reads it);
// tests: ctest -R StopSignal.
#pragma once

#include <string>

namespace moe {

// Installs the handler for SIGINT and SIGTERM. Until it is called, stop_signal() stays 0.
void install_stop_handlers();

// 0, or the number of the first SIGINT / SIGTERM received since install_stop_handlers().
int stop_signal();

// 128 + signal: 130 for SIGINT, 143 for SIGTERM.
int exit_status_for_signal(int signal);

// "SIGINT", "SIGTERM", or "signal N".
std::string signal_name(int signal);

}  // namespace moe
