// sim/step_load.cpp: a block's rows on the cluster (step_load.h).
#include "sim/step_load.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moe::sim {

void check_placement(int64_t experts, int64_t ranks) {
  if (experts < 1 || ranks < 1 || experts % ranks != 0) {
    throw std::invalid_argument("E = " + std::to_string(experts) + " experts on R = " + std::to_string(ranks) +
                                " ranks: E must be a multiple of R (each rank holds E / R experts)");
  }
}

std::vector<double> StepLoad::rows_per_rank() const {
  std::vector<double> out(static_cast<size_t>(ranks), 0.0);
  const int64_t per_rank = experts_per_rank();
  for (int64_t e = 0; e < experts; ++e) out[static_cast<size_t>(e / per_rank)] += rows_per_expert[static_cast<size_t>(e)];
  return out;
}

StepLoad step_load_from_tokens(const BlockLoad& load, int64_t ranks) {
  if (load.sources != ranks) {
    throw std::invalid_argument("a trace of " + std::to_string(load.sources) + " source ranks replayed exactly on R = " +
                                std::to_string(ranks) + " (replay it through its shares instead)");
  }
  check_placement(load.experts, ranks);
  StepLoad out;
  out.ranks = ranks;
  out.experts = load.experts;
  out.rows_per_expert.assign(static_cast<size_t>(load.experts), 0.0);
  out.rows.assign(static_cast<size_t>(ranks * ranks), 0.0);
  const int64_t per_rank = load.experts / ranks;
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t e = 0; e < load.experts; ++e) {
      const double n = static_cast<double>(load.tokens[static_cast<size_t>(s * load.experts + e)]);
      out.rows_per_expert[static_cast<size_t>(e)] += n;
      out.rows[static_cast<size_t>(s * ranks + e / per_rank)] += n;
    }
  }
  return out;
}

StepLoad step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank) {
  const int64_t E = static_cast<int64_t>(shares.size());
  check_placement(E, ranks);
  StepLoad out;
  out.ranks = ranks;
  out.experts = E;
  out.rows_per_expert.resize(static_cast<size_t>(E));
  std::vector<double> rank_share(static_cast<size_t>(ranks), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    out.rows_per_expert[static_cast<size_t>(e)] = shares[static_cast<size_t>(e)] * rows_per_rank * static_cast<double>(ranks);
    rank_share[static_cast<size_t>(e / (E / ranks))] += shares[static_cast<size_t>(e)];
  }
  out.rows.resize(static_cast<size_t>(ranks * ranks));
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t t = 0; t < ranks; ++t) out.rows[static_cast<size_t>(s * ranks + t)] = rows_per_rank * rank_share[static_cast<size_t>(t)];
  }
  return out;
}

void apply_capacity(StepLoad& load, double capacity) {
  if (capacity <= 0) return;
  const std::vector<double> routed = load.rows_per_rank();
  for (double& rows : load.rows_per_expert) rows = std::min(rows, capacity);
  const std::vector<double> kept = load.rows_per_rank();
  for (int64_t t = 0; t < load.ranks; ++t) {
    const double fraction = routed[static_cast<size_t>(t)] > 0 ? kept[static_cast<size_t>(t)] / routed[static_cast<size_t>(t)] : 1.0;
    for (int64_t s = 0; s < load.ranks; ++s) load.rows[static_cast<size_t>(s * load.ranks + t)] *= fraction;
  }
}

StepLoad scaled(const StepLoad& load, double factor) {
  StepLoad out = load;
  for (double& x : out.rows_per_expert) x *= factor;
  for (double& x : out.rows) x *= factor;
  return out;
}

}  // namespace moe::sim
