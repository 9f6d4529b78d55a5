// test_progress_line.cpp: the progress line with an injected clock and stream: ETA and rate
// formatting, the smoothed rate, in-place redrawing on a terminal, plain periodic lines otherwise.
//   ctest --test-dir build -R ProgressLine
#include <gtest/gtest.h>

#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "progress_line.h"

namespace moe {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

TEST(ProgressLine, FormatsDurations) {
  EXPECT_EQ(format_duration(0), "0:00:00");
  EXPECT_EQ(format_duration(59.4), "0:00:59");
  EXPECT_EQ(format_duration(59.6), "0:01:00");
  EXPECT_EQ(format_duration(3661), "1:01:01");
  EXPECT_EQ(format_duration(100 * 3600 + 5), "100:00:05");
  EXPECT_EQ(format_duration(-1), "--:--:--");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::quiet_NaN()), "--:--:--");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "--:--:--");
}

TEST(ProgressLine, FormatsRates) {
  EXPECT_EQ(format_rate(0), "0");
  EXPECT_EQ(format_rate(950), "950");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(462100), "462.1k");
  EXPECT_EQ(format_rate(1.25e6), "1.25M");
  EXPECT_EQ(format_rate(3.5e9), "3.50G");
  EXPECT_EQ(format_rate(-1), "--");
}

TEST(ProgressLine, TerminalRedrawsOneLineInPlace) {
  double now = 0;
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 10;
  options.terminal = true;
  options.smoothing = 0.5;
  ProgressLine progress(out, options, [&] { return now; });

  now = 1.0;  // 1000 tokens in 1 s
  progress.update(1, 1000, 2.5, {{"lr", "3.0e-4"}});
  EXPECT_EQ(out.str(), "\rstep 1/10  loss 2.5000  1.0k tok/s  eta 0:00:09  lr 3.0e-4\x1b[K");

  now = 2.0;  // 3000 tokens in the next second: the average moves halfway, to 2000
  progress.update(2, 4000, 2.25);
  EXPECT_DOUBLE_EQ(progress.tokens_per_second(), 2000.0);
  EXPECT_DOUBLE_EQ(progress.eta_seconds(), 8.0);  // 8 steps at 1 s
  EXPECT_EQ(progress.text(), "step 2/10  loss 2.2500  2.0k tok/s  eta 0:00:08");
  EXPECT_EQ(out.str().find('\n'), std::string::npos);  // still one line

  // Updates faster than the redraw interval are not drawn; finish draws the last and ends the line.
  const size_t drawn = out.str().size();
  now = 2.01;
  progress.update(3, 5000, 2.0);
  EXPECT_EQ(out.str().size(), drawn);
  progress.finish();
  const std::string all = out.str();
  EXPECT_EQ(all.substr(drawn), std::string("\r").append(progress.text()).append("\x1b[K\n"));
  progress.finish();  // idempotent
  EXPECT_EQ(out.str(), all);
}

// A log line while the progress line runs: on a terminal the drawn line is cleared first, so the
// message starts at the line's beginning; plain, the message alone.
TEST(ProgressLine, PrintedLineClearsTheTerminalLineFirst) {
  double now = 1.0;
  std::ostringstream terminal_out, plain_out;
  ProgressOptions options;
  options.total_steps = 10;
  options.terminal = true;
  ProgressLine terminal(terminal_out, options, [&] { return now; });
  terminal.print("before any line");
  terminal.update(1, 1000, 2.5);
  const size_t drawn = terminal_out.str().size();
  terminal.print("step 1: a message");
  EXPECT_EQ(terminal_out.str().substr(0, 16), "before any line\n");
  EXPECT_EQ(terminal_out.str().substr(drawn), "\r\x1b[Kstep 1: a message\n");
  options.terminal = false;
  ProgressLine plain(plain_out, options, [&] { return now; });
  plain.print("a message");
  EXPECT_EQ(plain_out.str(), "a message\n");
}

TEST(ProgressLine, SlowStepMovesTheSmoothedRateALittle) {
  double now = 0;
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 1000;
  options.smoothing = 0.1;
  ProgressLine progress(out, options, [&] { return now; });
  for (int step = 1; step <= 50; ++step) {
    now += 0.1;
    progress.update(step, step * 1000LL, 1.0);
  }
  EXPECT_NEAR(progress.tokens_per_second(), 10000.0, 1e-6);
  EXPECT_NEAR(progress.eta_seconds(), 950 * 0.1, 1e-6);
  now += 1.0;  // one step ten times slower (a validation pass)
  progress.update(51, 51000, 1.0);
  EXPECT_NEAR(progress.tokens_per_second(), 0.9 * 10000 + 0.1 * 1000, 1e-6);
}

TEST(ProgressLine, PlainOutputPrintsPeriodicLines) {
  double now = 0;
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 25;
  options.terminal = false;
  options.plain_every_seconds = 10;
  ProgressLine progress(out, options, [&] { return now; });
  for (int step = 1; step <= 25; ++step) {
    now += 1.0;
    progress.update(step, step * 100LL, 3.0);
  }
  progress.finish();
  const std::string text = out.str();
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  const auto lines = lines_of(text);
  ASSERT_EQ(lines.size(), 4u);  // the first update, every 10 s, and the last step
  EXPECT_EQ(lines[0], "step 1/25  loss 3.0000  100 tok/s  eta 0:00:24");
  EXPECT_EQ(lines[1].rfind("step 11/25", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 21/25", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3], "step 25/25  loss 3.0000  100 tok/s  eta 0:00:00");
}

TEST(ProgressLine, PlainOutputEveryNSteps) {
  double now = 0;
  std::ostringstream out;
  ProgressOptions options;
  options.plain_every_seconds = 1e9;
  options.plain_every_steps = 5;  // total unknown: no "/N", no ETA
  ProgressLine progress(out, options, [&] { return now; });
  for (int step = 1; step <= 12; ++step) {
    now += 0.5;
    progress.update(step, step * 10LL, 1.5);
  }
  progress.finish();  // step 12 was pending
  const auto lines = lines_of(out.str());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "step 1  loss 1.5000  20 tok/s");
  EXPECT_EQ(lines[1].rfind("step 6  ", 0), 0u);
  EXPECT_EQ(lines[2].rfind("step 11  ", 0), 0u);
  EXPECT_EQ(lines[3].rfind("step 12  ", 0), 0u);
}

TEST(ProgressLine, NoRateBeforeTimePasses) {
  double now = 0;
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 4;
  ProgressLine progress(out, options, [&] { return now; });
  progress.update(1, 100, 5.0);  // no time has passed: nothing to divide by
  EXPECT_EQ(progress.text(), "step 1/4  loss 5.0000  -- tok/s  eta --:--:--");
  (void)stdout_is_terminal();  // callable; under ctest it is usually false
}

}  // namespace
}  // namespace moe
