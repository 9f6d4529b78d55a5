// distributed_lesson_gpu.cpp: the GPU path of lessons 06 and 07 (see distributed_lesson_gpu.h), run
// by `mpirun --oversubscribe -np 2 build/lessons/lesson06_expert_parallelism --gpu` (or lesson07_tutel).
#include "distributed_lesson_gpu.h"

#include <mpi.h>  // MPI_Comm_split_type: the ranks of this host

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iostream>
#include <stdexcept>

#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/device_buffer.h"     // DeviceBuffer
#include "core/device_info.h"       // why_no_gpu
#include "bridge/reference_bridge.h"  // bf16_of, matrix_of
#include "moe/block_sparse.h"       // expert_pointer_table
#include "expert_placement.h"    // contiguous_placement
#if MOE_HAVE_NCCL
#include "comm/nccl_communicator.h"      // NcclCommunicator
#endif

namespace moe::lessons {

using cuda::DeviceBuffer;
using dist::bf16;

// ---- the ranks' GPUs ----

GpuRanks::~GpuRanks() {
  if (stream != nullptr) cudaStreamDestroy(stream);
}

std::unique_ptr<GpuRanks> open_gpu_ranks(dist::MpiCommunicator& world, const std::string& backend) {
  auto ranks = std::make_unique<GpuRanks>();
  const int R = world.size();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    (void)cudaGetLastError();
    devices = 0;
  }
  const std::vector<int64_t> all_devices = dist::all_gather<int64_t>(world, devices);
  std::string without;
  for (int r = 0; r < R; ++r) {
    if (all_devices[r] == 0) without += (without.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!without.empty()) {  // every rank knows which ranks lack a GPU: all refuse together
    ranks->refusal = (devices == 0 ? cuda::why_no_gpu() : std::string("no usable GPU")) + " (rank(s) " + without +
                     "); the lesson's CPU path runs without --gpu";
    ranks->exit_code = 1;
    return ranks;
  }

  // This rank's GPU: its place among the ranks of its host, modulo the host's GPUs.
  const auto [local_rank, local_ranks] = world.host_rank();
  const int device = local_rank % devices;
  CUDA_CHECK(cudaSetDevice(device));
  int sharing = 0;
  for (int r = 0; r < local_ranks; ++r) sharing += r % devices == device;
  const std::vector<int64_t> all_sharing = dist::all_gather<int64_t>(world, sharing);
  ranks->ranks_per_gpu = static_cast<int>(*std::max_element(all_sharing.begin(), all_sharing.end()));

#if MOE_HAVE_NCCL
  constexpr bool built_with_nccl = true;
#else
  constexpr bool built_with_nccl = false;
#endif
  if (backend == "nccl" && !built_with_nccl) {
    ranks->refusal = "--backend nccl: this build has no NCCL; use --backend mpi";
    ranks->exit_code = 2;
    return ranks;
  }
  if (backend == "nccl" && ranks->ranks_per_gpu > 1) {
    ranks->refusal = "--backend nccl needs one GPU per rank (NCCL refuses two ranks on one GPU); " +
                     std::to_string(ranks->ranks_per_gpu) + " ranks share a GPU here: use --backend mpi";
    ranks->exit_code = 2;
    return ranks;
  }
  ranks->backend = backend == "auto" ? (built_with_nccl && ranks->ranks_per_gpu == 1 ? "nccl" : "mpi") : backend;

  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  std::array<uint8_t, 64> name{};
  std::memcpy(name.data(), properties.name, std::min(std::strlen(properties.name), name.size() - 1));
  const std::vector<uint8_t> names = dist::all_gather<uint8_t>(world, std::span<const uint8_t>(name));
  const std::vector<int64_t> device_of = dist::all_gather<int64_t>(world, device);
  for (int r = 0; r < R; ++r) {
    const char* text = reinterpret_cast<const char*>(names.data() + static_cast<size_t>(r) * name.size());
    ranks->devices.push_back("GPU rank " + std::to_string(r) + ": " + std::string(text) + " (device " +
                             std::to_string(device_of[r]) + ", ExpertParallelGpu, bf16, " + ranks->backend + ")");
  }
#if MOE_HAVE_NCCL
  if (ranks->backend == "nccl") {  // under the world's watchdog, which then aborts NCCL on a stuck call
    ranks->nccl = std::make_unique<dist::NcclCommunicator>(world, /*stream=*/nullptr, world.watchdog());
  }
#endif
  ranks->layer = ranks->nccl ? ranks->nccl.get() : static_cast<dist::Communicator*>(&world);
  CUDA_CHECK(cudaStreamCreateWithFlags(&ranks->stream, cudaStreamNonBlocking));
  return ranks;
}

GpuLessonStart start_gpu_lesson(dist::MpiCommunicator& world, const std::string& backend,
                                const LessonOptions& options, const std::string& lesson_name,
                                const std::string& lesson_number, const MoeConfig& config) {
  GpuLessonStart start;
  start.ranks = open_gpu_ranks(world, backend);
  if (!start.ranks->refusal.empty()) {
    if (world.rank() == 0) std::cerr << lesson_name << " --gpu: " << start.ranks->refusal << "\n";
    start.exit_code = start.ranks->exit_code;
    return start;
  }
  start.output = RankOutput::open(world, options, lesson_name, lesson_number, config, start.ranks->devices);
  if (!start.output) start.exit_code = 2;
  return start;
}

LessonData rounded_to_bf16(LessonData data) {
  for (ref::Matrix* m : {&data.text_x, &data.random_x, &data.dy, &data.weights.gate_weights}) *m = cuda::round_bf16(*m);
  for (auto& w : data.weights.w1) w = cuda::round_bf16(w);
  for (auto& w : data.weights.w2) w = cuda::round_bf16(w);
  return data;
}

// ---- the layer ----

// A rank's expert slots: each holds its expert's weights and room for their gradients.
struct GpuLessonLayer::Experts {
  DeviceBuffer<bf16> w1, w2;                     // [slots, D, H] [slots, H, D]
  DeviceBuffer<const bf16*> w1_table, w2_table;  // [slots]
  DeviceBuffer<float> d_w1, d_w2;
  DeviceBuffer<float*> d_w1_table, d_w2_table;
  Experts(const ref::MoeWeights& weights, const std::vector<int64_t>& experts, int64_t D, int64_t H) {
    std::vector<ref::Matrix> w1_slots, w2_slots;
    for (int64_t e : experts) {
      w1_slots.push_back(weights.w1[static_cast<size_t>(e)]);
      w2_slots.push_back(weights.w2[static_cast<size_t>(e)]);
    }
    const int n = static_cast<int>(experts.size());
    w1 = DeviceBuffer<bf16>(cuda::bf16_of(w1_slots));
    w2 = DeviceBuffer<bf16>(cuda::bf16_of(w2_slots));
    w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), n, static_cast<size_t>(D * H));
    w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), n, static_cast<size_t>(H * D));
    d_w1 = DeviceBuffer<float>(static_cast<size_t>(n * D * H));
    d_w2 = DeviceBuffer<float>(static_cast<size_t>(n * H * D));
    d_w1_table = cuda::expert_pointer_table(d_w1.data(), n, static_cast<size_t>(D * H));
    d_w2_table = cuda::expert_pointer_table(d_w2.data(), n, static_cast<size_t>(H * D));
  }
};

