// lesson06_expert_parallelism.cpp: Lesson 06, expert parallelism (FastMoE). Different ranks hold
// different experts: each rank routes its own tokens, the ranks exchange the R x E counts, send the
// token rows to the experts' ranks (all-to-all-v), compute their local experts, send the results
// back and combine. This program runs that protocol on CPU ranks and prints what moves where, so
// that the exchange a GPU layer hides in one call can be read table by table and checked against
// the single-device layer. Read lessons/06_expert_parallelism.md beside it.
//
// Build and run (needs MPI; as root OpenMPI also wants --allow-run-as-root):
//   ./moe build && mpirun --oversubscribe -np 4 build/lessons/lesson06_expert_parallelism [--out runs/lesson06_expert_parallelism]
//   build/lessons/lesson06_expert_parallelism        (one rank: the same protocol, nothing travels)
//   mpirun --oversubscribe -np 2 build/lessons/lesson06_expert_parallelism --gpu [--backend auto|nccl|mpi]
//                    (the same layer on GPU ranks, distributed/ep/expert_parallel_gpu.h, checked against
//                    the CPU reference; writes runs/lesson06_expert_parallelism_gpu)
// --collective-timeout S (default 30): a rank that died or stopped ends the job after S seconds with
// a line naming the collective (distributed_lesson_support.h; test: ctest -R StoppedRank).
//
// The layer is distributed/ep/expert_parallel_cpu.h (Eigen, double), checked against the
// single-device layer reference_cpu/moe_layer.h on all tokens. Rank 0 prints the tables and the
// verdict and writes the run record. Dimension legend: T tokens (all ranks), T_r per rank,
// D model width, H expert hidden width, E experts, E_r = E / R per rank, K top-k, C capacity,
// B block size, R ranks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <optional>
#include <span>
#include <sstream>
#include <tuple>

#include "comm/mpi_communicator.h"       // MpiEnvironment, MpiCommunicator
#include "distributed_lesson_support.h"  // Shard, LessonData, RankOutput, RankFlags, run_gpu_path
#include "ep/expert_parallel_cpu.h"      // expert_parallel_forward / backward, local_weights
#include "lesson_support.h"              // options, Table, load_stats
#include "reference_cpu/moe_layer.h"     // moe_forward, moe_backward: the oracle
#ifdef MOE_LESSON_HAS_CUDA
#include "distributed_lesson_gpu.h"  // start_gpu_lesson, GpuLessonLayer, check_against_reference
#endif

using namespace moe;
using moe::lessons::Shard;
using moe::lessons::Table;

