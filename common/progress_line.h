// progress_line.h: one line of progress for long work: step, loss, tokens/s, ETA.
//
// On a terminal the line redraws itself in place ('\r', then the text, then "\x1b[K" to clear
// what a longer previous line left behind). Written to a file or a CI log, '\r' would pile every
// update onto one unreadable line, so there it prints ordinary lines, one every few seconds (or
// every N steps). The rate is an exponential moving average of tokens/s over the updates, so one
// slow step (a checkpoint, a validation pass) moves it a little rather than making it jump; the
// ETA is the remaining steps times the smoothed time per step.
// The clock and the stream are injected, so the tests drive time by hand.
//
//   moe::ProgressLine progress(std::cout, {.total_steps = 2000, .terminal = moe::stdout_is_terminal()});
//   for (...) progress.update(step, tokens_seen, loss, {{"lr", "3.0e-4"}});
//   progress.finish();
//   -> "step 120/2000  loss 2.3456  412.3k tok/s  eta 0:03:12  lr 3.0e-4"
//   cmake --build build --target moe_common   (tests: ctest --test-dir build -R progress_line)
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace moe {

// True when standard output is a terminal (isatty), so '\r' redrawing makes sense.
bool stdout_is_terminal();

// "h:mm:ss" (hours grow past 99 as needed); "--:--:--" for a negative or non-finite time.
std::string format_duration(double seconds);

// A rate with an SI suffix and 4 significant-ish digits: "950", "12.3k", "462.1k", "1.25M".
std::string format_rate(double per_second);

struct ProgressOptions {
  int64_t total_steps = 0;          // for "step i/N" and the ETA; 0 means unknown
  bool terminal = false;            // redraw one line in place, or print plain lines
  double plain_every_seconds = 10;  // plain mode: a line at most this often ...
  int64_t plain_every_steps = 0;    // ... or every this many steps too (0: by time only)
  double redraw_every_seconds = 0.1;  // terminal mode: do not redraw faster than this
  double smoothing = 0.1;           // weight of the newest interval in the moving averages
};

class ProgressLine {
 public:
  using Clock = std::function<double()>;  // seconds, monotonic
  using Fields = std::vector<std::pair<std::string, std::string>>;

  // The default clock is std::chrono::steady_clock.
  ProgressLine(std::ostream& out, ProgressOptions options, Clock clock = {});

  // After step `step` (1-based count of steps done), with `tokens_seen` tokens processed in total.
  // Extra fields are printed after the ETA as "name value".
  void update(int64_t step, int64_t tokens_seen, double loss, const Fields& extra = {});

  // Draws the last update if it was skipped, ends the terminal line with '\n'. Idempotent.
  void finish();

  // A line of its own (a log message) while the progress line runs: on a terminal the drawn line is
  // cleared first and drawn again at the next update; plain, the line alone.
  void print(const std::string& line);

  // The text of the line as it stands (no '\r', no escape codes): for tests and for logs.
  std::string text() const;

  double tokens_per_second() const { return tokens_per_second_; }  // smoothed; 0 before 2 updates
  double eta_seconds() const;  // negative when unknown

 private:
  void draw();

  std::ostream& out_;
  ProgressOptions options_;
  Clock clock_;
  bool have_update_ = false;
  bool pending_ = false;   // the latest update has not been drawn
  bool finished_ = false;
  double last_time_ = 0;
  int64_t last_step_ = 0;
  int64_t last_tokens_ = 0;
  double last_draw_time_ = 0;
  int64_t last_draw_step_ = 0;
  bool drawn_once_ = false;
  double tokens_per_second_ = 0;
  double seconds_per_step_ = 0;
  int64_t step_ = 0;
  double loss_ = 0;
  Fields extra_;
};

}  // namespace moe
