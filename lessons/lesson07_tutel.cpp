// lesson07_tutel.cpp: Lesson 07, Tutel (Hwang et al., MLSys 2023) on top of expert parallelism:
// adaptive pipelining (the rows in d chunks, so chunk c + 1's exchange overlaps chunk c's
// experts), the 2D hierarchical all-to-all (nodes of G ranks: fewer, larger messages between
// nodes), and parallelism switching (Tutel's r). Each idea is shown with a cost model built from
// figures measured on the GPU machines; the real run on CPU ranks checks that neither the chunking
// nor the 2DH exchange changes a result, and computes the layer in every valid layout r over one
// stored placement of the experts, each against the single-device layer, with the cost model's and
// the measured choice of r. Each mechanism is a trade (overlap against smaller messages, fewer
// messages against a second stage, memory against bytes moved): the cost models say when it pays,
// the real run that it never changes the layer. Read lessons/07_tutel.md beside it.
//
// Build and run (needs MPI; as root OpenMPI also wants --allow-run-as-root):
//   ./moe build && mpirun --oversubscribe -np 4 build/lessons/lesson07_tutel [--out runs/lesson07_tutel]
//   mpirun --oversubscribe -np 2 build/lessons/lesson07_tutel --gpu [--backend auto|nccl|mpi]
//                    (the GPU layer's pipelining degrees, its adaptive choice of d, its 2DH
//                    exchange and its layouts r, measured and checked; writes runs/lesson07_tutel_gpu)
// --collective-timeout S (default 30): a rank that died or stopped ends the job after S seconds with
// a line naming the collective (distributed_lesson_support.h; test: ctest -R StoppedRank).
//
// The layer is distributed/ep/expert_parallel_cpu.h (Eigen, double) with its pipeline_chunks and
// hierarchical options; the 2DH exchange is distributed/comm/all_to_all_2dh.h; the layouts r are
// distributed/ep/expert_layouts.h. Rank 0 prints the tables and the verdict and writes the run
// record. Dimension legend: T tokens (all ranks), T_r per rank,
// D model width, H expert hidden width, E experts, K top-k, R ranks, G ranks per node, N = R / G
// nodes, d pipeline chunks, r Tutel's parallelism degree.
#include <mpi.h>  // MPI_Abort: a GPU error on one rank ends every rank

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <tuple>

#include "comm/all_to_all_2dh.h"         // HierarchicalAllToAll
#include "comm/mpi_communicator.h"       // MpiEnvironment, MpiCommunicator
#include "distributed_lesson_support.h"  // Shard, LessonData, RankOutput, RankFlags, run_gpu_path
#include "ep/expert_layouts.h"           // expert_layout_forward / backward, choose_layout, measure_layouts
#include "ep/expert_parallel_cpu.h"      // expert_parallel_forward / backward, local_weights
#include "lesson_support.h"              // options, Table
#include "moe_layer.h"                   // ref::moe_forward / moe_backward, the oracle of section 4
#ifdef MOE_LESSON_HAS_CUDA
#include "distributed_lesson_gpu.h"       // start_gpu_lesson, GpuLessonLayer, check_against_reference
#include "ep/expert_layout_choice_gpu.h"  // choose_gpu_layout: the cost model on the GPU path
#endif

using namespace moe;
using moe::lessons::Shard;
using moe::lessons::Table;

namespace {

constexpr const char* kName = "lesson07_tutel";
constexpr double kTolerance = 1e-12;  // d chunks vs one: double, only the order of the weight-gradient sums differs
constexpr double kBf16Bytes = 2;

std::string text(double value, int decimals) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(decimals) << value;
  return out.str();
}

// ---- the cost model ----

// An exchange of b bytes per rank takes latency + b / bandwidth, the line through two points of the
// all-to-all sweep on two H200s over NVLink (PyTorch + NCCL 2.28, 2026-11-24; the anchor figures of
// notebooks_data/bench/README.md, "Anchor figures and ceilings"):
// busbw 58 GB/s at 8 MiB per rank and 249 GB/s at 256 MiB. time = bytes / algbw, algbw = busbw *
// R / (R - 1) = 2 busbw at R = 2.
struct Link {
  double latency_us = 0;
  double bytes_per_us = 0;
  double time_us(double bytes) const { return latency_us + bytes / bytes_per_us; }
};

Link measured_link() {
  const double small = 8.0 * (1 << 20), large = 256.0 * (1 << 20);
  const double small_us = small / (2 * 58e9) * 1e6, large_us = large / (2 * 249e9) * 1e6;
  Link link;
  link.bytes_per_us = (large - small) / (large_us - small_us);
  link.latency_us = small_us - small / link.bytes_per_us;
  return link;
}

// Expert FLOPs / rate: torch._grouped_mm, bf16 forward, D=2048 H=8192 K=2 uniform routing, one H200,
// 2026-11-21 (notebooks_data/bench/README.md, "Anchor figures and ceilings"): 623 TFLOP/s.
constexpr double kExpertFlopsPerUs = 623e12 / 1e6;

struct Span {
  int chunk = 0;
  double start = 0, end = 0;  // us
};

// One layer's forward with d chunks on two streams: the comm stream sends every chunk's dispatch,
// then every chunk's combine, in chunk order; the compute stream runs chunk c's experts as soon as
// its dispatch has arrived; chunk c's combine waits for its experts.
struct Schedule {
  std::vector<Span> dispatch, experts, combine;
  double total_us = 0;
};

Schedule simulate(int chunks, double exchange_us, double expert_us) {  // per chunk
  Schedule s;
  double comm = 0, compute = 0;
  for (int c = 0; c < chunks; ++c) s.dispatch.push_back({c, comm, comm + exchange_us}), comm += exchange_us;
  for (int c = 0; c < chunks; ++c) {
    const double start = std::max(compute, s.dispatch[c].end);
    s.experts.push_back({c, start, start + expert_us});
    compute = start + expert_us;
  }
  for (int c = 0; c < chunks; ++c) {
    const double start = std::max(comm, s.experts[c].end);
    s.combine.push_back({c, start, start + exchange_us});
    comm = start + exchange_us;
  }
  s.total_us = comm;
  return s;
}

// One lane of the timeline: the chunk number where an op runs, '.' where the stream waits.
std::string lane(const std::vector<Span>& spans, double us_per_column, int columns) {
  std::string out(static_cast<size_t>(columns), ' ');
  for (int i = 0; i < columns; ++i) {
    const double t = (i + 0.5) * us_per_column;
    for (const Span& span : spans) {
      if (t >= span.start && t < span.end) out[i] = static_cast<char>('0' + span.chunk % 10);
    }
    if (out[i] == ' ' && t < spans.back().end) out[i] = '.';
  }
  return out;
}

// ---- the real run ----

struct LayerResult {
  dist::ExpertParallelForward forward;
  dist::ExpertParallelGradients grads;
};

