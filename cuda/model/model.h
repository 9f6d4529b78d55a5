// model/model.h: the tiny byte-level MoE transformer on one GPU, one training step at a time:
// forward (loss on the device), backward (every parameter's gradient), AdamW step. It assembles
// the blocks of this folder (embedding, layer_norm_gpu, attention_gpu, MoeLayerGpu, cross_entropy,
// adamw) into the model that moe::ref::model_forward / model_backward define (reference_cpu/model.h),
// its oracle. Built into moe_cuda; tested by tests/cuda/test_model.cpp
// (ctest --test-dir build -R CudaModelGpu; skips without a GPU).
//
// Dimension legend: V = 256 bytes, D model width, L blocks, S sequence length, N sequences,
// T = N * S tokens (t = n * S + s), H_dense the dense FFN's hidden width; E, K, H, B as in MoeConfig.
//   x      = token_embedding[tokens] + position_embedding[s]                         [T, D]
//   block i:  x += attention(LN1(x));  x += FFN(LN2(x))     FFN = MoeLayerGpu or dense GeLU FFN
//   logits = LN_final(x) token_embedding^T                                            [T, V]
//   loss   = mean cross-entropy + aux_loss_coef * sum_j aux_j + z_loss_coef * sum_j z_j
//
// Pre-gated routing (config.pregated; reference_cpu/model.h says it in full): number the MoE blocks
// m_0 < m_1 < ...; block m_j's gate (j >= 1) reads LN2(x) of block m_{j-1}, m_0's gate its own, and
// every block's experts read their own LN2(x). MoeLayerGpu takes the gate's input as router_input
// and returns the gate's input gradient separately, which block m_{j-1}'s backward adds to the
// gradient of its LN2 output. Here block m_j's router runs when block m_j does, on m_{j-1}'s saved
// LN2 output: the same numbers as the reference, which evaluates it one MoE block earlier so that
// an offload engine knows m_j's experts in advance.
//
// Parameters: ONE flat fp32 buffer of master weights in exactly moe::parameter_layout's order
// (layout() below repeats it without Eigen), a bf16 copy of it that the forward reads, and a
// parallel flat fp32 gradient buffer, so a test uploads ref::init_model's values in list order and
// compares the gradients tensor by tensor, and the optimizer's norm is one pass over one buffer.
// The MoE experts' weights are reached through per-expert device pointer tables into these buffers.
//
// Precision: the residual stream is kept in fp32 (one [T, D] buffer updated in place by each
// block), and a bf16 copy of it at each block boundary is what LayerNorm reads and the backward
// keeps; every GEMM reads bf16 operands and accumulates in fp32; logits and the loss are fp32.
// The backward's residual gradient is fp32, rounded to bf16 only where it is a GEMM operand.
//
// Synchronisation: forward, backward and step only enqueue work on the model's stream. The one
// host synchronisation is read_loss(), which a caller uses when it wants the number.
//
// On several GPUs (model_ranks.h): the same model as one rank of R, data parallel with expert
// parallelism. The config's ranks and rank fields say which; the layout lists the replicated
// parameters and this rank's E / R experts of each MoE block (with their global names), the MoE
// blocks are the expert-parallel layer that ModelRanks makes, the loss's gradient is this rank's
// share of the mean over all R N S tokens, the backward sums the replicated gradients over the
// ranks in per-block buckets under its own work (gradient_buckets_ below), and step() clips by the
// norm over all ranks' gradients before AdamW. A rank's model then holds exactly
// what the one-GPU model holds of those parameters, step for step (tests/distributed/).
//
// The experts' activation is config.moe.activation: GeLU, or SwiGLU (each expert's W1 [D, 2H], gate
// columns then up columns, as parameter_layout says through w1_columns); the dense FFN blocks are
// GeLU either way, as in the reference.
// Gradient accumulation (micro_batches = M > 1, one GPU, dropless): a step runs M micro-batches of
// `batch` sequences each, forward_micro_batch(m) then backward_micro_batch(m) for m = 0 .. M-1,
// then step(). The step's loss is the mean of the micro-batches' losses, so each micro-batch's
// cross-entropy gradient is its share of the mean over all M N S tokens and its router losses
// weigh 1 / M (each micro-batch's are its own: the load-balancing loss is a statistic of the
// tokens routed together). Every gradient but the experts' is added up over the micro-batches (the
// first writes gradients(), the others a second flat buffer that is then added in); the experts'
// weight gradients run once, in the last micro-batch's backward, over every micro-batch's rows
// (MoeLayerGpu::expert_weight_gradients). Activations are those of one micro-batch; each MoE
// layer keeps its M micro-batches' expert rows (MoeLayerGpu says how much).
// Two-micro-batch overlap (config.overlap; DeepSeek-V3's and SGLang's schedule): the batch runs as
// two halves, sequences [0, N/2) and [N/2, N), each a "lane" with its own stream, cuBLAS handle,
// scratch and MoE layers, so that one half's all-to-alls run while the other half computes. The
// schedule is forward_phases() and backward_phases(), block by block:
//   forward:  attention A, attention B; routing A and B, each sending its counts; A's counts
//             received (the host's wait), rows out and experts; the same for B; rows back A, then
//             B; the next block's attention A runs while B's rows come back
//   backward: FFN A, FFN B (each: rows out, experts' backward, rows back); attention A, attention B;
//             the block's gradients: lane B's (written beside the step's, in micro_gradients_)
//             added in, then summed over the ranks, on the gradient stream
// The halves are the same tokens as the plain step's, so the cross-entropy and its gradients are
// the same sums in another order (within bf16 tolerance); the router losses are each half's own
// statistics, weighing 1/2 each, as for gradient accumulation's micro-batches. One lane (the
// default) is the plain step, kernel for kernel.
// Out of scope here: jitter (MoeLayerGpu has none), SwiGLU on several ranks (the expert-parallel
// layer's experts are GeLU), and pre-gating a model without MoE blocks (there is no gate to move, as
// the reference says). The constructor rejects them, with the field named, before allocating anything.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/attention.h"     // AttentionWorkspace
#include "core/bf16.h"           // bf16
#include "core/captured_graph.h"  // CapturedGraph
#include "core/device_buffer.h"  // DeviceBuffer
#include "core/gemm.h"           // CublasHandle
#include "expert_placement.h"    // dist::ExpertPlacement
#include "model_config.h"        // ModelConfig, MoeLayers
#include "moe_config.h"          // MoeConfig
#include "moe/moe_layer.h"       // MoeLayerGpu
#include "model/model_ranks.h"   // MoeBlockFfn, ModelRanks
#include "core/phase_timer.h"    // PhaseTimer
#include "model/optimizer.h"     // NormSpan

