// moe_bench.cpp: the expert FFN of an MoE layer, y = gelu(x W1) W2 per expert in bf16 (or SwiGLU:
// y = (silu(x W1_gate) * (x W1_up)) W2, W1 = [W1_gate | W1_up] [D, 2H]), timed in every formulation
// this project has, against dense cuBLAS doing the same useful math in the same run.
//
// Build: cmake -S . -B build-bench -G Ninja -DMOE_ENABLE_VIEWER=OFF && cmake --build build-bench --target moe_bench
// Run:   build-bench/cuda/bench/moe_bench                      (the shapes of shared/BASELINES.md)
//        build-bench/cuda/bench/moe_bench --shapes small       (a quick shape, with a CPU-oracle check)
//        build-bench/cuda/bench/moe_bench --activation both    (SwiGLU rows beside GeLU's, same shapes)
//        build-bench/cuda/bench/moe_bench --micro-batches 4 --shapes 16384,1024,4096,64,1 --routing zipf
//                                                      (the layer over 4 micro-batches, one weight-gradient
//                                                      product: gradient accumulation, [SECTION] micro-batches)
//        build-bench/cuda/bench/moe_bench --routing-from notebooks_data/runs/train_dropless_seed1
//            --shapes 8192,4096,14336,8,2                      (a real run's routing, on a shape of its E)
//        options: --shapes baselines|small|all|T,D,H,E,K  --routing both|uniform|zipf
//                 --routing-from RUN_DIR[@STEP]  (adds "captured": the shares of the run's most
//                 imbalanced MoE layer at STEP, default its last recorded step; shapes of its E only)
//                 --only NAME[,NAME...]  --out FILE  --warmup 3  --warmup-ms 1000  --repeat 20  --seed 1234
//                 --activation gelu|swiglu|both (the experts' activation; default gelu)
//                 --rows layer|gathered|permuted (how the block-sparse SDD reads x)
//                 --stream-k on|off (the block-sparse DSDs' stream-K tail, cuda/moe/tile_schedule.h)
//                 --gradient-pairs on|off (the block-sparse weight gradients in clusters of two tiles)
//                 --block-row-pairs rule|everywhere (pairs of block rows where the rule takes them, or
//                 at every shape: set_block_row_pairs_everywhere)
//                 --timing synced|pipelined (each timed run from an idle GPU, or back to back)
//                 --kernel-trace (after timing each formulation, `repeat` more runs back to back
//                 under CUPTI: every kernel's time in place and the GPU's idle gaps between them)
//                 --micro-batches M (the whole layer over M micro-batches of T tokens instead of
//                 the formulations table; T is one micro-batch's, dense cuBLAS runs M*T*K rows)
// The result file's fields are explained in notebooks_data/bench/README.md.
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, C capacity,
// B block size; rows = T*K routed slots, slot = t*K + k.
//
// Formulations (names as in the table and the JSON):
//   block_sparse_B128, _B64  dropless MegaBlocks FFN on our block-sparse kernels (block_sparse.h); the
//                            plan and topology are built on the GPU from top_experts, as in a real
//                            layer; x's rows are gathered by the SDD where the layer does
//                            (gathering_pays), else permuted by the GPU kernel into a copy
//   grouped_cublas           dropless, cuBLAS grouped GEMM on the exact per-expert row counts
//   padded_max               every expert padded to C = the largest count, one batched GEMM [E, C, D]
//   dropping_cf1.00, _cf1.25 C = ceil(cf * T*K / E), tokens past C dropped, batched GEMM [E, C, D]
//   dense_cublas             one [T*K, D] x [D, W1] GEMM, the activation, one [T*K, H] x [H, D] GEMM: the same
//                            useful FLOPs with no routing at all, the ceiling to compare with
// Useful TFLOP/s counts 2*rows*D*(W1 + H) (forward) and 3x that (forward + backward) for the rows that
// are really computed for a token: padding rows and dropped tokens count as zero. W1 = H for GeLU
// (4*rows*D*H, two products), 2H for SwiGLU (6*rows*D*H, three products: gate, up, down), so the two
// activations' TFLOP/s compare directly; "vs gelu" is a SwiGLU row's TFLOP/s over the GeLU row of the
// same shape, routing and formulation (the 5% target: vs gelu >= 0.95).
// SwiGLU runs the same formulations: dropless as two SDDs over W1's halves with silu(gate) * up in
// the second's epilogue (block_sparse.h); cuBLAS as one [rows, D] x [D, 2H] product per group, then
// the fused pass swiglu_forward / swiglu_backward (moe/activation.h).
//
// Correctness first: before each formulation is timed, its forward output and input gradient (and,
// where no token is dropped, two experts' weight gradients) are compared slot by slot with the
// grouped cuBLAS path, on fresh random inputs, with outputs poisoned (NaN) before the run. On small
// shapes the dropless output is also compared with the CPU reference (moe::ref::expert_ffn_forward).
// The last line is one verdict, PASS or FAIL (exit code 1).
//
// Index of sections:
//   [SECTION] options             [SECTION] random inputs       [SECTION] timing
//   [SECTION] checks              [SECTION] cuBLAS expert FFN   [SECTION] block-sparse expert FFN
//   [SECTION] one shape, one routing      [SECTION] the layer over micro-batches (--micro-batches M)
//   [SECTION] report                      [SECTION] main
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "moe/block_sparse.h"        // block_sparse_ffn_forward / backward
#include "moe/activation.h"          // gelu_forward / _backward, swiglu_forward / _backward
#include "command_line.h"           // CLI::App, parse_command_line, whole_number, finite_number, one_of
#include "core/bench_support.h"      // utc_now
#include "parse_number.h"            // parse_integer, parse_integer_list
#include "core/clock_warm_up.h"      // warm_up_clock
#include "core/bf16.h"               // bf16
#include "moe/topology.h"            // TopologyBuffers, build_topology
#include "core/cuda_check.h"         // CUDA_CHECK
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/device_info.h"        // gpu_available, why_no_gpu
#include "reference_cpu/dispatch.h"  // moe::ref::DispatchPlan (the CPU oracle's plan)
#include "program_exit.h"            // check_output_path
#include "moe/dispatch.h"            // DispatchPlanBuffers, build_dispatch_plan
#include "expert_ffn.h"              // moe::ref::expert_ffn_forward (the CPU oracle)
#include "core/gemm.h"               // gemm, gemm_batched, gemm_grouped, CublasHandle
#include "bench/kernel_trace.h"      // KernelTrace, summarize_runs (--kernel-trace)
#include "moe_config.h"              // MoeConfig
#include "run_record.h"              // RunReader (--routing-from: a recorded run's routing)
#include "moe/router.h"              // router_logits, route_top_k (with the router losses), route_fused, RouterWorkspace
#include "bench/routing_counts.h"    // routing_counts, top_experts_from_counts
#include "moe/permute.h"             // permute_tokens, unpermute_and_combine
#include "moe/moe_layer.h"           // MoeLayerGpu (--micro-batches: the whole layer, gradient accumulation)

namespace {

using moe::Formulation;
using moe::MoeConfig;
using moe::bench::Routing;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::cuda::Op;
using moe::cuda::utc_now;
using json = nlohmann::json;

constexpr double kTolerance = 2e-2;  // relative Frobenius error, bf16 operands and activations
constexpr int kOracleCpuRows = 256;  // slots checked against the CPU reference on small shapes

// ---------------------------------------------------------------------------------------------
// [SECTION] options
// ---------------------------------------------------------------------------------------------

struct Shape {
  int T, D, H, E, K;
  std::string name() const {
    std::ostringstream s;
    s << "T=" << T << " D=" << D << " H=" << H << " E=" << E << " K=" << K;
    return s.str();
  }
};

const std::vector<Shape> kBaselineShapes = {  // shared/BASELINES.md
    {16384, 1024, 4096, 64, 1},
    {16384, 2048, 8192, 64, 2},
    {8192, 4096, 14336, 8, 2},
};
const Shape kSmallShape = {2048, 512, 1024, 8, 2};

// The routing of one MoE layer of a recorded training run (its "routing" event), for Routing::captured.
struct CapturedRouting {
  std::string run;
  int64_t step = 0;
  int64_t layer = 0;
  std::vector<double> tokens_per_expert;  // [E]
  double max_over_mean = 0;
};

struct Options {
  std::vector<Shape> shapes = kBaselineShapes;
  std::vector<Routing> routings = {Routing::uniform, Routing::zipf};
  std::vector<moe::Activation> activations = {moe::Activation::gelu};
  std::optional<CapturedRouting> captured;
  std::vector<std::string> only;  // formulation names to time (substrings); empty = all
  std::string out;
  int warmup = 3, repeat = 20;
  double warmup_ms = 1000;  // and keep warming up until the GPU has been busy this long (time_work)
  uint64_t seed = 1234;
  enum class Rows { layer, gathered, permuted } rows = Rows::layer;  // block-sparse: how the SDD reads x
  bool stream_k = true;  // block-sparse: the DSDs end in a stream-K tail (set_stream_k_tail)
  bool gradient_pairs = true;  // block-sparse: weight gradients in pairs of tiles (set_weight_gradient_pairs)
  bool pairs_everywhere = false;  // block-sparse: set_block_row_pairs_everywhere
  bool pipelined = false;  // time_work: the timed runs back to back, not each after a synchronize
  bool kernel_trace = false;  // trace each formulation's kernels (kernel_trace.h)
  int micro_batches = 0;  // > 0: the layer over this many micro-batches instead of the formulations table

  // dense_cublas is always timed: every ratio is taken against it.
  bool selected(const std::string& formulation) const {
    if (only.empty() || formulation == "dense_cublas") return true;
    return std::any_of(only.begin(), only.end(),
                       [&](const std::string& name) { return formulation.find(name) != std::string::npos; });
  }
};

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, separator);) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// The routing events of RUN_DIR at STEP (default: the last step that has them); of those, the MoE
// layer whose busiest expert is furthest above the mean. Throws with the reason (no such run, no
// routing events, no routing at that step).
CapturedRouting capture_routing(const std::string& argument) {
  CapturedRouting captured;
  const size_t at = argument.rfind('@');
  captured.run = at == std::string::npos ? argument : argument.substr(0, at);
  const bool step_given = at != std::string::npos;
  const std::optional<int64_t> wanted_step = step_given ? moe::parse_integer(argument.substr(at + 1)) : 0;
  if (!wanted_step) throw std::invalid_argument("--routing-from " + argument + ": allowed: RUN_DIR or RUN_DIR@STEP");
  const moe::RunRecord record = moe::RunReader::load(captured.run);
  std::vector<const json*> routing;
  for (const json& event : record.events) {
    if (event["type"] == "routing") routing.push_back(&event);
  }
  if (routing.empty()) throw std::invalid_argument("--routing-from " + captured.run + ": the run has no routing events");
  captured.step = step_given ? *wanted_step : (*routing.back())["step"].get<int64_t>();
  bool found = false;
  for (const json* event : routing) {
    if ((*event)["step"].get<int64_t>() != captured.step) continue;
    const std::vector<double> counts = (*event)["tokens_per_expert"].get<std::vector<double>>();
    double total = 0, busiest = 0;
    for (double c : counts) {
      total += c;
      busiest = std::max(busiest, c);
    }
    const double max_over_mean = total > 0 ? busiest / (total / double(counts.size())) : 0;
    if (!found || max_over_mean > captured.max_over_mean) {
      captured.layer = (*event)["layer"].get<int64_t>();
      captured.tokens_per_expert = counts;
      captured.max_over_mean = max_over_mean;
      found = true;
    }
  }
  if (!found) {
    throw std::invalid_argument("--routing-from " + argument + ": no routing event at step " +
                                std::to_string(captured.step));
  }
  return captured;
}

const char* kDescription =
    "moe_bench: the expert FFN in every formulation, timed against dense cuBLAS in the same run.\n"
    "  formulations: block_sparse_B128 block_sparse_B64 grouped_cublas padded_max dropping_cf1.00\n"
    "                dropping_cf1.25 dense_cublas (always timed: the baseline of every ratio)";

