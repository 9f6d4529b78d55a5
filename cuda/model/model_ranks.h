// model/model_ranks.h: what the model and its trainer need from other ranks when the model is
// trained on several GPUs, as two small interfaces. distributed/train/ implements them over a
// Communicator (NCCL or MPI) and FastMoE's expert-parallel layer; on one GPU there are no other
// ranks, ModelGpu makes MoeLayerGpu blocks itself and the trainer passes no ModelRanks.
//
// The layout they serve (data parallel + expert parallel): R ranks, each with N / R of a global
// batch's N sequences. Every parameter except the experts is replicated: the same on every rank,
// its gradient summed over the ranks before the optimizer (all_reduce_sum). The experts are placed
// E / R per rank (rank r holds experts [r E_r, (r + 1) E_r) of every MoE block) and their
// gradients stay where they live: the expert-parallel layer already sums every rank's tokens'
// contributions on the expert's rank. A placement (ModelGpuConfig::expert_placements) may put any
// experts on any rank, with replicas; the model then also sums a replicated expert's gradients over
// its replicas, once a step (sum_replica_gradients).
//
// Dimension legend: T_r this rank's tokens (N / R sequences of S), T = R T_r, D, E, K, R as usual.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/bf16.h"          // bf16
#include "core/device_buffer.h" // DeviceBuffer
#include "core/phase_timer.h"   // PhaseTimer
#include "moe/moe_layer.h"      // MoeLayerWeights, MoeLayerGradients, MoeLayerGpu
#include "expert_placement.h"   // dist::ExpertPlacement
#include "moe_config.h"         // MoeConfig

namespace moe::cuda {

// The FFN of one MoE block as the model calls it. On one GPU: MoeLayerGpu. On several: the
// expert-parallel layer, whose weight tables hold this rank's E_r experts and whose forward and
// backward are collective (every rank calls them in the same order).
class MoeBlockFfn {
 public:
  virtual ~MoeBlockFfn() = default;
  // y [T_r, D] = the layer on x [T_r, D]; router_input: the gate's input when pre-gated, else null.
  virtual void forward(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
                       const bf16* router_input) = 0;
  // forward() and backward() in stages, for the model's two-micro-batch overlap (model.h), each on
  // the same stream; the model enqueues the other micro-batch's stages between them:
  //   forward_route    routing and, on several ranks, the count exchange sent
  //   forward_receive_counts  on several ranks, the host waits for the counts (a forward's host
  //                    wait): the model enqueues the other micro-batch's routing before it
  //   forward_experts  the rows out to the experts, and the experts
  //   forward_combine  the rows back, and the weighted combine into y
  //   backward_experts dy's rows out, and the experts' backward
  //   backward_combine dx's rows back, and the router's backward
  // Here the first stage of each only keeps its arguments and the last runs forward() or
  // backward(); the expert-parallel layer runs each stage where it says. The arguments stay valid
  // until the last stage; aux_loss() and z_loss() are ready after forward_combine (on several ranks
  // after forward_receive_counts).
  virtual void forward_route(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
                             const bf16* router_input);
  virtual void forward_receive_counts(cudaStream_t) {}
  virtual void forward_experts(cudaStream_t) {}
  virtual void forward_combine(cudaStream_t stream);
  virtual void backward_experts(const bf16* x, const MoeLayerWeights& weights, const bf16* dy,
                                const MoeLayerGradients& gradients, cudaStream_t stream, const bf16* router_input,
                                float* d_router_input);
  virtual void backward_combine(cudaStream_t stream);
  // Gradients of sum(dy .* y) + aux_loss_coef aux + z_loss_coef z (summed over ranks: the router
  // losses are global), overwritten. On several ranks d_gate_weights is this rank's part only.
  virtual void backward(const bf16* x, const MoeLayerWeights& weights, const bf16* dy,
                        const MoeLayerGradients& gradients, cudaStream_t stream, const bf16* router_input,
                        float* d_router_input) = 0;
  // Gradient accumulation (MoeLayerGpu's forward_micro_batch, backward_micro_batch and
  // expert_weight_gradients): micro-batch m's forward and its backward without the experts' weight
  // gradients (dx and d_gate_weights its own, overwritten), then those over every micro-batch at
  // once. One GPU only: the expert-parallel layer does not keep micro-batches (these throw).
  virtual void forward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights, bf16* y,
                                   cudaStream_t stream, const bf16* router_input);
  virtual void backward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights, const bf16* dy,
                                    float* dx, float* d_gate_weights, cudaStream_t stream, const bf16* router_input,
                                    float* d_router_input);
  virtual void expert_weight_gradients(float* const* d_w1, float* const* d_w2, cudaStream_t stream);
  // A placement with replicas: each replicated expert's weight gradients (the tables of this rank's
  // experts) summed over its replicas. The model calls it once a step per MoE block, on its gradient
  // stream after adding up the micro-batches' gradients, so the sum runs beside the next block's
  // backward instead of inside each micro-batch's. Collective; nothing on one GPU.
  virtual void sum_replica_gradients(float* const* /*d_w1*/, float* const* /*d_w2*/, cudaStream_t) {}
  virtual const float* aux_loss() const = 0;  // [1] device, unscaled, of the last forward (global)
  virtual const float* z_loss() const = 0;    // [1] device, unscaled
  virtual const DeviceBuffer<int>& top_experts() const = 0;  // [T_r, K] of the last forward
  // Token rows this rank's last forward sent to each rank, [R] (the all-to-all's row of its byte
  // matrix, in rows); empty on one GPU.
  virtual std::vector<int64_t> rows_sent_per_rank() const { return {}; }
  // The last forward's routed slots of each expert over all ranks' tokens, [E] on the host (before
  // any dropping: the load a placement by load balances); empty on one GPU, where reading the
  // routing back would cost a wait of the host.
  virtual std::vector<int64_t> expert_load() const { return {}; }
  // Tutel's pipelining degree d of the last forward (1 on one GPU) and, where the layer chooses d by
  // measurement, the candidates with their trial times (the slowest rank's forward + backward, ms;
  // negative until measured) and the kept d (0 while the trials run).
  struct PipelineDegree {
    int last = 1;
    bool adaptive = false;
    std::vector<int> candidates;
    std::vector<double> trial_ms;
    int chosen = 1;
  };
  virtual PipelineDegree pipeline_degree() const { return {}; }
  // Names the layer's own phases on the timeline (inside the model's "moe" phase); null stops.
  // lane: the micro-batch whose stream calls this layer (0, or 1 of two overlapped), which names the
  // layer's own streams on the timeline (the expert-parallel layer's exchange stream).
  virtual void set_phase_timer(PhaseTimer* timer, int lane) = 0;
  // The single-GPU layer, where it is one (tests and recording read its internals); else null.
  virtual const MoeLayerGpu* single_gpu_layer() const { return nullptr; }

 private:
  struct Staged {  // the first stage's arguments, for the last
    const bf16* x = nullptr;
    MoeLayerWeights weights;
    bf16* y = nullptr;
    const bf16* dy = nullptr;
    MoeLayerGradients gradients;
    const bf16* router_input = nullptr;
    float* d_router_input = nullptr;
    int stage = 0;  // 1 after forward_route, 2 after backward_experts
  };
  Staged staged_;
};

