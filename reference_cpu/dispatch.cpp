// dispatch.cpp: builds the dispatch plan of each formulation (see dispatch.h).
#include "dispatch.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace moe::ref {

DispatchPlan plan_dispatch(const MoeConfig& config, const IndexMatrix& top_experts) {
  validate(config);
  const int64_t T = config.tokens, E = config.num_experts, K = config.top_k;
  if (top_experts.rows() != T || top_experts.cols() != K) {
    std::ostringstream message;
    message << "top_experts has shape [" << top_experts.rows() << ", " << top_experts.cols()
            << "]; expected [T, K] = [" << T << ", " << K << "]";
    throw std::invalid_argument(message.str());
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = top_experts(t, k);
      if (e < 0 || e >= E) {
        std::ostringstream message;
        message << "top_experts[" << t << ", " << k << "] = " << e << "; expected 0 <= e < E = " << E;
        throw std::invalid_argument(message.str());
      }
    }
  }

  DispatchPlan plan;
  plan.formulation = config.formulation;
  plan.tokens = T;
  plan.num_experts = E;
  plan.top_k = K;
  plan.block_size = config.block_size;
  plan.capacity = config.formulation == Formulation::dropless ? 0 : capacity(config);

  // ---- histogram and counting sort: stable, so each expert sees its slots in token order ----
  plan.tokens_per_expert.assign(E, 0);
  for (int64_t slot = 0; slot < T * K; ++slot) ++plan.tokens_per_expert[top_experts.data()[slot]];
  plan.routed_offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    plan.routed_offsets[e + 1] = plan.routed_offsets[e] + plan.tokens_per_expert[e];
  }
  plan.routed_slots.assign(T * K, -1);
  IndexVector cursor(plan.routed_offsets.begin(), plan.routed_offsets.end() - 1);
  for (int64_t slot = 0; slot < T * K; ++slot) {
    plan.routed_slots[cursor[top_experts.data()[slot]]++] = static_cast<int32_t>(slot);
  }

  // ---- rows per expert ----
  plan.kept_per_expert.assign(E, 0);
  plan.rows_per_expert.assign(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = plan.tokens_per_expert[e];
    switch (config.formulation) {
      case Formulation::dropping:
        plan.kept_per_expert[e] = static_cast<int32_t>(std::min(count, plan.capacity));
        plan.rows_per_expert[e] = plan.kept_per_expert[e];
        break;
      case Formulation::padded:
        plan.kept_per_expert[e] = static_cast<int32_t>(std::min(count, plan.capacity));
        plan.rows_per_expert[e] = static_cast<int32_t>(plan.capacity);
        break;
      case Formulation::dropless: {
        const int64_t B = config.block_size;
        plan.kept_per_expert[e] = static_cast<int32_t>(count);
        plan.rows_per_expert[e] = static_cast<int32_t>((count + B - 1) / B * B);
        break;
      }
    }
  }
  plan.row_offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    plan.row_offsets[e + 1] = plan.row_offsets[e] + plan.rows_per_expert[e];
  }
  plan.total_rows = plan.row_offsets[E];

  // ---- row <-> slot maps: the first kept_per_expert[e] slots of expert e, in token order ----
  plan.row_slot.assign(plan.total_rows, -1);
  plan.slot_row.assign(T * K, -1);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < plan.kept_per_expert[e]; ++i) {
      const int32_t slot = plan.routed_slots[plan.routed_offsets[e] + i];
      const int32_t row = static_cast<int32_t>(plan.row_offsets[e] + i);
      plan.row_slot[row] = slot;
      plan.slot_row[slot] = row;
    }
    plan.dropped_slots += plan.tokens_per_expert[e] - plan.kept_per_expert[e];
    plan.padding_rows += plan.rows_per_expert[e] - plan.kept_per_expert[e];
  }
  return plan;
}

}  // namespace moe::ref