namespace {

constexpr const char* kName = "lesson06_expert_parallelism";
constexpr double kTolerance = 1e-10;  // double precision: only the order of sums differs
constexpr int64_t kBf16Bytes = 2;     // what a GPU layer sends per element

// Figures measured on the GPU machines (notebooks_data/bench/README.md, "Anchor figures and
// ceilings"): all-to-all on two H200s over NVLink (PyTorch + NCCL 2.28), 2026-11-24: busbw
// 176 GB/s at 64 MiB per rank, 249 GB/s at 256 MiB.
constexpr double kBusbw64MiB = 176e9, kBusbw256MiB = 249e9;  // bytes/s

// Sums of squares on this rank; relative() gives the Frobenius relative error of a tensor sharded
// over the ranks (collective).
struct ErrorSum {
  double difference = 0, reference = 0;
  void add(const ref::Matrix& actual, const ref::Matrix& expected) {
    difference += (actual - expected).squaredNorm();
    reference += expected.squaredNorm();
  }
  double relative(dist::Communicator& comm) const {
    std::vector<double> sums{difference, reference};
    dist::all_reduce_sum<double>(comm, sums);
    return sums[1] > 0 ? std::sqrt(sums[0] / sums[1]) : std::sqrt(sums[0]);
  }
};

struct LayerRun {
  dist::ExpertParallelForward forward;
  std::vector<int64_t> dispatch_rows;  // [R, R] rows rank s sends rank t (the whole exchange)
  double error = 0;                    // y and aux loss against the single-device layer
};

// The expert-parallel forward on this rank's shard, and its error against the single-device layer
// on all T tokens (every rank computes the reference; it is small). Collective.
// `placement`: where the experts live; nullptr, E / R a rank in id order.
LayerRun run_layer(dist::Communicator& comm, const MoeConfig& config, const ref::Matrix& x,  // [T, D]
                   const ref::MoeWeights& weights, const Shard& shard,
                   const dist::ExpertPlacement* placement = nullptr) {
  LayerRun run;
  dist::ExpertParallelOptions options;
  options.placement = placement;
  run.forward = dist::expert_parallel_forward(
      comm, config, x.middleRows(shard.offset, shard.tokens),
      placement ? dist::local_weights(config, weights, shard.rank, *placement)
                : dist::local_weights(config, weights, shard.rank, shard.ranks),
      options);
  run.dispatch_rows = dist::all_gather<int64_t>(comm, run.forward.chunks[0].send_rows);
  const ref::LayerForward reference = ref::moe_forward(config, x, weights);
  ErrorSum y;
  y.add(run.forward.y, reference.y.middleRows(shard.offset, shard.tokens));
  const double aux_error = std::abs(run.forward.aux_loss - reference.aux_loss) / reference.aux_loss;
  run.error = std::max(y.relative(comm), aux_error);
  return run;
}

// Column sums of an [R, R] matrix: what each rank receives (its own rows included).
std::vector<int64_t> received(const std::vector<int64_t>& matrix, int ranks) {
  std::vector<int64_t> sums(ranks, 0);
  for (int s = 0; s < ranks; ++s)
    for (int t = 0; t < ranks; ++t) sums[t] += matrix[s * ranks + t];
  return sums;
}

double max_over_mean(const std::vector<int64_t>& values) {
  double sum = 0, most = 0;
  for (int64_t v : values) sum += static_cast<double>(v), most = std::max(most, static_cast<double>(v));
  return sum > 0 ? most * static_cast<double>(values.size()) / sum : 1.0;
}

// "a b c"; scaled values with one decimal.
std::string joined(const std::vector<int64_t>& values, double scale = 1.0) {
  std::ostringstream out;
  if (scale != 1.0) out << std::fixed << std::setprecision(1);
  for (size_t i = 0; i < values.size(); ++i) out << (i ? " " : "") << static_cast<double>(values[i]) * scale;
  return out.str();
}

// Slots routed to each expert over all ranks: [R, E] -> [E].
std::vector<int64_t> expert_loads(const std::vector<int64_t>& per_rank_expert, int ranks, int64_t experts) {
  std::vector<int64_t> loads(experts, 0);
  for (int r = 0; r < ranks; ++r)
    for (int64_t e = 0; e < experts; ++e) loads[e] += per_rank_expert[r * experts + e];
  return loads;
}

std::vector<int32_t> as_int32(const std::vector<int64_t>& v) {
  std::vector<int32_t> out;
  for (int64_t n : v) out.push_back(static_cast<int32_t>(n));
  return out;
}

struct Replay {
  double duration_us = 0;  // the slowest rank's
  double started_us = 0;   // on this rank, after the call began (past the barrier)
  bool intact = true;      // on every rank
};

// One exchange again, alone and timed: the same rows as bf16 (D * 2 bytes a row, what a GPU layer
// sends) over the same communicator, into a NaN-filled buffer, every element checked on arrival.
// The time is that of MPI over shared memory on this machine, not of a GPU interconnect. Collective.
Replay replay_bf16(dist::Communicator& comm, const std::vector<int64_t>& send_rows,
                   const std::vector<int64_t>& recv_rows, int64_t D) {
  const int R = comm.size();
  std::vector<int64_t> send_counts(R), recv_counts(R);
  for (int p = 0; p < R; ++p) send_counts[p] = send_rows[p] * D, recv_counts[p] = recv_rows[p] * D;
  const auto send_offsets = dist::exclusive_prefix_sum(send_counts);
  const auto recv_offsets = dist::exclusive_prefix_sum(recv_counts);
  constexpr uint16_t kNan = 0x7FC0, kOne = 0x3F80;  // bf16 bit patterns; rank r sends 1.0 + r ulp
  std::vector<uint16_t> send(send_offsets[R - 1] + send_counts[R - 1], static_cast<uint16_t>(kOne + comm.rank()));
  std::vector<uint16_t> recv(recv_offsets[R - 1] + recv_counts[R - 1], kNan);
  const auto called = std::chrono::steady_clock::now();
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  comm.all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets,
                    dist::DataType::bfloat16);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  int32_t intact = 1;
  for (int p = 0; p < R; ++p)
    for (int64_t i = 0; i < recv_counts[p]; ++i) intact &= recv[recv_offsets[p] + i] == kOne + p;
  Replay replay;
  replay.started_us = std::chrono::duration<double, std::micro>(start - called).count();
  for (double d : dist::all_gather<double>(comm, us)) replay.duration_us = std::max(replay.duration_us, d);
  for (int32_t ok : dist::all_gather<int32_t>(comm, intact)) replay.intact = replay.intact && ok;
  return replay;
}

std::vector<std::vector<int64_t>> square(const std::vector<int64_t>& matrix, int ranks, int64_t scale,
                                         bool transpose = false) {
  std::vector<std::vector<int64_t>> rows(ranks, std::vector<int64_t>(ranks));
  for (int s = 0; s < ranks; ++s)
    for (int t = 0; t < ranks; ++t) rows[s][t] = scale * (transpose ? matrix[t * ranks + s] : matrix[s * ranks + t]);
  return rows;
}

// The dispatch [R, R] (rows rank s sends rank t) in bytes: a row a rank, what each sent, and last
// what each received.
Table dispatch_table(const std::string& title, const std::vector<int64_t>& dispatch, int R, int64_t row_bytes) {
  std::vector<std::string> columns{"from \\ to"};
  for (int t = 0; t < R; ++t) columns.push_back("rank " + std::to_string(t));
  columns.push_back("sent");
  Table table(title, columns);
  for (int s = 0; s < R; ++s) {
    std::vector<nlohmann::json> row{"rank " + std::to_string(s)};
    int64_t sent = 0;
    for (int t = 0; t < R; ++t) row.push_back(dispatch[s * R + t] * row_bytes), sent += dispatch[s * R + t];
    row.push_back(sent * row_bytes);
    table.add_row(row);
  }
  std::vector<nlohmann::json> last{"received"};
  for (int64_t n : received(dispatch, R)) last.push_back(n * row_bytes);
  last.push_back("");
  table.add_row(last);
  return table;
}

// ---- the lesson's layer ----

MoeConfig lesson_config() {
  return MoeConfig{.tokens = 4096,     // T, all ranks together
                   .model_dim = 64,    // D
                   .hidden_dim = 128,  // H
                   .num_experts = 16,  // E
                   .top_k = 2,         // K
                   .formulation = Formulation::dropless,
                   .block_size = 16,  // B
                   .aux_loss_coef = 0.01,
                   .z_loss_coef = 1e-3};
}

// ---- the GPU path (--gpu) ----

#ifdef MOE_LESSON_HAS_CUDA
constexpr int kWarmup = 3, kTimed = 10;  // steps of each GPU run

