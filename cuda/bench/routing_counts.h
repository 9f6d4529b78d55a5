// routing_counts.h: the deterministic routings of the benchmarks. Instead of a trained router, each
// expert gets a fixed share of the T*K routed slots, so every run (and the PyTorch side,
// cuda/bench/torch_baseline.py, which implements the same rule) times exactly the same expert sizes.
// Header-only host code, used by cuda/bench/moe_bench.cpp.
//
// Dimension legend: T tokens, E experts, K top-k; rows = T*K routed slots, slot = t * K + k.
//
// The count rule (torch_baseline.py's routing_counts, number for number, for uniform and zipf):
//   w_e = 1 (uniform), 1 / (e + 1) (zipf), or the tokens per expert of one layer of a real training
//   run (captured, moe_bench --routing-from RUN_DIR);  count_e = floor(rows * w_e / sum_j w_j);
//   the rows left over by the floors go one each to experts 0, 1, 2, ...
// From counts to a router output top_experts [T, K]: write the expert ids in ascending order, each
// repeated count_e times (a sequence of length T*K), and lay it out column by column: position i of
// the sequence goes to token i % T, choice i / T. Token t then holds the ids at positions
// t, t + T, t + 2T, ...; two of them are equal only if one expert's run of equal ids spans more than
// T positions, so every token gets K distinct experts whenever every count_e <= T.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moe::bench {

enum class Routing { uniform, zipf, captured };

inline std::string_view to_string(Routing routing) {
  switch (routing) {
    case Routing::uniform: return "uniform";
    case Routing::zipf: return "zipf";
    case Routing::captured: return "captured";
  }
  return "?";
}

// count_e of the rule above; the counts sum to `rows`. `captured` holds the captured run's tokens
// per expert (only read for Routing::captured; its length must be E).
inline std::vector<int> routing_counts(int64_t rows, int num_experts, Routing routing,
                                       const std::vector<double>& captured = {}) {
  if (rows < 0 || num_experts < 1) throw std::invalid_argument("routing_counts: need rows >= 0 and E >= 1");
  if (routing == Routing::captured && captured.size() != static_cast<size_t>(num_experts)) {
    throw std::invalid_argument("routing_counts: the captured routing has " + std::to_string(captured.size()) +
                                " experts; this shape has E = " + std::to_string(num_experts));
  }
  std::vector<double> weights(num_experts);
  double total = 0.0;  // summed in expert order, as Python's sum() does
  for (int e = 0; e < num_experts; ++e) {
    weights[e] = routing == Routing::uniform ? 1.0 : routing == Routing::zipf ? 1.0 / (e + 1) : captured[e];
    total += weights[e];
  }
  if (!(total > 0)) throw std::invalid_argument("routing_counts: the captured routing routed no token");
  std::vector<int> counts(num_experts);
  int64_t assigned = 0;
  for (int e = 0; e < num_experts; ++e) {
    counts[e] = static_cast<int>(static_cast<double>(rows) * weights[e] / total);  // floor: >= 0
    assigned += counts[e];
  }
  for (int64_t i = 0; i < rows - assigned; ++i) counts[i % num_experts] += 1;
  return counts;
}

// top_experts [T, K] row-major (slot t*K + k), every token with K distinct experts and expert e
// chosen by exactly counts[e] slots. Throws when the counts do not sum to T*K or one exceeds T.
inline std::vector<int32_t> top_experts_from_counts(const std::vector<int>& counts, int64_t tokens, int top_k) {
  int64_t rows = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] < 0 || counts[e] > tokens) {
      throw std::invalid_argument("top_experts_from_counts: expert " + std::to_string(e) + " has " +
                                  std::to_string(counts[e]) + " slots; at most T = " + std::to_string(tokens) +
                                  " fit with K distinct experts per token");
    }
    rows += counts[e];
  }
  if (rows != tokens * top_k) {
    throw std::invalid_argument("top_experts_from_counts: counts sum to " + std::to_string(rows) + ", not T*K = " +
                                std::to_string(tokens * top_k));
  }
  std::vector<int32_t> top_experts(static_cast<size_t>(rows));
  int64_t position = 0;  // position in the sorted sequence of expert ids
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int c = 0; c < counts[e]; ++c, ++position) {
      const int64_t token = position % tokens, choice = position / tokens;
      top_experts[static_cast<size_t>(token * top_k + choice)] = static_cast<int32_t>(e);
    }
  }
  return top_experts;
}

}  // namespace moe::bench
