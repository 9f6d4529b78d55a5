// infer/inference_model.h: the byte-level MoE transformer decoding on one GPU: prefill a batch of
// prompts, then one byte per sequence per step against a KV cache, with every MoE block's experts
// taken from an ExpertSource (offload/expert_source.h): all resident, or streamed into an expert
// cache from pinned host memory on a schedule (infer/expert_schedule.h). Its oracle is the CPU
// reference's incremental decoding, moe::ref::prefill / decode_step (reference_cpu/generate.h).
// Built into moe_cuda; tested by tests/cuda/test_infer.cpp (ctest --test-dir build -R CudaInfer;
// skips without a GPU); run by moe_generate (infer/README.md).
//
// Dimension legend: V = 256 bytes, D model width, L blocks, S the context (seq_len: the position
// table's rows and the KV cache's length), N sequences decoded together, P prompt length,
// T_new = N * P in a prefill and N in a decode step; E, K, H as in MoeConfig; M the MoE blocks,
// numbered m_0 < m_1 < ...
//
// One step, the model of model/model.h restricted to the new tokens (reference_cpu/generate.h):
//   x = token_embedding[bytes] + position_embedding[position]                       [T_new, D]
//   block i:  x += attention(LN1(x)) over the KV cache;  x += FFN(LN2(x))
//   next_logits = LN_final(x of each sequence's last new token) token_embedding^T        [N, V]
// The prefill runs the full-sequence attention of model/attention.h over the prompts and writes
// their keys and values into the cache; a decode step projects one row per sequence, appends its
// key and value, and attends to the cache (infer/kv_cache.h: decode_attention).
//
// Every MoE block, in a prefill and in a decode step alike:
//   route            the gate, plan and topology (MoeLayerGpu::route); pre-gated blocks m_j, j >= 1,
//                    were routed one MoE block earlier, from m_{j-1}'s LN2 output
//   read back        only when the source needs experts on the host: the block's chosen experts
//                    (top_experts, [T_new, K] ints) come back with a cudaMemcpyAsync and a stream
//                    synchronisation: the on-demand stall, a host wait on the gate, not on the
//                    experts. A pre-gated block's choice is read back in the block before it.
//   acquire          source.acquire(block, experts): missing experts copied, the compute stream waits
//                    (a source that plans on the device: acquire_on_device(block, top_experts on the
//                    device), no read-back; and prefetch_on_device below)
//   schedule         before this block's experts run, what the schedule prefetches for the next MoE
//                    block: all its experts, the pre-gate's choice, or a guess from its own gate
//   host experts     a source with host experts on picks some missing experts to compute on the
//                    host instead of copying them (offload/host_expert_choice.h; a block ahead when
//                    pre-gated, and those are not prefetched); the block's LN2 rows are read back
//   compute_experts  permute, the experts through the source's pointer tables, then, while the GPU
//                    runs them, the host experts on the host; their output rows go to the device
//                    and replace the GPU's before the combine (moe_layer.h: ReplacedRows)
//   release          source.release(block): the slots may be reused once the stream passes here
// With host experts the result is no longer bit for bit gpu_only's: the host sums an expert's
// products in another order (fp32 either way); it equals it within bf16 rounding, and repeats bit
// for bit run after run for the same thread count (offload/cpu_expert.h).
// All gate work of a block (its own route, the next block's pre-gate or guess) is enqueued before
// the one read-back, so a block waits on the host at most once. The source numbers the MoE blocks
// 0..M-1 (j for m_j), as offload/pinned_expert_store.h does; the step's record names their layers.
//
// Routing at inference is dropless whatever the model was trained with (reference_cpu/generate.h
// says why: a dropping or padded layer's capacity depends on which other tokens share the batch, so
// it is not defined for one decoded token), with B = 64: the mma.sync block-sparse kernels, whose
// sums run in a fixed order (the B = 128 Hopper kernel ends its DSD in a stream-K tail whose partial
// sums meet in arrival order), and less padding for a few tokens per expert. Hence H must be a
// multiple of 64. The decode step's MoE layers are sized for T = N, the prefill's for T = N * P;
// each pass holds two and MoE block m_j uses layer j % 2, so that m_{j+1} can be routed (pre-gate
// or guess) while m_j's routing is still needed by its experts.
//
// The prompts of one prefill have equal lengths (the decode step then writes every sequence's new
// key at the same position, one position embedding row, one cache length): pad or trim them.
//
// Precision, as ModelGpu: bf16 weights (except the experts, wherever the source keeps them) and
// activations, an fp32 residual stream, fp32 accumulation, fp32 logits; the KV cache bf16.
//
// Synchronisation: each step ends with one host wait (the logits [N, V] and the routing record
// come back); in between, only the read-backs above, and only for a source that needs them.
//
// The decode step as one CUDA graph. A decode step launches a few hundred small kernels for a
// handful of tokens (every block: LayerNorm, the projections, the cache append, the attention, the
// residual adds; every MoE block: the gate, top-K, the plan's histogram, scan and sort, the
// topology, the permute, two block-sparse products, the combine), each a few microseconds of GPU
// work and as many of host launch cost, so at batch 1 the host's launches, not the GPU, set the
// pace. With a resident source (gpu_only) nothing in the step depends on the host: the routing,
// the plan and the grids stay on the device (moe_layer.h), and the step's bytes and position are
// read from the device (one copy before the step), so the whole step is captured once into a CUDA
// graph and replayed every step: one launch. The same kernels with the same arguments, so the same
// bits (tests/cuda/test_infer.cpp checks it); set_decode_graph(false) runs it launched.
// A source that plans its copies on the host (OffloadedExperts) is not captured: its step waits on
// the host for each block's routing (acquire decides which experts to copy into which slot) and
// its copies depend on that routing. A source whose slot table lives on the device
// (DeviceSlotCache, offload/device_slot_cache.h; plans_on_device) is: acquire_on_device and
// prefetch_on_device read the block's routing where the gate wrote it (top_experts, or the next
// block's pre-gate or guess) and a kernel plans and copies, so every offloading schedule runs with
// no host wait inside the step, and is captured like gpu_only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/bf16.h"                // bf16
#include "core/captured_graph.h"      // CapturedGraph
#include "core/device_buffer.h"       // DeviceBuffer
#include "core/gemm.h"                // CublasHandle
#include "core/phase_timer.h"         // PhaseTimer
#include "infer/expert_schedule.h"    // ExpertSchedule
#include "infer/kv_cache.h"           // KvCacheGpu
#include "model/model.h"              // ModelGpuConfig, parameter_layout
#include "moe/moe_layer.h"            // MoeLayerGpu
#include "offload/expert_source.h"    // ExpertSource

