// moe/moe_layer.cu: one MoE layer on the GPU, forward and backward (see moe/moe_layer.h).
#include "moe/moe_layer.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "moe/activation.h"    // activation_forward / _backward
#include "moe/block_sparse.h"  // block_sparse_ffn_forward / _backward, dsd_transposed, dds
#include "core/elementwise.h"  // float_to_bf16
#include "core/cuda_check.h"   // CUDA_CHECK
#include "moe/router.h"        // router_logits, route_top_k, router_backward
#include "moe/permute.h"       // permute_tokens, unpermute_and_combine, combine_backward, permute_backward

namespace moe::cuda {

namespace {

// The rows every expert buffer holds: T*K + E*(B-1) dropless, E*C padded and dropping.
double layer_rows(const MoeConfig& config) {
  return config.formulation == Formulation::dropless
             ? double(config.tokens * config.top_k + config.num_experts * (config.block_size - 1))
             : double(config.num_experts) * double(capacity(config));
}

MoeConfig checked(const MoeConfig& config, int micro_batches) {
  validate(config);
  auto reject = [](const std::string& what) { throw std::invalid_argument("MoeLayerGpu: " + what); };
  if (micro_batches < 1) {
    reject("micro_batches (M) = " + std::to_string(micro_batches) + "; allowed: M >= 1");
  }
  if (micro_batches > 1 && config.formulation != Formulation::dropless) {
    reject("micro_batches (M) = " + std::to_string(micro_batches) + " with formulation = " +
           std::string(to_string(config.formulation)) +
           "; one weight-gradient product over all micro-batches needs the dropless formulation (for padded "
           "or dropping, run the layer per micro-batch and add its weight gradients)");
  }
  if (config.activation != Activation::gelu && config.activation != Activation::swiglu) {
    reject("activation = " + std::string(to_string(config.activation)) + "; allowed on the GPU: gelu, swiglu");
  }
  if (config.activation == Activation::swiglu && config.hidden_dim % 2 != 0) {
    reject("hidden_dim (H) = " + std::to_string(config.hidden_dim) +
           " with activation = swiglu; allowed: an even H (the SwiGLU pass moves bf16 pairs)");
  }
  if (config.jitter_eps != 0.0) {
    reject("jitter_eps = " + std::to_string(config.jitter_eps) +
           "; allowed on the GPU: 0 (apply jitter to x before the layer instead)");
  }
  if (config.num_experts > kRouterMaxExperts) {
    reject("num_experts (E) = " + std::to_string(config.num_experts) + "; allowed: E <= " +
           std::to_string(kRouterMaxExperts));
  }
  if (config.top_k > kRouterMaxTopK) {
    reject("top_k (K) = " + std::to_string(config.top_k) + "; allowed: K <= " + std::to_string(kRouterMaxTopK));
  }
  if (config.formulation == Formulation::dropless && config.block_size != 64 && config.block_size != 128) {
    reject("block_size (B) = " + std::to_string(config.block_size) + "; allowed for dropless: 64 or 128");
  }
  // The widest activation: D (x, expert out), H (hidden) or w1_columns (pre: 2H for SwiGLU's padded layout).
  const double rows = layer_rows(config);
  const int64_t widest = std::max(config.model_dim, w1_columns(config));
  if (rows * double(widest) > double((int64_t{1} << 31) - 1)) {
    reject("rows x max(D, w1_columns) = " + std::to_string(int64_t(rows)) + " x " + std::to_string(widest) +
           " is too large for the kernels' 32-bit indexing; allowed: below 2^31 (fewer tokens, a smaller "
           "capacity factor)");
  }
  if (config.formulation == Formulation::dropless) {
    // The weight gradients' walk spans every micro-batch's block rows: a grid's y of 65535 at most.
    const int64_t block_rows = micro_batches * (int64_t(rows) / config.block_size);
    if (block_rows > 65535) {
      reject("micro_batches (M) x max_block_rows = " + std::to_string(micro_batches) + " x " +
             std::to_string(int64_t(rows) / config.block_size) + " = " + std::to_string(block_rows) +
             "; allowed: at most 65535 (fewer micro-batches or fewer tokens per micro-batch)");
    }
  }
  // Fail before any allocation or launch when the layer's buffers cannot fit in the free memory.
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  check_layer_fits(config, free_bytes, micro_batches);
  return config;
}

// The GPU computes dropping as padded with the same capacity (C rows per expert, the rows past the
// kept tokens zero): the plan of the padded formulation.
MoeConfig plan_config(const MoeConfig& config) {
  MoeConfig c = config;
  if (c.formulation == Formulation::dropping) c.formulation = Formulation::padded;
  return c;
}

// Runs `work` as one named phase of the timeline when a timer is set.
template <typename Work>
void phase(PhaseTimer* timer, const char* name, cudaStream_t stream, Work&& work) {
  if (timer != nullptr) timer->begin(name, stream);
  work();
  if (timer != nullptr) timer->end(stream);
}

}  // namespace

double layer_memory_bytes(const MoeConfig& config, int micro_batches) {
  const double rows = layer_rows(config);
  const bool swiglu = config.activation == Activation::swiglu;
  // permuted x, pre-activation, hidden, expert out and their gradients (+ d_hidden when padded);
  // SwiGLU adds the up projection and its gradient (H more of each: pre is 2H wide).
  const double hidden_widths = swiglu ? 6.0 : 4.0;
  const double activation_bytes =
      rows * (4.0 * config.model_dim + hidden_widths * config.hidden_dim) * sizeof(bf16);
  // Each micro-batch past the first keeps its weight-gradient operands: permuted x and d_out (D each),
  // hidden and d_pre (H each; SwiGLU d_up too); and the walk's indices, two ints a block.
  const double kept_widths = 2.0 * config.model_dim + (swiglu ? 3.0 : 2.0) * config.hidden_dim;
  const double accumulation_bytes =
      (micro_batches - 1.0) * rows * kept_widths * sizeof(bf16) +
      (config.formulation == Formulation::dropless
           ? micro_batches * rows / config.block_size * (config.hidden_dim / config.block_size) * 2.0 * sizeof(int)
           : 0.0);
  const double router_bytes = double(config.tokens) * (config.num_experts * 14.0 + config.top_k * 16.0) +
                              kRouterMaxBlocks * (config.num_experts * 12.0 + 8.0);  // RouterWorkspace
  const double plan_bytes = (rows + 4.0 * config.tokens * config.top_k) * sizeof(int);
  return 1.1 * (activation_bytes + accumulation_bytes + router_bytes + plan_bytes);
}

double compacted_weight_gradient_bytes(const MoeConfig& config, int micro_batches) {
  const double rows = double(micro_batches) * config.tokens * config.top_k +
                      double(config.num_experts) * (config.block_size - 1);
  const double widths = 2.0 * config.model_dim + (config.activation == Activation::swiglu ? 3.0 : 2.0) * config.hidden_dim;
  return rows * widths * sizeof(bf16);
}

void check_layer_fits(const MoeConfig& config, size_t free_bytes, int micro_batches) {
  const double needed = layer_memory_bytes(config, micro_batches);
  if (needed <= double(free_bytes)) return;
  char message[400];
  std::snprintf(message, sizeof message,
                "MoeLayerGpu: the layer needs about %.2f GiB of GPU memory (T=%lld, D=%lld, H=%lld, E=%lld, "
                "K=%lld, micro-batches M=%d) and %.2f GiB are free; allowed: a problem that fits (fewer tokens, "
                "a smaller capacity factor, fewer micro-batches kept for one weight-gradient product)",
                needed / (1 << 30), (long long)config.tokens, (long long)config.model_dim,
                (long long)config.hidden_dim, (long long)config.num_experts, (long long)config.top_k,
                micro_batches, double(free_bytes) / (1 << 30));
  throw std::invalid_argument(message);
}

MoeConfig micro_batch_config(const MoeConfig& batch, int micro_batches) {
  if (micro_batches < 1 || batch.tokens % micro_batches != 0) {
    throw std::invalid_argument("micro_batch_config: micro_batches (M) = " + std::to_string(micro_batches) +
                                " for a batch of T = " + std::to_string(batch.tokens) +
                                " tokens; allowed: M >= 1 dividing T");
  }
  MoeConfig config = batch;
  config.tokens = batch.tokens / micro_batches;
  return config;
}

MoeLayerGpu::MoeLayerGpu(const MoeConfig& config, int micro_batches)
    : config_(checked(config, micro_batches)),
      micro_batches_(micro_batches),
      backward_done_(static_cast<size_t>(micro_batches), false),
      dropless_(config.formulation == Formulation::dropless),
      capacity_(dropless_ ? 0 : static_cast<int>(capacity(config))),
      gathers_rows_(dropless_ && gathering_pays(config_)),
      plan_(plan_config(config)),
      router_workspace_(config.num_experts) {
  const size_t T = config_.tokens, D = config_.model_dim, H = config_.hidden_dim, E = config_.num_experts,
               K = config_.top_k, rows = static_cast<size_t>(plan_.max_rows());
  // pre_activation_ is [rows, w1_columns] padded (SwiGLU: [gate | up] per row) and the gate's
  // [max_nnz, B, B] blocks dropless, where the up blocks have a buffer of their own.
  const size_t W1 = static_cast<size_t>(w1_columns(config_));
  const bool swiglu = config_.activation == Activation::swiglu;
  const size_t pre_width = dropless_ ? H : W1;
  if (dropless_) {
    topology_ = std::make_unique<TopologyBuffers>(config_);
    micro_batch_topology_ = std::make_unique<MicroBatchTopology>(config_, micro_batches_);
    slot_rows_ = micro_batch_topology_->slot_rows();
  }
  // The weight gradients' operands: M slots, slot_rows_ apart, the last as long as one micro-batch's.
  const size_t kept_rows = static_cast<size_t>(micro_batches_ - 1) * static_cast<size_t>(slot_rows_) + rows;
  router_ = RouterBuffers(T, E, K);
  permuted_x_ = DeviceBuffer<bf16>(kept_rows * D);
  pre_activation_ = DeviceBuffer<bf16>(rows * pre_width);
  hidden_ = DeviceBuffer<bf16>(kept_rows * H);
  expert_out_ = DeviceBuffer<bf16>(rows * D);
  d_expert_out_ = DeviceBuffer<bf16>(kept_rows * D);
  d_pre_activation_ = DeviceBuffer<bf16>(kept_rows * pre_width);  // M = 1 unless dropless (pre_width = H)
  if (dropless_ && swiglu) {
    up_projection_ = DeviceBuffer<bf16>(rows * H);
    d_up_projection_ = DeviceBuffer<bf16>(kept_rows * H);
  }
  d_permuted_x_ = DeviceBuffer<bf16>(rows * D);
  d_combine_weights_ = DeviceBuffer<float>(T * K);
  d_logits_ = DeviceBuffer<float>(T * E);
  d_logits_bf16_ = DeviceBuffer<bf16>(T * E);
  if (!dropless_) {
    // [E, C, *] tensors: expert e's rows start at e * C. The pointer tables are made once here.
    d_hidden_ = DeviceBuffer<bf16>(rows * H);
    const size_t C = static_cast<size_t>(capacity_);
    auto table_in = [&](DeviceBuffer<const bf16*>& table, const DeviceBuffer<bf16>& base, size_t width) {
      table = DeviceBuffer<const bf16*>(E);
      fill_strided_pointers<const bf16>(base.data(), C * width, static_cast<int>(E), table.data(), nullptr);
    };
    auto table_out = [&](DeviceBuffer<bf16*>& table, DeviceBuffer<bf16>& base, size_t width) {
      table = DeviceBuffer<bf16*>(E);
      fill_strided_pointers(base.data(), C * width, static_cast<int>(E), table.data(), nullptr);
    };
    table_in(x_rows_, permuted_x_, D);
    table_in(pre_rows_, pre_activation_, W1);
    table_in(hidden_rows_, hidden_, H);
    table_in(d_out_rows_, d_expert_out_, D);
    table_in(d_pre_rows_, d_pre_activation_, W1);
    table_out(pre_rows_out_, pre_activation_, W1);
    table_out(out_rows_out_, expert_out_, D);
    table_out(d_hidden_rows_out_, d_hidden_, H);
    table_out(d_x_rows_out_, d_permuted_x_, D);
    CUDA_CHECK(cudaDeviceSynchronize());  // the tables exist before any stream uses them
  }
}

// ---- forward ----

void MoeLayerGpu::forward(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t stream,
                          const bf16* router_input) {
  if (x == nullptr || y == nullptr || weights.gate_weights == nullptr || weights.w1 == nullptr ||
      weights.w2 == nullptr) {
    throw std::invalid_argument("MoeLayerGpu::forward: x, y and every weight pointer must be non-null");
  }
  // The gate is the only reader of router_input: everything after the router sees x alone.
  route(router_input != nullptr ? router_input : x, weights.gate_weights, stream);
  compute_experts(x, weights, y, stream);
}

void MoeLayerGpu::forward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights, bf16* y,
                                      cudaStream_t stream, const bf16* router_input) {
  require_micro_batch("MoeLayerGpu::forward_micro_batch", micro_batch);
  if (x == nullptr || y == nullptr || weights.gate_weights == nullptr || weights.w1 == nullptr ||
      weights.w2 == nullptr) {
    throw std::invalid_argument("MoeLayerGpu::forward_micro_batch: x, y and every weight pointer must be non-null");
  }
  route(router_input != nullptr ? router_input : x, weights.gate_weights, stream);  // slot 0
  slot_ = micro_batch;  // compute_experts writes this micro-batch's slot of the kept operands
  compute_experts(x, weights, y, stream);
}