struct GpuLessonLayer::Buffers {
  DeviceBuffer<bf16> x, dy, gate, y;           // [T_r, D] [T_r, D] [D, E] [T_r, D]
  DeviceBuffer<float> dx, d_gate;              // [T_r, D] [D, E]
  std::unique_ptr<Experts> experts;            // E / R in id order
};

GpuLessonLayer::GpuLessonLayer(GpuRanks& ranks, dist::Communicator& world, const MoeConfig& config,
                               const ref::Matrix& x, const ref::Matrix& dy, const ref::MoeWeights& weights,
                               int64_t offset, int64_t tokens)
    : ranks_(ranks), world_(world), config_(config), tokens_(tokens), weights_(weights),
      buffers_(std::make_unique<Buffers>()) {
  const int R = ranks.layer->size(), rank = ranks.layer->rank();
  const int64_t D = config.model_dim, H = config.hidden_dim;
  Buffers& b = *buffers_;
  b.x = DeviceBuffer<bf16>(cuda::bf16_of(ref::Matrix(x.middleRows(offset, tokens))));
  b.dy = DeviceBuffer<bf16>(cuda::bf16_of(ref::Matrix(dy.middleRows(offset, tokens))));
  b.gate = DeviceBuffer<bf16>(cuda::bf16_of(weights.gate_weights));
  b.experts = std::make_unique<Experts>(weights, dist::contiguous_placement(config.num_experts, R).experts_of(rank), D, H);
  b.y = DeviceBuffer<bf16>(static_cast<size_t>(tokens * D));
  b.dx = DeviceBuffer<float>(static_cast<size_t>(tokens * D));
  b.d_gate = DeviceBuffer<float>(static_cast<size_t>(D * config.num_experts));
  CUDA_CHECK(cudaDeviceSynchronize());
}

GpuLessonLayer::~GpuLessonLayer() = default;