namespace moe::cuda {

// The GPU's view of a ModelConfig (common/model_config.h, the one description of the model that the
// CPU reference shares): its shape, flat for the kernels' launches, and what a GPU run adds: the
// batch, the ranks, the micro-batches, and every MoE block's layer for that many tokens.
// gpu_config_of builds it from a ModelConfig; model_config_of gives the ModelConfig back.
struct ModelGpuConfig {
  int64_t model_dim = 64;   // D
  int64_t num_layers = 2;   // L
  int64_t num_heads = 4;    // D % num_heads == 0
  int64_t seq_len = 64;     // S
  int64_t batch = 4;        // N sequences per step
  MoeLayers moe_layers = MoeLayers::every_block;  // which blocks have an MoE FFN
  int64_t dense_hidden_dim = 256;  // H_dense
  double layer_norm_eps = 1e-5;
  MoeConfig moe;  // every MoE block's layer: tokens = N * S, model_dim = D, H, E, K, B, coefficients
  bool pregated = false;  // MoE block m_j's gate reads block m_{j-1}'s LN2 output (see above)
  // The attention core (model/attention.h): automatic is fused where the head width has kernels.
  AttentionCore attention_core = AttentionCore::automatic;
  // Trained on several ranks: this model is rank `rank` of `ranks`; batch is this rank's share N / R
  // of the global batch, moe.tokens all ranks' tokens (ranks * batch * seq_len), and the layout holds
  // experts [rank E / ranks, (rank + 1) E / ranks) of each MoE block.
  int64_t ranks = 1;
  int64_t rank = 0;
  // Gradient accumulation: a step of M micro-batches of `batch` sequences (see above). moe.tokens
  // stays one micro-batch's batch * seq_len. M > 1: one GPU and the dropless formulation.
  int64_t micro_batches = 1;
  // Two-micro-batch overlap (see above): an even batch, micro_batches = 1.
  bool overlap = false;
  // On several ranks, where each MoE block's experts live (common/expert_placement.h), one placement
  // per MoE block in block order; empty: contiguous_placement(E, R) for every block (E / R a rank
  // in id order where R divides E). A rank holds its slots' experts; a replicated expert has a copy
  // of its weights and AdamW moments on each of its ranks, the layer sums its weight gradients over
  // them, so the copies take the same steps and stay equal. The norm counts each expert once.
  std::vector<dist::ExpertPlacement> expert_placements;
};

// The optimizer's fixed settings (the learning rate comes with each step).
struct OptimizerSettings {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;   // applied to matrices only, as the reference (optimizer.h)
  float max_grad_norm = 1.0f;  // clip the global norm to this; <= 0 only measures
};

// One tensor of the flat parameter list (common/parameter_layout.h's ParameterInfo), at its offset
// in this rank's flat buffers.
struct ParameterSpan {
  std::string name;  // "blocks.1.moe.w1.3"
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t offset = 0;  // first entry in the flat buffers
  bool weight_decay = false;
  int64_t expert = -1;  // e of an expert's W1 or W2 (which live where the block's placement puts them); -1 else
  int64_t block = -1;   // i of a block's tensor ("blocks.i.*"); -1 for the embeddings and the final norm
  bool is_expert() const { return expert >= 0; }
};

// The GPU run of `model` with N = batch sequences a step on one GPU; a trainer on several ranks or
// with micro-batches sets those fields after (and moe.tokens with them).
ModelGpuConfig gpu_config_of(const ModelConfig& model, int64_t batch);
ModelConfig model_config_of(const ModelGpuConfig& config);

// Throws std::invalid_argument naming the field, its value and what is allowed.
void validate(const ModelGpuConfig& config);
bool is_moe_block(const ModelGpuConfig& config, int64_t layer);
// parameter_layout(model_config_of(config)) (common/parameter_layout.h); on several ranks, the
// subsequence this rank holds (the replicated tensors and its experts of each MoE block, as its
// placement says), at offsets in its buffers.
std::vector<ParameterSpan> parameter_layout(const ModelGpuConfig& config);
// MoE block `moe_block`'s placement (the moe_block-th MoE block, in block order): the config's, or
// contiguous_placement(E, R). One GPU: every expert on rank 0.
dist::ExpertPlacement expert_placement(const ModelGpuConfig& config, int64_t moe_block);
// The experts of MoE block `moe_block` this rank holds, ascending: all E on one GPU.
std::vector<int64_t> local_experts(const ModelGpuConfig& config, int64_t moe_block);

class ModelGpu {
 public:
  // Validates everything first (nothing is allocated for a bad config), then allocates weights,
  // gradients, optimizer moments and the activations of one [N, S] batch. Weights start at zero:
  // upload_weights() sets them. config.ranks > 1 needs `ranks` (of that size, this rank's), which
  // makes the MoE blocks and sums the gradients; it must outlive the model.
  explicit ModelGpu(const ModelGpuConfig& config, const OptimizerSettings& optimizer = {},
                    cudaStream_t stream = nullptr, ModelRanks* ranks = nullptr);