void MoeLayerGpu::require_micro_batch(const char* function, int micro_batch) const {
  if (!dropless_) {
    throw std::invalid_argument(std::string(function) + ": formulation = " +
                                std::string(to_string(config_.formulation)) +
                                "; the one weight-gradient product over micro-batches needs dropless (run forward "
                                "and backward per micro-batch and add the weight gradients)");
  }
  if (micro_batch < 0 || micro_batch >= micro_batches_) {
    throw std::invalid_argument(std::string(function) + ": micro_batch = " + std::to_string(micro_batch) +
                                "; allowed: 0 .. " + std::to_string(micro_batches_ - 1) +
                                " (the layer was made for M = " + std::to_string(micro_batches_) + ")");
  }
}

void MoeLayerGpu::route(const bf16* router_input, const bf16* gate_weights, cudaStream_t stream) {
  if (router_input == nullptr || gate_weights == nullptr) {
    throw std::invalid_argument("MoeLayerGpu::route: router_input and gate_weights must be non-null");
  }
  slot_ = 0;  // a new routing: compute_experts writes slot 0 unless forward_micro_batch says otherwise
  const int T = config_.tokens, D = config_.model_dim, E = config_.num_experts, K = config_.top_k;
  phase(timer_, "router", stream, [&] {
    router_logits(cublas_.get(), router_input, gate_weights, router_.logits.data(), T, D, E, stream);
    route_top_k(router_, router_workspace_, T, E, K, config_.renormalize, stream);
  });
  phase(timer_, "plan", stream, [&] {
    build_dispatch_plan(router_.top_experts.data(), plan_, stream);
    if (dropless_) build_topology(plan_.plan(), *topology_, stream);
  });
}

