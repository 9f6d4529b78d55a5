// moe_bench_harness.cpp: the options, inputs, timing, checks and report of moe_bench
// (see moe_bench_harness.h).
//   cmake --build build --target moe_bench
#include "moe_bench_harness.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "command_line.h"        // CLI::App, parse_command_line, whole_number, finite_number, one_of
#include "core/bench_support.h"  // utc_now
#include "core/clock_warm_up.h"  // warm_up_clock
#include "parse_number.h"        // parse_integer, parse_integer_list
#include "program_exit.h"        // check_output_path
#include "run_record.h"          // RunReader (--routing-from: a recorded run's routing)

namespace moe::bench {

using moe::cuda::utc_now;

namespace {

std::vector<Check> g_checks;  // every check of the run, in order; reported in the JSON and the verdict

json shape_json(const Shape& s) { return {{"T", s.T}, {"D", s.D}, {"H", s.H}, {"E", s.E}, {"K", s.K}}; }

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

}  // namespace

// A value that is more than a number (a shape, a choice) is read as text and turned into Options
// after the parse, so each flag's check and its help line stay together here.
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
      ->check(moe::finite_number(0, 600000));  // ten minutes at most
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

void announce_timing(const std::string& formulation, const char* phase) {
  std::printf("  timing %s %s\n", formulation.c_str(), phase);
  std::fflush(stdout);
}

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

Difference compare_slots(const std::vector<bf16>& candidate, const std::vector<bf16>& reference, int cols,
                         const std::vector<int>& present) {
  Difference d;
  for (size_t s = 0; s < present.size(); ++s) {
    if (present[s] < 0) continue;
    for (int c = 0; c < cols; ++c) d.add(to_float(candidate[s * cols + c]), to_float(reference[s * cols + c]));
  }
  return d;
}

Difference compare_floats(const std::vector<float>& candidate, const std::vector<float>& reference) {
  Difference d;
  for (size_t i = 0; i < reference.size(); ++i) d.add(candidate[i], reference[i]);
  return d;
}

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

const std::vector<Check>& recorded_checks() { return g_checks; }

int verdict() {
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

}  // namespace moe::bench