  // fp32 master weights in layout order, [parameter_count()]; refreshes the bf16 copy. Synchronous.
  void upload_weights(const std::vector<float>& weights);
  std::vector<float> download_weights() const;      // fp32 masters
  std::vector<float> download_gradients() const;    // fp32, from the last backward()
  std::vector<bf16> download_weights_bf16() const;  // the forward's copy

  // Enqueues the forward for device arrays tokens, targets [N, S] of bytes, which must stay valid
  // until backward() is enqueued. Returns the device address of the loss [1].
  const float* forward(const int32_t* tokens, const int32_t* targets);
  // Every parameter's gradient of the last forward's loss, overwritten in gradients().
  // config.micro_batches > 1: std::invalid_argument (train through the micro-batch calls below).
  void backward();
  // Gradient accumulation (config.micro_batches = M): micro-batch m's forward of tokens, targets
  // [N, S] (N = config.batch), and its backward, which adds its gradients into gradients() (m = 0
  // overwrites) and, for m = M-1, writes the experts' weight gradients of all M micro-batches.
  // backward_micro_batch(m) follows forward_micro_batch(m); std::invalid_argument otherwise.
  const float* forward_micro_batch(int micro_batch, const int32_t* tokens, const int32_t* targets);
  void backward_micro_batch(int micro_batch);
  // forward() then backward() of the batch in tokens, targets as one CUDA graph: run launched on the
  // first call (first-use setup stays out of the capture), captured on the second and replayed on
  // every later one, so the step's hundreds of kernels cost one launch.
  // The inputs are first copied into the model's own buffers, which the graph reads. The same
  // kernels with the same arguments in the same order: the same results as the two calls. Needs a
  // stream of its own (not the legacy default stream), one GPU (the expert-parallel layers wait on
  // the host for their counts, which a graph cannot hold) and no phase timer set (its events would
  // be captured). Returns the device address of the loss [1].
  const float* forward_backward_graph(const int32_t* tokens, const int32_t* targets);
  // Clips the gradients' global norm and takes one AdamW step with learning rate lr. On several
  // ranks the backward has summed the replicated parameters' gradients over the ranks (under its
  // own work, in buckets); the norm is over every rank's gradients (collective).
  void step(float lr);

