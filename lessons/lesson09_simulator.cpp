// lesson09_simulator.cpp: Lesson 09, expert parallelism beyond the machine: moe_sim replays routing
// through a model of GPUs, NVLink and InfiniBand calibrated on two GPUs, checks itself against the
// runs that were measured, and then asks what happens at 8 to 1024 GPUs. Read lessons/09_simulator.md
// beside it.
//
// Build and run:  ./moe build && build/lessons/lesson09_simulator [--out runs/lesson09_simulator]
//                 [--calibration notebooks_data/sim/calibration_h200x2_2026-11-28.json]
//                 [--model-calibration notebooks_data/sim/calibration_h200x2_2026-11-29.json]
//
// Everything here is plain C++ and runs in seconds on any machine: the GPU measurements it stands
// on are in notebooks_data/bench/ (ep_bench's JSON) and the calibration made from them in
// notebooks_data/sim/. Every time a table prints beyond four GPUs is a prediction, not a measurement.
// Dimension legend: T tokens a GPU, D model width, H expert hidden width, E experts, K top-k,
// R GPUs, G GPUs a node, N nodes, d pipelining degree.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "command_line.h"         // CLI::App: the lesson's own flags
#include "lesson_support.h"       // options, Table, finish
#include "program_exit.h"         // run_program
#include "sim/calibration.h"      // load_calibration
#include "sim/cost_model.h"       // CostModel
#include "sim/lm_step.h"          // predict_language_model_step
#include "sim/routing_trace.h"    // read_routing_trace, parse_synthetic
#include "sim/sim_record.h"       // SimulatedRunRecord
#include "sim/simulate.h"         // simulate
#include "sim/validation.h"       // validate_against_measurements
#include "sim/worked_example.h"   // worked_example_calibration

using namespace moe;
using moe::lessons::Table;

namespace {

const char* kLesson = "lesson09_simulator";

// One simulated configuration, its median step over a few steps.
sim::Simulation run(const sim::Calibration& calibration, sim::Cluster cluster, sim::LayerSpec layer,
                    const std::string& routing, int64_t steps = 3) {
  sim::SimulationSpec spec;
  spec.cluster = cluster;
  spec.layer = layer;
  spec.steps = steps;
  spec.span_ranks = 0;
  spec.synthetic = sim::parse_synthetic(routing);
  return sim::simulate(spec, calibration);
}

sim::LayerSpec layer_of(int64_t tokens, int64_t ranks) {
  sim::LayerSpec layer;  // D = 2048, H = 8192, K = 2: the layer ep_bench measures
  layer.tokens_per_rank = tokens;
  layer.experts = 8 * ranks;
  return layer;
}

double ms(double us) { return std::round(us / 10.0) / 100.0; }
double percent(double share) { return std::round(share * 1000.0) / 10.0; }

}  // namespace