// ---- G1. the count exchange, as the GPU layer saw it ----
void show_gpu_dispatch(lessons::RankOutput& out, const lessons::GpuLayerRun& full, int R, const MoeConfig& config) {
  const int64_t E = config.num_experts, E_r = E / R;
  const std::vector<int64_t>& kept = full.step.kept_per_rank_expert;  // [R, E] on every rank
  std::vector<int64_t> dispatch(static_cast<size_t>(R) * R, 0);      // rows rank s sends rank t
  for (int s = 0; s < R; ++s)
    for (int64_t e = 0; e < E; ++e) dispatch[s * R + e / E_r] += kept[s * E + e];
  out.show(dispatch_table(
      "Table G1: the GPU layer's dispatch, bytes rank s (row) sends rank t (column), from its count exchange",
      dispatch, R, config.model_dim * kBf16Bytes));
}

// ---- G2. where the time goes ----
void show_gpu_time(lessons::RankOutput& out, const lessons::GpuLayerRun& full, const lessons::GpuLayerRun& exchange,
                   int64_t row_bytes) {
  const double step_ms = full.forward_ms + full.backward_ms;
  const double experts_ms = std::max(0.0, full.forward_ms - exchange.forward_ms);
  Table table("Table G2: where a step's time goes, the slowest rank's median of " + std::to_string(kTimed) +
                  " steps (CUDA events on the rank's stream)",
              {"part", "ms", "share of the step", "host waits"});
  table.add_row({"forward: route, count exchange, dispatch, experts, combine", full.forward_ms,
                 full.forward_ms / step_ms, full.step.host_synchronisations});
  table.add_row({"  the exchange alone (identity experts: route, counts, dispatch, combine)", exchange.forward_ms,
                 exchange.forward_ms / step_ms, exchange.step.host_synchronisations});
  table.add_row({"  the experts (forward minus the exchange alone)", experts_ms, experts_ms / step_ms, ""});
  table.add_row({"backward: combine, rows out, experts, rows back, router", full.backward_ms,
                 full.backward_ms / step_ms, full.step.backward_host_synchronisations});
  out.show(table);
  const double bytes = 2.0 * static_cast<double>(full.step.rows_sent * row_bytes);  // out and back
  std::ostringstream text;
  text << std::setprecision(3) << "  This rank sent " << full.step.rows_sent << " rows (" << bytes / 2
       << " bytes) and got as many back; the exchange alone moves them at " << bytes / (exchange.forward_ms * 1e6)
       << " GB/s including routing, the count exchange and the layout kernels. The one host wait of a\n"
          "  forward over NCCL is the count read-back (FastMoE's); over MPI each exchange waits twice more.\n";
  out.say(text.str());
}

// ---- G3. the check against the CPU reference ----
void show_gpu_check(lessons::RankOutput& out, const lessons::ReferenceCheck& check, double aux_error, int64_t T) {
  Table table("Table G3: the GPU layer against the CPU reference on all T tokens (double, the same bf16 inputs)",
              {"tensor", "rel err", "tol"});
  table.add_row({"y", check.y_error, lessons::kGpuTolerance});
  table.add_row({"dx", check.dx_error, lessons::kGpuTolerance});
  table.add_row({"aux loss", aux_error, lessons::kGpuTolerance});
  table.add_row({"tokens routed otherwise (near-ties, left out above)", check.routed_otherwise, T / 100});
  out.show(table);
}

// ---- G4. the straggler on GPUs, and replicas of the hot experts (section 7) ----
// The same step under uniform routing (the random tokens) and under the zipf text's, each expert
// placed E / R in id order, then the zipf text with EPLB's replicas planned from its own counts:
// the rows each rank's experts compute, the step's time, and each run against the CPU reference.
// Returns the worst relative error (y and dx) and whether every run passed. Collective.
std::pair<double, bool> show_gpu_straggler(dist::Communicator& comm, lessons::RankOutput& out,
                                           lessons::GpuRanks& ranks, const MoeConfig& config,
                                           const lessons::LessonData& data, lessons::GpuLessonLayer& zipf,
                                           const lessons::GpuLayerRun& zipf_plain, const ref::LayerForward& reference,
                                           const ref::LayerGradients& gradients, const Shard& shard) {
  const int R = comm.size();
  const int64_t E = config.num_experts, T = config.tokens;
  Table table("Table G4: the straggler on GPUs, and replicas of the hot experts (forward + backward, the slowest "
              "rank's median of " + std::to_string(kTimed) + " steps)",
              {"routing, placement", "rows each rank computes", "max/mean", "step ms", "rel err vs CPU (y, dx)"});
  double worst = 0;
  bool pass = true;
  auto add = [&](const std::string& name, const lessons::GpuLayerRun& run, const ref::LayerForward& want,
                 const ref::LayerGradients& want_grads) {
    const lessons::ReferenceCheck check =
        lessons::check_against_reference(comm, run, want, &want_grads, shard.offset, shard.tokens, config.top_k);
    const std::vector<int64_t> rows = dist::all_gather<int64_t>(comm, run.step.rows_received);
    const double error = std::max(check.y_error, check.dx_error);
    worst = std::max(worst, error);
    pass = pass && check.pass(T);
    table.add_row({name, joined(rows), max_over_mean(rows), run.forward_ms + run.backward_ms, error});
  };
  {  // uniform: the random tokens, on a layer of their own
    const ref::LayerForward uniform_reference = ref::moe_forward(config, data.random_x, data.weights);
    const ref::LayerGradients uniform_gradients =
        ref::moe_backward(config, data.random_x, data.weights, uniform_reference, data.dy);
    lessons::GpuLessonLayer uniform(ranks, comm, config, data.random_x, data.dy, data.weights, shard.offset,
                                    shard.tokens);
    add("uniform (random tokens), E / R in id order", uniform.run({}, kWarmup, kTimed), uniform_reference,
        uniform_gradients);
  }
  add("zipf text, E / R in id order", zipf_plain, reference, gradients);
  const std::vector<int64_t> counts = expert_loads(zipf_plain.step.routed_per_rank_expert, R, E);
  const std::vector<double> load(counts.begin(), counts.end());
  std::vector<dist::ExpertPlacement> placements;
  for (int64_t redundant : {1, 2}) {
    if (R > 1 && redundant <= E - E / R) {
      placements.push_back(dist::eplb_placement(load, R, redundant));
      add("zipf text, EPLB S=" + std::to_string(redundant), zipf.run({.placement = &placements.back()}, kWarmup, kTimed),
          reference, gradients);
    }
  }
  out.show(table);
  out.say("  The same routing as Table 4: under the zipf text the busiest rank's experts compute the most rows,\n"
          "  and every rank waits for it at the combine. EPLB's replicas (section 7) even the rows out; each\n"
          "  replica holds its expert's weights and their gradients are summed. At this size a step is a\n"
          "  few launches, so the rows even out more than the times do; ep_bench --placements shows the\n"
          "  same at full size (distributed/measured.md).\n");
  return {worst, pass};
}