LayerResult run_layer(dist::Communicator& comm, const MoeConfig& config, const ref::Matrix& x,  // [T, D]
                      const ref::Matrix& dy, const ref::MoeWeights& weights, const Shard& shard,
                      const dist::ExpertParallelOptions& options) {
  const ref::Matrix x_r = x.middleRows(shard.offset, shard.tokens);
  const auto local = dist::local_weights(config, weights, shard.rank, shard.ranks);
  LayerResult result;
  result.forward = dist::expert_parallel_forward(comm, config, x_r, local, options);
  result.grads = dist::expert_parallel_backward(comm, config, x_r, local, result.forward,
                                                dy.middleRows(shard.offset, shard.tokens));
  return result;
}

// Every tensor of a result, in one list: y, dx, dWg, dW1..., dW2...
std::vector<const ref::Matrix*> tensors(const LayerResult& r) {
  std::vector<const ref::Matrix*> out{&r.forward.y, &r.grads.x, &r.grads.gate_weights};
  for (const auto& m : r.grads.w1) out.push_back(&m);
  for (const auto& m : r.grads.w2) out.push_back(&m);
  return out;
}

bool same_bits(const ref::Matrix& a, const ref::Matrix& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(double) * static_cast<size_t>(a.size())) == 0;
}

struct Comparison {
  bool y_bitwise = true;   // the forward output, on every rank
  bool bitwise = true;     // on every rank, every tensor
  double max_rel_err = 0;  // the largest over the tensors, ||a - b|| / ||b|| over all ranks
};

// Collective: every rank compares its tensors; the outcome is the same on every rank.
Comparison compare(dist::Communicator& comm, const LayerResult& actual, const LayerResult& expected) {
  const auto a = tensors(actual), b = tensors(expected);
  // [difference^2, reference^2] per tensor, then the tensors that differ in a bit: y, all
  std::vector<double> sums(2 * a.size() + 2, 0.0);
  for (size_t i = 0; i < a.size(); ++i) {
    const bool replicated = i == 2;  // dWg is the same on every rank: count it once
    if (replicated && comm.rank() != 0) continue;
    sums[2 * i] = (*a[i] - *b[i]).squaredNorm();
    sums[2 * i + 1] = b[i]->squaredNorm();
  }
  sums[2 * a.size()] = same_bits(*a[0], *b[0]) ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) sums.back() += same_bits(*a[i], *b[i]) ? 0 : 1;
  dist::all_reduce_sum<double>(comm, sums);
  Comparison c;
  c.y_bitwise = sums[2 * a.size()] == 0;
  c.bitwise = sums.back() == 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = sums[2 * i + 1] > 0 ? std::sqrt(sums[2 * i] / sums[2 * i + 1]) : std::sqrt(sums[2 * i]);
    c.max_rel_err = std::max(c.max_rel_err, e);
  }
  return c;
}

// The dispatch's rows as bf16 with a different bit pattern per element, through the flat and the
// 2DH all-to-all-v into NaN-filled buffers: true when both receive the same bits (on every rank).
bool same_exchange(dist::Communicator& comm, dist::HierarchicalAllToAll& hierarchical,
                   const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows, int64_t D) {
  const int R = comm.size();
  std::vector<int64_t> send_counts(R), recv_counts(R);
  for (int p = 0; p < R; ++p) send_counts[p] = send_rows[p] * D, recv_counts[p] = recv_rows[p] * D;
  const auto send_offsets = dist::exclusive_prefix_sum(send_counts);
  const auto recv_offsets = dist::exclusive_prefix_sum(recv_counts);
  std::vector<uint16_t> send(send_offsets[R - 1] + send_counts[R - 1]);
  for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint16_t>(0x3C00 + (comm.rank() * 7919 + i) % 0x800);
  const size_t received = recv_offsets[R - 1] + recv_counts[R - 1];
  std::vector<uint16_t> flat(received, 0x7FC0), two_level(received, 0x7FC0);  // bf16 NaN
  comm.all_to_all_v(send.data(), send_counts, send_offsets, flat.data(), recv_counts, recv_offsets,
                    dist::DataType::bfloat16);
  hierarchical.all_to_all_v(send.data(), send_counts, send_offsets, two_level.data(), recv_counts, recv_offsets,
                            dist::DataType::bfloat16);
  int32_t same = flat == two_level ? 1 : 0;
  for (int32_t s : dist::all_gather<int32_t>(comm, same)) same &= s;
  return same == 1;
}

// ---- parallelism switching: the real run ----

constexpr double kLayoutTolerance = 1e-10;  // every layout against the single-device layer, double

struct LayoutRun {
  dist::ExpertLayoutForward forward;
  dist::ExpertLayoutGradients grads;
};

// The layer in layout r on this rank's shard, forward and backward, over the stored placement.
LayoutRun run_layout(dist::Communicator& comm, const MoeConfig& config, const ref::Matrix& x,  // [T, D]
                     const ref::Matrix& dy, const dist::ExpertParallelWeights& stored, const Shard& shard, int r) {
  const ref::Matrix x_r = x.middleRows(shard.offset, shard.tokens);
  dist::ExpertLayoutOptions options;
  options.r = r;
  LayoutRun run;
  run.forward = dist::expert_layout_forward(comm, config, x_r, stored, options);
  run.grads = dist::expert_layout_backward(comm, config, x_r, stored, run.forward,
                                           dy.middleRows(shard.offset, shard.tokens));
  return run;
}

// The largest of ||run - reference|| / ||reference|| over y, dx, dWg, and the dW1 and dW2 of the
// experts each rank stores (norms over all ranks), and the aux and z losses' relative errors.
// Collective; the same on every rank.
double error_against_reference(dist::Communicator& comm, const LayoutRun& run, const ref::LayerForward& forward,
                               const ref::LayerGradients& grads, const Shard& shard) {
  enum Kind { y, dx, dw1, dw2, dwg, kinds };
  struct Pair {
    Kind kind;
    const ref::Matrix* actual;
    ref::Matrix reference;
  };
  std::vector<Pair> pairs{{y, &run.forward.y, forward.y.middleRows(shard.offset, shard.tokens)},
                          {dx, &run.grads.x, grads.x.middleRows(shard.offset, shard.tokens)}};
  const int64_t per_rank = static_cast<int64_t>(run.grads.w1.size());
  for (int64_t j = 0; j < per_rank; ++j) {
    pairs.push_back({dw1, &run.grads.w1[j], grads.w1[shard.rank * per_rank + j]});
    pairs.push_back({dw2, &run.grads.w2[j], grads.w2[shard.rank * per_rank + j]});
  }
  if (shard.rank == 0) pairs.push_back({dwg, &run.grads.gate_weights, grads.gate_weights});  // the same on every rank
  std::vector<double> sums(2 * kinds, 0.0);  // [difference^2, reference^2] per kind
  for (const Pair& pair : pairs) {
    const bool same_shape = pair.actual->rows() == pair.reference.rows() && pair.actual->cols() == pair.reference.cols();
    sums[2 * pair.kind] += same_shape ? (*pair.actual - pair.reference).squaredNorm()
                                      : std::numeric_limits<double>::infinity();
    sums[2 * pair.kind + 1] += pair.reference.squaredNorm();
  }
  dist::all_reduce_sum<double>(comm, sums);
  double error = std::max(std::abs(run.forward.aux_loss - forward.aux_loss) / std::abs(forward.aux_loss),
                          std::abs(run.forward.z_loss - forward.z_loss) / std::abs(forward.z_loss));
  for (int kind = 0; kind < kinds; ++kind) {
    error = std::max(error, sums[2 * kind + 1] > 0 ? std::sqrt(sums[2 * kind] / sums[2 * kind + 1])
                                                   : std::sqrt(sums[2 * kind]));
  }
  return std::isnan(error) ? std::numeric_limits<double>::infinity() : error;
}

