// stop_signal.cpp: see stop_signal.h.
#include "stop_signal.h"

#include <csignal>

namespace moe {
namespace {

// Written only by the handler, read by the loop; sig_atomic_t so a read never sees half a write.
volatile std::sig_atomic_t received_signal = 0;

extern "C" void remember_signal(int signal) { received_signal = signal; }

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = remember_signal;
  sigemptyset(&action.sa_mask);
  // SA_RESETHAND: the next signal of this kind takes the default action (ends the program now).
  // SA_RESTART: a read or write the signal interrupts is restarted rather than failing with EINTR.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int stop_signal() { return received_signal; }

int exit_status_for_signal(int signal) { return 128 + signal; }

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

}  // namespace moe
