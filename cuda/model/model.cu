// model/model.cu: the tiny MoE transformer on one GPU (see model/model.h): the flat parameter layout,
// the phases of the forward and the backward, and the optimizer step. The three small kernels here
// are the residual stream's bookkeeping; everything else is a launcher of this folder.
//
// Index:
//   [SECTION] config and layout
//   [SECTION] loss kernels
//   [SECTION] construction and weights
//   [SECTION] forward
//   [SECTION] backward
//   [SECTION] optimizer
#include "model/model.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "moe/activation.h"       // gelu_forward, gelu_backward
#include "moe/tensor_map.h"      // create_launch_scratch_pool
#include "model/optimizer.h"      // gradient_norm, adamw_update, kGradientNormBlocks
#include "parameter_layout.h"     // moe::parameter_layout: the one order of the parameters
#include "model/cross_entropy.h"  // cross_entropy_forward / backward, kCrossEntropyClasses
#include "core/cuda_check.h"      // CUDA_CHECK
#include "core/elementwise.h"     // float_to_bf16, bf16_to_float, residual_add, add_in_place
#include "model/embedding.h"      // embedding_forward / backward
#include "model/flash_attention.h"  // flash_attention_supports
#include "model/layer_norm.h"     // layer_norm_forward / backward

namespace moe::cuda {

// ---- [SECTION] config and layout ----

namespace {

constexpr int64_t kVocabulary = kCrossEntropyClasses;  // V = 256 bytes

[[noreturn]] void reject(const std::string& field, const std::string& value, const std::string& allowed) {
  throw std::invalid_argument("ModelGpu: invalid config: " + field + " = " + value + "; allowed: " + allowed);
}

std::string text(int64_t value) { return std::to_string(value); }

}  // namespace

void validate(const ModelGpuConfig& c) {
  if (c.model_dim < 1) reject("model_dim (D)", text(c.model_dim), "D >= 1");
  if (c.num_layers < 1) reject("num_layers (L)", text(c.num_layers), "L >= 1");
  if (c.num_heads < 1 || c.model_dim % c.num_heads != 0) {
    reject("num_heads", text(c.num_heads), "a divisor of model_dim D = " + text(c.model_dim));
  }
  if (c.seq_len < 1) reject("seq_len (S)", text(c.seq_len), "S >= 1");
  if (c.batch < 1) reject("batch (N)", text(c.batch), "N >= 1");
  if (c.attention_core == AttentionCore::fused && !flash_attention_supports(c.model_dim / c.num_heads)) {
    reject("attention_core", "fused with head width D / heads = " + text(c.model_dim / c.num_heads),
           "head widths 32, 64, 128 for the fused core; or unfused / automatic");
  }
  if (!(c.layer_norm_eps > 0.0)) reject("layer_norm_eps", std::to_string(c.layer_norm_eps), "a number > 0");
  if (c.moe_layers == MoeLayers::every_other_block && c.num_layers < 2) {
    reject("moe_blocks", "every_other_block with L = " + text(c.num_layers), "L >= 2");
  }
  if (c.moe_layers != MoeLayers::every_block && c.dense_hidden_dim < 1) {
    reject("dense_hidden_dim (H_dense)", text(c.dense_hidden_dim), "H_dense >= 1 when some blocks are dense");
  }
  if (c.ranks < 1) reject("ranks (R)", text(c.ranks), "R >= 1");
  if (c.rank < 0 || c.rank >= c.ranks) reject("rank", text(c.rank), "0 <= rank < ranks = " + text(c.ranks));
  if (c.micro_batches < 1) reject("micro_batches (M)", text(c.micro_batches), "M >= 1");
  if (c.micro_batches > 1 && c.ranks > 1) {
    reject("micro_batches (M)", text(c.micro_batches) + " on " + text(c.ranks) + " ranks",
           "1 (the expert-parallel layer keeps no micro-batches; gradient accumulation trains on one GPU)");
  }
  if (c.overlap && (c.batch % 2 != 0 || c.micro_batches > 1)) {
    reject("overlap", "true with batch N = " + text(c.batch) + ", micro_batches M = " + text(c.micro_batches),
           "an even N (the two halves run side by side) and M = 1; or overlap = false");
  }
  if (c.micro_batches > 1 && c.moe_layers != MoeLayers::none && c.moe.formulation != Formulation::dropless) {
    reject("micro_batches (M)", text(c.micro_batches) + " with moe.formulation = " +
           std::string(to_string(c.moe.formulation)),
           "1, or the dropless formulation (one expert weight-gradient product over the micro-batches)");
  }
  if (c.pregated && c.moe_layers == MoeLayers::none) {
    reject("pregated", "true with moe_blocks = none", "pregated = false for a dense model (no gate to move)");
  }
  if (c.moe_layers == MoeLayers::none) return;
  const MoeConfig& m = c.moe;
  if (m.tokens != c.ranks * c.batch * c.seq_len) {
    reject("moe.tokens (T)", text(m.tokens),
           (c.ranks > 1 ? "ranks * batch * seq_len = " : "batch * seq_len = ") + text(c.ranks * c.batch * c.seq_len));
  }
  if (c.ranks > 1 && m.num_experts < c.ranks) {
    reject("moe.num_experts (E)", text(m.num_experts),
           "at least the ranks R = " + text(c.ranks) + " (each rank holds an expert of every MoE block)");
  }
  if (!c.expert_placements.empty()) {
    const int64_t moe_blocks = int64_t(moe::moe_blocks(model_config_of(c)).size());
    if (c.ranks == 1) reject("expert_placements", "set on one GPU", "empty (every expert is on the one GPU)");
    if (int64_t(c.expert_placements.size()) != moe_blocks) {
      reject("expert_placements", text(int64_t(c.expert_placements.size())) + " placements",
             "one per MoE block: " + text(moe_blocks));
    }
    for (size_t j = 0; j < c.expert_placements.size(); ++j) {
      const dist::ExpertPlacement& p = c.expert_placements[j];
      if (p.ranks() != c.ranks || p.experts() != m.num_experts) {
        reject("expert_placements[" + text(int64_t(j)) + "]",
               "a placement of E = " + text(p.experts()) + " experts on R = " + text(p.ranks()) + " ranks",
               "E = " + text(m.num_experts) + " on R = " + text(c.ranks));
      }
      if (p.replicated() && m.formulation == Formulation::padded) {
        reject("expert_placements[" + text(int64_t(j)) + "]", "replicated experts with moe.formulation = padded",
               "no replicas when padded (C rows are one rank's computation of an expert), or dropless / dropping");
      }
    }
  }
  if (c.ranks > 1 && c.pregated) {
    reject("pregated", "true on " + text(c.ranks) + " ranks",
           "false (the expert-parallel layer routes its own input; pre-gating is for offloaded inference)");
  }
  if (m.model_dim != c.model_dim) reject("moe.model_dim", text(m.model_dim), "model_dim = " + text(c.model_dim));
  try {
    moe::validate(m);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("ModelGpu: MoE layer: ") + error.what());
  }
  // MoeLayerGpu's own limits, checked here too so that no buffer of the model is allocated first.
  if (m.activation != Activation::gelu && m.activation != Activation::swiglu) {
    reject("moe.activation", std::string(to_string(m.activation)), "gelu or swiglu");
  }
  if (m.activation == Activation::swiglu && m.hidden_dim % 2 != 0) {
    reject("moe.hidden_dim (H)", text(m.hidden_dim), "an even H with activation = swiglu (bf16 pairs)");
  }
  if (m.activation == Activation::swiglu && c.ranks > 1) {
    reject("moe.activation", "swiglu on " + text(c.ranks) + " ranks",
           "gelu (the expert-parallel layer's experts are GeLU; SwiGLU trains on one GPU)");
  }
  if (m.jitter_eps != 0.0) reject("moe.jitter_eps", std::to_string(m.jitter_eps), "0 (the model is deterministic)");
  if (m.formulation == Formulation::dropless && m.block_size != 64 && m.block_size != 128) {
    reject("moe.block_size (B)", text(m.block_size), "64 or 128 for dropless (the block-sparse kernels' tiles)");
  }
}

