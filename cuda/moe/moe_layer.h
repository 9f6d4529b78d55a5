// moe/moe_layer.h: one whole MoE layer on the GPU, forward and backward, in the three formulations.
// This is the layer the training, offload and distributed code reuse; its oracle is the CPU
// reference's moe::ref::moe_forward / moe_backward (reference_cpu/moe_layer.h).
// Built into moe_cuda; tested by tests/cuda/test_moe_layer.cpp; dumped to .npy by moe_layer_dump.
//
// Forward, each step one launch (or one CUB / cuBLAS call) on the caller's stream:
//   router      logits = x Wg (cuBLAS), fused softmax + top-K + combine weights, router losses
//   plan        histogram, prefix sums, stable sort by expert (moe/dispatch.h)
//   topology    BCSR + transpose indices of the hidden matrix (dropless only, moe/topology.h)
//   permute     gather x into expert order, padding rows zeroed (moe/permute.h); on the
//               dropless Hopper path with narrow experts the SDD gathers x's rows itself as it
//               copies them (block_sparse.h, ExpertRows, gathering_pays), and the permute runs
//               in the backward instead, for the weight gradient dW1
//   experts     dropless: block-sparse SDD (+ the activation in its epilogue) and DSD on tensor
//               cores (block_sparse.h)
//               padded / dropping: cuBLAS batched GEMMs over [E, C, D] (the GShard / Tutel way;
//               dropping is padded with the capacity C = ceil(cf*T*K/E): the same kept tokens, the
//               same output, C rows computed per expert)
//   combine     y[t] = sum_k w[t,k] expert_out[row of (t,k)]
// No step reads anything back to the host: counts stay on the GPU and every buffer and grid is sized
// by host-known bounds (device_plan.h). Backward runs the same steps in reverse.
//
// Pre-gated routing (Pre-gated MoE, Hwang et al., ISCA 2024; reference_cpu/pregated_layer.h): the
// router may read another tensor than the experts (router_input, the previous MoE block's input in
// the model), and the backward then splits the input gradient in two: dx through the experts,
// d_router_input through the gate. With no router_input both are one tensor and dx gets their sum.
//
// Precision: bf16 activations and weights, fp32 accumulation; router logits, probabilities and
// combine weights in fp32; weight and input gradients in fp32.
// Activations: GeLU, and SwiGLU (W1 [D, 2H], the gate columns then the up columns, hidden =
// silu(gate) * up, as reference_cpu/expert_ffn.h). Dropless runs SwiGLU as two SDDs over W1's halves,
// the second with silu(gate) * up in its epilogue, and its backward as one SDD whose epilogue writes
// d_gate and d_up, two DDS for dW1's halves and one DSD over [d_gate | d_up] for dx. Padded and
// dropping make one [C, D] x [D, 2H] product per expert, then one fused SwiGLU pass
// (moe/activation.h). No jitter (checked in the constructor with a clear error, as the activation).
//
// Gradient accumulation over M micro-batches (dropless only): a step's batch runs as M micro-batches
// of T tokens, each with its own routing, forward and backward (dx and the router), while the
// expert weight gradients dW1 = xᵀ d_pre and dW2 = hiddenᵀ d_out run once at the end, as one DSᵀD
// and one DDS over every micro-batch's rows (MicroBatchTopology, moe/topology.h). One micro-batch
// of T tokens gives each expert T*K/E rows on average, too few for the weight-gradient tiles to
// amortise their writes (lesson 03, "Rows per expert"); over M micro-batches they reduce over M
// times as many rows and write the gradients once. The price is memory: the layer keeps every
// micro-batch's permuted x, hidden blocks, output gradients and d_pre blocks (SwiGLU: d_up too)
// until the end of the step, about M x (2 D + 2 H, SwiGLU 3 H) x 2 bytes a routed row, which
// layer_memory_bytes counts and the constructor checks against the free memory before allocating.
// Padded and dropping are rejected with micro_batches > 1: their per-expert capacity rows are
// batched GEMMs, whose weight gradients a caller accumulates by running the layer per micro-batch.
//
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k,
// C capacity, B block size, M micro-batches.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/bf16.h"           // bf16
#include "moe/block_sparse.h"    // ExpertRows
#include "moe/topology.h"        // TopologyBuffers, MicroBatchTopology
#include "core/device_buffer.h"  // DeviceBuffer
#include "moe/dispatch.h"        // DispatchPlanBuffers
#include "core/gemm.h"           // CublasHandle
#include "moe_config.h"          // MoeConfig
#include "core/phase_timer.h"    // PhaseTimer
#include "moe/router.h"          // RouterWorkspace