// The flags; a value that is more than a number (a shape, a choice) is read as text and turned into
// Options after the parse, so each flag's check and its help line stay together here.
Options parse_options(int argc, char** argv) {
  Options options;
  options.out = "notebooks_data/bench/moe_bench_" + utc_now("%Y-%m-%dT%H%M%SZ") + ".json";
  std::string shapes, routing, activation, routing_from, only, rows, stream_k, gradient_pairs, timing, block_row_pairs;
  CLI::App app{kDescription, "moe_bench"};
  app.add_option("--shapes", shapes, "baselines (default), small, all, or one shape T,D,H,E,K")
      ->check(CLI::Validator(
          [](const std::string& v) {
            const std::optional<std::vector<int64_t>> n = moe::parse_integer_list(v);
            const bool ok = v == "baselines" || v == "small" || v == "all" || (n && n->size() == 5);
            return ok ? std::string() : v + ": allowed: baselines, small, all or T,D,H,E,K";
          },
          ""));
  app.add_option("--routing", routing, "both (default), uniform or zipf")->check(moe::one_of({"both", "uniform", "zipf"}));
  app.add_option("--routing-from", routing_from,
                 "RUN_DIR[@STEP]: also time \"captured\": a recorded training run's routing (its most imbalanced layer "
                 "at STEP, default the last recorded), on the shapes with the run's E");
  app.add_option("--only", only, "NAME[,NAME...]: the formulations to time (substrings of their names)");
  app.add_option("--out", options.out, "the results file (JSON)");
  app.add_option("--warmup", options.warmup, "untimed runs first")->capture_default_str()->check(moe::whole_number(0));
  app.add_option("--warmup-ms", options.warmup_ms, "and keep warming up until the GPU has been busy this long")
      ->capture_default_str()
      ->check(moe::finite_number(0));
  app.add_option("--repeat", options.repeat, "timed runs (the median is reported)")->capture_default_str()
      ->check(moe::whole_number(1));
  app.add_option("--seed", options.seed, "seed of the inputs")->capture_default_str()->check(moe::whole_number(0));
  app.add_option("--rows", rows,
                 "how the block-sparse SDD reads x: as the layer does (layer, default: gathered where gathering_pays), "
                 "gathered wherever the kernels can, or from a permuted copy")
      ->check(moe::one_of({"layer", "gathered", "permuted"}));
  app.add_option("--stream-k", stream_k, "whether the block-sparse DSDs end in a stream-K tail (default on)")
      ->check(moe::one_of({"on", "off"}));
  app.add_option("--gradient-pairs", gradient_pairs,
                 "whether the block-sparse weight gradients run in clusters of two tiles that share an operand's "
                 "copies (default on)")
      ->check(moe::one_of({"on", "off"}));
  app.add_option("--timing", timing,
                 "synced (default): each timed run starts on an idle GPU, after a synchronize, so it includes the "
                 "host's time to its first launch; pipelined: the runs enqueued back to back, an event between each "
                 "two, so each is timed on the GPU alone")
      ->check(moe::one_of({"synced", "pipelined"}));
  app.add_option("--block-row-pairs", block_row_pairs,
                 "pairs of block rows (and of weight-gradient tiles) where the measured rule takes them (rule, "
                 "default), or at every shape, for an experiment (everywhere)")
      ->check(moe::one_of({"rule", "everywhere"}));
  app.add_flag("--kernel-trace", options.kernel_trace,
               "after timing each formulation, run its forward and its forward + backward `repeat` more times back "
               "to back under CUPTI and report each kernel's median time in place and the GPU's idle gaps between "
               "kernels (JSON: kernel_traces)");
  app.add_option("--activation", activation,
                 "the experts' activation: gelu (default), swiglu (W1 [D, 2H]), or both, SwiGLU's rows after GeLU's "
                 "for each shape and routing, with their ratio (vs gelu)")
      ->check(moe::one_of({"gelu", "swiglu", "both"}));
  app.add_option("--micro-batches", options.micro_batches,
                 "M: instead of the formulations table, the whole dropless layer (B = 128) over M micro-batches of the "
                 "shape's T tokens, its expert weight gradients as one product over all of them (gradient "
                 "accumulation), beside the same micro-batches each with its own weight gradients, the layer on one "
                 "batch of M*T tokens, and dense cuBLAS on M*T*K rows (the ratios' baseline); M = 1 times the "
                 "layer's plain step")
      ->check(moe::whole_number(1, 4096));
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) std::exit(*exit_status);

  if (shapes == "small") options.shapes = {kSmallShape};
  else if (shapes == "all") {
    options.shapes = {kSmallShape};
    options.shapes.insert(options.shapes.end(), kBaselineShapes.begin(), kBaselineShapes.end());
  } else if (!shapes.empty() && shapes != "baselines") {
    const std::vector<int64_t> n = *moe::parse_integer_list(shapes);
    options.shapes = {{int(n[0]), int(n[1]), int(n[2]), int(n[3]), int(n[4])}};
    const Shape& s = options.shapes.front();
    if (s.T < 1 || s.D < 1 || s.H < 1 || s.E < 1 || s.K < 1 || s.K > s.E) {
      throw std::invalid_argument("--shapes " + shapes + ": allowed: T,D,H,E,K all >= 1 and K <= E");
    }
  }
  if (routing == "uniform") options.routings = {Routing::uniform};
  else if (routing == "zipf") options.routings = {Routing::zipf};
  if (activation == "swiglu") options.activations = {moe::Activation::swiglu};
  else if (activation == "both") options.activations = {moe::Activation::gelu, moe::Activation::swiglu};
  if (!routing_from.empty()) options.captured = capture_routing(routing_from);
  if (!only.empty()) options.only = split(only, ',');
  if (rows == "gathered") options.rows = Options::Rows::gathered;
  else if (rows == "permuted") options.rows = Options::Rows::permuted;
  options.stream_k = stream_k != "off";
  options.gradient_pairs = gradient_pairs != "off";
  options.pipelined = timing == "pipelined";
  options.pairs_everywhere = block_row_pairs == "everywhere";
  if (options.captured) options.routings.push_back(Routing::captured);
  if (!options.out.empty()) moe::check_output_path("--out", options.out);  // before the GPU work, not after
  return options;
}

// ---------------------------------------------------------------------------------------------
// [SECTION] random inputs
// ---------------------------------------------------------------------------------------------

// A counter-based generator (splitmix64 of seed + index): element i gets the same value whatever the
// number of threads, so inputs are reproducible from the seed alone.
uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale), rounded to bf16. Generated on the host in chunks by all cores and copied
// up: the largest tensor here (E*D*H = 1.07e9 values) takes about a second.
void fill_uniform(DeviceBuffer<bf16>& buffer, float scale, uint64_t seed) {
  constexpr size_t kChunk = size_t{1} << 24;
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 32u);
  std::vector<bf16> host(std::min(kChunk, buffer.size()));
  const uint64_t stream_key = splitmix64(seed);
  for (size_t first = 0; first < buffer.size(); first += kChunk) {
    const size_t count = std::min(kChunk, buffer.size() - first);
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < threads; ++w) {
      workers.emplace_back([&, w] {
        const size_t begin = count * w / threads, end = count * (w + 1) / threads;
        for (size_t i = begin; i < end; ++i) {
          const uint64_t bits = splitmix64(stream_key ^ (first + i));
          const float unit = static_cast<float>(bits >> 40) * 0x1p-24f;  // [0, 1)
          host[i] = __float2bfloat16((2.0f * unit - 1.0f) * scale);
        }
      });
    }
    for (std::thread& worker : workers) worker.join();
    CUDA_CHECK(cudaMemcpy(buffer.data() + first, host.data(), count * sizeof(bf16), cudaMemcpyHostToDevice));
  }
  CUDA_CHECK(cudaStreamSynchronize(nullptr));  // on the GPU before any stream reads it (device_buffer.h)
}

// ---------------------------------------------------------------------------------------------
// [SECTION] timing
// ---------------------------------------------------------------------------------------------

struct Timing {
  std::vector<float> samples_ms;
  double median_ms = std::nan("");
};

// Warm-up runs (`warmup` of them, and at least warmup_ms of load: clock_warm_up.h says why), then
// `repeat` runs, each between two events on `stream`; the median of their times.
// Synced: each run is enqueued after the one before has finished, so it starts on an idle GPU and
// its time includes the host's work up to its first launch. Pipelined: one untimed run, then every
// run enqueued back to back with an event between each two, so that while the GPU runs one the
// host enqueues the next, as in a training loop: each time is the GPU's alone.
Timing time_work(cudaStream_t stream, const Options& options, const std::function<void()>& work) {
  moe::cuda::warm_up_clock(stream, options.warmup, options.warmup_ms, work);
  std::vector<cudaEvent_t> events(options.repeat + 1);  // pipelined: one between each two runs
  for (cudaEvent_t& e : events) CUDA_CHECK(cudaEventCreate(&e));
  Timing timing;
  auto add_sample = [&](cudaEvent_t start, cudaEvent_t stop) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    timing.samples_ms.push_back(ms);
  };
  if (options.pipelined) {
    work();
    CUDA_CHECK(cudaEventRecord(events[0], stream));
    for (int i = 0; i < options.repeat; ++i) {
      work();
      CUDA_CHECK(cudaEventRecord(events[i + 1], stream));
    }
    CUDA_CHECK(cudaEventSynchronize(events.back()));
    for (int i = 0; i < options.repeat; ++i) add_sample(events[i], events[i + 1]);
  } else {
    for (int i = 0; i < options.repeat; ++i) {
      CUDA_CHECK(cudaEventRecord(events[0], stream));
      work();
      CUDA_CHECK(cudaEventRecord(events[1], stream));
      CUDA_CHECK(cudaEventSynchronize(events[1]));
      add_sample(events[0], events[1]);
    }
  }
  for (cudaEvent_t e : events) CUDA_CHECK(cudaEventDestroy(e));
  std::vector<float> sorted = timing.samples_ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  timing.median_ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  return timing;
}

// ---------------------------------------------------------------------------------------------
// [SECTION] checks
// ---------------------------------------------------------------------------------------------

struct Difference {  // accumulates ||candidate - reference|| and ||reference||
  double diff2 = 0, ref2 = 0;
  int64_t compared = 0, not_finite = 0;
  void add(double candidate, double reference) {
    ++compared;
    if (!std::isfinite(candidate)) {
      ++not_finite;
      return;
    }
    diff2 += (candidate - reference) * (candidate - reference);
    ref2 += reference * reference;
  }
  double relative() const { return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2); }
};

struct Check {
  std::string name;
  double relative_error = 0;
  int64_t compared = 0, not_finite = 0;
  double tolerance = kTolerance;
  bool pass = false;
  std::string note;  // for checks that are not a tolerance (counts, exceptions)
};

std::vector<Check> g_checks;  // every check of the run, in order; reported in the JSON and the verdict

void record_check(const std::string& name, const Difference& d) {
  Check c{name, d.relative(), d.compared, d.not_finite, kTolerance, false, ""};
  c.pass = d.compared > 0 && d.not_finite == 0 && c.relative_error < kTolerance;
  std::printf("  check %-62s rel_err=%.2e tol=%.0e %s%s\n", name.c_str(), c.relative_error, kTolerance,
              c.pass ? "ok" : "FAIL", d.not_finite ? " (NaN/Inf in output)" : "");
  g_checks.push_back(c);
}

void record_fact(const std::string& name, bool pass, const std::string& note) {
  std::printf("  check %-62s %s %s\n", name.c_str(), note.c_str(), pass ? "ok" : "FAIL");
  g_checks.push_back(Check{name, 0, 0, 0, 0, pass, note});
}

float to_float(bf16 v) { return __bfloat162float(v); }