namespace moe::cuda {

inline constexpr int64_t kInferenceBlockSize = 64;  // B of every MoE layer at inference (see above)

// What one MoE block did in one step.
struct MoeBlockStep {
  int64_t block = 0;           // the MoE block's layer index
  int64_t known_in_block = 0;  // whose LN2 output its gate read: m_{j-1} when pre-gated (j >= 1), else itself
  std::vector<int32_t> top_experts;  // [T_new, K] each new token's experts, by descending probability
  std::vector<int32_t> experts;      // the distinct experts of top_experts, ascending: what the block used
  std::vector<int32_t> prefetched;   // what the schedule prefetched for this block, ascending (empty: none)
  std::vector<int32_t> on_host;      // the experts computed on the host instead, ascending (empty: none)
  double host_ms = 0;                // the host's time for them (wall clock, overlapped with the GPU's work)
};

struct StepResult {
  std::vector<float> next_logits;  // [N, V] each sequence's logits after its last new token
  std::vector<MoeBlockStep> moe;   // one per MoE block, ascending
};

// Throws std::invalid_argument naming the field when `config` cannot decode on the GPU: everything
// ModelGpu checks (with T = N * S, dropless, B = 64), H a multiple of 64, and GeLU experts (the
// expert sources hold W1 [D, H]; a SwiGLU model trains but does not decode here).
void validate_for_inference(const ModelGpuConfig& config);

// Throws std::invalid_argument when the schedule cannot run on this model (pregated needs a model
// trained pre-gated).
void check_schedule(const ModelGpuConfig& config, ExpertSchedule schedule);

class InferenceModelGpu {
 public:
  // config: the model (its batch is N, the sequences decoded together; seq_len the context S; the
  // MoE layer's tokens, formulation, capacity and block size are ignored: see above). weights: the
  // flat fp32 parameters in parameter_layout(config)'s order; every tensor but the experts' w1 / w2
  // is copied to the GPU as bf16 (the experts are the source's). `experts` serves every MoE block's
  // pointer tables and must outlive the model. Validates first; allocates the dense weights, the KV
  // cache and the decode step's buffers.
  InferenceModelGpu(const ModelGpuConfig& config,
                    std::span<const float> weights,  // [parameter_count] fp32
                    ExpertSource& experts, ExpertSchedule schedule = ExpertSchedule::gpu_only,
                    cudaStream_t stream = nullptr);
  ~InferenceModelGpu();
  InferenceModelGpu(const InferenceModelGpu&) = delete;
  InferenceModelGpu& operator=(const InferenceModelGpu&) = delete;

  // Empties the cache and runs N prompts of equal length P (1 <= P <= S, bytes 0..255) through the
  // model. Throws std::invalid_argument naming the prompt for a wrong count, unequal lengths, a
  // prompt longer than the context, or a value that is not a byte; nothing is run then.
  StepResult prefill(const std::vector<std::vector<int32_t>>& prompts);  // N prompts of P bytes

