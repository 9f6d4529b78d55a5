// infer/inference_model.cu: the decoding model (see infer/inference_model.h): its weights, the
// buffers of a step, the phases of a step, and the schedule of the experts around each MoE block.
//
// Index:
//   [SECTION] config checks
//   [SECTION] helpers
//   [SECTION] weights and construction
//   [SECTION] steps: prefill and decode
//   [SECTION] the phases of a step
//   [SECTION] MoE blocks and the schedule
//   [SECTION] logits and the routing record
#include "infer/inference_model.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <iterator>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/elementwise.h"  // fill_nan, bf16_to_float, residual_add
#include "core/cuda_check.h"      // CUDA_CHECK
#include "core/pinned_buffer.h"   // PinnedBuffer
#include "model/attention.h"      // attention_forward, AttentionWorkspace
#include "model/embedding.h"      // embedding_forward, kEmbeddingVocabulary
#include "model/layer_norm.h"     // layer_norm_forward
#include "moe/activation.h"       // gelu_forward
#include "moe/tensor_map.h"       // create_launch_scratch_pool

namespace moe::cuda {

namespace {

constexpr int64_t kVocabulary = kEmbeddingVocabulary;  // V = 256 bytes

[[noreturn]] void reject(const std::string& message) {
  throw std::invalid_argument("InferenceModelGpu: " + message);
}

// The MoE layer of a step of `tokens` new tokens: dropless with B = 64 (inference_model.h says why).
MoeConfig inference_layer_config(const ModelGpuConfig& config, int64_t tokens) {
  MoeConfig layer = config.moe;
  layer.tokens = tokens;
  layer.model_dim = config.model_dim;
  layer.formulation = Formulation::dropless;
  layer.block_size = kInferenceBlockSize;
  layer.capacity_factor = 1.0;
  return layer;
}

// The config as ModelGpu checks it for a batch of N full sequences, with the inference layer.
ModelGpuConfig normalised(const ModelGpuConfig& config) {
  ModelGpuConfig c = config;
  c.moe = inference_layer_config(config, config.batch * config.seq_len);
  return c;
}

}  // namespace

// ---- [SECTION] config checks ----

void validate_for_inference(const ModelGpuConfig& config) {
  // The expert sources (resident, offloaded, their pinned stores) are built with H-column W1 by the
  // inference programs; a SwiGLU model trains (ModelGpu) but does not decode here.
  if (config.moe_layers != MoeLayers::none && config.moe.activation != Activation::gelu) {
    reject("moe.activation = " + std::string(to_string(config.moe.activation)) +
           "; allowed for inference: gelu (SwiGLU experts train on the GPU, but the inference expert sources hold "
           "W1 [D, H])");
  }
  if (config.moe_layers != MoeLayers::none && config.moe.hidden_dim % kInferenceBlockSize != 0) {
    reject("moe.hidden_dim (H) = " + std::to_string(config.moe.hidden_dim) + "; allowed: a multiple of " +
           std::to_string(kInferenceBlockSize) + " (inference routes dropless with B = " +
           std::to_string(kInferenceBlockSize) + ")");
  }
  try {
    validate(normalised(config));
  } catch (const std::invalid_argument& error) {
    reject(error.what());
  }
}

void check_schedule(const ModelGpuConfig& config, ExpertSchedule schedule) {
  if (schedule == ExpertSchedule::pregated && !config.pregated) {
    reject("schedule pregated needs a model trained pre-gated (pregated = true: MoE block m_j's gate reads "
           "m_{j-1}'s LN2 output, so m_j's experts are known one MoE block early); this model's gates read their "
           "own block. Allowed here: gpu_only, on_demand, prefetch_all, speculative");
  }
}

// ---- [SECTION] helpers ----

namespace {

bool is_expert_matrix(const std::string& name) {
  return name.find(".moe.w1.") != std::string::npos || name.find(".moe.w2.") != std::string::npos;
}

// Every tensor of the layout but the experts' matrices, packed at offsets rounded up to 64 elements
// (128 bytes, so every operand starts aligned for vector loads and cuBLAS), converted to bf16.
std::vector<bf16> pack_dense_weights(const std::vector<ParameterSpan>& layout, std::span<const float> weights,
                                     std::map<std::string, int64_t>& offsets) {
  int64_t packed = 0;
  for (const ParameterSpan& span : layout) {
    if (is_expert_matrix(span.name)) continue;
    offsets[span.name] = packed;
    packed += (span.rows * span.cols + 63) / 64 * 64;
  }
  std::vector<bf16> out(static_cast<size_t>(packed), __float2bfloat16(0.0f));
  for (const ParameterSpan& span : layout) {
    if (is_expert_matrix(span.name)) continue;
    const int64_t at = offsets.at(span.name);
    for (int64_t i = 0; i < span.rows * span.cols; ++i) {
      out[size_t(at + i)] = __float2bfloat16(weights[size_t(span.offset + i)]);
    }
  }
  return out;
}

std::vector<int32_t> distinct_sorted(const std::vector<int32_t>& ids) {
  const std::set<int32_t> distinct(ids.begin(), ids.end());
  return {distinct.begin(), distinct.end()};
}

}  // namespace

// ---- [SECTION] weights and construction ----

// An event the host waits on (no timing), destroyed with its owner.
struct HostEvent {
  cudaEvent_t event = nullptr;
  HostEvent() { CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~HostEvent() { cudaEventDestroy(event); }  // no throw from a destructor
  HostEvent(const HostEvent&) = delete;
  HostEvent& operator=(const HostEvent&) = delete;
};

// The buffers of one step shape: T_new = N * count new tokens (count = P in a prefill, 1 in a decode step).
struct InferenceModelGpu::Pass {
  int64_t count = 0;   // new tokens per sequence
  int64_t tokens = 0;  // T_new
  DeviceBuffer<int32_t> inputs;    // [N * count + 1]: the new bytes [N, count], then the first position
  int32_t* bytes() { return inputs.data(); }                  // [N, count]
  int32_t* first_position() { return inputs.data() + tokens; }  // [1]
  DeviceBuffer<float> residual;    // [T_new, D] the fp32 residual stream
  DeviceBuffer<bf16> x;            // [T_new, D] its bf16 copy: what LayerNorm reads
  DeviceBuffer<bf16> normed;       // [T_new, D] LN1 or LN2 output
  DeviceBuffer<float> mean, rstd;  // [T_new]
  DeviceBuffer<bf16> qkv;          // [T_new, 3D]
  DeviceBuffer<bf16> context;      // [T_new, D]
  DeviceBuffer<bf16> block_out;    // [T_new, D] attention or FFN output before the residual add
  AttentionSavedBuffer attention_saved;  // prefill only: the core's log-sum-exp [N * heads, P] (or probs)
  std::unique_ptr<AttentionWorkspace> attention;  // prefill only: the full-sequence attention's scratch
  DeviceBuffer<bf16> pre_activation, hidden;      // [T_new, H_dense] dense blocks
  std::array<std::unique_ptr<MoeLayerGpu>, 2> moe;  // MoE block m_j uses moe[j % 2]
  DeviceBuffer<int32_t> routing;   // [M, T_new, K] each MoE block's top_experts, the step's record
  DeviceBuffer<bf16> last_x, last_normed;     // [N, D] each sequence's last new row, and LN_final of it
  DeviceBuffer<float> last_mean, last_rstd;   // [N]
  DeviceBuffer<float> logits;      // [N, V]
  // Host experts (allocated with the pass when the source may compute on the host): the LN2 rows
  // read back, the host's output rows by slot, and which slots they replace, pinned, and their
  // device copies that the layer's combine reads (moe_layer.h: ReplacedRows).
  PinnedBuffer<bf16> host_x;            // [T_new, D]
  PinnedBuffer<bf16> host_rows;         // [T_new * K, D]
  PinnedBuffer<int32_t> host_replace;   // [T_new * K]
  DeviceBuffer<bf16> replaced_rows;     // [T_new * K, D]
  DeviceBuffer<int32_t> replaced;       // [T_new * K]
  // A pre-gated block's read of the next block's routing, which the host waits for only once this
  // block's experts are enqueued (moe_block): pinned, so the copy does not hold the host.
  PinnedBuffer<int32_t> next_routing;   // [T_new * K]
  std::unique_ptr<HostEvent> next_routing_read;
  // host side, per step: what each MoE block's source was told
  std::vector<std::vector<int32_t>> known;       // [M] experts read back for block m_j (valid if known_valid)
  std::vector<std::vector<int32_t>> top;         // [M][T_new * K] the same, per slot (rows per expert)
  std::vector<char> known_valid;                 // [M]
  std::vector<std::vector<int32_t>> prefetched;  // [M] what the schedule prefetched for m_j
  std::vector<std::vector<int32_t>> on_host;     // [M] the experts m_j computes on the host (valid if host_valid)
  std::vector<char> host_valid;                  // [M]
  std::vector<double> host_ms;                   // [M] the host's time for them
};

InferenceModelGpu::InferenceModelGpu(const ModelGpuConfig& config, std::span<const float> weights,
                                     ExpertSource& experts, ExpertSchedule schedule, cudaStream_t stream)
    : config_((validate_for_inference(config), check_schedule(config, schedule), normalised(config))),
      experts_(&experts),
      schedule_(schedule),
      stream_(stream),
      cache_(KvCacheShape{config.num_layers, config.batch, config.num_heads, config.seq_len,
                          config.model_dim / config.num_heads}) {
  const std::vector<ParameterSpan> layout = parameter_layout(config_);
  const int64_t parameters = layout.back().offset + layout.back().rows * layout.back().cols;
  if (static_cast<int64_t>(weights.size()) != parameters) {
    reject("weights have " + std::to_string(weights.size()) + " values; the model has " + std::to_string(parameters) +
           " parameters (parameter_layout's flat order)");
  }
  std::map<std::string, int64_t> offsets;
  weights_ = DeviceBuffer<bf16>(pack_dense_weights(layout, weights, offsets));
  const auto at = [&](const std::string& name) -> const bf16* { return weights_.data() + offsets.at(name); };
  token_embedding_ = at("token_embedding");
  position_embedding_ = at("position_embedding");
  final_gain_ = at("final_ln.gain");
  final_bias_ = at("final_ln.bias");
  blocks_.resize(size_t(config_.num_layers));
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const std::string prefix = "blocks." + std::to_string(i) + ".";
    Block& b = blocks_[size_t(i)];
    b.ln1_gain = at(prefix + "ln1.gain");
    b.ln1_bias = at(prefix + "ln1.bias");
    b.qkv = at(prefix + "attention.qkv");
    b.out = at(prefix + "attention.out");
    b.ln2_gain = at(prefix + "ln2.gain");
    b.ln2_bias = at(prefix + "ln2.bias");
    if (is_moe_block(config_, i)) {
      b.gate = at(prefix + "moe.gate");
      b.moe_index = static_cast<int64_t>(moe_blocks_.size());
      moe_blocks_.push_back(i);
    } else {
      b.ffn_w1 = at(prefix + "ffn.w1");
      b.ffn_w2 = at(prefix + "ffn.w2");
    }
  }
  decode_ = make_pass(1);
  cublas_.set_stream(stream_);
  CUDA_CHECK(cudaDeviceSynchronize());  // the uploads above ran on the default stream
}

InferenceModelGpu::~InferenceModelGpu() = default;

std::unique_ptr<InferenceModelGpu::Pass> InferenceModelGpu::make_pass(int64_t new_per_sequence) {
  auto pass = std::make_unique<Pass>();
  const int64_t N = config_.batch, D = config_.model_dim, T = N * new_per_sequence;
  const size_t t = size_t(T), d = size_t(D);
  pass->count = new_per_sequence;
  pass->tokens = T;
  // The MoE layers first: they check that they fit in the free memory before allocating.
  const size_t layers = std::min<size_t>(moe_blocks_.size(), 2);
  for (size_t l = 0; l < layers; ++l) pass->moe[l] = std::make_unique<MoeLayerGpu>(inference_layer_config(config_, T));
  for (auto& layer : pass->moe) {
    if (layer) layer->set_phase_timer(timer_);
  }
  pass->inputs = DeviceBuffer<int32_t>(t + 1);
  pass->residual = DeviceBuffer<float>(t * d);
  pass->x = DeviceBuffer<bf16>(t * d);
  pass->normed = DeviceBuffer<bf16>(t * d);
  pass->mean = DeviceBuffer<float>(t);
  pass->rstd = DeviceBuffer<float>(t);
  pass->qkv = DeviceBuffer<bf16>(t * 3 * d);
  pass->context = DeviceBuffer<bf16>(t * d);
  pass->block_out = DeviceBuffer<bf16>(t * d);
  if (new_per_sequence > 1) {  // a prefill: the full-sequence attention over the prompts
    const AttentionShape shape{N, new_per_sequence, D, config_.num_heads};
    pass->attention = std::make_unique<AttentionWorkspace>(shape);
    pass->attention_saved = AttentionSavedBuffer(shape, pass->attention->core);
  }
  if (config_.moe_layers != MoeLayers::every_block) {
    pass->pre_activation = DeviceBuffer<bf16>(t * size_t(config_.dense_hidden_dim));
    pass->hidden = DeviceBuffer<bf16>(t * size_t(config_.dense_hidden_dim));
  }
  pass->routing = DeviceBuffer<int32_t>(std::max<size_t>(moe_blocks_.size(), 1) * t * size_t(config_.moe.top_k));
  pass->last_x = DeviceBuffer<bf16>(size_t(N) * d);
  pass->last_normed = DeviceBuffer<bf16>(size_t(N) * d);
  pass->last_mean = DeviceBuffer<float>(size_t(N));
  pass->last_rstd = DeviceBuffer<float>(size_t(N));
  pass->logits = DeviceBuffer<float>(size_t(N * kVocabulary));
  if (experts_->needs_experts_on_host()) {
    const size_t slots = t * size_t(config_.moe.top_k);
    pass->host_x = PinnedBuffer<bf16>(t * d);
    pass->host_rows = PinnedBuffer<bf16>(slots * d);
    pass->host_replace = PinnedBuffer<int32_t>(slots);
    pass->replaced_rows = DeviceBuffer<bf16>(slots * d);
    pass->replaced = DeviceBuffer<int32_t>(slots);
    pass->next_routing = PinnedBuffer<int32_t>(slots);
    pass->next_routing_read = std::make_unique<HostEvent>();
  }
  return pass;
}

void InferenceModelGpu::set_schedule(ExpertSchedule schedule) {
  check_schedule(config_, schedule);
  schedule_ = schedule;
  graph_.reset();  // the captured step was the old schedule's; the next decode step captures again
}

void InferenceModelGpu::set_phase_timer(PhaseTimer* timer) {
  timer_ = timer;
  for (auto& layer : decode_->moe) {
    if (layer) layer->set_phase_timer(timer);
  }
}

void InferenceModelGpu::poison() {
  cache_.poison(stream_);
  Pass& p = *decode_;
  for (DeviceBuffer<bf16>* buffer : {&p.x, &p.normed, &p.qkv, &p.context, &p.block_out, &p.pre_activation, &p.hidden,
                                     &p.last_x, &p.last_normed}) {
    if (buffer->size() > 0) {
      fill_nan(buffer->data(), buffer->size(), stream_);
    }
  }
  for (DeviceBuffer<float>* buffer : {&p.residual, &p.mean, &p.rstd, &p.last_mean, &p.last_rstd, &p.logits}) {
    buffer->fill_bytes(0xFF, stream_);  // NaN
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename Work>
void InferenceModelGpu::phase(const char* name, Work&& work) {
  if (timer_ != nullptr) timer_->begin(name, stream_);
  work();
  if (timer_ != nullptr) timer_->end(stream_);
}

// ---- [SECTION] steps: prefill and decode ----

namespace {

void check_bytes(const std::vector<int32_t>& bytes, const std::string& what) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] < 0 || bytes[i] >= kVocabulary) {
      reject(what + " value " + std::to_string(i) + " = " + std::to_string(bytes[i]) + "; expected a byte, 0..255");
    }
  }
}

}  // namespace