// Device rows [max_rows, cols] -> host rows in slot order; a slot without a row (slot_row = -1) stays NaN.
std::vector<bf16> rows_by_slot(const bf16* device_rows, size_t max_rows, int cols, const std::vector<int>& slot_row) {
  std::vector<bf16> all(max_rows * cols);
  CUDA_CHECK(cudaMemcpy(all.data(), device_rows, all.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<bf16> by_slot(slot_row.size() * cols, __float2bfloat16(std::nanf("")));
  for (size_t s = 0; s < slot_row.size(); ++s) {
    if (slot_row[s] >= 0) {
      std::copy_n(all.begin() + size_t(slot_row[s]) * cols, cols, by_slot.begin() + s * cols);
    }
  }
  return by_slot;
}

// Compares the slots where `present[s] >= 0` (a row exists in the candidate's layout).
Difference compare_slots(const std::vector<bf16>& candidate, const std::vector<bf16>& reference, int cols,
                         const std::vector<int>& present) {
  Difference d;
  for (size_t s = 0; s < present.size(); ++s) {
    if (present[s] < 0) continue;
    for (int c = 0; c < cols; ++c) d.add(to_float(candidate[s * cols + c]), to_float(reference[s * cols + c]));
  }
  return d;
}

// Expert e's [rows, cols] slice of an [E, rows, cols] device tensor, as floats.
template <typename T>
std::vector<float> expert_slice(const T* device, int expert, size_t per_expert) {
  std::vector<T> host(per_expert);
  CUDA_CHECK(cudaMemcpy(host.data(), device + size_t(expert) * per_expert, per_expert * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> out(per_expert);
  for (size_t i = 0; i < per_expert; ++i) {
    if constexpr (std::is_same_v<T, bf16>) out[i] = __bfloat162float(host[i]);
    else out[i] = host[i];
  }
  return out;
}

Difference compare_floats(const std::vector<float>& candidate, const std::vector<float>& reference) {
  Difference d;
  for (size_t i = 0; i < reference.size(); ++i) d.add(candidate[i], reference[i]);
  return d;
}

// The grouped cuBLAS path's results in slot order: what every other formulation is compared with.
struct Oracle {
  std::vector<bf16> out;  // [T*K, D]
  std::vector<bf16> dx;   // [T*K, D] gradient of the permuted input
  std::vector<int> checked_experts;              // experts whose weight gradients are kept (non-empty)
  std::vector<std::vector<float>> dw1, dw2;      // per checked expert: [D, W1], [H, D]
};

// ---------------------------------------------------------------------------------------------
// [SECTION] cuBLAS expert FFN (grouped, padded / dropping batched, dense)
// ---------------------------------------------------------------------------------------------

// Which rows of a [rows, .] activation belong to which expert's product.
struct ExpertGroups {
  std::vector<int> expert;        // the weight set of each group
  std::vector<int> rows;          // m of each group's products
  std::vector<size_t> first_row;  // where each group's rows start
};

ExpertGroups capacity_groups(int experts, int capacity) {  // padded / dropping: E x [C, .]
  ExpertGroups g;
  for (int e = 0; e < experts; ++e) {
    g.expert.push_back(e);
    g.rows.push_back(capacity);
    g.first_row.push_back(size_t(e) * capacity);
  }
  return g;
}

ExpertGroups exact_groups(const std::vector<int>& counts) {  // dropless grouped: empty experts left out
  ExpertGroups g;
  size_t first = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) {
      g.expert.push_back(static_cast<int>(e));
      g.rows.push_back(counts[e]);
      g.first_row.push_back(first);
    }
    first += counts[e];
  }
  return g;
}

// A device array of pointers base + index[g] * stride, one per group.
template <typename T>
DeviceBuffer<T*> pointer_table(T* base, const std::vector<size_t>& index, size_t stride) {
  std::vector<T*> pointers;
  for (size_t i : index) pointers.push_back(base + i * stride);
  return DeviceBuffer<T*>(pointers);
}

enum class CublasKind { dense, batched, grouped };

// The activations, gradients and per-group pointer tables of the cuBLAS expert FFN over `rows` rows.
// W1 = the columns of W1 and of pre: H for GeLU, 2H for SwiGLU ([gate | up] per row).
// GeLU: d_hidden doubles as d_pre (gelu_backward is elementwise, so it can overwrite its input).
// SwiGLU: d_pre [rows, 2H] is a buffer of its own ([d_gate | d_up], twice d_hidden's width).
struct CublasFfn {
  CublasFfn(size_t rows, int model_dim, int hidden_dim, moe::Activation activation, ExpertGroups groups_in,
            const bf16* w1, const bf16* w2, int weight_sets)
      : rows(rows), D(model_dim), H(hidden_dim), W1(w1_width(hidden_dim, activation)), activation(activation),
        groups(std::move(groups_in)), w1(w1), w2(w2), x(rows * D), pre(rows * W1), hidden(rows * H),
        out(rows * D), d_out(rows * D), d_hidden(rows * H), d_pre_swiglu(swiglu() ? rows * W1 : 0), dx(rows * D),
        dw1(size_t(weight_sets) * D * W1), dw2(size_t(weight_sets) * H * D) {
    const std::vector<size_t>& r = groups.first_row;
    std::vector<size_t> e(groups.expert.begin(), groups.expert.end());
    const size_t DW1 = size_t(D) * W1, HD = size_t(H) * D;
    bf16* const d_pre = swiglu() ? d_pre_swiglu.data() : d_hidden.data();
    x_of = pointer_table<const bf16>(x.data(), r, D);
    hidden_of = pointer_table<const bf16>(hidden.data(), r, H);
    d_out_of = pointer_table<const bf16>(d_out.data(), r, D);
    d_pre_of = pointer_table<const bf16>(d_pre, r, W1);
    w1_of = pointer_table<const bf16>(w1, e, DW1);
    w2_of = pointer_table<const bf16>(w2, e, HD);
    pre_of = pointer_table<bf16>(pre.data(), r, W1);
    out_of = pointer_table<bf16>(out.data(), r, D);
    d_hidden_of = pointer_table<bf16>(d_hidden.data(), r, H);
    dx_of = pointer_table<bf16>(dx.data(), r, D);
    dw1_of = pointer_table<bf16>(dw1.data(), weight_sets == 1 ? std::vector<size_t>(e.size(), 0) : e, DW1);
    dw2_of = pointer_table<bf16>(dw2.data(), weight_sets == 1 ? std::vector<size_t>(e.size(), 0) : e, HD);
  }
  static int w1_width(int H, moe::Activation activation) {
    return activation == moe::Activation::swiglu ? 2 * H : H;
  }
  // GeLU: pre, hidden, d_hidden (= d_pre): 3H per row; SwiGLU: pre 2H, hidden, d_hidden, d_pre 2H: 6H.
  static size_t bytes(size_t rows, int D, int H, moe::Activation activation, int weight_sets) {
    const size_t W1 = size_t(w1_width(H, activation));
    const size_t hidden_widths = activation == moe::Activation::swiglu ? 2 * W1 + 2 * size_t(H) : 3 * size_t(H);
    return rows * (4 * size_t(D) + hidden_widths) * sizeof(bf16) +
           size_t(weight_sets) * D * (W1 + size_t(H)) * sizeof(bf16);
  }
  bool swiglu() const { return activation == moe::Activation::swiglu; }
  bf16* d_pre() { return swiglu() ? d_pre_swiglu.data() : d_hidden.data(); }  // [rows, W1]
  void poison_results() {
    out.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    dw1.fill_bytes(0xFF);
    dw2.fill_bytes(0xFF);
  }

  size_t rows;
  int D, H, W1;
  moe::Activation activation;
  ExpertGroups groups;
  const bf16* w1;  // [E, D, W1]  (dense: expert 0's [D, W1])
  const bf16* w2;  // [E, H, D]
  DeviceBuffer<bf16> x, pre, hidden, out, d_out, d_hidden, d_pre_swiglu, dx;  // [rows, D], [rows, W1], [rows, H]
  DeviceBuffer<bf16> dw1, dw2;  // [weight_sets, D, W1], [weight_sets, H, D]
  DeviceBuffer<const bf16*> x_of, hidden_of, d_out_of, d_pre_of, w1_of, w2_of;
  DeviceBuffer<bf16*> pre_of, out_of, d_hidden_of, dx_of, dw1_of, dw2_of;
};

// pre = x W1 [rows, W1];  hidden = act(pre) [rows, H];  out = hidden W2 [rows, D].
void cublas_ffn_forward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1, groups = static_cast<int>(f.groups.rows.size());
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::none, int(f.rows), W1, D, f.x.data(), D, f.w1, W1, f.pre.data(), W1);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::none, f.groups.rows[0], W1, D, f.x_of.data(), D, f.w1_of.data(),
                              W1, f.pre_of.data(), W1, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, f.groups.rows, W1, D, f.x_of.data(), D, f.w1_of.data(), W1, f.pre_of.data(), W1);
      break;
  }
  if (f.swiglu()) {
    moe::cuda::swiglu_forward(f.pre.data(), f.hidden.data(), int64_t(f.rows), H, stream);
  } else {
    moe::cuda::gelu_forward(f.pre.data(), f.hidden.data(), f.rows * H, stream);
  }
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::none, int(f.rows), D, H, f.hidden.data(), H, f.w2, D, f.out.data(), D);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::none, f.groups.rows[0], D, H, f.hidden_of.data(), H,
                              f.w2_of.data(), D, f.out_of.data(), D, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, f.groups.rows, D, H, f.hidden_of.data(), H, f.w2_of.data(), D,
                              f.out_of.data(), D);
      break;
  }
}