bool is_moe_block(const ModelGpuConfig& config, int64_t layer) {
  return moe::is_moe_block(model_config_of(config), layer);
}

namespace {

// The fields ModelConfig and ModelGpuConfig share by name, copied from `from` to `to`: the one list
// that both conversions below use.
template <class From, class To>
void copy_shared_model_fields(const From& from, To& to) {
  to.model_dim = from.model_dim;
  to.num_layers = from.num_layers;
  to.num_heads = from.num_heads;
  to.seq_len = from.seq_len;
  to.moe_layers = from.moe_layers;
  to.dense_hidden_dim = from.dense_hidden_dim;
  to.layer_norm_eps = from.layer_norm_eps;
  to.pregated = from.pregated;
}

}  // namespace

ModelGpuConfig gpu_config_of(const ModelConfig& c, int64_t batch) {
  ModelGpuConfig g;
  copy_shared_model_fields(c, g);
  g.batch = batch;
  g.moe = moe_layer_config(c, batch);
  return g;
}

ModelConfig model_config_of(const ModelGpuConfig& g) {
  ModelConfig c;
  copy_shared_model_fields(g, c);
  c.num_experts = g.moe.num_experts;
  c.top_k = g.moe.top_k;
  c.expert_hidden_dim = g.moe.hidden_dim;
  c.formulation = g.moe.formulation;
  c.capacity_factor = g.moe.capacity_factor;
  c.block_size = g.moe.block_size;
  c.activation = g.moe.activation;
  c.renormalize = g.moe.renormalize;
  c.aux_loss_coef = g.moe.aux_loss_coef;
  c.z_loss_coef = g.moe.z_loss_coef;
  return c;
}

dist::ExpertPlacement expert_placement(const ModelGpuConfig& c, int64_t moe_block) {
  if (!c.expert_placements.empty()) return c.expert_placements.at(size_t(moe_block));
  return dist::contiguous_placement(c.moe.num_experts, int(std::max<int64_t>(c.ranks, 1)));
}

std::vector<int64_t> local_experts(const ModelGpuConfig& c, int64_t moe_block) {
  return expert_placement(c, moe_block).experts_of(int(c.rank));
}

std::vector<ParameterSpan> parameter_layout(const ModelGpuConfig& c) {
  // Per MoE block, which experts this rank holds: [layer][e].
  std::vector<std::vector<bool>> held(size_t(c.num_layers));
  for (int64_t layer = 0, moe_block = 0; layer < c.num_layers; ++layer) {
    if (c.moe_layers == MoeLayers::none || !is_moe_block(c, layer)) continue;
    held[size_t(layer)].assign(size_t(c.moe.num_experts), false);
    for (int64_t e : local_experts(c, moe_block++)) held[size_t(layer)][size_t(e)] = true;
  }
  std::vector<ParameterSpan> layout;
  int64_t offset = 0;
  for (const ParameterInfo& p : moe::parameter_layout(model_config_of(c))) {
    if (p.expert >= 0 && !held[size_t(p.block)][size_t(p.expert)]) continue;  // another rank's expert
    layout.push_back({p.name, p.rows, p.cols, offset, p.weight_decay, p.expert, p.block});
    offset += p.rows * p.cols;
  }
  return layout;
}

// ---- [SECTION] loss kernels ----

namespace {

// losses = {loss, lm, aux sum, z sum}: starts from the mean cross-entropy (already in losses[1]).
__global__ void start_loss_kernel(float* losses) {
  losses[0] = losses[1];
  losses[2] = 0.0f;
  losses[3] = 0.0f;
}

// A step's losses: the mean of its M micro-batches' (micro-batch 0 starts it).
__global__ void accumulate_step_losses_kernel(float* step_losses, const float* losses, int micro_batch,
                                              int micro_batches) {
  const int i = threadIdx.x;
  if (i >= 4) return;
  const float share = losses[i] / float(micro_batches);
  step_losses[i] = micro_batch == 0 ? share : step_losses[i] + share;
}

// One MoE block's router losses into the total, in block order (one thread: a fixed order).
__global__ void add_router_losses_kernel(float* losses, const float* aux, const float* z, float aux_coef,
                                         float z_coef) {
  losses[0] += aux_coef * aux[0] + z_coef * z[0];
  losses[2] += aux[0];
  losses[3] += z[0];
}

// The one-GPU MoE block: MoeLayerGpu as the model's MoeBlockFfn.
class SingleGpuMoeFfn final : public MoeBlockFfn {
 public:
  SingleGpuMoeFfn(const MoeConfig& config, int micro_batches) : layer_(config, micro_batches) {}
  void forward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights, bf16* y,
                           cudaStream_t stream, const bf16* router_input) override {
    layer_.forward_micro_batch(micro_batch, x, weights, y, stream, router_input);
  }
  void backward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights, const bf16* dy, float* dx,
                            float* d_gate_weights, cudaStream_t stream, const bf16* router_input,
                            float* d_router_input) override {
    layer_.backward_micro_batch(micro_batch, x, weights, dy, dx, d_gate_weights, stream, router_input, d_router_input);
  }
  void expert_weight_gradients(float* const* d_w1, float* const* d_w2, cudaStream_t stream) override {
    layer_.expert_weight_gradients(d_w1, d_w2, stream);
  }
  void forward(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
               const bf16* router_input) override {
    layer_.forward(x, weights, y, stream, router_input);
  }
  void backward(const bf16* x, const MoeLayerWeights& weights, const bf16* dy, const MoeLayerGradients& gradients,
                cudaStream_t stream, const bf16* router_input, float* d_router_input) override {
    layer_.backward(x, weights, dy, gradients, stream, router_input, d_router_input);
  }
  const float* aux_loss() const override { return layer_.aux_loss().data(); }
  const float* z_loss() const override { return layer_.z_loss().data(); }
  const DeviceBuffer<int>& top_experts() const override { return layer_.top_experts(); }
  void set_phase_timer(PhaseTimer* timer, int) override { layer_.set_phase_timer(timer); }
  const MoeLayerGpu* single_gpu_layer() const override { return &layer_; }

 private:
  MoeLayerGpu layer_;
};

}  // namespace

// ---- [SECTION] construction and weights ----

