// synthetic_run.cpp: made-up run records with a known shape (synthetic_run.h).
#include "synthetic_run.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "run_record.h"  // RunWriter, event helpers

namespace moe::viewer {

namespace {
constexpr const char* kSampleText =
    "def route(x): return topk(softmax(x @ Wg), k)  # The quick brown fox; 3.14 * 2 = 6.28\n";
const char* const kGenres[] = {"code", "prose", "math"};

// Routed tokens per expert at one step of one layer: a skew that drifts over time (some experts
// run hot, then cool down as the aux loss pushes back), summing to exactly T*K.
std::vector<int64_t> drifting_counts(const SyntheticRunOptions& o, int64_t step, int64_t layer, std::mt19937_64& rng) {
  const int64_t E = o.experts, routed = o.tokens_per_step * o.top_k;
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  if (o.hot_expert >= 0) {
    counts[static_cast<size_t>(o.hot_expert % E)] = routed;
    return counts;
  }
  std::normal_distribution<double> noise(0.0, 0.08);
  const double skew = 1.2 * std::exp(-static_cast<double>(step) / (0.4 * static_cast<double>(o.steps) + 1));
  std::vector<double> weights(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const double phase = 0.7 * static_cast<double>(e) + 0.9 * static_cast<double>(layer) + static_cast<double>(step) * 0.002;
    weights[e] = std::exp(skew * std::sin(phase) + noise(rng));
  }
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  int64_t assigned = 0;
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = static_cast<int64_t>(std::floor(weights[e] / total * static_cast<double>(routed)));
    assigned += counts[e];
  }
  for (int64_t i = 0; assigned < routed; ++i, ++assigned) ++counts[i % E];
  return counts;
}
}  // namespace