// dh = dy W2ᵀ;  d_pre = act'(dh, pre) [rows, W1];  dW2 = hᵀ dy;  dW1 = xᵀ d_pre;  dx = d_pre W1ᵀ.
void cublas_ffn_backward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream) {
  const int D = f.D, H = f.H, W1 = f.W1, groups = static_cast<int>(f.groups.rows.size());
  bf16* const d_pre = f.d_pre();
  const int m = int(f.rows);
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::none, Op::transpose, m, H, D, f.d_out.data(), D, f.w2, D, f.d_hidden.data(), H);
      break;
    case CublasKind::batched:
      moe::cuda::gemm_batched(handle, Op::none, Op::transpose, f.groups.rows[0], H, D, f.d_out_of.data(), D,
                              f.w2_of.data(), D, f.d_hidden_of.data(), H, groups);
      break;
    case CublasKind::grouped:
      moe::cuda::gemm_grouped(handle, Op::none, Op::transpose, f.groups.rows, std::vector<int>(groups, H),
                           std::vector<int>(groups, D), f.d_out_of.data(), D, f.w2_of.data(), D,
                           f.d_hidden_of.data(), H);
      break;
  }
  if (f.swiglu()) {
    moe::cuda::swiglu_backward(f.pre.data(), f.d_hidden.data(), d_pre, int64_t(f.rows), H, stream);
  } else {
    moe::cuda::gelu_backward(f.pre.data(), f.d_hidden.data(), d_pre, f.rows * H, stream);
  }
  switch (kind) {
    case CublasKind::dense:
      moe::cuda::gemm(handle, Op::transpose, Op::none, H, D, m, f.hidden.data(), H, f.d_out.data(), D, f.dw2.data(), D);
      moe::cuda::gemm(handle, Op::transpose, Op::none, D, W1, m, f.x.data(), D, d_pre, W1, f.dw1.data(), W1);
      moe::cuda::gemm(handle, Op::none, Op::transpose, m, D, W1, d_pre, W1, f.w1, W1, f.dx.data(), D);
      break;
    case CublasKind::batched: {
      const int C = f.groups.rows[0];
      moe::cuda::gemm_batched(handle, Op::transpose, Op::none, H, D, C, f.hidden_of.data(), H, f.d_out_of.data(), D,
                              f.dw2_of.data(), D, groups);
      moe::cuda::gemm_batched(handle, Op::transpose, Op::none, D, W1, C, f.x_of.data(), D, f.d_pre_of.data(), W1,
                              f.dw1_of.data(), W1, groups);
      moe::cuda::gemm_batched(handle, Op::none, Op::transpose, C, D, W1, f.d_pre_of.data(), W1, f.w1_of.data(), W1,
                              f.dx_of.data(), D, groups);
      break;
    }
    case CublasKind::grouped: {
      const std::vector<int> all_d(groups, D), all_h(groups, H), all_w1(groups, W1);
      moe::cuda::gemm_grouped(handle, Op::transpose, Op::none, all_h, all_d, f.groups.rows, f.hidden_of.data(), H,
                           f.d_out_of.data(), D, f.dw2_of.data(), D);
      moe::cuda::gemm_grouped(handle, Op::transpose, Op::none, all_d, all_w1, f.groups.rows, f.x_of.data(), D,
                           f.d_pre_of.data(), W1, f.dw1_of.data(), W1);
      moe::cuda::gemm_grouped(handle, Op::none, Op::transpose, f.groups.rows, all_d, all_w1, f.d_pre_of.data(), W1,
                           f.w1_of.data(), W1, f.dx_of.data(), D);
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// [SECTION] block-sparse expert FFN
// ---------------------------------------------------------------------------------------------

MoeConfig layer_config(const Shape& s, moe::Activation activation, Formulation formulation, int block_size,
                       double capacity_factor = 1.0) {
  MoeConfig c;
  c.tokens = s.T;
  c.model_dim = s.D;
  c.hidden_dim = s.H;
  c.num_experts = s.E;
  c.top_k = s.K;
  c.formulation = formulation;
  c.block_size = block_size;
  c.capacity_factor = capacity_factor;
  c.activation = activation;
  return c;
}

// The dropless layer's buffers: plan and topology built on the GPU, activations in B x B blocks,
// bf16 weight gradients, as every cuBLAS formulation here writes them (block_sparse_ffn_backward
// writes fp32 or bf16; the trainer takes fp32 for its optimizer). SwiGLU adds the up projection's
// blocks and their gradient; dW1 is [E, D, 2H].
struct BlockSparseFfn {
  BlockSparseFfn(const MoeConfig& config_in)
      : config(config_in), plan(config), topology(config),
        x(size_t(plan.max_rows()) * config.model_dim), out(x.size()), d_out(x.size()), dx(x.size()),
        pre(blocks()), up(swiglu() ? blocks() : 0), hidden(blocks()), d_pre(blocks()), d_up(up.size()),
        dw1(size_t(config.num_experts) * config.model_dim * moe::w1_columns(config)),
        dw2(size_t(config.num_experts) * config.hidden_dim * config.model_dim) {
    dw1_of = moe::cuda::expert_pointer_table(dw1.data(), int(config.num_experts),
                                             size_t(config.model_dim) * moe::w1_columns(config));
    dw2_of = moe::cuda::expert_pointer_table(dw2.data(), int(config.num_experts),
                                             size_t(config.hidden_dim) * config.model_dim);
  }
  bool swiglu() const { return config.activation == moe::Activation::swiglu; }
  size_t blocks() const {
    const moe::cuda::DeviceTopology t = topology.topology();
    return size_t(t.max_nnz) * t.block_size * t.block_size;
  }
  static size_t bytes(const Shape& s, moe::Activation activation, int B) {
    const size_t rows = size_t(s.T) * s.K + size_t(s.E) * (B - 1);
    const bool swiglu = activation == moe::Activation::swiglu;
    const size_t hidden_widths = swiglu ? 5 : 3;  // pre, hidden, d_pre (+ up, d_up)
    const size_t weight_widths = swiglu ? 3 : 2;  // dW1 [D, W1] + dW2 [H, D], in units of D H
    return rows * (4 * size_t(s.D) + hidden_widths * size_t(s.H)) * sizeof(bf16) +
           weight_widths * size_t(s.E) * s.D * s.H * sizeof(bf16) + rows * 16;  // + plan and topology, generously
  }
  moe::cuda::BlockSparseFfnOutputs outputs() {
    moe::cuda::BlockSparseFfnOutputs o;
    o.pre_activation = pre.data();
    o.up_projection = up.data();  // nullptr for GeLU (an empty buffer)
    o.hidden = hidden.data();
    o.out = out.data();
    return o;
  }
  moe::cuda::BlockSparseFfnGradients gradients() {
    moe::cuda::BlockSparseFfnGradients g;
    g.d_pre_activation = d_pre.data();
    g.d_up_projection = d_up.data();
    g.d_permuted_x = dx.data();
    g.d_w1_bf16 = dw1_of.data();
    g.d_w2_bf16 = dw2_of.data();
    return g;
  }

  MoeConfig config;
  moe::cuda::DispatchPlanBuffers plan;
  moe::cuda::TopologyBuffers topology;
  DeviceBuffer<bf16> x, out, d_out, dx;  // [max_rows, D]
  DeviceBuffer<bf16> pre, up, hidden, d_pre, d_up;  // [max_nnz, B, B]; up, d_up SwiGLU only
  DeviceBuffer<bf16> dw1, dw2;                      // [E, D, W1], [E, H, D]
  DeviceBuffer<bf16*> dw1_of, dw2_of;
};

// The router's buffers, for timing the work outside the expert FFN.
struct RouterBuffers {
  RouterBuffers(const Shape& s)
      : gate_weights(size_t(s.D) * s.E), logits(size_t(s.T) * s.E), probs(logits.size()),
        top_experts(size_t(s.T) * s.K), combine_weights(top_experts.size()), logsumexp(s.T), expert_fraction(s.E),
        mean_probs(s.E), aux_loss(1), z_loss(1), workspace(s.E), y(size_t(s.T) * s.D) {}
  DeviceBuffer<bf16> gate_weights;  // [D, E]
  DeviceBuffer<float> logits, probs;  // [T, E]
  DeviceBuffer<int> top_experts;      // [T, K]
  DeviceBuffer<float> combine_weights, logsumexp, expert_fraction, mean_probs, aux_loss, z_loss;
  moe::cuda::RouterWorkspace workspace;
  DeviceBuffer<bf16> y;  // [T, D]
};

// ---------------------------------------------------------------------------------------------
// [SECTION] one shape, one routing
// ---------------------------------------------------------------------------------------------

struct Measurement {
  Shape shape;
  Routing routing;
  moe::Activation activation = moe::Activation::gelu;
  std::string formulation;
  int micro_batches = 1;  // --micro-batches: the rows cover M micro-batches of the shape's T tokens
  int block_size = 0, capacity = 0;
  bool gathers_rows = false;  // block-sparse: x's rows gathered by the SDD and DDS (no permuted copy)
  int64_t computed_rows = 0, useful_rows = 0;  // rows multiplied vs rows that belong to a kept token
  double dropped_fraction = 0;
  Timing forward, forward_backward;
  double forward_tflops = 0, forward_backward_tflops = 0, forward_vs_dense = 0, forward_backward_vs_dense = 0;
  // SwiGLU rows: useful TFLOP/s over the GeLU row of the same shape, routing and formulation (0: none)
  double forward_vs_gelu = 0, forward_backward_vs_gelu = 0;
};

struct Overhead {
  Shape shape;
  Routing routing;
  moe::Activation activation = moe::Activation::gelu;
  std::vector<std::pair<std::string, double>> step_ms;  // each step alone
  double total_ms = 0, ffn_forward_ms = 0, share = 0;
  double fused_router_ms = 0;  // route_fused beside router_logits + route_top_k (not in the total)
};

// One formulation's forward (or forward + backward), `repeat` runs back to back under CUPTI.
struct Trace {
  Shape shape;
  Routing routing;
  moe::Activation activation = moe::Activation::gelu;
  std::string formulation, phase;
  double timed_median_ms = 0;  // the same work's median from time_work, for comparison with the span
  moe::bench::KernelTraceSummary summary;
};

struct Report {
  std::vector<Measurement> measurements;
  std::vector<Overhead> overheads;
  std::vector<Trace> traces;
  std::vector<std::string> skipped;
};

// Device memory needed vs free; false (and a message) when it does not fit.
bool fits(size_t bytes, const std::string& what, Report& report) {
  constexpr size_t kSlack = size_t{768} << 20;  // cuBLAS workspaces, CUB scratch, fragmentation
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (bytes + kSlack <= free_bytes) return true;
  std::ostringstream message;
  message.precision(3);
  message << "skip " << what << ": needs about " << double(bytes + kSlack) / (1 << 30) << " GiB, "
          << double(free_bytes) / (1 << 30) << " GiB free of " << double(total_bytes) / (1 << 30);
  std::printf("  %s\n", message.str().c_str());
  report.skipped.push_back(message.str());
  return false;
}

// The tensors every formulation of a shape and activation shares. W1 = H (GeLU) or 2H (SwiGLU).
struct ShapeInputs {
  ShapeInputs(const Shape& s, moe::Activation activation_in, uint64_t seed)
      : activation(activation_in), W1(CublasFfn::w1_width(s.H, activation)), x(size_t(s.T) * s.D), dy(x.size()),
        w1(size_t(s.E) * s.D * W1), w2(size_t(s.E) * s.H * s.D) {
    fill_uniform(x, 1.0f, seed + 1);
    fill_uniform(dy, 1.0f, seed + 2);  // the gradient arriving at each token's output
    fill_uniform(w1, 1.0f / std::sqrt(float(s.D)), seed + 3);  // keeps pre-activations O(1)
    fill_uniform(w2, 1.0f / std::sqrt(float(s.H)), seed + 4);
    w1_of = moe::cuda::expert_pointer_table<const bf16>(w1.data(), s.E, size_t(s.D) * W1);
    w2_of = moe::cuda::expert_pointer_table<const bf16>(w2.data(), s.E, size_t(s.H) * s.D);
  }
  static size_t bytes(const Shape& s, moe::Activation activation) {
    const size_t W1 = size_t(CublasFfn::w1_width(s.H, activation));
    return (2 * size_t(s.T) * s.D + size_t(s.E) * s.D * (W1 + size_t(s.H))) * sizeof(bf16);
  }
  moe::Activation activation;
  int W1;
  DeviceBuffer<bf16> x, dy;   // [T, D]
  DeviceBuffer<bf16> w1, w2;  // [E, D, W1], [E, H, D]
  DeviceBuffer<const bf16*> w1_of, w2_of;
};

class RoutingBench {
 public:
  RoutingBench(const Shape& shape, Routing routing, const ShapeInputs& in, const Options& options,
               moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report)
      : s_(shape), routing_(routing), in_(in), options_(options), cublas_(cublas), stream_(stream), report_(report) {
    counts_ = moe::bench::routing_counts(int64_t(s_.T) * s_.K, s_.E, routing_,
                                         options.captured ? options.captured->tokens_per_expert : std::vector<double>{});
    top_experts_host_ = moe::bench::top_experts_from_counts(counts_, s_.T, s_.K);
    top_experts_ = DeviceBuffer<int>(top_experts_host_);
    max_count_ = *std::max_element(counts_.begin(), counts_.end());
    label_ = s_.name() + " " + std::string(moe::bench::to_string(routing_)) + " " +
             std::string(moe::to_string(in_.activation));
  }

  void run() {
    std::printf("%s: max %d rows per expert (mean %.0f)\n", label_.c_str(), max_count_,
                double(s_.T) * s_.K / s_.E);
    guarded("grouped_cublas and dense_cublas", [&] { exact_rows(); });
    if (oracle_.out.empty()) return;  // nothing to compare the others with
    for (int B : {128, 64}) {
      guarded("block_sparse_B" + std::to_string(B), [&] { block_sparse(B); });
    }
    guarded("padded_max", [&] { capacity_path("padded_max", max_count_); });
    for (double cf : {1.0, 1.25}) {
      char name[32];
      std::snprintf(name, sizeof name, "dropping_cf%.2f", cf);
      guarded(name, [&] { capacity_path(name, int(moe::capacity(config(Formulation::padded, 1, cf)))); });
    }
  }

 private:
  // One formulation's section: an exception (a launcher's argument check, a CUDA or cuBLAS error)
  // becomes a failed check and the next formulation still runs.
  void guarded(const std::string& what, const std::function<void()>& section) {
    try {
      section();
    } catch (const std::exception& error) {
      record_fact(label_ + " " + what, false, std::string("threw: ") + error.what());
      (void)cudaGetLastError();  // clear a non-sticky error so the next section starts clean
    }
  }

  int64_t routed_rows() const { return int64_t(s_.T) * s_.K; }
  MoeConfig config(Formulation formulation, int block_size, double capacity_factor = 1.0) const {
    return layer_config(s_, in_.activation, formulation, block_size, capacity_factor);
  }
  size_t w1_elements() const { return size_t(s_.D) * in_.W1; }  // one expert's W1 [D, W1]
  size_t w2_elements() const { return size_t(s_.H) * s_.D; }    // one expert's W2 [H, D]

  Measurement& add_measurement(const std::string& formulation, int64_t computed_rows, int64_t useful_rows) {
    Measurement m;
    m.shape = s_;
    m.routing = routing_;
    m.activation = in_.activation;
    m.formulation = formulation;
    m.computed_rows = computed_rows;
    m.useful_rows = useful_rows;
    m.dropped_fraction = 1.0 - double(useful_rows) / double(routed_rows());
    report_.measurements.push_back(m);
    return report_.measurements.back();
  }

  // Each phase is announced as it starts ("timing NAME forward", then "timing NAME forward+backward";
  // the "time" line ends the second), flushed at once, so that a tool reading the output as it comes
  // knows what the GPU is running (cuda/bench/power_trace.py samples the clock and power beside it).
  void time_forward_backward(Measurement& m, const std::function<void()>& forward,
                             const std::function<void()>& backward) {
    auto announce = [&](const char* phase) {
      std::printf("  timing %s %s\n", m.formulation.c_str(), phase);
      std::fflush(stdout);
    };
    announce("forward");
    m.forward = time_work(stream_, options_, forward);
    announce("forward+backward");
    m.forward_backward = time_work(stream_, options_, [&] {
      forward();
      backward();
    });
    std::printf("  time  %-20s forward %8.3f ms   forward+backward %8.3f ms\n", m.formulation.c_str(),
                m.forward.median_ms, m.forward_backward.median_ms);
    std::fflush(stdout);
    if (options_.kernel_trace) {
      trace(m, "forward", m.forward.median_ms, forward);
      trace(m, "forward+backward", m.forward_backward.median_ms, [&] {
        forward();
        backward();
      });
    }
  }

  // `repeat` runs of `work` back to back (the GPU is warm from the timing just done) under CUPTI.
  void trace(const Measurement& m, const char* phase, double timed_median_ms, const std::function<void()>& work) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    Trace t{s_, routing_, in_.activation, m.formulation, phase, timed_median_ms, {}};
    {
      moe::bench::KernelTrace tracer;
      for (int i = 0; i < options_.repeat; ++i) work();
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      t.summary = moe::bench::summarize_runs(tracer.take(), options_.repeat);
    }
    std::printf("  trace %-20s %-16s span %8.3f ms = kernels %8.3f + gaps %6.3f ms (%zu kernels a run)\n",
                m.formulation.c_str(), phase, t.summary.median_span_ms, t.summary.sum_kernels_ms,
                t.summary.sum_gaps_ms, t.summary.kernels.size());
    std::fflush(stdout);
    report_.traces.push_back(std::move(t));
  }

  std::vector<int> download_ints(const DeviceBuffer<int>& b) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return b.download();
  }

  // The plan the GPU built must hold the counts the host asked for.
  void check_plan(const std::string& what, const moe::cuda::DispatchPlanBuffers& plan, int64_t expected_dropped) {
    const std::vector<int> tokens_per_expert = download_ints(plan.tokens_per_expert);
    const std::vector<int> invalid = download_ints(plan.invalid_slots);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    const int64_t dropped = std::count(slot_row.begin(), slot_row.end(), -1);
    const bool ok = tokens_per_expert == counts_ && invalid[0] == 0 && dropped == expected_dropped;
    record_fact(label_ + " " + what + " GPU plan counts", ok,
                "invalid=" + std::to_string(invalid[0]) + " dropped=" + std::to_string(dropped) + "/" +
                    std::to_string(expected_dropped));
  }

  // -- grouped cuBLAS (the oracle of the other formulations) and dense cuBLAS, on exact rows --
  void exact_rows() {
    const size_t rows = size_t(routed_rows());
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, s_.E), label_ + " grouped_cublas", report_)) return;
    // A dropless plan with B = 1 lays the rows out expert after expert with no padding.
    moe::cuda::DispatchPlanBuffers plan(config(Formulation::dropless, 1));
    moe::cuda::build_dispatch_plan(top_experts_.data(), plan, stream_);
    check_plan("grouped_cublas", plan, 0);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    cublasHandle_t h = cublas_.get();
    {
      CublasFfn f(rows, s_.D, s_.H, in_.activation, exact_groups(counts_), in_.w1.data(), in_.w2.data(), s_.E);
      moe::cuda::permute_tokens(plan.plan(), in_.x.data(), f.x.data(), s_.D, stream_);
      moe::cuda::permute_tokens(plan.plan(), in_.dy.data(), f.d_out.data(), s_.D, stream_);
      f.poison_results();
      cublas_ffn_forward(h, CublasKind::grouped, f, stream_);
      cublas_ffn_backward(h, CublasKind::grouped, f, stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      oracle_.out = rows_by_slot(f.out.data(), rows, s_.D, slot_row);
      oracle_.dx = rows_by_slot(f.dx.data(), rows, s_.D, slot_row);
      for (int e : {0, s_.E - 1}) {
        if (counts_[e] == 0 || std::count(oracle_.checked_experts.begin(), oracle_.checked_experts.end(), e)) continue;
        oracle_.checked_experts.push_back(e);
        oracle_.dw1.push_back(expert_slice(f.dw1.data(), e, w1_elements()));
        oracle_.dw2.push_back(expert_slice(f.dw2.data(), e, w2_elements()));
      }
      // The oracle must at least be complete: every slot's row written with finite numbers.
      Difference finite;
      for (const bf16 v : oracle_.out) finite.add(to_float(v), 0.0);
      for (const bf16 v : oracle_.dx) finite.add(to_float(v), 0.0);
      record_fact(label_ + " grouped_cublas out, dx all written and finite", finite.not_finite == 0,
                  std::to_string(finite.not_finite) + " non-finite of " + std::to_string(finite.compared));
      if (finite.not_finite != 0) {
        oracle_ = Oracle{};
        return;
      }
      if (options_.selected("grouped_cublas")) {
        Measurement& m = add_measurement("grouped_cublas", routed_rows(), routed_rows());
        time_forward_backward(m, [&] { cublas_ffn_forward(h, CublasKind::grouped, f, stream_); },
                              [&] { cublas_ffn_backward(h, CublasKind::grouped, f, stream_); });
      }
    }
    // Dense: expert 0's weights for every row, so its rows of expert 0 must equal the oracle's.
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, 1), label_ + " dense_cublas", report_)) return;
    ExpertGroups one{{0}, {int(rows)}, {0}};
    CublasFfn f(rows, s_.D, s_.H, in_.activation, one, in_.w1.data(), in_.w2.data(), 1);
    moe::cuda::permute_tokens(plan.plan(), in_.x.data(), f.x.data(), s_.D, stream_);
    moe::cuda::permute_tokens(plan.plan(), in_.dy.data(), f.d_out.data(), s_.D, stream_);
    f.poison_results();
    cublas_ffn_forward(h, CublasKind::dense, f, stream_);
    cublas_ffn_backward(h, CublasKind::dense, f, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<int> expert0_slots(slot_row.size(), -1);
    for (size_t slot = 0; slot < slot_row.size(); ++slot) {
      if (slot_row[slot] < counts_[0]) expert0_slots[slot] = slot_row[slot];
    }
    record_check(label_ + " dense_cublas out (expert 0 rows) vs grouped",
                 compare_slots(rows_by_slot(f.out.data(), rows, s_.D, expert0_slots), oracle_.out, s_.D, expert0_slots));
    record_check(label_ + " dense_cublas dx (expert 0 rows) vs grouped",
                 compare_slots(rows_by_slot(f.dx.data(), rows, s_.D, expert0_slots), oracle_.dx, s_.D, expert0_slots));
    Measurement& m = add_measurement("dense_cublas", routed_rows(), routed_rows());
    time_forward_backward(m, [&] { cublas_ffn_forward(h, CublasKind::dense, f, stream_); },
                          [&] { cublas_ffn_backward(h, CublasKind::dense, f, stream_); });
  }

  // Compares a formulation's out and dx (and weight gradients) with the oracle, slot by slot.
  template <typename WeightT>
  void compare_with_oracle(const std::string& name, const bf16* out, const bf16* dx, size_t max_rows,
                           const std::vector<int>& slot_row, const WeightT* dw1, const WeightT* dw2, bool weights) {
    record_check(label_ + " " + name + " out vs grouped",
                 compare_slots(rows_by_slot(out, max_rows, s_.D, slot_row), oracle_.out, s_.D, slot_row));
    record_check(label_ + " " + name + " dx vs grouped",
                 compare_slots(rows_by_slot(dx, max_rows, s_.D, slot_row), oracle_.dx, s_.D, slot_row));
    if (!weights) return;
    for (size_t i = 0; i < oracle_.checked_experts.size(); ++i) {
      const int e = oracle_.checked_experts[i];
      record_check(label_ + " " + name + " dW1[" + std::to_string(e) + "] vs grouped",
                   compare_floats(expert_slice(dw1, e, w1_elements()), oracle_.dw1[i]));
      record_check(label_ + " " + name + " dW2[" + std::to_string(e) + "] vs grouped",
                   compare_floats(expert_slice(dw2, e, w2_elements()), oracle_.dw2[i]));
    }
  }

  // -- dropless block-sparse (MegaBlocks) --
  void block_sparse(int B) {
    const std::string name = "block_sparse_B" + std::to_string(B);
    if (!options_.selected(name)) return;
    if (!fits(BlockSparseFfn::bytes(s_, in_.activation, B), label_ + " " + name, report_)) return;
    BlockSparseFfn f(config(Formulation::dropless, B));
    const moe::cuda::DevicePlan plan = f.plan.plan();
    const moe::cuda::DeviceTopology topology = f.topology.topology();
    moe::cuda::build_dispatch_plan(top_experts_.data(), f.plan, stream_);
    moe::cuda::build_topology(plan, f.topology, stream_);
    moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_);
    moe::cuda::permute_tokens(plan, in_.dy.data(), f.d_out.data(), s_.D, stream_);
    check_plan(name, f.plan, 0);
    f.out.fill_bytes(0xFF, stream_);
    f.dx.fill_bytes(0xFF, stream_);
    f.dw1.fill_bytes(0xFF, stream_);
    f.dw2.fill_bytes(0xFF, stream_);
    // What the layer runs: x's rows gathered by the forward's SDD where gathering pays (no permute
    // in the forward, so none in the routing overhead either; the backward then permutes x for its
    // DDS, and that permute is timed with the backward), else the permuted copy.
    const bool gathered =
        options_.rows == Options::Rows::layer      ? moe::cuda::gathering_pays(f.config)
        : options_.rows == Options::Rows::gathered ? moe::cuda::rows_gatherable(f.config)
                                                   : false;
    const moe::cuda::ExpertRows rows =
        gathered ? moe::cuda::ExpertRows::gathered(in_.x.data(), plan) : moe::cuda::ExpertRows(f.x.data());
    auto forward = [&] {
      moe::cuda::block_sparse_ffn_forward(f.config, topology, rows, in_.w1_of.data(), in_.w2_of.data(), f.outputs(),
                                          stream_);
    };
    auto backward = [&] {
      if (gathered) moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_);
      moe::cuda::block_sparse_ffn_backward(f.config, topology, f.x.data(), in_.w1_of.data(), in_.w2_of.data(),
                                           f.outputs(), f.d_out.data(), f.gradients(), stream_);
    };
    forward();
    backward();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::vector<int> slot_row = download_ints(f.plan.slot_row);
    const size_t max_rows = size_t(f.plan.max_rows());
    compare_with_oracle(name, f.out.data(), f.dx.data(), max_rows, slot_row, f.dw1.data(), f.dw2.data(), true);
    if (B == 128) cpu_oracle_check(name, f.out.data(), max_rows, slot_row);

    Measurement& m = add_measurement(name, -1, routed_rows());
    m.block_size = B;
    m.gathers_rows = gathered;  // and forward_backward_ms includes the backward's permute
    std::vector<int> total_rows = download_ints(f.plan.total_rows);
    m.computed_rows = total_rows[0];
    time_forward_backward(m, forward, backward);
    if (B == 128) routing_overhead(f, m.forward.median_ms, gathered);
  }

  // Everything of a forward layer step outside the expert FFN, with the real kernels: the router,
  // the plan, the topology, the permutation (unless the SDD gathers the rows, as the layer then runs
  // none) and the weighted un-permutation. The plan is built from
  // this bench's deterministic top_experts (so its sizes match the routing measured); the router
  // computes its losses from its own top_experts.
  void routing_overhead(BlockSparseFfn& f, double ffn_forward_ms, bool gathered) {
    if (!fits(size_t(s_.T) * (s_.D * 2 + s_.E * 8 + s_.K * 8) + size_t(s_.D) * s_.E * 2, label_ + " routing overhead",
              report_)) {
      return;
    }
    RouterBuffers r(s_);
    fill_uniform(r.gate_weights, 1.0f / std::sqrt(float(s_.D)), options_.seed + 5);
    const moe::cuda::DevicePlan plan = f.plan.plan();
    cublasHandle_t h = cublas_.get();
    std::vector<std::pair<std::string, std::function<void()>>> steps = {
        {"router_logits", [&] { moe::cuda::router_logits(h, in_.x.data(), r.gate_weights.data(), r.logits.data(), s_.T, s_.D, s_.E, stream_); }},
        {"route_top_k", [&] { moe::cuda::route_top_k(r.logits.data(), r.probs.data(), r.top_experts.data(), r.combine_weights.data(), r.logsumexp.data(), r.expert_fraction.data(), r.mean_probs.data(), r.aux_loss.data(), r.z_loss.data(), r.workspace, s_.T, s_.E, s_.K, false, stream_); }},
        {"build_dispatch_plan", [&] { moe::cuda::build_dispatch_plan(top_experts_.data(), f.plan, stream_); }},
        {"build_topology", [&] { moe::cuda::build_topology(plan, f.topology, stream_); }},
        {"permute_tokens", [&] { moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_); }},
        {"unpermute_and_combine", [&] { moe::cuda::unpermute_and_combine(plan, r.combine_weights.data(), f.out.data(), r.y.data(), s_.D, stream_); }},
    };
    if (gathered) steps.erase(steps.begin() + 4);  // the SDD gathers the rows: the layer runs no permute
    Overhead o;
    o.shape = s_;
    o.routing = routing_;
    o.activation = in_.activation;
    for (const auto& [step, work] : steps) o.step_ms.emplace_back(step, time_work(stream_, options_, work).median_ms);
    o.total_ms = time_work(stream_, options_, [&] {
                   for (const auto& step : steps) step.second();
                 }).median_ms;
    o.ffn_forward_ms = ffn_forward_ms;
    o.share = o.total_ms / (o.total_ms + ffn_forward_ms);
    // Beside it, the router as one kernel (route_fused: the logits on the tensor cores, in shared
    // memory), which the layer does not run: router.h gives the measurements.
    o.fused_router_ms = time_work(stream_, options_, [&] {
                          moe::cuda::route_fused(in_.x.data(), r.gate_weights.data(), s_.D, r.probs.data(), r.top_experts.data(), r.combine_weights.data(), r.logsumexp.data(), r.expert_fraction.data(), r.mean_probs.data(), r.aux_loss.data(), r.z_loss.data(), r.workspace, s_.T, s_.E, s_.K, false, stream_);
                        }).median_ms;
    std::printf("  time  %-20s %8.3f ms (router_logits + route_top_k, the layer's: %.3f ms)\n", "route_fused",
                o.fused_router_ms, o.step_ms[0].second + o.step_ms[1].second);
    std::printf("  time  %-20s %8.3f ms outside the expert FFN: %.1f%% of the dropless forward layer\n",
                "routing overhead", o.total_ms, 100.0 * o.share);
    report_.overheads.push_back(o);
  }

  // An oracle independent of cuBLAS: the CPU reference on a few hundred slots (small shapes only:
  // it needs the weights in double precision on the host).
  void cpu_oracle_check(const std::string& name, const bf16* out, size_t max_rows, const std::vector<int>& slot_row) {
    if (size_t(s_.E) * w1_elements() > (size_t{1} << 25)) return;
    const int64_t slots = routed_rows();
    const int n = int(std::min<int64_t>(kOracleCpuRows, slots));
    std::vector<std::vector<int64_t>> chosen(s_.E);  // sampled slots, by expert
    for (int i = 0; i < n; ++i) {
      const int64_t slot = i * slots / n;
      chosen[top_experts_host_[slot]].push_back(slot);
    }
    moe::ref::DispatchPlan plan;
    plan.num_experts = s_.E;
    plan.row_offsets.push_back(0);
    std::vector<int64_t> order;
    for (int e = 0; e < s_.E; ++e) {
      plan.rows_per_expert.push_back(int32_t(chosen[e].size()));
      plan.row_offsets.push_back(plan.row_offsets.back() + int32_t(chosen[e].size()));
      order.insert(order.end(), chosen[e].begin(), chosen[e].end());
    }
    plan.total_rows = n;
    const std::vector<bf16> x = in_.x.download(), w1 = in_.w1.download(), w2 = in_.w2.download();
    moe::ref::Matrix permuted_x(n, s_.D);
    for (int r = 0; r < n; ++r) {
      const int64_t token = order[r] / s_.K;
      for (int d = 0; d < s_.D; ++d) permuted_x(r, d) = to_float(x[size_t(token) * s_.D + d]);
    }
    std::vector<moe::ref::Matrix> w1_ref(s_.E, moe::ref::Matrix(s_.D, in_.W1)), w2_ref(s_.E, moe::ref::Matrix(s_.H, s_.D));
    for (int e = 0; e < s_.E; ++e) {
      for (size_t i = 0; i < w1_elements(); ++i) w1_ref[e].data()[i] = to_float(w1[e * w1_elements() + i]);
      for (size_t i = 0; i < w2_elements(); ++i) w2_ref[e].data()[i] = to_float(w2[e * w2_elements() + i]);
    }
    const moe::ref::ExpertActivations ref =
        moe::ref::expert_ffn_forward(config(Formulation::dropless, 128), plan, permuted_x, w1_ref, w2_ref);
    const std::vector<bf16> gpu = rows_by_slot(out, max_rows, s_.D, slot_row);
    Difference d;
    for (int r = 0; r < n; ++r) {
      for (int c = 0; c < s_.D; ++c) d.add(to_float(gpu[size_t(order[r]) * s_.D + c]), ref.out(r, c));
    }
    record_check(label_ + " " + name + " out vs CPU reference (" + std::to_string(n) + " slots)", d);
  }

  // -- padded to the largest expert (C = max count) and dropping at a capacity factor --
  void capacity_path(const std::string& name, int C) {
    if (!options_.selected(name)) return;
    int64_t dropped = 0;
    for (int c : counts_) dropped += std::max(0, c - C);
    const size_t rows = size_t(s_.E) * C;
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, s_.E) + rows * 8, label_ + " " + name, report_)) return;
    // The padded plan lays out E x [C, D]; its capacity comes from capacity_factor, so pick the factor
    // that gives exactly C (nudged past the rounding of ceil(cf * T*K / E)).
    MoeConfig padded = config(Formulation::padded, 1, double(C) * s_.E / double(routed_rows()));
    while (moe::capacity(padded) > C) padded.capacity_factor = std::nextafter(padded.capacity_factor, 0.0);
    while (moe::capacity(padded) < C) padded.capacity_factor = std::nextafter(padded.capacity_factor, 1e300);
    moe::cuda::DispatchPlanBuffers plan(padded);
    moe::cuda::build_dispatch_plan(top_experts_.data(), plan, stream_);
    check_plan(name, plan, dropped);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    cublasHandle_t h = cublas_.get();
    CublasFfn f(rows, s_.D, s_.H, in_.activation, capacity_groups(s_.E, C), in_.w1.data(), in_.w2.data(), s_.E);
    moe::cuda::permute_tokens(plan.plan(), in_.x.data(), f.x.data(), s_.D, stream_);
    moe::cuda::permute_tokens(plan.plan(), in_.dy.data(), f.d_out.data(), s_.D, stream_);
    f.poison_results();
    cublas_ffn_forward(h, CublasKind::batched, f, stream_);
    cublas_ffn_backward(h, CublasKind::batched, f, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    // Kept tokens must match exactly; weight gradients only when nothing was dropped.
    compare_with_oracle(name, f.out.data(), f.dx.data(), rows, slot_row, f.dw1.data(), f.dw2.data(), dropped == 0);
    Measurement& m = add_measurement(name, int64_t(rows), routed_rows() - dropped);
    m.capacity = C;
    time_forward_backward(m, [&] { cublas_ffn_forward(h, CublasKind::batched, f, stream_); },
                          [&] { cublas_ffn_backward(h, CublasKind::batched, f, stream_); });
  }

  Shape s_;
  Routing routing_;
  const ShapeInputs& in_;
  const Options& options_;
  moe::cuda::CublasHandle& cublas_;
  cudaStream_t stream_;
  Report& report_;
  std::string label_;
  std::vector<int> counts_;
  std::vector<int32_t> top_experts_host_;
  DeviceBuffer<int> top_experts_;  // [T, K]
  int max_count_ = 0;
  Oracle oracle_;
};