void MoeLayerGpu::compute_experts(const bf16* x, const MoeLayerWeights& weights, bf16* y, cudaStream_t stream) {
  if (y == nullptr) throw std::invalid_argument("MoeLayerGpu::compute_experts: y must be non-null");
  run_experts(x, weights, stream);
  combine(y, stream);
}

void MoeLayerGpu::run_experts(const bf16* x, const MoeLayerWeights& weights, cudaStream_t stream) {
  if (x == nullptr || weights.w1 == nullptr || weights.w2 == nullptr) {
    throw std::invalid_argument("MoeLayerGpu::compute_experts: x, y and the expert tables w1, w2 must be non-null");
  }
  const int D = config_.model_dim;
  if (!gathers_rows_) {
    phase(timer_, "dispatch", stream, [&] { permute_tokens(plan_.plan(), x, permuted_x_slot(), D, stream); });
  }
  phase(timer_, "expert_compute", stream, [&] { experts_forward(x, weights, stream); });
}

void MoeLayerGpu::combine(bf16* y, cudaStream_t stream, const ReplacedRows* replaced) {
  if (y == nullptr) throw std::invalid_argument("MoeLayerGpu::combine: y must be non-null");
  const int D = config_.model_dim;
  phase(timer_, "combine", stream, [&] {
    if (replaced != nullptr) replace_slot_rows(plan_.plan(), replaced->rows, replaced->replace, expert_out_.data(), D, stream);
    unpermute_and_combine(plan_.plan(), router_.combine_weights.data(), expert_out_.data(), y, D, stream);
  });
}

