// comm_view.cpp: timeline lanes, all-to-all matrices and offload counters (comm_view.h).
#include "comm_view.h"

#include <algorithm>
#include <limits>
#include <map>

namespace moe::viewer {

namespace {
constexpr int64_t kAllToAllStream = 1000;  // the Chrome trace export's tid for all-to-alls

bool is_copy_or_compute(const std::string& stream_name, const std::string& name) {
  return stream_name == "compute" || stream_name == "copy" || name.find("copy") != std::string::npos ||
         name.find("h2d") != std::string::npos;
}

// The recorded step of `records` closest at or before `step` (the first one when all are after).
template <class Records>
int64_t recorded_step(const Records& records, int64_t step, bool& found) {
  int64_t best = std::numeric_limits<int64_t>::min(), first = std::numeric_limits<int64_t>::max();
  found = false;
  for (const auto& r : records) {
    found = true;
    first = std::min(first, r.step);
    if (r.step <= step) best = std::max(best, r.step);
  }
  return best == std::numeric_limits<int64_t>::min() ? first : best;
}
}  // namespace

Timeline build_timeline(const RunModel& run, int64_t step_lo, int64_t step_hi, bool copy_and_compute_only) {
  Timeline t;
  std::map<std::pair<int64_t, int64_t>, TimelineLane> lanes;
  std::map<std::string, int32_t> name_index, family_index;
  auto index_of = [&](const std::string& name) {
    auto [it, inserted] = name_index.try_emplace(name, static_cast<int32_t>(t.names.size()));
    if (inserted) {
      t.names.push_back(name);
      const std::string family = name.substr(0, name.find(' '));
      auto [f, new_family] = family_index.try_emplace(family, static_cast<int32_t>(t.families.size()));
      if (new_family) t.families.push_back(family);
      t.family_of.push_back(f->second);
    }
    return it->second;
  };
  t.t0 = std::numeric_limits<double>::infinity();
  t.t1 = -std::numeric_limits<double>::infinity();
  auto add = [&](int64_t rank, int64_t stream, const std::string& stream_label, const std::string& name,
                 double start, double duration) {
    TimelineLane& lane = lanes[{rank, stream}];
    if (lane.spans.empty()) {
      lane.rank = rank;
      lane.stream = stream;
      lane.label = "rank " + std::to_string(rank) + " / " +
                   (stream_label.empty() ? "stream " + std::to_string(stream) : stream_label);
    }
    lane.spans.push_back({start, start + duration, index_of(name), 1});
    t.t0 = std::min(t.t0, start);
    t.t1 = std::max(t.t1, start + duration);
    ++t.span_count;
  };
  for (const SpanRecord& s : run.spans) {
    if (s.step < step_lo || s.step > step_hi) continue;
    if (copy_and_compute_only && !is_copy_or_compute(s.stream_name, s.name)) continue;
    add(s.rank, s.stream, s.stream_name, s.name, s.start_us, s.duration_us);
  }
  if (!copy_and_compute_only)
    for (const AllToAllRecord& a : run.alltoalls)
      if (a.start_us && a.step >= step_lo && a.step <= step_hi)
        add(a.rank, kAllToAllStream, "all-to-all", a.name.empty() ? "alltoall" : a.name, *a.start_us, a.duration_us);
  const bool one_rank = !lanes.empty() && lanes.begin()->first.first == lanes.rbegin()->first.first;
  for (auto& [key, lane] : lanes) {
    if (one_rank) lane.label = lane.label.substr(lane.label.find(" / ") + 3);
    std::sort(lane.spans.begin(), lane.spans.end(),
              [](const TimelineSpan& a, const TimelineSpan& b) { return a.start_us < b.start_us; });
    t.lanes.push_back(std::move(lane));
  }
  if (t.span_count == 0) t.t0 = t.t1 = 0;
  return t;
}

int64_t timeline_step(const RunModel& run, int64_t step) {
  int64_t best = INT64_MIN, first = INT64_MAX;
  for (const SpanRecord& s : run.spans) {
    first = std::min(first, s.step);
    if (s.step <= step) best = std::max(best, s.step);
  }
  if (best != INT64_MIN) return best;
  return run.spans.empty() ? INT64_MIN : first;
}

std::vector<TimelineSpan> visible_spans(const TimelineLane& lane, double t_lo, double t_hi, double min_width_us) {
  std::vector<TimelineSpan> out;
  // Spans are sorted by start: binary-search the window, then step back over spans that began
  // before it but reach into it.
  auto it = std::lower_bound(lane.spans.begin(), lane.spans.end(), t_lo,
                             [](const TimelineSpan& s, double t) { return s.start_us < t; });
  while (it != lane.spans.begin() && (it - 1)->end_us > t_lo) --it;
  bool last_thin = false;  // the last span out is thin, or thin spans merged
  for (; it != lane.spans.end() && it->start_us <= t_hi; ++it) {
    if (it->end_us < t_lo) continue;
    const bool thin = it->end_us - it->start_us < min_width_us;
    // A thin span less than a pixel after a thin one joins it: at this zoom no gap between them
    // could be seen anyway, and the merged count goes to the tooltip. A wide span keeps its name
    // and colour: a 7 us dispatch after a 40 us router is drawn on its own, a pixel wide.
    if (thin && last_thin && !out.empty() && it->start_us - out.back().end_us < min_width_us) {
      out.back().end_us = std::max(out.back().end_us, it->end_us);
      ++out.back().merged;
      continue;
    }
    out.push_back(*it);
    last_thin = thin;
  }
  return out;
}

AllToAllView alltoall_at(const RunModel& run, int64_t step, const std::string& name, int64_t layer) {
  AllToAllView v;
  v.layer = layer;
  bool found = false;
  v.step = recorded_step(run.alltoalls, step, found);
  if (!found) return v;
  for (const AllToAllRecord& a : run.alltoalls) {
    if (a.step != v.step || (!name.empty() && a.name != name) || (layer >= 0 && a.layer != layer)) continue;
    if (a.ranks > v.ranks) {  // a wider matrix than seen so far: grow, keeping what was summed
      std::vector<double> grown(static_cast<size_t>(a.ranks * a.ranks), 0.0);
      for (int64_t s = 0; s < v.ranks; ++s)
        for (int64_t d = 0; d < v.ranks; ++d) grown[s * a.ranks + d] = v.bytes[s * v.ranks + d];
      v.bytes = std::move(grown);
      v.ranks = a.ranks;
    }
    for (int64_t s = 0; s < a.ranks; ++s)
      for (int64_t d = 0; d < a.ranks; ++d)
        v.bytes[s * v.ranks + d] += static_cast<double>(a.bytes[s * a.ranks + d]);
    v.duration_us += a.duration_us;
    ++v.events;
  }
  v.send_bytes.assign(static_cast<size_t>(v.ranks), 0.0);
  v.recv_bytes.assign(static_cast<size_t>(v.ranks), 0.0);
  for (int64_t s = 0; s < v.ranks; ++s)
    for (int64_t d = 0; d < v.ranks; ++d) {
      const double b = v.bytes[s * v.ranks + d];
      v.total_bytes += b;
      if (s == d) continue;
      v.remote_bytes += b;
      v.send_bytes[s] += b;
      v.recv_bytes[d] += b;
    }
  v.bandwidth_gb_per_s = v.duration_us > 0 ? v.remote_bytes / (v.duration_us * 1e-6) / 1e9 : 0;
  return v;
}

std::vector<std::string> alltoall_names(const RunModel& run) {
  std::vector<std::string> names;
  for (const AllToAllRecord& a : run.alltoalls)
    if (std::find(names.begin(), names.end(), a.name) == names.end()) names.push_back(a.name);
  return names;
}

Series alltoall_bandwidth_series(const RunModel& run, const std::string& name) {
  std::map<int64_t, std::pair<double, double>> per_step;  // step -> (remote bytes, duration)
  for (const AllToAllRecord& a : run.alltoalls) {
    if (!name.empty() && a.name != name) continue;
    auto& [bytes, duration] = per_step[a.step];
    for (int64_t s = 0; s < a.ranks; ++s)
      for (int64_t d = 0; d < a.ranks; ++d)
        if (s != d) bytes += static_cast<double>(a.bytes[s * a.ranks + d]);
    duration += a.duration_us;
  }
  Series out;
  for (const auto& [step, bd] : per_step) {
    out.steps.push_back(static_cast<double>(step));
    out.values.push_back(bd.second > 0 ? bd.first / (bd.second * 1e-6) / 1e9 : 0.0);
  }
  return out;
}

OffloadView offload_at(const RunModel& run, int64_t step, int64_t layer) {
  OffloadView v;
  bool found = false;
  v.step = recorded_step(run.offloads, step, found);
  if (!found) return v;
  for (const OffloadRecord& o : run.offloads) {
    if (o.step != v.step || (layer >= 0 && o.layer != layer)) continue;
    v.hits += o.hits;
    v.misses += o.misses;
    v.stall_us += o.stall_us;
    v.on_host += static_cast<int64_t>(o.on_host.size());
    v.host_us += o.host_us;
    v.prefetched.insert(v.prefetched.end(), o.prefetched.begin(), o.prefetched.end());
    ++v.events;
  }
  v.hit_rate = v.hits + v.misses > 0 ? static_cast<double>(v.hits) / static_cast<double>(v.hits + v.misses) : 0;
  return v;
}

Series offload_series(const RunModel& run, const std::string& field, int64_t layer) {
  struct Sum { double hits = 0, misses = 0, stall = 0; };
  std::map<int64_t, Sum> per_step;
  for (const OffloadRecord& o : run.offloads) {
    if (layer >= 0 && o.layer != layer) continue;
    Sum& s = per_step[o.step];
    s.hits += static_cast<double>(o.hits);
    s.misses += static_cast<double>(o.misses);
    s.stall += o.stall_us;
  }
  Series out;
  for (const auto& [step, s] : per_step) {
    double v = 0;
    if (field == "hit_rate")
      v = s.hits + s.misses > 0 ? s.hits / (s.hits + s.misses) : std::numeric_limits<double>::quiet_NaN();
    else if (field == "hits") v = s.hits;
    else if (field == "misses") v = s.misses;
    else if (field == "stall_us") v = s.stall;
    out.steps.push_back(static_cast<double>(step));
    out.values.push_back(v);
  }
  return out;
}

}  // namespace moe::viewer