// ---------------------------------------------------------------------------------------------
// [SECTION] the layer over micro-batches (--micro-batches M)
// ---------------------------------------------------------------------------------------------
// Gradient accumulation (cuda/moe/moe_layer.h): M micro-batches of T tokens, each routed, run
// forward and backward (dx, the router) on its own, and the expert weight gradients computed once
// over all M*T*K rows (one DSᵀD and one DDS: MicroBatchTopology). Timed as the whole dropless layer
// (B = 128) through MoeLayerGpu: router, plan, topology, permute, experts, combine and their
// backward, so the work outside the expert FFN is in these times (lesson 03: 8-9% of the forward
// at D = 1024). The rows, all at M*T*K routed rows, the same useful FLOPs:
//   layer_micro_batches    M x (forward_micro_batch + backward_micro_batch), expert_weight_gradients
//   layer_per_micro_batch  M x (forward + backward), each micro-batch writing its own weight
//                          gradients: accumulating without the one product (less the M-1 additions)
//   layer_one_batch        the layer on one batch of M*T tokens (where it fits): no micro-batches
//   dense_cublas           the dense expert FFN on M*T*K rows: the baseline of the ratios
// "forward" is the M forwards alone. Routing: the counts rule (uniform, zipf, captured) on each
// micro-batch's T tokens, every micro-batch routed alike, imposed on the layer's own router through
// its input: token t's first E features are zero but at its K experts (1, 1 - 1/(4K), ...), and the
// gate weights are 8 times an E x E identity above zero rows, so the router's top-K is the rule's
// (checked); the other features are uniform in [-1, 1). Needs D >= E. The router losses are off
// (their coefficients change no time). Checked first: the one product's dW1, dW2 (experts 0 and
// E-1) against the sum of the per-micro-batch backward's, dWg (summed over the micro-batches, as a
// trainer does) and dx micro-batch by micro-batch, and layer_one_batch's dx against the
// micro-batches'. The timed step leaves each micro-batch's dWg in one buffer (no sum: a trainer's
// addition over its parameters is not the layer's).
class MicroBatchBench {
 public:
  MicroBatchBench(const Shape& shape, Routing routing, moe::Activation activation, const Options& options,
                  moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report)
      : s_(shape), routing_(routing), activation_(activation), M_(options.micro_batches), options_(options),
        cublas_(cublas), stream_(stream), report_(report),
        W1_(CublasFfn::w1_width(shape.H, activation)) {
    label_ = s_.name() + " M=" + std::to_string(M_) + " " + std::string(moe::bench::to_string(routing_)) + " " +
             std::string(moe::to_string(activation_));
    config_ = layer_config(s_, activation_, Formulation::dropless, 128);
    config_.aux_loss_coef = 0.0;
    config_.z_loss_coef = 0.0;
  }