// The lesson's layer on GPU ranks (distributed/ep/expert_parallel_gpu.h, bf16), checked against the CPU
// reference on all tokens (double, from the same bf16 values), then what the GPU run measured: the
// count exchange's matrix, the bytes each rank moves, and where the time goes. Collective; returns
// the exit code.
int run_on_gpu(dist::MpiCommunicator& world, const lessons::LessonOptions& options, const lessons::RankFlags& flags,
               MoeConfig config, const Shard& shard) {
  // The GPU's block-sparse kernels tile by B = 64 or 128 (D, H multiples of B): the lesson's B = 16
  // becomes 64. Dropless, B only sets the padding rows: y and every gradient are the same.
  config.block_size = 64;
  auto start = lessons::start_gpu_lesson(world, flags.backend, options, kName, "06", config);
  if (!start.output) return start.exit_code;
  const lessons::GpuRanks& ranks = *start.ranks;
  lessons::RankOutput& out = *start.output;
  dist::Communicator& comm = world;  // the lesson's own collectives (tables, checks) on host values
  const int R = comm.size();
  const int64_t T = config.tokens, E = config.num_experts;
  out.say("Lesson 06 on the GPU: R=" + std::to_string(R) + " ranks over " + ranks.backend + ", " +
          std::to_string(ranks.ranks_per_gpu) + " rank(s) per GPU; " + ranks.devices[0] +
          ".\n  The lesson's layer: T=" + std::to_string(T) + " tokens (T_r=" + std::to_string(shard.tokens) +
          " a rank), D=" + std::to_string(config.model_dim) + ", H=" + std::to_string(config.hidden_dim) +
          ", E=" + std::to_string(E) + " (E_r=" + std::to_string(E / R) + " a rank), K=" +
          std::to_string(config.top_k) + ", dropless, B=64 (the GPU kernels' block)\n");
  if (ranks.ranks_per_gpu > 1) {
    out.say("  NOTE: ranks share a GPU, so the MPI backend stages every exchange through host memory: the\n"
            "  times below are of that staging and sharing, not of a GPU interconnect.\n");
  }

  // The CPU path's data (the same draws), rounded to bf16 so that both layers read the same values.
  const lessons::LessonData data =
      lessons::rounded_to_bf16(lessons::draw_lesson_data(config, options.seed, /*with_random_tokens=*/true));
  const ref::LayerForward reference = ref::moe_forward(config, data.text_x, data.weights);
  const ref::LayerGradients reference_grads = ref::moe_backward(config, data.text_x, data.weights, reference, data.dy);

  lessons::GpuLessonLayer gpu(*start.ranks, comm, config, data.text_x, data.dy, data.weights, shard.offset,
                              shard.tokens);
  const lessons::GpuLayerRun full = gpu.run({}, kWarmup, kTimed);
  const lessons::GpuLayerRun exchange = gpu.run({.experts = dist::ExpertCompute::identity}, kWarmup, kTimed);
  show_gpu_dispatch(out, full, R, config);
  show_gpu_time(out, full, exchange, config.model_dim * kBf16Bytes);

  const lessons::ReferenceCheck check = lessons::check_against_reference(
      comm, full, reference, &reference_grads, shard.offset, shard.tokens, config.top_k);
  const double aux_error = std::abs(full.step.aux_loss - reference.aux_loss) / reference.aux_loss;
  show_gpu_check(out, check, aux_error, T);
  const auto [placed_error, placed_pass] =
      show_gpu_straggler(comm, out, *start.ranks, config, data, gpu, full, reference, reference_grads, shard);

  // ---- verdict ----
  const bool pass = check.pass(T) && aux_error <= lessons::kGpuTolerance && placed_pass;
  std::ostringstream message;
  message << std::setprecision(2) << "GPU EP layer == CPU reference on R=" << R << " ranks (" << ranks.backend
          << "): y rel_err=" << check.y_error << " dx rel_err=" << check.dx_error << " aux rel_err=" << aux_error
          << " tol=" << lessons::kGpuTolerance << "; tokens routed otherwise: " << check.routed_otherwise
          << "; uniform, zipf and EPLB placements (Table G4) max rel_err=" << placed_error;
  return out.finish(pass, message.str());
}
#else
int run_on_gpu(dist::MpiCommunicator& world, const lessons::LessonOptions&, const lessons::RankFlags&, MoeConfig,
               const Shard&) {
  return lessons::no_gpu_path(world, kName);
}
#endif

// ---- the CPU path ----

