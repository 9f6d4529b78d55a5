// parallel_view.cpp: byte matrices per layer, load across ranks and idle time in the exchanges
// of an expert-parallel run (parallel_view.h).
#include "parallel_view.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "run_events.h"  // is_exposed_communication, the timeline rows' names

namespace moe::viewer {

std::vector<int64_t> alltoall_layers(const RunModel& run) {
  std::set<int64_t> layers;
  for (const AllToAllRecord& a : run.alltoalls) layers.insert(a.layer);
  return {layers.begin(), layers.end()};
}

namespace {
// The dispatch matrices of one step, column sums: what each rank received to compute.
RankLoad load_from(const AllToAllView& dispatch) {
  RankLoad load;
  load.step = dispatch.step;
  load.ranks = dispatch.ranks;
  load.received.assign(static_cast<size_t>(dispatch.ranks), 0.0);
  for (int64_t s = 0; s < dispatch.ranks; ++s)
    for (int64_t d = 0; d < dispatch.ranks; ++d)
      load.received[static_cast<size_t>(d)] += dispatch.bytes[static_cast<size_t>(s * dispatch.ranks + d)];
  double sum = 0, largest = -1;
  for (int64_t r = 0; r < load.ranks; ++r) {
    const double b = load.received[static_cast<size_t>(r)];
    sum += b;
    if (b > largest) {
      largest = b;
      load.busiest_rank = r;
    }
  }
  load.max_over_mean = sum > 0 ? largest / (sum / static_cast<double>(load.ranks)) : 0;
  return load;
}
}  // namespace

RankLoad rank_load_at(const RunModel& run, int64_t step, int64_t layer) {
  const AllToAllView dispatch = alltoall_at(run, step, "dispatch", layer);
  if (dispatch.events == 0) return RankLoad{};
  return load_from(dispatch);
}

Series rank_imbalance_series(const RunModel& run, int64_t layer) {
  std::set<int64_t> steps;
  for (const AllToAllRecord& a : run.alltoalls)
    if (a.name == "dispatch" && (layer < 0 || a.layer == layer)) steps.insert(a.step);
  Series out;
  for (int64_t step : steps) {
    out.steps.push_back(static_cast<double>(step));
    out.values.push_back(rank_load_at(run, step, layer).max_over_mean);
  }
  return out;
}

bool is_exchange_span(const SpanRecord& span) {
  constexpr std::string_view kSuffix = "_exchange";
  return span.stream_name.rfind("exchange", 0) == 0 || span.stream_name.rfind("comm", 0) == 0 ||
         (span.name.size() >= kSuffix.size() && span.name.compare(span.name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0);
}

namespace {
// The exchanges of one step: per rank, per name, the durations in start order.
using RankExchanges = std::map<std::string, std::vector<std::pair<double, double>>>;  // name -> (start, duration)

ExchangeWaits waits_of(const std::map<int64_t, RankExchanges>& by_rank, int64_t step) {
  ExchangeWaits w;
  w.step = step;
  if (by_rank.size() < 2) return w;
  // Ranks are numbered 0..R-1; a rank with no exchange at all leaves no collective matched.
  w.ranks = by_rank.rbegin()->first + 1;
  w.exchange_us.assign(static_cast<size_t>(w.ranks), 0.0);
  w.idle_us.assign(static_cast<size_t>(w.ranks), 0.0);
  if (static_cast<int64_t>(by_rank.size()) != w.ranks) return w;
  std::set<std::string> names;
  for (const auto& [rank, exchanges] : by_rank)
    for (const auto& [name, spans] : exchanges) names.insert(name);
  for (const std::string& name : names) {
    // The k-th exchange of this name on every rank is one collective; match as many as all have.
    size_t matched = std::numeric_limits<size_t>::max();
    for (const auto& [rank, exchanges] : by_rank) {
      auto it = exchanges.find(name);
      matched = std::min(matched, it == exchanges.end() ? size_t{0} : it->second.size());
    }
    if (matched == 0) continue;
    w.names.push_back(name);
    for (size_t k = 0; k < matched; ++k) {
      double shortest = std::numeric_limits<double>::infinity();
      for (const auto& [rank, exchanges] : by_rank) shortest = std::min(shortest, exchanges.at(name)[k].second);
      for (const auto& [rank, exchanges] : by_rank) {
        const double duration = exchanges.at(name)[k].second;
        w.exchange_us[static_cast<size_t>(rank)] += duration;
        w.idle_us[static_cast<size_t>(rank)] += duration - shortest;
      }
      ++w.exchanges;
    }
  }
  return w;
}

// Every step's exchanges, by step and rank, their spans sorted by start.
std::map<int64_t, std::map<int64_t, RankExchanges>> exchanges_by_step(const RunModel& run, int64_t only_step) {
  std::map<int64_t, std::map<int64_t, RankExchanges>> out;
  for (const SpanRecord& s : run.spans)
    if ((only_step == std::numeric_limits<int64_t>::min() || s.step == only_step) && is_exchange_span(s))
      out[s.step][s.rank][s.name].emplace_back(s.start_us, s.duration_us);
  for (auto& [step, ranks] : out)
    for (auto& [rank, exchanges] : ranks)
      for (auto& [name, spans] : exchanges) std::sort(spans.begin(), spans.end());
  return out;
}
}  // namespace

ExchangeWaits exchange_waits_at(const RunModel& run, int64_t step) {
  const int64_t shown = timeline_step(run, step);
  if (shown == std::numeric_limits<int64_t>::min()) return ExchangeWaits{};
  const auto steps = exchanges_by_step(run, shown);
  if (steps.empty()) {
    ExchangeWaits none;
    none.step = shown;
    return none;
  }
  return waits_of(steps.begin()->second, shown);
}

std::vector<Series> exchange_idle_series(const RunModel& run) {
  std::vector<Series> out;
  for (const auto& [step, ranks] : exchanges_by_step(run, std::numeric_limits<int64_t>::min())) {
    const ExchangeWaits w = waits_of(ranks, step);
    if (w.exchanges == 0) continue;
    if (out.size() < static_cast<size_t>(w.ranks)) out.resize(static_cast<size_t>(w.ranks));
    for (int64_t r = 0; r < w.ranks; ++r) {
      out[static_cast<size_t>(r)].steps.push_back(static_cast<double>(step));
      out[static_cast<size_t>(r)].values.push_back(w.idle_us[static_cast<size_t>(r)]);
    }
  }
  return out;
}

bool is_first_compute_stream(const SpanRecord& span) {
  const std::string_view name = span.stream_name, second = kSecondMicroBatchSuffix;
  return name.rfind(kComputeRow, 0) == 0 && name.find(second) == std::string_view::npos;
}

namespace {
// The exposed communication and step time of every rank at one recorded step (all steps: only_step
// = min), by step.
std::map<int64_t, ExposedCommunication> exposed_by_step(const RunModel& run, int64_t only_step) {
  struct Extent {
    double first = std::numeric_limits<double>::infinity(), last = -std::numeric_limits<double>::infinity();
    double exposed = 0;
  };
  std::map<int64_t, std::map<int64_t, Extent>> extents;  // step -> rank -> extent
  for (const SpanRecord& s : run.spans) {
    if (only_step != std::numeric_limits<int64_t>::min() && s.step != only_step) continue;
    Extent& e = extents[s.step][s.rank];
    e.first = std::min(e.first, s.start_us);
    e.last = std::max(e.last, s.start_us + s.duration_us);
    if (is_first_compute_stream(s) && moe::is_exposed_communication(s.name)) e.exposed += s.duration_us;
  }
  std::map<int64_t, ExposedCommunication> out;
  for (const auto& [step, ranks] : extents) {
    ExposedCommunication& x = out[step];
    x.step = step;
    x.ranks = ranks.rbegin()->first + 1;
    x.exposed_us.assign(static_cast<size_t>(x.ranks), 0.0);
    x.step_us.assign(static_cast<size_t>(x.ranks), 0.0);
    for (const auto& [rank, e] : ranks) {
      x.exposed_us[static_cast<size_t>(rank)] = e.exposed;
      x.step_us[static_cast<size_t>(rank)] = e.last - e.first;
    }
  }
  return out;
}
}  // namespace

ExposedCommunication exposed_communication_at(const RunModel& run, int64_t step) {
  const int64_t shown = timeline_step(run, step);
  if (shown == std::numeric_limits<int64_t>::min()) return ExposedCommunication{};
  const auto steps = exposed_by_step(run, shown);
  if (steps.empty()) {
    ExposedCommunication none;
    none.step = shown;
    return none;
  }
  return steps.begin()->second;
}

std::vector<Series> exposed_communication_series(const RunModel& run) {
  std::vector<Series> out;
  for (const auto& [step, x] : exposed_by_step(run, std::numeric_limits<int64_t>::min())) {
    if (out.size() < static_cast<size_t>(x.ranks)) out.resize(static_cast<size_t>(x.ranks));
    for (int64_t r = 0; r < x.ranks; ++r) {
      out[static_cast<size_t>(r)].steps.push_back(static_cast<double>(step));
      out[static_cast<size_t>(r)].values.push_back(x.exposed_us[static_cast<size_t>(r)]);
    }
  }
  return out;
}

PlacementView placement_at(const RunModel& run, int64_t step, int64_t layer) {
  PlacementView view;
  for (const TableRecord& table : run.tables) {
    if (table.name != "placement" || table.columns.size() < 6) continue;
    for (const std::vector<std::string>& row : table.rows) {
      if (row.size() < 6) continue;
      const nlohmann::json ranks = nlohmann::json::parse(row[5], nullptr, /*allow_exceptions=*/false);
      int64_t at = 0, row_layer = 0;
      try {
        at = std::stoll(row[0]);
        row_layer = std::stoll(row[1]);
      } catch (const std::exception&) {
        continue;
      }
      if (!ranks.is_array()) continue;
      if (layer < 0) layer = row_layer;  // the first MoE block named
      if (row_layer != layer) continue;
      view.plan_steps.push_back(at);
      if (at > step || at < view.planned_at) continue;
      std::vector<std::vector<int64_t>> experts_of_rank;
      bool valid = true;
      for (const nlohmann::json& experts : ranks) {
        std::vector<int64_t>& mine = experts_of_rank.emplace_back();
        valid = valid && experts.is_array();
        for (size_t i = 0; valid && i < experts.size(); ++i) {
          valid = experts[i].is_number_integer() && experts[i].get<int64_t>() >= 0 && experts[i].get<int64_t>() < 4096;
          if (valid) mine.push_back(experts[i].get<int64_t>());
        }
      }
      if (!valid) continue;
      view.planned_at = at;
      view.layer = row_layer;
      view.experts_of_rank = std::move(experts_of_rank);
      view.expected_before = std::strtod(row[2].c_str(), nullptr);
      view.expected_after = std::strtod(row[3].c_str(), nullptr);
    }
  }
  std::sort(view.plan_steps.begin(), view.plan_steps.end());
  for (const std::vector<int64_t>& mine : view.experts_of_rank) {
    for (int64_t e : mine) {
      if (view.copies.size() <= size_t(e)) view.copies.resize(size_t(e) + 1, 0);
      ++view.copies[size_t(e)];
    }
  }
  return view;
}

}  // namespace moe::viewer