  void run() {
    const std::vector<int> counts = moe::bench::routing_counts(
        int64_t(s_.T) * s_.K, s_.E, routing_,
        options_.captured ? options_.captured->tokens_per_expert : std::vector<double>{});
    top_experts_ = moe::bench::top_experts_from_counts(counts, s_.T, s_.K);
    std::printf("%s: max %d rows per expert in each of %d micro-batches (mean %.0f)\n", label_.c_str(),
                *std::max_element(counts.begin(), counts.end()), M_, double(s_.T) * s_.K / s_.E);
    if (s_.D < s_.E) {
      record_fact(label_ + " routing", false, "D < E: the routing cannot be imposed through the input");
      return;
    }
    const size_t tokens = size_t(M_) * s_.T, D = s_.D, E = s_.E, H = s_.H;
    const size_t inputs_bytes = tokens * D * (2 + 2 + 2 + 4) + E * D * (W1_ + H) * (2 + 4) + D * E * 6;
    if (!fits(inputs_bytes + size_t(moe::cuda::layer_memory_bytes(config_, M_)), label_ + " layer_micro_batches",
              report_)) {
      return;
    }
    inputs();
    moe::cuda::MoeLayerGpu layer(config_, M_);
    gathers_rows_ = layer.gathers_rows();
    if (!check(layer)) return;

    Measurement& one_product = add_measurement("layer_micro_batches");
    time_rows(one_product, [&] { forward_micro_batches(layer); }, [&] {
      for (int m = 0; m < M_; ++m) {
        layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
        layer.backward_micro_batch(m, x_of(m), weights(), dy_of(m), dx_of(m), d_gate_.data(), stream_);
      }
      layer.expert_weight_gradients(d_w1_table_.data(), d_w2_table_.data(), stream_);
    });
    Measurement& per_micro_batch = add_measurement("layer_per_micro_batch");
    time_rows(per_micro_batch, [&] {
      for (int m = 0; m < M_; ++m) layer.forward(x_of(m), weights(), y_of(m), stream_);
    }, [&] {
      for (int m = 0; m < M_; ++m) {
        layer.forward(x_of(m), weights(), y_of(m), stream_);
        layer.backward(x_of(m), weights(), dy_of(m), gradients(m), stream_);
      }
    });
    one_batch();
    dense();
  }

 private:
  moe::cuda::MoeLayerWeights weights() const { return {gate_.data(), w1_table_.data(), w2_table_.data()}; }
  size_t rows_of(int m) const { return size_t(m) * s_.T * s_.D; }  // micro-batch m's first element of [M*T, D]
  const bf16* x_of(int m) const { return x_.data() + rows_of(m); }
  const bf16* dy_of(int m) const { return dy_.data() + rows_of(m); }
  bf16* y_of(int m) { return y_.data() + rows_of(m); }
  float* dx_of(int m) { return dx_.data() + rows_of(m); }
  moe::cuda::MoeLayerGradients gradients(int m) {
    return {dx_of(m), d_gate_.data(), d_w1_table_.data(), d_w2_table_.data()};
  }
  void forward_micro_batches(moe::cuda::MoeLayerGpu& layer) {
    for (int m = 0; m < M_; ++m) layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
  }