// ---- the lesson's layer ----

MoeConfig lesson_config() {
  return MoeConfig{.tokens = 2048,    // T, all ranks together
                   .model_dim = 32,   // D
                   .hidden_dim = 64,  // H
                   .num_experts = 8,  // E
                   .top_k = 2,        // K
                   .formulation = Formulation::dropless,
                   .capacity_factor = 1.25,
                   .block_size = 8,  // B
                   .aux_loss_coef = 0.01,
                   .z_loss_coef = 1e-3};
}

// ---- the GPU path (--gpu) ----

#ifdef MOE_LESSON_HAS_CUDA
constexpr int kWarmup = 3, kTimed = 10;  // steps of each GPU run

// What every GPU section reads: the communicator of the lesson's own collectives (tables, checks on
// host values), rank 0's output, the layer, and its run at d = 1 (flat, r = 1) that the others
// compare with.
struct GpuSection {
  dist::Communicator& comm;
  lessons::RankOutput& out;
  lessons::GpuLessonLayer& gpu;
  const lessons::GpuLayerRun& one;
};

// True on every rank when every rank's y (and dx, when asked) has the same bits in both runs.
bool same_outputs(dist::Communicator& comm, const lessons::GpuLayerRun& a, const lessons::GpuLayerRun& b,
                  bool with_dx) {
  int32_t same = a.y_bits == b.y_bits && (!with_dx || a.dx == b.dx) ? 1 : 0;
  for (int32_t s : dist::all_gather<int32_t>(comm, same)) same &= s;
  return same == 1;
}

double step_ms(const lessons::GpuLayerRun& run) { return run.forward_ms + run.backward_ms; }

// ---- G1. the pipelining degrees, and the layer's own choice ----
// Returns whether every degree and the adaptive choice give y bit for bit d = 1's.
bool gpu_pipelining(const GpuSection& s, const lessons::GpuLayerRun& adaptive) {
  bool bitwise = true;
  Table table("Table G1: forward + backward on the GPU at each pipelining degree, and the layer choosing d itself",
              {"d", "forward (ms)", "backward (ms)", "step (ms)", "vs d=1", "y bit for bit vs d=1"});
  table.add_row({1, s.one.forward_ms, s.one.backward_ms, step_ms(s.one), 1.0, "-"});
  for (int d : {2, 4, 8}) {
    const lessons::GpuLayerRun run = s.gpu.run({.pipeline_chunks = d}, kWarmup, kTimed);
    const bool same = same_outputs(s.comm, run, s.one, false);
    bitwise = bitwise && same;
    table.add_row({d, run.forward_ms, run.backward_ms, step_ms(run), step_ms(run) / step_ms(s.one), same ? "yes" : "NO"});
  }
  const bool same = same_outputs(s.comm, adaptive, s.one, false);
  bitwise = bitwise && same;
  table.add_row({"adaptive: d=" + std::to_string(adaptive.step.pipeline.chosen), adaptive.forward_ms,
                 adaptive.backward_ms, step_ms(adaptive), step_ms(adaptive) / step_ms(s.one), same ? "yes" : "NO"});
  s.out.show(table);
  return bitwise;
}

// ---- G2. the layer's adaptive trials ----
void show_gpu_trials(lessons::RankOutput& out, const dist::PipelineChoice& choice) {
  Table table("Table G2: the layer's adaptive trials (pipeline_chunks = 0): each candidate's best of " +
                  std::to_string(dist::kTrialStepsPerCandidate) + " forward + backward steps, the slowest rank's",
              {"candidate d", "trial (ms)", "chosen"});
  for (size_t i = 0; i < choice.candidates.size(); ++i) {
    table.add_row({choice.candidates[i], choice.times_ms[i], choice.candidates[i] == choice.chosen ? "<-" : ""});
  }
  out.show(table);
  out.say("  Every rank measured every candidate on its own stream; the ranks gathered the times and all kept\n"
          "  the d whose slowest rank was fastest. d = 1 is a candidate, so the choice is never slower than\n"
          "  d = 1 beyond the noise of two steps. A new shape (other T_r) gets trials of its own.\n");
}

// ---- G3. the 2DH exchange against the flat one ----
struct GpuHierarchical {
  bool bitwise = true;     // y and dx at every G
  std::string node_sizes;  // the G checked, "2,4"
};

GpuHierarchical gpu_hierarchical(const GpuSection& s) {
  const int R = s.comm.size();
  GpuHierarchical result;
  Table table("Table G3: the layer through the 2DH all-to-all (nodes of G ranks) against the flat one, d=1",
              {"G", "nodes N", "forward (ms)", "backward (ms)", "vs flat", "y and dx bit for bit", "host waits"});
  table.add_row({"flat", "-", s.one.forward_ms, s.one.backward_ms, 1.0, "-",
                 s.one.step.host_synchronisations + s.one.step.backward_host_synchronisations});
  for (int G = 2; G <= R; ++G) {
    if (R % G != 0) continue;
    const lessons::GpuLayerRun run = s.gpu.run({.pipeline_chunks = 1, .hierarchical_ranks_per_node = G}, kWarmup, kTimed);
    const bool same = same_outputs(s.comm, run, s.one, true);
    result.bitwise = result.bitwise && same;
    result.node_sizes += (result.node_sizes.empty() ? "" : ",") + std::to_string(G);
    table.add_row({G, R / G, run.forward_ms, run.backward_ms, step_ms(run) / step_ms(s.one), same ? "yes" : "NO",
                   run.step.host_synchronisations + run.step.backward_host_synchronisations});
  }
  s.out.show(table);
  if (result.node_sizes.empty()) s.out.say("  (2DH needs nodes of G > 1 ranks: run with -np 2 or 4.)\n");
  s.out.say("  On one host the 'nodes' share the same links: 2DH pays its second stage and its copies here\n"
            "  without the gain it brings across real nodes (fewer, larger messages; Table 3 of the CPU path).\n");
  return result;
}