// What every forward run of the CPU path adds to the verdict.
struct ForwardChecks {
  double worst_error = 0;  // y and aux against the single-device layer
  bool counts_ok = true;   // the count matrix sums to T * K
  int runs = 0;

  void add(const LayerRun& run, const MoeConfig& c) {
    ++runs;
    worst_error = std::max(worst_error, run.error);
    int64_t routed = 0;
    for (int64_t n : run.forward.routed_per_rank_expert) routed += n;
    counts_ok = counts_ok && routed == c.tokens * c.top_k;
  }
};

void introduce(lessons::RankOutput& out, const MoeConfig& config, int R) {
  const int64_t T = config.tokens, E = config.num_experts;
  out.say("Lesson 06: expert parallelism on R=" + std::to_string(R) + " CPU ranks. T=" + std::to_string(T) +
          " tokens (T_r=" + std::to_string(T / R) + " a rank), D=" + std::to_string(config.model_dim) + ", H=" +
          std::to_string(config.hidden_dim) + ", E=" + std::to_string(E) + " experts (E_r=" + std::to_string(E / R) +
          " a rank), K=" + std::to_string(config.top_k) + "\n");
}

// ---- 1. the protocol on text-like tokens, dropless ----

void show_count_exchange(lessons::RankOutput& out, const std::vector<int64_t>& routed, int R, int64_t E) {
  std::vector<std::string> columns{"rank \\ expert"};
  for (int64_t e = 0; e < E; ++e) columns.push_back((std::ostringstream() << "e" << e).str());
  columns.push_back("sum");
  Table table("Table 1: the count exchange: slots each rank (row) routes to each expert (column), zipf text", columns);
  for (int r = 0; r < R; ++r) {
    std::vector<nlohmann::json> row{"rank " + std::to_string(r)};
    int64_t sum = 0;
    for (int64_t e = 0; e < E; ++e) row.push_back(routed[r * E + e]), sum += routed[r * E + e];
    row.push_back(sum);
    table.add_row(row);
  }
  std::vector<nlohmann::json> owner{"on rank"};
  for (int64_t e = 0; e < E; ++e) owner.push_back(e / (E / R));
  owner.push_back("");
  table.add_row(owner);
  out.show(table);
  out.say("  One all-gather of E counts a rank gives every rank this matrix: each learns how many rows\n"
          "  it will receive from whom before any row moves, so it can size its buffers.\n");
}

void show_dispatch(lessons::RankOutput& out, const std::vector<int64_t>& dispatch, int R, const MoeConfig& config) {
  const int64_t row_bytes = config.model_dim * kBf16Bytes;
  out.show(dispatch_table("Table 2: the dispatch all-to-all-v, bytes rank s (row) sends rank t (column), bf16 rows of D=" +
                              std::to_string(config.model_dim),
                          dispatch, R, row_bytes));
  out.say("  Each rank sends T_r*K*D*2 = " + std::to_string(config.tokens / R * config.top_k * row_bytes) +
          " bytes (the diagonal stays on the rank);\n"
          "  the combine sends the same matrix transposed.\n"
          "  This CPU run moves doubles (4x these bytes); the table counts what a bf16 GPU layer sends.\n");
}

void show_rows_per_expert(dist::Communicator& comm, lessons::RankOutput& out, const LayerRun& run,
                          const MoeConfig& config) {
  const int R = comm.size();
  const int64_t E_r = config.num_experts / R;
  const auto arrived = dist::all_gather<int32_t>(comm, run.forward.chunks[0].expert_plan.tokens_per_expert);
  const auto computed = dist::all_gather<int32_t>(comm, run.forward.chunks[0].expert_plan.rows_per_expert);
  Table table("Table 3: on each rank, rows per local expert (dropless: each expert's rows rounded up to B=" +
                  std::to_string(config.block_size) + ")",
              {"rank", "experts", "rows from each rank", "rows per local expert", "rows computed", "padding rows"});
  for (int r = 0; r < R; ++r) {
    std::vector<int64_t> from(R), per_expert(E_r);
    int64_t rows = 0, padding = 0;
    for (int s = 0; s < R; ++s) from[s] = run.dispatch_rows[s * R + r];
    for (int64_t j = 0; j < E_r; ++j) {
      per_expert[j] = arrived[r * E_r + j];
      rows += computed[r * E_r + j];
      padding += computed[r * E_r + j] - arrived[r * E_r + j];
    }
    table.add_row({r, "e" + std::to_string(r * E_r) + "-e" + std::to_string((r + 1) * E_r - 1), joined(from),
                   joined(per_expert), rows, padding});
  }
  out.show(table);
}

// ---- 2. the backward of the same layer: expert gradients stay home, the router's is summed ----

// The largest relative error of dx, dWg, dW1 and dW2 against the single-device layer. Collective.
// Each slot is compared with its expert's whole gradient (a replica's is summed over its replicas).
double backward_error(dist::Communicator& comm, const MoeConfig& config, const lessons::LessonData& data,
                      const LayerRun& run, const Shard& shard) {
  const int rank = comm.rank();
  const ref::Matrix x_r = data.text_x.middleRows(shard.offset, shard.tokens);
  const auto local = dist::local_weights(config, data.weights, rank, run.forward.placement);
  const auto grads = dist::expert_parallel_backward(comm, config, x_r, local, run.forward,
                                                    data.dy.middleRows(shard.offset, shard.tokens));
  const ref::LayerForward forward = ref::moe_forward(config, data.text_x, data.weights);
  const ref::LayerGradients reference = ref::moe_backward(config, data.text_x, data.weights, forward, data.dy);
  ErrorSum dx, gate, w1, w2;
  dx.add(grads.x, reference.x.middleRows(shard.offset, shard.tokens));
  if (rank == 0) gate.add(grads.gate_weights, reference.gate_weights);  // the same on every rank
  const std::vector<int64_t>& mine = run.forward.placement.experts_of(rank);
  for (size_t j = 0; j < mine.size(); ++j) {
    w1.add(grads.w1[j], reference.w1[mine[j]]);
    w2.add(grads.w2[j], reference.w2[mine[j]]);
  }
  double error = 0;
  for (const ErrorSum* sum : {&dx, &gate, &w1, &w2}) error = std::max(error, sum->relative(comm));
  return error;
}

