// sim/step_load.cpp: a block's rows on the cluster (step_load.h).
#include "sim/step_load.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace moe::sim {

void check_placement(int64_t experts, int64_t ranks) {
  if (experts < 1 || ranks < 1 || experts % ranks != 0) {
    throw std::invalid_argument("E = " + std::to_string(experts) + " experts on R = " + std::to_string(ranks) +
                                " ranks: E must be a multiple of R (each rank holds E / R experts)");
  }
}

std::vector<double> StepLoad::expert_rows_of(int64_t r) const {
  if (!slot_rows.empty()) return slot_rows[static_cast<size_t>(r)];
  const int64_t per_rank = experts_per_rank();
  return {rows_per_expert.begin() + r * per_rank, rows_per_expert.begin() + (r + 1) * per_rank};
}

std::vector<double> StepLoad::rows_per_rank() const {
  std::vector<double> out(static_cast<size_t>(ranks), 0.0);
  for (int64_t r = 0; r < ranks; ++r) {
    for (double n : expert_rows_of(r)) out[static_cast<size_t>(r)] += n;
  }
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
  out.source_rows.assign(static_cast<size_t>(ranks * load.experts), 0.0);
  const int64_t per_rank = load.experts / ranks;
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t e = 0; e < load.experts; ++e) {
      const double n = static_cast<double>(load.tokens[static_cast<size_t>(s * load.experts + e)]);
      out.source_rows[static_cast<size_t>(s * load.experts + e)] = n;
      out.rows_per_expert[static_cast<size_t>(e)] += n;
      out.rows[static_cast<size_t>(s * ranks + e / per_rank)] += n;
    }
  }
  return out;
}

StepLoad step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank) {
  StepLoad out;
  step_load_from_shares(shares, ranks, rows_per_rank, out);
  return out;
}

void step_load_from_shares(const std::vector<double>& shares, int64_t ranks, double rows_per_rank, StepLoad& out) {
  const int64_t E = static_cast<int64_t>(shares.size());
  check_placement(E, ranks);
  // out's three large arrays are kept and overwritten: at R = 1024, E = 8192 the [R][E] rows alone
  // are 64 MB, and a fresh allocation every step costs more than the step's simulation.
  std::vector<double> rows_per_expert = std::move(out.rows_per_expert), rows = std::move(out.rows),
                      source_rows = std::move(out.source_rows);
  out = StepLoad{};
  out.ranks = ranks;
  out.experts = E;
  rows_per_expert.resize(static_cast<size_t>(E));
  std::vector<double> rank_share(static_cast<size_t>(ranks), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    rows_per_expert[static_cast<size_t>(e)] = shares[static_cast<size_t>(e)] * rows_per_rank * static_cast<double>(ranks);
    rank_share[static_cast<size_t>(e / (E / ranks))] += shares[static_cast<size_t>(e)];
  }
  rows.resize(static_cast<size_t>(ranks * ranks));
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t t = 0; t < ranks; ++t) rows[static_cast<size_t>(s * ranks + t)] = rows_per_rank * rank_share[static_cast<size_t>(t)];
  }
  source_rows.resize(static_cast<size_t>(ranks * E));
  for (int64_t s = 0; s < ranks; ++s) {
    for (int64_t e = 0; e < E; ++e) source_rows[static_cast<size_t>(s * E + e)] = shares[static_cast<size_t>(e)] * rows_per_rank;
  }
  out.rows_per_expert = std::move(rows_per_expert);
  out.rows = std::move(rows);
  out.source_rows = std::move(source_rows);
}

void apply_capacity(StepLoad& load, double capacity) {
  if (capacity <= 0) return;
  if (!load.slot_rows.empty()) throw std::logic_error("apply_capacity: cap the experts before placing replicas");
  const std::vector<double> routed = load.rows_per_rank();
  for (int64_t e = 0; e < load.experts; ++e) {  // every source's rows for e shrink by e's kept fraction
    const double all = load.rows_per_expert[static_cast<size_t>(e)];
    const double fraction = all > capacity ? capacity / all : 1.0;
    for (int64_t s = 0; s < load.ranks; ++s) load.source_rows[static_cast<size_t>(s * load.experts + e)] *= fraction;
  }
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
  for (double& x : out.source_rows) x *= factor;
  for (std::vector<double>& rank : out.slot_rows) {
    for (double& x : rank) x *= factor;
  }
  return out;
}

void apply_layout(StepLoad& load, int64_t layout) {
  if (layout == 1) return;
  if (!load.slot_rows.empty()) throw std::invalid_argument("Tutel's layouts r != 1 with replicas: not modelled");
  const int64_t R = load.ranks, E = load.experts, per_rank = load.experts_per_rank();
  load.slot_rows.assign(static_cast<size_t>(R), {});
  load.slot_experts.assign(static_cast<size_t>(R), {});
  std::fill(load.rows.begin(), load.rows.end(), 0.0);
  if (layout == 0) {
    for (int64_t s = 0; s < R; ++s) {
      for (int64_t e = 0; e < E; ++e) {
        const double n = load.source_rows[static_cast<size_t>(s * E + e)];
        load.slot_rows[static_cast<size_t>(s)].push_back(n);
        load.slot_experts[static_cast<size_t>(s)].push_back(e);
        load.rows[static_cast<size_t>(s * R + s)] += n;  // copied, not exchanged
      }
    }
    return;
  }
  // r > 1: rank t computes, for the r E / R experts of its group, every row routed to them.
  for (int64_t t = 0; t < R; ++t) {
    const int64_t first = t / layout * layout * per_rank, last = first + layout * per_rank;
    for (int64_t e = first; e < last; ++e) {
      load.slot_rows[static_cast<size_t>(t)].push_back(load.rows_per_expert[static_cast<size_t>(e)]);
      load.slot_experts[static_cast<size_t>(t)].push_back(e);
      for (int64_t s = 0; s < R; ++s) load.rows[static_cast<size_t>(s * R + t)] += load.source_rows[static_cast<size_t>(s * E + e)];
    }
  }
}

