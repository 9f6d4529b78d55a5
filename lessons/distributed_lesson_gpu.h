// distributed_lesson_gpu.h: the GPU path of lessons 06 and 07 (their --gpu flag): the lesson's layer
// through the expert-parallel layer on the GPU (distributed/ep/expert_parallel_gpu.h), one process per
// rank, over NCCL where every rank has a GPU of its own and over MPI where ranks share one (staged
// through host memory; NCCL refuses two ranks on one GPU). Built only where CMake found CUDA
// (MOE_LESSON_HAS_CUDA); the lessons' CPU path is their default and needs none of this.
//   mpirun --oversubscribe -np 2 build/lessons/lesson06_expert_parallelism --gpu
//   mpirun --oversubscribe -np 2 build/lessons/lesson07_tutel --gpu --backend nccl
//
// What it measures: each step's forward and backward on the caller's stream between CUDA events,
// the median of the timed steps on each rank, then the slowest rank's (every rank waits for it).
// Where ranks share a GPU those times are of the sharing, not of a multi-GPU system.
// Dimension legend: T tokens (all ranks), T_r per rank, D model width, E experts, K top-k, R ranks.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"             // Communicator
#include "comm/mpi_communicator.h"         // MpiCommunicator
#include "distributed_lesson_support.h"    // RankOutput, LessonData, LessonOptions
#include "ep/expert_parallel_gpu.h"        // ExpertParallelGpu, ExpertParallelGpuOptions, ExpertParallelGpuStep
#include "reference_cpu/moe_layer.h"       // MoeWeights, LayerForward, LayerGradients

namespace moe::lessons {

// The ranks' GPUs and the communicator the layer runs on. Collective over world.
struct GpuRanks {
  std::string refusal;  // empty when the layer can run; else why not, the same text on every rank
  int exit_code = 0;    // with a refusal: 2 for a --backend this machine cannot honour, 1 for no GPU
  std::string backend;  // "nccl" or "mpi"
  int ranks_per_gpu = 1;             // the most ranks on one GPU
  std::vector<std::string> devices;  // one per rank: "GPU rank r: NAME (device i, ..., BACKEND)"
  std::unique_ptr<dist::Communicator> nccl;  // when backend == "nccl"
  dist::Communicator* layer = nullptr;       // NCCL, or the MPI world
  cudaStream_t stream = nullptr;

  GpuRanks() = default;
  ~GpuRanks();
  GpuRanks(const GpuRanks&) = delete;
  GpuRanks& operator=(const GpuRanks&) = delete;
};
// backend "auto": NCCL where the build has it and no two ranks share a GPU, else MPI.
std::unique_ptr<GpuRanks> open_gpu_ranks(dist::MpiCommunicator& world, const std::string& backend);

// The GPU path's start: the ranks' GPUs (open_gpu_ranks), then the run record with one device name
// per rank (RankOutput::open). Collective.
struct GpuLessonStart {
  std::unique_ptr<GpuRanks> ranks;
  std::optional<RankOutput> output;  // empty when the ranks refused or the record may not be written
  int exit_code = 0;                 // what every rank returns when `output` is empty
};
GpuLessonStart start_gpu_lesson(dist::MpiCommunicator& world, const std::string& backend,
                                const LessonOptions& options, const std::string& lesson_name,
                                const std::string& lesson_number, const MoeConfig& config);

// The lesson's data with x, dy and the weights rounded to bf16, so that the GPU layer and the CPU
// reference read the same numbers.
LessonData rounded_to_bf16(LessonData data);

// One configuration of the layer, run for a few steps on this rank's shard.
struct GpuLayerRun {
  ref::Matrix y, dx;             // this rank's [T_r, D] (dx empty with identity experts)
  std::vector<uint16_t> y_bits;  // y as bf16 bits, for bit-for-bit comparisons
  std::vector<int> top_experts;  // [T_r, K] the GPU router's choice
  dist::ExpertParallelGpuStep step;        // of the last step
  double forward_ms = 0, backward_ms = 0;  // the slowest rank's median over the timed steps
};

// The lesson's problem on this rank's GPU: its shard of x and dy and its experts' weights, in bf16,
// uploaded once. x, dy and the weights should already be bf16 values (round_bf16) so that the CPU
// reference reads the same numbers.
class GpuLessonLayer {
 public:
  GpuLessonLayer(GpuRanks& ranks, dist::Communicator& world, const MoeConfig& config,
                 const ref::Matrix& x,   // [T, D] all ranks' tokens
                 const ref::Matrix& dy,  // [T, D]
                 const ref::MoeWeights& weights, int64_t offset, int64_t tokens);
  ~GpuLessonLayer();
  GpuLessonLayer(const GpuLessonLayer&) = delete;
  GpuLessonLayer& operator=(const GpuLessonLayer&) = delete;

  // A layer with these options, in Tutel's layout r (set_layout; 1: expert parallel): warm-up
  // steps, then timed steps (a barrier before each), then one step more into NaN-filled outputs,
  // which are read back. Forward and backward (forward only with identity experts). With
  // options.placement, this rank's slots of that placement hold their experts' weights for the run.
  // Collective.
  GpuLayerRun run(const dist::ExpertParallelGpuOptions& options, int warmup_steps, int timed_steps, int layout = 1);

 private:
  struct Buffers;
  struct Experts;
  GpuRanks& ranks_;
  dist::Communicator& world_;
  MoeConfig config_;
  int64_t tokens_ = 0;  // T_r
  ref::MoeWeights weights_;  // every expert's, for the slots of a placement
  std::unique_ptr<Buffers> buffers_;
};

// ---- checks ----

inline constexpr double kGpuTolerance = 2e-2;  // against the CPU reference: bf16 activations, fp32 accumulation

// A GPU run against the CPU reference on all T tokens (double, from the same bf16 values).
struct ReferenceCheck {
  int64_t routed_otherwise = 0;   // tokens (all ranks) whose K experts differ: near-ties, left out below
  double y_error = 0;             // relative, over the other tokens
  double dx_error = 0;            // the same for dx, when the reference's gradients were given
  // y (and dx) within kGpuTolerance, and at most 1% of the tokens routed otherwise.
  bool pass(int64_t tokens) const {
    return y_error <= kGpuTolerance && dx_error <= kGpuTolerance && routed_otherwise <= tokens / 100;
  }
};
// Collective. `reference_grads` null: y alone.
ReferenceCheck check_against_reference(dist::Communicator& comm, const GpuLayerRun& run,
                                       const ref::LayerForward& reference, const ref::LayerGradients* reference_grads,
                                       int64_t offset, int64_t tokens, int64_t top_k);

// sqrt(sum over ranks of ||actual - expected||^2 / sum of ||expected||^2) over the rows where `keep`
// is true: the relative error of a tensor sharded over the ranks. Collective.
double sharded_relative_error(dist::Communicator& comm, const ref::Matrix& actual, const ref::Matrix& expected,
                              const std::vector<bool>& keep);

// This rank's tokens whose K experts are the same on the GPU and in the CPU reference, in the same
// order; the others sit on a near-tie that the GPU's bf16 logits break the other way.
std::vector<bool> same_routing(const std::vector<int>& gpu_top_experts, const ref::IndexMatrix& reference_top_experts,
                               int64_t offset, int64_t tokens, int64_t top_k);

}  // namespace moe::lessons
