// offload/host_expert_choice.cpp: the copy-or-compute split of a block's missing experts (see the header).
#include "offload/host_expert_choice.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace moe::cuda {

std::string_view to_string(HostExperts mode) {
  switch (mode) {
    case HostExperts::off: return "off";
    case HostExperts::misses: return "misses";
    case HostExperts::cost_model: return "auto";
  }
  return "?";
}

HostExperts parse_host_experts(std::string_view text) {
  for (HostExperts mode : {HostExperts::off, HostExperts::misses, HostExperts::cost_model}) {
    if (text == to_string(mode)) return mode;
  }
  throw std::invalid_argument("unknown host-experts mode '" + std::string(text) +
                              "'; allowed: off (copy every miss) | misses (compute every miss on the host) | "
                              "auto (the cost model picks per expert)");
}

double HostExpertCosts::host_ms_at(int64_t rows) const {
  if (rows < 1) throw std::invalid_argument("host expert costs: rows must be >= 1, got " + std::to_string(rows));
  if (host_ms.empty()) throw std::invalid_argument("host expert costs: the host's times by rows are not measured");
  const auto n = static_cast<int64_t>(host_ms.size());
  if (rows <= n) return host_ms[size_t(rows - 1)];
  if (n == 1) return host_ms[0] * double(rows);
  const double slope = host_ms[size_t(n - 1)] - host_ms[size_t(n - 2)];
  return host_ms[size_t(n - 1)] + std::max(slope, 0.0) * double(rows - n);
}

namespace {
void check_spans(std::span<const int32_t> misses, std::span<const int64_t> rows) {
  if (misses.size() != rows.size()) {
    throw std::invalid_argument("choose_host_experts: " + std::to_string(misses.size()) + " misses but " +
                                std::to_string(rows.size()) + " row counts");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 1) {
      throw std::invalid_argument("choose_host_experts: expert " + std::to_string(misses[i]) + " has " +
                                  std::to_string(rows[i]) + " rows; a chosen expert has at least 1");
    }
  }
}
}  // namespace

std::vector<int32_t> choose_host_experts(HostExperts mode, std::span<const int32_t> misses,
                                         std::span<const int64_t> rows, const HostExpertCosts& costs,
                                         Backlogs backlogs) {
  check_spans(misses, rows);
  std::vector<int32_t> chosen;
  if (mode == HostExperts::misses) chosen.assign(misses.begin(), misses.end());
  if (mode == HostExperts::cost_model && !misses.empty()) {
    if (!(costs.copy_ms > 0)) {
      throw std::invalid_argument("choose_host_experts: the copy time must be > 0 ms, got " +
                                  std::to_string(costs.copy_ms));
    }
    // The misses by their host time, cheapest first (ties by id, so the choice is deterministic).
    std::vector<size_t> order(misses.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::vector<double> host(misses.size());
    for (size_t i = 0; i < misses.size(); ++i) host[i] = costs.host_ms_at(rows[i]);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return host[a] != host[b] ? host[a] < host[b] : misses[a] < misses[b];
    });
    const auto n = static_cast<int64_t>(misses.size());
    int64_t best_k = 0;
    const double copy_queue = std::max(backlogs.copy_ms, 0.0), host_queue = std::max(backlogs.host_ms, 0.0);
    double best = std::max(copy_queue + double(n) * costs.copy_ms, host_queue), host_sum = 0;
    for (int64_t k = 1; k <= n; ++k) {
      host_sum += host[order[size_t(k - 1)]] + (k == 1 ? std::max(costs.host_block_ms, 0.0) : 0.0);
      const double cost = std::max(copy_queue + double(n - k) * costs.copy_ms, host_queue + host_sum);
      if (cost < best) best = cost, best_k = k;
    }
    for (int64_t k = 0; k < best_k; ++k) chosen.push_back(misses[order[size_t(k)]]);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

double predicted_miss_ms(std::span<const int32_t> misses, std::span<const int64_t> rows,
                         std::span<const int32_t> on_host, const HostExpertCosts& costs, Backlogs backlogs) {
  check_spans(misses, rows);
  double copies = 0, host = 0;
  bool any_on_host = false;
  for (size_t i = 0; i < misses.size(); ++i) {
    if (std::find(on_host.begin(), on_host.end(), misses[i]) != on_host.end()) {
      host += costs.host_ms_at(rows[i]);
      any_on_host = true;
    } else {
      copies += costs.copy_ms;
    }
  }
  if (any_on_host) host += std::max(costs.host_block_ms, 0.0);
  return std::max(std::max(backlogs.copy_ms, 0.0) + copies, std::max(backlogs.host_ms, 0.0) + host);
}

}  // namespace moe::cuda