void write_synthetic_run(const std::filesystem::path& dir, const SyntheticRunOptions& o) {
  const int64_t E = std::max<int64_t>(1, o.experts), L = std::max<int64_t>(1, o.layers);
  const int64_t R = std::max<int64_t>(1, o.ranks), K = std::clamp<int64_t>(o.top_k, 1, E);
  SyntheticRunOptions options = o;
  options.experts = E;
  options.top_k = K;
  RunInfo info;
  info.kind = RunKind::train;
  info.name = o.name.empty() ? "synthetic-" + std::to_string(o.steps) + "x" + std::to_string(E) + "x" + std::to_string(L)
                             : o.name;
  info.formulation = o.capacity_factor > 0 ? "dropping" : "dropless";
  info.model = {{"layers", L}, {"vocab", 256}};
  info.world_size = R;
  for (int64_t r = 0; r < R; ++r) info.devices.push_back("synthetic device " + std::to_string(r));
  info.extra = {{"synthetic", true},
                {"generator", "moe_fake_run"},
                {"note", "made-up numbers with a known shape, for the viewer's tests; not a measurement"},
                {"hot_expert", o.hot_expert}};
  MoeConfig config;
  config.tokens = o.tokens_per_step;
  config.model_dim = 64;
  config.hidden_dim = o.hidden_dim;
  config.num_experts = E;
  config.top_k = K;
  config.block_size = o.block_size;
  if (o.capacity_factor > 0) {
    config.formulation = Formulation::dropping;
    config.capacity_factor = o.capacity_factor;
  } else {
    config.formulation = Formulation::dropless;
  }
  info.moe_config = config;

  RunWriter writer = RunWriter::create(dir, info, OnExisting::overwrite);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> noise(0.0, 1.0);
  const int64_t routed = o.tokens_per_step * K;
  const int64_t capacity = o.capacity_factor > 0
      ? static_cast<int64_t>(std::ceil(o.capacity_factor * static_cast<double>(routed) / static_cast<double>(E))) : -1;
  const double step_us = 2000.0;
  const std::string sample = kSampleText;

  for (int64_t step = 0; step < o.steps; ++step) {
    const double progress = static_cast<double>(step) / std::max<int64_t>(1, o.steps);
    double aux_loss = 0;
    for (int64_t layer = 0; layer < L; ++layer) {
      RoutingEvent routing{.step = step, .layer = layer, .tokens_per_expert = drifting_counts(options, step, layer, rng)};
      const auto& counts = routing.tokens_per_expert;
      double f_sum = 0;
      for (int64_t c : counts) f_sum += std::pow(static_cast<double>(c) / routed, 2);
      aux_loss += E * f_sum / L;
      if (capacity >= 0) {
        routing.capacity = capacity;
        for (int64_t c : counts) routing.dropped_per_expert.push_back(std::max<int64_t>(0, c - capacity));
      }
      if (o.genres) {
        // Genres split each expert's tokens in proportions that depend on the expert, so
        // "code" leans on low expert ids and "prose" on high ones.
        for (int g = 0; g < 3; ++g) {
          std::vector<int64_t> share(static_cast<size_t>(E));
          for (int64_t e = 0; e < E; ++e) {
            const double w = g == 0 ? 1.0 - static_cast<double>(e) / E : g == 1 ? static_cast<double>(e + 1) / E : 0.5;
            share[e] = static_cast<int64_t>(static_cast<double>(counts[e]) * w / 2.0);
          }
          routing.tokens_per_expert_by_genre[kGenres[g]] = std::move(share);
        }
      }
      writer.append(to_event(routing));

      if (o.topology_every > 0 && step % o.topology_every == 0) {
        const int64_t B = std::max<int64_t>(1, o.block_size);
        TopologyEvent t{.step = step, .layer = layer, .block_size = B};
        int64_t rows = 0;
        for (int64_t c : counts) {
          const int64_t padded = (c + B - 1) / B * B;
          t.rows_per_expert.push_back(padded);
          t.padding_rows += padded - c;
          rows += padded;
        }
        t.block_rows = rows / B;
        t.block_cols = E * std::max<int64_t>(1, o.hidden_dim / B);
        t.nnz = t.block_rows * std::max<int64_t>(1, o.hidden_dim / B);
        writer.append(to_event(t));
      }
      if (o.offload) {
        const int64_t misses = std::max<int64_t>(0, static_cast<int64_t>(K * (1.5 - progress) + noise(rng) * 0.5));
        OffloadEvent off{.step = step, .layer = layer, .hits = std::max<int64_t>(0, E / 2 - misses), .misses = misses,
                         .stall_us = static_cast<double>(misses) * 35.0};
        for (int64_t k = 0; k < K; ++k) off.prefetched.push_back((step + layer + k) % E);
        writer.append(to_event(off));
      }
      if (o.tokens_every > 0 && step % o.tokens_every == 0) {
        TokensEvent tokens{.step = step, .layer = layer, .text = sample};
        for (size_t i = 0; i < sample.size(); ++i) {
          std::vector<int64_t> choice;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t byte = static_cast<unsigned char>(sample[i]);
            choice.push_back(o.hot_expert >= 0 && k == 0 ? o.hot_expert % E : (byte / 8 + layer + k * 3) % E);
          }
          tokens.experts.push_back(std::move(choice));
        }
        writer.append(to_event(tokens));
      }
    }
    if (o.spans) {
      for (int64_t r = 0; r < R; ++r) {
        const double t0 = static_cast<double>(step) * step_us + 20.0 * static_cast<double>(r);
        const double jitter = std::abs(noise(rng)) * 40.0;
        const double dispatch = 180 + jitter, compute = 900 + 60.0 * static_cast<double>(r), combine = 170 + jitter;
        writer.append(to_event(SpanEvent{.step = step, .rank = r, .stream = 1, .stream_name = "comm", .name = "dispatch",
                                         .start_us = t0, .duration_us = dispatch}));
        writer.append(to_event(SpanEvent{.step = step, .rank = r, .stream = 0, .stream_name = "compute",
                                         .name = "expert_compute", .start_us = t0 + dispatch, .duration_us = compute}));
        writer.append(to_event(SpanEvent{.step = step, .rank = r, .stream = 1, .stream_name = "comm", .name = "combine",
                                         .start_us = t0 + dispatch + compute, .duration_us = combine}));
        if (o.offload)
          writer.append(to_event(SpanEvent{.step = step, .rank = r, .stream = 2, .stream_name = "copy", .name = "h2d_copy",
                                           .start_us = t0 + 50, .duration_us = 600 + jitter}));
      }
    }
    if (o.alltoall && R > 1) {
      for (const char* name : {"dispatch", "combine"}) {
        AllToAllEvent a{.step = step, .layer = 0, .name = name};
        a.bytes.assign(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R), 0));
        for (int64_t s = 0; s < R; ++s)
          for (int64_t d = 0; d < R; ++d)
            a.bytes[s][d] = (o.tokens_per_step / R) * 64 * 2 * (1 + (s + 2 * d + step / 50) % 3);
        a.duration_us = std::string(name) == "dispatch" ? 180.0 : 170.0;
        a.start_us = static_cast<double>(step) * step_us + (std::string(name) == "dispatch" ? 0.0 : 1100.0);
        writer.append(to_event(a));
      }
    }
    const double loss = 4.0 * std::exp(-4.0 * progress) + 1.6 + 0.05 * noise(rng);
    std::vector<std::pair<std::string, double>> metrics = {
        {"loss", loss}, {"aux_loss", aux_loss}, {"tokens_per_s", 1.5e6 + 2e4 * noise(rng)}, {"lr", 3e-4}};
    if (step % 20 == 0) metrics.push_back({"val_loss", loss + 0.08});
    writer.append(step_event(step, metrics));
    if (o.live_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.live_delay_ms));
  }
}

}  // namespace moe::viewer