namespace moe::cuda {

struct MoeLayerWeights {           // device memory, owned by the caller
  const bf16* gate_weights = nullptr;  // [D, E]
  const bf16* const* w1 = nullptr;     // device array [E] -> [D, w1_columns] per expert (H; SwiGLU 2H)
  const bf16* const* w2 = nullptr;     // device array [E] -> [H, D] per expert
};

// Expert outputs computed elsewhere (a decoder's host experts, offload/host_expert_choice.h): the
// slots marked in `replace` take their expert's output row from `rows` instead of the GPU's, just
// before the combine. Device memory, owned by the caller.
struct ReplacedRows {
  const bf16* rows = nullptr;        // [T*K, D] by slot t*K+k: the output of expert top_experts[t,k] on token t
  const int32_t* replace = nullptr;  // [T*K] non-zero: take the slot's row from `rows`
};

struct MoeLayerGradients {         // device memory, owned by the caller; overwritten, not accumulated
  float* dx = nullptr;                // [T, D]
  float* d_gate_weights = nullptr;    // [D, E]
  float* const* d_w1 = nullptr;       // device array [E] -> [D, w1_columns]
  float* const* d_w2 = nullptr;       // device array [E] -> [H, D]
};

// GPU memory the layer allocates for `config` (and M micro-batches' weight-gradient operands), an
// estimate with a 10% margin.
double layer_memory_bytes(const MoeConfig& config, int micro_batches = 1);
// Throws std::invalid_argument naming both figures when the layer needs more than free_bytes.
// The constructor calls it with cudaMemGetInfo's free memory before allocating anything.
void check_layer_fits(const MoeConfig& config, size_t free_bytes, int micro_batches = 1);
// What MoeLayerGpu::set_compacted_weight_gradients(true) allocates: the operands' copies over
// M T K + E (B - 1) rows.
double compacted_weight_gradient_bytes(const MoeConfig& config, int micro_batches);

// One micro-batch's config: `batch` with tokens = batch.tokens / micro_batches. Throws
// std::invalid_argument when micro_batches < 1 or does not divide batch.tokens.
MoeConfig micro_batch_config(const MoeConfig& batch, int micro_batches);

class MoeLayerGpu {
 public:
  // Validates the config (moe::validate, then GeLU or SwiGLU (H even), no jitter, E and K within the router's
  // limits, dropless B of 64 or 128) and allocates every buffer for T tokens. micro_batches = M >= 1
  // (M > 1: dropless only) keeps M micro-batches' weight-gradient operands for accumulation (below).
  explicit MoeLayerGpu(const MoeConfig& config, int micro_batches = 1);

  // router_input: what the gate reads; nullptr (the default) routes x itself.
  // forward is route(router_input or x, weights.gate_weights) then compute_experts(x, weights, y):
  // the same launches in the same order, so the same bits.
  void forward(const bf16* x,  // [T, D] the experts' input
               const MoeLayerWeights& weights,
               bf16* y,        // [T, D]
               cudaStream_t stream,
               const bf16* router_input = nullptr);  // [T, D] the gate's input, or nullptr

  // ---- forward in two halves: a block's experts are known before they run ----
  // A decoding model routes a block, reads top_experts() back if its experts must be fetched (the
  // on-demand path), or routes it one MoE block early from the previous block's input (Pre-gated
  // MoE), and only then runs the experts, from wherever they are by then.
  //   route            router (logits, softmax, top-K, combine weights, router losses), dispatch
  //                    plan, topology: afterwards top_experts(), combine_weights() and plan() hold
  //                    this routing on the device
  //   compute_experts  permute (or the SDD's gather), the experts, combine, for the last route()
  //                    = run_experts then combine: between the two a decoder computes some experts
  //                    on the host, and combine puts their rows in place of the GPU's (ReplacedRows)
  void route(const bf16* router_input,  // [T, D] what the gate reads: x itself when self-gated
             const bf16* gate_weights,  // [D, E]
             cudaStream_t stream);
  // weights.w1 and w2 are read; weights.gate_weights is not (route() used it).
  void compute_experts(const bf16* x,  // [T, D] the experts' input
                       const MoeLayerWeights& weights,
                       bf16* y,        // [T, D]
                       cudaStream_t stream);
  void run_experts(const bf16* x, const MoeLayerWeights& weights, cudaStream_t stream);
  // y = the combine of the last run_experts' rows, with `replaced`'s rows first put in place when given.
  void combine(bf16* y, cudaStream_t stream, const ReplacedRows* replaced = nullptr);