// ---- 3. the dispatch and combine replayed as bf16, for the run record's all-to-all panel ----

// Returns whether both replays arrived intact on every rank.
bool replay_exchanges(dist::Communicator& comm, lessons::RankOutput& out, const LayerRun& run,
                      const MoeConfig& config) {
  const int R = comm.size();
  const int64_t D = config.model_dim, row_bytes = D * kBf16Bytes;
  const auto& chunk = run.forward.chunks[0];
  // Rank 0's clock is the run's (start_us of the all-to-all events, so a trace export shows them).
  RunWriter* writer = out.writer();
  const double dispatch_called_us = writer ? writer->elapsed_us() : 0;
  const Replay dispatch = replay_bf16(comm, chunk.send_rows, chunk.recv_rows, D);
  const double combine_called_us = writer ? writer->elapsed_us() : 0;
  const Replay combine = replay_bf16(comm, chunk.recv_rows, chunk.send_rows, D);
  if (writer) {
    writer->append(to_event(RoutingEvent{.step = 0, .layer = 0,
                                         .tokens_per_expert = expert_loads(run.forward.routed_per_rank_expert, R,
                                                                           config.num_experts),
                                         .dropped_per_expert = {}, .capacity = std::nullopt,
                                         .tokens_per_expert_by_genre = {}}));
    writer->append(to_event(lessons::expert_load_of(0, 0, run.forward.routed_per_rank_expert, R)));
    writer->append(to_event(AllToAllEvent{.step = 0, .layer = 0, .name = "dispatch",
                                          .bytes = square(run.dispatch_rows, R, row_bytes),
                                          .duration_us = dispatch.duration_us,
                                          .start_us = dispatch_called_us + dispatch.started_us,
                                          .rank = 0}));
    writer->append(to_event(AllToAllEvent{.step = 0, .layer = 0, .name = "combine",
                                          .bytes = square(run.dispatch_rows, R, row_bytes, true),
                                          .duration_us = combine.duration_us,
                                          .start_us = combine_called_us + combine.started_us,
                                          .rank = 0}));
    std::cout << std::setprecision(3) << "  The dispatch replayed alone as bf16 took " << dispatch.duration_us
              << " us, the combine " << combine.duration_us
              << " us (MPI over shared memory on this machine, one run: not an interconnect's figure).\n";
  }
  return dispatch.intact && combine.intact;
}

// ---- 4. uneven routing: some ranks receive far more than others ----

// Returns the max/mean of the rows the ranks receive on the zipf text at the lesson's K.
double show_routing_skew(dist::Communicator& comm, lessons::RankOutput& out, ForwardChecks& checks,
                         const MoeConfig& config, const lessons::LessonData& data, const LayerRun& main_run,
                         const Shard& shard) {
  const int R = comm.size();
  const int64_t row_bytes = config.model_dim * kBf16Bytes;
  double zipf_skew = 1;
  Table table("Table 4: what routing skew does to the ranks (dropless; received = rows for its experts, own included)",
              {"input", "K", "max/mean expert load", "KiB received per rank (bf16)", "max/mean received",
               "rel err vs 1 device"});
  for (const auto& [name, x, k] : {std::tuple<std::string, const ref::Matrix*, int64_t>{"random", &data.random_x, 2},
                                   {"zipf text", &data.text_x, 2}, {"zipf text", &data.text_x, 1}}) {
    MoeConfig c = config;
    c.top_k = k;
    const bool main = k == config.top_k && x == &data.text_x;
    const LayerRun run = main ? main_run : run_layer(comm, c, *x, data.weights, shard);
    checks.add(run, c);
    const auto in = received(run.dispatch_rows, R);
    const double skew = max_over_mean(in);
    if (main) zipf_skew = skew;
    table.add_row({name, k,
                   lessons::load_stats(as_int32(expert_loads(run.forward.routed_per_rank_expert, R, c.num_experts)))
                       .max_over_mean,
                   joined(in, static_cast<double>(row_bytes) / 1024.0), skew, run.error});
  }
  out.show(table);
  out.say("  Every rank waits for the busiest one: its exchange and its experts take max/mean times the\n"
          "  balanced time. Frequent token types send identical rows to the same experts, so their ranks fill.\n");
  return zipf_skew;
}

// ---- 5. the capacity rule across ranks (dropping) ----

