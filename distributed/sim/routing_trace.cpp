// sim/routing_trace.cpp: reading, writing and synthesising routing traces (routing_trace.h).
#include "sim/routing_trace.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>

#include "parse_number.h"  // parse_real, parse_integer
#include "run_record.h"    // RunReader

namespace moe::sim {

int64_t BlockLoad::total() const { return std::accumulate(tokens.begin(), tokens.end(), int64_t{0}); }

std::vector<double> BlockLoad::shares() const {
  std::vector<double> p(static_cast<size_t>(experts), 0.0);
  for (int64_t s = 0; s < sources; ++s) {
    for (int64_t e = 0; e < experts; ++e) p[static_cast<size_t>(e)] += static_cast<double>(tokens[static_cast<size_t>(s * experts + e)]);
  }
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x = sum > 0 ? x / sum : 1.0 / static_cast<double>(experts);
  return p;
}

std::vector<int64_t> RoutingTrace::steps() const {
  std::vector<int64_t> out;
  for (const BlockLoad& load : loads) out.push_back(load.step);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

nlohmann::json expert_load_event(const BlockLoad& load) {
  ExpertLoadEvent event{.step = load.step, .layer = load.layer};
  for (int64_t s = 0; s < load.sources; ++s) {
    event.tokens.emplace_back(load.tokens.begin() + s * load.experts, load.tokens.begin() + (s + 1) * load.experts);
  }
  return to_event(event);
}

RoutingTrace read_routing_trace(const std::filesystem::path& run_dir) {
  const std::string where = run_dir.string();
  RunRecord record;
  try {
    record = RunReader::load(run_dir);
  } catch (const std::exception& error) {
    throw std::invalid_argument("--trace " + where + ": not a readable run record: " + error.what());
  }
  RoutingTrace by_rank, by_expert;
  by_rank.source = by_expert.source = where;
  auto check_experts = [&](RoutingTrace& trace, const BlockLoad& load) {
    if (load.experts < 1) throw std::invalid_argument("--trace " + where + ": step " + std::to_string(load.step) + " has a block with no experts");
    if (!trace.loads.empty() && trace.loads.front().experts != load.experts) {
      throw std::invalid_argument("--trace " + where + ": blocks disagree on E (" + std::to_string(trace.loads.front().experts) +
                                  " and " + std::to_string(load.experts) + ")");
    }
    trace.loads.push_back(load);
  };
  for (const nlohmann::json& event : record.events) {
    const std::string type = event.value("type", "");
    if (type == "expert_load" && event.contains("tokens") && event["tokens"].is_array()) {
      BlockLoad load;
      load.step = event.value("step", int64_t{0});
      load.layer = event.value("layer", int64_t{0});
      load.sources = static_cast<int64_t>(event["tokens"].size());
      for (const nlohmann::json& row : event["tokens"]) {
        const std::vector<int64_t> counts = row.get<std::vector<int64_t>>();
        if (load.experts == 0) load.experts = static_cast<int64_t>(counts.size());
        if (static_cast<int64_t>(counts.size()) != load.experts) {
          throw std::invalid_argument("--trace " + where + ": an expert_load event's rows differ in length");
        }
        load.tokens.insert(load.tokens.end(), counts.begin(), counts.end());
      }
      check_experts(by_rank, load);
    } else if (type == "routing" && event.contains("tokens_per_expert")) {
      BlockLoad load;
      load.step = event.value("step", int64_t{0});
      load.layer = event.value("layer", int64_t{0});
      load.tokens = event["tokens_per_expert"].get<std::vector<int64_t>>();
      load.experts = static_cast<int64_t>(load.tokens.size());
      check_experts(by_expert, load);
    }
  }
  RoutingTrace& trace = by_rank.loads.empty() ? by_expert : by_rank;
  if (trace.loads.empty()) {
    throw std::invalid_argument("--trace " + where + ": a trace without counts: no expert_load or routing event "
                                "with tokens_per_expert (record with --record-every, or use --routing uniform|zipf:S|drift:S:STEPS)");
  }
  std::stable_sort(trace.loads.begin(), trace.loads.end(), [](const BlockLoad& a, const BlockLoad& b) {
    return a.step != b.step ? a.step < b.step : a.layer < b.layer;
  });
  return trace;
}

SyntheticRouting parse_synthetic(const std::string& text) {
  const std::string allowed = "allowed: uniform, zipf:S (S > 0) or drift:S:STEPS (STEPS >= 1)";
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ':');) parts.push_back(part);
  SyntheticRouting routing;
  auto exponent = [&](const std::string& part) {
    const std::optional<double> s = parse_real(part);
    if (!s || !std::isfinite(*s) || *s <= 0) throw std::invalid_argument("--routing " + text + ": '" + part + "' is not an exponent > 0; " + allowed);
    return *s;
  };
  if (parts.size() == 1 && parts[0] == "uniform") {
    routing.kind = SyntheticRouting::Kind::uniform;
  } else if (parts.size() == 2 && parts[0] == "zipf") {
    routing.kind = SyntheticRouting::Kind::zipf;
    routing.zipf_s = exponent(parts[1]);
  } else if (parts.size() == 3 && parts[0] == "drift") {
    routing.kind = SyntheticRouting::Kind::drift;
    routing.zipf_s = exponent(parts[1]);
    const std::optional<int64_t> steps = parse_integer(parts[2]);
    if (!steps || *steps < 1) throw std::invalid_argument("--routing " + text + ": '" + parts[2] + "' is not a whole number of steps >= 1; " + allowed);
    routing.drift_steps = *steps;
  } else {
    throw std::invalid_argument("--routing " + text + ": " + allowed);
  }
  return routing;
}

