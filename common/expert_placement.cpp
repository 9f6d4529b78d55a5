// expert_placement.cpp: placements, EPLB and the routing rule (see expert_placement.h).
#include "expert_placement.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "fnv1a.h"  // fnv1a_64_words

namespace moe::dist {

ExpertPlacement::ExpertPlacement(int64_t experts, std::vector<std::vector<int64_t>> rank_experts)
    : experts_(experts), rank_experts_(std::move(rank_experts)) {
  const int R = ranks();
  if (R < 1) throw std::invalid_argument("expert placement: no ranks; expected R >= 1");
  if (experts < 1) throw std::invalid_argument("expert placement: E = " + std::to_string(experts) + "; expected E >= 1");
  replicas_.assign(static_cast<size_t>(experts), {});
  first_slot_.assign(static_cast<size_t>(R) + 1, 0);
  for (int r = 0; r < R; ++r) {
    std::vector<int64_t>& mine = rank_experts_[static_cast<size_t>(r)];
    std::sort(mine.begin(), mine.end());
    for (size_t i = 0; i < mine.size(); ++i) {
      const int64_t e = mine[i];
      if (e < 0 || e >= experts) {
        throw std::invalid_argument("expert placement: rank " + std::to_string(r) + " holds expert " +
                                    std::to_string(e) + "; expert ids are 0 .. E - 1 = " + std::to_string(experts - 1));
      }
      if (i > 0 && mine[i - 1] == e) {
        throw std::invalid_argument("expert placement: rank " + std::to_string(r) + " holds expert " +
                                    std::to_string(e) + " twice; a rank holds an expert at most once");
      }
      replicas_[static_cast<size_t>(e)].push_back(static_cast<int64_t>(slot_expert_.size()));
      slot_expert_.push_back(e);
      slot_rank_.push_back(r);
    }
    first_slot_[static_cast<size_t>(r) + 1] = static_cast<int64_t>(slot_expert_.size());
  }
  shadowed_.assign(static_cast<size_t>(experts), false);
  for (int64_t e = 0; e < experts; ++e) {
    if (replicas_[static_cast<size_t>(e)].empty()) {
      throw std::invalid_argument("expert placement: expert " + std::to_string(e) +
                                  " is on no rank; every expert needs at least one");
    }
  }
}

bool ExpertPlacement::is_even_contiguous() const {
  if (experts_ % ranks() != 0 || replicated()) return false;
  const int64_t per_rank = experts_ / ranks();
  for (int64_t p = 0; p < slots(); ++p) {
    if (slot_expert(p) != p || slot_rank(p) != p / per_rank) return false;
  }
  return true;
}

ExpertPlacement ExpertPlacement::with_shadowed(const std::vector<int64_t>& experts) const {
  std::vector<std::vector<int64_t>> held = rank_experts_;
  for (int64_t e : experts) {
    if (e < 0 || e >= experts_) {
      throw std::invalid_argument("expert placement: shadowing expert " + std::to_string(e) +
                                  "; expert ids are 0 .. E - 1 = " + std::to_string(experts_ - 1));
    }
    for (auto& mine : held) {
      if (std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
    }
  }
  ExpertPlacement out(experts_, std::move(held));
  out.shadowed_ = shadowed_;
  for (int64_t e : experts) out.shadowed_[static_cast<size_t>(e)] = true;
  return out;
}

ExpertPlacement::Piece ExpertPlacement::piece(int source, int64_t expert, int64_t rows, int64_t replica) const {
  const std::vector<int64_t>& holders = replicas(expert);
  const int64_t n = static_cast<int64_t>(holders.size());
  if (n == 1) return {0, rows};
  if (shadowed(expert)) {  // on every rank: the source's own replica takes every row
    return slot_rank(holders[static_cast<size_t>(replica)]) == source ? Piece{0, rows} : Piece{rows, 0};
  }
  // The replica that takes the first piece: the source's own, else source mod n.
  int64_t start = source % n;
  for (int64_t i = 0; i < n; ++i) {
    if (slot_rank(holders[static_cast<size_t>(i)]) == source) start = i;
  }
  const int64_t order = (replica - start + n) % n;  // this replica's piece, counted from the first
  const int64_t base = rows / n, longer = rows % n;
  return {order * base + std::min(order, longer), base + (order < longer ? 1 : 0)};
}

uint64_t ExpertPlacement::fingerprint() const {
  uint64_t hash = fnv1a_64_words({static_cast<uint64_t>(ranks()), static_cast<uint64_t>(experts_)});
  for (int r = 0; r < ranks(); ++r) {
    hash = fnv1a_64_words({static_cast<uint64_t>(slots_of(r))}, hash);
    for (int64_t e : experts_of(r)) hash = fnv1a_64_words({static_cast<uint64_t>(e)}, hash);
  }
  for (int64_t e = 0; e < experts_; ++e) hash = fnv1a_64_words({shadowed(e) ? 1u : 0u}, hash);
  return hash;
}

std::string ExpertPlacement::describe() const {
  std::string out;
  for (int r = 0; r < ranks(); ++r) {
    if (r > 0) out += " | ";
    out += "rank ";
    out += std::to_string(r);
    out += ":";
    for (int64_t e : experts_of(r)) {
      out += ' ';
      out += std::to_string(e);
      if (shadowed(e)) out += '*';
    }
  }
  return out;
}

ExpertPlacement contiguous_placement(int64_t experts, int ranks) {
  if (ranks < 1 || experts < ranks) {
    throw std::invalid_argument("expert placement: E = " + std::to_string(experts) + " experts on R = " +
                                std::to_string(ranks) + " ranks; contiguous placement needs 1 <= R <= E");
  }
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    for (int64_t e = r * experts / ranks; e < (r + 1) * experts / ranks; ++e) held[static_cast<size_t>(r)].push_back(e);
  }
  return ExpertPlacement(experts, std::move(held));
}

ExpertPlacement eplb_placement(std::span<const double> expert_load, int ranks, int64_t redundant_slots_per_rank) {
  const int64_t E = static_cast<int64_t>(expert_load.size());
  if (ranks < 1 || E < ranks) {
    throw std::invalid_argument("EPLB: E = " + std::to_string(E) + " experts on R = " + std::to_string(ranks) +
                                " ranks; needs 1 <= R <= E");
  }
  for (int64_t e = 0; e < E; ++e) {
    const double load = expert_load[static_cast<size_t>(e)];
    if (!std::isfinite(load) || load < 0) {
      throw std::invalid_argument("EPLB: expert " + std::to_string(e) + "'s load is " + std::to_string(load) +
                                  "; loads are finite and >= 0");
    }
  }
  const int64_t base_slots = (E + ranks - 1) / ranks;
  if (redundant_slots_per_rank < 0 || redundant_slots_per_rank > E - base_slots) {
    throw std::invalid_argument("EPLB: " + std::to_string(redundant_slots_per_rank) +
                                " redundant slots a rank; allowed 0 .. E - ceil(E / R) = " +
                                std::to_string(E - base_slots) + " (a rank holds each expert at most once)");
  }
  const int64_t slots_per_rank = base_slots + redundant_slots_per_rank;
  auto load_of = [&](int64_t e) { return expert_load[static_cast<size_t>(e)]; };

  // ---- replicate: each free slot to the expert with the most load a replica ----
  std::vector<int64_t> copies(static_cast<size_t>(E), 1);
  auto per_replica = [&](int64_t e) { return load_of(e) / static_cast<double>(copies[static_cast<size_t>(e)]); };
  for (int64_t extra = ranks * slots_per_rank - E; extra > 0; --extra) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (copies[static_cast<size_t>(e)] == ranks) continue;
      if (best < 0 || per_replica(e) > per_replica(best)) best = e;
    }
    ++copies[static_cast<size_t>(best)];  // one exists: slots_per_rank <= E leaves an expert with copies < R
  }

  // ---- pack: replicas by load, most first, each to the least loaded rank that can take it ----
  std::vector<int64_t> items;  // one entry per replica
  for (int64_t e = 0; e < E; ++e) items.insert(items.end(), static_cast<size_t>(copies[static_cast<size_t>(e)]), e);
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return per_replica(a) > per_replica(b); });
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(ranks));
  std::vector<double> rank_load(static_cast<size_t>(ranks), 0.0);
  auto holds = [&](int r, int64_t e) {
    const auto& h = held[static_cast<size_t>(r)];
    return std::find(h.begin(), h.end(), e) != h.end();
  };
  auto has_room = [&](int r) { return static_cast<int64_t>(held[static_cast<size_t>(r)].size()) < slots_per_rank; };
  for (const int64_t e : items) {
    int target = -1;
    for (int r = 0; r < ranks; ++r) {
      if (!has_room(r) || holds(r, e)) continue;
      if (target < 0 || rank_load[static_cast<size_t>(r)] < rank_load[static_cast<size_t>(target)]) target = r;
    }
    if (target < 0) {
      // Every rank with room already holds e. Rank `room` (with room) takes an expert f from a full
      // rank u without e that `room` lacks, and u takes e. Such u and f exist: fewer than R ranks
      // hold e, and `room` holds fewer experts than u, so not all of u's.
      int room = 0;
      while (!has_room(room)) ++room;
      for (int u = 0; u < ranks && target < 0; ++u) {
        if (holds(u, e)) continue;
        auto& from = held[static_cast<size_t>(u)];
        for (size_t i = 0; i < from.size(); ++i) {
          if (holds(room, from[i])) continue;
          const int64_t f = from[i];
          held[static_cast<size_t>(room)].push_back(f);
          rank_load[static_cast<size_t>(room)] += per_replica(f);
          rank_load[static_cast<size_t>(u)] -= per_replica(f);
          from.erase(from.begin() + static_cast<std::ptrdiff_t>(i));
          target = u;
          break;
        }
      }
      if (target < 0) throw std::logic_error("EPLB: no rank can take a replica (the packing's invariant broke)");
    }
    held[static_cast<size_t>(target)].push_back(e);
    rank_load[static_cast<size_t>(target)] += per_replica(e);
  }
  return ExpertPlacement(E, std::move(held));
}