inline void MoeBlockFfn::forward_route(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t,
                                       const bf16* router_input) {
  staged_ = Staged{};
  staged_.x = x;
  staged_.weights = weights;
  staged_.y = y;
  staged_.router_input = router_input;
  staged_.stage = 1;
}
inline void MoeBlockFfn::forward_combine(cudaStream_t stream) {
  if (staged_.stage != 1) throw std::logic_error("MoeBlockFfn::forward_combine without a forward_route");
  staged_.stage = 0;
  forward(staged_.x, staged_.weights, staged_.y, stream, staged_.router_input);
}
inline void MoeBlockFfn::backward_experts(const bf16* x, const MoeLayerWeights& weights, const bf16* dy,
                                          const MoeLayerGradients& gradients, cudaStream_t, const bf16* router_input,
                                          float* d_router_input) {
  staged_ = Staged{};
  staged_.x = x;
  staged_.weights = weights;
  staged_.dy = dy;
  staged_.gradients = gradients;
  staged_.router_input = router_input;
  staged_.d_router_input = d_router_input;
  staged_.stage = 2;
}
inline void MoeBlockFfn::backward_combine(cudaStream_t stream) {
  if (staged_.stage != 2) throw std::logic_error("MoeBlockFfn::backward_combine without a backward_experts");
  staged_.stage = 0;
  backward(staged_.x, staged_.weights, staged_.dy, staged_.gradients, stream, staged_.router_input,
           staged_.d_router_input);
}

inline void MoeBlockFfn::forward_micro_batch(int, const bf16*, const MoeLayerWeights&, bf16*, cudaStream_t,
                                             const bf16*) {
  throw std::logic_error("MoeBlockFfn::forward_micro_batch: micro-batches are for the one-GPU layer (MoeLayerGpu)");
}
inline void MoeBlockFfn::backward_micro_batch(int, const bf16*, const MoeLayerWeights&, const bf16*, float*, float*,
                                              cudaStream_t, const bf16*, float*) {
  throw std::logic_error("MoeBlockFfn::backward_micro_batch: micro-batches are for the one-GPU layer (MoeLayerGpu)");
}
inline void MoeBlockFfn::expert_weight_gradients(float* const*, float* const*, cudaStream_t) {
  throw std::logic_error("MoeBlockFfn::expert_weight_gradients: micro-batches are for the one-GPU layer (MoeLayerGpu)");
}

// The other ranks, for ModelGpu (device collectives, the MoE blocks) and the trainer (host ones).
// Every call is collective: all ranks make the same calls in the same order.
class ModelRanks {
 public:
  virtual ~ModelRanks() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;                // R
  virtual std::string description() const = 0; // "2 ranks over NCCL", for logs and run records

  // An MoE block's FFN whose experts are spread over the ranks as `placement` says (this rank's
  // slots are the experts whose weights the model hands it). layer_config.tokens is T (all ranks'
  // tokens), local_tokens is T_r.
  virtual std::unique_ptr<MoeBlockFfn> make_moe_ffn(const MoeConfig& layer_config, int64_t local_tokens,
                                                    const dist::ExpertPlacement& placement) = 0;

  // Sums device data [count] over the ranks in place, ordered on `stream`.
  virtual void all_reduce_sum(float* data, int64_t count, cudaStream_t stream) = 0;
  virtual void all_reduce_sum(double* data, int64_t count, cudaStream_t stream) = 0;

  // Host buffers.
  virtual void host_all_reduce_sum(std::vector<double>& values) = 0;
  // Every rank's `mine` (the same length on every rank), concatenated in rank order, on every rank.
  virtual std::vector<float> host_all_gather(const std::vector<float>& mine) = 0;
  virtual std::vector<int32_t> host_all_gather(const std::vector<int32_t>& mine) = 0;
  virtual void barrier() = 0;
};

}  // namespace moe::cuda