std::string describe(const SyntheticRouting& routing) {
  std::ostringstream out;
  switch (routing.kind) {
    case SyntheticRouting::Kind::uniform: out << "uniform"; break;
    case SyntheticRouting::Kind::zipf: out << "zipf:" << routing.zipf_s; break;
    case SyntheticRouting::Kind::drift: out << "drift:" << routing.zipf_s << ":" << routing.drift_steps; break;
  }
  return out.str();
}

std::vector<double> synthetic_shares(const SyntheticRouting& routing, int64_t experts, int64_t step) {
  if (experts < 1) throw std::invalid_argument("synthetic_shares: E must be >= 1");
  const size_t E = static_cast<size_t>(experts);
  std::vector<double> p(E, 1.0 / static_cast<double>(experts));
  if (routing.kind == SyntheticRouting::Kind::uniform) return p;
  // Popularity rank i (0 = hottest) belongs to expert order[(i + shift) % E]: a seeded order, so
  // the hot experts are spread over the ranks as a real router's would be.
  std::vector<size_t> order(E);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 generator(routing.seed);
  std::shuffle(order.begin(), order.end(), generator);
  const size_t shift = routing.kind == SyntheticRouting::Kind::drift ? static_cast<size_t>(step / routing.drift_steps) % E : 0;
  double sum = 0;
  for (size_t i = 0; i < E; ++i) sum += std::pow(static_cast<double>(i + 1), -routing.zipf_s);
  for (size_t i = 0; i < E; ++i) p[order[(i + shift) % E]] = std::pow(static_cast<double>(i + 1), -routing.zipf_s) / sum;
  return p;
}

std::vector<double> stretch_shares(const std::vector<double>& shares, int64_t experts) {
  if (shares.empty() || experts < 1) throw std::invalid_argument("stretch_shares: needs shares and E >= 1");
  const int64_t old_experts = static_cast<int64_t>(shares.size());
  if (old_experts == experts) return shares;
  std::vector<double> out(static_cast<size_t>(experts), 0.0);
  if (experts > old_experts) {  // split: new expert i takes old expert i E_old / E_new's share
    for (int64_t i = 0; i < experts; ++i) out[static_cast<size_t>(i)] = shares[static_cast<size_t>(i * old_experts / experts)];
  } else {  // merge: old expert j joins new expert j E_new / E_old
    for (int64_t j = 0; j < old_experts; ++j) out[static_cast<size_t>(j * experts / old_experts)] += shares[static_cast<size_t>(j)];
  }
  const double sum = std::accumulate(out.begin(), out.end(), 0.0);
  for (double& x : out) x = sum > 0 ? x / sum : 1.0 / static_cast<double>(experts);
  return out;
}

}  // namespace moe::sim