void MoeLayerGpu::experts_forward(const bf16* x, const MoeLayerWeights& weights, cudaStream_t stream) {
  if (dropless_) {
    // SwiGLU: the gate blocks in pre_activation_, the up blocks in up_projection_, hidden = silu(gate) * up
    // in the second SDD's epilogue (block_sparse.h).
    const BlockSparseFfnOutputs outputs{pre_activation_.data(), up_projection_.data(), hidden_slot(),
                                        expert_out_.data()};
    const ExpertRows rows = gathers_rows_ ? ExpertRows::gathered(x, plan_.plan()) : ExpertRows(permuted_x_slot());
    block_sparse_ffn_forward(config_, topology_->topology(), rows, weights.w1, weights.w2, outputs, stream);
    return;
  }
  // Padded / dropping: E products [C, D] x [D, W1], the activation, E products [C, H] x [H, D],
  // W1 = w1_columns: H for GeLU, 2H for SwiGLU (one product computes gate and up: pre = [gate | up]).
  const int C = capacity_, D = config_.model_dim, H = config_.hidden_dim, E = config_.num_experts;
  const int W1 = static_cast<int>(w1_columns(config_));
  cublas_.set_stream(stream);
  gemm_batched(cublas_.get(), Op::none, Op::none, C, W1, D, x_rows_.data(), D, weights.w1, W1,
               pre_rows_out_.data(), W1, E);
  activation_forward(config_.activation, pre_activation_.data(), hidden_.data(), int64_t{E} * C, H, stream);
  gemm_batched(cublas_.get(), Op::none, Op::none, C, D, H, hidden_rows_.data(), H, weights.w2, D,
               out_rows_out_.data(), D, E);
}