StepResult InferenceModelGpu::prefill(const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t N = config_.batch, S = config_.seq_len;
  if (static_cast<int64_t>(prompts.size()) != N) {
    reject("prefill got " + std::to_string(prompts.size()) + " prompts; the model decodes batch N = " +
           std::to_string(N) + " sequences");
  }
  const int64_t P = static_cast<int64_t>(prompts[0].size());
  std::vector<int32_t> bytes;
  for (size_t n = 0; n < prompts.size(); ++n) {
    const int64_t length = static_cast<int64_t>(prompts[n].size());
    if (length == 0) reject("prompt " + std::to_string(n) + " is empty; expected 1..S = " + std::to_string(S) + " bytes");
    if (length > S) {
      reject("prompt " + std::to_string(n) + " has " + std::to_string(length) +
             " bytes, longer than the context: S = " + std::to_string(S) + " positions");
    }
    if (length != P) {
      reject("prompt " + std::to_string(n) + " has " + std::to_string(length) + " bytes and prompt 0 has " +
             std::to_string(P) + "; a prefill takes prompts of equal length (pad or trim them)");
    }
    check_bytes(prompts[n], "prompt " + std::to_string(n) + "'s");
    bytes.insert(bytes.end(), prompts[n].begin(), prompts[n].end());
  }
  std::unique_ptr<Pass> pass = P == 1 ? nullptr : make_pass(P);  // a one-byte prompt is a decode step's shape
  Pass& p = pass ? *pass : *decode_;
  upload_inputs(p, bytes, 0);
  length_ = 0;  // the cache is empty: rows past a length are never read
  StepResult result = run(p);
  length_ = P;
  return result;
}