// ---- G4. Tutel's layouts r on the GPU, over the same stored experts ----
struct GpuLayouts {
  double error = 0;  // the largest y, dx rel_err against r = 1
  std::string run;   // the r run, "0,1,2"
  int fastest_r = 1, cost_model_r = 1;
};

GpuLayouts gpu_layouts(const GpuSection& s, const lessons::GpuRanks& ranks, const MoeConfig& config,
                       const Shard& shard) {
  GpuLayouts result;
  const std::vector<int> layouts = dist::valid_gpu_layouts(config, {}, s.comm.size());
  Table table("Table G4: the layer in each of Tutel's layouts r on the GPU (d=1, flat), over one storage of the "
              "experts",
              {"r", "layout", "forward (ms)", "backward (ms)", "vs r=1", "weights sent (elements)",
               "y, dx rel_err vs r=1"});
  const std::vector<bool> every(static_cast<size_t>(shard.tokens), true);
  double fastest_ms = step_ms(s.one);
  for (int r : layouts) {
    const lessons::GpuLayerRun run = r == 1 ? s.one : s.gpu.run({.pipeline_chunks = 1}, kWarmup, kTimed, r);
    const double error = std::max(lessons::sharded_relative_error(s.comm, run.y, s.one.y, every),
                                  lessons::sharded_relative_error(s.comm, run.dx, s.one.dx, every));
    result.error = std::max(result.error, error);
    result.run += (result.run.empty() ? "" : ",") + std::to_string(r);
    if (step_ms(run) < fastest_ms) {
      fastest_ms = step_ms(run);
      result.fastest_r = r;
    }
    table.add_row({r, dist::layout_name(r), run.forward_ms, run.backward_ms, step_ms(run) / step_ms(s.one),
                   static_cast<double>(run.step.weight_elements_sent), error});
  }
  s.out.show(table);
  dist::ExpertParallelGpu chooser(*ranks.layer, config, shard.tokens);  // the cost model reads its settings
  result.cost_model_r = dist::choose_gpu_layout(chooser).r;
  s.out.say("  The table's fastest layout: r = " + std::to_string(result.fastest_r) +
            "; the cost model's (uniform routing, " + "H200 figures): r = " + std::to_string(result.cost_model_r) +
            ".\n"
            "  r = 0 moves every expert (all-gather, then an all-reduce of their gradients) and no token; r > 1\n"
            "  moves H / r slices of its group's experts and each kept row to r ranks. At this tiny D and H the\n"
            "  weights are cheap to move; at Tutel's sizes they decide (the cost model's table on the CPU path).\n");
  return result;
}

// Tutel's mechanisms on the GPU layer (distributed/ep/expert_parallel_gpu.h): the pipelining degrees
// d = 1, 2, 4, 8 timed, the layer's own adaptive choice of d with its trial times, the 2DH exchange
// against the flat one, and every valid layout r (set_layout) with the cost model's and the
// measurement's choice of r; every pipelining and 2DH variant's y bit for bit d = 1's (B = 64: the
// portable kernels compute a row the same way whatever rows surround it), every layout's y and dx
// within bf16 tolerance of r = 1's, and d = 1 against the CPU reference. Collective; returns the
// exit code.
int run_on_gpu(dist::MpiCommunicator& world, const lessons::LessonOptions& options, const lessons::RankFlags& flags,
               MoeConfig config, const Shard& shard) {
  // The GPU's block-sparse kernels tile by B = 64 or 128, with D and H multiples of B: the lesson's
  // D = 32, H = 64, B = 8 become D = 64, H = 128, B = 64 (T, E, K as on the CPU ranks).
  config.model_dim = 64;
  config.hidden_dim = 128;
  config.block_size = 64;
  auto start = lessons::start_gpu_lesson(world, flags.backend, options, kName, "07", config);
  if (!start.output) return start.exit_code;
  const lessons::GpuRanks& ranks = *start.ranks;
  lessons::RankOutput& out = *start.output;
  dist::Communicator& comm = world;
  const int R = comm.size();
  out.say("Lesson 07 on the GPU: R=" + std::to_string(R) + " ranks over " + ranks.backend + ", " +
          std::to_string(ranks.ranks_per_gpu) + " rank(s) per GPU; " + ranks.devices[0] + ".\n  The layer: T=" +
          std::to_string(config.tokens) + " (T_r=" + std::to_string(shard.tokens) + " a rank), D=" +
          std::to_string(config.model_dim) + ", H=" + std::to_string(config.hidden_dim) + ", E=" +
          std::to_string(config.num_experts) + ", K=" + std::to_string(config.top_k) +
          ", dropless, B=64. Times: the slowest rank's median of 10 steps (CUDA events).\n");
  if (ranks.ranks_per_gpu > 1) {
    out.say("  NOTE: ranks share a GPU, so the MPI backend stages every exchange through host memory (the host\n"
            "  runs the exchange while the GPU runs the experts): the schedule is Tutel's, the times are not an\n"
            "  interconnect's.\n");
  }

  const lessons::LessonData data =
      lessons::rounded_to_bf16(lessons::draw_lesson_data(config, options.seed, /*with_random_tokens=*/false));
  lessons::GpuLessonLayer gpu(*start.ranks, comm, config, data.text_x, data.dy, data.weights, shard.offset,
                              shard.tokens);
  const lessons::GpuLayerRun one = gpu.run({.pipeline_chunks = 1}, kWarmup, kTimed);
  const int trials = static_cast<int>(dist::kAdaptiveCandidates.size()) * dist::kTrialStepsPerCandidate;
  const lessons::GpuLayerRun adaptive =
      gpu.run({.pipeline_chunks = dist::kAdaptivePipelineChunks}, /*warmup: the trials, then the choice*/ trials + 1,
              kTimed);
  const GpuSection section{comm, out, gpu, one};
  const bool pipelined_bitwise = gpu_pipelining(section, adaptive);
  const dist::PipelineChoice& choice = adaptive.step.pipeline;
  const bool chose_a_candidate =
      std::find(choice.candidates.begin(), choice.candidates.end(), choice.chosen) != choice.candidates.end();
  show_gpu_trials(out, choice);
  const GpuHierarchical hierarchical = gpu_hierarchical(section);
  const GpuLayouts layouts = gpu_layouts(section, ranks, config, shard);

  // ---- the verdict: d = 1 against the CPU reference, and the checks above ----
  const ref::LayerForward reference = ref::moe_forward(config, data.text_x, data.weights);
  const lessons::ReferenceCheck check =
      lessons::check_against_reference(comm, one, reference, nullptr, shard.offset, shard.tokens, config.top_k);
  const bool pass = check.pass(config.tokens) && pipelined_bitwise && chose_a_candidate && hierarchical.bitwise &&
                    layouts.error <= lessons::kGpuTolerance;
  std::ostringstream message;
  message << std::setprecision(2) << "GPU layer on R=" << R << " ranks (" << ranks.backend
          << "): d=1 vs CPU reference y rel_err=" << check.y_error << " tol=" << lessons::kGpuTolerance
          << " (tokens routed otherwise: " << check.routed_otherwise << "); d=2,4,8 and adaptive (chose d="
          << choice.chosen << ") y bit for bit d=1: " << (pipelined_bitwise ? "yes" : "NO")
          << "; 2DH == flat bit for bit at G=" << (hierarchical.node_sizes.empty() ? "none (R=1)" : hierarchical.node_sizes)
          << ": " << (hierarchical.bitwise ? "yes" : "NO") << "; layouts r=" << layouts.run
          << " y, dx vs r=1 max rel_err=" << layouts.error << " (fastest r=" << layouts.fastest_r
          << ", cost model r=" << layouts.cost_model_r << ")";
  return out.finish(pass, message.str());
}
#else
int run_on_gpu(dist::MpiCommunicator& world, const lessons::LessonOptions&, const lessons::RankFlags&, MoeConfig,
               const Shard&) {
  return lessons::no_gpu_path(world, kName);
}
#endif