  // AdamW's state, for a checkpoint: the moments m and v in layout order and the steps taken (the
  // bias corrections' t). Synchronous. upload_optimizer_state checks both lengths.
  struct OptimizerState {
    int64_t steps = 0;
    std::vector<float> first_moment, second_moment;  // [parameter_count()] each
  };
  OptimizerState download_optimizer_state() const;
  void upload_optimizer_state(const OptimizerState& state);
  int64_t optimizer_steps() const { return optimizer_steps_; }

  // The same state moved on the device, tensor by tensor by name, to or from arrays laid out as
  // `layout` (another model's parameter_layout, e.g. the one-GPU model's): how the trainer moves the
  // experts to a new placement without a trip through the host. export_state copies the tensors
  // `take` accepts into the arrays (the rest of them untouched); import_state fills every tensor of
  // this model from them, refreshes the bf16 copy and sets AdamW's step. Enqueued on the model's
  // stream; a name missing from `layout` is a std::invalid_argument.
  struct StateArrays {
    float* weights = nullptr;        // [layout's entries] each
    float* first_moment = nullptr;
    float* second_moment = nullptr;
  };
  void export_state(const std::vector<ParameterSpan>& layout, const StateArrays& into,
                    const std::function<bool(const ParameterSpan&)>& take) const;
  void import_state(const std::vector<ParameterSpan>& layout, const StateArrays& from, int64_t optimizer_steps);

  float read_loss() const;       // synchronises the stream
  float read_grad_norm() const;  // the norm before clipping of the last step(); synchronises

