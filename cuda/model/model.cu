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
  if (c.ranks > 1 && m.num_experts % c.ranks != 0) {
    reject("moe.num_experts (E)", text(m.num_experts),
           "a multiple of the ranks R = " + text(c.ranks) + " (each rank holds E / R experts)");
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

std::pair<int64_t, int64_t> local_experts(const ModelGpuConfig& c) {
  const int64_t per_rank = c.moe.num_experts / std::max<int64_t>(c.ranks, 1);
  return {c.rank * per_rank, per_rank};
}

std::vector<ParameterSpan> parameter_layout(const ModelGpuConfig& c) {
  const auto [first_expert, expert_count] = local_experts(c);
  std::vector<ParameterSpan> layout;
  int64_t offset = 0;
  for (const ParameterInfo& p : moe::parameter_layout(model_config_of(c))) {
    const bool expert = p.expert >= 0;
    if (expert && (p.expert < first_expert || p.expert >= first_expert + expert_count)) continue;  // another rank's
    layout.push_back({p.name, p.rows, p.cols, offset, p.weight_decay, expert});
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
  void set_phase_timer(PhaseTimer* timer) override { layer_.set_phase_timer(timer); }
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
  const size_t attention_pairs = size_t(config_.batch * config_.num_heads), S = size_t(config_.seq_len);

  // The MoE layers first: they check that they fit in the free memory before allocating anything.
  // Over M micro-batches each one's router losses weigh 1 / M of the step's loss (model.h); the
  // forward's reported losses keep config_.moe's coefficients (loss_phase).
  MoeConfig layer_config = config_.moe;
  const int micro_batches = int(config_.micro_batches);
  layer_config.aux_loss_coef /= micro_batches;
  layer_config.z_loss_coef /= micro_batches;
  blocks_.resize(size_t(config_.num_layers));
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    if (!is_moe_block(config_, i)) continue;
    blocks_[size_t(i)].moe = ranks_ != nullptr ? ranks_->make_moe_ffn(config_.moe, config_.batch * config_.seq_len)
                                               : std::make_unique<SingleGpuMoeFfn>(layer_config, micro_batches);
  }

  weights_ = DeviceBuffer<float>(P);
  gradients_ = DeviceBuffer<float>(P);
  gradient_target_ = gradients_.data();
  if (micro_batches > 1) {
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
    // counts a replicated tensor once over all ranks (weight 1 / R on each) and each expert once.
    std::vector<NormSpan> spans;
    gradient_buckets_.resize(size_t(config_.num_layers + 1));
    for (const ParameterSpan& p : layout_) {
      const int64_t count = p.rows * p.cols;
      const float weight = p.expert ? 1.0f : 1.0f / float(config_.ranks);
      if (!spans.empty() && spans.back().weight == weight && spans.back().offset + spans.back().count == p.offset) {
        spans.back().count += count;
      } else {
        spans.push_back({p.offset, count, weight});
      }
      if (!p.expert) {  // into its block's bucket ("blocks.i.*"), else the last one
        const bool in_block = p.name.rfind("blocks.", 0) == 0;
        auto& bucket = gradient_buckets_[in_block ? size_t(std::stoll(p.name.substr(7))) : size_t(config_.num_layers)];
        if (!bucket.empty() && bucket.back().first + bucket.back().second == p.offset) {
          bucket.back().second += count;
        } else {
          bucket.emplace_back(p.offset, count);
        }
      }
    }
    gradient_stream_ = std::make_unique<GradientStream>();
    norm_spans_ = DeviceBuffer<NormSpan>(spans);
    squared_norm_ = DeviceBuffer<double>(1);
  }

  // Per block: parameter offsets (walking the layout in its order), activations, expert tables.
  size_t next = 2;  // after token_embedding and position_embedding
  for (int64_t i = 0; i < config_.num_layers; ++i) {
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
    b.probs = DeviceBuffer<bf16>(attention_pairs * S * S);
    b.context = DeviceBuffer<bf16>(T * D);
    b.x_mid = DeviceBuffer<bf16>(T * D);
    b.ln2_y = DeviceBuffer<bf16>(T * D);
    b.ln2_mean = DeviceBuffer<float>(T);
    b.ln2_rstd = DeviceBuffer<float>(T);
    if (b.moe) {
      const size_t E = size_t(local_experts(config_).second);  // this rank's experts: all on one GPU
      b.gate = layout_[next++].offset;
      std::vector<const bf16*> w1(E), w2(E);
      std::vector<float*> d_w1(E), d_w2(E);
      for (size_t e = 0; e < E; ++e) {
        w1[e] = weight(layout_[next + e].offset);
        d_w1[e] = gradient(layout_[next + e].offset);
        w2[e] = weight(layout_[next + E + e].offset);
        d_w2[e] = gradient(layout_[next + E + e].offset);
      }
      next += 2 * E;
      b.w1_table = DeviceBuffer<const bf16*>(w1);
      b.w2_table = DeviceBuffer<const bf16*>(w2);
      b.d_w1_table = DeviceBuffer<float*>(d_w1);
      b.d_w2_table = DeviceBuffer<float*>(d_w2);
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
      if (!b.moe) continue;
      b.gate_input_block = previous_moe;
      if (previous_moe >= 0) blocks_[size_t(previous_moe)].d_ln2_from_next_gate = DeviceBuffer<float>(T * D);
      previous_moe = i;
    }
  }
  if (config_.moe_layers != MoeLayers::every_block) {
    d_hidden_ = DeviceBuffer<bf16>(T * Hd);
    d_pre_activation_ = DeviceBuffer<bf16>(T * Hd);
  }
  attention_workspace_ = std::make_unique<AttentionWorkspace>(
      AttentionShape{config_.batch, config_.seq_len, config_.model_dim, config_.num_heads});

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
  layer_norm_scratch_ = DeviceBuffer<float>(size_t(layer_norm_backward_scratch_floats(int64_t(T), int64_t(D))));
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
         {&b.x, &b.ln1_y, &b.qkv_out, &b.probs, &b.context, &b.x_mid, &b.ln2_y, &b.pre_activation, &b.hidden}) {
      buffer->fill_bytes(kNaN, stream_);
    }
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
                                      &d_residual_, &d_norm_input_, &layer_norm_scratch_}) {
    buffer->fill_bytes(kNaN, stream_);
  }
}

