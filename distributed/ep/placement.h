// placement.h: where the experts live on R ranks, and the fingerprint that ranks compare before
// they build a layer. Plain C++ (no Eigen, no CUDA): the CPU layer (expert_parallel_cpu.h), the
// GPU layer (expert_parallel_gpu.h) and the exchange plan (expert_parallel_plan.h) share these
// rules, and none of them needs another's library for them.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_plan
//
// Dimension legend: E experts, R ranks, E_r = E / R experts a rank. Rank r owns experts
// [r E_r, (r + 1) E_r) (FastMoE's placement: contiguous, the same count on every rank).
#pragma once

#include <cstdint>

#include "moe_config.h"  // MoeConfig

namespace moe::dist {

// E_r = E / R; throws std::invalid_argument unless R divides E.
int64_t experts_per_rank(const MoeConfig& config, int ranks);

// Who computes what in Tutel's layout r (layout_choice.h): r = 1 each expert on the rank that
// stores it; r = 0 every rank all E experts on its own tokens; r > 1 group g of r consecutive
// ranks computes the r E_r experts its ranks store, rank g r + s the H / r columns [s H / r, ...).
struct Placement {
  int r = 0;
  int ranks = 1;
  int64_t experts = 0;          // E
  int64_t stored_per_rank = 0;  // E_r
  int64_t hidden = 0;           // H

  int64_t computed_experts() const { return r == 0 ? experts : r * stored_per_rank; }
  int64_t first_expert(int p) const { return r == 0 ? 0 : (p / r) * r * stored_per_rank; }
  int64_t hidden_width() const { return r == 0 ? hidden : hidden / r; }
  int64_t hidden_begin(int p) const { return r == 0 ? 0 : (p % r) * hidden_width(); }
  int owner(int64_t e) const { return static_cast<int>(e / stored_per_rank); }
  bool computes(int p, int64_t e) const { return e >= first_expert(p) && e < first_expert(p) + computed_experts(); }
  // Whether rank p computes (its slice of) the rows that rank `source` routes to expert e.
  bool receives(int p, int source, int64_t e) const { return computes(p, e) && (r != 0 || p == source); }
};

// Every rank builds the same from the settings. Throws as experts_per_rank does.
Placement placement_of(const MoeConfig& config, int ranks, int r);

// A hash of every field of the config (FNV-1a, common/fnv1a.h): ranks compare it before any work.
uint64_t config_fingerprint(const MoeConfig& config);

}  // namespace moe::dist
