// pregate.cpp: block i+1's routing from block i's input (see pregate.h).
#include "pregate.h"

namespace moe::ref {

PreGateOutput pregate(const MoeConfig& next_config, const Matrix& x_current,
                      const Matrix& next_gate_weights) {
  PreGateOutput out;
  out.router = route(next_config, x_current, next_gate_weights);
  out.plan = plan_dispatch(next_config, out.router.top_experts);
  for (int64_t e = 0; e < out.plan.num_experts; ++e) {
    if (out.plan.kept_per_expert[e] > 0) out.experts_to_prefetch.push_back(static_cast<int32_t>(e));
  }
  return out;
}

}  // namespace moe::ref