void show_capacity_rule(dist::Communicator& comm, lessons::RankOutput& out, ForwardChecks& checks,
                        const MoeConfig& config, const lessons::LessonData& data, const Shard& shard) {
  const int R = comm.size();
  const int64_t T = config.tokens, E = config.num_experts;
  Table table("Table 5: dropping with capacity C counted over all T tokens in token order (zipf text, K=2)",
              {"cf", "C", "dropped %", "dropped slots by source rank", "max/mean received",
               "dropped % (per-rank rule)", "rel err vs 1 device"});
  for (double cf : {1.0, 1.25, 2.0}) {
    MoeConfig c = config;
    c.formulation = Formulation::dropping;
    c.capacity_factor = cf;
    const LayerRun run = run_layer(comm, c, data.text_x, data.weights, shard);
    checks.add(run, c);
    const auto& r_e = run.forward.routed_per_rank_expert;
    const auto& kept = run.forward.kept_per_rank_expert;
    std::vector<int64_t> dropped_by_rank(R, 0), dropped_by_expert(E, 0);
    // The per-rank rule (GShard, Tutel): each rank keeps at most ceil(cf * T_r * K / E) slots an expert.
    const auto local_capacity = static_cast<int64_t>(std::ceil(cf * static_cast<double>(T / R * c.top_k) / E));
    int64_t dropped_local = 0;
    for (int r = 0; r < R; ++r) {
      for (int64_t e = 0; e < E; ++e) {
        dropped_by_rank[r] += r_e[r * E + e] - kept[r * E + e];
        dropped_by_expert[e] += r_e[r * E + e] - kept[r * E + e];
        dropped_local += std::max<int64_t>(0, r_e[r * E + e] - local_capacity);
      }
    }
    const double slots = static_cast<double>(T * c.top_k);
    table.add_row({cf, run.forward.capacity, 100.0 * static_cast<double>(run.forward.dropped_slots) / slots,
                   joined(dropped_by_rank), max_over_mean(received(run.dispatch_rows, R)),
                   100.0 * static_cast<double>(dropped_local) / slots, run.error});
    if (RunWriter* writer = out.writer()) {
      writer->append(to_event(RoutingEvent{.step = static_cast<int64_t>(std::lround(100 * cf)), .layer = 0,
                                           .tokens_per_expert = expert_loads(r_e, R, E),
                                           .dropped_per_expert = dropped_by_expert, .capacity = run.forward.capacity,
                                           .tokens_per_expert_by_genre = {}}));
    }
  }
  out.show(table);
  out.say("  kept[r][e] = min(routed[r][e], C - slots of e kept by ranks before r): the count matrix is\n"
          "  enough, no further message. Later ranks' tokens come later in token order, so they drop first.\n");
}

// ---- 6. the arithmetic at a realistic shape (cost model; no run) ----

void show_realistic_shapes(lessons::RankOutput& out, double zipf_skew) {
  struct Shape {
    std::string name;
    int64_t tokens_per_rank, D, H, E, K;
    double expert_flops_per_s;  // torch._grouped_mm, bf16 forward, one H200, uniform routing, 2026-11-21
  };
  const std::vector<Shape> shapes{
      {"D=2048 H=8192 E=32 K=2 (Tutel's layer)", 16384, 2048, 8192, 32, 2, 623e12},
      {"D=1024 H=4096 E=64 K=1 (small experts)", 32768, 1024, 4096, 64, 1, 424e12},  // rate at T=16384
      {"D=4096 H=14336 E=8 K=2 (large experts)", 8192, 4096, 14336, 8, 2, 654e12}};
  const int pair = 2;  // the measured machine: two H200s over NVLink
  Table table("Table 6: forward bytes and time per rank on two H200s (cost model from measured figures, bf16)",
              {"shape", "T_r", "MiB each way", "exchange ms at 249 | 176 GB/s", "expert TFLOP",
               "experts ms", "2 exchanges / experts"});
  for (const Shape& s : shapes) {
    const double bytes = static_cast<double>(s.tokens_per_rank * s.K * s.D * kBf16Bytes);  // T_r*K*D*2
    const double crossing = bytes * (pair - 1) / pair;  // busbw = algbw * (R-1)/R
    const double fast_ms = 1e3 * crossing / kBusbw256MiB, slow_ms = 1e3 * crossing / kBusbw64MiB;
    const double flops = 4.0 * static_cast<double>(s.tokens_per_rank * s.K) * s.D * s.H;  // two GEMMs
    const double expert_ms = 1e3 * flops / s.expert_flops_per_s;
    std::ostringstream exchange, ratio;
    exchange << std::fixed << std::setprecision(2) << fast_ms << " | " << slow_ms;
    ratio << std::fixed << std::setprecision(2) << 2 * fast_ms / expert_ms << " - " << 2 * slow_ms / expert_ms;
    table.add_row({s.name, s.tokens_per_rank, bytes / (1 << 20), exchange.str(), flops / 1e12, expert_ms, ratio.str()});
  }
  out.show(table);
  std::ostringstream text;
  text << std::setprecision(3)
       << "  exchange / experts = F (R-1) / (2 R H busbw) per direction: only H, the FLOP rate F and the\n"
          "  link set it. Under the skew of Table 4 the busiest rank takes "
       << zipf_skew << "x the balanced time for both.\n";
  out.say(text.str());
}

// ---- 7. placing experts by load: replicas of the hot experts even out the ranks of Table 4 ----

