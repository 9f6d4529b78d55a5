// ep_bench_harness.h: the one harness of ep_bench, in the shape of nccl-tests' src/common.cu: a
// size sweep (-b -e -f), warm-up, timed iterations with CUDA events, the median, a data check
// after the timing, and one table row per (variant, size) with size, count, type, time (us), algbw,
// busbw and the error, so that a wrong answer shows in the same table as the speed. Each variant
// (ep_bench_variants.h) only says what it moves, how to prepare and check it, and the call itself.
//   mpirun -np 2 build/distributed/bench/ep_bench --backend nccl
//
// Bandwidth as nccl-tests defines it for all-to-all: algbw = bytes a rank moves / time, busbw =
// algbw * (R - 1) / R (the part that leaves the rank). A variant states how many bytes a rank moves
// per run: the size for one all-to-all, twice the size for dispatch + combine (there and back).
// Time is the slowest rank's median (every iteration starts after a barrier); the error column
// is the sum over ranks of wrong elements (exact checks) or the largest relative error (the layer).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/collective_timeout.h"  // kDefaultCollectiveTimeoutSeconds
#include "comm/communicator.h"     // Communicator
#include "core/phase_timer.h"  // PhaseTimer
#include "comm/device_exchange.h"  // DeviceExchange
#include "moe_config.h"       // Formulation

namespace moe::dist::bench {

// The layer rows' shape (per rank: T_r tokens on each of R ranks, T = R T_r).
struct LayerShape {
  int64_t tokens_per_rank = 16384;  // T_r
  int64_t model_dim = 2048;         // D
  int64_t hidden_dim = 8192;        // H
  int64_t experts = 32;             // E
  int64_t top_k = 2;                // K
  int64_t block_size = 128;         // B
  Formulation formulation = Formulation::dropless;
  double capacity_factor = 1.0;
};

struct BenchOptions {
  std::string backend;  // "nccl" or "mpi"; empty: nccl where built
  std::vector<int64_t> sizes;  // bytes per rank; from -b -e -f, or 1, 16, 64, 256 MiB
  int warmup_runs = 5;         // -w
  double warmup_ms = 1000.0;   // --warmup-ms: and at least this much load (the clock's ramp)
  int iterations = 20;         // -n
  LayerShape layer;            // --layer T,D,H,E,K and --block, --formulation, --capacity-factor
  std::vector<int> pipeline_chunks{1, 2, 4, 8};  // --pipeline-chunks 1,2,4,8
  bool adaptive = true;        // the layer's own choice of d as a row too (--no-adaptive: not)
  bool layouts = false;        // --layouts: the layer in each of Tutel's other layouts r (0, r > 1) too
  bool overlap = false;        // --overlap: the d = 1 step as two overlapped micro-batches too
  int hierarchical_ranks_per_node = 0;  // --nodes-of G: 2DH rows beside the flat ones (G > 1 dividing R)
  double zipf = 0;             // --zipf S: the layer rows' router prefers expert e by (e + 1)^-S; 0: not
  std::vector<std::string> placements;  // --placements plain,eplb1,eplb2,shadow: the layer at d = 1 placed so
  std::vector<std::string> variants{"count", "alltoall", "dispatch", "layer"};  // --only
  std::string out;             // --out FILE.json
  uint64_t seed = 1234;
  double collective_timeout_seconds = kDefaultCollectiveTimeoutSeconds;  // --collective-timeout S: the watchdog's
  bool help = false;
};

// Throws std::invalid_argument naming the flag (common/command_line.h's wording); --help sets help.
BenchOptions parse_options(int argc, char** argv);
std::string usage();

// What every variant gets: the communicators, this rank's stream and the options.
struct BenchContext {
  Communicator& host;        // MPI world: barriers before each timed run, the results
  Communicator& layer;       // what the layer and the raw exchange run on (NCCL or MPI)
  DeviceExchange& exchange;  // device buffers over `layer`
  int rank = 0, ranks = 1;
  int ranks_per_gpu = 1;     // ranks of this host that share this rank's GPU
  double gpu_memory_bytes = 0;
  cudaStream_t stream = nullptr;
  BenchOptions options;
};

// What a variant moves at one size, set up outside the timing.
struct Prepared {
  int64_t size_bytes = 0;   // the size column: bytes per rank
  int64_t count = 0;        // the count column: elements, or tokens for the layer
  std::string type;         // the type column
  double bytes_moved = 0;   // per rank per run, for algbw
};

struct Check {
  double error = 0;    // wrong elements (exact), or a relative error
  bool exact = true;
  std::string note;    // why there is no check, if there is none
  bool available = true;
};

// One phase of a row's run as the layer names it on its PhaseTimer (cuda/core/phase_timer.h): the
// median over a few runs of its time in one run (summed where a run enters it more than once).
struct PhaseTime {
  std::string name;
  double median_us = 0;
  int stream = 0;           // 0: the caller's stream; 1, 2, ...: others in the order first seen
  std::string stream_name;  // the timeline row the layer named it (an exchange stream, a second micro-batch's)
};

// One variant: nccl-tests' struct of functions, as an interface.
class Variant {
 public:
  virtual ~Variant() = default;
  virtual std::string name() const = 0;
  virtual std::vector<int64_t> sizes(const BenchOptions& options) const { return options.sizes; }
  virtual Prepared prepare(int64_t size_bytes) = 0;
  virtual void run(cudaStream_t stream) = 0;  // the timed call
  virtual Check check() = 0;                   // after the timed runs
  virtual int host_syncs() const { return 0; }  // waits of the host on the GPU in one run
  // After the check: a few runs more with the layer's phases timed (none for a raw collective).
  // Collective: every rank makes the same runs.
  virtual std::vector<PhaseTime> phases(cudaStream_t) { return {}; }
  virtual void release() {}                    // the size's buffers
};

// `runs` calls of run() with `timer` collecting after each; each phase's median, a phase being a
// name on a stream. A phase on an exchange stream includes the time its collective waits for the
// slowest peer.
std::vector<PhaseTime> median_phases(cuda::PhaseTimer& timer, int runs, const std::function<void()>& run);

struct Row {
  std::string variant;
  int64_t size_bytes = 0, count = 0;
  std::string type;
  double time_us = 0, algbw_gbs = 0, busbw_gbs = 0;
  Check check;
  int host_syncs = 0;
  std::vector<PhaseTime> phases;  // this rank's (the table prints rank 0's)
};

// Prepares, warms up, times, checks and releases one (variant, size); collective over ctx.host.
Row measure(BenchContext& ctx, Variant& variant, int64_t size_bytes);

std::string table_header();
std::string table_line(const Row& row);

}  // namespace moe::dist::bench
