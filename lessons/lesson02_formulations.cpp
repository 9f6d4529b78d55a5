// lesson02_formulations.cpp: Lesson 02, dropping vs padded vs dropless. The same routed tokens
// computed three ways: how many tokens a capacity factor drops, how much padding each formulation
// computes, and what block size costs the dropless formulation: the trade MegaBlocks removes, seen
// on one routing before any kernel. Read lessons/02_formulations.md.
//
// Build and run:  ./moe build && build/lessons/lesson02_formulations [--out runs/lesson02_formulations]
//
// Everything runs on the CPU reference (moe::ref, double precision). Dimension legend:
// T tokens, D model width, H expert hidden width, E experts, K top-k, C capacity, B block size.
#include <cmath>
#include <iostream>
#include <sstream>

#include "expert_ffn.h"               // activate
#include "init.h"                     // random_weights
#include "lesson_support.h"           // options, zipf_tokens, Table
#include "reference_cpu/moe_layer.h"  // moe_forward

using namespace moe;
using moe::lessons::Table;
using moe::lessons::relative_error;

namespace {

// The definition of an MoE layer, one token at a time: y_t = sum_k w_tk * FFN_{e_tk}(x_t).
// No capacity, no padding, no permutation: what the dropless formulation must reproduce.
ref::Matrix per_token_moe(const MoeConfig& config, const ref::Matrix& x,  // [T, D]
                          const ref::MoeWeights& weights, const ref::RouterOutput& routing) {
  ref::Matrix y = ref::Matrix::Zero(x.rows(), x.cols());
  for (int64_t t = 0; t < config.tokens; ++t) {
    for (int64_t k = 0; k < config.top_k; ++k) {
      const int32_t e = routing.top_experts(t, k);
      const ref::Matrix hidden = ref::activate(config, x.row(t) * weights.w1[e]);  // [1, H]
      y.row(t) += routing.combine_weights(t, k) * (hidden * weights.w2[e]);
    }
  }
  return y;
}

// ---- the oracle: dropless, checked against the per-token definition ----

struct Oracle {
  ref::LayerForward dropless;
  ref::Matrix per_token;  // [T, D] per_token_moe on the same routing
  double error = 0;       // dropless against per_token, relative
};

Oracle check_dropless(RunWriter& writer, const MoeConfig& config, const ref::Matrix& x,
                      const ref::MoeWeights& weights) {
  Oracle o;
  o.dropless = ref::moe_forward(config, x, weights);
  const ref::LayerForward& dropless = o.dropless;
  o.per_token = per_token_moe(config, x, weights, dropless.router);
  o.error = relative_error(dropless.y, o.per_token);
  const int64_t routed_rows = config.tokens * config.top_k;
  int32_t max_count = 0;
  for (int32_t n : dropless.plan.tokens_per_expert) max_count = std::max(max_count, n);
  std::cout << "routed slots T*K = " << routed_rows << ", mean per expert "
            << routed_rows / config.num_experts << ", busiest expert " << max_count << "\n";
  writer.append(to_event(RoutingEvent{.step = 0, .layer = 0,
                                      .tokens_per_expert = lessons::as_int64(dropless.plan.tokens_per_expert),
                                      .dropped_per_expert = {}, .capacity = std::nullopt,
                                      .tokens_per_expert_by_genre = {}}));
  return o;
}

// ---- 1. capacity factors ----

struct CapacityChecks {
  bool padded_matches_dropping = true;     // at every cf
  bool large_cf_matches_dropless = false;  // where nothing is dropped
};

// C = ceil(cf * T * K / E). Dropping computes min(count, C) rows per expert and drops the rest;
// padded always computes C rows (one dense batched GEMM [E, C, D]); both give the same y.
CapacityChecks show_capacity_factors(RunWriter& writer, const MoeConfig& config, const ref::Matrix& x,
                                     const ref::MoeWeights& weights, const ref::LayerForward& dropless) {
  Table capacity_table(
      "Table 1: capacity factor cf, capacity C = ceil(cf*T*K/E), dropping and padded formulations",
      {"cf", "C", "dropped %", "dropping rows", "padded rows", "padding % (padded)",
       "useful FLOP % (padded)", "rel err of y vs dropless"});
  CapacityChecks checks;
  const int64_t routed_rows = config.tokens * config.top_k;
  for (double cf : {0.5, 1.0, 1.25, 1.5, 2.0, 4.0, 16.0}) {
    MoeConfig c = config;
    c.capacity_factor = cf;
    c.formulation = Formulation::dropping;
    const ref::LayerForward dropping = ref::moe_forward(c, x, weights);
    c.formulation = Formulation::padded;
    const ref::LayerForward padded = ref::moe_forward(c, x, weights);
    checks.padded_matches_dropping = checks.padded_matches_dropping && relative_error(padded.y, dropping.y) < 1e-12;
    const double error = relative_error(dropping.y, dropless.y);
    if (dropping.plan.dropped_slots == 0) checks.large_cf_matches_dropless = error < 1e-12;
    const double padded_rows = static_cast<double>(padded.plan.total_rows);
    capacity_table.add_row({cf, dropping.plan.capacity,
                            100.0 * dropping.plan.dropped_slots / routed_rows,
                            dropping.plan.total_rows, padded.plan.total_rows,
                            100.0 * padded.plan.padding_rows / padded_rows,
                            100.0 * (routed_rows - dropping.plan.dropped_slots) / padded_rows, error});
    std::vector<int64_t> dropped(config.num_experts);
    for (int64_t e = 0; e < config.num_experts; ++e) {
      dropped[e] = dropping.plan.tokens_per_expert[e] - dropping.plan.kept_per_expert[e];
    }
    writer.append(to_event(RoutingEvent{.step = static_cast<int64_t>(cf * 100), .layer = 0,
                                        .tokens_per_expert = lessons::as_int64(dropping.plan.tokens_per_expert),
                                        .dropped_per_expert = dropped, .capacity = dropping.plan.capacity,
                                        .tokens_per_expert_by_genre = {}}));
  }
  lessons::show(writer, capacity_table);
  std::cout << "  (routing events in the run record use step = 100 * cf, one per capacity factor)\n";
  return checks;
}

// ---- 2. block sizes ----

// Dropless rounds each expert's rows up to B so the product tiles into B x B blocks: the only
// padding it computes is under one block per expert, whatever the skew.
// Returns whether every B gives the per-token y with less than one block of padding per expert.
bool show_block_sizes(RunWriter& writer, const MoeConfig& config, const ref::Matrix& x, const ref::MoeWeights& weights,
                      const ref::Matrix& per_token) {
  Table block_table("Table 2: dropless, block size B: rows computed and padding",
                    {"B", "rows", "padding rows", "padding %", "blocks (nnz)", "useful FLOP %",
                     "rel err of y vs per-token"});
  bool blocks_ok = true;
  const int64_t routed_rows = config.tokens * config.top_k;
  const double useful_flops_per_row = 4.0 * config.model_dim * config.hidden_dim;  // x W1 and h W2
  for (int64_t b : {8, 16, 32, 64, 128}) {
    MoeConfig c = config;
    c.block_size = b;
    const ref::LayerForward forward = ref::moe_forward(c, x, weights);
    const auto& topology = *forward.topology;
    const double error = relative_error(forward.y, per_token);
    blocks_ok = blocks_ok && error < 1e-12 && forward.plan.padding_rows < b * config.num_experts;
    block_table.add_row({b, forward.plan.total_rows, forward.plan.padding_rows,
                         100.0 * forward.plan.padding_rows / forward.plan.total_rows, topology.nnz,
                         100.0 * routed_rows / forward.plan.total_rows, error});
    std::vector<int64_t> rows(forward.plan.rows_per_expert.begin(), forward.plan.rows_per_expert.end());
    writer.append(to_event(TopologyEvent{.step = b, .layer = 0, .block_size = b,
                                         .block_rows = topology.block_rows,
                                         .block_cols = topology.block_cols, .nnz = topology.nnz,
                                         .padding_rows = forward.plan.padding_rows,
                                         .rows_per_expert = rows}));
  }
  lessons::show(writer, block_table);
  std::cout << "  useful FLOPs = 4*D*H per routed row (x W1 and h W2), " << useful_flops_per_row
            << " here; padding rows cost the same but do nothing.\n"
               "  (topology events in the run record use step = B)\n";
  return blocks_ok;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options =
      lessons::parse_options(argc, argv, "lesson02_formulations", "runs/lesson02_formulations");
  std::mt19937_64 generator(options.seed);

  MoeConfig config;
  config.tokens = 4096;     // T
  config.model_dim = 64;    // D
  config.hidden_dim = 128;  // H
  config.num_experts = 16;  // E
  config.top_k = 2;         // K
  config.block_size = 32;   // B
  config.formulation = Formulation::dropless;

  auto writer = lessons::create_lesson_run(options, "lesson02_formulations", "02", config);

  std::cout << "Lesson 02: dropping vs padded vs dropless. T=" << config.tokens
            << " text-like tokens, D=" << config.model_dim << ", H=" << config.hidden_dim
            << ", E=" << config.num_experts << ", K=" << config.top_k << "\n";

  const ref::Matrix x = lessons::zipf_tokens(config.tokens, config.model_dim, 1000, 1.1, generator);
  ref::MoeWeights weights = ref::random_weights(config, options.seed + 1);
  weights.gate_weights *= 3.0;  // a router sure enough of itself to show real skew

  const Oracle oracle = check_dropless(writer, config, x, weights);
  const CapacityChecks capacity = show_capacity_factors(writer, config, x, weights, oracle.dropless);
  const bool blocks_ok = show_block_sizes(writer, config, x, weights, oracle.per_token);

  // ---- verdict ----
  const bool pass = oracle.error < 1e-12 && capacity.padded_matches_dropping &&
                    capacity.large_cf_matches_dropless && blocks_ok;
  std::ostringstream message;
  message << std::setprecision(2) << "dropless vs per-token rel_err=" << oracle.error
          << " tol=1e-12; padded == dropping at every cf: " << (capacity.padded_matches_dropping ? "yes" : "NO")
          << "; dropping with no drops == dropless: " << (capacity.large_cf_matches_dropless ? "yes" : "NO")
          << "; dropless padding < B*E at every B: " << (blocks_ok ? "yes" : "NO");
  return lessons::finish_lesson(writer, "lesson02_formulations", options, pass, message.str());
}