// ---- backward ----

void MoeLayerGpu::backward(const bf16* x, const MoeLayerWeights& weights, const bf16* dy,
                           const MoeLayerGradients& gradients, cudaStream_t stream, const bf16* router_input,
                           float* d_router_input) {
  if (x == nullptr || dy == nullptr || gradients.dx == nullptr || gradients.d_gate_weights == nullptr ||
      gradients.d_w1 == nullptr || gradients.d_w2 == nullptr) {
    throw std::invalid_argument("MoeLayerGpu::backward: x, dy and every gradient pointer must be non-null");
  }
  if (slot_ != 0) {
    throw std::invalid_argument("MoeLayerGpu::backward: the last forward was forward_micro_batch(" +
                                std::to_string(slot_) + "); call backward_micro_batch for it");
  }
  backward_pass(x, weights, dy, gradients.dx, gradients.d_gate_weights, gradients.d_w1, gradients.d_w2, stream,
                router_input, d_router_input);
}

void MoeLayerGpu::backward_micro_batch(int micro_batch, const bf16* x, const MoeLayerWeights& weights,
                                       const bf16* dy, float* dx, float* d_gate_weights, cudaStream_t stream,
                                       const bf16* router_input, float* d_router_input) {
  constexpr const char* function = "MoeLayerGpu::backward_micro_batch";
  require_micro_batch(function, micro_batch);
  if (x == nullptr || dy == nullptr || dx == nullptr || d_gate_weights == nullptr) {
    throw std::invalid_argument(std::string(function) + ": x, dy, dx and d_gate_weights must be non-null");
  }
  if (micro_batch != slot_) {
    throw std::invalid_argument(std::string(function) + ": micro_batch = " + std::to_string(micro_batch) +
                                " but the last forward was micro-batch " + std::to_string(slot_) +
                                "; call forward_micro_batch(" + std::to_string(micro_batch) + ", ...) first");
  }
  backward_pass(x, weights, dy, dx, d_gate_weights, nullptr, nullptr, stream, router_input, d_router_input);
  // Keep this micro-batch's routing for the walk over all of them; its operands stay in its slot.
  micro_batch_topology_->record(micro_batch, plan_.plan(), *topology_, stream);
  backward_done_[static_cast<size_t>(micro_batch)] = true;
}

