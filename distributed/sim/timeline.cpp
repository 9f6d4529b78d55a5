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
    case kCompute2: return "compute 2";
  }
  return "?";
}

namespace {
bool is_compute(int stream) { return stream == kCompute || stream == kCompute2; }
}  // namespace

Timeline::Timeline(int64_t ranks)
    : ranks_(ranks),
      stream_free_(static_cast<size_t>(ranks * kStreams), 0.0),
      host_free_(static_cast<size_t>(ranks), 0.0),
      gpu_busy_(static_cast<size_t>(ranks)),
      compute_busy_(static_cast<size_t>(ranks), 0.0),
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

double Timeline::first_gap(size_t r, double ready, double duration_us) const {
  // The intervals never overlap, so sorted by start they are sorted by end too: skip those that end
  // before `ready` (most operations go after all of them), then walk the gaps.
  const auto& busy = gpu_busy_[r];
  auto it = std::partition_point(busy.begin(), busy.end(), [&](const std::pair<double, double>& b) { return b.second <= ready; });
  double start = ready;
  for (; it != busy.end(); ++it) {
    if (it->first >= start + duration_us) break;  // the gap before this interval holds the operation
    start = std::max(start, it->second);
  }
  return start;
}

Op Timeline::place(const std::string& name, int stream, const std::vector<double>& duration_us, bool collective,
                   const std::vector<Op>& after) {
  if (stream < 0 || stream >= kStreams) throw std::invalid_argument("Timeline: no stream " + std::to_string(stream));
  for (Op op : after) {
    if (op.index < 0 || op.index >= static_cast<int>(end_.size())) throw std::invalid_argument("Timeline: " + name + " waits for an operation not issued");
  }
  const size_t R = static_cast<size_t>(ranks_);
  // A compute operation needs its GPU free as well: the first gap after it is ready. A collective
  // on a compute stream is communication: it waits for the stream, not for the other stream's work.
  const bool on_gpu = is_compute(stream) && !collective;
  std::vector<double> ready(R), end(R);
  for (size_t r = 0; r < R; ++r) {
    double t = std::max(stream_free_[r * kStreams + static_cast<size_t>(stream)], host_free_[r]);
    for (Op op : after) t = std::max(t, end_[static_cast<size_t>(op.index)][r]);
    ready[r] = on_gpu && duration_us[r] > 0 ? first_gap(r, t, duration_us[r]) : t;  // nothing to fit: no wait
  }
  if (collective) {
    const double start = *std::max_element(ready.begin(), ready.end());
    std::fill(ready.begin(), ready.end(), start);
  }
  for (size_t r = 0; r < R; ++r) {
    end[r] = ready[r] + duration_us[r];
    stream_free_[r * kStreams + static_cast<size_t>(stream)] = end[r];
    if (on_gpu && duration_us[r] > 0) {
      auto& busy = gpu_busy_[r];
      busy.insert(std::upper_bound(busy.begin(), busy.end(), std::make_pair(ready[r], end[r])), {ready[r], end[r]});
      compute_busy_[r] += duration_us[r];
    }
    if (keep_[r] && duration_us[r] > 0) spans_.push_back({static_cast<int64_t>(r), stream, name, ready[r], duration_us[r]});
  }
  end_.push_back(std::move(end));
  return Op{static_cast<int>(end_.size()) - 1};
}

void Timeline::host_waits_for(Op op) {
  if (op.index < 0 || op.index >= static_cast<int>(end_.size())) throw std::invalid_argument("Timeline: the host waits for an operation not issued");
  for (size_t r = 0; r < static_cast<size_t>(ranks_); ++r) host_free_[r] = std::max(host_free_[r], end_[static_cast<size_t>(op.index)][r]);
}

double Timeline::end_us(Op op, int64_t rank) const {
  return end_.at(static_cast<size_t>(op.index)).at(static_cast<size_t>(rank));
}

double Timeline::finish_step() {
  const double end = *std::max_element(stream_free_.begin(), stream_free_.end());
  const double duration = end - step_start_;
  std::fill(stream_free_.begin(), stream_free_.end(), end);
  std::fill(host_free_.begin(), host_free_.end(), end);
  // What the GPU did not compute in the step was waiting: for exchanges, collectives, slower ranks.
  last_exposed_.assign(static_cast<size_t>(ranks_), 0.0);
  for (size_t r = 0; r < static_cast<size_t>(ranks_); ++r) {
    last_exposed_[r] = std::max(0.0, duration - compute_busy_[r]);
    gpu_busy_[r].clear();
  }
  last_compute_busy_ = compute_busy_;
  std::fill(compute_busy_.begin(), compute_busy_.end(), 0.0);
  end_.clear();
  step_start_ = end;
  return duration;
}

std::vector<SimSpan> Timeline::take_spans() {
  std::vector<SimSpan> out;
  out.swap(spans_);
  return out;
}

}  // namespace moe::sim