// ---- the lesson's opening ----

void introduce(lessons::RankOutput& out, const MoeConfig& config, int R) {
  out.say("Lesson 07: Tutel on R=" + std::to_string(R) + " CPU ranks (real run: T=" + std::to_string(config.tokens) +
          ", D=" + std::to_string(config.model_dim) + ", H=" + std::to_string(config.hidden_dim) + ", E=" +
          std::to_string(config.num_experts) + ", K=" + std::to_string(config.top_k) + "; cost models at GPU sizes)\n");
}

// ---- 1. adaptive pipelining: the cost model ----

struct PipelineShape {
  std::string name;
  int64_t tokens_per_rank, D, H, K;
  double link_speed;  // 1 = the measured NVLink pair
};

const std::vector<int> kDegrees{1, 2, 4, 8};  // the pipelining degrees d of sections 1 and 2

// One shape at every degree d: the exchange and the experts per chunk, and the schedule.
struct ModelledShape {
  PipelineShape shape;
  std::vector<double> exchange_us, experts_us;  // per chunk, [degree]
  std::vector<Schedule> schedules;              // [degree]
  size_t best = 0;  // the fastest; d = 1 unless another is strictly faster
};

std::vector<ModelledShape> model_pipelining(const Link& link) {
  const std::vector<PipelineShape> shapes{
      {"Tutel's layer, NVLink", 16384, 2048, 8192, 2, 1.0},
      {"Tutel's layer, link 8x slower (hypothetical)", 16384, 2048, 8192, 2, 0.125},
      {"T_r=1024 (small batch), NVLink", 1024, 2048, 8192, 2, 1.0}};
  std::vector<ModelledShape> modelled;
  for (const PipelineShape& s : shapes) {
    const double bytes = static_cast<double>(s.tokens_per_rank * s.K * s.D) * kBf16Bytes;  // T_r*K*D*2 each way
    const double flops = 4.0 * static_cast<double>(s.tokens_per_rank * s.K) * s.D * s.H;
    ModelledShape m;
    m.shape = s;
    for (int d : kDegrees) {
      m.exchange_us.push_back(link.latency_us + bytes / d / (link.bytes_per_us * s.link_speed));
      m.experts_us.push_back(flops / d / kExpertFlopsPerUs);
      m.schedules.push_back(simulate(d, m.exchange_us.back(), m.experts_us.back()));
    }
    for (size_t i = 1; i < m.schedules.size(); ++i) {
      if (m.schedules[i].total_us < m.schedules[m.best].total_us) m.best = i;
    }
    modelled.push_back(std::move(m));
  }
  return modelled;
}

void show_pipelining_model(lessons::RankOutput& out, const Link& link, const std::vector<ModelledShape>& modelled) {
  out.say("\nThe cost model: exchange = " + text(link.latency_us, 1) + " us + bytes / " +
          text(link.bytes_per_us / 1e3, 0) + " GB/s (fit of the 2 x H200 all-to-all sweep, 2026-11-24);\n"
          "experts = FLOPs / 623 TFLOP/s (grouped GEMM, one H200, 2026-11-21). Forward of one layer, per rank.\n");
  Table table("Table 1: d chunks, forward time from the cost model (bf16 rows; the comm stream carries both exchanges)",
              {"shape", "d", "exchange a chunk (us)", "experts a chunk (us)", "forward (us)", "vs d=1",
               "model's choice"});
  for (const ModelledShape& m : modelled) {
    for (size_t i = 0; i < m.schedules.size(); ++i) {
      table.add_row({i == 0 ? m.shape.name : "", kDegrees[i], m.exchange_us[i], m.experts_us[i],
                     m.schedules[i].total_us, m.schedules[i].total_us / m.schedules[0].total_us,
                     i == m.best ? "<- best" : ""});
    }
  }
  out.show(table);
}

// The schedules of one shape as text lanes, and as spans in the run record (step = d), so that the
// viewer's timeline draws them.
void show_timelines(lessons::RankOutput& out, const std::vector<Schedule>& schedules) {
  const int columns = 72;
  double longest = 0;
  for (const Schedule& s : schedules) longest = std::max(longest, s.total_us);
  const double us_per_column = longest / columns;
  std::ostringstream lanes;
  lanes << "\nTimelines of Tutel's layer on NVLink (one column = " << text(us_per_column, 0)
        << " us; digits are chunk numbers, '.' a stream waiting):\n";
  for (size_t i = 0; i < schedules.size(); ++i) {
    const Schedule& s = schedules[i];
    lanes << "  d=" << kDegrees[i] << "  " << text(s.total_us, 0) << " us\n"
          << "    dispatch |" << lane(s.dispatch, us_per_column, columns) << "\n"
          << "    experts  |" << lane(s.experts, us_per_column, columns) << "\n"
          << "    combine  |" << lane(s.combine, us_per_column, columns) << "\n";
    if (RunWriter* writer = out.writer()) {
      for (const auto& [spans, stream, stream_name, name] :
           {std::tuple{&s.dispatch, 1, "comm (cost model)", "dispatch"},
            std::tuple{&s.experts, 0, "compute (cost model)", "expert_compute"},
            std::tuple{&s.combine, 1, "comm (cost model)", "combine"}}) {
        for (const Span& span : *spans) {
          writer->append(to_event(SpanEvent{.step = kDegrees[i], .rank = 0, .stream = stream,
                                            .stream_name = stream_name, .name = name, .start_us = span.start,
                                            .duration_us = span.end - span.start}));
        }
      }
    }
  }
  out.say(lanes.str());
}

// ---- 2. adaptive pipelining: the real run, d = 1, 2, 4, 8 on CPU ranks ----