// Returns the worst backward error of the replicated placements. Collective.
double show_placement_by_load(dist::Communicator& comm, lessons::RankOutput& out, ForwardChecks& checks,
                              const MoeConfig& config, const lessons::LessonData& data, const LayerRun& main_run,
                              const Shard& shard) {
  const int R = comm.size();
  const int64_t E = config.num_experts, base_slots = E / R;
  const std::vector<int64_t>& routed = main_run.forward.routed_per_rank_expert;
  const std::vector<int64_t> counts = expert_loads(routed, R, E);
  const std::vector<double> load(counts.begin(), counts.end());  // this step's rows per expert
  const int64_t hottest = std::max_element(counts.begin(), counts.end()) - counts.begin();
  const dist::ExpertPlacement plain = dist::contiguous_placement(E, R);

  std::vector<std::pair<std::string, dist::ExpertPlacement>> placements{{"E / R in id order", plain}};
  for (int64_t redundant : {1, 2}) {  // a rank holds each expert once (R = 1: no room at all)
    if (redundant <= E - base_slots) {
      placements.emplace_back("EPLB, S=" + std::to_string(redundant), dist::eplb_placement(load, R, redundant));
    }
  }
  if (R > 1) placements.emplace_back("shadow e" + std::to_string(hottest), plain.with_shadowed({hottest}));

  Table table("Table 7: placing experts by load (from Table 4's zipf-text loads, K=2, dropless)",
              {"placement", "slots a rank", "copies beyond one", "rows each rank computes", "max/mean",
               "rows crossing ranks", "rel err vs 1 device"});
  double backward = 0;
  for (const auto& [name, placement] : placements) {
    const bool plain_run = placement.fingerprint() == plain.fingerprint();
    const LayerRun run = plain_run ? main_run : run_layer(comm, config, data.text_x, data.weights, shard, &placement);
    if (!plain_run) {
      checks.add(run, config);
      backward = std::max(backward, backward_error(comm, config, data, run, shard));
    }
    const std::vector<int64_t> in = received(run.dispatch_rows, R);
    int64_t crossing = 0;
    for (int s = 0; s < R; ++s) {
      for (int t = 0; t < R; ++t) crossing += s == t ? 0 : run.dispatch_rows[s * R + t];
    }
    table.add_row({name, placement.slots_of(0), placement.slots() - E, joined(in), max_over_mean(in), crossing,
                   run.error});
  }
  out.show(table);
  std::ostringstream text;
  text << "  EPLB gives every rank ceil(E/R) + S slots. It fills the spare ones with copies of the experts\n"
          "  that have the most rows a copy, then packs the copies, heaviest first, onto the least loaded\n"
          "  rank that does not hold that expert yet. A source splits its rows for a copied expert evenly\n"
          "  over the copies (its own first); the copies' weight gradients are summed, so they stay equal.\n"
          "  Shadowing (FasterMoE) copies an expert to every rank and keeps its rows at home: its weights\n"
          "  travel instead of its rows.\n";
  if (placements.size() > 1) text << "  " << placements[1].first << ": " << placements[1].second.describe() << "\n";
  if (R > 1) {
    const int64_t elements = config.model_dim * w1_columns(config) + config.hidden_dim * config.model_dim;
    const std::vector<int64_t> worth =
        dist::worth_shadowing(plain, routed, config.model_dim, w1_columns(config), config.hidden_dim);
    const bool pays = std::find(worth.begin(), worth.end(), hottest) != worth.end();
    text << "  Shadowing e" << hottest << " moves its " << elements << " weights: " << (R - 1) * elements * 10
         << " bytes a step (a bf16 broadcast, fp32 gradients summed),\n  against 8 D = "
         << 8 * config.model_dim << " bytes for each of its rows that crosses ranks: worth it at these counts? "
         << (pays ? "yes" : "no") << " (common/expert_placement.h).\n";
  }
  out.say(text.str());
  return backward;
}

// ---- verdict ----

int verdict(lessons::RankOutput& out, int R, const ForwardChecks& checks, double backward, bool replays_intact) {
  const double error = std::max(checks.worst_error, backward);
  const bool pass = checks.counts_ok && replays_intact && error <= kTolerance;
  std::ostringstream message;
  message << std::setprecision(2) << "EP layer == single-device reference on R=" << R
          << " ranks: max_rel_err=" << error << " tol=" << kTolerance
          << " (y and aux of " << checks.runs
          << " forward runs; dx, dWg, dW1, dW2 of the dropless runs); counts sum to T*K: "
          << (checks.counts_ok ? "yes" : "NO") << "; bf16 replays intact: " << (replays_intact ? "yes" : "NO");
  return out.finish(pass, message.str());
}

// The CPU path: the lesson's sections in order, then the verdict. Collective; returns the exit code.
int run_on_cpu(dist::Communicator& comm, lessons::RankOutput& out, const lessons::LessonOptions& options,
               const MoeConfig& config, const Shard& shard) {
  const int R = comm.size();
  introduce(out, config, R);
  const lessons::LessonData data = lessons::draw_lesson_data(config, options.seed, /*with_random_tokens=*/true);

  ForwardChecks checks;
  const LayerRun main_run = run_layer(comm, config, data.text_x, data.weights, shard);
  checks.add(main_run, config);
  show_count_exchange(out, main_run.forward.routed_per_rank_expert, R, config.num_experts);
  show_dispatch(out, main_run.dispatch_rows, R, config);
  show_rows_per_expert(comm, out, main_run, config);
  const double backward = backward_error(comm, config, data, main_run, shard);
  const bool replays_intact = replay_exchanges(comm, out, main_run, config);
  const double zipf_skew = show_routing_skew(comm, out, checks, config, data, main_run, shard);
  show_capacity_rule(comm, out, checks, config, data, shard);
  show_realistic_shapes(out, zipf_skew);
  const double placed_backward = show_placement_by_load(comm, out, checks, config, data, main_run, shard);
  return verdict(out, R, checks, std::max(backward, placed_backward), replays_intact);
}

}  // namespace

int main(int argc, char** argv) {
  lessons::RankFlags rank_flags;
  const auto options = lessons::parse_options(
      argc, argv, kName,
      lessons::gpu_flag_given(argc, argv) ? "runs/lesson06_expert_parallelism_gpu" : "runs/lesson06_expert_parallelism",
      [&](CLI::App& app) { lessons::add_rank_flags(app, rank_flags); });
  const MoeConfig config = lesson_config();
  return lessons::run_on_ranks(
      argc, argv, options, rank_flags, kName, "06", config,
      [&](dist::MpiCommunicator& world, const Shard& shard) { return run_on_gpu(world, options, rank_flags, config, shard); },
      [&](dist::Communicator& comm, lessons::RankOutput& out, const Shard& shard) {
        return run_on_cpu(comm, out, options, config, shard);
      });
}
