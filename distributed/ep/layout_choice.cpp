// layout_choice.cpp: the valid layouts r and the cost model's choice (see layout_choice.h).
#include "ep/layout_choice.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "ep/placement.h"  // experts_per_rank, placement_of

namespace moe::dist {

// ---- settings ----

std::vector<int> valid_layouts(const MoeConfig& config, int ranks) {
  experts_per_rank(config, ranks);  // the storage needs R | E
  std::vector<int> layouts{0, 1};
  for (int r = 2; r <= ranks; ++r) {
    if (ranks % r == 0 && config.hidden_dim % r == 0) layouts.push_back(r);
  }
  return layouts;
}

void check_layout(const MoeConfig& config, int ranks, int r) {
  const std::vector<int> valid = valid_layouts(config, ranks);
  if (std::find(valid.begin(), valid.end(), r) != valid.end()) return;
  std::string why;
  if (r < 0) {
    why = "r must be 0 (data parallel), 1 (expert parallel) or a sharding degree > 1";
  } else if (ranks % r != 0) {
    why = "a sharding degree r > 1 must divide R = " + std::to_string(ranks) + " (groups of r consecutive ranks)";
  } else {
    why = "a sharding degree r > 1 must divide H = " + std::to_string(config.hidden_dim) +
          " (each rank of a group computes H / r columns of every group expert)";
  }
  std::string allowed;
  for (int v : valid) allowed += (allowed.empty() ? "" : ", ") + std::to_string(v);
  throw std::invalid_argument("expert layout r = " + std::to_string(r) + ": " + why + "; allowed here: r in {" +
                              allowed + "}");
}

std::string layout_name(int r) {
  if (r == 0) return "r=0 data parallel";
  if (r == 1) return "r=1 expert parallel";
  return "r=" + std::to_string(r) + " sharded over " + std::to_string(r) + " ranks along H";
}

// ---- the cost model ----

LayoutChoice choose_layout(const MoeConfig& config, int ranks, std::span<const int64_t> kept_per_rank_expert,
                           const LayoutCostModel& model) {
  validate(config);
  const int R = ranks;
  const int64_t E = config.num_experts, D = config.model_dim, H = config.hidden_dim;
  LayoutChoice choice;
  choice.by = "cost model";
  choice.candidates = valid_layouts(config, R);
  const int64_t E_r = experts_per_rank(config, R);
  if (!kept_per_rank_expert.empty() && static_cast<int64_t>(kept_per_rank_expert.size()) != R * E) {
    throw std::invalid_argument("choose_layout: kept_per_rank_expert has " +
                                std::to_string(kept_per_rank_expert.size()) + " counts; expected R x E = " +
                                std::to_string(R * E) + ", or none for uniform routing");
  }
  const bool padded = config.formulation == Formulation::padded;
  const double C = config.formulation == Formulation::dropless ? 0.0 : static_cast<double>(capacity(config));
  std::vector<double> kept(static_cast<size_t>(R) * E);  // [R, E]
  for (size_t i = 0; i < kept.size(); ++i) {
    if (!kept_per_rank_expert.empty()) {
      kept[i] = static_cast<double>(kept_per_rank_expert[i]);
    } else {  // uniform: T K / E slots an expert, at most C kept, spread evenly over the ranks
      double per_expert = static_cast<double>(config.tokens * config.top_k) / static_cast<double>(E);
      if (config.formulation != Formulation::dropless) per_expert = std::min(per_expert, C);
      kept[i] = per_expert / R;
    }
  }
  std::vector<double> kept_everywhere(E, 0.0);
  for (int p = 0; p < R; ++p) {
    for (int64_t e = 0; e < E; ++e) kept_everywhere[e] += kept[p * E + e];
  }
  const double P_e = static_cast<double>(D * w1_columns(config) + H * D);

  for (int r : choice.candidates) {
    const Placement place = placement_of(config, R, r);
    const int slices = r > 1 ? r : 1;
    LayoutEstimate estimate;
    estimate.r = r;
    double weight_elements = 0;
    if (r == 0) weight_elements = 2.0 * (R - 1) * E_r * P_e;
    if (r > 1) weight_elements = 2.0 * (r - 1) * E_r * P_e / r;
    estimate.collectives = R == 1 ? 0 : (r == 0 ? 2 : r == 1 ? 4 : 6);
    // The experts r = 1 computes are the ones a rank stores: the placement of r > 1 with r = 1.
    const Placement computing = r == 1 ? Placement{1, R, E, E_r, H} : place;
    for (int p = 0; p < R; ++p) {
      double sent_rows = 0, received_rows = 0, computed_rows = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (r != 0) {  // rows of p's slots to the other ranks computing e; rows to p from the others
          for (int q = 0; q < R; ++q) {
            if (q != p && computing.receives(q, p, e)) sent_rows += kept[p * E + e];
            if (q != p && computing.receives(p, q, e)) received_rows += kept[q * E + e];
          }
        }
        if (r == 0) {
          computed_rows += kept[p * E + e] + (padded && place.owner(e) == p ? C - kept_everywhere[e] : 0.0);
        } else if (computing.computes(p, e)) {
          computed_rows += padded ? C : kept_everywhere[e];
        }
      }
      const double token_elements = 2.0 * (sent_rows + received_rows) * D;
      // Forward: 2 D (w1_columns + H) FLOPs a row over the slice's share; backward twice that.
      const double flops = 3.0 * computed_rows * 2.0 * D * (w1_columns(config) + H) / slices;
      estimate.weight_bytes = std::max(estimate.weight_bytes, weight_elements * model.bytes_per_element);
      estimate.token_bytes = std::max(estimate.token_bytes, token_elements * model.bytes_per_element);
      estimate.expert_flops = std::max(estimate.expert_flops, flops);
    }
    estimate.communication_us = estimate.collectives * model.latency_us +
                                (estimate.weight_bytes + estimate.token_bytes) / model.bytes_per_us;
    estimate.compute_us = estimate.expert_flops / model.expert_flops_per_us;
    estimate.total_us = estimate.communication_us + estimate.compute_us;
    choice.estimates.push_back(estimate);
  }
  size_t best = 0;  // ties keep the smaller r
  for (size_t i = 1; i < choice.estimates.size(); ++i) {
    if (choice.estimates[i].total_us < choice.estimates[best].total_us) best = i;
  }
  choice.r = choice.estimates[best].r;
  return choice;
}

}  // namespace moe::dist