StepResult InferenceModelGpu::decode_step(const std::vector<int32_t>& next_bytes) {
  const int64_t N = config_.batch, S = config_.seq_len;
  if (length_ == 0) throw std::logic_error("InferenceModelGpu::decode_step: call prefill() first");
  if (static_cast<int64_t>(next_bytes.size()) != N) {
    reject("decode_step got " + std::to_string(next_bytes.size()) + " bytes; expected one per sequence, N = " +
           std::to_string(N));
  }
  if (length_ + 1 > S) {
    reject("the context is full: every sequence holds " + std::to_string(length_) + " positions and S = " +
           std::to_string(S) + "; a decode step needs one more");
  }
  check_bytes(next_bytes, "next byte");
  upload_inputs(*decode_, next_bytes, length_);
  StepResult result = run(*decode_);
  length_ += 1;
  return result;
}

// The step's bytes and its first position, in one copy: every kernel of a step reads the position
// from the device, so that a captured decode step replays at whatever position comes next.
void InferenceModelGpu::upload_inputs(Pass& pass, const std::vector<int32_t>& bytes, int64_t first_position) {
  std::vector<int32_t> inputs(bytes);
  inputs.push_back(static_cast<int32_t>(first_position));
  CUDA_CHECK(cudaMemcpyAsync(pass.inputs.data(), inputs.data(), inputs.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_));
}

