// moe_layer_dump.cpp: runs one MoE layer on the GPU and on the CPU reference from the same inputs,
// prints how far apart they are, and writes every tensor as .npy (inputs, weights, routing, outputs,
// gradients, and the reference's) so a lesson, a notebook or numpy can look at them. The same
// directory is a run record (run.json + events.jsonl) the viewer opens: the routing, the topology,
// and the GPU timeline of --steps forward + backward passes, one span per phase (router, plan,
// dispatch, expert_compute, combine and their backward), timed with CUDA events.
//
// Build and run:  ./moe build && build/cuda/moe_layer_dump [--out runs/layer_dump] [--formulation F]
//                 [--tokens T] [--model-dim D] [--hidden-dim H] [--experts E] [--top-k K]
//                 [--block-size B] [--capacity-factor CF] [--activation gelu|swiglu] [--seed N]
//                 [--steps N] [--no-npy]
// Files: x, dy, gate_weights, w1 [E,D,W1] (W1 = H for GeLU, 2H for SwiGLU: gate columns, then up),
// w2 [E,H,D], top_experts [T,K] (int32), combine_weights,
// y, dx, d_gate_weights, d_w1, d_w2 (GPU), and ref_y, ref_dx, ref_d_gate_weights, ref_d_w1,
// ref_d_w2 (CPU reference, double rounded to float32). All float32 unless said.
// Ends with one verdict line, PASS when every relative error is under 2e-2 (bf16 arithmetic).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "command_line.h"              // CLI::App, parse_command_line, whole_number, finite_number
#include "core/bf16.h"                // to_bf16
#include "moe/block_sparse.h"         // expert_pointer_table
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/device_info.h"         // gpu_available, current_device
#include "init.h"                     // random_matrix, random_weights
#include "reference_cpu/moe_layer.h"  // moe::ref::moe_forward, moe_backward
#include "moe/moe_layer.h"            // MoeLayerGpu
#include "npy.h"                      // write_npy
#include "core/phase_timer.h"         // PhaseTimer
#include "program_exit.h"             // run_program, check_output_path
#include "bridge/reference_bridge.h"    // round_bf16
#include "run_record.h"               // RunWriter, span / routing / topology events

using namespace moe;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using moe::ref::Matrix;

