// infer/expert_schedule.h: when a decoding model tells its ExpertSource (offload/expert_source.h)
// which experts the next MoE block will need: the five modes of Pre-gated MoE (Hwang et al., ISCA
// 2024) and mixtral-offloading, as the decoding model (infer/inference_model.h) runs them.
// Header only; used by InferenceModelGpu and moe_generate --mode.
//
// Number the MoE blocks m_0 < m_1 < ...; "before m_j's experts run" means after m_j's gate and
// before its expert products are enqueued, so copies for m_{j+1} overlap m_j's compute:
//   gpu_only      no prefetch: every expert resident (ResidentExperts); the baseline
//   on_demand     no prefetch: after m_j's gate its chosen experts are read back and acquired, the
//                 missing ones copied while the compute stream waits (OffloadedExperts)
//   prefetch_all  before m_j's experts run, prefetch every expert of m_{j+1} (m_0's: at the step's start)
//   pregated      before m_j's experts run, prefetch what m_j's pre-gate chose for m_{j+1}: exactly
//                 the experts m_{j+1} will use (a model trained with --pregated only)
//   speculative   before m_j's experts run, apply m_{j+1}'s own gate to m_j's LN2 output and
//                 prefetch that guess (mixtral-offloading); m_{j+1}'s real routing then acquires
//                 whatever the guess missed
// gpu_only and on_demand run the same schedule; they differ in the source. The schedule never
// changes a number: a block always computes with the experts its router chose, wherever they are.
#pragma once

#include <array>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe::cuda {

enum class ExpertSchedule { gpu_only, on_demand, prefetch_all, pregated, speculative };

inline constexpr std::array<ExpertSchedule, 5> kExpertSchedules = {
    ExpertSchedule::gpu_only, ExpertSchedule::on_demand, ExpertSchedule::prefetch_all, ExpertSchedule::pregated,
    ExpertSchedule::speculative};

inline std::string_view to_string(ExpertSchedule schedule) {
  switch (schedule) {
    case ExpertSchedule::gpu_only: return "gpu_only";
    case ExpertSchedule::on_demand: return "on_demand";
    case ExpertSchedule::prefetch_all: return "prefetch_all";
    case ExpertSchedule::pregated: return "pregated";
    case ExpertSchedule::speculative: return "speculative";
  }
  return "?";
}

// Throws std::invalid_argument listing the allowed names when the text matches none.
inline ExpertSchedule parse_expert_schedule(std::string_view text) {
  std::string allowed;
  for (ExpertSchedule schedule : kExpertSchedules) {
    if (text == to_string(schedule)) return schedule;
    allowed += (allowed.empty() ? "" : " | ") + std::string(to_string(schedule));
  }
  throw std::invalid_argument("unknown schedule '" + std::string(text) + "'; allowed: " + allowed);
}

}  // namespace moe::cuda