  const ModelGpuConfig& config() const { return config_; }
  const std::vector<ParameterSpan>& layout() const { return layout_; }
  int64_t parameter_count() const { return parameter_count_; }
  DeviceBuffer<float>& gradients() { return gradients_; }  // [parameter_count()] fp32
  // MoE block `layer`'s FFN (routing, router losses of the last forward); null for a dense block.
  const MoeBlockFfn* moe_ffn(int64_t layer, int lane = 0) const { return blocks_[size_t(layer)].moe[size_t(lane)].get(); }
  // 2 with config.overlap (lane l holds sequences [l N/2, (l + 1) N/2)), else 1.
  int lanes() const { return int(lanes_.size()); }
  // The same as the one-GPU layer; null for a dense block or on several ranks.
  const MoeLayerGpu* moe_layer(int64_t layer) const {
    const MoeBlockFfn* ffn = moe_ffn(layer);
    return ffn != nullptr ? ffn->single_gpu_layer() : nullptr;
  }
  const DeviceBuffer<float>& losses() const { return losses_; }  // {loss, lm, aux sum, z sum}
  // The mean of losses() over the micro-batches of a step (forward_micro_batch), complete after
  // the last one's forward: the step's losses.
  const DeviceBuffer<float>& step_losses() const { return step_losses_; }  // [4]

  // Fills every activation buffer with NaN bytes (tests: nothing may be read before it is written).
  void poison_activations();

  // Names each phase on the GPU timeline (NVTX + events); the MoE layers add their own inside "moe".
  void set_phase_timer(PhaseTimer* timer);

 private:
  // Saved activations and parameter addresses of one block.
  struct Block {
    int64_t ln1_gain = 0, ln1_bias = 0, qkv = 0, out = 0, ln2_gain = 0, ln2_bias = 0;  // offsets
    int64_t ffn_w1 = 0, ffn_w2 = 0, gate = 0;  // dense w1, w2 / MoE gate offsets
    DeviceBuffer<bf16> x;                     // [T, D] the residual entering the block (bf16 copy)
    DeviceBuffer<bf16> ln1_y;                 // [T, D]
    DeviceBuffer<float> ln1_mean, ln1_rstd;   // [T]
    DeviceBuffer<bf16> qkv_out, context;  // [T, 3D] [T, D]
    AttentionSavedBuffer attention_saved;  // the attention core's: log-sum-exp [N*heads, S] or probs [N*heads, S, S]
    DeviceBuffer<bf16> x_mid;                 // [T, D] after the attention residual (bf16 copy)
    DeviceBuffer<bf16> ln2_y;                 // [T, D]
    DeviceBuffer<float> ln2_mean, ln2_rstd;   // [T]
    DeviceBuffer<bf16> pre_activation, hidden;  // [T, H_dense] dense blocks
    std::array<std::unique_ptr<MoeBlockFfn>, 2> moe;  // MoE blocks: [lane], lane 1's with overlap only
    // Pre-gated: the previous MoE block, whose ln2_y this block's gate reads; -1 when the gate reads
    // this block's own ln2_y (not pre-gated, or the first MoE block).
    int64_t gate_input_block = -1;
    // Pre-gated, in an MoE block whose ln2_y a later block's gate reads: that gate's gradient with
    // respect to ln2_y [T, D]. The later block's backward runs first and writes it; this block's
    // backward adds it to the FFN's share before LN2's backward.
    DeviceBuffer<float> d_ln2_from_next_gate;
    DeviceBuffer<const bf16*> w1_table, w2_table;  // [E] -> [D, H], [H, D] in weights_bf16_
    // [lane][E] -> the same entries of the lane's gradients: gradients_ (lane 0), micro_gradients_ (1)
    std::array<DeviceBuffer<float*>, 2> d_w1_table, d_w2_table;
  };