ModelGpu::ModelGpu(const ModelGpuConfig& config, const OptimizerSettings& optimizer, cudaStream_t stream,
                   ModelRanks* ranks)
    : config_((validate(config), config)), optimizer_(optimizer), stream_(stream), ranks_(ranks) {
  if (config_.ranks > 1 && (ranks_ == nullptr || ranks_->size() != config_.ranks || ranks_->rank() != config_.rank)) {
    throw std::invalid_argument("ModelGpu: config.ranks = " + text(config_.ranks) + ", rank = " + text(config_.rank) +
                                " needs the ModelRanks of that rank of that many ranks; got " +
                                (ranks_ == nullptr ? std::string("none")
                                                   : "rank " + text(ranks_->rank()) + " of " + text(ranks_->size())));
  }
  if (config_.ranks == 1) ranks_ = nullptr;  // nothing to share with
  layout_ = parameter_layout(config_);
  parameter_count_ = layout_.back().offset + layout_.back().rows * layout_.back().cols;
  token_embedding_ = layout_.front().offset;
  position_embedding_ = layout_[1].offset;
  final_gain_ = layout_[layout_.size() - 2].offset;
  final_bias_ = layout_.back().offset;

  const size_t T = size_t(config_.batch * config_.seq_len), D = size_t(config_.model_dim);
  const size_t V = size_t(kVocabulary), Hd = size_t(config_.dense_hidden_dim), P = size_t(parameter_count_);

  // The MoE layers first: they check that they fit in the free memory before allocating anything.
  // Over M micro-batches, or over the two lanes of the overlap, each one's router losses weigh 1 / M
  // (1 / 2) of the step's loss (model.h); the forward's reported losses keep config_.moe's
  // coefficients (loss_phase). A lane's layers see its tokens: T / 2 of them with overlap.
  const int micro_batches = int(config_.micro_batches), lane_count = config_.overlap ? 2 : 1;
  MoeConfig layer_config = config_.moe;
  layer_config.aux_loss_coef /= micro_batches * lane_count;
  layer_config.z_loss_coef /= micro_batches * lane_count;
  layer_config.tokens /= lane_count;
  const int64_t lane_sequences = config_.batch / lane_count;
  blocks_.resize(size_t(config_.num_layers));
  for (int64_t i = 0, moe_block = 0; i < config_.num_layers; ++i) {
    if (!is_moe_block(config_, i)) continue;
    const dist::ExpertPlacement placement = expert_placement(config_, moe_block++);
    for (int lane = 0; lane < lane_count; ++lane) {
      blocks_[size_t(i)].moe[size_t(lane)] =
          ranks_ != nullptr ? ranks_->make_moe_ffn(layer_config, lane_sequences * config_.seq_len, placement)
                            : std::make_unique<SingleGpuMoeFfn>(layer_config, micro_batches);
    }
  }
  for (int index = 0; index < lane_count; ++index) {
    auto lane = std::make_unique<Lane>();
    lane->index = index;
    lane->first_sequence = index * lane_sequences;
    lane->sequences = lane_sequences;
    lane->stream = stream_;
    if (index > 0) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking));
      lane->owns_stream = true;
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&lane->ready, cudaEventDisableTiming));
    lane->attention = std::make_unique<AttentionWorkspace>(
        AttentionShape{lane_sequences, config_.seq_len, config_.model_dim, config_.num_heads}, config_.attention_core);
    lane->layer_norm_scratch = DeviceBuffer<float>(
        size_t(layer_norm_backward_scratch_floats(lane_sequences * config_.seq_len, config_.model_dim)));
    lane->embedding_scratch = DeviceBuffer<float>(
        size_t(embedding_backward_scratch_floats(lane_sequences * config_.seq_len, config_.model_dim)));
    if (lane_count > 1) lane->losses = DeviceBuffer<float>(4);
    lanes_.push_back(std::move(lane));
  }

  weights_ = DeviceBuffer<float>(P);
  gradients_ = DeviceBuffer<float>(P);
  gradient_target_ = gradients_.data();
  if (micro_batches > 1 || lane_count > 1) {
    micro_gradients_ = DeviceBuffer<float>(P);
    micro_gradients_.fill_bytes(0);  // its expert spans are never written: they add zero
  }
  first_moment_ = DeviceBuffer<float>(P);
  second_moment_ = DeviceBuffer<float>(P);
  weights_bf16_ = DeviceBuffer<bf16>(P);
  weights_.fill_bytes(0);
  weights_bf16_.fill_bytes(0);
  first_moment_.fill_bytes(0);
  second_moment_.fill_bytes(0);
  norm_partials_ = DeviceBuffer<float>(kGradientNormBlocks);
  grad_norm_ = DeviceBuffer<float>(1);
  clip_scale_ = DeviceBuffer<float>(1);
  if (ranks_ != nullptr) {
    // Runs of neighbouring replicated tensors, summed over the ranks in one call each; the norm
    // counts a replicated tensor once over all ranks (weight 1 / R on each) and each expert once
    // (weight 1 / n on each of its n replicas).
    std::vector<std::vector<double>> expert_weight(size_t(config_.num_layers));  // [layer][e]: 1 / replicas
    for (int64_t i = 0, moe_block = 0; i < config_.num_layers; ++i) {
      if (!is_moe_block(config_, i)) continue;
      const dist::ExpertPlacement placement = expert_placement(config_, moe_block++);
      for (int64_t e = 0; e < placement.experts(); ++e) {
        expert_weight[size_t(i)].push_back(1.0 / double(placement.replicas(e).size()));
      }
    }
    std::vector<NormSpan> spans;
    gradient_buckets_.resize(size_t(config_.num_layers + 1));
    for (const ParameterSpan& p : layout_) {
      const int64_t count = p.rows * p.cols;
      const float weight = p.is_expert() ? float(expert_weight[size_t(p.block)][size_t(p.expert)])
                                         : 1.0f / float(config_.ranks);
      if (!spans.empty() && spans.back().weight == weight && spans.back().offset + spans.back().count == p.offset) {
        spans.back().count += count;
      } else {
        spans.push_back({p.offset, count, weight});
      }
      if (!p.is_expert()) {  // into its block's bucket, else the last one
        auto& bucket = gradient_buckets_[p.block >= 0 ? size_t(p.block) : size_t(config_.num_layers)];
        if (!bucket.empty() && bucket.back().first + bucket.back().second == p.offset) {
          bucket.back().second += count;
        } else {
          bucket.emplace_back(p.offset, count);
        }
      }
    }
    norm_spans_ = DeviceBuffer<NormSpan>(spans);
    squared_norm_ = DeviceBuffer<double>(1);
  }
  if (lane_count > 1) {  // every tensor of block i (its experts' too) in run i; the rest in run L
    lane_merge_spans_.resize(size_t(config_.num_layers + 1));
    for (const ParameterSpan& p : layout_) {
      auto& runs = lane_merge_spans_[p.block >= 0 ? size_t(p.block) : size_t(config_.num_layers)];
      if (!runs.empty() && runs.back().first + runs.back().second == p.offset) {
        runs.back().second += p.rows * p.cols;
      } else {
        runs.emplace_back(p.offset, p.rows * p.cols);
      }
    }
  }
  if (ranks_ != nullptr || lane_count > 1) gradient_stream_ = std::make_unique<GradientStream>();

  // Per block: parameter offsets (walking the layout in its order), activations, expert tables.
  size_t next = 2;  // after token_embedding and position_embedding
  for (int64_t i = 0, moe_block = 0; i < config_.num_layers; ++i) {
    Block& b = blocks_[size_t(i)];
    b.ln1_gain = layout_[next++].offset;
    b.ln1_bias = layout_[next++].offset;
    b.qkv = layout_[next++].offset;
    b.out = layout_[next++].offset;
    b.ln2_gain = layout_[next++].offset;
    b.ln2_bias = layout_[next++].offset;
    b.x = DeviceBuffer<bf16>(T * D);
    b.ln1_y = DeviceBuffer<bf16>(T * D);
    b.ln1_mean = DeviceBuffer<float>(T);
    b.ln1_rstd = DeviceBuffer<float>(T);
    b.qkv_out = DeviceBuffer<bf16>(T * 3 * D);
    b.attention_saved = AttentionSavedBuffer(
        AttentionShape{config_.batch, config_.seq_len, config_.model_dim, config_.num_heads}, config_.attention_core);
    b.context = DeviceBuffer<bf16>(T * D);
    b.x_mid = DeviceBuffer<bf16>(T * D);
    b.ln2_y = DeviceBuffer<bf16>(T * D);
    b.ln2_mean = DeviceBuffer<float>(T);
    b.ln2_rstd = DeviceBuffer<float>(T);
    if (b.moe[0]) {
      const size_t E = size_t(local_experts(config_, moe_block++).size());  // this rank's experts: all on one GPU
      b.gate = layout_[next++].offset;
      std::vector<const bf16*> w1(E), w2(E);
      for (size_t e = 0; e < E; ++e) {
        w1[e] = weight(layout_[next + e].offset);
        w2[e] = weight(layout_[next + E + e].offset);
      }
      for (const std::unique_ptr<Lane>& lane : lanes_) {
        std::vector<float*> d_w1(E), d_w2(E);
        for (size_t e = 0; e < E; ++e) {
          d_w1[e] = gradient(*lane, layout_[next + e].offset);
          d_w2[e] = gradient(*lane, layout_[next + E + e].offset);
        }
        b.d_w1_table[size_t(lane->index)] = DeviceBuffer<float*>(d_w1);
        b.d_w2_table[size_t(lane->index)] = DeviceBuffer<float*>(d_w2);
      }
      next += 2 * E;
      b.w1_table = DeviceBuffer<const bf16*>(w1);
      b.w2_table = DeviceBuffer<const bf16*>(w2);
    } else {
      b.ffn_w1 = layout_[next++].offset;
      b.ffn_w2 = layout_[next++].offset;
      b.pre_activation = DeviceBuffer<bf16>(T * Hd);
      b.hidden = DeviceBuffer<bf16>(T * Hd);
    }
  }
  // Pre-gating: each MoE block after the first routes from the previous MoE block's LN2 output,
  // and that block keeps a buffer for the gradient the gate sends back.
  if (config_.pregated) {
    int64_t previous_moe = -1;
    for (int64_t i = 0; i < config_.num_layers; ++i) {
      Block& b = blocks_[size_t(i)];
      if (!b.moe[0]) continue;
      b.gate_input_block = previous_moe;
      if (previous_moe >= 0) blocks_[size_t(previous_moe)].d_ln2_from_next_gate = DeviceBuffer<float>(T * D);
      previous_moe = i;
    }
  }
  if (config_.moe_layers != MoeLayers::every_block) {
    d_hidden_ = DeviceBuffer<bf16>(T * Hd);
    d_pre_activation_ = DeviceBuffer<bf16>(T * Hd);
  }
  residual_ = DeviceBuffer<float>(T * D);
  block_out_ = DeviceBuffer<bf16>(T * D);
  final_x_ = DeviceBuffer<bf16>(T * D);
  final_y_ = DeviceBuffer<bf16>(T * D);
  final_mean_ = DeviceBuffer<float>(T);
  final_rstd_ = DeviceBuffer<float>(T);
  logits_ = DeviceBuffer<float>(T * V);
  token_losses_ = DeviceBuffer<float>(T);
  losses_ = DeviceBuffer<float>(4);
  step_losses_ = DeviceBuffer<float>(4);
  d_logits_ = DeviceBuffer<bf16>(T * V);
  d_residual_ = DeviceBuffer<float>(T * D);
  d_residual_bf16_ = DeviceBuffer<bf16>(T * D);
  d_norm_input_ = DeviceBuffer<float>(T * D);
  CUDA_CHECK(cudaDeviceSynchronize());  // the fills above ran on the default stream
}