GpuLayerRun GpuLessonLayer::run(const dist::ExpertParallelGpuOptions& options, int warmup_steps, int timed_steps,
                                int layout) {
  Buffers& b = *buffers_;
  const cudaStream_t stream = ranks_.stream;
  const bool ffn = options.experts == dist::ExpertCompute::ffn;
  dist::ExpertParallelGpu layer(*ranks_.layer, config_, tokens_, options);
  if (layout != 1) layer.set_layout(layout);
  std::unique_ptr<Experts> placed;  // a placement's slots, for this run
  if (options.placement != nullptr) {
    placed = std::make_unique<Experts>(weights_, options.placement->experts_of(ranks_.layer->rank()),
                                       config_.model_dim, config_.hidden_dim);
  }
  const Experts& experts = placed ? *placed : *b.experts;
  const dist::ExpertParallelGpuWeights weights{b.gate.data(), experts.w1_table.data(), experts.w2_table.data()};
  const dist::ExpertParallelGpuGradients gradients{b.dx.data(), b.d_gate.data(), experts.d_w1_table.data(),
                                                   experts.d_w2_table.data()};
  cudaEvent_t start = nullptr, forwarded = nullptr, done = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&forwarded));
  CUDA_CHECK(cudaEventCreate(&done));
  auto step = [&] {
    CUDA_CHECK(cudaEventRecord(start, stream));
    layer.forward(b.x.data(), tokens_, weights, b.y.data(), stream);
    CUDA_CHECK(cudaEventRecord(forwarded, stream));
    if (ffn) layer.backward(b.x.data(), weights, b.dy.data(), gradients, stream);
    CUDA_CHECK(cudaEventRecord(done, stream));
    CUDA_CHECK(cudaEventSynchronize(done));
  };
  for (int i = 0; i < warmup_steps; ++i) step();
  std::vector<double> forward_ms, backward_ms;
  for (int i = 0; i < timed_steps; ++i) {
    world_.barrier();
    step();
    float forward = 0, backward = 0;
    CUDA_CHECK(cudaEventElapsedTime(&forward, start, forwarded));
    CUDA_CHECK(cudaEventElapsedTime(&backward, forwarded, done));
    forward_ms.push_back(forward);
    backward_ms.push_back(backward);
  }
  b.y.fill_bytes(0xFF, stream);  // NaN poison: the last step must write every element
  b.dx.fill_bytes(0xFF, stream);
  step();
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(forwarded));
  CUDA_CHECK(cudaEventDestroy(done));
  GpuLayerRun run;
  const int64_t D = config_.model_dim;
  const std::vector<bf16> y = b.y.download();
  run.y_bits.resize(y.size());
  std::memcpy(run.y_bits.data(), y.data(), y.size() * sizeof(bf16));
  run.y = cuda::matrix_of(y, tokens_, D);
  if (ffn) run.dx = cuda::matrix_of(b.dx.download(), tokens_, D);
  const std::vector<int> top = layer.top_experts().download();
  run.top_experts.assign(top.begin(), top.begin() + tokens_ * config_.top_k);
  run.step = layer.last_step();
  auto slowest_median = [&](std::vector<double> times) {
    double median = 0;
    if (!times.empty()) {
      std::sort(times.begin(), times.end());
      median = times[times.size() / 2];
    }
    const std::vector<double> all = dist::all_gather<double>(world_, median);
    return *std::max_element(all.begin(), all.end());
  };
  run.forward_ms = slowest_median(forward_ms);
  run.backward_ms = slowest_median(backward_ms);
  return run;
}

// ---- checks ----

ReferenceCheck check_against_reference(dist::Communicator& comm, const GpuLayerRun& run,
                                       const ref::LayerForward& reference, const ref::LayerGradients* reference_grads,
                                       int64_t offset, int64_t tokens, int64_t top_k) {
  const std::vector<bool> same = same_routing(run.top_experts, reference.router.top_experts, offset, tokens, top_k);
  std::vector<int64_t> flipped{static_cast<int64_t>(std::count(same.begin(), same.end(), false))};
  dist::all_reduce_sum<int64_t>(comm, flipped);
  ReferenceCheck check;
  check.routed_otherwise = flipped[0];
  check.y_error = sharded_relative_error(comm, run.y, reference.y.middleRows(offset, tokens), same);
  if (reference_grads != nullptr) {
    check.dx_error = sharded_relative_error(comm, run.dx, reference_grads->x.middleRows(offset, tokens), same);
  }
  return check;
}

double sharded_relative_error(dist::Communicator& comm, const ref::Matrix& actual, const ref::Matrix& expected,
                              const std::vector<bool>& keep) {
  std::vector<double> sums{0.0, 0.0};
  for (int64_t t = 0; t < expected.rows(); ++t) {
    if (!keep[static_cast<size_t>(t)]) continue;
    const double difference = (actual.row(t) - expected.row(t)).squaredNorm();
    sums[0] += std::isfinite(difference) ? difference : 1e300;
    sums[1] += expected.row(t).squaredNorm();
  }
  dist::all_reduce_sum<double>(comm, sums);
  return sums[1] > 0 ? std::sqrt(sums[0] / sums[1]) : std::sqrt(sums[0]);
}

std::vector<bool> same_routing(const std::vector<int>& gpu_top_experts, const ref::IndexMatrix& reference_top_experts,
                               int64_t offset, int64_t tokens, int64_t top_k) {
  std::vector<bool> same(static_cast<size_t>(tokens), true);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      if (gpu_top_experts[static_cast<size_t>(t * top_k + k)] != reference_top_experts(offset + t, k)) {
        same[static_cast<size_t>(t)] = false;
      }
    }
  }
  return same;
}

}  // namespace moe::lessons
