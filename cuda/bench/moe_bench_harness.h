// moe_bench_harness.h: the harness of moe_bench (cuda/bench/moe_bench.cpp), in the shape of
// nccl-tests' src/common.cu: the options, the random inputs, the timing loop (warm-up, repeats, the
// median), the checks against the reference path, and the report (table, JSON, verdict). Each
// variant (moe_bench_variants.h: the formulations table, the layer over micro-batches) says only
// what it runs and checks, and hands its rows to the Report here.
//
//   cmake --build build --target moe_bench && build/cuda/bench/moe_bench --help
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, C capacity,
// B block size, W1 = H (GeLU) or 2H (SwiGLU); rows = T*K routed slots, slot = t*K + k.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/kernel_trace.h"    // KernelTraceSummary (--kernel-trace)
#include "bench/routing_counts.h"  // Routing
#include "core/bf16.h"             // bf16
#include "core/cuda_check.h"       // CUDA_CHECK
#include "core/device_buffer.h"    // DeviceBuffer
#include "core/gemm.h"             // Op, CUBLAS_CHECK
#include "moe/block_sparse.h"      // expert_pointer_table
#include "moe_config.h"            // MoeConfig, Activation

namespace moe::bench {

using moe::Formulation;
using moe::MoeConfig;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::cuda::Op;
using json = nlohmann::json;

constexpr double kTolerance = 2e-2;  // relative Frobenius error, bf16 operands and activations
constexpr int kOracleCpuRows = 256;  // slots checked against the CPU reference on small shapes

// The columns of W1 (and of the pre-activation): H for GeLU, 2H for SwiGLU ([gate | up]).
inline int w1_width(int H, moe::Activation activation) { return activation == moe::Activation::swiglu ? 2 * H : H; }

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

inline const std::vector<Shape> kBaselineShapes = {  // the reference shapes: notebooks_data/bench/README.md, "Anchor figures and ceilings"
    {16384, 1024, 4096, 64, 1},
    {16384, 2048, 8192, 64, 2},
    {8192, 4096, 14336, 8, 2},
};
inline const Shape kSmallShape = {2048, 512, 1024, 8, 2};

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

// The flags (common/command_line.h); --help and a bad flag end the program here (exit 0 / 2).
// A value that is wrong only with the others (K > E, a run without routing) throws
// std::invalid_argument naming the flag.
Options parse_options(int argc, char** argv);

// ---------------------------------------------------------------------------------------------
// [SECTION] random inputs
// ---------------------------------------------------------------------------------------------

// A counter-based generator (splitmix64 of seed + index): element i gets the same value whatever the
// number of threads, so inputs are reproducible from the seed alone.
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale), rounded to bf16. Generated on the host in chunks by all cores and copied
// up: the largest tensor here (E*D*H = 1.07e9 values) takes about a second.
void fill_uniform(DeviceBuffer<bf16>& buffer, float scale, uint64_t seed);

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
Timing time_work(cudaStream_t stream, const Options& options, const std::function<void()>& work);

// "  timing NAME PHASE", flushed at once: a tool reading the output as it comes knows what the GPU
// is running (cuda/bench/power_trace.py samples the clock and power beside it).
void announce_timing(const std::string& formulation, const char* phase);

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

// Every check of the run is kept, in order, for the JSON and the verdict line.
void record_check(const std::string& name, const Difference& d);

void record_fact(const std::string& name, bool pass, const std::string& note);
const std::vector<Check>& recorded_checks();

inline float to_float(bf16 v) { return __bfloat162float(v); }

// Device rows [max_rows, cols] -> host rows in slot order; a slot without a row (slot_row = -1) stays NaN.
std::vector<bf16> rows_by_slot(const bf16* device_rows, size_t max_rows, int cols, const std::vector<int>& slot_row);

// Compares the slots where `present[s] >= 0` (a row exists in the candidate's layout).
Difference compare_slots(const std::vector<bf16>& candidate, const std::vector<bf16>& reference, int cols,
                         const std::vector<int>& present);

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

Difference compare_floats(const std::vector<float>& candidate, const std::vector<float>& reference);

// The grouped cuBLAS path's results in slot order: what every other formulation is compared with.
struct Oracle {
  std::vector<bf16> out;  // [T*K, D]
  std::vector<bf16> dx;   // [T*K, D] gradient of the permuted input
  std::vector<int> checked_experts;              // experts whose weight gradients are kept (non-empty)
  std::vector<std::vector<float>> dw1, dw2;      // per checked expert: [D, W1], [H, D]
};

// ---------------------------------------------------------------------------------------------
// [SECTION] measurements and the report
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
bool fits(size_t bytes, const std::string& what, Report& report);

// The tensors every formulation of a shape and activation shares. W1 = H (GeLU) or 2H (SwiGLU).
struct ShapeInputs {
  ShapeInputs(const Shape& s, moe::Activation activation_in, uint64_t seed)
      : activation(activation_in), W1(w1_width(s.H, activation)), x(size_t(s.T) * s.D), dy(x.size()),
        w1(size_t(s.E) * s.D * W1), w2(size_t(s.E) * s.H * s.D) {
    fill_uniform(x, 1.0f, seed + 1);
    fill_uniform(dy, 1.0f, seed + 2);  // the gradient arriving at each token's output
    fill_uniform(w1, 1.0f / std::sqrt(float(s.D)), seed + 3);  // keeps pre-activations O(1)
    fill_uniform(w2, 1.0f / std::sqrt(float(s.H)), seed + 4);
    w1_of = moe::cuda::expert_pointer_table<const bf16>(w1.data(), s.E, size_t(s.D) * W1);
    w2_of = moe::cuda::expert_pointer_table<const bf16>(w2.data(), s.E, size_t(s.H) * s.D);
  }
  static size_t bytes(const Shape& s, moe::Activation activation) {
    const size_t W1 = size_t(w1_width(s.H, activation));
    return (2 * size_t(s.T) * s.D + size_t(s.E) * s.D * (W1 + size_t(s.H))) * sizeof(bf16);
  }
  moe::Activation activation;
  int W1;
  DeviceBuffer<bf16> x, dy;   // [T, D]
  DeviceBuffer<bf16> w1, w2;  // [E, D, W1], [E, H, D]
  DeviceBuffer<const bf16*> w1_of, w2_of;
};

// ---------------------------------------------------------------------------------------------
// [SECTION] report
// ---------------------------------------------------------------------------------------------

// TFLOP/s from the useful rows, and the ratios to dense cuBLAS of the same shape and routing.
void finish_measurements(Report& report);

// The results file (its fields: notebooks_data/bench/README.md).
json report_json(const Report& report, const Options& options, cublasHandle_t cublas);

void print_table(const Report& report);

// The verdict line, PASS or FAIL over every recorded check; the program's exit status (0 or 1).
int verdict();

}  // namespace moe::bench