  // Gradients of L = sum(dy .* y) + aux_loss_coef * aux + z_loss_coef * z, for the x, weights and
  // routing of the last forward() (call forward first, with the same x, router_input and weights;
  // route + compute_experts count as a forward).
  // The gradient through the gate goes to d_router_input when it is given (overwritten), and
  // gradients.dx then holds only the part through the experts; with d_router_input = nullptr it is
  // added into dx. A separate router_input needs a d_router_input: its gradient is not dx's.
  void backward(const bf16* x,   // [T, D] the experts' input
                const MoeLayerWeights& weights,
                const bf16* dy,  // [T, D]
                const MoeLayerGradients& gradients, cudaStream_t stream,
                const bf16* router_input = nullptr,  // [T, D] as given to forward
                float* d_router_input = nullptr);    // [T, D] or nullptr

  // ---- gradient accumulation: M micro-batches, one expert weight-gradient product ----
  // A step over M micro-batches of config.tokens tokens each:
  //   for m = 0 .. M-1:
  //     forward_micro_batch(m, x_m, weights, y_m, stream)
  //     backward_micro_batch(m, x_m, weights, dy_m, dx_m, d_gate_weights, stream)
  //   expert_weight_gradients(d_w1, d_w2, stream)
  // Each micro-batch routes on its own and its gradients are those of its own loss
  // L_m = sum(dy_m .* y_m) + aux_loss_coef * aux_m + z_loss_coef * z_m (the router losses are
  // statistics of the tokens routed together, as in any framework that accumulates); the step's
  // gradients are the sums over m. With zero loss coefficients they equal one batch of all M*T
  // tokens. forward_micro_batch is forward() writing micro-batch m's slot; backward_micro_batch is
  // backward() without the expert weight gradients: dx [T, D] and d_gate_weights [D, E] are
  // micro-batch m's own (overwritten), which the caller accumulates with its other parameters'.
  // expert_weight_gradients writes dW1 and dW2 (overwritten, fp32), the sums over the M
  // micro-batches' rows, and needs each m's backward since the last call. dropless only (else
  // std::invalid_argument).
  void forward_micro_batch(int micro_batch, const bf16* x,  // [T, D]
                           const MoeLayerWeights& weights,
                           bf16* y,                          // [T, D]
                           cudaStream_t stream,
                           const bf16* router_input = nullptr);  // [T, D] or nullptr
  void backward_micro_batch(int micro_batch, const bf16* x,  // [T, D]
                            const MoeLayerWeights& weights,
                            const bf16* dy,                  // [T, D]
                            float* dx,                       // [T, D]
                            float* d_gate_weights,           // [D, E] this micro-batch's
                            cudaStream_t stream,
                            const bf16* router_input = nullptr,  // [T, D] as given to the forward
                            float* d_router_input = nullptr);    // [T, D] or nullptr
  void expert_weight_gradients(float* const* d_w1,  // device array [E] -> [D, w1_columns]
                               float* const* d_w2,  // device array [E] -> [H, D]
                               cudaStream_t stream);
  int micro_batches() const { return micro_batches_; }

  // Compaction before the weight gradients (MicroBatchTopology::build_compacted): on, each
  // expert_weight_gradients first copies every operand's rows (x and d_out, D wide; hidden and d_pre,
  // H wide; SwiGLU's d_up) into one layout where each expert's rows of all M micro-batches are padded
  // to B once, then runs the two products over it. Off (the default), the products walk the M slots
  // and multiply each micro-batch's padding rows. The same rows are summed in the same order; the
  // tiles' k-steps group them differently, so the gradients agree to fp32 rounding, not bit for bit
  // (bit for bit where every micro-batch's expert counts are multiples of B: the layouts coincide).
  // Allocates the copies (compacted_weight_gradient_bytes), checked against the free memory.
  // Needs M > 1 and the dropless formulation, else std::invalid_argument.
  void set_compacted_weight_gradients(bool on);
  bool compacted_weight_gradients() const { return compacted_x_.size() > 0; }

  // Times and names each phase (router, plan, topology, permute, experts, combine, and their
  // backward) on the GPU timeline; nullptr (the default) records nothing.
  void set_phase_timer(PhaseTimer* timer) { timer_ = timer; }

  const MoeConfig& config() const { return config_; }
  int max_rows() const { return plan_.max_rows(); }

  // ---- what the last forward computed, on the device (for tests, lessons, .npy dumps) ----
  const DispatchPlanBuffers& plan() const { return plan_; }
  const TopologyBuffers* topology() const { return topology_.get(); }  // dropless only
  const DeviceBuffer<float>& probs() const { return router_.probs; }                      // [T, E]
  const DeviceBuffer<int>& top_experts() const { return router_.top_experts; }            // [T, K]
  const DeviceBuffer<float>& combine_weights() const { return router_.combine_weights; }  // [T, K]
  const DeviceBuffer<float>& aux_loss() const { return router_.aux_loss; }                // [1] unscaled
  const DeviceBuffer<float>& z_loss() const { return router_.z_loss; }                    // [1] unscaled
  // The forward's SDD gathers x's rows (no permute before it); the backward then permutes.
  bool gathers_rows() const { return gathers_rows_; }
  const DeviceBuffer<bf16>& expert_out() const { return expert_out_; }             // [max_rows, D]