  // A share of the batch that runs as a unit: the whole batch, or with config.overlap one of its two
  // halves. Its rows are the batch's sequences [first_sequence, first_sequence + sequences), at the
  // same places in every activation buffer; it runs on its own stream (lane 0: the model's) with
  // its own cuBLAS handle and scratch, and its MoE blocks are Block::moe[index].
  struct Lane {
    int index = 0;
    int64_t first_sequence = 0, sequences = 0;
    cudaStream_t stream = nullptr;
    bool owns_stream = false;
    cudaEvent_t ready = nullptr;  // recorded where another stream waits for the lane's work so far
    CublasHandle cublas;
    std::unique_ptr<AttentionWorkspace> attention;
    DeviceBuffer<float> layer_norm_scratch;
    DeviceBuffer<float> embedding_scratch;  // the token table gradient's segment partials
    DeviceBuffer<float> losses;  // [4] with two lanes, its own share of losses_
    Lane() = default;
    ~Lane();
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;
  };
  int64_t first_token(const Lane& lane) const { return lane.first_sequence * config_.seq_len; }
  int64_t tokens(const Lane& lane) const { return lane.sequences * config_.seq_len; }
  float* lane_losses(Lane& lane) { return lanes_.size() == 1 ? losses_.data() : lane.losses.data(); }
  // The other lanes' streams wait for the work enqueued so far on `lane`'s.
  void lanes_wait_for(Lane& lane);

  // forward() and forward_micro_batch() after setting micro_batch_; backward()'s phases. These two
  // functions are the schedule (see the file comment).
  const float* forward_phases(const int32_t* tokens, const int32_t* targets);
  void backward_phases();
  // ---- forward phases ----
  void embedding_forward_phase(Lane& lane);
  void attention_forward_phase(Lane& lane, Block& block);
  void ffn_forward_begin(Lane& lane, Block& block);    // LN2, then a dense FFN, or an MoE layer's route
  void ffn_forward_experts(Lane& lane, Block& block);  // two lanes: the counts received, rows out, experts
  void ffn_forward_end(Lane& lane, Block& block);      // two lanes: the rows back; the residual add
  void lm_head_forward_phase(Lane& lane);
  void loss_phase(Lane& lane);
  // ---- backward phases ----
  void loss_backward_phase(Lane& lane);
  void ffn_backward_begin(Lane& lane, Block& block);  // the FFN's backward (two lanes: an MoE layer's experts')
  void ffn_backward_end(Lane& lane, Block& block);    // (two lanes: the MoE layer's rows back) LN2's backward
  void attention_backward_phase(Lane& lane, Block& block);
  void embedding_backward_phase(Lane& lane);

  template <typename Work>
  void phase(const Lane& lane, const char* name, Work&& work);

  // [T, D] pre-gated (the lane's rows of the previous MoE block's LN2 output), or nullptr: its own ln2_y
  const bf16* gate_input(const Lane& lane, const Block& block) const;

  const bf16* weight(int64_t offset) const { return weights_bf16_.data() + offset; }
  // Where a lane's backward writes a gradient: lane 0 gradients_, or, in micro-batches after the
  // first, micro_gradients_ (added into gradients_ at the end of that micro-batch's backward);
  // lane 1 micro_gradients_ (added in block by block, on the gradient stream).
  float* gradient(const Lane& lane, int64_t offset) {
    return (lane.index == 0 ? gradient_target_ : micro_gradients_.data()) + offset;
  }

  ModelGpuConfig config_;
  OptimizerSettings optimizer_;
  cudaStream_t stream_ = nullptr;
  ModelRanks* ranks_ = nullptr;  // null on one GPU
  PhaseTimer* timer_ = nullptr;
  // forward_backward_graph's graph, captured on its second call, and the inputs it reads.
  std::unique_ptr<CapturedGraph> graph_;
  bool graph_warmed_up_ = false;  // the first call ran launched; the second captures
  DeviceBuffer<int32_t> graph_inputs_;  // [2, N, S]: tokens, then targets
  std::vector<ParameterSpan> layout_;
  int64_t parameter_count_ = 0;
  int64_t token_embedding_ = 0, position_embedding_ = 0, final_gain_ = 0, final_bias_ = 0;  // offsets
  int64_t optimizer_steps_ = 0;
  const int32_t* tokens_ = nullptr;   // [N, S] of the last forward, device
  const int32_t* targets_ = nullptr;  // [N, S]
  int micro_batch_ = -1;              // the last forward's micro-batch; -1: a plain forward()
  float* gradient_target_ = nullptr;  // gradients_ or micro_gradients_ (gradient())