void MoeLayerGpu::set_compacted_weight_gradients(bool on) {
  constexpr const char* function = "MoeLayerGpu::set_compacted_weight_gradients";
  if (!on) {
    for (auto* buffer : {&compacted_x_, &compacted_d_out_, &compacted_hidden_, &compacted_d_pre_, &compacted_d_up_}) {
      *buffer = DeviceBuffer<bf16>();
    }
    return;
  }
  if (micro_batches_ < 2 || !dropless_) {
    throw std::invalid_argument(std::string(function) + ": micro_batches = " + std::to_string(micro_batches_) +
                                ", formulation " + std::string(to_string(config_.formulation)) +
                                "; allowed: M >= 2 micro-batches of the dropless formulation (only they keep "
                                "padding between micro-batches)");
  }
  if (compacted_weight_gradients()) return;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double needed = compacted_weight_gradient_bytes(config_, micro_batches_);
  if (needed > double(free_bytes)) {
    throw std::invalid_argument(std::string(function) + ": the compacted operands need " +
                                std::to_string(needed / double(1 << 30)) + " GiB and " +
                                std::to_string(double(free_bytes) / double(1 << 30)) +
                                " GiB are free; allowed: a layer whose copies fit, or compaction off");
  }
  const size_t rows = static_cast<size_t>(micro_batch_topology_->compacted_rows());
  const size_t D = static_cast<size_t>(config_.model_dim), H = static_cast<size_t>(config_.hidden_dim);
  compacted_x_ = DeviceBuffer<bf16>(rows * D);
  compacted_d_out_ = DeviceBuffer<bf16>(rows * D);
  compacted_hidden_ = DeviceBuffer<bf16>(rows * H);
  compacted_d_pre_ = DeviceBuffer<bf16>(rows * H);
  if (config_.activation == Activation::swiglu) compacted_d_up_ = DeviceBuffer<bf16>(rows * H);
}