  // The routing-carrying x, the gate weights that read it, random dy and expert weights.
  void inputs() {
    const size_t tokens = size_t(M_) * s_.T, D = s_.D, E = s_.E, H = s_.H, K = s_.K;
    std::vector<bf16> x(tokens * D), gate(D * E, __float2bfloat16(0.0f));
    const uint64_t key = splitmix64(options_.seed + 11);
    for (size_t i = 0; i < tokens; ++i) {
      const size_t t = i % size_t(s_.T);
      for (size_t d = 0; d < D; ++d) {
        const float unit = static_cast<float>(splitmix64(key ^ (i * D + d)) >> 40) * 0x1p-24f;
        x[i * D + d] = __float2bfloat16(d < E ? 0.0f : 2.0f * unit - 1.0f);
      }
      for (size_t k = 0; k < K; ++k) {
        x[i * D + size_t(top_experts_[t * K + k])] = __float2bfloat16(1.0f - 0.25f * float(k) / float(K));
      }
    }
    for (size_t e = 0; e < E; ++e) gate[e * E + e] = __float2bfloat16(8.0f);  // Wg [D, E]: row d = e
    x_ = DeviceBuffer<bf16>(x);
    gate_ = DeviceBuffer<bf16>(gate);
    dy_ = DeviceBuffer<bf16>(tokens * D);
    w1_ = DeviceBuffer<bf16>(E * D * W1_);
    w2_ = DeviceBuffer<bf16>(E * H * D);
    fill_uniform(dy_, 1.0f, options_.seed + 12);
    fill_uniform(w1_, 1.0f / std::sqrt(float(D)), options_.seed + 13);
    fill_uniform(w2_, 1.0f / std::sqrt(float(H)), options_.seed + 14);
    w1_table_ = moe::cuda::expert_pointer_table<const bf16>(w1_.data(), int(E), D * W1_);
    w2_table_ = moe::cuda::expert_pointer_table<const bf16>(w2_.data(), int(E), H * D);
    y_ = DeviceBuffer<bf16>(tokens * D);
    dx_ = DeviceBuffer<float>(tokens * D);
    d_gate_ = DeviceBuffer<float>(D * E);
    d_w1_ = DeviceBuffer<float>(E * D * W1_);
    d_w2_ = DeviceBuffer<float>(E * H * D);
    d_w1_table_ = moe::cuda::expert_pointer_table(d_w1_.data(), int(E), D * W1_);
    d_w2_table_ = moe::cuda::expert_pointer_table(d_w2_.data(), int(E), H * D);
  }

  void poison() {
    for (auto* buffer : {&dx_, &d_gate_, &d_w1_, &d_w2_}) buffer->fill_bytes(0xFF, stream_);
    y_.fill_bytes(0xFF, stream_);
  }

