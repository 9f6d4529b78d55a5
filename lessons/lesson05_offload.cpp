// lesson05_offload.cpp: Lesson 05, offloaded experts and Pre-gated MoE (Hwang et al., ISCA 2024).
// When an MoE model's experts live in pinned host memory, decoding waits on PCIe unless each block's
// experts are known, and copied, before the block runs. This program shows the arithmetic, which
// experts each block needs and when each mode knows them, a simulated timeline of every mode, the
// quality cost of pre-gating, on a GPU with a trained run the pre-gate against the speculative
// guess, and which expert a full cache should give up (LRU, LFU, the expected next use, Belady's
// oracle, replayed). Read lessons/05_offload.md beside it.
//
// Build and run:  ./moe build && build/lessons/lesson05_offload [--out runs/lesson05_offload]
//                 [--checkpoint RUN]   (GPU part: a moe_train run; pre-gated for the pregated row)
//
// CPU part: the reference (moe::ref, double) decodes a small random model; the timeline is a model
// (copy = bytes / 54.9 GB/s, the pinned copy measured on an H100, 2026-11-25,
// notebooks_data/bench/offload_copy_bench_h100_2026-11-25.json; compute = weight bytes read / HBM
// bandwidth + kernel launches). Dimension legend: D model width, H expert hidden width, E experts,
// K top-k, M MoE blocks, N sequences.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "command_line.h"            // CLI::App: the lesson's own flag
#include "lesson_support.h"          // options, Table, finish
#include "reference_cpu/generate.h"  // prefill, decode_step, make_kv_cache
#include "reference_cpu/model.h"     // init_model
#include "run_record.h"              // RunReader
#include "sim/cache_replay.h"        // OffloadTrace, replay, ReplayPolicy: the eviction rules replayed

#ifdef MOE_LESSON_HAS_CUDA
#include "core/device_info.h"            // gpu_available, why_no_gpu
#include "infer/inference_model.h"       // InferenceModelGpu
#include "infer/sampling.h"              // ByteSampler
#include "infer/weights_file.h"          // load_weights_checkpoint, pinned_experts
#include "offload/offloaded_experts.h"   // OffloadedExperts
#include "offload/pinned_expert_store.h" // PinnedExpertStore
#endif

using namespace moe;
using moe::lessons::Table;