void MoeLayerGpu::expert_weight_gradients(float* const* d_w1, float* const* d_w2, cudaStream_t stream) {
  constexpr const char* function = "MoeLayerGpu::expert_weight_gradients";
  require_micro_batch(function, 0);
  if (d_w1 == nullptr || d_w2 == nullptr) {
    throw std::invalid_argument(std::string(function) + ": d_w1 and d_w2 must be non-null");
  }
  for (int m = 0; m < micro_batches_; ++m) {
    if (!backward_done_[static_cast<size_t>(m)]) {
      throw std::invalid_argument(std::string(function) + ": micro-batch " + std::to_string(m) + " of " +
                                  std::to_string(micro_batches_) +
                                  " has had no backward_micro_batch since the last call; run every micro-batch's "
                                  "forward and backward first");
    }
  }
  const int D = config_.model_dim, H = config_.hidden_dim;
  const int W1 = static_cast<int>(w1_columns(config_));
  const bool swiglu = config_.activation == Activation::swiglu;
  // dW2_e = sum_m hidden_{m,e}ᵀ d_out_{m,e};  dW1_e = sum_m x_{m,e}ᵀ d_pre_{m,e} (SwiGLU: the gate
  // columns from d_pre, the up columns from d_up): one product each over every slot's rows, or over
  // the compacted copies of them.
  MicroBatchTopology& rows = *micro_batch_topology_;
  const bf16 *x = permuted_x_.data(), *d_out = d_expert_out_.data(), *hidden = hidden_.data();
  const bf16 *d_pre = d_pre_activation_.data(), *d_up = d_up_projection_.data();
  DeviceTopology walk{};
  if (compacted_weight_gradients()) {
    phase(timer_, "compact_rows", stream, [&] {
      rows.build_compacted(stream);
      gather_compacted(rows, x, compacted_x_.data(), D, /*blocked=*/false, stream);
      gather_compacted(rows, d_out, compacted_d_out_.data(), D, false, stream);
      gather_compacted(rows, hidden, compacted_hidden_.data(), H, /*blocked=*/true, stream);
      gather_compacted(rows, d_pre, compacted_d_pre_.data(), H, true, stream);
      if (swiglu) gather_compacted(rows, d_up, compacted_d_up_.data(), H, true, stream);
    });
    walk = rows.compacted_topology();
    x = compacted_x_.data(), d_out = compacted_d_out_.data(), hidden = compacted_hidden_.data();
    d_pre = compacted_d_pre_.data(), d_up = compacted_d_up_.data();
  }
  phase(timer_, "expert_weight_gradients", stream, [&] {
    if (!compacted_weight_gradients()) {
      rows.build(stream);
      walk = rows.topology();
    }
    dsd_transposed(walk, hidden, d_out, D, d_w2, D, stream);
    dds(walk, x, D, d_pre, d_w1, W1, 0, stream);
    if (swiglu) dds(walk, x, D, d_up, d_w1, W1, H, stream);
  });
  std::fill(backward_done_.begin(), backward_done_.end(), false);
}

void MoeLayerGpu::backward_pass(const bf16* x, const MoeLayerWeights& weights, const bf16* dy, float* dx,
                                float* d_gate_weights, float* const* d_w1, float* const* d_w2, cudaStream_t stream,
                                const bf16* router_input, float* d_router_input) {
  if (router_input != nullptr && d_router_input == nullptr) {
    throw std::invalid_argument(
        "MoeLayerGpu::backward: router_input is given but d_router_input is nullptr; the gradient through the "
        "gate belongs to router_input, not to dx: pass a [T, D] buffer for it");
  }
  if (d_router_input != nullptr && d_router_input == dx) {
    throw std::invalid_argument(
        "MoeLayerGpu::backward: d_router_input is gradients.dx; pass nullptr to get the sum in dx");
  }
  const int T = config_.tokens, D = config_.model_dim, E = config_.num_experts, K = config_.top_k;
  // The one place the two inputs differ: the gate's products read gate_input and write d_gate_input.
  // When the gate read x and no separate output is asked for, its gradient is added onto dx, which
  // the un-gather has just written (beta = 1); a separate d_router_input is overwritten (beta = 0).
  const bf16* const gate_input = router_input != nullptr ? router_input : x;
  float* const d_gate_input = d_router_input != nullptr ? d_router_input : dx;
  const float d_gate_input_beta = d_router_input != nullptr ? 0.0f : 1.0f;
  // The weight gradient dW1 reads x's rows in expert order: a forward that gathered them wrote no copy.
  if (gathers_rows_) {
    phase(timer_, "dispatch", stream, [&] { permute_tokens(plan_.plan(), x, permuted_x_slot(), D, stream); });
  }
  // combine: d expert_out rows = w * dy, and d combine_weights (the router's input gradient)
  phase(timer_, "combine_backward", stream, [&] {
    combine_backward(plan_.plan(), router_.combine_weights.data(), dy, expert_out_.data(), d_expert_out_slot(),
                     d_combine_weights_.data(), D, stream);
  });
  phase(timer_, "expert_compute_backward", stream, [&] { experts_backward(weights, d_w1, d_w2, stream); });
  // un-gather: dx[t] = sum of its K rows' gradients
  phase(timer_, "dispatch_backward", stream, [&] {
    permute_backward(plan_.plan(), d_permuted_x_.data(), dx, D, /*accumulate=*/false, stream);
  });
  // router: d_logits, then the gate's two products. d_logits is rounded to bf16 for the tensor-core
  // GEMMs (fp32 accumulation), the same precision as every other activation gradient here.
  phase(timer_, "router_backward", stream, [&] {
    router_backward(router_.probs.data(), router_.logsumexp.data(), router_.top_experts.data(),
                    d_combine_weights_.data(), router_.expert_fraction.data(), d_logits_.data(), T, E, K,
                    config_.renormalize, config_.aux_loss_coef, config_.z_loss_coef, stream);
    const size_t n = static_cast<size_t>(T) * E;
    float_to_bf16(d_logits_.data(), d_logits_bf16_.data(), n, stream);
    cublas_.set_stream(stream);
    // d_gate_weights [D, E] = gate_inputᵀ [D, T] d_logits [T, E];
    // d_gate_input [T, D] (+)= d_logits [T, E] Wgᵀ [E, D]
    gemm(cublas_.get(), Op::transpose, Op::none, D, E, T, gate_input, D, d_logits_bf16_.data(), E,
         d_gate_weights, E, 1.0f, 0.0f, /*c_is_float=*/true);
    gemm(cublas_.get(), Op::none, Op::transpose, T, D, E, d_logits_bf16_.data(), E, weights.gate_weights, E,
         d_gate_input, D, 1.0f, d_gate_input_beta, /*c_is_float=*/true);
  });
}

