// synthetic_run.h: writes SYNTHETIC run records (made-up numbers with a known shape) for the
// viewer's tests and for its smoothness check on a large run. Every run it writes says so:
// run.json has extra.synthetic = true and a name starting "synthetic", and the viewer shows a
// banner on it. Never present one as a measurement.
//
//   moe::viewer::SyntheticRunOptions o{.steps = 10000, .experts = 64, .layers = 8, .ranks = 4};
//   moe::viewer::write_synthetic_run("/tmp/runs/big", o);
// The command-line wrapper is moe_fake_run (viewer/tools/fake_run.cpp).
// Dimension legend: T tokens, E experts, K top-k, L layers, R ranks, B block size, C capacity.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace moe::viewer {

struct SyntheticRunOptions {
  int64_t steps = 200;
  int64_t experts = 8;            // E
  int64_t layers = 2;             // L
  int64_t ranks = 2;              // R
  int64_t top_k = 2;              // K
  int64_t tokens_per_step = 4096; // T
  double capacity_factor = 1.25;  // <= 0: dropless (no capacity, no drops)
  int64_t hot_expert = -1;        // >= 0: every routed token goes to this expert (a known picture)
  int64_t block_size = 64;        // B of the topology events
  int64_t hidden_dim = 256;       // H: H / B block columns per expert
  int64_t topology_every = 10;    // a topology event per layer every this many steps
  int64_t tokens_every = 50;      // a token sample per layer every this many steps
  bool genres = true;             // routing by genre (code / prose / math)
  bool spans = true;              // per-rank timeline spans
  bool alltoall = true;           // dispatch + combine byte matrices
  bool offload = true;            // expert-cache hits and misses
  int64_t live_delay_ms = 0;      // > 0: sleep this long after each step (to watch live mode)
  uint64_t seed = 1;
  std::string name{};             // "" = "synthetic-<steps>x<E>x<L>"
};

// Writes run.json and events.jsonl under dir (replacing a run there). Throws RecordError.
void write_synthetic_run(const std::filesystem::path& dir, const SyntheticRunOptions& options);

}  // namespace moe::viewer