namespace {

constexpr double kPinnedGbPerS = 54.9;  // H100, 2026-11-25, offload_copy_bench_h100_2026-11-25.json
constexpr double kHbmGbPerS = 3350;     // H100 SXM HBM3, the data sheet's figure
constexpr double kLaunchUs = 4;         // one kernel launch on a decode step, about

struct Scale {
  std::string name;
  double D, H, E, K, blocks, moe_blocks;
};
const Scale kScales[] = {{"Switch-Base-like (E=64)", 768, 3072, 64, 1, 12, 6},
                         {"large experts", 4096, 14336, 8, 2, 4, 4}};

double expert_bytes(const Scale& s) { return 4 * s.D * s.H; }  // w1 + w2 in bf16
double copy_ms(const Scale& s) { return expert_bytes(s) / (kPinnedGbPerS * 1e9) * 1e3; }
// One block of a batch-1 decode step is memory-bound: its weights read once from HBM, plus launches.
double attention_ms(const Scale& s) { return (4 * s.D * s.D * 2) / (kHbmGbPerS * 1e9) * 1e3 + 6 * kLaunchUs / 1e3; }
double experts_ms(const Scale& s) { return s.K * expert_bytes(s) / (kHbmGbPerS * 1e9) * 1e3 + 10 * kLaunchUs / 1e3; }
double dense_ffn_ms(const Scale& s) { return (4 * s.D * 4 * s.D) / (kHbmGbPerS * 1e9) * 1e3 + 3 * kLaunchUs / 1e3; }

// ---- the simulated schedule of one decode step at batch 1, every needed expert a miss ----
// Blocks run in order on the compute stream; copies run in order on the copy stream. For MoE block
// m_j: `known` is when its experts are known (its own gate, or m_{j-1}'s pre-gate / guess), copies
// start at max(known, copy stream free), and its experts wait for them.
struct Timeline {
  double total_ms = 0, stall_ms = 0, copied_mb = 0;
  std::vector<std::string> lines;  // the first blocks, as text
};

Timeline simulate(const Scale& s, const std::string& mode, double guess_accuracy) {
  Timeline t;
  double now = 0, copy_free = 0;
  double prefetched_done = -1;  // when the copies for the next MoE block finish (-1: none started)
  double prefetched_right = 0;  // of its K experts, how many the prefetch got right
  int j = 0;
  for (int b = 0; b < int(s.blocks); ++b) {
    now += attention_ms(s);
    const bool moe = s.moe_blocks == s.blocks || b % 2 == 1;
    if (!moe) {
      now += dense_ffn_ms(s);
      continue;
    }
    now += 0.01;  // the gate and its read-back
    double ready = now;
    if (mode == "gpu_only") {
      ready = now;
    } else if (mode == "on_demand" || prefetched_done < 0) {
      const double start = std::max(now, copy_free);
      copy_free = start + s.K * copy_ms(s);
      t.copied_mb += s.K * expert_bytes(s) / 1e6;
      ready = copy_free;
    } else {
      const double missing = s.K - prefetched_right;  // fetched on demand after the gate
      double end = prefetched_done;
      if (missing > 0) {
        copy_free = std::max(now, copy_free) + missing * copy_ms(s);
        t.copied_mb += missing * expert_bytes(s) / 1e6;
        end = std::max(end, copy_free);
      }
      ready = std::max(now, end);
    }
    const double stall = ready - now;
    // The next MoE block's copies start now, while these experts compute (not for on_demand).
    const bool has_next = j + 1 < int(s.moe_blocks);
    prefetched_done = -1;
    if (has_next && mode != "gpu_only" && mode != "on_demand") {
      const double count = mode == "prefetch_all" ? s.E : s.K;
      prefetched_right = mode == "speculative" ? guess_accuracy * s.K : s.K;  // expected right
      const double start = std::max(ready, copy_free);
      copy_free = start + count * copy_ms(s);
      prefetched_done = copy_free;  // prefetch_all: the chosen ones may come last
      t.copied_mb += count * expert_bytes(s) / 1e6;
    }
    if (j < 3) {
      char line[200];
      std::snprintf(line, sizeof line, "    m%d: experts known at %7.3f ms, ready at %7.3f ms (waits %6.3f ms)%s", j,
                    now, ready, stall, has_next && prefetched_done >= 0 ? ", m(j+1)'s copies start now" : "");
      t.lines.push_back(line);
    }
    t.stall_ms += stall;
    now = ready + experts_ms(s);
    ++j;
  }
  t.total_ms = now + 0.05;  // the LM head
  return t;
}

// The final validation bits per byte of a training run, or NaN when it is not there.
double final_val_bits(const std::filesystem::path& dir) {
  try {
    const RunRecord run = RunReader::load(dir);
    double bits = NAN;
    for (const auto& event : run.events) {
      if (event.value("type", "") == "step" && event.contains("val_bits_per_byte") &&
          event["val_bits_per_byte"].is_number()) {
        bits = event["val_bits_per_byte"].get<double>();
      }
    }
    return bits;
  } catch (const std::exception&) {
    return NAN;
  }
}

#ifdef MOE_LESSON_HAS_CUDA
// The trained run's pre-gate (a pre-gated model: exactly what the next block uses) or the speculative
// guess (a self-gated model: the next block's gate on this block's LN2 output), measured on the GPU:
// the fraction of the experts each MoE block used that were prefetched for it. Greedy, 64 bytes.
void gpu_part(const std::string& checkpoint, Table& table) {
  using namespace moe::cuda;
  if (!gpu_available()) {
    std::cout << "GPU part: skipped (" << why_no_gpu() << ")\n";
    return;
  }
  InferenceWeights loaded = load_weights_checkpoint(checkpoint);
  ModelGpuConfig config = loaded.config;
  config.batch = 1;
  const ExpertSchedule mode = config.pregated ? ExpertSchedule::pregated : ExpertSchedule::speculative;
  const PinnedExpertStore store = pinned_experts(config, loaded.weights);
  const ExpertShape& shape = store.shape();
  const std::string prompt = "The jury said";
  OffloadOptions options;
  options.cache_slots = std::min(2 * shape.experts, shape.blocks * shape.experts);
  options.max_tokens_per_step = int64_t(prompt.size());
  options.top_k = config.moe.top_k;
  options.cache_slots = std::max(options.cache_slots, minimum_cache_slots(shape.experts, options.max_tokens_per_step, options.top_k));
  OffloadedExperts source(store, options);
  InferenceModelGpu model(config, loaded.weights, source, mode);
  StepResult step = model.prefill({std::vector<int32_t>(prompt.begin(), prompt.end())});
  cuda::ByteSampler sampler(SamplingSettings{0.0, 0, 1}, 1);
  int64_t used = 0, foreseen = 0;
  for (int s = 0; s < 64 && model.length() < config.seq_len; ++s) {
    step = model.decode_step(sampler.sample(step.next_logits));
    for (size_t j = 1; j < step.moe.size(); ++j) {  // m_0 has no block before it
      const MoeBlockStep& b = step.moe[j];
      used += int64_t(b.experts.size());
      for (int32_t e : b.experts) foreseen += std::binary_search(b.prefetched.begin(), b.prefetched.end(), e);
    }
  }
  const double accuracy = used > 0 ? double(foreseen) / double(used) : 0;
  std::printf("GPU part: %s (%s), MoE blocks m_1.. over 64 greedy bytes: %.3f of the experts used were known one "
              "block ahead\n", checkpoint.c_str(), config.pregated ? "pre-gated: the pre-gate" : "self-gated: the speculative guess",
              accuracy);
  table.add_row({config.pregated ? "pre-gate (trained pre-gated)" : "speculative guess (trained self-gated)", accuracy,
                 "GPU, " + checkpoint});
}
#endif

// ---- 1. the PCIe arithmetic ----

void show_pcie_arithmetic(RunWriter& writer) {
  Table arithmetic("Table 1: the PCIe arithmetic at 54.9 GB/s (pinned, H100, 2026-11-25), batch 1, every chosen expert a miss",
                   {"scale", "expert MB (4*D*H)", "copy ms", "experts/token", "floor ms/token", "all experts GB (pinned)",
                    "gpu_only expert GB", "cache of 2 blocks' needs GB"});
  for (const Scale& s : kScales) {
    const double per_token = s.moe_blocks * s.K;
    arithmetic.add_row({s.name, expert_bytes(s) / 1e6, copy_ms(s), per_token, per_token * copy_ms(s),
                        s.moe_blocks * s.E * expert_bytes(s) / 1e9, s.moe_blocks * s.E * expert_bytes(s) / 1e9,
                        2 * s.K * expert_bytes(s) / 1e9});
  }
  lessons::show(writer, arithmetic);
}

// ---- 2. which experts each block needs, and when each mode knows them ----

// A small random pre-gated model decoded by the reference: m_j's choice is made in block
// known_in_block (m_{j-1}'s for j >= 1), one MoE block before the experts run.
// Returns whether every block after the first knew its experts one MoE block early.
bool show_block_needs(RunWriter& writer, const ModelConfig& small, uint64_t seed) {
  const ref::ModelWeights weights = ref::init_model(small, seed);
  ref::KvCache cache = ref::make_kv_cache(small, 1);
  ref::StepOutput step = ref::prefill(small, weights, {{'T', 'h', 'e', ' '}}, cache);
  Table needs("Table 2: a small pre-gated model (reference, D=32, E=8, K=2, 4 MoE blocks): what each block needs and "
              "where it is known", {"step", "block", "experts", "known in block", "on_demand knows", "pregated knows"});
  bool known_early = true;
  for (int s = 0; s < 4; ++s) {
    int best = 0;
    for (int v = 1; v < 256; ++v) best = step.next_logits(0, v) > step.next_logits(0, best) ? v : best;
    step = ref::decode_step(small, weights, {best}, cache);
    for (size_t j = 0; j < step.moe.size(); ++j) {
      const ref::MoeBlockRouting& r = step.moe[j];
      std::string experts;
      for (size_t i = 0; i < r.experts.size(); ++i) {
        if (i > 0) experts += ',';
        experts += std::to_string(r.experts[i]);
      }
      const bool early = j > 0 && r.known_in_block < r.block;
      known_early = known_early && (j == 0 || early);
      needs.add_row({s + 1, r.block, experts, r.known_in_block, "after block " + std::to_string(r.block) + "'s gate",
                     j == 0 ? "after its own gate" : "during block " + std::to_string(r.known_in_block)});
    }
  }
  lessons::show(writer, needs);
  return known_early;
}

// ---- 3. the schedule, simulated ----

// Returns whether gpu_only <= pregated <= on_demand at every scale.
bool simulate_schedules(RunWriter& writer) {
  std::cout << "\nThe schedule of one batch-1 decode step, simulated (copy = 4*D*H / 54.9 GB/s; compute = weights "
               "read / 3.35 TB/s + launches; every needed expert a miss; speculative guesses 1/2 right):\n";
  Table timeline("Table 3: simulated decode step per mode (ms, batch 1)",
                 {"scale", "mode", "step ms", "stall ms", "MB copied", "x gpu_only"});
  bool order_ok = true;
  for (const Scale& s : kScales) {
    double gpu_only = simulate(s, "gpu_only", 0.5).total_ms, on_demand = 0, pregated = 0;
    for (const std::string mode : {"gpu_only", "on_demand", "prefetch_all", "pregated", "speculative"}) {
      const Timeline t = simulate(s, mode, 0.5);
      std::cout << "  " << s.name << ", " << mode << ": " << t.total_ms << " ms\n";
      for (const std::string& line : t.lines) std::cout << line << "\n";
      timeline.add_row({s.name, mode, t.total_ms, t.stall_ms, t.copied_mb, t.total_ms / gpu_only});
      if (mode == "on_demand") on_demand = t.total_ms;
      if (mode == "pregated") pregated = t.total_ms;
    }
    order_ok = order_ok && gpu_only <= pregated && pregated <= on_demand;
  }
  lessons::show(writer, timeline);
  return order_ok;
}

// ---- 4. the quality cost of pre-gating (lesson 08's runs) ----

void show_pregating_quality(RunWriter& writer) {
  Table quality("Table 4: final validation bits per byte, lesson 08's runs (H200, notebooks_data/runs/)",
                {"run", "val bits/byte"});
  for (const std::string name : {"train_dropless_seed1", "train_dropless_seed2", "train_dropless_seed3",
                                 "train_dropless_pregated_seed1"}) {
    const double bits = final_val_bits(std::filesystem::path("notebooks_data/runs") / name);
    quality.add_row({name, std::isnan(bits) ? nlohmann::json("not found") : nlohmann::json(bits)});
  }
  lessons::show(writer, quality);
}

// ---- 5. the pre-gate against the speculative guess (GPU, trained run) ----

void show_pregate_against_guess(RunWriter& writer, const std::string& checkpoint) {
  Table guess("Table 5: experts known one MoE block ahead (m_1..), measured", {"predictor", "fraction known", "where"});
  guess.add_row({"pre-gate (any pre-gated model)", 1.0, "by construction: m_j's gate runs in m_{j-1} (Table 2)"});
#ifdef MOE_LESSON_HAS_CUDA
  if (checkpoint.empty()) {
    std::cout << "\nGPU part: skipped (give --checkpoint RUN, a moe_train run; see 05_offload.md)\n";
  } else {
    try {
      gpu_part(checkpoint, guess);
    } catch (const std::exception& error) {
      std::cout << "\nGPU part: skipped (" << error.what() << ")\n";
    }
  }
#else
  (void)checkpoint;  // read by the GPU part only
  std::cout << "\nGPU part: skipped (built without CUDA)\n";
#endif
  lessons::show(writer, guess);
}

// ---- 6. which expert to give up: the eviction policies, replayed ----

// The large experts' decode steps (M = 4 MoE blocks of E = 8, top-2), each sequence's two experts a
// block drawn uniformly (seeded), through the expert cache's own eviction code
// (cuda/offload/cache_policy.h, replayed by distributed/sim/cache_replay.h) and Belady's oracle,
// demand fetching. Returns whether next_use copies at most 3/4 of LRU's bytes at batch 4 and the
// oracle copies least everywhere.
bool compare_policies(RunWriter& writer, uint64_t seed) {
  const Scale& large = kScales[1];
  const int64_t M = 4, E = 8, steps = 200;
  Table table("Table 6: which expert a full cache gives up, replayed (large experts, uniform routing, 200 steps)",
              {"batch", "slots", "policy", "misses a step", "GB a step", "x Belady"});
  bool ok = true;
  for (const auto& [batch, slots] : {std::pair<int64_t, int64_t>{1, 8}, {4, 16}}) {
    sim::OffloadTrace trace;
    trace.source = "uniform routing, batch " + std::to_string(batch);
    trace.mode = "on_demand";
    trace.policy = "lru";
    trace.cache_slots = slots;
    trace.experts = E;
    trace.top_k = 2;
    trace.batch = batch;
    trace.expert_bytes = static_cast<size_t>(expert_bytes(large));
    for (int64_t j = 0; j < M; ++j) trace.layers.push_back(j);
    std::mt19937_64 generator(seed + uint64_t(batch));
    for (int64_t step = 0; step < steps; ++step) {
      std::vector<sim::OffloadBlockRecord> blocks;
      for (int64_t j = 0; j < M; ++j) {
        std::set<int32_t> chosen;
        for (int64_t n = 0; n < batch; ++n) {  // two different experts a sequence
          const auto first = static_cast<int32_t>(generator() % E);
          chosen.insert(first);
          chosen.insert(static_cast<int32_t>((first + 1 + int64_t(generator() % (E - 1))) % E));
        }
        sim::OffloadBlockRecord block;
        block.layer = j;
        block.experts.assign(chosen.begin(), chosen.end());
        blocks.push_back(block);
      }
      trace.steps.push_back(blocks);
      trace.spans.emplace_back();
    }
    const double belady = double(sim::replay(trace, slots, sim::ReplayPolicy::belady, false).misses(1));
    double lru = 0, next_use = 0;
    for (const sim::ReplayPolicy policy : {sim::ReplayPolicy::lru, sim::ReplayPolicy::lfu, sim::ReplayPolicy::next_use,
                                           sim::ReplayPolicy::belady}) {
      const double misses = double(sim::replay(trace, slots, policy, false).misses(1));
      const double per_step = misses / double(steps - 1);
      table.add_row({batch, slots, sim::to_string(policy), per_step, per_step * expert_bytes(large) / 1e9,
                     misses / belady});
      ok = ok && belady <= misses;
      if (policy == sim::ReplayPolicy::lru) lru = misses;
      if (policy == sim::ReplayPolicy::next_use) next_use = misses;
    }
    if (batch == 4) ok = ok && next_use <= 0.75 * lru;
  }
  lessons::show(writer, table);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  // --checkpoint RUN is this lesson's own flag; the rest are every lesson's.
  std::string checkpoint;
  const auto options = lessons::parse_options(argc, argv, "lesson05_offload", "runs/lesson05_offload", [&](CLI::App& app) {
    app.add_option("--checkpoint", checkpoint, "GPU part: a moe_train run (pre-gated for the pregated row)")
        ->type_name("RUN");
  });

  // The small random pre-gated model that section 2 decodes; its MoE layer is the run record's.
  ModelConfig small;
  small.model_dim = 32, small.num_layers = 4, small.num_heads = 2, small.seq_len = 32;
  small.moe_layers = MoeLayers::every_block;
  small.num_experts = 8, small.top_k = 2, small.expert_hidden_dim = 32, small.block_size = 16;
  small.pregated = true;
  auto writer = lessons::create_lesson_run(options, "lesson05_offload", "05", moe_layer_config(small, 1));
  std::cout << "Lesson 05: offloaded experts and Pre-gated MoE\n\n";

  show_pcie_arithmetic(writer);
  const bool known_early = show_block_needs(writer, small, options.seed);
  const bool order_ok = simulate_schedules(writer);
  show_pregating_quality(writer);
  show_pregate_against_guess(writer, checkpoint);
  const bool policies_ok = compare_policies(writer, options.seed);

  std::cout << "\nMeasured on a GPU: offload_bench writes notebooks_data/bench/offload_bench_<device>_<date>.json "
               "(see 05_offload.md).\n";
  const bool pass = known_early && order_ok && policies_ok;
  lessons::finish(writer, "lesson05", pass,
                  std::string("pre-gated blocks known one MoE block early: ") + (known_early ? "yes" : "NO") +
                      "; simulated gpu_only <= pregated <= on_demand at both scales: " + (order_ok ? "yes" : "NO") +
                      "; next_use copies <= 3/4 of LRU's bytes at batch 4: " + (policies_ok ? "yes" : "NO"));
  return pass ? 0 : 1;
}