// ---- [SECTION] the decode step as one CUDA graph ----

void InferenceModelGpu::set_decode_graph(bool on) { graph_on_ = on; }

bool InferenceModelGpu::decode_graph_applies() const {
  return graph_on_ && !experts_->needs_experts_on_host() && timer_ == nullptr && stream_ != nullptr;
}

// Captures the decode pass's whole step (embedding to logits and routing record, on the device) into
// one graph. The step's host-side record (what was prefetched, host experts: none for a source
// that needs nothing on the host) is the captured step's, which every replay shares.
void InferenceModelGpu::capture_decode_graph() {
  create_launch_scratch_pool();  // the block-sparse kernels' scratch: a capture cannot create the pool
  graph_ = CapturedGraph::capture(stream_, [&] { enqueue_step(*decode_); });
}

// A prefill's pass, a source that waits on the host, a phase timer or the legacy stream: launched.
// Else the decode pass's first step runs launched (whatever the kernels set up on first use happens
// outside a capture), the second is captured, and every step replays the graph.
StepResult InferenceModelGpu::run(Pass& pass) {
  if (&pass != decode_.get() || !decode_graph_applies()) {
    enqueue_step(pass);
  } else if (!graph_warmed_up_) {
    enqueue_step(pass);
    graph_warmed_up_ = true;
  } else {
    if (!graph_) capture_decode_graph();
    graph_->launch(stream_);
  }
  return read_step(pass);
}

