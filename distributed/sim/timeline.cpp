// sim/timeline.cpp: list scheduling of issued operations over ranks and streams (timeline.h).
#include "sim/timeline.h"

#include <algorithm>
#include <stdexcept>

namespace moe::sim {

const char* stream_name(int stream) {
  switch (stream) {
    case kCompute: return "compute";
    case kExchange: return "exchange";
    case kCopy: return "copy";
  }
  return "?";
}

Timeline::Timeline(int64_t ranks)
    : ranks_(ranks),
      stream_free_(static_cast<size_t>(ranks * kStreams), 0.0),
      compute_busy_(static_cast<size_t>(ranks), 0.0),
      exposed_(static_cast<size_t>(ranks), 0.0),
      keep_(static_cast<size_t>(ranks), true) {
  if (ranks < 1) throw std::invalid_argument("Timeline: needs at least one rank");
}

void Timeline::keep_spans_of(std::vector<int64_t> ranks) {
  std::fill(keep_.begin(), keep_.end(), false);
  for (int64_t r : ranks) {
    if (r >= 0 && r < ranks_) keep_[static_cast<size_t>(r)] = true;
  }
}

Op Timeline::local(const std::string& name, int stream, const std::vector<double>& duration_us, const std::vector<Op>& after) {
  if (static_cast<int64_t>(duration_us.size()) != ranks_) {
    throw std::invalid_argument("Timeline::local(" + name + "): one duration a rank expected");
  }
  return place(name, stream, duration_us, false, after);
}

Op Timeline::local(const std::string& name, int stream, double duration_us, const std::vector<Op>& after) {
  return place(name, stream, std::vector<double>(static_cast<size_t>(ranks_), duration_us), false, after);
}

Op Timeline::collective(const std::string& name, int stream, double duration_us, const std::vector<Op>& after) {
  return place(name, stream, std::vector<double>(static_cast<size_t>(ranks_), duration_us), true, after);
}

Op Timeline::place(const std::string& name, int stream, const std::vector<double>& duration_us, bool collective,
                   const std::vector<Op>& after) {
  if (stream < 0 || stream >= kStreams) throw std::invalid_argument("Timeline: no stream " + std::to_string(stream));
  for (Op op : after) {
    if (op.index < 0 || op.index >= static_cast<int>(end_.size())) throw std::invalid_argument("Timeline: " + name + " waits for an operation not issued");
  }
  const size_t R = static_cast<size_t>(ranks_);
  std::vector<double> ready(R), end(R);
  for (size_t r = 0; r < R; ++r) {
    double t = stream_free_[r * kStreams + static_cast<size_t>(stream)];
    for (Op op : after) t = std::max(t, end_[static_cast<size_t>(op.index)][r]);
    ready[r] = t;
  }
  if (collective) {
    const double start = *std::max_element(ready.begin(), ready.end());
    std::fill(ready.begin(), ready.end(), start);
  }
  const bool communicates = collective || stream == kExchange;
  for (size_t r = 0; r < R; ++r) {
    end[r] = ready[r] + duration_us[r];
    double& free = stream_free_[r * kStreams + static_cast<size_t>(stream)];
    if (stream == kCompute) {
      // The compute stream idles from `free` to `ready`: exposed communication when what it waited
      // for is an exchange (or this is a collective), else a wait on another compute operation.
      bool waited_on_exchange = collective;
      for (Op op : after) {
        if (communicates_[static_cast<size_t>(op.index)] && end_[static_cast<size_t>(op.index)][r] > free) waited_on_exchange = true;
      }
      if (waited_on_exchange) exposed_[r] += ready[r] - free;
      if (collective) exposed_[r] += duration_us[r];  // a collective on the compute stream is communication
      else compute_busy_[r] += duration_us[r];
    }
    free = end[r];
    if (keep_[r] && duration_us[r] > 0) spans_.push_back({static_cast<int64_t>(r), stream, name, ready[r], duration_us[r]});
  }
  end_.push_back(std::move(end));
  communicates_.push_back(communicates);
  return Op{static_cast<int>(end_.size()) - 1};
}

double Timeline::end_us(Op op, int64_t rank) const {
  return end_.at(static_cast<size_t>(op.index)).at(static_cast<size_t>(rank));
}

double Timeline::finish_step() {
  const double end = *std::max_element(stream_free_.begin(), stream_free_.end());
  const double duration = end - step_start_;
  std::fill(stream_free_.begin(), stream_free_.end(), end);
  // A rank that finished early waits for the slowest at the step's end (its next collective):
  // that idle time is a wait on communication too.
  for (size_t r = 0; r < static_cast<size_t>(ranks_); ++r) {
    const double compute_end = step_start_ + compute_busy_[r] + exposed_[r];
    exposed_[r] += std::max(0.0, end - compute_end);
  }
  last_compute_busy_ = compute_busy_;
  last_exposed_ = exposed_;
  std::fill(compute_busy_.begin(), compute_busy_.end(), 0.0);
  std::fill(exposed_.begin(), exposed_.end(), 0.0);
  end_.clear();
  communicates_.clear();
  step_start_ = end;
  return duration;
}

std::vector<SimSpan> Timeline::take_spans() {
  std::vector<SimSpan> out;
  out.swap(spans_);
  return out;
}

}  // namespace moe::sim