struct ChunkCheck {
  double error = 0;                          // the largest max_rel_err against d = 1
  bool y_bitwise = true;                     // every d's y bit for bit d = 1's
  std::optional<LayerResult> flat_dropless;  // d = 1, flat: the 2DH runs compare with it
};

// "a b c": the rows each chunk computed, summed over the ranks. Collective.
std::string rows_per_chunk(dist::Communicator& comm, const LayerResult& result, int d) {
  std::vector<int64_t> rows;
  for (const auto& chunk : result.forward.chunks) rows.push_back(chunk.expert_plan.total_rows);
  rows = dist::all_gather<int64_t>(comm, rows);  // [R, d]
  std::string rows_text;
  for (int ch = 0; ch < d; ++ch) {
    int64_t sum = 0;
    for (int r = 0; r < comm.size(); ++r) sum += rows[r * d + ch];
    if (ch) rows_text += ' ';
    rows_text += std::to_string(sum);
  }
  return rows_text;
}

ChunkCheck run_pipelining(dist::Communicator& comm, lessons::RankOutput& out, const MoeConfig& config,
                          const lessons::LessonData& data, const Shard& shard) {
  ChunkCheck check;
  Table table("Table 2: the real run in d chunks on " + std::to_string(comm.size()) +
                  " CPU ranks (zipf text), forward and backward, against d=1",
              {"formulation", "d", "rows computed per chunk (all ranks)", "max_rel_err vs d=1", "y bit for bit",
               "all bit for bit"});
  for (Formulation formulation : {Formulation::dropless, Formulation::padded}) {
    MoeConfig c = config;
    c.formulation = formulation;
    std::optional<LayerResult> one;
    for (int d : kDegrees) {
      LayerResult result = run_layer(comm, c, data.text_x, data.dy, data.weights, shard,
                                     {.pipeline_chunks = d, .hierarchical = nullptr});
      Comparison cmp;
      if (one) {
        cmp = compare(comm, result, *one);
        check.error = std::max(check.error, cmp.max_rel_err);
        check.y_bitwise = check.y_bitwise && cmp.y_bitwise;
      }
      table.add_row({std::string(to_string(formulation)), d, rows_per_chunk(comm, result, d), cmp.max_rel_err,
                     d == 1 ? "-" : (cmp.y_bitwise ? "yes" : "no"), d == 1 ? "-" : (cmp.bitwise ? "yes" : "no")});
      if (!one) one = std::move(result);
    }
    if (formulation == Formulation::dropless) check.flat_dropless = std::move(one);
  }
  out.show(table);
  out.say("  The chunks split each expert's row space (its kept rows, or C when padded): every row is\n"
          "  computed once, y bit for bit. Dropless rounds each chunk's rows up to B: more padding. The\n"
          "  gradients (weights, and dx over a token's K slots) add up chunk by chunk: another order.\n");
  return check;
}

// ---- 3. the 2D hierarchical all-to-all ----

// The message arithmetic per rank for b bytes per rank each way (Tutel's layer: 128 MiB).
void show_message_arithmetic(lessons::RankOutput& out) {
  const double b = 16384.0 * 2 * 2048 * kBf16Bytes;
  Table table("Table 3: messages a rank sends in one all-to-all of b = 128 MiB per rank (uniform routing)",
              {"R", "G", "exchange", "messages within node", "KiB each", "messages across nodes", "KiB each"});
  auto kib = [](double bytes) { return static_cast<int64_t>(std::llround(bytes / 1024)); };
  for (const auto& [ranks, per_node] : {std::pair{4, 2}, std::pair{64, 8}, std::pair{256, 8}}) {
    const int nodes = ranks / per_node;
    table.add_row({ranks, per_node, "flat", per_node - 1, kib(b / ranks), ranks - per_node, kib(b / ranks)});
    table.add_row({"", "", "2DH stage 1", per_node - 1, kib(b / per_node), 0, "-"});
    table.add_row({"", "", "2DH stage 2", 0, "-", nodes - 1, kib(b / nodes)});
  }
  out.show(table);
  out.say("  Flat: R - G messages of b/R cross nodes. 2DH: N - 1 messages of b/N, each G times larger;\n"
          "  the bytes that cross nodes are the same, the messages G times fewer. The price: stage 1\n"
          "  moves (G-1)/G of b once more inside the node, and two local copies reorder the blocks.\n");
}

// The messages of one exchange stage, within and across nodes.
struct StageMessages {
  int64_t within = 0, across = 0, within_bytes = 0, across_bytes = 0;
  void add(bool same_node, int64_t bytes) {
    if (bytes <= 0) return;
    if (same_node) ++within, within_bytes += bytes;
    else ++across, across_bytes += bytes;
  }
};

// The flat exchange and the two 2DH stages of the dispatch [R, R] (bytes rank s sends rank t) in
// nodes of G ranks.
std::array<StageMessages, 3> count_messages(const std::vector<int64_t>& dispatch_bytes, int R, int G) {
  const int N = R / G;
  StageMessages flat, stage1, stage2;
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < R; ++t)
      if (s != t) flat.add(s / G == t / G, dispatch_bytes[s * R + t]);
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      for (int g2 = 0; g2 < G; ++g2) {  // stage 1: (n, g) -> (n, g2), all it has for ranks (*, g2)
        int64_t bytes = 0;
        for (int n2 = 0; n2 < N; ++n2) bytes += dispatch_bytes[(n * G + g) * R + n2 * G + g2];
        if (g2 != g) stage1.add(true, bytes);
      }
      for (int n2 = 0; n2 < N; ++n2) {  // stage 2: (n, g) -> (n2, g), node n's blocks for (n2, g)
        int64_t bytes = 0;
        for (int g_source = 0; g_source < G; ++g_source) bytes += dispatch_bytes[(n * G + g_source) * R + n2 * G + g];
        if (n2 != n) stage2.add(false, bytes);
      }
    }
  }
  return {flat, stage1, stage2};
}

// The real dispatch of section 2 (dropless, d = 1), flat and 2DH, at every node size 1 < G < R.
void show_real_messages(lessons::RankOutput& out, const std::vector<int64_t>& dispatch_rows, int R, int64_t D) {
  std::vector<int> node_sizes;
  for (int g = 2; g < R; ++g) if (R % g == 0) node_sizes.push_back(g);
  if (node_sizes.empty()) {
    out.say("\n(Table 4 needs R with a node size 1 < G < R, e.g. -np 4; skipped at R=" + std::to_string(R) + ")\n");
    return;
  }
  std::vector<int64_t> dispatch_bytes;
  for (int64_t rows : dispatch_rows) dispatch_bytes.push_back(rows * D * static_cast<int64_t>(kBf16Bytes));
  Table table("Table 4: the real dispatch of Table 2 (dropless, d=1), flat and 2DH, bytes as bf16 rows",
              {"G", "exchange", "messages within node", "bytes within node", "messages across nodes",
               "bytes across nodes", "mean message across (bytes)"});
  for (int G : node_sizes) {
    const auto stages = count_messages(dispatch_bytes, R, G);
    const char* names[] = {"flat", "2DH stage 1", "2DH stage 2"};
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageMessages& s = stages[i];
      table.add_row({G, names[i], s.within, s.within_bytes, s.across, s.across_bytes,
                     s.across > 0 ? s.across_bytes / s.across : int64_t{0}});
    }
  }
  out.show(table);
}