  // One byte per sequence at position length(). Throws std::logic_error before a prefill,
  // std::invalid_argument when the context is full or a value is not a byte; the cache is unchanged
  // by a step that throws.
  StepResult decode_step(const std::vector<int32_t>& next_bytes);  // [N]

  int64_t length() const { return length_; }  // positions of every sequence in the cache
  void set_schedule(ExpertSchedule schedule);  // check_schedule, then takes it from the next step on
  ExpertSchedule schedule() const { return schedule_; }

  const ModelGpuConfig& config() const { return config_; }
  const std::vector<int64_t>& moe_blocks() const { return moe_blocks_; }  // layer indices of m_0, m_1, ...
  size_t dense_weight_bytes() const { return weights_.bytes(); }
  size_t kv_cache_bytes() const { return cache_.bytes(); }
  // NaN in the KV cache and the decode step's activations (tests: nothing is read before it is written).
  void poison();
  // Names each phase on the GPU timeline (embedding, attention, moe, dense_ffn, lm_head; the MoE
  // layers add theirs inside "moe"); nullptr (the default) records nothing.
  void set_phase_timer(PhaseTimer* timer);
  // The decode step as one CUDA graph (above; on by default). It applies when the source needs
  // nothing on the host (resident, or a slot table on the device), no phase timer is set (its events would be captured) and the model has a stream of its
  // own (the legacy default stream cannot be captured); otherwise decode steps run launched. The
  // first decode step runs launched, the second captures the graph, later ones replay it.
  void set_decode_graph(bool on);
  bool decode_graph_applies() const;  // whether decode steps use the graph now

 private:
  struct Pass;  // the activations and MoE layers of one step shape (inference_model.cu)

  // Per-block parameter addresses in weights_.
  struct Block {
    const bf16 *ln1_gain = nullptr, *ln1_bias = nullptr, *qkv = nullptr, *out = nullptr;
    const bf16 *ln2_gain = nullptr, *ln2_bias = nullptr;
    const bf16 *ffn_w1 = nullptr, *ffn_w2 = nullptr;  // dense blocks
    const bf16* gate = nullptr;                       // MoE blocks: [D, E]
    int64_t moe_index = -1;                           // j for MoE block m_j, -1 for a dense block
  };

  std::unique_ptr<Pass> make_pass(int64_t new_per_sequence);
  void upload_inputs(Pass& pass, const std::vector<int32_t>& bytes, int64_t first_position);
  // Enqueues the step (launched, from the graph, or captured), then read_step.
  StepResult run(Pass& pass);
  void capture_decode_graph();
  // ---- the phases of a step ----
  void enqueue_step(Pass& pass);  // every phase, embedding to lm_head, on stream_
  void embedding_phase(Pass& pass);
  void attention_phase(Pass& pass, int64_t layer);
  void ffn_phase(Pass& pass, int64_t layer);
  void moe_block(Pass& pass, int64_t layer);
  void route_block(Pass& pass, int64_t j, const bf16* router_input);
  void choose_host_experts(Pass& pass, int64_t j, bool chosen_ahead);
  void host_experts_forward(Pass& pass, int64_t j);
  void lm_head_phase(Pass& pass);
  StepResult read_step(Pass& pass);  // the step's host wait: logits and routing back, the record
  std::vector<std::vector<int32_t>> read_back_experts(const std::vector<const MoeLayerGpu*>& layers);

  template <typename Work>
  void phase(const char* name, Work&& work);

  ModelGpuConfig config_;
  ExpertSource* experts_ = nullptr;
  ExpertSchedule schedule_ = ExpertSchedule::gpu_only;
  cudaStream_t stream_ = nullptr;
  PhaseTimer* timer_ = nullptr;
  CublasHandle cublas_;
  std::vector<int64_t> moe_blocks_;  // M layer indices
  std::vector<Block> blocks_;        // L
  const bf16 *token_embedding_ = nullptr, *position_embedding_ = nullptr;  // [V, D], [S, D]
  const bf16 *final_gain_ = nullptr, *final_bias_ = nullptr;               // [D]
  DeviceBuffer<bf16> weights_;       // the dense part, packed (inference_model.cu: pack_dense_weights)
  KvCacheGpu cache_;                 // [L, N, heads, S, d] keys and values
  int64_t length_ = 0;               // positions filled, the same for every sequence
  std::unique_ptr<Pass> decode_;     // T_new = N
  bool graph_on_ = true;             // set_decode_graph
  bool graph_warmed_up_ = false;     // a decode step ran launched: the next one may capture
  std::unique_ptr<CapturedGraph> graph_;  // the captured decode step
};

}  // namespace moe::cuda