void apply_placement(StepLoad& load, const dist::ExpertPlacement& placement) {
  const int64_t R = load.ranks, E = load.experts;
  if (placement.experts() != E || placement.ranks() != R) {
    throw std::invalid_argument("a placement of E = " + std::to_string(placement.experts()) + " experts over R = " +
                                std::to_string(placement.ranks()) + " ranks applied to a load of E = " +
                                std::to_string(E) + " over R = " + std::to_string(R));
  }
  auto holders_of = [&](int64_t e) { return static_cast<double>(placement.replicas(e).size()); };
  // A shadowed expert's rows stay with their source; any other's split evenly over its replicas.
  auto slot_share = [&](int64_t s, int64_t e, int64_t t) {
    const double n = load.source_rows[static_cast<size_t>(s * E + e)];
    if (placement.shadowed(e)) return s == t ? n : 0.0;
    return n / holders_of(e);
  };
  load.slot_rows.assign(static_cast<size_t>(R), {});
  load.slot_experts.assign(static_cast<size_t>(R), {});
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t e : placement.experts_of(static_cast<int>(r))) {
      double rows = 0;
      for (int64_t s = 0; s < R; ++s) rows += slot_share(s, e, r);
      load.slot_rows[static_cast<size_t>(r)].push_back(rows);
      load.slot_experts[static_cast<size_t>(r)].push_back(e);
    }
  }
  load.holders.assign(static_cast<size_t>(E), 1);
  for (int64_t e = 0; e < E; ++e) load.holders[static_cast<size_t>(e)] = static_cast<int64_t>(holders_of(e));
  load.replicas = placement.slots() - E;
  std::fill(load.rows.begin(), load.rows.end(), 0.0);
  for (int64_t s = 0; s < R; ++s) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t slot : placement.replicas(e)) {
        const int64_t t = placement.slot_rank(slot);
        load.rows[static_cast<size_t>(s * R + t)] += slot_share(s, e, t);
      }
    }
  }
}

void shadow_hot_experts(StepLoad& load, int64_t model_dim, int64_t hidden_dim) {
  const int64_t R = load.ranks, E = load.experts;
  if (R == 1) return;
  if (!load.slot_rows.empty()) throw std::invalid_argument("shadowing decided per step with replicas or a layout r != 1: not modelled");
  std::vector<int64_t> routed(static_cast<size_t>(R * E));
  for (size_t i = 0; i < routed.size(); ++i) routed[i] = std::llround(load.source_rows[i]);
  const dist::ExpertPlacement plain = dist::contiguous_placement(E, static_cast<int>(R));
  const std::vector<int64_t> shadowed = dist::worth_shadowing(plain, routed, model_dim, hidden_dim, hidden_dim);
  if (shadowed.empty()) return;
  apply_placement(load, plain.with_shadowed(shadowed));
  load.replicas = 0;  // no copy is kept: none is summed over replicas
  load.shadowed_this_step = shadowed;
}

std::vector<double> top_k_shares(const std::vector<double>& weights, int64_t top_k) {
  const size_t E = weights.size();
  if (E == 0 || top_k < 1 || top_k > 3 || static_cast<size_t>(top_k) > E) {
    throw std::invalid_argument("top_k_shares: needs E >= K and 1 <= K <= 3 (K = " + std::to_string(top_k) + ", E = " +
                                std::to_string(E) + ")");
  }
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<double> p(E), in(E, 0.0);
  for (size_t i = 0; i < E; ++i) p[i] = weights[i] / total;
  // P(i among the first K draws without replacement) = sum over the orders of the draws before it.
  for (size_t i = 0; i < E; ++i) {
    in[i] += p[i];
    if (top_k < 2) continue;
    for (size_t j = 0; j < E; ++j) {
      if (j == i) continue;
      const double pj = p[j], after_j = p[i] / (1 - pj);
      in[i] += pj * after_j;
      if (top_k < 3) continue;
      for (size_t k = 0; k < E; ++k) {
        if (k == i || k == j) continue;
        in[i] += pj * p[k] / (1 - pj) * p[i] / (1 - pj - p[k]);
      }
    }
  }
  for (double& x : in) x /= static_cast<double>(top_k);
  return in;
}

void replicate_hot_experts(StepLoad& load, int64_t redundant_slots_per_rank) {
  if (redundant_slots_per_rank <= 0) return;
  apply_placement(load, dist::eplb_placement(load.rows_per_expert, static_cast<int>(load.ranks), redundant_slots_per_rank));
}

}  // namespace moe::sim