void MoeLayerGpu::experts_backward(const MoeLayerWeights& weights, float* const* d_w1, float* const* d_w2,
                                   cudaStream_t stream) {
  if (dropless_) {
    // Without d_w1 / d_w2 (a micro-batch of an accumulated step) the weight gradients are skipped:
    // expert_weight_gradients computes them over every micro-batch's slot at the end.
    const BlockSparseFfnOutputs forward{pre_activation_.data(), up_projection_.data(), hidden_slot(),
                                        expert_out_.data()};
    const BlockSparseFfnGradients out{d_pre_activation_slot(), d_up_projection_slot(), d_permuted_x_.data(), d_w1,
                                      d_w2};
    block_sparse_ffn_backward(config_, topology_->topology(), permuted_x_slot(), weights.w1, weights.w2, forward,
                              d_expert_out_slot(), out, stream);
    return;
  }
  if (d_w1 == nullptr || d_w2 == nullptr) {
    throw std::logic_error("MoeLayerGpu: the padded / dropping backward always writes the weight gradients");
  }
  // Padded / dropping, per expert e over its C rows (padding rows carry zero gradient):
  //   dh = d_out W2ᵀ,  d_pre = act'(dh, pre),  dW2 = hiddenᵀ d_out,  dW1 = xᵀ d_pre,  dx = d_pre W1ᵀ
  // with d_pre [C, W1]: GeLU dh * gelu'(pre); SwiGLU [d_gate | d_up], so dW1 [D, 2H] and dx come from
  // one product each over both halves.
  const int C = capacity_, D = config_.model_dim, H = config_.hidden_dim, E = config_.num_experts;
  const int W1 = static_cast<int>(w1_columns(config_));
  cublas_.set_stream(stream);
  gemm_batched(cublas_.get(), Op::none, Op::transpose, C, H, D, d_out_rows_.data(), D, weights.w2, D,
               d_hidden_rows_out_.data(), H, E);
  activation_backward(config_.activation, pre_activation_.data(), d_hidden_.data(), d_pre_activation_.data(),
                      int64_t{E} * C, H, stream);
  gemm_batched(cublas_.get(), Op::transpose, Op::none, H, D, C, hidden_rows_.data(), H, d_out_rows_.data(), D,
               d_w2, D, E);
  gemm_batched(cublas_.get(), Op::transpose, Op::none, D, W1, C, x_rows_.data(), D, d_pre_rows_.data(), W1,
               d_w1, W1, E);
  gemm_batched(cublas_.get(), Op::none, Op::transpose, C, D, W1, d_pre_rows_.data(), W1, weights.w1, W1,
               d_x_rows_out_.data(), D, E);
}

}  // namespace moe::cuda