void ModelGpu::set_phase_timer(PhaseTimer* timer) {
  timer_ = timer;
  for (Block& b : blocks_) {
    if (b.moe) b.moe->set_phase_timer(timer);
  }
}

template <typename Work>
void ModelGpu::phase(const char* name, Work&& work) {
  if (timer_ != nullptr) timer_->begin(name, stream_);
  work();
  if (timer_ != nullptr) timer_->end(stream_);
}

// ---- [SECTION] forward ----

const float* ModelGpu::forward(const int32_t* tokens, const int32_t* targets) {
  micro_batch_ = -1;
  return forward_phases(tokens, targets);
}

const float* ModelGpu::forward_phases(const int32_t* tokens, const int32_t* targets) {
  tokens_ = tokens;
  targets_ = targets;
  embedding_forward_phase();
  for (Block& block : blocks_) {
    attention_forward_phase(block);
    ffn_forward_phase(block);
  }
  lm_head_forward_phase();
  loss_phase();
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
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      forward(graph_tokens, graph_targets);
      backward();
    } catch (...) {  // end the capture so the stream is usable again, then report the first error
      (void)cudaStreamEndCapture(stream_, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    auto captured = std::make_unique<Graph>();
    const cudaError_t instantiated = cudaGraphInstantiate(&captured->exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(instantiated);
    graph_ = std::move(captured);
  }
  CUDA_CHECK(cudaGraphLaunch(graph_->exec, stream_));
  return losses_.data();
}

// x0 = token_embedding[tokens] + position_embedding[s], straight into block 0's saved input.
void ModelGpu::embedding_forward_phase() {
  phase("embedding", [&] {
    const size_t n = blocks_[0].x.size();
    embedding_forward(tokens_, weight(token_embedding_), weight(position_embedding_), blocks_[0].x.data(),
                      config_.batch, config_.seq_len, config_.model_dim, stream_);
    bf16_to_float(blocks_[0].x.data(), residual_.data(), n, stream_);
  });
}

// x_mid = x + attention(LN1(x)); the fp32 residual in place, its bf16 copy saved as x_mid.
void ModelGpu::attention_forward_phase(Block& b) {
  phase("attention", [&] {
    const int64_t T = config_.batch * config_.seq_len, D = config_.model_dim;
    layer_norm_forward(b.x.data(), weight(b.ln1_gain), weight(b.ln1_bias), b.ln1_y.data(), b.ln1_mean.data(),
                       b.ln1_rstd.data(), T, D, float(config_.layer_norm_eps), stream_);
    attention_forward(cublas_.get(), attention_workspace_->shape, b.ln1_y.data(), weight(b.qkv), weight(b.out),
                      b.qkv_out.data(), b.probs.data(), b.context.data(), block_out_.data(), *attention_workspace_,
                      stream_);
    residual_add(residual_.data(), block_out_.data(), b.x_mid.data(), size_t(T * D), stream_);
  });
}

// What block b's gate reads: the previous MoE block's LN2 output when pre-gated, else nullptr
// (MoeLayerGpu then routes the block's own LN2 output).
const bf16* ModelGpu::gate_input(const Block& b) const {
  return b.gate_input_block >= 0 ? blocks_[size_t(b.gate_input_block)].ln2_y.data() : nullptr;
}

// x_out = x_mid + FFN(LN2(x_mid)); x_out's bf16 copy is the next block's input (or LN_final's).
void ModelGpu::ffn_forward_phase(Block& b) {
  const int64_t T = config_.batch * config_.seq_len, D = config_.model_dim;
  layer_norm_forward(b.x_mid.data(), weight(b.ln2_gain), weight(b.ln2_bias), b.ln2_y.data(), b.ln2_mean.data(),
                     b.ln2_rstd.data(), T, D, float(config_.layer_norm_eps), stream_);
  if (b.moe) {
    phase("moe", [&] {
      const MoeLayerWeights weights{weight(b.gate), b.w1_table.data(), b.w2_table.data()};
      if (micro_batch_ >= 0) {
        b.moe->forward_micro_batch(micro_batch_, b.ln2_y.data(), weights, block_out_.data(), stream_, gate_input(b));
      } else {
        b.moe->forward(b.ln2_y.data(), weights, block_out_.data(), stream_, gate_input(b));
      }
    });
  } else {
    phase("dense_ffn", [&] {
      const int Hd = int(config_.dense_hidden_dim);
      cublas_.set_stream(stream_);
      // pre = LN2(x) w1 [T, H_dense];  hidden = gelu(pre);  out = hidden w2 [T, D]
      gemm(cublas_.get(), Op::none, Op::none, int(T), Hd, int(D), b.ln2_y.data(), int(D), weight(b.ffn_w1), Hd,
           b.pre_activation.data(), Hd);
      gelu_forward(b.pre_activation.data(), b.hidden.data(), size_t(T) * size_t(Hd), stream_);
      gemm(cublas_.get(), Op::none, Op::none, int(T), int(D), Hd, b.hidden.data(), Hd, weight(b.ffn_w2), int(D),
           block_out_.data(), int(D));
    });
  }
  Block* const next = &b == &blocks_.back() ? nullptr : &b + 1;
  bf16* const x_out = next != nullptr ? next->x.data() : final_x_.data();
  residual_add(residual_.data(), block_out_.data(), x_out, size_t(T * D), stream_);
}

// logits = LN_final(x) token_embedding^T [T, V], fp32 (the tied output projection).
void ModelGpu::lm_head_forward_phase() {
  phase("lm_head", [&] {
    const int T = int(config_.batch * config_.seq_len), D = int(config_.model_dim), V = int(kVocabulary);
    layer_norm_forward(final_x_.data(), weight(final_gain_), weight(final_bias_), final_y_.data(),
                       final_mean_.data(), final_rstd_.data(), T, D, float(config_.layer_norm_eps), stream_);
    cublas_.set_stream(stream_);
    gemm(cublas_.get(), Op::none, Op::transpose, T, V, D, final_y_.data(), D, weight(token_embedding_), D,
         logits_.data(), V, 1.0f, 0.0f, /*c_is_float=*/true);
  });
}

// loss = mean cross-entropy + aux_loss_coef * sum aux + z_loss_coef * sum z, on the device.
void ModelGpu::loss_phase() {
  phase("loss", [&] {
    cross_entropy_forward(logits_.data(), targets_, token_losses_.data(), losses_.data() + 1,
                          config_.batch * config_.seq_len, stream_);
    start_loss_kernel<<<1, 1, 0, stream_>>>(losses_.data());
    CUDA_CHECK(cudaGetLastError());
    for (const Block& b : blocks_) {
      if (!b.moe) continue;
      add_router_losses_kernel<<<1, 1, 0, stream_>>>(losses_.data(), b.moe->aux_loss(), b.moe->z_loss(),
                                                     float(config_.moe.aux_loss_coef),
                                                     float(config_.moe.z_loss_coef));
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

void ModelGpu::backward_phases() {
  loss_backward_phase();
  for (size_t i = blocks_.size(); i-- > 0;) {
    ffn_backward_phase(blocks_[i]);
    attention_backward_phase(blocks_[i]);
    sum_gradient_bucket(i);  // block i's replicated gradients are complete
  }
  embedding_backward_phase();
  sum_gradient_bucket(blocks_.size());
  if (ranks_ != nullptr) {
    phase("gradient_all_reduce", [&] {  // what of the sums the backward did not hide
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
  if (ranks_ == nullptr || gradient_buckets_[bucket].empty()) return;
  CUDA_CHECK(cudaEventRecord(gradient_stream_->ready, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(gradient_stream_->stream, gradient_stream_->ready, 0));
  for (const auto& [offset, count] : gradient_buckets_[bucket]) {
    ranks_->all_reduce_sum(gradients_.data() + offset, count, gradient_stream_->stream);
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
    phase("accumulate_gradients", [&] {
      const size_t n = size_t(parameter_count_);
      add_in_place(gradients_.data(), micro_gradients_.data(), n, stream_);
    });
  }
  if (micro_batch == config_.micro_batches - 1) {
    // The experts' weight gradients, once over every micro-batch's rows, straight into gradients_.
    phase("backward_moe_weight_gradients", [&] {
      for (Block& b : blocks_) {
        if (b.moe) b.moe->expert_weight_gradients(b.d_w1_table.data(), b.d_w2_table.data(), stream_);
      }
    });
  }
}

// d_logits = (softmax - one_hot) / T; the tied projection's two products; LN_final's backward
// starts the residual gradient (overwritten here, accumulated by every block after).
void ModelGpu::loss_backward_phase() {
  phase("backward_lm_head", [&] {
    const int T = int(config_.batch * config_.seq_len), D = int(config_.model_dim), V = int(kVocabulary);
    // The loss is the mean over all ranks' tokens (and all micro-batches' of the step): each rank's,
    // each micro-batch's d_logits is its share of it.
    const int64_t micro_batches = micro_batch_ >= 0 ? config_.micro_batches : 1;
    cross_entropy_backward(logits_.data(), targets_, d_logits_.data(), T, stream_,
                           int64_t{T} * config_.ranks * micro_batches);
    cublas_.set_stream(stream_);
    // d token_embedding [V, D] = d_logitsᵀ LN_final(x): overwritten; the embedding adds its share later.
    gemm(cublas_.get(), Op::transpose, Op::none, V, D, T, d_logits_.data(), V, final_y_.data(), D,
         gradient(token_embedding_), D, 1.0f, 0.0f, true);
    // d LN_final(x) [T, D] = d_logits token_embedding
    gemm(cublas_.get(), Op::none, Op::none, T, D, V, d_logits_.data(), V, weight(token_embedding_), D,
         d_norm_input_.data(), D, 1.0f, 0.0f, true);
    layer_norm_backward(d_norm_input_.data(), final_x_.data(), final_mean_.data(), final_rstd_.data(),
                        weight(final_gain_), d_residual_.data(), gradient(final_gain_), gradient(final_bias_),
                        layer_norm_scratch_.data(), T, D, /*accumulate_dx=*/false, stream_);
  });
}

// Through x_out = x_mid + FFN(LN2(x_mid)): the FFN reads d_residual (bf16), LN2 adds its dx.
// Pre-gated, LN2's output has two readers, this block's FFN and the next MoE block's gate, so its
// gradient is the sum of both: the gate's share arrives first (that block's backward ran earlier).
void ModelGpu::ffn_backward_phase(Block& b) {
  const int T = int(config_.batch * config_.seq_len), D = int(config_.model_dim);
  const size_t n = size_t(T) * size_t(D);
  float_to_bf16(d_residual_.data(), d_residual_bf16_.data(), n, stream_);
  if (b.moe) {
    phase("backward_moe", [&] {
      const MoeLayerWeights weights{weight(b.gate), b.w1_table.data(), b.w2_table.data()};
      const MoeLayerGradients gradients{d_norm_input_.data(), gradient(b.gate), b.d_w1_table.data(),
                                        b.d_w2_table.data()};
      // Pre-gated: d_norm_input_ receives only the gradient through the experts, and the gate's
      // share goes back to the block whose LN2 output it read.
      float* const d_gate_input =
          b.gate_input_block >= 0 ? blocks_[size_t(b.gate_input_block)].d_ln2_from_next_gate.data() : nullptr;
      if (micro_batch_ >= 0) {  // no expert weight gradients: backward_micro_batch runs them at the end
        b.moe->backward_micro_batch(micro_batch_, b.ln2_y.data(), weights, d_residual_bf16_.data(), gradients.dx,
                                    gradients.d_gate_weights, stream_, gate_input(b), d_gate_input);
      } else {
        b.moe->backward(b.ln2_y.data(), weights, d_residual_bf16_.data(), gradients, stream_, gate_input(b),
                        d_gate_input);
      }
    });
  } else {
    phase("backward_dense_ffn", [&] {
      const int Hd = int(config_.dense_hidden_dim);
      cublas_.set_stream(stream_);
      // d w2 [H_dense, D] = hiddenᵀ dy;  d hidden [T, H_dense] = dy w2ᵀ
      gemm(cublas_.get(), Op::transpose, Op::none, Hd, D, T, b.hidden.data(), Hd, d_residual_bf16_.data(), D,
           gradient(b.ffn_w2), D, 1.0f, 0.0f, true);
      gemm(cublas_.get(), Op::none, Op::transpose, T, Hd, D, d_residual_bf16_.data(), D, weight(b.ffn_w2), D,
           d_hidden_.data(), Hd);
      gelu_backward(b.pre_activation.data(), d_hidden_.data(), d_pre_activation_.data(), size_t(T) * size_t(Hd),
                    stream_);
      // d w1 [D, H_dense] = LN2(x)ᵀ d pre;  d LN2(x) [T, D] = d pre w1ᵀ
      gemm(cublas_.get(), Op::transpose, Op::none, D, Hd, T, b.ln2_y.data(), D, d_pre_activation_.data(), Hd,
           gradient(b.ffn_w1), Hd, 1.0f, 0.0f, true);
      gemm(cublas_.get(), Op::none, Op::transpose, T, D, Hd, d_pre_activation_.data(), Hd, weight(b.ffn_w1), Hd,
           d_norm_input_.data(), D, 1.0f, 0.0f, true);
    });
  }
  phase("backward_layer_norm", [&] {
    if (b.d_ln2_from_next_gate.size() > 0) {
      add_in_place(d_norm_input_.data(), b.d_ln2_from_next_gate.data(), n, stream_);
    }
    layer_norm_backward(d_norm_input_.data(), b.x_mid.data(), b.ln2_mean.data(), b.ln2_rstd.data(),
                        weight(b.ln2_gain), d_residual_.data(), gradient(b.ln2_gain), gradient(b.ln2_bias),
                        layer_norm_scratch_.data(), T, D, /*accumulate_dx=*/true, stream_);
  });
}

// Through x_mid = x + attention(LN1(x)).
void ModelGpu::attention_backward_phase(Block& b) {
  phase("backward_attention", [&] {
    const int T = int(config_.batch * config_.seq_len), D = int(config_.model_dim);
    const size_t n = size_t(T) * size_t(D);
    float_to_bf16(d_residual_.data(), d_residual_bf16_.data(), n, stream_);
    attention_backward(cublas_.get(), attention_workspace_->shape, b.ln1_y.data(), weight(b.qkv), weight(b.out),
                       b.qkv_out.data(), b.probs.data(), b.context.data(), d_residual_bf16_.data(), gradient(b.qkv),
                       gradient(b.out), d_norm_input_.data(), *attention_workspace_, stream_);
    layer_norm_backward(d_norm_input_.data(), b.x.data(), b.ln1_mean.data(), b.ln1_rstd.data(), weight(b.ln1_gain),
                        d_residual_.data(), gradient(b.ln1_gain), gradient(b.ln1_bias), layer_norm_scratch_.data(),
                        T, D, /*accumulate_dx=*/true, stream_);
  });
}

// The residual gradient at the input into both tables; the token table adds to the lm head's share.
void ModelGpu::embedding_backward_phase() {
  phase("backward_embedding", [&] {
    embedding_backward(tokens_, d_residual_.data(), gradient(token_embedding_), gradient(position_embedding_),
                       config_.batch, config_.seq_len, config_.model_dim, /*accumulate_token_gradient=*/true,
                       stream_);
  });
}

// ---- [SECTION] optimizer ----

// Global norm and clip scale stay on the device. AdamW runs over the flat buffers with one launch
// per run of neighbouring tensors that share a weight-decay setting (layout order keeps a block's
// matrices together: about four runs per block), not one per tensor: with 16 experts a block
// has 38 tensors, and hundreds of tiny launches cost more than the update itself.
void ModelGpu::step(float lr) {
  phase("optimizer", [&] {
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