namespace {

constexpr double kTolerance = 2e-2;

using cuda::round_bf16;  // reference_bridge.h
std::vector<float> floats(const Matrix& m) { return {m.data(), m.data() + m.size()}; }
std::vector<float> floats(const std::vector<Matrix>& ms) {
  std::vector<float> out;
  for (const Matrix& m : ms) out.insert(out.end(), m.data(), m.data() + m.size());
  return out;
}
std::vector<float> floats(const std::vector<bf16>& v) { return moe::cuda::to_float(v); }
double relative_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Bad usage found after the parse (the shape's rules): the message, then the flags (the config's
// checks name its fields, top_k (K); the usage beside them names the flag to change), exit 2.
[[noreturn]] void usage(const std::string& message, const CLI::App& app) {
  std::cerr << "moe_layer_dump: " << message << "\n" << app.help();
  std::exit(2);
}

int run(int argc, char** argv);

}  // namespace

// Every error that reaches here is a message for the user, never an abort: exit 1 for a failure
// while running (the GPU, writing the files); bad usage ends in usage() with exit 2.
int main(int argc, char** argv) {
  return moe::run_program("moe_layer_dump", [&] { return run(argc, argv); });
}

namespace {

int run(int argc, char** argv) {
  MoeConfig config;
  config.tokens = 512;
  config.model_dim = 256;
  config.hidden_dim = 512;
  config.num_experts = 8;
  config.top_k = 2;
  config.block_size = 64;
  config.capacity_factor = 1.25;
  config.renormalize = true;
  config.aux_loss_coef = 0.01;
  config.z_loss_coef = 0.001;
  std::filesystem::path out = "runs/layer_dump";
  uint64_t seed = 1;
  int steps = 3;
  bool write_tensors = true;
  std::string formulation, activation;
  CLI::App app{"moe_layer_dump: dumps one GPU MoE layer and its CPU reference as .npy", "moe_layer_dump"};
  app.add_option("--out", out, "run record and tensors directory")->capture_default_str();
  app.add_option("--formulation", formulation, "dropless (default), padded or dropping");
  app.add_option("--tokens", config.tokens, "T")->capture_default_str()->check(whole_number(1));
  app.add_option("--model-dim", config.model_dim, "D")->capture_default_str()->check(whole_number(1));
  app.add_option("--hidden-dim", config.hidden_dim, "H")->capture_default_str()->check(whole_number(1));
  app.add_option("--experts", config.num_experts, "E")->capture_default_str()->check(whole_number(1));
  app.add_option("--top-k", config.top_k, "K")->capture_default_str()->check(whole_number(1));
  app.add_option("--block-size", config.block_size, "B")->capture_default_str()->check(whole_number(1));
  app.add_option("--capacity-factor", config.capacity_factor, "CF of padded and dropping")->capture_default_str()
      ->check(finite_number());
  app.add_option("--activation", activation, "gelu (default) or swiglu");
  app.add_option("--seed", seed, "seed of the inputs and weights")->capture_default_str()->check(whole_number(0));
  app.add_option("--steps", steps, "training steps recorded")->capture_default_str()->check(whole_number(1));
  app.add_flag_callback("--no-npy", [&] { write_tensors = false; }, "write the run record only, no tensors");
  if (const std::optional<int> exit_status = parse_command_line(app, argc, argv)) return *exit_status;
  try {
    if (!formulation.empty()) config.formulation = parse_formulation(formulation);
    if (!activation.empty()) config.activation = parse_activation(activation);
    validate(config);
    // The dropless layer is block-sparse over whole B x B blocks of D and H (cuda/moe/block_sparse.cu);
    // say so here, before any GPU work, with the flags the user typed.
    const bool block_sparse = config.formulation == Formulation::dropless;
    if (block_sparse && config.model_dim % config.block_size != 0)
      throw UsageError("--model-dim " + std::to_string(config.model_dim) +
                       ": allowed: a positive multiple of --block-size " + std::to_string(config.block_size));
    if (block_sparse && config.hidden_dim % config.block_size != 0)
      throw UsageError("--hidden-dim " + std::to_string(config.hidden_dim) +
                       ": allowed: a positive multiple of --block-size " + std::to_string(config.block_size));
    check_output_path("--out", out / "run.json");  // the record and the tensors go there
  } catch (const std::exception& error) {  // validate()'s, the enum parsers' and the shape's messages
    usage(error.what(), app);
  }
  if (!cuda::gpu_available()) {
    std::cerr << "moe_layer_dump: needs a GPU (" << cuda::why_no_gpu() << ")\n";
    return kExitFailure;
  }
  const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
  const int64_t W1 = w1_columns(config);  // H, or 2H for SwiGLU

  // Inputs rounded to bf16 first, so the reference computes from exactly the values the GPU sees.
  std::mt19937_64 rng(seed);
  ref::MoeWeights weights = ref::random_weights(config, seed + 1);
  weights.gate_weights = round_bf16(weights.gate_weights);
  for (auto& w : weights.w1) w = round_bf16(w);
  for (auto& w : weights.w2) w = round_bf16(w);
  const Matrix x = round_bf16(ref::random_matrix(T, D, rng));
  const Matrix dy = round_bf16(ref::random_matrix(T, D, rng));

  // ---- GPU ----
  auto upload = [](const std::vector<float>& v) { return DeviceBuffer<bf16>(cuda::to_bf16(v)); };
  DeviceBuffer<bf16> x_gpu = upload(floats(x)), dy_gpu = upload(floats(dy));
  DeviceBuffer<bf16> gate_gpu = upload(floats(weights.gate_weights));
  DeviceBuffer<bf16> w1_gpu = upload(floats(weights.w1)), w2_gpu = upload(floats(weights.w2));
  DeviceBuffer<bf16> y_gpu(size_t(T * D));
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1_gpu.data(), int(E), size_t(D * W1));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2_gpu.data(), int(E), size_t(H * D));
  DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * W1)), d_w2(size_t(E * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * W1));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));

  RunInfo info;
  info.kind = RunKind::bench;
  info.name = "moe_layer_dump_" + std::string(to_string(config.formulation));
  info.moe_config = config;
  info.devices = {cuda::current_device().name};
  info.extra = {{"program", "moe_layer_dump"}, {"seed", seed}, {"steps", steps}};
  auto writer = RunWriter::create(out, info, OnExisting::overwrite);

  cuda::MoeLayerGpu layer(config);
  cuda::PhaseTimer timer;
  layer.set_phase_timer(&timer);
  const cuda::MoeLayerWeights w{gate_gpu.data(), w1_table.data(), w2_table.data()};
  // Each step: forward and backward on the same inputs (the first one includes cuBLAS's and the
  // kernels' first-launch costs, which is why a timeline shows it longer). Span start times are the
  // host clock at the step's start plus the GPU's own offsets within the step.
  for (int step = 0; step < steps; ++step) {
    const double step_start_us = writer.elapsed_us();
    layer.forward(x_gpu.data(), w, y_gpu.data(), nullptr);
    layer.backward(x_gpu.data(), w, dy_gpu.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                   nullptr);
    double layer_us = 0;
    for (const cuda::TimedPhase& phase : timer.collect()) {
      writer.append(to_event(SpanEvent{.step = step, .rank = 0, .stream = 0, .stream_name = "compute",
                                       .name = phase.name, .start_us = step_start_us + phase.start_us,
                                       .duration_us = phase.duration_us}));
      layer_us = phase.start_us + phase.duration_us;
    }
    writer.append(step_event(step, {{"aux_loss", layer.aux_loss().download()[0]},
                                    {"z_loss", layer.z_loss().download()[0]},
                                    {"layer_forward_backward_us", layer_us}}));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  {
    const std::vector<int> counts = layer.plan().tokens_per_expert.download();
    const std::vector<int> kept = layer.plan().kept_per_expert.download();
    RoutingEvent routing{.step = steps - 1, .layer = 0, .tokens_per_expert = {}, .dropped_per_expert = {},
                         .capacity = std::nullopt, .tokens_per_expert_by_genre = {}};
    for (size_t e = 0; e < counts.size(); ++e) {
      routing.tokens_per_expert.push_back(counts[e]);
      routing.dropped_per_expert.push_back(counts[e] - kept[e]);
    }
    if (config.formulation != Formulation::dropless) routing.capacity = capacity(config);
    writer.append(to_event(routing));
  }

  // ---- CPU reference ----
  const ref::LayerForward ref = ref::moe_forward(config, x, weights);
  const ref::LayerGradients ref_grad = ref::moe_backward(config, x, weights, ref, dy);

  // ---- compare and write ----
  std::map<std::string, std::pair<std::vector<float>, std::vector<float>>> compared = {
      {"y", {floats(y_gpu.download()), floats(ref.y)}},
      {"dx", {dx.download(), floats(ref_grad.x)}},
      {"d_gate_weights", {d_gate.download(), floats(ref_grad.gate_weights)}},
      {"d_w1", {d_w1.download(), floats(ref_grad.w1)}},
      {"d_w2", {d_w2.download(), floats(ref_grad.w2)}},
  };
  if (write_tensors) {
    write_npy(out / "x.npy", floats(x), {T, D});
    write_npy(out / "dy.npy", floats(dy), {T, D});
    write_npy(out / "gate_weights.npy", floats(weights.gate_weights), {D, E});
    write_npy(out / "w1.npy", floats(weights.w1), {E, D, W1});
    write_npy(out / "w2.npy", floats(weights.w2), {E, H, D});
    write_npy(out / "top_experts.npy", layer.top_experts().download(), {T, config.top_k});
    write_npy(out / "combine_weights.npy", layer.combine_weights().download(), {T, config.top_k});
  }
  if (ref.topology) {
    const ref::BlockSparseTopology& topology = *ref.topology;
    writer.append(to_event(TopologyEvent{
        .step = steps - 1, .layer = 0, .block_size = topology.block_size, .block_rows = topology.block_rows,
        .block_cols = topology.block_cols, .nnz = topology.nnz, .padding_rows = ref.plan.padding_rows,
        .rows_per_expert = std::vector<int64_t>(ref.plan.rows_per_expert.begin(), ref.plan.rows_per_expert.end())}));
  }
  const std::map<std::string, std::vector<int64_t>> shapes = {
      {"y", {T, D}}, {"dx", {T, D}}, {"d_gate_weights", {D, E}}, {"d_w1", {E, D, W1}}, {"d_w2", {E, H, D}}};
  bool pass = true;
  std::ostringstream verdict;
  for (const auto& [name, pair] : compared) {
    if (write_tensors) {
      write_npy(out / (name + ".npy"), pair.first, shapes.at(name));
      write_npy(out / ("ref_" + name + ".npy"), pair.second, shapes.at(name));
    }
    const double error = relative_error(pair.first, pair.second);
    pass = pass && error < kTolerance;
    verdict << " " << name << "=" << std::scientific << std::setprecision(1) << error;
  }
  std::cout << "moe_layer_dump: " << to_string(config.formulation) << " " << to_string(config.activation) << " T=" << T << " D=" << D << " H=" << H
            << " E=" << E << " K=" << config.top_k << " on " << cuda::current_device().name << "\n"
            << "wrote the run record" << (write_tensors ? " and .npy files" : "") << " to " << out.string() << "\n"
            << (pass ? "PASS" : "FAIL") << " GPU vs CPU reference, relative errors:" << verdict.str()
            << " tol=" << kTolerance << "\n";
  writer.append(to_event(VerdictEvent{.pass = pass, .message = "GPU vs CPU reference:" + verdict.str(),
                                      .step = std::nullopt}));
  return pass ? 0 : 1;
}

}  // namespace