 private:
  void experts_forward(const bf16* x, const MoeLayerWeights& weights, cudaStream_t stream);
  // d_w1 / d_w2 null: no weight gradients (a micro-batch of an accumulated step).
  void experts_backward(const MoeLayerWeights& weights, float* const* d_w1, float* const* d_w2, cudaStream_t stream);
  // backward() and backward_micro_batch(): d_w1 / d_w2 null leaves the weight gradients out.
  void backward_pass(const bf16* x, const MoeLayerWeights& weights, const bf16* dy, float* dx, float* d_gate_weights,
                     float* const* d_w1, float* const* d_w2, cudaStream_t stream, const bf16* router_input,
                     float* d_router_input);
  void require_micro_batch(const char* function, int micro_batch) const;
  // Micro-batch slot_'s part of the buffers the weight gradients read (slot 0 without accumulation).
  bf16* permuted_x_slot() { return permuted_x_.data() + slot_ * slot_rows_ * config_.model_dim; }
  bf16* d_expert_out_slot() { return d_expert_out_.data() + slot_ * slot_rows_ * config_.model_dim; }
  bf16* hidden_slot() { return hidden_.data() + slot_ * slot_rows_ * config_.hidden_dim; }
  bf16* d_pre_activation_slot() { return d_pre_activation_.data() + slot_ * slot_rows_ * config_.hidden_dim; }
  bf16* d_up_projection_slot() {  // SwiGLU only
    return d_up_projection_.size() == 0 ? nullptr : d_up_projection_.data() + slot_ * slot_rows_ * config_.hidden_dim;
  }

  MoeConfig config_;
  PhaseTimer* timer_ = nullptr;
  int micro_batches_ = 1;
  int64_t slot_ = 0;         // the slot compute_experts writes and the backward reads: route() sets 0,
                             // forward_micro_batch(m) then m
  int64_t slot_rows_ = 0;    // dense rows between two micro-batches' slots (R * B); the blocks are H wide
  std::vector<bool> backward_done_;  // per micro-batch, since the last expert_weight_gradients
  std::unique_ptr<MicroBatchTopology> micro_batch_topology_;  // dropless
  // The compacted weight-gradient operands (set_compacted_weight_gradients), [compacted rows, width].
  DeviceBuffer<bf16> compacted_x_, compacted_d_out_, compacted_hidden_, compacted_d_pre_, compacted_d_up_;
  bool dropless_ = true;
  int capacity_ = 0;  // C for the padded / dropping formulations
  bool gathers_rows_ = false;  // the forward writes no permuted copy of x (gathering_pays)
  CublasHandle cublas_;
  DispatchPlanBuffers plan_;
  std::unique_ptr<TopologyBuffers> topology_;

  // router
  RouterBuffers router_;
  RouterWorkspace router_workspace_;  // route_top_k's per-block partial sums of the statistics
  // Dropless with M micro-batches: permuted_x_, hidden_, d_expert_out_, d_pre_activation_ and
  // d_up_projection_ hold M slots (slot_rows_ rows apart; the last one max_rows long), the
  // operands of the expert weight gradients; the others are reused by each micro-batch.
  // experts: dropless stores the hidden activations as [max_nnz, B, B] blocks, padded as
  // [E*C, H] rows; both are max_rows * H values. pre_activation_ is the same dropless (the gate's
  // blocks for SwiGLU, whose up blocks are up_projection_) and [E*C, w1_columns] padded (SwiGLU:
  // [gate | up] per row). permuted_x_ is written by the backward when the forward gathers the rows.
  DeviceBuffer<bf16> permuted_x_, pre_activation_, up_projection_, hidden_, expert_out_;
  // backward (d_pre_activation_ and d_up_projection_ shaped as pre_activation_ and up_projection_)
  DeviceBuffer<bf16> d_expert_out_, d_hidden_, d_pre_activation_, d_up_projection_, d_permuted_x_, d_logits_bf16_;
  DeviceBuffer<float> d_combine_weights_, d_logits_;
  // padded / dropping: per-expert pointers into the [E, C, *] activation tensors
  DeviceBuffer<const bf16*> x_rows_, pre_rows_, hidden_rows_, d_out_rows_, d_pre_rows_;
  DeviceBuffer<bf16*> pre_rows_out_, out_rows_out_, d_hidden_rows_out_, d_x_rows_out_;
};

}  // namespace moe::cuda