// ---- [SECTION] the phases of a step ----

void InferenceModelGpu::enqueue_step(Pass& pass) {
  const size_t M = moe_blocks_.size();
  pass.known.assign(M, {});
  pass.top.assign(M, {});
  pass.known_valid.assign(M, 0);
  pass.prefetched.assign(M, {});
  pass.on_host.assign(M, {});
  pass.host_valid.assign(M, 0);
  pass.host_ms.assign(M, 0.0);
  embedding_phase(pass);
  // prefetch_all: m_0 has no MoE block before it; its experts are asked for at the step's start.
  if (schedule_ == ExpertSchedule::prefetch_all && M > 0 && !experts_->resident(0)) {
    std::vector<int32_t> all(size_t(config_.moe.num_experts));
    std::iota(all.begin(), all.end(), 0);
    if (experts_->plans_on_device()) {
      experts_->prefetch_on_device(0, nullptr, 0, stream_);
    } else {
      experts_->prefetch(0, all);
    }
    pass.prefetched[0] = std::move(all);
  }
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    attention_phase(pass, i);
    ffn_phase(pass, i);
  }
  lm_head_phase(pass);
}

// x0 = token_embedding[bytes] + position_embedding[first_position + i]: token i of each sequence
// reads row first_position + i, the first position read on the device.
void InferenceModelGpu::embedding_phase(Pass& pass) {
  phase("embedding", [&] {
    const int64_t D = config_.model_dim;
    embedding_forward(pass.bytes(), token_embedding_, position_embedding_, pass.x.data(), config_.batch, pass.count, D,
                      stream_, pass.first_position());
    bf16_to_float(pass.x.data(), pass.residual.data(), pass.x.size(), stream_);
  });
}

// x += attention(LN1(x)): a prefill runs the full-sequence kernels over the prompts (model/attention.h)
// and stores their keys and values; a decode step projects its one row per sequence, appends its key
// and value at first_position and attends to positions 0..first_position (read on the device).
void InferenceModelGpu::attention_phase(Pass& pass, int64_t layer) {
  phase("attention", [&] {
    const Block& b = blocks_[size_t(layer)];
    const int64_t T = pass.tokens, D = config_.model_dim;
    const KvCacheShape& shape = cache_.shape();
    layer_norm_forward(pass.x.data(), b.ln1_gain, b.ln1_bias, pass.normed.data(), pass.mean.data(), pass.rstd.data(),
                       T, D, float(config_.layer_norm_eps), stream_);
    if (pass.attention) {
      attention_forward(cublas_.get(), pass.attention->shape, pass.normed.data(), b.qkv, b.out, pass.qkv.data(),
                        pass.attention_saved.at(0), pass.context.data(), pass.block_out.data(), *pass.attention,
                        stream_);
      kv_cache_append(pass.qkv.data(), cache_.keys(layer), cache_.values(layer), shape, pass.count,
                      pass.first_position(), stream_);
    } else {
      cublas_.set_stream(stream_);
      // [q | k | v] = LN1(x) qkv [N, 3D];  out = context out [N, D]
      gemm(cublas_.get(), Op::none, Op::none, int(T), int(3 * D), int(D), pass.normed.data(), int(D), b.qkv,
           int(3 * D), pass.qkv.data(), int(3 * D));
      kv_cache_append(pass.qkv.data(), cache_.keys(layer), cache_.values(layer), shape, 1, pass.first_position(),
                      stream_);
      decode_attention(pass.qkv.data(), cache_.keys(layer), cache_.values(layer), pass.context.data(), shape,
                       pass.first_position(), stream_);
      gemm(cublas_.get(), Op::none, Op::none, int(T), int(D), int(D), pass.context.data(), int(D), b.out, int(D),
           pass.block_out.data(), int(D));
    }
    residual_add(pass.residual.data(), pass.block_out.data(), pass.x.data(), pass.residual.size(), stream_);
  });
}

// x += FFN(LN2(x)), the FFN an MoE block (with its experts' schedule) or the dense GeLU FFN.
void InferenceModelGpu::ffn_phase(Pass& pass, int64_t layer) {
  const Block& b = blocks_[size_t(layer)];
  const int64_t T = pass.tokens, D = config_.model_dim;
  layer_norm_forward(pass.x.data(), b.ln2_gain, b.ln2_bias, pass.normed.data(), pass.mean.data(), pass.rstd.data(),
                     T, D, float(config_.layer_norm_eps), stream_);
  if (b.moe_index >= 0) {
    phase("moe", [&] { moe_block(pass, layer); });
  } else {
    phase("dense_ffn", [&] {
      const int Hd = int(config_.dense_hidden_dim);
      cublas_.set_stream(stream_);
      // pre = LN2(x) w1 [T, H_dense];  hidden = gelu(pre);  out = hidden w2 [T, D]
      gemm(cublas_.get(), Op::none, Op::none, int(T), Hd, int(D), pass.normed.data(), int(D), b.ffn_w1, Hd,
           pass.pre_activation.data(), Hd);
      gelu_forward(pass.pre_activation.data(), pass.hidden.data(), size_t(T) * size_t(Hd), stream_);
      gemm(cublas_.get(), Op::none, Op::none, int(T), int(D), Hd, pass.hidden.data(), Hd, b.ffn_w2, int(D),
           pass.block_out.data(), int(D));
    });
  }
  residual_add(pass.residual.data(), pass.block_out.data(), pass.x.data(), pass.residual.size(), stream_);
}

