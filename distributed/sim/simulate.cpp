// sim/simulate.cpp: a simulated run, step by step (simulate.h).
#include "sim/simulate.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>

#include "sim/layer_step.h"  // issue_layer_step
#include "sim/step_load.h"   // StepLoad

namespace moe::sim {

namespace {

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// The blocks of one step, as loads on the cluster, into `loads` (the last step's, whose memory is
// reused for synthetic routing).
void loads_of_step(const SimulationSpec& spec, int64_t step, const std::map<int64_t, std::vector<const BlockLoad*>>& trace_steps,
                   std::vector<StepLoad>& loads) {
  const int64_t R = spec.cluster.ranks(), E = spec.layer.experts;
  const double rows_per_rank = static_cast<double>(spec.layer.tokens_per_rank * spec.layer.top_k);
  if (!spec.trace) {
    const std::vector<double> shares = synthetic_shares(spec.synthetic, E, step);
    loads.resize(static_cast<size_t>(spec.blocks));
    for (StepLoad& load : loads) step_load_from_shares(shares, R, rows_per_rank, load);
  } else {
    loads.clear();
    auto it = trace_steps.begin();
    std::advance(it, static_cast<long>(step % static_cast<int64_t>(trace_steps.size())));
    for (const BlockLoad* block : it->second) {
      if (block->sources == R && block->experts == E) {
        loads.push_back(step_load_from_tokens(*block, R));
      } else {
        loads.push_back(step_load_from_shares(stretch_shares(block->shares(), E), R, rows_per_rank));
      }
    }
  }
  for (StepLoad& load : loads) {
    apply_capacity(load, spec.layer.capacity_rows(R));
    replicate_hot_experts(load, spec.layer.redundant_slots);
    if (spec.layer.shadow_per_step) shadow_hot_experts(load, spec.layer.model_dim, spec.layer.hidden_dim);
    apply_layout(load, spec.layer.layout);
  }
}

}  // namespace

double Simulation::median_step_us() const {
  std::vector<double> values;
  for (const SimulatedStep& s : steps) values.push_back(s.step_us);
  return median(values);
}

double Simulation::median_exposed_share() const {
  std::vector<double> values;
  for (const SimulatedStep& s : steps) values.push_back(s.exposed_share);
  return median(values);
}

Simulation simulate(const SimulationSpec& spec, const Calibration& calibration,
                    const std::function<void(const SimulatedStep&)>& on_step) {
  if (spec.steps < 1) throw std::invalid_argument("steps must be >= 1");
  if (!spec.trace && spec.blocks < 1) throw std::invalid_argument("blocks must be >= 1");
  const CostModel model(calibration, spec.cluster, spec.layer);
  const int64_t R = spec.cluster.ranks();
  std::map<int64_t, std::vector<const BlockLoad*>> trace_steps;
  if (spec.trace) {
    for (const BlockLoad& block : spec.trace->loads) trace_steps[block.step].push_back(&block);
    if (trace_steps.empty()) throw std::invalid_argument("the trace has no steps");
  }
  Timeline timeline(R);
  Simulation result;
  std::vector<StepLoad> loads;
  for (int64_t step = 0; step < spec.steps; ++step) {
    loads_of_step(spec, step, trace_steps, loads);
    SimulatedStep out;
    out.step = step;
    // Keep the first ranks' spans and the busiest rank's (the straggler the others wait for).
    std::vector<int64_t> kept;
    for (int64_t r = 0; r < std::min(R, spec.span_ranks); ++r) kept.push_back(r);
    std::vector<double> busiest(static_cast<size_t>(R), 0.0);
    for (const StepLoad& load : loads) {
      const std::vector<double> per_rank = load.rows_per_rank();
      for (int64_t r = 0; r < R; ++r) busiest[static_cast<size_t>(r)] += per_rank[static_cast<size_t>(r)];
      const double mean = std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / static_cast<double>(R);
      if (mean > 0) out.straggler = std::max(out.straggler, *std::max_element(per_rank.begin(), per_rank.end()) / mean);
      out.rows_per_expert.push_back(load.rows_per_expert);
    }
    kept.push_back(std::max_element(busiest.begin(), busiest.end()) - busiest.begin());
    timeline.keep_spans_of(kept);
    for (const StepLoad& load : loads) issue_layer_step(timeline, model, load);
    out.step_us = timeline.finish_step();
    out.compute_us = *std::max_element(timeline.compute_busy_us().begin(), timeline.compute_busy_us().end());
    out.exposed_us = median(timeline.exposed_communication_us());
    out.exposed_share = out.step_us > 0 ? out.exposed_us / out.step_us : 0;
    out.spans = timeline.take_spans();
    if (on_step) on_step(out);
    out.spans.clear();  // the record has them; a long run keeps only the figures
    result.steps.push_back(std::move(out));
  }
  return result;
}

}  // namespace moe::sim