int main(int argc, char** argv) {
  std::string calibration_path = "notebooks_data/sim/calibration_h200x2_2026-11-28.json";
  std::string bench_dir = "notebooks_data/bench";
  std::string model_calibration_path = "notebooks_data/sim/calibration_h200x2_2026-11-29.json";
  const lessons::LessonOptions options =
      lessons::parse_options(argc, argv, kLesson, "runs/lesson09_simulator", [&](CLI::App& app) {
        app.add_option("--calibration", calibration_path, "the calibration the studies use")->capture_default_str();
        app.add_option("--bench-dir", bench_dir, "where the measured ep_bench files are")->capture_default_str();
        app.add_option("--model-calibration", model_calibration_path,
                       "a calibration holding the language model's step, plain and overlapped (section 3b)")
            ->capture_default_str();
      });
  return run_program(kLesson, [&] {
    MoeConfig config;  // the layer of the studies: 8 experts a GPU on 8 GPUs
    config.tokens = 16384;
    config.model_dim = 2048;
    config.hidden_dim = 8192;
    config.num_experts = 64;
    config.top_k = 2;
    RunWriter writer = lessons::create_lesson_run(options, kLesson, "09", config, {"CPU (moe_sim's model)"});
    const sim::Calibration calibration = sim::load_calibration(calibration_path);
    std::vector<std::string> failures;

    // ---- 1. The worked example: two GPUs, one step, numbers to add up by hand ----
    std::printf("\n== 1. Two GPUs, one step, by hand (sim/worked_example.h's round numbers) ==\n");
    {
      sim::SimulationSpec spec;
      spec.cluster = sim::Cluster{1, 2};
      spec.layer = sim::worked_example_layer(2);
      spec.steps = 1;
      spec.span_ranks = 1;
      std::vector<sim::SimSpan> spans;
      const sim::Simulation one = sim::simulate(spec, sim::worked_example_calibration(),
                                                [&](const sim::SimulatedStep& s) { spans = s.spans; });
      Table table("rank 0's step, worked example", {"operation", "stream", "start_us", "duration_us"});
      for (const sim::SimSpan& span : spans) {
        if (span.rank == 0) table.add_row({span.name, sim::stream_name(span.stream), span.start_us, span.duration_us});
      }
      lessons::show(writer, table);
      const double by_hand = 10 + 7 + 20 + 10 + 292.0 / 3 + 10 + 30 + 40 + 10 + 584.0 / 3 + 10 + 50 + 7 + 30 + 454;
      std::printf("by hand: route 10 + counts 7 + permute 20 + out 10 + experts 97.3 + back 10 + combine 30 + combine's\n"
                  "backward 40 + out 10 + experts 194.7 + back 10 + router 50 + all-reduce 7 + SGD 30 + unnamed 454 = %.1f us;\n"
                  "simulated: %.1f us, of which %.1f us the compute stream waits on exchanges\n",
                  by_hand, one.steps[0].step_us, one.steps[0].exposed_us);
      if (std::abs(one.steps[0].step_us - by_hand) > 1e-6) failures.push_back("the worked example differs from the sum by hand");
    }

    // ---- 2. Does the model predict what was measured? ----
    std::printf("\n== 2. The model against measured runs (calibration %s: %s, %s, up to %lld GPUs) ==\n",
                calibration_path.c_str(), calibration.device.c_str(), calibration.date.c_str(),
                static_cast<long long>(calibration.gpus_measured));
    sim::ValidationSummary validation;
    {
      std::vector<std::filesystem::path> files;
      // The measured runs of notebooks_data/sim/validation_h200x2_2026-11-28.txt: the language
      // model's benchmarks carry their timed step's routing, which its rows are predicted with.
      for (const char* name : {"ep_bench_calibrate_r1_h200x2_2026-11-28.json", "train_brown_step300_r1_h200x2_2026-11-28.json",
                               "ep_bench_calibrate_lm_layer_r2_h200x2_2026-11-28.json",
                               "ep_bench_exposed_lm_layer_r2_h200x2_2026-11-28.json",
                               "ep_bench_calibrate_r2_h200x2_2026-11-28.json", "ep_bench_exposed_r2_h200x2_2026-11-28.json",
                               "train_brown_step300_r2_h200x2_2026-11-28.json", "train_brown_step300_r2_h200x4_2026-11-28.json",
                               "ep_bench_overlap_r2_h200x2_2026-11-28.json", "ep_bench_overlap_lm_layer_r2_h200x2_2026-11-28.json",
                               "ep_bench_scaling_nccl_h200x4_2026-11-26.json", "ep_bench_exchange_nccl_h200x4_2026-11-26.json",
                               "ep_bench_exposed_r4_h200x4_2026-11-28.json", "ep_bench_exposed_lm_layer_r4_h200x4_2026-11-28.json",
                               "train_brown_step300_r4_h200x4_2026-11-28.json"}) {
        files.push_back(std::filesystem::path(bench_dir) / name);
      }
      const std::vector<sim::ValidationRow> rows = sim::validate_against_measurements(calibration, files);
      Table table("predicted against measured (ep_bench, moe_train_distributed, H200s)", {"what", "R", "measured_us", "predicted_us", "error_%", "role"});
      for (const sim::ValidationRow& row : rows) {
        if (row.calibration) continue;
        table.add_row({row.what, row.ranks, std::round(row.measured_us), std::round(row.predicted_us),
                       percent(row.error()), row.held_out ? "hold-out (4 GPUs)" : "predicted"});
      }
      lessons::show(writer, table);
      validation = sim::summarize(rows);
      std::printf("%lld predictions: median |error| %.1f%%, largest %.1f%% (dispatch + combine at 1 and 16 MiB is bound by the\n"
                  "hosts' launches and waits: the same row measured on two machines differs by up to 61%%)\n",
                  static_cast<long long>(validation.rows), 100 * validation.median_abs_error, 100 * validation.max_abs_error);
      // The studies below rest on the layer's step at d = 1: each of its predictions must hold to 5%.
      for (const sim::ValidationRow& row : rows) {
        if (!row.calibration && row.what == "ep_layer d=1" && std::abs(row.error()) > 0.05) {
          failures.push_back("the layer's step at d = 1 on " + std::to_string(row.ranks) + " GPUs is off by more than 5%");
        }
      }
    }

    // ---- 3. Weak scaling: 8 experts and 16384 tokens a GPU, nodes of 8 ----
    std::printf("\n== 3. Weak scaling of the layer's step (T=16384 a GPU, D=2048 H=8192, 8 experts a GPU, K=2, uniform) ==\n");
    const double one_gpu = run(calibration, {1, 1}, layer_of(16384, 1), "uniform").median_step_us();
    {
      Table table("weak scaling, simulated", {"GPUs", "nodes", "flat_ms", "flat_exposed_%", "2dh_ms", "efficiency_flat"});
      for (int64_t gpus : {8, 16, 64, 256, 1024}) {
        const sim::Cluster cluster{gpus / 8, 8};
        sim::LayerSpec layer = layer_of(16384, gpus);
        const sim::Simulation flat = run(calibration, cluster, layer, "uniform");
        layer.all_to_all = sim::AllToAllKind::hierarchical;
        const sim::Simulation two_d = run(calibration, cluster, layer, "uniform");
        table.add_row({gpus, cluster.nodes, ms(flat.median_step_us()), percent(flat.median_exposed_share()),
                       ms(two_d.median_step_us()), std::round(100 * one_gpu / flat.median_step_us()) / 100});
      }
      lessons::show(writer, table);
      std::printf("one GPU: %.2f ms. Inside a node NVLink keeps the step near it; past one node every exchange\n"
                  "crosses a 50 GB/s NIC and the exposed share grows.\n", one_gpu / 1e3);
    }

    // ---- 3b. Weak scaling of the language model's training step ----
    std::printf("\n== 3b. Weak scaling of the language model's step (throughput preset, 64 sequences a GPU, 16 experts a GPU\n"
                "       up to E = 1024, the most a model config holds: 4 a GPU on 256, 1 on 1024) ==\n");
    {
      const sim::Calibration lm = sim::load_calibration(model_calibration_path);
      const double one_gpu_ms = lm.language_model.step_ms;
      Table table("the language model's step, simulated (E = min(16 R, 1024))",
                  {"GPUs", "nodes", "E", "plain_ms", "overlapped_ms", "plain_efficiency", "overlap_gain_%"});
      double gain_at_64 = 0;
      for (int64_t gpus : {2, 8, 16, 64, 256, 1024}) {
        const sim::Cluster cluster = gpus <= 8 ? sim::Cluster{1, gpus} : sim::Cluster{gpus / 8, 8};
        const int64_t experts = std::min<int64_t>(16 * gpus, kMaxExperts);
        const double plain = sim::predict_language_model_step(lm, cluster, {.experts = experts}).step_ms;
        const double overlapped = sim::predict_language_model_step(lm, cluster, {.overlap = true, .experts = experts}).step_ms;
        const double gain = 1 - overlapped / plain;
        if (gpus == 64) gain_at_64 = gain;
        table.add_row({gpus, cluster.nodes, experts, std::round(plain * 100) / 100, std::round(overlapped * 100) / 100,
                       std::round(100 * one_gpu_ms / plain) / 100, percent(gain)});
      }
      lessons::show(writer, table);
      std::printf("one GPU: %.2f ms plain, %.2f ms overlapped (%s, %s). Each GPU keeps its 64 sequences and its\n"
                  "rows routed, so a perfect machine would hold the one-GPU step.\n",
                  one_gpu_ms, lm.language_model.overlapped_step_ms, lm.device.c_str(), lm.date.c_str());
      std::printf("Past one node the exchanges cross NICs and the overlap hides them behind the other half's work;\n"
                  "with one expert a GPU on 1024 every exchange has 1023 peers, each half pays each peer's fixed cost\n"
                  "again, and two micro-batches lose.\n");
      if (!(gain_at_64 > 0)) failures.push_back("two micro-batches did not shorten the language model's step on 64 GPUs");
    }

    // ---- 4. Where 2DH starts to pay: small batches, many nodes ----
    std::printf("\n== 4. Flat against 2DH at T=2048 tokens a GPU (small messages) ==\n");
    int64_t crossover = 0;
    {
      Table table("2DH against flat, simulated", {"nodes", "GPUs", "flat_ms", "2dh_ms", "2dh_speedup"});
      for (int64_t nodes : {2, 8, 16, 32, 64, 128}) {
        const sim::Cluster cluster{nodes, 8};
        sim::LayerSpec layer = layer_of(2048, cluster.ranks());
        const double flat = run(calibration, cluster, layer, "uniform").median_step_us();
        layer.all_to_all = sim::AllToAllKind::hierarchical;
        const double two_d = run(calibration, cluster, layer, "uniform").median_step_us();
        table.add_row({nodes, cluster.ranks(), ms(flat), ms(two_d), std::round(100 * flat / two_d) / 100});
        if (two_d < flat && crossover == 0) crossover = nodes;
      }
      lessons::show(writer, table);
      std::printf("2DH first wins at %lld nodes: a flat all-to-all pays a per-peer cost for each of R - G remote peers,\n"
                  "2DH for N - 1 (G x larger messages), at the price of a second exchange inside the node.\n",
                  static_cast<long long>(crossover));
      if (crossover == 0) failures.push_back("2DH never beat flat up to 128 nodes at T=2048");
    }

    // ---- 5. Stragglers: Zipf routing, and what a capacity factor wins back ----
    std::printf("\n== 5. Skewed routing on 64 GPUs (8 nodes): the busiest GPU sets the step ==\n");
    double dropless_zipf = 0, capped_zipf = 0, replicated_zipf = 0;
    {
      Table table("Zipf routing on 64 GPUs, simulated",
                  {"routing", "dropless_ms", "straggler", "cf_1.25_ms", "cf_1.0_ms", "replicas_1_ms", "straggler_1",
                   "replicas_2_ms", "straggler_2"});
      for (const char* routing : {"uniform", "zipf:0.5", "zipf:0.8", "zipf:1"}) {
        const sim::Cluster cluster{8, 8};
        sim::LayerSpec layer = layer_of(16384, 64);
        const sim::Simulation dropless = run(calibration, cluster, layer, routing);
        layer.capacity_factor = 1.25;
        const double cf125 = run(calibration, cluster, layer, routing).median_step_us();
        layer.capacity_factor = 1.0;
        const double cf1 = run(calibration, cluster, layer, routing).median_step_us();
        layer.capacity_factor = 0;  // dropless again, with 1 and 2 replicas of the hottest experts a GPU
        layer.redundant_slots = 1;
        const sim::Simulation one = run(calibration, cluster, layer, routing);
        layer.redundant_slots = 2;
        const sim::Simulation two = run(calibration, cluster, layer, routing);
        auto straggler = [](const sim::Simulation& s) { return std::round(100 * s.steps[0].straggler) / 100; };
        table.add_row({routing, ms(dropless.median_step_us()), straggler(dropless), ms(cf125), ms(cf1),
                       ms(one.median_step_us()), straggler(one), ms(two.median_step_us()), straggler(two)});
        if (std::string(routing) == "zipf:0.8") {
          dropless_zipf = dropless.median_step_us();
          capped_zipf = cf1;
          replicated_zipf = one.median_step_us();
        }
      }
      lessons::show(writer, table);
      std::printf("straggler: the busiest GPU's rows over the mean. A capacity factor caps it and drops the tokens\n"
                  "beyond it; replicas of the hot experts (EPLB, the layers' placement: 1 or 2 spare expert slots a GPU)\n"
                  "keep every token, at the price of more rows crossing the network and the replicas' gradients summed.\n");
      if (!(capped_zipf < dropless_zipf)) failures.push_back("capacity 1.0 did not shorten the Zipf step");
      if (!(replicated_zipf < dropless_zipf)) failures.push_back("a replica slot a GPU did not shorten the Zipf step");
    }

    // ---- 6. A recorded run's own routing, replayed ----
    const std::filesystem::path recorded = "notebooks_data/runs/train_throughput_preset_300steps";
    std::printf("\n== 6. The routing of a recorded training run (%s), replayed on 16 GPUs ==\n", recorded.c_str());
    {
      sim::SimulationSpec spec;
      spec.cluster = sim::Cluster{1, 16};
      spec.layer = layer_of(16384, 1);
      spec.layer.model_dim = 512;  // the throughput preset's layer: D = 512, H = 1024, E = 16, K = 2
      spec.layer.hidden_dim = 1024;
      spec.layer.experts = 16;
      spec.trace = sim::read_routing_trace(recorded);
      spec.steps = static_cast<int64_t>(spec.trace->steps().size());
      spec.span_ranks = 0;
      const sim::Simulation replay = sim::simulate(spec, calibration);
      spec.blocks = static_cast<int64_t>(spec.trace->loads.size()) / spec.steps;  // the recorded MoE blocks a step
      spec.trace.reset();
      const double uniform = sim::simulate(spec, calibration).median_step_us();
      Table table("recorded routing on 16 GPUs, simulated (one step = all 8 MoE blocks)", {"trace_step", "step_ms", "straggler", "vs_uniform"});
      const std::vector<int64_t> steps = sim::read_routing_trace(recorded).steps();
      for (size_t i = 0; i < replay.steps.size(); ++i) {
        table.add_row({steps[i], ms(replay.steps[i].step_us), std::round(100 * replay.steps[i].straggler) / 100,
                       std::round(100 * replay.steps[i].step_us / uniform) / 100});
      }
      lessons::show(writer, table);
    }

    // ---- 7. A simulated run for the viewer ----
    const std::filesystem::path picture = options.out.parent_path() / "lesson09_simulated_64gpus_zipf";
    {
      sim::SimulationSpec spec;
      spec.cluster = sim::Cluster{8, 8};
      spec.layer = layer_of(16384, 64);
      spec.steps = 10;
      spec.synthetic = sim::parse_synthetic("drift:0.8:3");
      sim::SimulatedRunRecord record(picture, spec, calibration_path, calibration, kLesson, /*overwrite=*/true);
      sim::simulate(spec, calibration, [&](const sim::SimulatedStep& s) { record.append(s); });
      std::printf("\nA simulated run of 64 GPUs (Zipf 0.8 whose hot experts drift) is in %s: the viewer shows it marked\n"
                  "SIMULATED (build/viewer/moe_viewer %s --panel alltoall).\n", picture.c_str(), picture.c_str());
    }

    char message[448];
    std::snprintf(message, sizeof message,
                  "worked example == sum by hand: %s; the layer's step at d=1 within 5%% on 2 and 4 GPUs: %s; "
                  "%lld predictions of measured runs, median |error| %.1f%%; "
                  "2DH beats flat from %lld nodes at T=2048; Zipf 0.8 on 64 GPUs %.1f ms dropless, %.1f ms at cf 1.0, "
                  "%.1f ms with a replica slot a GPU",
                  failures.empty() || failures.front().find("worked") == std::string::npos ? "yes" : "no",
                  std::none_of(failures.begin(), failures.end(), [](const std::string& f) { return f.find("d = 1") != std::string::npos; }) ? "yes" : "no",
                  static_cast<long long>(validation.rows), 100 * validation.median_abs_error, static_cast<long long>(crossover),
                  dropless_zipf / 1e3, capped_zipf / 1e3, replicated_zipf / 1e3);
    for (const std::string& failure : failures) std::printf("FAILED CHECK: %s\n", failure.c_str());
    return lessons::finish_lesson(writer, kLesson, options, failures.empty(), message);
  });
}