  // The one product against the per-micro-batch backward, summed on the host; the routing first.
  bool check(moe::cuda::MoeLayerGpu& layer) {
    const size_t D = s_.D, E = s_.E, K = s_.K, w1_elements = D * W1_, w2_elements = size_t(s_.H) * D;
    const std::vector<int> experts = E > 1 ? std::vector<int>{0, int(E) - 1} : std::vector<int>{0};
    poison();
    int64_t flips = 0;
    std::vector<float> one_product_gate(D * E, 0.0f);  // each micro-batch's router gradient, summed
    for (int m = 0; m < M_; ++m) {
      layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<int> top = layer.top_experts().download();
      for (size_t i = 0; i < size_t(s_.T) * K; ++i) flips += top[i] != top_experts_[i];
      layer.backward_micro_batch(m, x_of(m), weights(), dy_of(m), dx_of(m), d_gate_.data(), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<float> gate = d_gate_.download();
      for (size_t i = 0; i < gate.size(); ++i) one_product_gate[i] += gate[i];
    }
    layer.expert_weight_gradients(d_w1_table_.data(), d_w2_table_.data(), stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    record_fact(label_ + " layer routing is the counts rule", flips == 0,
                std::to_string(flips) + " slots of " + std::to_string(int64_t(M_) * s_.T * s_.K) + " differ");
    if (flips != 0) return false;
    one_product_dx_ = dx_.download();
    std::vector<std::vector<float>> one_product_w1, one_product_w2;
    for (int e : experts) {
      one_product_w1.push_back(expert_slice(d_w1_.data(), e, w1_elements));
      one_product_w2.push_back(expert_slice(d_w2_.data(), e, w2_elements));
    }
    // The same micro-batches, each with its own weight gradients, summed here in double.
    poison();
    std::vector<double> gate_sum(D * E, 0.0);
    std::vector<std::vector<double>> w1_sum(experts.size(), std::vector<double>(w1_elements, 0.0)),
        w2_sum(experts.size(), std::vector<double>(w2_elements, 0.0));
    for (int m = 0; m < M_; ++m) {
      layer.forward(x_of(m), weights(), y_of(m), stream_);
      layer.backward(x_of(m), weights(), dy_of(m), gradients(m), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<float> gate = d_gate_.download();
      for (size_t i = 0; i < gate.size(); ++i) gate_sum[i] += gate[i];
      for (size_t i = 0; i < experts.size(); ++i) {
        const std::vector<float> w1 = expert_slice(d_w1_.data(), experts[i], w1_elements);
        const std::vector<float> w2 = expert_slice(d_w2_.data(), experts[i], w2_elements);
        for (size_t j = 0; j < w1_elements; ++j) w1_sum[i][j] += w1[j];
        for (size_t j = 0; j < w2_elements; ++j) w2_sum[i][j] += w2[j];
      }
    }
    auto compare = [](const std::vector<float>& candidate, const std::vector<double>& reference) {
      Difference d;
      for (size_t i = 0; i < reference.size(); ++i) d.add(candidate[i], reference[i]);
      return d;
    };
    record_check(label_ + " dWg one product vs per micro-batch, summed", compare(one_product_gate, gate_sum));
    for (size_t i = 0; i < experts.size(); ++i) {
      const std::string e = std::to_string(experts[i]);
      record_check(label_ + " dW1[" + e + "] one product vs per micro-batch, summed",
                   compare(one_product_w1[i], w1_sum[i]));
      record_check(label_ + " dW2[" + e + "] one product vs per micro-batch, summed",
                   compare(one_product_w2[i], w2_sum[i]));
    }
    record_check(label_ + " dx micro-batches vs per micro-batch", compare_floats(one_product_dx_, dx_.download()));
    return std::all_of(g_checks.end() - (2 + 2 * experts.size()), g_checks.end(), [](const Check& c) { return c.pass; });
  }

  Measurement& add_measurement(const std::string& formulation) {
    Measurement m;
    m.shape = s_;
    m.routing = routing_;
    m.activation = activation_;
    m.formulation = formulation;
    m.micro_batches = M_;
    m.block_size = formulation == "dense_cublas" ? 0 : 128;
    m.gathers_rows = formulation != "dense_cublas" && gathers_rows_;
    m.useful_rows = m.computed_rows = int64_t(M_) * s_.T * s_.K;
    m.dropped_fraction = 0;
    report_.measurements.push_back(m);
    return report_.measurements.back();
  }

  // As RoutingBench::time_forward_backward: each phase announced as it starts (power_trace.py).
  void time_rows(Measurement& m, const std::function<void()>& forward, const std::function<void()>& step) {
    auto announce = [&](const char* phase) {
      std::printf("  timing %s %s\n", m.formulation.c_str(), phase);
      std::fflush(stdout);
    };
    announce("forward");
    m.forward = time_work(stream_, options_, forward);
    announce("forward+backward");
    m.forward_backward = time_work(stream_, options_, step);
    std::printf("  time  %-22s forward %8.3f ms   forward+backward %8.3f ms   (%d micro-batches)\n",
                m.formulation.c_str(), m.forward.median_ms, m.forward_backward.median_ms, M_);
    std::fflush(stdout);
  }

  // The layer on one batch of all M*T tokens (routed alike: the micro-batches side by side).
  void one_batch() {
    MoeConfig whole = config_;
    whole.tokens = int64_t(M_) * s_.T;
    if (!fits(size_t(moe::cuda::layer_memory_bytes(whole)), label_ + " layer_one_batch", report_)) return;
    moe::cuda::MoeLayerGpu layer(whole);
    const moe::cuda::MoeLayerGradients g = gradients(0);  // [M*T, D] from row 0
    poison();
    layer.forward(x_.data(), weights(), y_.data(), stream_);
    layer.backward(x_.data(), weights(), dy_.data(), g, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    record_check(label_ + " dx one batch vs micro-batches", compare_floats(dx_.download(), one_product_dx_));
    Measurement& m = add_measurement("layer_one_batch");
    time_rows(m, [&] { layer.forward(x_.data(), weights(), y_.data(), stream_); }, [&] {
      layer.forward(x_.data(), weights(), y_.data(), stream_);
      layer.backward(x_.data(), weights(), dy_.data(), g, stream_);
    });
  }

  // Dense cuBLAS on M*T*K rows, expert 0's weights for every row (checked in the formulations table).
  void dense() {
    const size_t rows = size_t(M_) * s_.T * s_.K;
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, activation_, 1), label_ + " dense_cublas", report_)) return;
    CublasFfn f(rows, s_.D, s_.H, activation_, ExpertGroups{{0}, {int(rows)}, {0}}, w1_.data(), w2_.data(), 1);
    fill_uniform(f.x, 1.0f, options_.seed + 15);
    fill_uniform(f.d_out, 1.0f, options_.seed + 16);
    cublasHandle_t h = cublas_.get();
    Measurement& m = add_measurement("dense_cublas");
    time_rows(m, [&] { cublas_ffn_forward(h, CublasKind::dense, f, stream_); }, [&] {
      cublas_ffn_forward(h, CublasKind::dense, f, stream_);
      cublas_ffn_backward(h, CublasKind::dense, f, stream_);
    });
  }

  Shape s_;
  Routing routing_;
  moe::Activation activation_;
  int M_;
  const Options& options_;
  moe::cuda::CublasHandle& cublas_;
  cudaStream_t stream_;
  Report& report_;
  size_t W1_;
  std::string label_;
  MoeConfig config_;
  bool gathers_rows_ = false;
  std::vector<int32_t> top_experts_;  // [T, K] every micro-batch's routing
  DeviceBuffer<bf16> x_, dy_, y_, gate_, w1_, w2_;  // [M*T, D] x3, [D, E], [E, D, W1], [E, H, D]
  DeviceBuffer<const bf16*> w1_table_, w2_table_;
  DeviceBuffer<float> dx_, d_gate_, d_w1_, d_w2_;  // [M*T, D], [D, E], [E, D, W1], [E, H, D]
  DeviceBuffer<float*> d_w1_table_, d_w2_table_;
  std::vector<float> one_product_dx_;  // [M*T, D] from the check
};

// ---------------------------------------------------------------------------------------------
// [SECTION] report
// ---------------------------------------------------------------------------------------------

// TFLOP/s from the useful rows, and the ratios to dense cuBLAS of the same shape and routing.
void finish_measurements(Report& report) {
  for (Measurement& m : report.measurements) {
    // 2 FLOPs per multiply-add over x W1 [D, W1] and hidden W2 [H, D]: W1 = H (GeLU) or 2H (SwiGLU).
    const double w1_columns = m.activation == moe::Activation::swiglu ? 2.0 * m.shape.H : double(m.shape.H);
    const double useful = 2.0 * double(m.useful_rows) * m.shape.D * (w1_columns + m.shape.H);
    m.forward_tflops = useful / m.forward.median_ms / 1e9;
    m.forward_backward_tflops = 3.0 * useful / m.forward_backward.median_ms / 1e9;
  }
  for (Measurement& m : report.measurements) {
    for (const Measurement& dense : report.measurements) {
      if (dense.formulation == "dense_cublas" && dense.shape.name() == m.shape.name() && dense.routing == m.routing &&
          dense.activation == m.activation && dense.micro_batches == m.micro_batches) {
        m.forward_vs_dense = m.forward_tflops / dense.forward_tflops;
        m.forward_backward_vs_dense = m.forward_backward_tflops / dense.forward_backward_tflops;
      }
    }
    if (m.activation == moe::Activation::gelu) continue;
    for (const Measurement& gelu : report.measurements) {
      if (gelu.activation == moe::Activation::gelu && gelu.formulation == m.formulation &&
          gelu.shape.name() == m.shape.name() && gelu.routing == m.routing && gelu.micro_batches == m.micro_batches) {
        m.forward_vs_gelu = m.forward_tflops / gelu.forward_tflops;
        m.forward_backward_vs_gelu = m.forward_backward_tflops / gelu.forward_backward_tflops;
      }
    }
  }
}

json shape_json(const Shape& s) { return {{"T", s.T}, {"D", s.D}, {"H", s.H}, {"E", s.E}, {"K", s.K}}; }

json report_json(const Report& report, const Options& options, cublasHandle_t cublas) {
  int device = 0, driver = 0, runtime = 0, cublas_version = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  CUBLAS_CHECK(cublasGetVersion(cublas, &cublas_version));
  json doc;
  doc["program"] = "moe_bench";
  doc["date_utc"] = utc_now("%Y-%m-%dT%H:%M:%SZ");
  doc["device"] = {{"name", prop.name},
                   {"compute_capability", prop.major * 10 + prop.minor},
                   {"multiprocessors", prop.multiProcessorCount},
                   {"global_memory_bytes", prop.totalGlobalMem},
                   {"l2_cache_bytes", prop.l2CacheSize}};
  doc["driver_version"] = driver;  // 13000 = 13.0
  doc["runtime_version"] = runtime;
  doc["cublas_version"] = cublas_version;
  doc["method"] = {{"warmup", options.warmup},
                   {"warmup_ms", options.warmup_ms},
                   {"repeat", options.repeat},
                   {"statistic", "median of CUDA-event times"},
                   {"timing", options.pipelined ? "pipelined" : "synced"},
                   {"seed", options.seed},
                   {"tolerance", kTolerance},
                   {"useful_flops", "2 * useful_rows * D * (W1 + H) forward, 3x that forward + backward; "
                                    "W1 = H (gelu), 2H (swiglu)"},
                   {"rows", options.rows == Options::Rows::layer      ? "layer"
                            : options.rows == Options::Rows::gathered ? "gathered"
                                                                      : "permuted"},
                   {"micro_batches", options.micro_batches},
                   {"stream_k", options.stream_k}, {"gradient_pairs", options.gradient_pairs},
                   {"block_row_pairs", options.pairs_everywhere ? "everywhere" : "rule"}};
  json results = json::array();
  for (const Measurement& m : report.measurements) {
    results.push_back({{"shape", shape_json(m.shape)},
                       {"routing", moe::bench::to_string(m.routing)},
                       {"activation", std::string(moe::to_string(m.activation))},
                       {"formulation", m.formulation},
                       {"micro_batches", m.micro_batches},
                       {"block_size", m.block_size},
                       {"gathers_rows", m.gathers_rows},
                       {"capacity", m.capacity},
                       {"computed_rows", m.computed_rows},
                       {"useful_rows", m.useful_rows},
                       {"dropped_fraction", m.dropped_fraction},
                       {"forward_ms", m.forward.median_ms},
                       {"forward_samples_ms", m.forward.samples_ms},
                       {"forward_tflops", m.forward_tflops},
                       {"forward_vs_dense", m.forward_vs_dense},
                       {"forward_backward_ms", m.forward_backward.median_ms},
                       {"forward_backward_samples_ms", m.forward_backward.samples_ms},
                       {"forward_backward_tflops", m.forward_backward_tflops},
                       {"forward_backward_vs_dense", m.forward_backward_vs_dense},
                       {"forward_vs_gelu", m.forward_vs_gelu},
                       {"forward_backward_vs_gelu", m.forward_backward_vs_gelu}});
  }
  doc["results"] = results;
  json overheads = json::array();
  for (const Overhead& o : report.overheads) {
    json steps = json::object();
    for (const auto& [name, ms] : o.step_ms) steps[name] = ms;
    overheads.push_back({{"shape", shape_json(o.shape)},
                         {"routing", moe::bench::to_string(o.routing)},
                         {"activation", std::string(moe::to_string(o.activation))},
                         {"steps_ms", steps},
                         {"total_ms", o.total_ms},
                         {"block_sparse_B128_forward_ms", o.ffn_forward_ms},
                         {"fused_router_ms", o.fused_router_ms},
                         {"share_of_forward_layer", o.share}});
  }
  doc["routing_overhead"] = overheads;
  json traces = json::array();
  for (const Trace& t : report.traces) {
    json kernels = json::array();
    for (const auto& k : t.summary.kernels) {
      kernels.push_back({{"name", k.name}, {"median_ms", k.median_ms}, {"median_gap_before_ms", k.median_gap_before_ms}});
    }
    traces.push_back({{"shape", shape_json(t.shape)},
                      {"routing", moe::bench::to_string(t.routing)},
                      {"activation", std::string(moe::to_string(t.activation))},
                      {"formulation", t.formulation},
                      {"phase", t.phase},
                      {"runs", t.summary.runs},
                      {"timed_median_ms", t.timed_median_ms},
                      {"median_span_ms", t.summary.median_span_ms},
                      {"sum_kernels_ms", t.summary.sum_kernels_ms},
                      {"sum_gaps_ms", t.summary.sum_gaps_ms},
                      {"kernels", kernels}});
  }
  if (!report.traces.empty()) doc["kernel_traces"] = traces;
  json checks = json::array();
  for (const Check& c : g_checks) {
    checks.push_back({{"name", c.name}, {"pass", c.pass}, {"relative_error", c.relative_error},
                      {"tolerance", c.tolerance}, {"compared", c.compared}, {"not_finite", c.not_finite},
                      {"note", c.note}});
  }
  doc["checks"] = checks;
  doc["skipped"] = report.skipped;
  if (options.captured) {
    doc["captured_routing"] = {{"run", options.captured->run}, {"step", options.captured->step},
                               {"layer", options.captured->layer},
                               {"tokens_per_expert", options.captured->tokens_per_expert},
                               {"max_over_mean", options.captured->max_over_mean}};
  }
  return doc;
}

void print_table(const Report& report) {
  std::printf("\nExpert FFN y = act(x W1) W2 (gelu; swiglu: silu(x W1_gate) * (x W1_up)), bf16; useful TFLOP/s "
              "(padding and dropped tokens count as zero; swiglu counts its 3 products), median of %s timed runs; "
              "vs gelu: a swiglu row over the gelu row of its shape, routing and formulation\n",
              report.measurements.empty() ? "the" : std::to_string(report.measurements[0].forward.samples_ms.size()).c_str());
  std::printf("%-32s %-8s %-6s %-18s %9s %8s %9s %8s %8s %8s %8s\n", "shape", "routing", "act", "formulation",
              "fwd TF/s", "vs dense", "f+b TF/s", "vs dense", "fwd/gelu", "f+b/gelu", "dropped");
  for (const Measurement& m : report.measurements) {
    char fwd_vs_gelu[16] = "-", fb_vs_gelu[16] = "-";
    if (m.forward_vs_gelu > 0) std::snprintf(fwd_vs_gelu, sizeof fwd_vs_gelu, "%.3f", m.forward_vs_gelu);
    if (m.forward_backward_vs_gelu > 0) std::snprintf(fb_vs_gelu, sizeof fb_vs_gelu, "%.3f", m.forward_backward_vs_gelu);
    const std::string shape = m.micro_batches > 1 ? m.shape.name() + " x" + std::to_string(m.micro_batches) : m.shape.name();
    std::printf("%-32s %-8s %-6s %-18s %9.0f %8.2f %9.0f %8.2f %8s %8s %7.1f%%\n", shape.c_str(),
                std::string(moe::bench::to_string(m.routing)).c_str(), std::string(moe::to_string(m.activation)).c_str(),
                m.formulation.c_str(), m.forward_tflops, m.forward_vs_dense, m.forward_backward_tflops,
                m.forward_backward_vs_dense, fwd_vs_gelu, fb_vs_gelu, 100.0 * m.dropped_fraction);
  }
  if (!report.overheads.empty()) {
    std::printf("\nOutside the expert FFN (router, losses, plan, topology, permute unless the SDD gathers, "
                "un-permute), forward:\n");
    std::printf("%-32s %-8s %-6s %10s %14s %8s\n", "shape", "routing", "act", "ms", "B128 FFN ms", "share");
    for (const Overhead& o : report.overheads) {
      std::printf("%-32s %-8s %-6s %10.3f %14.3f %7.1f%%\n", o.shape.name().c_str(),
                  std::string(moe::bench::to_string(o.routing)).c_str(), std::string(moe::to_string(o.activation)).c_str(),
                  o.total_ms, o.ffn_forward_ms, 100.0 * o.share);
    }
  }
  for (const Trace& t : report.traces) {
    std::printf("\nKernel trace, %s %s %s %s %s: %d runs back to back; median span %.3f ms (timed: %.3f) = kernels "
                "%.3f + GPU idle %.3f\n",
                t.shape.name().c_str(), std::string(moe::bench::to_string(t.routing)).c_str(),
                std::string(moe::to_string(t.activation)).c_str(), t.formulation.c_str(),
                t.phase.c_str(), t.summary.runs, t.summary.median_span_ms, t.timed_median_ms, t.summary.sum_kernels_ms,
                t.summary.sum_gaps_ms);
    for (const auto& k : t.summary.kernels) {
      std::printf("  %9.4f ms  gap before %7.4f ms  %s\n", k.median_ms, k.median_gap_before_ms, k.name.c_str());
    }
  }
  for (const std::string& s : report.skipped) std::printf("%s\n", s.c_str());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// [SECTION] main
// ---------------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
    moe::cuda::set_stream_k_tail(options.stream_k);
    moe::cuda::set_weight_gradient_pairs(options.gradient_pairs);
    moe::cuda::set_block_row_pairs_everywhere(options.pairs_everywhere);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "moe_bench: %s\n", error.what());
    return 2;
  }
  if (!moe::cuda::gpu_available()) {
    std::printf("FAIL no GPU: %s\n", moe::cuda::why_no_gpu().c_str());
    return 1;
  }
  Report report;
  try {
    cudaStream_t stream;
    // A blocking stream: the synchronous copies and memsets on the legacy default stream (uploads,
    // poisoning, downloads) stay ordered with the work on it.
    CUDA_CHECK(cudaStreamCreate(&stream));
    moe::cuda::CublasHandle cublas;
    cublas.set_stream(stream);
    for (const Shape& shape : options.shapes) {
      std::printf("== %s\n", shape.name().c_str());
      for (moe::Activation activation : options.activations) {
        const std::string what = shape.name() + " " + std::string(moe::to_string(activation));
        if (options.micro_batches > 0) {  // the layer over micro-batches: its own inputs, per routing
          for (Routing routing : options.routings) {
            if (routing == Routing::captured && int64_t(options.captured->tokens_per_expert.size()) != shape.E) continue;
            try {
              MicroBatchBench(shape, routing, activation, options, cublas, stream, report).run();
            } catch (const std::exception& error) {
              record_fact(what + " " + std::string(moe::bench::to_string(routing)) + " micro-batches", false,
                          std::string("threw: ") + error.what());
            }
            CUDA_CHECK(cudaStreamSynchronize(stream));
          }
          continue;
        }
        // Weights and token tensors for the shape, plus the smallest section (the exact-rows cuBLAS paths).
        const size_t rows = size_t(shape.T) * shape.K;
        if (!fits(ShapeInputs::bytes(shape, activation) + CublasFfn::bytes(rows, shape.D, shape.H, activation, shape.E),
                  what, report)) {
          continue;
        }
        const ShapeInputs inputs(shape, activation, options.seed);
        for (Routing routing : options.routings) {
          if (routing == Routing::captured && int64_t(options.captured->tokens_per_expert.size()) != shape.E) {
            std::printf("captured routing: E = %zu, this shape E = %d: not timed\n",
                        options.captured->tokens_per_expert.size(), shape.E);
            continue;
          }
          try {
            RoutingBench(shape, routing, inputs, options, cublas, stream, report).run();
          } catch (const std::exception& error) {  // e.g. a routing that cannot give K distinct experts
            record_fact(what + " " + std::string(moe::bench::to_string(routing)), false,
                        std::string("threw: ") + error.what());
          }
        }
        CUDA_CHECK(cudaStreamSynchronize(stream));
      }  // each shape's and activation's buffers are freed here, before the next allocates
    }
    finish_measurements(report);
    print_table(report);
    const json doc = report_json(report, options, cublas.get());
    const std::filesystem::path out(options.out);
    if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
    std::ofstream(out) << doc.dump(1) << "\n";
    std::printf("wrote %s\n", options.out.c_str());
    CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& error) {
    record_fact("moe_bench", false, std::string("stopped: ") + error.what());
  }
  const auto failed = std::count_if(g_checks.begin(), g_checks.end(), [](const Check& c) { return !c.pass; });
  double worst = 0;
  for (const Check& c : g_checks) worst = std::max(worst, c.relative_error);
  if (failed == 0 && !g_checks.empty()) {
    std::printf("PASS %zu checks, max_rel_err=%.1e tol=%.0e\n", g_checks.size(), worst, kTolerance);
    return 0;
  }
  std::printf("FAIL %ld of %zu checks failed (first: %s)\n", long(failed), g_checks.size(),
              failed ? std::find_if(g_checks.begin(), g_checks.end(), [](const Check& c) { return !c.pass; })->name.c_str()
                     : "no checks ran");
  return 1;
}