// ---- [SECTION] MoE blocks and the schedule ----

// Routes MoE block m_j from router_input into its layer, and keeps the routing for the step's record.
void InferenceModelGpu::route_block(Pass& pass, int64_t j, const bf16* router_input) {
  MoeLayerGpu& layer = *pass.moe[size_t(j % 2)];
  layer.route(router_input, blocks_[size_t(moe_blocks_[size_t(j)])].gate, stream_);
  const size_t slots = size_t(pass.tokens * config_.moe.top_k);
  CUDA_CHECK(cudaMemcpyAsync(pass.routing.data() + size_t(j) * slots, layer.top_experts().data(),
                             slots * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream_));
}

// Block `layer` = m_j, its LN2 output in pass.normed: the order of inference_model.h's list.
void InferenceModelGpu::moe_block(Pass& pass, int64_t layer) {
  const int64_t j = blocks_[size_t(layer)].moe_index;
  const bool has_next = j + 1 < static_cast<int64_t>(moe_blocks_.size());
  MoeLayerGpu& this_layer = *pass.moe[size_t(j % 2)];
  MoeLayerGpu* next_layer = has_next ? pass.moe[size_t((j + 1) % 2)].get() : nullptr;
  const bool fetches = experts_->needs_experts_on_host();
  const bool on_device = experts_->plans_on_device();  // the slot table on the device: no read-back
  const int64_t routing_slots = pass.tokens * config_.moe.top_k;

  // ---- the gates: this block's (unless pre-gated one block ago), then the next block's ----
  if (!(config_.pregated && j > 0)) route_block(pass, j, pass.normed.data());
  // Pre-gating: m_{j+1}'s gate reads this block's LN2 output; its routing is the real one.
  if (has_next && config_.pregated) route_block(pass, j + 1, pass.normed.data());
  // What to ask the source for m_{j+1} before this block's experts run, made only for a source that
  // fetches experts (a resident one ignores prefetches): read back, or planned on the device.
  const bool next_resident = has_next && experts_->resident(j + 1);  // nothing to prefetch for it
  const bool guess_next = has_next && !next_resident && (fetches || on_device) &&
                          (schedule_ == ExpertSchedule::pregated || schedule_ == ExpertSchedule::speculative);
  if (guess_next && !config_.pregated) {
    // speculative on a self-gated model: m_{j+1}'s own gate on this block's LN2 output, into the
    // layer m_{j+1} will route into for real (which overwrites the guess)
    next_layer->route(pass.normed.data(), blocks_[size_t(moe_blocks_[size_t(j + 1)])].gate, stream_);
  }

  // ---- the one host wait of this block: its own choice (unless known) and the guess ----
  // Where this block's choice is known (a pre-gated block after the first) or not needed (a block
  // the source holds resident), only the guess is read, and this block's experts do not need it:
  // its copy is enqueued now and the host waits for it after this block's experts are enqueued, so
  // the GPU computes them meanwhile instead of idling through the read-back and the enqueueing.
  std::vector<const MoeLayerGpu*> to_read;
  const bool read_this = fetches && !pass.known_valid[size_t(j)] && !experts_->resident(j);
  const bool read_guess = guess_next && fetches;
  const bool guess_later = read_guess && !read_this;
  if (read_this) to_read.push_back(&this_layer);
  if (read_guess && !guess_later) to_read.push_back(next_layer);
  const auto take_guess = [&](std::vector<int32_t> guess) {
    pass.prefetched[size_t(j + 1)] = distinct_sorted(guess);
    // A pre-gated model's guess is m_{j+1}'s real routing: it need not be read again.
    if (config_.pregated) {
      pass.top[size_t(j + 1)] = std::move(guess);
      pass.known[size_t(j + 1)] = pass.prefetched[size_t(j + 1)];
      pass.known_valid[size_t(j + 1)] = 1;
    }
  };
  if (!to_read.empty()) {
    std::vector<std::vector<int32_t>> read = read_back_experts(to_read);  // per slot
    if (read_this) {
      pass.top[size_t(j)] = read.front();
      pass.known[size_t(j)] = distinct_sorted(read.front());
      pass.known_valid[size_t(j)] = 1;
    }
    if (read_guess && !guess_later) take_guess(std::move(read.back()));
  }
  if (guess_later) {
    CUDA_CHECK(cudaMemcpyAsync(pass.next_routing.data(), next_layer->top_experts().data(),
                               size_t(routing_slots) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaEventRecord(pass.next_routing_read->event, stream_));
  }

  // ---- the experts computed on the host instead (none unless the source's host experts are on) ----
  if (!pass.host_valid[size_t(j)]) choose_host_experts(pass, j, /*chosen_ahead=*/false);
  const std::vector<int32_t>& on_host = pass.on_host[size_t(j)];
  std::vector<int32_t> on_gpu;
  std::set_difference(pass.known[size_t(j)].begin(), pass.known[size_t(j)].end(), on_host.begin(), on_host.end(),
                      std::back_inserter(on_gpu));
  if (!on_host.empty()) {
    // Their rows: the LN2 output, read back before any of this block's expert work is enqueued (the
    // wait is for the LN2 and the gate, as the routing's), so the host works while the GPU does.
    // The wait also ends the previous block's upload from host_rows, which is rewritten below.
    CUDA_CHECK(cudaMemcpyAsync(pass.host_x.data(), pass.normed.data(), pass.normed.bytes(), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // ---- acquire this block's experts, prefetch the next block's, compute, release ----
  const ExpertTables tables = on_device
                                  ? experts_->acquire_on_device(j, this_layer.top_experts().data(), routing_slots, stream_)
                                  : experts_->acquire(j, on_gpu, stream_);
  if (tables.w1 == nullptr || tables.w2 == nullptr) {
    throw std::logic_error("InferenceModelGpu: the expert source returned no pointer tables for MoE block " +
                           std::to_string(j) + " (layer " + std::to_string(layer) + ")");
  }
  // The next block's prefetch, once its guess is on the host (after this block's acquire, which
  // may have evicted some of this block's experts).
  const auto prefetch_next = [&] {
    if (!has_next || next_resident) return;
    if (schedule_ == ExpertSchedule::prefetch_all) {
      pass.prefetched[size_t(j + 1)].resize(size_t(config_.moe.num_experts));
      std::iota(pass.prefetched[size_t(j + 1)].begin(), pass.prefetched[size_t(j + 1)].end(), 0);
    }
    // A pre-gated model knows m_{j+1}'s routing now: its host experts are chosen a block ahead and
    // are not prefetched. The copies of the others start now, while the host first computes this
    // block's host experts.
    if (config_.pregated && pass.known_valid[size_t(j + 1)]) {
      choose_host_experts(pass, j + 1, /*chosen_ahead=*/true);
      std::vector<int32_t> copied;
      std::set_difference(pass.prefetched[size_t(j + 1)].begin(), pass.prefetched[size_t(j + 1)].end(),
                          pass.on_host[size_t(j + 1)].begin(), pass.on_host[size_t(j + 1)].end(),
                          std::back_inserter(copied));
      pass.prefetched[size_t(j + 1)] = std::move(copied);
    }
    if (on_device) {
      // The device plans m_{j+1}'s copies from the routing where the gate wrote it (the record's
      // prefetched list is known on the host only for prefetch_all).
      if (schedule_ == ExpertSchedule::prefetch_all) {
        experts_->prefetch_on_device(j + 1, nullptr, 0, stream_);
      } else if (guess_next) {
        experts_->prefetch_on_device(j + 1, next_layer->top_experts().data(), routing_slots, stream_);
      }
    } else if (!pass.prefetched[size_t(j + 1)].empty()) {
      experts_->prefetch(j + 1, pass.prefetched[size_t(j + 1)]);
    }
  };
  if (!guess_later) prefetch_next();
  const MoeLayerWeights weights{blocks_[size_t(layer)].gate, tables.w1, tables.w2};
  this_layer.run_experts(pass.normed.data(), weights, stream_);
  if (guess_later) {
    CUDA_CHECK(cudaEventSynchronize(pass.next_routing_read->event));
    take_guess(std::vector<int32_t>(pass.next_routing.data(), pass.next_routing.data() + routing_slots));
    prefetch_next();
  }
  if (on_host.empty()) {
    this_layer.combine(pass.block_out.data(), stream_);
  } else {
    // The host's experts run while the GPU runs the others (their table entries point at the
    // poison expert: the GPU's rows for them are NaN until replaced, before the combine).
    host_experts_forward(pass, j);
    const ReplacedRows replaced{pass.replaced_rows.data(), pass.replaced.data()};
    this_layer.combine(pass.block_out.data(), stream_, &replaced);
  }
  experts_->release(j, stream_);
}

// The source's pick of m_j's experts to compute on the host, from its routing on the host.
void InferenceModelGpu::choose_host_experts(Pass& pass, int64_t j, bool chosen_ahead) {
  const std::vector<int32_t>& experts = pass.known[size_t(j)];
  std::vector<int64_t> rows(experts.size(), 0);
  for (int32_t e : pass.top[size_t(j)]) {
    const auto at = std::lower_bound(experts.begin(), experts.end(), e);
    if (at != experts.end() && *at == e) rows[size_t(at - experts.begin())] += 1;
  }
  ExpertSource::HostPick pick;
  if (!experts.empty()) pick = experts_->choose_host_experts(j, experts, rows, chosen_ahead);
  pass.on_host[size_t(j)] = std::move(pick.experts);
  pass.host_valid[size_t(j)] = 1;
}

// y = expert e on its rows of host_x, for each of m_j's host experts, into host_rows by slot (bf16,
// as the GPU's expert outputs); then both tables go to the device on the compute stream.
void InferenceModelGpu::host_experts_forward(Pass& pass, int64_t j) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t D = config_.model_dim, K = config_.moe.top_k;
  const std::vector<int32_t>& top = pass.top[size_t(j)];
  std::fill(pass.host_replace.data(), pass.host_replace.data() + top.size(), 0);
  std::vector<float> x, y;
  std::vector<size_t> slots;
  for (int32_t e : pass.on_host[size_t(j)]) {
    slots.clear();
    for (size_t s = 0; s < top.size(); ++s) {
      if (top[s] == e) slots.push_back(s);
    }
    const auto rows = static_cast<int64_t>(slots.size());
    x.resize(size_t(rows * D));
    y.resize(x.size());
    for (size_t r = 0; r < slots.size(); ++r) {
      const bf16* row = pass.host_x.data() + (slots[r] / size_t(K)) * size_t(D);
      for (int64_t c = 0; c < D; ++c) x[r * size_t(D) + size_t(c)] = __bfloat162float(row[c]);
    }
    experts_->host_forward(j, e, x, rows, y);
    for (size_t r = 0; r < slots.size(); ++r) {
      bf16* out = pass.host_rows.data() + slots[r] * size_t(D);
      for (int64_t c = 0; c < D; ++c) out[c] = __float2bfloat16(y[r * size_t(D) + size_t(c)]);
      pass.host_replace[slots[r]] = 1;
    }
  }
  CUDA_CHECK(cudaMemcpyAsync(pass.replaced_rows.data(), pass.host_rows.data(), top.size() * size_t(D) * sizeof(bf16),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(pass.replaced.data(), pass.host_replace.data(), top.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  pass.host_ms[size_t(j)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// One copy per layer and one wait for all of them: the on-demand stall (a host wait on the gates).
// Each layer's top_experts [T_new, K], per slot.
std::vector<std::vector<int32_t>> InferenceModelGpu::read_back_experts(const std::vector<const MoeLayerGpu*>& layers) {
  std::vector<std::vector<int32_t>> top;
  for (const MoeLayerGpu* layer : layers) {
    top.emplace_back(layer->top_experts().size());
    CUDA_CHECK(cudaMemcpyAsync(top.back().data(), layer->top_experts().data(), top.back().size() * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return top;
}

// ---- [SECTION] logits and the routing record ----

// next_logits = LN_final(each sequence's last new row) token_embedding^T [N, V].
void InferenceModelGpu::lm_head_phase(Pass& pass) {
  const int64_t N = config_.batch, D = config_.model_dim;
  phase("lm_head", [&] {
    // row n * count + count - 1 of x for each sequence n: a strided copy of N rows
    const size_t row_bytes = size_t(D) * sizeof(bf16);
    CUDA_CHECK(cudaMemcpy2DAsync(pass.last_x.data(), row_bytes, pass.x.data() + (pass.count - 1) * D,
                                 row_bytes * size_t(pass.count), row_bytes, size_t(N), cudaMemcpyDeviceToDevice,
                                 stream_));
    layer_norm_forward(pass.last_x.data(), final_gain_, final_bias_, pass.last_normed.data(), pass.last_mean.data(),
                       pass.last_rstd.data(), N, D, float(config_.layer_norm_eps), stream_);
    cublas_.set_stream(stream_);
    gemm(cublas_.get(), Op::none, Op::transpose, int(N), int(kVocabulary), int(D), pass.last_normed.data(), int(D),
         token_embedding_, int(D), pass.logits.data(), int(kVocabulary), 1.0f, 0.0f, /*c_is_float=*/true);
  });
}

// The step's one host wait: the logits and every MoE block's routing come back.
StepResult InferenceModelGpu::read_step(Pass& pass) {
  const int64_t K = config_.moe.top_k;
  StepResult result;
  result.next_logits.resize(pass.logits.size());
  CUDA_CHECK(cudaMemcpyAsync(result.next_logits.data(), pass.logits.data(), pass.logits.bytes(),
                             cudaMemcpyDeviceToHost, stream_));
  const size_t M = moe_blocks_.size(), slots = size_t(pass.tokens * K);
  std::vector<int32_t> routing(M * slots);
  if (M > 0) {
    CUDA_CHECK(cudaMemcpyAsync(routing.data(), pass.routing.data(), routing.size() * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t j = 0; j < M; ++j) {
    MoeBlockStep block;
    block.block = moe_blocks_[j];
    block.known_in_block = config_.pregated && j > 0 ? moe_blocks_[j - 1] : moe_blocks_[j];
    block.top_experts.assign(routing.begin() + std::ptrdiff_t(j * slots), routing.begin() + std::ptrdiff_t((j + 1) * slots));
    block.experts = distinct_sorted(block.top_experts);
    block.prefetched = distinct_sorted(pass.prefetched[j]);
    block.on_host = pass.on_host[j];
    block.host_ms = pass.host_ms[j];
    result.moe.push_back(std::move(block));
  }
  return result;
}

}  // namespace moe::cuda