std::vector<int64_t> worth_shadowing(const ExpertPlacement& placement, std::span<const int64_t> routed,
                                     int64_t model_dim, int64_t w1_columns, int64_t hidden_dim) {
  const int R = placement.ranks();
  const int64_t E = placement.experts();
  if (static_cast<int64_t>(routed.size()) != static_cast<int64_t>(R) * E) {
    throw std::invalid_argument("worth_shadowing: " + std::to_string(routed.size()) + " counts; expected R x E = " +
                                std::to_string(static_cast<int64_t>(R) * E));
  }
  const double weight_bytes = static_cast<double>(R - 1) *
                              static_cast<double>(model_dim * w1_columns + hidden_dim * model_dim) * (2.0 + 8.0);
  std::vector<int64_t> out;
  for (int64_t e = 0; e < E; ++e) {
    if (R == 1 || placement.shadowed(e)) continue;
    const std::vector<int64_t>& replicas = placement.replicas(e);
    double crossing = 0;  // rows of e that leave their source
    for (int s = 0; s < R; ++s) {
      const int64_t n = routed[static_cast<size_t>(s) * E + e];
      for (size_t i = 0; i < replicas.size(); ++i) {
        if (placement.slot_rank(replicas[i]) != s) crossing += static_cast<double>(placement.piece(s, e, n, static_cast<int64_t>(i)).count);
      }
    }
    if (8.0 * static_cast<double>(model_dim) * crossing > weight_bytes) out.push_back(e);
  }
  return out;
}

std::vector<double> expected_rank_load(const ExpertPlacement& placement, std::span<const double> expert_load) {
  if (static_cast<int64_t>(expert_load.size()) != placement.experts()) {
    throw std::invalid_argument("expected_rank_load: " + std::to_string(expert_load.size()) + " loads for E = " +
                                std::to_string(placement.experts()) + " experts");
  }
  std::vector<double> load(static_cast<size_t>(placement.ranks()), 0.0);
  for (int64_t e = 0; e < placement.experts(); ++e) {
    const auto& slots = placement.replicas(e);
    for (int64_t p : slots) {
      load[static_cast<size_t>(placement.slot_rank(p))] += expert_load[static_cast<size_t>(e)] / static_cast<double>(slots.size());
    }
  }
  return load;
}

}  // namespace moe::dist
