// progress_line.cpp: the progress line's smoothing, formatting and drawing (see progress_line.h).
#include "progress_line.h"

#include <unistd.h>  // isatty

#include <chrono>
#include <cmath>
#include <cstdio>

namespace moe {

bool stdout_is_terminal() { return ::isatty(STDOUT_FILENO) == 1; }

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--:--";
  const long long total = std::llround(seconds);
  char text[32];
  std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", total / 3600, (total / 60) % 60, total % 60);
  return text;
}

std::string format_rate(double per_second) {
  if (!std::isfinite(per_second) || per_second < 0) return "--";
  char text[32];
  if (per_second < 1e3) {
    std::snprintf(text, sizeof text, "%.0f", per_second);
  } else if (per_second < 1e6) {
    std::snprintf(text, sizeof text, "%.1fk", per_second / 1e3);
  } else if (per_second < 1e9) {
    std::snprintf(text, sizeof text, "%.2fM", per_second / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%.2fG", per_second / 1e9);
  }
  return text;
}

ProgressLine::ProgressLine(std::ostream& out, ProgressOptions options, Clock clock)
    : out_(out), options_(options), clock_(std::move(clock)) {
  if (!clock_) {
    clock_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
  }
  last_time_ = clock_();  // the first interval runs from construction to the first update
}

void ProgressLine::update(int64_t step, int64_t tokens_seen, double loss, const Fields& extra) {
  const double now = clock_();
  const double elapsed = now - last_time_;
  const int64_t steps = step - last_step_;
  // An exponential moving average, seeded with the first interval rather than with 0 so the
  // first readings are not dragged towards zero.
  if (elapsed > 0 && steps > 0) {
    const double rate = static_cast<double>(tokens_seen - last_tokens_) / elapsed;
    const double per_step = elapsed / static_cast<double>(steps);
    const double weight = have_update_ ? options_.smoothing : 1.0;
    tokens_per_second_ += weight * (rate - tokens_per_second_);
    seconds_per_step_ += weight * (per_step - seconds_per_step_);
    have_update_ = true;
  }
  last_time_ = now;
  last_step_ = step;
  last_tokens_ = tokens_seen;
  step_ = step;
  loss_ = loss;
  extra_ = extra;
  pending_ = true;
  finished_ = false;

  const bool last_step = options_.total_steps > 0 && step >= options_.total_steps;
  bool due;
  if (options_.terminal) {
    due = !drawn_once_ || now - last_draw_time_ >= options_.redraw_every_seconds;
  } else {
    due = !drawn_once_ || now - last_draw_time_ >= options_.plain_every_seconds ||
          (options_.plain_every_steps > 0 && step - last_draw_step_ >= options_.plain_every_steps);
  }
  if (due || last_step) {
    last_draw_time_ = now;
    last_draw_step_ = step;
    draw();
  }
}

void ProgressLine::print(const std::string& line) {
  if (options_.terminal && drawn_once_ && !finished_) out_ << "\r\033[K";
  out_ << line << '\n';
  out_.flush();
}

void ProgressLine::finish() {
  if (finished_) return;
  if (pending_) draw();
  if (options_.terminal && drawn_once_) out_ << '\n';
  out_.flush();
  finished_ = true;
}

double ProgressLine::eta_seconds() const {
  if (options_.total_steps <= 0 || !have_update_) return -1;
  const int64_t remaining = options_.total_steps - step_;
  return remaining > 0 ? static_cast<double>(remaining) * seconds_per_step_ : 0.0;
}

std::string ProgressLine::text() const {
  // Built with append rather than operator+ chains, which GCC 12 warns about (-Wrestrict).
  std::string line = "step ";
  line.append(std::to_string(step_));
  if (options_.total_steps > 0) line.append("/").append(std::to_string(options_.total_steps));
  char loss[32];
  std::snprintf(loss, sizeof loss, "%.4f", loss_);
  line.append("  loss ").append(loss);
  line.append("  ").append(have_update_ ? format_rate(tokens_per_second_) : "--").append(" tok/s");
  if (options_.total_steps > 0) line.append("  eta ").append(format_duration(eta_seconds()));
  for (const auto& [name, value] : extra_) line.append("  ").append(name).append(" ").append(value);
  return line;
}

void ProgressLine::draw() {
  if (options_.terminal) {
    out_ << '\r' << text() << "\x1b[K";  // clear the rest of a longer previous line
  } else {
    out_ << text() << '\n';
  }
  out_.flush();
  drawn_once_ = true;
  pending_ = false;
}

}  // namespace moe