  std::vector<Block> blocks_;  // L
  std::vector<std::unique_ptr<Lane>> lanes_;  // 1, or 2 with config.overlap

  // parameters and optimizer state, all [parameter_count()]
  DeviceBuffer<float> weights_, gradients_, first_moment_, second_moment_;
  DeviceBuffer<float> micro_gradients_;  // [parameter_count()] micro_batches > 1: micro-batches 1 .. M-1
                                         // write here (its expert spans stay zero), then add;
                                         // overlap: lane 1's gradients
  DeviceBuffer<bf16> weights_bf16_;
  DeviceBuffer<float> norm_partials_, grad_norm_, clip_scale_;  // [kGradientNormBlocks] [1] [1]
  // On several ranks the replicated tensors' gradients are summed over the ranks under the backward,
  // in buckets as PyTorch DDP does: bucket i holds block i's runs of neighbouring replicated tensors
  // (offset, count) and is summed on the gradient stream as soon as block i's backward has run,
  // while the blocks below run theirs; bucket L holds the embeddings' and the final norm's, summed
  // after the embedding backward. The same buckets in the same order on every rank (on one
  // communicator, whose operations run in the order issued): the sums repeat bit for bit. The
  // backward's end waits for the last bucket ("gradient_all_reduce": what the backward did not hide).
  // Bucket i then sums block i's replicated experts over their replicas (MoeBlockFfn::
  // sum_replica_gradients), once a step, after both lanes' gradients are added.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> gradient_buckets_;  // [L + 1]
  // With overlap, lane 1's gradients of block i's tensors (its experts' included), or for i = L of
  // the embeddings and the final norm, as runs (offset, count): added into gradients_ on the
  // gradient stream before bucket i's sum.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> lane_merge_spans_;  // [L + 1]
  struct GradientStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr;  // recorded on the model's stream: a bucket's gradients are complete
    cudaEvent_t summed = nullptr;  // recorded on `stream`: every bucket so far summed
    GradientStream();
    ~GradientStream();
    GradientStream(const GradientStream&) = delete;
    GradientStream& operator=(const GradientStream&) = delete;
  };
  std::unique_ptr<GradientStream> gradient_stream_;
  // Enqueues, behind every lane's backward so far, lane 1's share of bucket's tensors and then
  // bucket's all-reduce and its replicated experts' sum; nothing on one GPU without overlap.
  void sum_gradient_bucket(size_t bucket);
  // The norm's weighted spans (model/optimizer.h) and its sum of squares, on several ranks.
  DeviceBuffer<NormSpan> norm_spans_;
  DeviceBuffer<double> squared_norm_;  // [1]

  // activations shared by the blocks
  DeviceBuffer<float> residual_;         // [T, D] the fp32 residual stream
  DeviceBuffer<bf16> block_out_;         // [T, D] attention or FFN output before the residual add
  DeviceBuffer<bf16> final_x_;           // [T, D] the residual after the last block (bf16 copy)
  DeviceBuffer<bf16> final_y_;           // [T, D] LN_final's output
  DeviceBuffer<float> final_mean_, final_rstd_;  // [T]
  DeviceBuffer<float> logits_;           // [T, V]
  DeviceBuffer<float> token_losses_;     // [T]
  DeviceBuffer<float> losses_;           // [4] loss, lm loss, aux sum, z sum
  DeviceBuffer<float> step_losses_;      // [4] their mean over a step's micro-batches

  // backward scratch
  DeviceBuffer<bf16> d_logits_;          // [T, V]
  DeviceBuffer<float> d_residual_;       // [T, D] d loss / d residual stream
  DeviceBuffer<bf16> d_residual_bf16_;   // [T, D] its bf16 copy, a GEMM operand
  DeviceBuffer<float> d_norm_input_;     // [T, D] the gradient a LayerNorm's output receives
  DeviceBuffer<bf16> d_hidden_, d_pre_activation_;  // [T, H_dense] dense blocks
};

}  // namespace moe::cuda