struct HierarchicalCheck {
  bool bitwise = true;     // the layer and the bf16 dispatch at every G
  std::string node_sizes;  // the G checked, "1,2,4"
};

HierarchicalCheck check_hierarchical(dist::Communicator& comm, lessons::RankOutput& out, const MoeConfig& config,
                                     const lessons::LessonData& data, const Shard& shard, const LayerResult& flat) {
  const int R = comm.size();
  HierarchicalCheck check;
  Table table("Table 5: the layer through the 2DH all-to-all against the flat one (dropless, d=1, forward and backward)",
              {"G", "nodes N", "y, dx, dWg, dW1, dW2 bit for bit", "bf16 dispatch bit for bit"});
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    dist::HierarchicalAllToAll hierarchical(comm, G);
    const LayerResult result = run_layer(comm, config, data.text_x, data.dy, data.weights, shard,
                                         {.pipeline_chunks = 1, .hierarchical = &hierarchical});
    const bool layer_same = compare(comm, result, flat).bitwise;
    const bool exchange_same = same_exchange(comm, hierarchical, flat.forward.chunks[0].send_rows,
                                             flat.forward.chunks[0].recv_rows, config.model_dim);
    check.bitwise = check.bitwise && layer_same && exchange_same;
    if (!check.node_sizes.empty()) check.node_sizes += ',';
    check.node_sizes += std::to_string(G);
    table.add_row({G, R / G, layer_same ? "yes" : "NO", exchange_same ? "yes" : "NO"});
  }
  out.show(table);
  return check;
}

// ---- 4. parallelism switching (Tutel's r): the cost model ----

void show_switching_model(lessons::RankOutput& out) {
  struct SwitchShape {
    std::string name;
    int ranks;
    int64_t E, D, H, K, tokens_per_rank;
  };
  const std::vector<SwitchShape> shapes{
      {"Tutel's layer: R=2 E=32 D=2048 H=8192 T_r=16384", 2, 32, 2048, 8192, 2, 16384},
      {"small experts: R=8 E=4 D=1024 H=1024 T_r=16384", 8, 4, 1024, 1024, 2, 16384},
      {"large experts: R=8 E=4 D=4096 H=14336 T_r=8192", 8, 4, 4096, 14336, 2, 8192}};
  const double busbw = 249e9;  // 2 x H200 all-to-all at 256 MiB, 2026-11-24; a stand-in for every collective
  Table table("Table 6: one training step of the layer per rank under Tutel's r (cost model, bf16, K=2)",
              {"shape", "r", "layout", "expert weights held (MiB)", "weight bytes a step (MiB)",
               "token bytes a step (MiB)", "ms at 249 GB/s", "least"});
  const double MiB = 1 << 20;
  for (const SwitchShape& s : shapes) {
    const double P = static_cast<double>(s.E) * 2 * s.D * s.H * kBf16Bytes;  // every expert's W1 and W2
    const double stored = P / s.ranks;                                          // each rank's slice, every r
    const double b = static_cast<double>(s.tokens_per_rank * s.K * s.D) * kBf16Bytes;  // one exchange
    const double crossing = static_cast<double>(s.ranks - 1) / s.ranks;
    std::vector<std::vector<nlohmann::json>> rows;
    double least = 1e300;
    size_t least_row = 0;
    for (int r : {0, 1, 2}) {
      const double held = r == 0 ? P : P / std::min<double>(s.ranks, static_cast<double>(s.E * r));
      const double weight_bytes = 2 * (held - stored);                        // all-gather + reduce-scatter
      const double token_bytes = r == 0 ? 0 : 4 * b * r * crossing;           // 2 exchanges fwd, 2 bwd
      const double ms = 1e3 * (weight_bytes + token_bytes) / busbw;
      const std::string layout = r == 0 ? "data parallel: every expert on every rank"
                                 : r == 1 ? "expert parallel"
                                          : "each expert sharded over 2 ranks along H";
      if (ms < least) least = ms, least_row = rows.size();
      rows.push_back({rows.empty() ? s.name : "", r, layout, held / MiB, weight_bytes / MiB, token_bytes / MiB, ms, ""});
    }
    rows[least_row].back() = "<-";
    for (auto& row : rows) table.add_row(row);
  }
  out.show(table);
  out.say("  Expert FLOPs are the same in every layout; r trades the memory a rank holds against the bytes\n"
          "  it moves. Tutel stores 1/R of the expert parameters on each rank for every r and gathers what\n"
          "  r needs, so r can change between steps with no parameter moved (the real run follows).\n");
}

// ---- 4. parallelism switching: the real run on CPU ranks, every valid r over one storage ----

struct LayoutCheck {
  double error = 0;     // the largest against the single-device layer
  std::string checked;  // the r run, "0,1,2"
};

// Every valid layout r in every formulation against the single-device layer, and the traffic of
// each layout's dropless step. Collective.
struct LayoutRuns {
  std::vector<int> layouts;
  std::vector<std::vector<double>> errors;      // [layout][formulation]
  std::vector<dist::LayoutTraffic> traffic;     // [layout] dropless, this rank, forward + backward
  std::vector<int64_t> kept_dropless;           // [R, E] of the dropless step
};

LayoutRuns run_layouts(dist::Communicator& comm, const MoeConfig& config, const lessons::LessonData& data,
                       const dist::ExpertParallelWeights& stored, const Shard& shard) {
  LayoutRuns runs;
  runs.layouts = dist::valid_layouts(config, comm.size());
  runs.errors.resize(runs.layouts.size());
  runs.traffic.resize(runs.layouts.size());
  for (Formulation formulation : {Formulation::dropless, Formulation::padded, Formulation::dropping}) {
    MoeConfig c = config;
    c.formulation = formulation;
    const ref::LayerForward reference = ref::moe_forward(c, data.text_x, data.weights);
    const ref::LayerGradients reference_grads = ref::moe_backward(c, data.text_x, data.weights, reference, data.dy);
    for (size_t i = 0; i < runs.layouts.size(); ++i) {
      const LayoutRun run = run_layout(comm, c, data.text_x, data.dy, stored, shard, runs.layouts[i]);
      runs.errors[i].push_back(error_against_reference(comm, run, reference, reference_grads, shard));
      if (formulation == Formulation::dropless) {
        runs.traffic[i] = run.forward.traffic;
        runs.traffic[i] += run.grads.traffic;
        runs.kept_dropless = run.forward.kept_per_rank_expert;
      }
    }
  }
  return runs;
}