void ModelGpu::upload_weights(const std::vector<float>& weights) {
  if (int64_t(weights.size()) != parameter_count_) {
    throw std::invalid_argument("ModelGpu::upload_weights: " + std::to_string(weights.size()) +
                                " values; expected parameter_count() = " + std::to_string(parameter_count_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  weights_.upload(weights);
  float_to_bf16(weights_.data(), weights_bf16_.data(), weights.size(), stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<float> ModelGpu::download_weights() const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return weights_.download();
}

std::vector<float> ModelGpu::download_gradients() const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return gradients_.download();
}

std::vector<bf16> ModelGpu::download_weights_bf16() const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return weights_bf16_.download();
}

ModelGpu::OptimizerState ModelGpu::download_optimizer_state() const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return {optimizer_steps_, first_moment_.download(), second_moment_.download()};
}

void ModelGpu::upload_optimizer_state(const OptimizerState& state) {
  for (const std::vector<float>* moment : {&state.first_moment, &state.second_moment}) {
    if (int64_t(moment->size()) != parameter_count_) {
      throw std::invalid_argument("ModelGpu::upload_optimizer_state: a moment of " + std::to_string(moment->size()) +
                                  " values; expected parameter_count() = " + std::to_string(parameter_count_));
    }
  }
  if (state.steps < 0) throw std::invalid_argument("ModelGpu::upload_optimizer_state: steps < 0");
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  first_moment_.upload(state.first_moment);
  second_moment_.upload(state.second_moment);
  optimizer_steps_ = state.steps;
}

namespace {
// Offsets by name of a layout's tensors.
std::map<std::string, int64_t> offsets_by_name(const std::vector<ParameterSpan>& layout) {
  std::map<std::string, int64_t> offsets;
  for (const ParameterSpan& p : layout) offsets[p.name] = p.offset;
  return offsets;
}
int64_t offset_of(const std::map<std::string, int64_t>& offsets, const std::string& name) {
  const auto it = offsets.find(name);
  if (it == offsets.end()) throw std::invalid_argument("ModelGpu: the layout has no tensor " + name);
  return it->second;
}
}  // namespace

void ModelGpu::export_state(const std::vector<ParameterSpan>& layout, const StateArrays& into,
                            const std::function<bool(const ParameterSpan&)>& take) const {
  const std::map<std::string, int64_t> offsets = offsets_by_name(layout);
  for (const ParameterSpan& p : layout_) {
    if (!take(p)) continue;
    const int64_t there = offset_of(offsets, p.name);
    const size_t bytes = size_t(p.rows * p.cols) * sizeof(float);
    CUDA_CHECK(cudaMemcpyAsync(into.weights + there, weights_.data() + p.offset, bytes, cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(into.first_moment + there, first_moment_.data() + p.offset, bytes,
                               cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(into.second_moment + there, second_moment_.data() + p.offset, bytes,
                               cudaMemcpyDeviceToDevice, stream_));
  }
}

void ModelGpu::import_state(const std::vector<ParameterSpan>& layout, const StateArrays& from, int64_t optimizer_steps) {
  const std::map<std::string, int64_t> offsets = offsets_by_name(layout);
  for (const ParameterSpan& p : layout_) {
    const int64_t there = offset_of(offsets, p.name);
    const size_t bytes = size_t(p.rows * p.cols) * sizeof(float);
    CUDA_CHECK(cudaMemcpyAsync(weights_.data() + p.offset, from.weights + there, bytes, cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(first_moment_.data() + p.offset, from.first_moment + there, bytes,
                               cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(second_moment_.data() + p.offset, from.second_moment + there, bytes,
                               cudaMemcpyDeviceToDevice, stream_));
  }
  float_to_bf16(weights_.data(), weights_bf16_.data(), size_t(parameter_count_), stream_);
  optimizer_steps_ = optimizer_steps;
}

float ModelGpu::read_loss() const {
  float loss = 0.0f;
  CUDA_CHECK(cudaMemcpyAsync(&loss, losses_.data(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

float ModelGpu::read_grad_norm() const {
  float norm = 0.0f;
  CUDA_CHECK(cudaMemcpyAsync(&norm, grad_norm_.data(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return norm;
}

void ModelGpu::poison_activations() {
  constexpr int kNaN = 0xFF;  // every float and bf16 becomes a NaN
  for (Block& b : blocks_) {
    for (DeviceBuffer<bf16>* buffer :
         {&b.x, &b.ln1_y, &b.qkv_out, &b.context, &b.x_mid, &b.ln2_y, &b.pre_activation, &b.hidden}) {
      buffer->fill_bytes(kNaN, stream_);
    }
    b.attention_saved.fill_bytes(kNaN, stream_);
    for (DeviceBuffer<float>* buffer :
         {&b.ln1_mean, &b.ln1_rstd, &b.ln2_mean, &b.ln2_rstd, &b.d_ln2_from_next_gate}) {
      buffer->fill_bytes(kNaN, stream_);
    }
  }
  for (DeviceBuffer<bf16>* buffer :
       {&block_out_, &final_x_, &final_y_, &d_logits_, &d_residual_bf16_, &d_hidden_, &d_pre_activation_}) {
    buffer->fill_bytes(kNaN, stream_);
  }
  for (DeviceBuffer<float>* buffer : {&residual_, &final_mean_, &final_rstd_, &logits_, &token_losses_, &losses_,
                                      &d_residual_, &d_norm_input_}) {
    buffer->fill_bytes(kNaN, stream_);
  }
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    lane->layer_norm_scratch.fill_bytes(kNaN, stream_);
    lane->embedding_scratch.fill_bytes(kNaN, stream_);
  }
}

ModelGpu::Lane::~Lane() {
  if (ready != nullptr) cudaEventDestroy(ready);
  if (owns_stream) cudaStreamDestroy(stream);
}

void ModelGpu::lanes_wait_for(Lane& lane) {
  if (lanes_.size() == 1) return;
  CUDA_CHECK(cudaEventRecord(lane.ready, lane.stream));
  for (const std::unique_ptr<Lane>& other : lanes_) {
    if (other.get() != &lane) CUDA_CHECK(cudaStreamWaitEvent(other->stream, lane.ready, 0));
  }
}

void ModelGpu::set_phase_timer(PhaseTimer* timer) {
  timer_ = timer;
  // The lanes' streams by name (the timeline's rows): "compute", and with two micro-batches
  // overlapped "compute, second micro-batch" for the second.
  for (const auto& lane : lanes_) {
    if (timer != nullptr) {
      timer->name_stream(lane->stream, lane->index == 0 ? std::string(kComputeRow)
                                                        : std::string(kComputeRow) + kSecondMicroBatchSuffix);
    }
  }
  for (Block& b : blocks_) {
    for (size_t lane = 0; lane < b.moe.size(); ++lane) {
      if (b.moe[lane]) b.moe[lane]->set_phase_timer(timer, static_cast<int>(lane));
    }
  }
}

template <typename Work>
void ModelGpu::phase(const Lane& lane, const char* name, Work&& work) {
  if (timer_ != nullptr) timer_->begin(name, lane.stream);
  work();
  if (timer_ != nullptr) timer_->end(lane.stream);
}

// ---- [SECTION] forward ----

const float* ModelGpu::forward(const int32_t* tokens, const int32_t* targets) {
  micro_batch_ = -1;
  return forward_phases(tokens, targets);
}

// The forward's schedule: each step below runs for lane A, then lane B (with overlap). The MoE
// layers' exchanges thus reach the communicator as counts A, counts B, rows out A, rows out B,
// back A, back B: B's routing and counts run while the host waits for A's counts, A's rows go out
// while B's counts travel, B's while A's experts run, A's come back while B's experts run, and B's
// while the next block's attention of A runs. The host waits for A's counts only once B's routing
// is enqueued, and for B's once A's rows are on their way.
const float* ModelGpu::forward_phases(const int32_t* tokens, const int32_t* targets) {
  tokens_ = tokens;
  targets_ = targets;
  Lane& first = *lanes_[0];
  lanes_wait_for(first);  // lane 1 starts behind what the model's stream has (inputs, the last step)
  for (auto& lane : lanes_) embedding_forward_phase(*lane);
  for (Block& block : blocks_) {
    for (auto& lane : lanes_) attention_forward_phase(*lane, block);
    for (auto& lane : lanes_) ffn_forward_begin(*lane, block);  // routing; the counts sent
    for (auto& lane : lanes_) {
      ffn_forward_experts(*lane, block);  // the host waits here for the lane's counts
    }
    for (auto& lane : lanes_) ffn_forward_end(*lane, block);
  }
  for (auto& lane : lanes_) {
    lm_head_forward_phase(*lane);
    loss_phase(*lane);
  }
  if (lanes_.size() > 1) {  // the step's losses: the mean of the halves', in lane order
    lanes_wait_for(*lanes_[1]);
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      accumulate_step_losses_kernel<<<1, 32, 0, stream_>>>(losses_.data(), lane->losses.data(), lane->index,
                                                           int(lanes_.size()));
      CUDA_CHECK(cudaGetLastError());
    }
  }
  return losses_.data();
}

const float* ModelGpu::forward_micro_batch(int micro_batch, const int32_t* tokens, const int32_t* targets) {
  if (micro_batch < 0 || micro_batch >= config_.micro_batches) {
    throw std::invalid_argument("ModelGpu::forward_micro_batch: micro_batch = " + text(micro_batch) +
                                "; allowed: 0 .. " + text(config_.micro_batches - 1) + " (config.micro_batches = " +
                                text(config_.micro_batches) + ")");
  }
  micro_batch_ = micro_batch;  // the MoE blocks' forward (ffn_forward_phase) keeps its expert rows
  forward_phases(tokens, targets);
  accumulate_step_losses_kernel<<<1, 32, 0, stream_>>>(step_losses_.data(), losses_.data(), micro_batch,
                                                       int(config_.micro_batches));
  CUDA_CHECK(cudaGetLastError());
  return losses_.data();
}

const float* ModelGpu::forward_backward_graph(const int32_t* tokens, const int32_t* targets) {
  if (ranks_ != nullptr) {
    throw std::invalid_argument("forward_backward_graph: on one GPU only (the expert-parallel layers wait on the host "
                                "for their counts, which a CUDA graph cannot hold); use forward() and backward()");
  }
  if (stream_ == nullptr) {
    throw std::invalid_argument("forward_backward_graph: the model runs on the legacy default stream, which cannot be "
                                "captured; give the model a stream of its own");
  }
  if (config_.micro_batches > 1) {
    throw std::invalid_argument("forward_backward_graph: config.micro_batches = " + text(config_.micro_batches) +
                                "; a step of micro-batches runs forward_micro_batch and backward_micro_batch");
  }
  if (config_.overlap) {
    throw std::invalid_argument("forward_backward_graph: config.overlap is set; the overlap hides exchanges between "
                                "ranks, and a graph runs on one GPU: use overlap = false");
  }
  if (timer_ != nullptr) {
    throw std::invalid_argument("forward_backward_graph: a phase timer is set (its events would be captured); use "
                                "forward() and backward() for timed steps");
  }
  const size_t n = static_cast<size_t>(config_.batch * config_.seq_len);
  if (graph_inputs_.size() == 0) graph_inputs_ = DeviceBuffer<int32_t>(2 * n);
  int32_t* const graph_tokens = graph_inputs_.data();
  int32_t* const graph_targets = graph_inputs_.data() + n;
  CUDA_CHECK(cudaMemcpyAsync(graph_tokens, tokens, n * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(graph_targets, targets, n * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream_));
  if (!graph_warmed_up_) {
    // The first call runs launched: whatever the kernels set up on first use (function attributes,
    // the occupancy of their clusters, the scratch pool) happens outside the capture.
    forward(graph_tokens, graph_targets);
    backward();
    graph_warmed_up_ = true;
    return losses_.data();
  }
  if (graph_ == nullptr) {
    create_launch_scratch_pool();  // the block-sparse kernels' scratch: a capture cannot create the pool
    graph_ = CapturedGraph::capture(stream_, [&] {
      forward(graph_tokens, graph_targets);
      backward();
    });
  }
  graph_->launch(stream_);
  return losses_.data();
}

// x0 = token_embedding[tokens] + position_embedding[s], straight into block 0's saved input.
void ModelGpu::embedding_forward_phase(Lane& l) {
  phase(l, "embedding", [&] {
    const int64_t t0 = first_token(l), T = tokens(l), D = config_.model_dim;
    embedding_forward(tokens_ + t0, weight(token_embedding_), weight(position_embedding_), blocks_[0].x.data() + t0 * D,
                      l.sequences, config_.seq_len, D, l.stream);
    bf16_to_float(blocks_[0].x.data() + t0 * D, residual_.data() + t0 * D, size_t(T * D), l.stream);
  });
}

// x_mid = x + attention(LN1(x)); the fp32 residual in place, its bf16 copy saved as x_mid.
void ModelGpu::attention_forward_phase(Lane& l, Block& b) {
  phase(l, "attention", [&] {
    const int64_t t0 = first_token(l), T = tokens(l), D = config_.model_dim;
    layer_norm_forward(b.x.data() + t0 * D, weight(b.ln1_gain), weight(b.ln1_bias), b.ln1_y.data() + t0 * D,
                       b.ln1_mean.data() + t0, b.ln1_rstd.data() + t0, T, D, float(config_.layer_norm_eps), l.stream);
    attention_forward(l.cublas.get(), l.attention->shape, b.ln1_y.data() + t0 * D, weight(b.qkv), weight(b.out),
                      b.qkv_out.data() + t0 * 3 * D, b.attention_saved.at(l.first_sequence), b.context.data() + t0 * D,
                      block_out_.data() + t0 * D, *l.attention, l.stream);
    residual_add(residual_.data() + t0 * D, block_out_.data() + t0 * D, b.x_mid.data() + t0 * D, size_t(T * D),
                 l.stream);
  });
}

// What block b's gate reads: the previous MoE block's LN2 output when pre-gated, else nullptr
// (MoeLayerGpu then routes the block's own LN2 output).
const bf16* ModelGpu::gate_input(const Lane& l, const Block& b) const {
  return b.gate_input_block >= 0 ? blocks_[size_t(b.gate_input_block)].ln2_y.data() + first_token(l) * config_.model_dim
                                 : nullptr;
}

// FFN(LN2(x_mid)) into block_out_: a dense FFN whole; an MoE layer's forward_route with two lanes
// (routing, the counts sent), its whole forward with one.
void ModelGpu::ffn_forward_begin(Lane& l, Block& b) {
  const int64_t t0 = first_token(l), T = tokens(l), D = config_.model_dim;
  layer_norm_forward(b.x_mid.data() + t0 * D, weight(b.ln2_gain), weight(b.ln2_bias), b.ln2_y.data() + t0 * D,
                     b.ln2_mean.data() + t0, b.ln2_rstd.data() + t0, T, D, float(config_.layer_norm_eps), l.stream);
  if (b.moe[0]) {
    phase(l, "moe", [&] {
      const MoeLayerWeights weights{weight(b.gate), b.w1_table.data(), b.w2_table.data()};
      MoeBlockFfn& moe = *b.moe[size_t(l.index)];
      bf16* const y = block_out_.data() + t0 * D;
      const bf16* const x = b.ln2_y.data() + t0 * D;
      if (micro_batch_ >= 0) {
        moe.forward_micro_batch(micro_batch_, x, weights, y, l.stream, gate_input(l, b));
      } else if (lanes_.size() > 1) {
        moe.forward_route(x, weights, y, l.stream, gate_input(l, b));
      } else {
        moe.forward(x, weights, y, l.stream, gate_input(l, b));
      }
    });
  } else {
    phase(l, "dense_ffn", [&] {
      const int Hd = int(config_.dense_hidden_dim);
      l.cublas.set_stream(l.stream);
      // pre = LN2(x) w1 [T, H_dense];  hidden = gelu(pre);  out = hidden w2 [T, D]
      gemm(l.cublas.get(), Op::none, Op::none, int(T), Hd, int(D), b.ln2_y.data() + t0 * D, int(D), weight(b.ffn_w1),
           Hd, b.pre_activation.data() + t0 * Hd, Hd);
      gelu_forward(b.pre_activation.data() + t0 * Hd, b.hidden.data() + t0 * Hd, size_t(T) * size_t(Hd), l.stream);
      gemm(l.cublas.get(), Op::none, Op::none, int(T), int(D), Hd, b.hidden.data() + t0 * Hd, Hd, weight(b.ffn_w2),
           int(D), block_out_.data() + t0 * D, int(D));
    });
  }
}

// With two lanes, an MoE layer's counts received (the host's wait), its rows out and its experts.
void ModelGpu::ffn_forward_experts(Lane& l, Block& b) {
  if (b.moe[0] && lanes_.size() > 1) {
    phase(l, "moe", [&] {
      MoeBlockFfn& moe = *b.moe[size_t(l.index)];
      moe.forward_receive_counts(l.stream);
      moe.forward_experts(l.stream);
    });
  }
}

// x_out = x_mid + FFN(LN2(x_mid)) (with two lanes, after the MoE layer's rows came back); x_out's
// bf16 copy is the next block's input (or LN_final's).
void ModelGpu::ffn_forward_end(Lane& l, Block& b) {
  const int64_t t0 = first_token(l), T = tokens(l), D = config_.model_dim;
  if (b.moe[0] && lanes_.size() > 1) phase(l, "moe", [&] { b.moe[size_t(l.index)]->forward_combine(l.stream); });
  Block* const next = &b == &blocks_.back() ? nullptr : &b + 1;
  bf16* const x_out = next != nullptr ? next->x.data() : final_x_.data();
  residual_add(residual_.data() + t0 * D, block_out_.data() + t0 * D, x_out + t0 * D, size_t(T * D), l.stream);
}

// logits = LN_final(x) token_embedding^T [T, V], fp32 (the tied output projection).
void ModelGpu::lm_head_forward_phase(Lane& l) {
  phase(l, "lm_head", [&] {
    const int64_t t0 = first_token(l);
    const int T = int(tokens(l)), D = int(config_.model_dim), V = int(kVocabulary);
    layer_norm_forward(final_x_.data() + t0 * D, weight(final_gain_), weight(final_bias_), final_y_.data() + t0 * D,
                       final_mean_.data() + t0, final_rstd_.data() + t0, T, D, float(config_.layer_norm_eps), l.stream);
    l.cublas.set_stream(l.stream);
    gemm(l.cublas.get(), Op::none, Op::transpose, T, V, D, final_y_.data() + t0 * D, D, weight(token_embedding_), D,
         logits_.data() + t0 * V, V, 1.0f, 0.0f, /*c_is_float=*/true);
  });
}

// loss = mean cross-entropy + aux_loss_coef * sum aux + z_loss_coef * sum z, on the device: the
// lane's own (lane_losses), of its tokens and its MoE layers.
void ModelGpu::loss_phase(Lane& l) {
  phase(l, "loss", [&] {
    const int64_t t0 = first_token(l);
    float* const losses = lane_losses(l);
    cross_entropy_forward(logits_.data() + t0 * kVocabulary, targets_ + t0, token_losses_.data() + t0, losses + 1,
                          tokens(l), l.stream);
    start_loss_kernel<<<1, 1, 0, l.stream>>>(losses);
    CUDA_CHECK(cudaGetLastError());
    for (const Block& b : blocks_) {
      if (!b.moe[0]) continue;
      const MoeBlockFfn& moe = *b.moe[size_t(l.index)];
      add_router_losses_kernel<<<1, 1, 0, l.stream>>>(losses, moe.aux_loss(), moe.z_loss(),
                                                      float(config_.moe.aux_loss_coef), float(config_.moe.z_loss_coef));
      CUDA_CHECK(cudaGetLastError());
    }
  });
}

// ---- [SECTION] backward ----

void ModelGpu::backward() {
  if (tokens_ == nullptr) throw std::logic_error("ModelGpu::backward: call forward() first");
  if (config_.micro_batches > 1 || micro_batch_ >= 0) {
    throw std::invalid_argument("ModelGpu::backward: a model of config.micro_batches = " +
                                text(config_.micro_batches) + " trains through forward_micro_batch and "
                                "backward_micro_batch (its MoE layers weigh each micro-batch's router losses 1 / M)");
  }
  backward_phases();
}

// The backward's schedule, as the forward's: lane 0, then lane 1, at each step; dy's rows go out
// A, B and dx's come back A, B, each exchange beside the other lane's experts or attention.
void ModelGpu::backward_phases() {
  lanes_wait_for(*lanes_[0]);
  for (auto& lane : lanes_) loss_backward_phase(*lane);
  for (size_t i = blocks_.size(); i-- > 0;) {
    for (auto& lane : lanes_) ffn_backward_begin(*lane, blocks_[i]);
    for (auto& lane : lanes_) ffn_backward_end(*lane, blocks_[i]);
    for (auto& lane : lanes_) attention_backward_phase(*lane, blocks_[i]);
    sum_gradient_bucket(i);  // block i's gradients are complete in every lane
  }
  for (auto& lane : lanes_) embedding_backward_phase(*lane);
  sum_gradient_bucket(blocks_.size());
  if (gradient_stream_ != nullptr) {
    phase(*lanes_[0], "gradient_all_reduce", [&] {  // what of the sums the backward did not hide
      CUDA_CHECK(cudaEventRecord(gradient_stream_->summed, gradient_stream_->stream));
      CUDA_CHECK(cudaStreamWaitEvent(stream_, gradient_stream_->summed, 0));
    });
  }
}

ModelGpu::GradientStream::GradientStream() {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&summed, cudaEventDisableTiming));
}

ModelGpu::GradientStream::~GradientStream() {
  cudaEventDestroy(summed);
  cudaEventDestroy(ready);
  cudaStreamDestroy(stream);
}

void ModelGpu::sum_gradient_bucket(size_t bucket) {
  if (gradient_stream_ == nullptr) return;
  for (const std::unique_ptr<Lane>& lane : lanes_) {
    CUDA_CHECK(cudaEventRecord(lane->ready, lane->stream));
    CUDA_CHECK(cudaStreamWaitEvent(gradient_stream_->stream, lane->ready, 0));
  }
  if (lanes_.size() > 1) {
    for (const auto& [offset, count] : lane_merge_spans_[bucket]) {
      add_in_place(gradients_.data() + offset, micro_gradients_.data() + offset, size_t(count),
                   gradient_stream_->stream);
    }
  }
  if (ranks_ == nullptr) return;
  for (const auto& [offset, count] : gradient_buckets_[bucket]) {
    ranks_->all_reduce_sum(gradients_.data() + offset, count, gradient_stream_->stream);
  }
  // A block's replicated experts: their gradients (every lane's, added above) over their replicas.
  if (bucket < blocks_.size() && blocks_[bucket].moe[0]) {
    const Block& b = blocks_[bucket];
    b.moe[0]->sum_replica_gradients(b.d_w1_table[0].data(), b.d_w2_table[0].data(), gradient_stream_->stream);
  }
}

void ModelGpu::backward_micro_batch(int micro_batch) {
  if (tokens_ == nullptr || micro_batch_ < 0 || micro_batch != micro_batch_) {
    throw std::invalid_argument("ModelGpu::backward_micro_batch(" + text(micro_batch) +
                                "): the last forward was " +
                                (micro_batch_ < 0 ? std::string("not a micro-batch's")
                                                  : "micro-batch " + text(micro_batch_) + "'s") +
                                "; call forward_micro_batch(" + text(micro_batch) + ", ...) first");
  }
  // Micro-batch 0 writes the step's gradients; the others write their own beside them and add.
  gradient_target_ = micro_batch == 0 ? gradients_.data() : micro_gradients_.data();
  try {
    backward_phases();
  } catch (...) {
    gradient_target_ = gradients_.data();
    throw;
  }
  gradient_target_ = gradients_.data();
  if (micro_batch > 0) {
    phase(*lanes_[0], "accumulate_gradients", [&] {
      const size_t n = size_t(parameter_count_);
      add_in_place(gradients_.data(), micro_gradients_.data(), n, stream_);
    });
  }
  if (micro_batch == config_.micro_batches - 1) {
    // The experts' weight gradients, once over every micro-batch's rows, straight into gradients_.
    phase(*lanes_[0], "backward_moe_weight_gradients", [&] {
      for (Block& b : blocks_) {
        if (b.moe[0]) b.moe[0]->expert_weight_gradients(b.d_w1_table[0].data(), b.d_w2_table[0].data(), stream_);
      }
    });
  }
}

// d_logits = (softmax - one_hot) / T; the tied projection's two products; LN_final's backward
// starts the residual gradient (overwritten here, accumulated by every block after).
void ModelGpu::loss_backward_phase(Lane& l) {
  phase(l, "backward_lm_head", [&] {
    const int64_t t0 = first_token(l);
    const int T = int(tokens(l)), D = int(config_.model_dim), V = int(kVocabulary);
    // The loss is the mean over all ranks' tokens (and all micro-batches' of the step): each rank's,
    // each micro-batch's, each lane's d_logits is its share of it.
    const int64_t micro_batches = micro_batch_ >= 0 ? config_.micro_batches : 1;
    cross_entropy_backward(logits_.data() + t0 * V, targets_ + t0, d_logits_.data() + t0 * V, T, l.stream,
                           config_.batch * config_.seq_len * config_.ranks * micro_batches);
    l.cublas.set_stream(l.stream);
    // d token_embedding [V, D] = d_logitsᵀ LN_final(x): overwritten; the embedding adds its share later.
    gemm(l.cublas.get(), Op::transpose, Op::none, V, D, T, d_logits_.data() + t0 * V, V, final_y_.data() + t0 * D, D,
         gradient(l, token_embedding_), D, 1.0f, 0.0f, true);
    // d LN_final(x) [T, D] = d_logits token_embedding
    gemm(l.cublas.get(), Op::none, Op::none, T, D, V, d_logits_.data() + t0 * V, V, weight(token_embedding_), D,
         d_norm_input_.data() + t0 * D, D, 1.0f, 0.0f, true);
    layer_norm_backward(d_norm_input_.data() + t0 * D, final_x_.data() + t0 * D, final_mean_.data() + t0,
                        final_rstd_.data() + t0, weight(final_gain_), d_residual_.data() + t0 * D,
                        gradient(l, final_gain_), gradient(l, final_bias_), l.layer_norm_scratch.data(), T, D,
                        /*accumulate_dx=*/false, l.stream, d_residual_bf16_.data() + t0 * D);
  });
}

// Through x_out = x_mid + FFN(LN2(x_mid)): the FFN reads d_residual (bf16) and writes LN2's output
// gradient (with two lanes an MoE layer's backward_experts here, its backward_combine in
// ffn_backward_end).
void ModelGpu::ffn_backward_begin(Lane& l, Block& b) {
  const int64_t t0 = first_token(l), D64 = config_.model_dim;
  const int T = int(tokens(l)), D = int(D64);
  // d_residual's bf16 copy: written with it by the layer norm's backward above this block.
  const bf16* const d_residual_bf16 = d_residual_bf16_.data() + t0 * D64;
  float* const d_norm_input = d_norm_input_.data() + t0 * D64;
  const bf16* const ln2_y = b.ln2_y.data() + t0 * D64;
  if (b.moe[0]) {
    phase(l, "backward_moe", [&] {
      const MoeLayerWeights weights{weight(b.gate), b.w1_table.data(), b.w2_table.data()};
      const MoeLayerGradients gradients{d_norm_input, gradient(l, b.gate), b.d_w1_table[size_t(l.index)].data(),
                                        b.d_w2_table[size_t(l.index)].data()};
      MoeBlockFfn& moe = *b.moe[size_t(l.index)];
      // Pre-gated: d_norm_input receives only the gradient through the experts, and the gate's
      // share goes back to the block whose LN2 output it read.
      float* const d_gate_input =
          b.gate_input_block >= 0 ? blocks_[size_t(b.gate_input_block)].d_ln2_from_next_gate.data() + t0 * D64
                                  : nullptr;
      if (micro_batch_ >= 0) {  // no expert weight gradients: backward_micro_batch runs them at the end
        moe.backward_micro_batch(micro_batch_, ln2_y, weights, d_residual_bf16, gradients.dx,
                                 gradients.d_gate_weights, l.stream, gate_input(l, b), d_gate_input);
      } else if (lanes_.size() > 1) {
        moe.backward_experts(ln2_y, weights, d_residual_bf16, gradients, l.stream, gate_input(l, b), d_gate_input);
      } else {
        moe.backward(ln2_y, weights, d_residual_bf16, gradients, l.stream, gate_input(l, b), d_gate_input);
      }
    });
  } else {
    phase(l, "backward_dense_ffn", [&] {
      const int Hd = int(config_.dense_hidden_dim);
      const bf16* const hidden = b.hidden.data() + t0 * Hd;
      const bf16* const pre_activation = b.pre_activation.data() + t0 * Hd;
      bf16* const d_hidden = d_hidden_.data() + t0 * Hd;
      bf16* const d_pre_activation = d_pre_activation_.data() + t0 * Hd;
      l.cublas.set_stream(l.stream);
      // d w2 [H_dense, D] = hiddenᵀ dy;  d hidden [T, H_dense] = dy w2ᵀ
      gemm(l.cublas.get(), Op::transpose, Op::none, Hd, D, T, hidden, Hd, d_residual_bf16, D, gradient(l, b.ffn_w2), D,
           1.0f, 0.0f, true);
      gemm(l.cublas.get(), Op::none, Op::transpose, T, Hd, D, d_residual_bf16, D, weight(b.ffn_w2), D, d_hidden, Hd);
      gelu_backward(pre_activation, d_hidden, d_pre_activation, size_t(T) * size_t(Hd), l.stream);
      // d w1 [D, H_dense] = LN2(x)ᵀ d pre;  d LN2(x) [T, D] = d pre w1ᵀ
      gemm(l.cublas.get(), Op::transpose, Op::none, D, Hd, T, ln2_y, D, d_pre_activation, Hd, gradient(l, b.ffn_w1),
           Hd, 1.0f, 0.0f, true);
      gemm(l.cublas.get(), Op::none, Op::transpose, T, D, Hd, d_pre_activation, Hd, weight(b.ffn_w1), Hd,
           d_norm_input, D, 1.0f, 0.0f, true);
    });
  }
}

// LN2's backward adds its dx to the residual gradient. Pre-gated, LN2's output has two readers, this
// block's FFN and the next MoE block's gate, so its gradient is the sum of both: the gate's share
// arrives first (that block's backward ran earlier).
void ModelGpu::ffn_backward_end(Lane& l, Block& b) {
  const int64_t t0 = first_token(l), D64 = config_.model_dim;
  const int T = int(tokens(l)), D = int(D64);
  const size_t n = size_t(T) * size_t(D);
  float* const d_residual = d_residual_.data() + t0 * D64;
  float* const d_norm_input = d_norm_input_.data() + t0 * D64;
  if (b.moe[0] && lanes_.size() > 1) {
    phase(l, "backward_moe", [&] { b.moe[size_t(l.index)]->backward_combine(l.stream); });
  }
  phase(l, "backward_layer_norm", [&] {
    if (b.d_ln2_from_next_gate.size() > 0) {
      add_in_place(d_norm_input, b.d_ln2_from_next_gate.data() + t0 * D64, n, l.stream);
    }
    layer_norm_backward(d_norm_input, b.x_mid.data() + t0 * D64, b.ln2_mean.data() + t0, b.ln2_rstd.data() + t0,
                        weight(b.ln2_gain), d_residual, gradient(l, b.ln2_gain), gradient(l, b.ln2_bias),
                        l.layer_norm_scratch.data(), T, D, /*accumulate_dx=*/true, l.stream,
                        d_residual_bf16_.data() + t0 * D64);
  });
}

// Through x_mid = x + attention(LN1(x)).
void ModelGpu::attention_backward_phase(Lane& l, Block& b) {
  phase(l, "backward_attention", [&] {
    const int64_t t0 = first_token(l), D64 = config_.model_dim;
    const int T = int(tokens(l)), D = int(D64);
    float* const d_residual = d_residual_.data() + t0 * D64;
    bf16* const d_residual_bf16 = d_residual_bf16_.data() + t0 * D64;  // written with it by LN2's backward
    float* const d_norm_input = d_norm_input_.data() + t0 * D64;
    attention_backward(l.cublas.get(), l.attention->shape, b.ln1_y.data() + t0 * D64, weight(b.qkv), weight(b.out),
                       b.qkv_out.data() + t0 * 3 * D64, b.attention_saved.at(l.first_sequence),
                       b.context.data() + t0 * D64,
                       d_residual_bf16, gradient(l, b.qkv), gradient(l, b.out), d_norm_input, *l.attention, l.stream);
    layer_norm_backward(d_norm_input, b.x.data() + t0 * D64, b.ln1_mean.data() + t0, b.ln1_rstd.data() + t0,
                        weight(b.ln1_gain), d_residual, gradient(l, b.ln1_gain), gradient(l, b.ln1_bias),
                        l.layer_norm_scratch.data(), T, D, /*accumulate_dx=*/true, l.stream, d_residual_bf16);
  });
}

// The residual gradient at the input into both tables; the token table adds to the lm head's share.
void ModelGpu::embedding_backward_phase(Lane& l) {
  phase(l, "backward_embedding", [&] {
    const int64_t t0 = first_token(l);
    embedding_backward(tokens_ + t0, d_residual_.data() + t0 * config_.model_dim, gradient(l, token_embedding_),
                       gradient(l, position_embedding_), l.embedding_scratch.data(), l.sequences, config_.seq_len,
                       config_.model_dim,
                       /*accumulate_token_gradient=*/true, l.stream);
  });
}

// ---- [SECTION] optimizer ----

// Global norm and clip scale stay on the device. AdamW runs over the flat buffers with one launch
// per run of neighbouring tensors that share a weight-decay setting (layout order keeps a block's
// matrices together: about four runs per block), not one per tensor: with 16 experts a block
// has 38 tensors, and hundreds of tiny launches cost more than the update itself.
void ModelGpu::step(float lr) {
  phase(*lanes_[0], "optimizer", [&] {
    if (ranks_ == nullptr) {
      gradient_norm(gradients_.data(), parameter_count_, norm_partials_.data(), grad_norm_.data(), clip_scale_.data(),
                    optimizer_.max_grad_norm, stream_);
    } else {
      gradient_squared_norm(gradients_.data(), norm_spans_.data(), int(norm_spans_.size()), norm_partials_.data(),
                            squared_norm_.data(), stream_);
      ranks_->all_reduce_sum(squared_norm_.data(), 1, stream_);
      clip_scale_from_squared_norm(squared_norm_.data(), grad_norm_.data(), clip_scale_.data(), optimizer_.max_grad_norm,
                                   stream_);
    }
    ++optimizer_steps_;
    for (size_t first = 0; first < layout_.size();) {
      size_t end = first + 1;  // [first, end): tensors adjacent in memory with the same decay
      while (end < layout_.size() && layout_[end].weight_decay == layout_[first].weight_decay &&
             layout_[end].offset == layout_[end - 1].offset + layout_[end - 1].rows * layout_[end - 1].cols) {
        ++end;
      }
      const int64_t offset = layout_[first].offset;
      const int64_t count = layout_[end - 1].offset + layout_[end - 1].rows * layout_[end - 1].cols - offset;
      AdamWStep step;
      step.lr = lr;
      step.beta1 = optimizer_.beta1;
      step.beta2 = optimizer_.beta2;
      step.eps = optimizer_.eps;
      step.weight_decay = layout_[first].weight_decay ? optimizer_.weight_decay : 0.0f;
      step.step = optimizer_steps_;
      adamw_update(step, weights_.data() + offset, gradients_.data() + offset, first_moment_.data() + offset,
                   second_moment_.data() + offset, weights_bf16_.data() + offset, clip_scale_.data(), count, stream_);
      first = end;
    }
  });
}

}  // namespace moe::cuda