LayoutCheck switch_layouts(dist::Communicator& comm, lessons::RankOutput& out, const MoeConfig& config,
                           const lessons::LessonData& data, const Shard& shard, const Link& link) {
  const int R = comm.size();
  // The stored placement of every layout: rank q keeps experts [q E_r, (q+1) E_r) whole.
  const dist::ExpertParallelWeights stored = dist::local_weights(config, data.weights, shard.rank, R);
  const LayoutRuns runs = run_layouts(comm, config, data, stored, shard);
  LayoutCheck check;
  for (const auto& errors : runs.errors)
    for (double e : errors) check.error = std::max(check.error, e);
  for (int r : runs.layouts) check.checked += (check.checked.empty() ? "" : ",") + std::to_string(r);

  // The choice: the cost model on this step's counts (section 1's H200 figures, bf16 elements),
  // and the measurement of every layout on these CPU ranks (host MPI and Eigen).
  dist::LayoutCostModel model;
  model.latency_us = link.latency_us;
  model.bytes_per_us = link.bytes_per_us;
  model.expert_flops_per_us = kExpertFlopsPerUs;
  model.bytes_per_element = kBf16Bytes;
  const dist::LayoutChoice modelled = dist::choose_layout(config, R, runs.kept_dropless, model);
  if (RunWriter* writer = out.writer()) {  // the dropless step's routing, for moe_sim --trace
    writer->append(to_event(lessons::expert_load_of(0, 0, runs.kept_dropless, R)));
  }
  const dist::LayoutChoice measured =
      dist::measure_layouts(comm, config, data.text_x.middleRows(shard.offset, shard.tokens),
                            data.dy.middleRows(shard.offset, shard.tokens), stored, runs.layouts, 5);

  Table table("Table 7: the real run in every layout on " + std::to_string(R) +
                  " CPU ranks (T=2048 D=32 H=64 E=8 K=2, zipf text), forward and backward, against the "
                  "single-device layer",
              {"layout", "max_rel_err dropless", "padded", "dropping", "weight KiB sent a step (all ranks)",
               "token KiB sent a step (all ranks)", "messages", "model (us, H200 figures, bf16)",
               "measured (us, host MPI)"});
  for (size_t i = 0; i < runs.layouts.size(); ++i) {
    // Bytes as run here: double, 8 bytes an element, summed over the ranks (dropless step).
    const std::vector<int64_t> all = dist::all_gather<int64_t>(
        comm, std::vector<int64_t>{runs.traffic[i].weight_elements, runs.traffic[i].token_elements,
                                   runs.traffic[i].messages});
    int64_t weight_elements = 0, token_elements = 0, messages = 0;
    for (int p = 0; p < R; ++p) weight_elements += all[3 * p], token_elements += all[3 * p + 1], messages += all[3 * p + 2];
    table.add_row({dist::layout_name(runs.layouts[i]), runs.errors[i][0], runs.errors[i][1], runs.errors[i][2],
                   weight_elements * 8.0 / 1024, token_elements * 8.0 / 1024, messages,
                   modelled.estimates[i].total_us, measured.measured_us[i]});
  }
  out.show(table);
  out.say("  Every layout computes the same layer from the same stored experts: r = 0 gathers the experts\n"
          "  and moves no token, r = 1 moves tokens and no weight, r > 1 gathers H / r slices inside groups\n"
          "  of r ranks and sends each token to all r of them. The model's choice: " +
          dist::layout_name(modelled.r) + "; the measured choice (median of 5 calls, slowest rank): " +
          dist::layout_name(measured.r) + ".\n"
          "  The measured times are host MPI and Eigen on CPU ranks, not a GPU interconnect.\n");
  return check;
}

// ---- verdict ----

int verdict(lessons::RankOutput& out, int R, const ChunkCheck& chunks, const HierarchicalCheck& hierarchical,
            const LayoutCheck& layouts) {
  const bool pass = hierarchical.bitwise && chunks.error <= kTolerance && layouts.error <= kLayoutTolerance;
  std::ostringstream message;
  message << std::setprecision(2) << "on R=" << R << " ranks: 2DH == flat bit for bit at G=" << hierarchical.node_sizes
          << " (y, dx, dWg, dW1, dW2 and the bf16 dispatch): " << (hierarchical.bitwise ? "yes" : "NO")
          << "; d=2,4,8 == d=1 (dropless and padded, forward and backward): max_rel_err=" << chunks.error
          << " tol=" << kTolerance << ", y bit for bit: " << (chunks.y_bitwise ? "yes" : "no")
          << "; layouts r=" << layouts.checked << " == single device (3 formulations, forward and backward): "
          << (layouts.error <= kLayoutTolerance ? "PASS" : "FAIL") << " max_rel_err=" << layouts.error
          << " tol=" << kLayoutTolerance;
  return out.finish(pass, message.str());
}

// The CPU path: the lesson's sections in order, then the verdict. Collective; returns the exit code.
int run_on_cpu(dist::Communicator& comm, lessons::RankOutput& out, const lessons::LessonOptions& options,
               const MoeConfig& config, const Shard& shard) {
  introduce(out, config, comm.size());
  const Link link = measured_link();
  const std::vector<ModelledShape> modelled = model_pipelining(link);
  show_pipelining_model(out, link, modelled);
  show_timelines(out, modelled.front().schedules);

  const lessons::LessonData data = lessons::draw_lesson_data(config, options.seed, /*with_random_tokens=*/false);
  const ChunkCheck chunks = run_pipelining(comm, out, config, data, shard);
  const LayerResult& flat = *chunks.flat_dropless;
  show_message_arithmetic(out);
  show_real_messages(out, dist::all_gather<int64_t>(comm, flat.forward.chunks[0].send_rows), comm.size(),
                     config.model_dim);
  const HierarchicalCheck hierarchical = check_hierarchical(comm, out, config, data, shard, flat);

  show_switching_model(out);
  const LayoutCheck layouts = switch_layouts(comm, out, config, data, shard, link);
  return verdict(out, comm.size(), chunks, hierarchical, layouts);
}

}  // namespace

int main(int argc, char** argv) {
  lessons::RankFlags rank_flags;
  const auto options = lessons::parse_options(
      argc, argv, kName, lessons::gpu_flag_given(argc, argv) ? "runs/lesson07_tutel_gpu" : "runs/lesson07_tutel",
      [&](CLI::App& app) { lessons::add_rank_flags(app, rank_flags); });
  const MoeConfig config = lesson_config();
  return lessons::run_on_ranks(
      argc, argv, options, rank_flags, kName, "07", config,
      [&](dist::MpiCommunicator& world, const Shard& shard) { return run_on_gpu(world, options, rank_flags, config, shard); },
      [&](dist::Communicator& comm, lessons::RankOutput& out, const Shard& shard) {
        return run_on_cpu(comm, out, options, config, shard);
      });
}
