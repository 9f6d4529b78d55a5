// expert_parallel_gpu.cpp: FastMoE's expert-parallel layer on the GPU with Tutel's pipelining,
// adaptive pipelining degree and 2DH exchange (see expert_parallel_gpu.h). Host code: every kernel
// is a launcher of cuda/moe/ or of expert_parallel_kernels.h.
//
// Sections: ---- settings ----  ---- buffers ----  ---- construction ----  ---- Tutel's layouts ----
//           ---- forward ----  ---- adaptive pipelining ----  ---- the pipeline ----
//           ---- the local experts ----  ---- backward ----
#include "ep/expert_parallel_gpu.h"

#include <nvtx3/nvToolsExt.h>  // nvtxRangePushA, nvtxRangePop: the phases on Nsight's timeline

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"          // CUDA_CHECK
#include "core/elementwise.h"         // float_to_bf16
#include "ep/placement.h"  // experts_per_rank, config_fingerprint: the rules every layer shares
#include "ep/expert_parallel_kernels.h"  // pack_routing_summary, build_send_order, build_expert_rows, ...
#include "moe/activation.h"           // gelu_forward, gelu_backward (padded experts)
#include "moe/block_sparse.h"         // block_sparse_ffn_forward / backward, expert_pointer_table
#include "moe/permute.h"              // permute_tokens, unpermute_and_combine, combine_backward, permute_backward
#include "comm/rank_agreement.h"           // check_on_every_rank, check_same_on_every_rank

namespace moe::dist {

using cuda::DeviceBuffer;
using cuda::DevicePlan;

// ---- settings ----

namespace {

// What a rank reports in word 0 of its routing summary when its own forward inputs are wrong.
constexpr int32_t kBadTokenCount = -1;
constexpr int32_t kNullPointer = -2;

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// One phase of the layer on the timeline: an NVTX range, and with a PhaseTimer a pair of events on
// the phase's stream (the exchanges run on the exchange stream, the rest on the caller's), so that
// a run record shows where a step's time goes (cuda/core/phase_timer.h).
class Phase {
 public:
  Phase(cuda::PhaseTimer* timer, const char* name, cudaStream_t stream) : timer_(timer), stream_(stream) {
    if (timer_ != nullptr) {
      timer_->begin(name, stream_);  // opens the NVTX range too
    } else {
      nvtxRangePushA(name);
    }
  }
  ~Phase() {
    if (timer_ != nullptr) {
      timer_->end(stream_);
    } else {
      nvtxRangePop();
    }
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  cuda::PhaseTimer* timer_;
  cudaStream_t stream_;
};

// The supported set (see the header), checked on the host before any GPU work.
void check_supported(const MoeConfig& config, const ExpertParallelGpuOptions& options, int64_t max_local_tokens,
                     int ranks) {
  validate(config);
  auto reject = [](const std::string& what) { throw std::invalid_argument(what); };
  if (const ExpertPlacement* placement = options.placement) {
    if (placement->experts() != config.num_experts || placement->ranks() != ranks) {
      reject("the placement is of E = " + std::to_string(placement->experts()) + " experts over R = " +
             std::to_string(placement->ranks()) + " ranks; the layer has E = " + std::to_string(config.num_experts) +
             " over R = " + std::to_string(ranks));
    }
    if (placement->replicated() && config.formulation == Formulation::padded) {
      reject("the padded formulation computes each expert as C rows on one rank; a placement with replicas takes "
             "dropless or dropping");
    }
  } else {
    experts_per_rank(config, ranks);  // E % R == 0, with the CPU layer's message
  }
  if (options.shadow_per_step) {
    if (options.experts != ExpertCompute::ffn) reject("shadow_per_step shadows the FFN experts; the identity experts have no weights");
    if (config.formulation == Formulation::padded) {
      reject("shadow_per_step with the padded formulation: it computes each expert as C rows on one rank; allowed: "
             "dropless or dropping");
    }
    if (options.placement != nullptr && options.placement->replicated()) {
      reject("shadow_per_step with a placement that has replicas (" + options.placement->describe() +
             "); allowed: a placement with each expert on one rank");
    }
  }
  if (config.activation != Activation::gelu) {
    reject("activation = " + std::string(to_string(config.activation)) + "; allowed on the GPU: gelu");
  }
  if (config.jitter_eps != 0.0) {
    reject("jitter_eps = " + std::to_string(config.jitter_eps) + "; allowed on the GPU: 0 (apply jitter to x first)");
  }
  if (config.num_experts > cuda::kRouterMaxExperts) {
    reject("num_experts (E) = " + std::to_string(config.num_experts) + "; allowed: E <= " +
           std::to_string(cuda::kRouterMaxExperts));
  }
  if (config.top_k > cuda::kRouterMaxTopK) {
    reject("top_k (K) = " + std::to_string(config.top_k) + "; allowed: K <= " + std::to_string(cuda::kRouterMaxTopK));
  }
  if (config.formulation == Formulation::dropless) {
    if (config.block_size != 64 && config.block_size != 128) {
      reject("block_size (B) = " + std::to_string(config.block_size) + "; allowed for dropless: 64 or 128");
    }
    if (config.model_dim % config.block_size != 0) {
      reject("model_dim (D) = " + std::to_string(config.model_dim) + "; allowed for dropless: a multiple of B = " +
             std::to_string(config.block_size) + " (the block-sparse products tile D by B)");
    }
  }
  if (options.pipeline_chunks != kAdaptivePipelineChunks &&
      (options.pipeline_chunks < 1 || options.pipeline_chunks > kMaxPipelineChunks)) {
    reject("pipeline_chunks (d) = " + std::to_string(options.pipeline_chunks) + "; allowed: 1 <= d <= " +
           std::to_string(kMaxPipelineChunks) + ", or kAdaptivePipelineChunks (0): chosen by measurement");
  }
  const int G = options.hierarchical_ranks_per_node;
  if (G < 0 || (G > 1 && ranks % G != 0)) {
    reject("hierarchical_ranks_per_node (G) = " + std::to_string(G) + " with R = " + std::to_string(ranks) +
           " ranks; allowed: 0 or 1 (the flat exchange), or G > 1 dividing R (nodes of G consecutive ranks)");
  }
  if (options.experts != ExpertCompute::ffn && options.experts != ExpertCompute::identity) {
    reject("options.experts is neither ffn nor identity");
  }
  constexpr int64_t int32_limit = std::numeric_limits<int32_t>::max();
  if (max_local_tokens < 0 || max_local_tokens * config.top_k > int32_limit ||
      max_local_tokens * config.num_experts > int32_limit || config.tokens * config.top_k > int32_limit) {
    reject("max_local_tokens = " + std::to_string(max_local_tokens) + " (T = " + std::to_string(config.tokens) +
           "); allowed: 0 <= T_r, and T * K, T_r * E below 2^31 (the plans' int32 indices)");
  }
}

uint64_t options_fingerprint(const ExpertParallelGpuOptions& options) {
  return static_cast<uint64_t>(options.pipeline_chunks) * 1000003u +
         (options.all_reduce_router_gradient ? 101u : 0u) + static_cast<uint64_t>(options.experts) * 7u +
         static_cast<uint64_t>(options.hierarchical_ranks_per_node) * 1009u * 1000003u +
         (options.placement ? options.placement->fingerprint() : 0u) + (options.shadow_per_step ? 7919u : 0u);
}

// ---- buffers ----

// Grows `buffer` to at least `count` elements (and at least 1, so that a pointer is never null),
// with a quarter of headroom: the routing, and so the row counts, move a little from step to step.
// (No headroom for counts derived from a bound that already has it.)
template <typename T>
void ensure(DeviceBuffer<T>& buffer, int64_t count, bool headroom = true) {
  const size_t needed = static_cast<size_t>(std::max<int64_t>(count, 1));
  if (buffer.size() < needed) buffer = DeviceBuffer<T>(headroom ? needed + needed / 4 : needed);
}

std::vector<int64_t> times(std::span<const int64_t> rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

}  // namespace

// One chunk's rows on the experts' side, kept from the forward for the backward.
struct ExpertParallelGpu::Chunk {
  DeviceBuffer<bf16> received;    // [N_c, D] the rows as they arrive ([source][local expert][token])
  DeviceBuffer<bf16> sent_back;   // [N_c, D] the experts' results in the same order, sent home
  DeviceBuffer<int> row_slot;     // [M_c] the received row feeding each expert row, -1 for padding
  // The weight gradients' four operands, in this chunk's slot of the layer's Slots (slot < 0: the
  // chunk received no row this forward, and computes nothing):
  int slot = -1;
  bf16* permuted_x = nullptr;        // [M_c, D] the experts' input rows (padding zero)
  bf16* expert_out = nullptr;        // [M_c, D] their outputs; in the backward, d(outputs)
  bf16* hidden = nullptr;            // [M_c, H]
  bf16* d_pre_activation = nullptr;  // [M_c, H]
  DeviceBuffer<bf16> d_permuted_x;                      // [M_c, D]
  DeviceBuffer<bf16> pre_activation, d_hidden;          // [M_c, H]; d_hidden padded only
  std::unique_ptr<cuda::TopologyBuffers> topology;      // dropless: the E_c computed experts' BCSR
  int64_t topology_rows = 0;                            // the received rows it was sized for
  int64_t topology_experts = 0, topology_hidden = 0;    // and the E_c, H_c (they change with the layout)
  // padded / dropping: per-expert pointers into the [E_r, C_c, *] tensors above
  DeviceBuffer<bf16*> x_rows, pre_rows, hidden_rows, out_rows, d_hidden_rows, d_pre_rows, d_x_rows;
};

// r = 0 and r > 1: the experts this rank computes, gathered for one step, and their gradients.
// One expert is one block of P_c = 2 D H_c elements (expert_parallel_kernels.h: W1's columns of the
// slice, then W2's rows of it); computed expert m's block is at m P_c.
struct ExpertParallelGpu::LayoutBuffers {
  DeviceBuffer<bf16> packed;                   // [slices, E_r, P_c] this rank's stored experts, sliced
  DeviceBuffer<bf16> weights;                  // [E_c, P_c] the gathered experts
  DeviceBuffer<const bf16*> w1, w2;            // [E_c] pointer tables into weights
  DeviceBuffer<float> gradients;               // [E_c, P_c] their gradients, this rank's rows
  DeviceBuffer<float*> d_w1, d_w2;             // [E_c] pointer tables into gradients
  DeviceBuffer<float> returned_gradients;      // r > 1: [r, E_r, P_c] the slices of the stored experts
};

// shadow_per_step: the step's shadowed experts S, and where their copies are. Copy k of the copies
// this rank holds is the k-th of S counted rank after rank of their storing ranks (ascending expert
// inside a rank), one block of P = 2 D H elements (pack_expert_slices, slices = 1).
struct ExpertParallelGpu::Shadows {
  std::vector<int64_t> experts;              // S, ascending; empty: no expert shadowed this step
  std::vector<int> sent;                     // this rank's stored slots of S, ascending
  std::vector<int64_t> received_from;        // [R] copies held of each rank's experts (0 for this rank)
  int64_t received = 0;                      // copies held
  DeviceBuffer<int> sources, sent_sources;   // [E_c] a step slot's stored slot, or -1 - copy; [sent] stored slots
  DeviceBuffer<const bf16*> w1, w2, sent_w1, sent_w2;  // [E_c] the step's weight tables; [sent] the stored ones of S
  DeviceBuffer<float*> d_w1, d_w2, sent_d_w1, sent_d_w2;  // the same for the gradients
  DeviceBuffer<bf16> packed, copies;           // [sent, P] this rank's experts of S; [received, P] the others'
  DeviceBuffer<float> copy_gradients, returned;  // [received, P]; [R - 1, sent, P] the other ranks' for this rank's
};

// The exchange plan's index tables, packed as int32 words, one upload a forward.
struct ExpertParallelGpu::Tables {
  std::vector<int32_t> words;
  int32_t* pinned = nullptr;  // the upload's source: pinned, so the copy is asynchronous
  size_t pinned_words = 0;
  DeviceBuffer<int32_t> device;
  // where each table starts, in words
  size_t segment_begin = 0, segment_send_row = 0, total_sent = 0, global_fraction = 0;
  size_t group_begin = 0;  // r > 1: [R / r + 1] where each group's rows start in the send buffer
  std::vector<size_t> row_offsets, arrived, total_rows, arrived_before, block_start;  // per chunk

  ~Tables() {
    if (pinned != nullptr) cudaFreeHost(pinned);
  }
  int* at(size_t offset) const { return const_cast<int*>(device.data()) + offset; }
};

// The trials of one shape while its adaptive choice is measured.
struct ExpertParallelGpu::Trial {
  std::vector<double> best_ms;  // [candidates] this rank's best step so far
  int steps = 0;                // trial steps read so far; candidate i runs steps [i k, (i + 1) k)
};

// ---- construction ----

ExpertParallelGpu::ExpertParallelGpu(Communicator& communicator, const MoeConfig& config, int64_t max_local_tokens,
                                     const ExpertParallelGpuOptions& options)
    : config_(config), options_(options), max_local_tokens_(max_local_tokens),
      exchange_(std::make_unique<DeviceExchange>(communicator)) {
  // The settings first, on every rank, before any GPU work: a bad one fails everywhere alike.
  Communicator& host = exchange_->host();
  check_same_on_every_rank(host, "expert parallel layer (GPU): the MoE configs", config_fingerprint(config));
  check_same_on_every_rank(host, "expert parallel layer (GPU): the options (pipeline_chunks, "
                           "all_reduce_router_gradient, experts, hierarchical_ranks_per_node)",
                           options_fingerprint(options));
  check_on_every_rank(host, "expert parallel layer (GPU): bad settings",
                      [&] { check_supported(config, options, max_local_tokens, communicator.size()); });

  const int R = communicator.size();
  max_chunks_ = options.pipeline_chunks == kAdaptivePipelineChunks
                    ? *std::max_element(kAdaptiveCandidates.begin(), kAdaptiveCandidates.end())
                    : options.pipeline_chunks;
  const int d = max_chunks_;
  const size_t T = static_cast<size_t>(std::max<int64_t>(max_local_tokens, 1)), D = config.model_dim,
               E = config.num_experts, K = config.top_k;
  experts_per_rank_ = config.num_experts / R;
  rank_ = communicator.rank();
  placement_ = options.placement ? *options.placement : contiguous_placement(config.num_experts, R);
  options_.placement = &placement_;  // the layer's own copy from here on
  step_placement_ = placement_;
  if (options.shadow_per_step) shadows_ = std::make_unique<Shadows>();
  local_experts_config_ = config;
  local_experts_config_.num_experts = local_slots();
  local_experts_config_.top_k = 1;  // each received row is one row of one expert
  local_experts_config_.tokens = 1;  // sizes come from the received counts, not from here

  cublas_ = std::make_unique<cuda::CublasHandle>();
  CUDA_CHECK(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
  events_.assign(static_cast<size_t>(2 * d + 2), nullptr);
  for (cudaEvent_t& event : events_) CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&tables_uploaded_, cudaEventDisableTiming));
  for (StepEvents& events : step_events_) {  // with timing: the adaptive trials read them
    for (cudaEvent_t* event : {&events.forward_start, &events.forward_end, &events.backward_start, &events.backward_end}) {
      CUDA_CHECK(cudaEventCreate(event));
    }
  }
  if (options.hierarchical_ranks_per_node > 1) {  // collective: the node and across-node groups
    hierarchical_ = std::make_unique<DeviceHierarchicalAllToAll>(*exchange_, options.hierarchical_ranks_per_node);
  }

  router_ = cuda::RouterBuffers(T, E, K);
  router_workspace_ = std::make_unique<cuda::RouterWorkspace>(static_cast<int>(E));
  summary_ = DeviceBuffer<int32_t>(static_cast<size_t>(routing_summary_words(config.num_experts)));
  summaries_.assign(static_cast<size_t>(R) * summary_.size(), 0);
  send_slot_ = DeviceBuffer<int>(T * K);
  slot_send_row_ = DeviceBuffer<int>(T * K);
  send_x_ = DeviceBuffer<bf16>(T * K * D);
  returned_ = DeviceBuffer<bf16>(T * K * D);
  d_send_ = DeviceBuffer<bf16>(T * K * D);
  returned_dx_ = DeviceBuffer<bf16>(T * K * D);
  d_combine_weights_ = DeviceBuffer<float>(T * K);
  d_logits_ = DeviceBuffer<float>(T * E);
  d_logits_bf16_ = DeviceBuffer<bf16>(T * E);
  tables_ = std::make_unique<Tables>();
  for (int c = 0; c < d; ++c) chunks_.push_back(std::make_unique<Chunk>());
  // The router workspace's ticket is zeroed on the legacy stream; the caller's stream may be a
  // non-blocking one that does not wait for it.
  CUDA_CHECK(cudaDeviceSynchronize());
}

ExpertParallelGpu::~ExpertParallelGpu() {
  for (cudaEvent_t event : events_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (tables_uploaded_ != nullptr) cudaEventDestroy(tables_uploaded_);
  for (const StepEvents& events : step_events_) {
    for (cudaEvent_t event : {events.forward_start, events.forward_end, events.backward_start, events.backward_end}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  if (exchange_stream_ != nullptr) cudaStreamDestroy(exchange_stream_);
}

const ExchangePlan& ExpertParallelGpu::plan() const {
  if (!plan_) throw std::logic_error("ExpertParallelGpu::plan: no forward has run yet");
  return *plan_;
}

// ---- Tutel's layouts ----

std::vector<int> valid_gpu_layouts(const MoeConfig& config, const ExpertParallelGpuOptions& options, int ranks) {
  if (options.placement && !options.placement->is_even_contiguous()) return {1};  // a placement of its own
  if (options.shadow_per_step) return {1};  // shadowing places experts per step, r = 1
  std::vector<int> valid;
  for (int r : valid_layouts(config, ranks)) {
    if (r == 1) {
      valid.push_back(r);
      continue;
    }
    if (options.pipeline_chunks != 1 || options.hierarchical_ranks_per_node > 1 ||
        options.experts != ExpertCompute::ffn) {
      continue;
    }
    if (r > 1 && config.formulation == Formulation::dropless && (config.hidden_dim / r) % config.block_size != 0) {
      continue;
    }
    valid.push_back(r);
  }
  return valid;
}

void check_gpu_layout(const MoeConfig& config, const ExpertParallelGpuOptions& options, int ranks, int r) {
  if (r == 1) return;
  if (options.shadow_per_step) {
    throw std::invalid_argument("expert layout " + layout_name(r) +
                                " with shadow_per_step; shadowing places the experts of each step itself, at r = 1");
  }
  if (options.placement && !options.placement->is_even_contiguous()) {
    throw std::invalid_argument("expert layout " + layout_name(r) +
                                " on the GPU with a placement of its own; Tutel's layouts store E / R experts a "
                                "rank in id order, other placements take r = 1");
  }
  check_layout(config, ranks, r);  // 0, 1, or r > 1 dividing R and H, with expert_layouts.h's message
  if (options.pipeline_chunks != 1 || options.hierarchical_ranks_per_node > 1) {
    throw std::invalid_argument(
        "expert layout " + layout_name(r) + " on the GPU with pipeline_chunks (d) = " +
        std::to_string(options.pipeline_chunks) + " and hierarchical_ranks_per_node (G) = " +
        std::to_string(options.hierarchical_ranks_per_node) +
        "; the d-chunk pipeline (and its adaptive choice) and the 2DH exchange belong to the expert-parallel "
        "layout r = 1; other layouts take d = 1 and the flat exchange");
  }
  if (options.experts != ExpertCompute::ffn) {
    throw std::invalid_argument("expert layout " + layout_name(r) +
                                " on the GPU with identity experts; the exchange alone is r = 1's");
  }
  if (r > 1 && config.formulation == Formulation::dropless && (config.hidden_dim / r) % config.block_size != 0) {
    throw std::invalid_argument("expert layout " + layout_name(r) + ": each rank computes H / r = " +
                                std::to_string(config.hidden_dim / r) + " hidden columns, not a multiple of B = " +
                                std::to_string(config.block_size) +
                                " (the block-sparse FFN tiles them by B); choose r with H / r a multiple of B");
  }
}

void ExpertParallelGpu::set_layout(int r, const LayoutChoice& why) {
  Communicator& host = exchange_->host();
  check_same_on_every_rank(host, "expert parallel layer (GPU): the layouts r",
                           static_cast<uint64_t>(static_cast<uint32_t>(r)));
  check_on_every_rank(host, "expert parallel layer (GPU): bad layout",
                      [&] { check_gpu_layout(config_, options_, exchange_->size(), r); });
  layout_ = r;
  layout_choice_ = why;
  local_experts_config_.num_experts = r == 0 ? config_.num_experts : r > 1 ? r * experts_per_rank_ : local_slots();
  local_experts_config_.hidden_dim = r > 1 ? config_.hidden_dim / r : config_.hidden_dim;
  forward_done_ = false;  // a backward belongs to a forward of the same layout
}

ExpertParallelGpu::LayoutBuffers& ExpertParallelGpu::layout_buffers() {
  std::unique_ptr<LayoutBuffers>& slot = layout_buffers_[layout_];
  if (slot) return *slot;
  slot = std::make_unique<LayoutBuffers>();
  LayoutBuffers& b = *slot;
  const int r = layout_, E_c = static_cast<int>(local_experts_config_.num_experts);
  const size_t D = config_.model_dim, H_c = local_experts_config_.hidden_dim, E_r = experts_per_rank_;
  const size_t block = 2 * D * H_c;  // P_c
  const size_t slices = r > 1 ? r : 1;
  b.packed = DeviceBuffer<bf16>(slices * E_r * block);
  b.weights = DeviceBuffer<bf16>(E_c * block);
  b.w1 = cuda::expert_pointer_table<const bf16>(b.weights.data(), E_c, block);
  b.w2 = cuda::expert_pointer_table<const bf16>(b.weights.data() + D * H_c, E_c, block);
  b.gradients = DeviceBuffer<float>(E_c * block);
  b.d_w1 = cuda::expert_pointer_table(b.gradients.data(), E_c, block);
  b.d_w2 = cuda::expert_pointer_table(b.gradients.data() + D * H_c, E_c, block);
  if (r > 1) b.returned_gradients = DeviceBuffer<float>(slices * E_r * block);
  return b;
}

// r = 0: every rank all-gathers every stored expert (an all-gather of [E_r, P] from each rank gives
// [E, P], expert e at e P). r > 1: rank g r + i gets slice i of the group's r E_r experts, an
// all-to-all inside the group: storing rank g r + i' sends its [E_r, P_c] of slice i to g r + i,
// which puts them at computed experts i' E_r + j. The same exchanges in reverse bring the gradients
// back (return_expert_gradients).
ExpertParallelGpuWeights ExpertParallelGpu::gather_expert_weights(const ExpertParallelGpuWeights& stored,
                                                                  cudaStream_t stream) {
  if (layout_ == 1) return stored;
  Phase phase(timer_, "ep_gather_experts", stream);
  LayoutBuffers& b = layout_buffers();
  const int r = layout_, R = exchange_->size(), rank = exchange_->rank();
  const int64_t D = config_.model_dim, H = config_.hidden_dim, E_r = experts_per_rank_;
  const int64_t stored_elements = E_r * 2 * D * H;  // = slices x E_r x P_c
  pack_expert_slices(stored.w1, stored.w2, static_cast<int>(E_r), static_cast<int>(D), static_cast<int>(H),
                     r > 1 ? r : 1, b.packed.data(), stream);
  if (r == 0) {
    exchange_->all_gather(b.packed.data(), b.weights.data(), stored_elements, DataType::bfloat16, stream);
    step_.weight_elements_sent = (R - 1) * stored_elements;
  } else {
    const int64_t share = stored_elements / r;  // E_r P_c: one slice of this rank's experts
    std::vector<int64_t> counts(R, 0), offsets(R, 0);
    for (int i = 0; i < r; ++i) {
      const int p = rank / r * r + i;
      counts[p] = share;
      offsets[p] = i * share;  // out: slice i; in: from group rank i, its experts i E_r + j
    }
    exchange_->all_to_all_v(b.packed.data(), counts, offsets, b.weights.data(), counts, offsets, DataType::bfloat16,
                            stream);
    step_.weight_elements_sent = (r - 1) * share;
  }
  return ExpertParallelGpuWeights{stored.gate_weights, b.w1.data(), b.w2.data()};
}

// r = 0: an all-reduce of all E experts' gradients, then each rank keeps its stored experts' rows
// (the Communicator has no reduce-scatter; a ring all-reduce is a reduce-scatter then an all-gather,
// so this sends twice the bytes of Tutel's reduce-scatter, and the sum is the same on every rank).
// r > 1: the group's all-to-all of the forward in reverse; each storing rank writes every slice.
void ExpertParallelGpu::return_expert_gradients(const ExpertParallelGpuGradients& gradients, cudaStream_t stream) {
  if (layout_ == 1) return;
  Phase phase(timer_, "ep_return_expert_gradients", stream);
  LayoutBuffers& b = layout_buffers();
  const int r = layout_, R = exchange_->size(), rank = exchange_->rank();
  const int64_t D = config_.model_dim, H = config_.hidden_dim, E_r = experts_per_rank_;
  const int64_t stored_elements = E_r * 2 * D * H;
  if (r == 0) {
    const int64_t all = static_cast<int64_t>(R) * stored_elements;
    exchange_->all_reduce_sum(b.gradients.data(), b.gradients.data(), all, DataType::float32, stream);
    unpack_expert_slices(b.gradients.data() + rank * stored_elements, gradients.d_w1, gradients.d_w2,
                         static_cast<int>(E_r), static_cast<int>(D), static_cast<int>(H), 1, stream);
    return;
  }
  const int64_t share = stored_elements / r;
  std::vector<int64_t> counts(R, 0), offsets(R, 0);
  for (int i = 0; i < r; ++i) {
    const int p = rank / r * r + i;
    counts[p] = share;
    offsets[p] = i * share;  // out: computed experts i E_r + j to their storing rank; in: slice i
  }
  exchange_->all_to_all_v(b.gradients.data(), counts, offsets, b.returned_gradients.data(), counts, offsets,
                          DataType::float32, stream);
  unpack_expert_slices(b.returned_gradients.data(), gradients.d_w1, gradients.d_w2, static_cast<int>(E_r),
                       static_cast<int>(D), static_cast<int>(H), r, stream);
}

// ---- shadowing decided per step ----

bool ExpertParallelGpu::shadowing() const { return shadows_ && !shadows_->experts.empty(); }

// S from this step's counts (the same on every rank: every rank has the same counts), the step's
// placement, and where each of this rank's step slots finds its weights.
void ExpertParallelGpu::choose_shadows(const std::vector<int64_t>& routed, cudaStream_t stream) {
  if (!shadows_) return;
  Shadows& z = *shadows_;
  const int R = exchange_->size();
  z.experts = worth_shadowing(placement_, routed, config_.model_dim, config_.hidden_dim, config_.hidden_dim);
  step_placement_ = z.experts.empty() ? placement_ : placement_.with_shadowed(z.experts);
  local_experts_config_.num_experts = step_placement_.slots_of(rank_);
  if (z.experts.empty()) return;
  // The copies this rank holds, rank after rank of their storing ranks, and those it sends.
  const std::vector<int64_t>& stored = placement_.experts_of(rank_);
  std::map<int64_t, int> copy_of;  // expert -> copy index here
  z.received_from.assign(static_cast<size_t>(R), 0);
  z.received = 0;
  z.sent.clear();
  for (int p = 0; p < R; ++p) {
    for (int64_t e : z.experts) {
      if (placement_.slot_rank(placement_.replicas(e).front()) != p) continue;
      if (p == rank_) {
        z.sent.push_back(static_cast<int>(std::lower_bound(stored.begin(), stored.end(), e) - stored.begin()));
      } else {
        copy_of[e] = static_cast<int>(z.received++);
        ++z.received_from[static_cast<size_t>(p)];
      }
    }
  }
  std::vector<int> sources;
  for (int64_t e : step_placement_.experts_of(rank_)) {
    const auto it = std::lower_bound(stored.begin(), stored.end(), e);
    sources.push_back(it != stored.end() && *it == e ? static_cast<int>(it - stored.begin()) : -1 - copy_of.at(e));
  }
  const int64_t P = 2 * config_.model_dim * config_.hidden_dim;
  const int64_t sent = static_cast<int64_t>(z.sent.size());
  ensure(z.sources, static_cast<int64_t>(sources.size()));
  ensure(z.sent_sources, sent);
  ensure(z.w1, static_cast<int64_t>(sources.size()));
  ensure(z.w2, static_cast<int64_t>(sources.size()));
  ensure(z.d_w1, static_cast<int64_t>(sources.size()));
  ensure(z.d_w2, static_cast<int64_t>(sources.size()));
  ensure(z.sent_w1, sent);
  ensure(z.sent_w2, sent);
  ensure(z.sent_d_w1, sent);
  ensure(z.sent_d_w2, sent);
  ensure(z.packed, sent * P);
  ensure(z.copies, z.received * P);
  ensure(z.copy_gradients, z.received * P);
  ensure(z.returned, static_cast<int64_t>(R - 1) * sent * P);
  // From pageable memory: staged before the call returns, so `sources` may go; in order on `stream`
  // after the last step's kernels that read these tables.
  CUDA_CHECK(cudaMemcpyAsync(z.sources.data(), sources.data(), sources.size() * sizeof(int), cudaMemcpyHostToDevice, stream));
  if (sent > 0) {
    CUDA_CHECK(cudaMemcpyAsync(z.sent_sources.data(), z.sent.data(), z.sent.size() * sizeof(int), cudaMemcpyHostToDevice,
                               stream));
  }
}

// The step's weight tables: each stored slot the caller's, each shadowed expert stored elsewhere a
// copy, broadcast from its storing rank (one all-to-all-v: every rank sends its experts of S, packed,
// to every other rank).
ExpertParallelGpuWeights ExpertParallelGpu::shadow_weights(const ExpertParallelGpuWeights& stored, cudaStream_t stream) {
  Phase phase(timer_, "ep_shadow_experts", stream);
  Shadows& z = *shadows_;
  const int R = exchange_->size();
  const int64_t D = config_.model_dim, H = config_.hidden_dim, P = 2 * D * H;
  const int sent = static_cast<int>(z.sent.size()), slots = static_cast<int>(step_placement_.slots_of(rank_));
  assemble_pointer_table(stored.w1, z.sent_sources.data(), nullptr, 0, sent, z.sent_w1.data(), stream);
  assemble_pointer_table(stored.w2, z.sent_sources.data(), nullptr, 0, sent, z.sent_w2.data(), stream);
  pack_expert_slices(z.sent_w1.data(), z.sent_w2.data(), sent, static_cast<int>(D), static_cast<int>(H), 1,
                     z.packed.data(), stream);
  std::vector<int64_t> send_counts(R, 0), send_offsets(R, 0), recv_counts(R, 0), recv_offsets(R, 0);
  int64_t offset = 0;
  for (int p = 0; p < R; ++p) {
    if (p != rank_) send_counts[p] = sent * P;  // the same packed experts to every other rank
    recv_counts[p] = z.received_from[p] * P;
    recv_offsets[p] = offset;
    offset += recv_counts[p];
  }
  exchange_->all_to_all_v(z.packed.data(), send_counts, send_offsets, z.copies.data(), recv_counts, recv_offsets,
                          DataType::bfloat16, stream);
  step_.weight_elements_sent = static_cast<int64_t>(R - 1) * sent * P;
  assemble_pointer_table(stored.w1, z.sources.data(), z.copies.data(), P, slots, z.w1.data(), stream);
  assemble_pointer_table(stored.w2, z.sources.data(), z.copies.data() + D * H, P, slots, z.w2.data(), stream);
  return ExpertParallelGpuWeights{stored.gate_weights, z.w1.data(), z.w2.data()};
}

ExpertParallelGpuGradients ExpertParallelGpu::shadow_gradient_tables(const ExpertParallelGpuGradients& stored,
                                                                     cudaStream_t stream) {
  Shadows& z = *shadows_;
  const int64_t D = config_.model_dim, H = config_.hidden_dim, P = 2 * D * H;
  const int sent = static_cast<int>(z.sent.size()), slots = static_cast<int>(step_placement_.slots_of(rank_));
  assemble_pointer_table(stored.d_w1, z.sources.data(), z.copy_gradients.data(), P, slots, z.d_w1.data(), stream);
  assemble_pointer_table(stored.d_w2, z.sources.data(), z.copy_gradients.data() + D * H, P, slots, z.d_w2.data(), stream);
  assemble_pointer_table(stored.d_w1, z.sent_sources.data(), nullptr, 0, sent, z.sent_d_w1.data(), stream);
  assemble_pointer_table(stored.d_w2, z.sent_sources.data(), nullptr, 0, sent, z.sent_d_w2.data(), stream);
  ExpertParallelGpuGradients out = stored;
  out.d_w1 = z.d_w1.data();
  out.d_w2 = z.d_w2.data();
  return out;
}

// Each copy's gradient back to its storing rank (the reverse all-to-all-v), added there to the
// stored expert's own, the other ranks in rank order.
void ExpertParallelGpu::return_shadow_gradients(cudaStream_t stream) {
  if (!shadowing()) return;
  Phase phase(timer_, "ep_return_shadow_gradients", stream);
  Shadows& z = *shadows_;
  const int R = exchange_->size();
  const int64_t D = config_.model_dim, H = config_.hidden_dim, P = 2 * D * H;
  const int64_t sent = static_cast<int64_t>(z.sent.size());
  std::vector<int64_t> send_counts(R, 0), send_offsets(R, 0), recv_counts(R, 0), recv_offsets(R, 0);
  int64_t offset = 0, from = 0;
  for (int p = 0; p < R; ++p) {
    send_counts[p] = z.received_from[p] * P;
    send_offsets[p] = offset;
    offset += send_counts[p];
    if (p == rank_) continue;
    recv_counts[p] = sent * P;
    recv_offsets[p] = from;
    from += recv_counts[p];
  }
  exchange_->all_to_all_v(z.copy_gradients.data(), send_counts, send_offsets, z.returned.data(), recv_counts,
                          recv_offsets, DataType::float32, stream);
  add_expert_blocks(z.returned.data(), R - 1, static_cast<int>(sent), static_cast<int>(D), static_cast<int>(H),
                    z.sent_d_w1.data(), z.sent_d_w2.data(), stream);
}

// ---- forward ----

void ExpertParallelGpu::route(const bf16* x, int64_t local_tokens, const bf16* gate_weights, cudaStream_t stream) {
  Phase phase(timer_, "ep_route", stream);
  const int T = static_cast<int>(local_tokens), D = static_cast<int>(config_.model_dim),
            E = static_cast<int>(config_.num_experts), K = static_cast<int>(config_.top_k);
  cuda::router_logits(cublas_->get(), x, gate_weights, router_.logits.data(), T, D, E, stream);
  cuda::route_top_k(router_, *router_workspace_, T, E, K, config_.renormalize, stream);
  // The slots of this rank grouped by expert, token order inside: the dispatch plan's stable sort.
  // Only routed_slots, routed_offsets and tokens_per_expert are read, so the formulation is any.
  if (!home_plan_ || home_plan_tokens_ != local_tokens) {
    MoeConfig home = config_;
    home.tokens = local_tokens;
    home.formulation = Formulation::padded;  // needs no H % B; its rows are not used
    home.capacity_factor = 1.0;
    home_plan_ = std::make_unique<cuda::DispatchPlanBuffers>(home);
    home_plan_tokens_ = local_tokens;
  }
  cuda::build_dispatch_plan(router_.top_experts.data(), *home_plan_, stream);
}

void ExpertParallelGpu::forward(const bf16* x, int64_t local_tokens, const ExpertParallelGpuWeights& weights, bf16* y,
                                cudaStream_t stream) {
  forward_route(x, local_tokens, weights, y, stream);
  forward_out(stream, /*bring_back=*/true);
  forward_back(stream, /*brought_back=*/true);
}

void ExpertParallelGpu::expect_stage(int stage, const char* call) const {
  if (staged_.stage != stage) {
    static const char* const after[] = {"nothing staged", "forward_route", "forward_experts", "backward_experts",
                                        "forward_send_counts"};
    throw std::logic_error(std::string("ExpertParallelGpu::") + call + " after " + after[staged_.stage] +
                           "; the stages run forward_route (or forward_send_counts, forward_receive_counts), "
                           "forward_experts, forward_combine, then backward_experts, backward_combine");
  }
}

void ExpertParallelGpu::forward_experts(cudaStream_t stream) {
  expect_stage(1, "forward_experts");
  forward_out(stream, /*bring_back=*/false);
}

void ExpertParallelGpu::forward_combine(cudaStream_t stream) {
  expect_stage(2, "forward_combine");
  forward_back(stream, /*brought_back=*/false);
}

void ExpertParallelGpu::forward_route(const bf16* x, int64_t local_tokens, const ExpertParallelGpuWeights& weights,
                                      bf16* y, cudaStream_t stream) {
  forward_send_counts(x, local_tokens, weights, y, stream);
  forward_receive_counts(stream);
}

void ExpertParallelGpu::forward_send_counts(const bf16* x, int64_t local_tokens,
                                            const ExpertParallelGpuWeights& weights, bf16* y, cudaStream_t stream) {
  NvtxRange range("ep_forward_send_counts");
  forward_done_ = false;
  staged_ = Staged{};
  const int64_t waits_before = exchange_->host_waits() + (hierarchical_ ? hierarchical_->host_waits() : 0);
  // Not the set of a trial step still to be read (after the count exchange below, or, when this
  // forward fails before, at a later one).
  current_step_events_ = trial_step_pending_ ? 1 - trial_step_events_ : 1 - current_step_events_;
  CUDA_CHECK(cudaEventRecord(step_events_[current_step_events_].forward_start, stream));
  const int64_t E = config_.num_experts;
  const int64_t words = routing_summary_words(E);

  // ---- 1. route locally; this rank's own faults travel in the count exchange ----
  int32_t status = static_cast<int32_t>(std::clamp<int64_t>(local_tokens, 0, std::numeric_limits<int32_t>::max()));
  if (local_tokens < 0 || local_tokens > max_local_tokens_) {
    status = kBadTokenCount;
  } else if (local_tokens > 0 && (x == nullptr || y == nullptr || weights.gate_weights == nullptr ||
                                  (options_.experts == ExpertCompute::ffn && (weights.w1 == nullptr || weights.w2 == nullptr)))) {
    status = kNullPointer;
  }
  if (status > 0) route(x, local_tokens, weights.gate_weights, stream);
  pack_routing_summary(status > 0 ? home_plan_->tokens_per_expert.data() : nullptr, router_.mean_probs.data(),
                       router_.z_loss.data(), status, static_cast<int>(E), summary_.data(), stream);

  // ---- 2. the count exchange: the forward's one host synchronisation (in forward_receive_counts) ----
  {
    Phase phase(timer_, "ep_count_exchange", stream);
    exchange_->start_all_gather_to_host(summary_.data(), words, DataType::int32, stream);
  }
  staged_.stage = 4;
  staged_.x = x;
  staged_.y = y;
  staged_.weights = weights;
  staged_.waits_before = waits_before;
}

void ExpertParallelGpu::forward_receive_counts(cudaStream_t stream) {
  NvtxRange range("ep_forward_receive_counts");
  expect_stage(4, "forward_receive_counts");
  staged_.stage = 0;  // a fault below leaves no stage to continue from
  const int R = exchange_->size(), rank = exchange_->rank();
  const int64_t E = config_.num_experts, K = config_.top_k;
  const int64_t words = routing_summary_words(E);
  exchange_->finish_all_gather_to_host(summaries_.data());
  std::vector<int64_t> tokens_per_rank(R), routed(static_cast<size_t>(R) * E);
  std::string faults;
  for (int p = 0; p < R; ++p) {
    const int32_t* summary = summaries_.data() + static_cast<size_t>(p) * words;
    if (summary[0] < 0) {
      faults += std::string(faults.empty() ? "" : "; ") + "rank " + std::to_string(p) + ": " +
                (summary[0] == kBadTokenCount ? "local_tokens outside [0, max_local_tokens]"
                                              : "a null x, y or weight pointer");
    }
    tokens_per_rank[p] = std::max<int32_t>(summary[0], 0);
    for (int64_t e = 0; e < E; ++e) routed[p * E + e] = summary[1 + e];
  }
  if (!faults.empty()) throw std::invalid_argument("expert parallel layer (GPU) forward: bad input: " + faults);
  const bool adaptive = options_.pipeline_chunks == kAdaptivePipelineChunks;
  const int d = adaptive ? choose_pipeline_chunks(tokens_per_rank) : options_.pipeline_chunks;
  choose_shadows(routed, stream);
  plan_ = std::make_unique<ExchangePlan>(config_, R, rank, d, tokens_per_rank, routed, layout_, &step_placement_);

  // The router losses over all T tokens: f_e from the counts, P_e and the z-loss from the summaries.
  const ExchangePlan& plan = *plan_;
  const double T = static_cast<double>(plan.tokens());
  step_ = ExpertParallelGpuStep{};
  step_.tokens = plan.tokens();
  step_.token_offset = plan.token_offset();
  step_.local_tokens = plan.local_tokens();
  step_.capacity = plan.capacity();
  step_.routed_per_rank_expert = plan.routed_matrix();
  step_.kept_per_rank_expert = plan.kept_matrix();
  step_.dropped_slots = plan.dropped_slots();
  for (int c = 0; c < d; ++c) {  // at r > 1 each kept slot's row goes to r ranks
    for (int64_t rows : plan.send_rows(c)) step_.rows_sent += rows;
  }
  step_.rows_received = plan.rows_received();
  step_.pipeline_chunks = d;
  step_.hierarchical_ranks_per_node = hierarchical_ ? options_.hierarchical_ranks_per_node : 0;
  step_.layout = layout_;
  step_.layout_choice = layout_choice_;
  if (shadows_) step_.shadowed = shadows_->experts;
  if (adaptive) {
    step_.pipeline = choices_.at(tokens_per_rank);
  } else {
    step_.pipeline.chosen = d;
  }
  const bool trial_step = adaptive && step_.pipeline.chosen == 0;
  double z_sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double routed_e = 0.0, prob_sum = 0.0;
    for (int p = 0; p < R; ++p) {
      const int32_t* summary = summaries_.data() + static_cast<size_t>(p) * words;
      routed_e += static_cast<double>(routed[p * E + e]);
      prob_sum += static_cast<double>(tokens_per_rank[p]) * std::bit_cast<float>(summary[1 + E + e]);
    }
    const double fraction = routed_e / (T * static_cast<double>(K));
    step_.aux_loss += static_cast<double>(E) * fraction * prob_sum / T;
  }
  for (int p = 0; p < R; ++p) {
    const int32_t* summary = summaries_.data() + static_cast<size_t>(p) * words;
    z_sum += static_cast<double>(tokens_per_rank[p]) * std::bit_cast<float>(summary[1 + 2 * E]);
  }
  step_.z_loss = z_sum / T;

  upload_tables(stream);  // with the global f_e, for the router backward
  reserve_buffers();
  if (hierarchical_) hierarchical_counts();
  staged_.stage = 1;
  staged_.trial_step = trial_step;
}

void ExpertParallelGpu::forward_out(cudaStream_t stream, bool bring_back) {
  NvtxRange range("ep_forward_out");
  const bf16* const x = staged_.x;
  const ExpertParallelGpuWeights& weights = staged_.weights;
  const ExchangePlan& plan = *plan_;
  const int64_t K = config_.top_k, D = config_.model_dim;
  const int d = plan.chunks();
  const int64_t T_r = plan.local_tokens();

  // ---- 3. the send order, and the rows in it ----
  if (T_r > 0) {
    Phase phase(timer_, "ep_permute", stream);
    build_send_order(router_.top_experts.data(), home_plan_->routed_slots.data(), home_plan_->routed_offsets.data(),
                     tables_->at(tables_->segment_begin), tables_->at(tables_->segment_send_row),
                     static_cast<int>(T_r * K), plan.segments(), send_slot_.data(), slot_send_row_.data(), stream);
    if (plan.rows_sent() > 0) cuda::permute_tokens(home_view(T_r), x, send_x_.data(), static_cast<int>(D), stream);
  }
  computed_weights_ = gather_expert_weights(weights, stream);  // r = 1: the caller's
  if (shadowing()) computed_weights_ = shadow_weights(weights, stream);  // with copies of the shadowed experts
  for (int c = 0; c < d; ++c) prepare_experts(c, computed_weights_, stream);

  // ---- 4, 5: chunk after chunk, the rows out, the experts, the results back ----
  // (r > 1: the r partial results of each row come back apart and are summed here.)
  const bool partial = plan.copies() > 1;
  pipeline_out(send_x_.data(), partial ? partials_.data() : returned_.data(), stream, bring_back,
               [&](int c) { experts_forward(c, computed_weights_, stream); });
  staged_.stage = 2;
}

void ExpertParallelGpu::forward_back(cudaStream_t stream, bool brought_back) {
  NvtxRange range("ep_forward_back");
  const ExchangePlan& plan = *plan_;
  const int64_t D = config_.model_dim, T_r = plan.local_tokens();
  bf16* const y = staged_.y;
  const bool partial = plan.copies() > 1;
  pipeline_back(partial ? partials_.data() : returned_.data(), stream, brought_back);
  if (partial) sum_partials(returned_.data(), stream);

  // ---- 6. the weighted combine ----
  if (T_r > 0) {
    Phase phase(timer_, "ep_combine", stream);
    cuda::unpermute_and_combine(home_view(T_r), router_.combine_weights.data(), returned_.data(), y,
                                static_cast<int>(D), stream);
  }
  CUDA_CHECK(cudaEventRecord(step_events_[current_step_events_].forward_end, stream));
  if (staged_.trial_step) {  // read at the next forward, once the count exchange has waited on the stream
    trial_step_pending_ = true;
    trial_step_has_backward_ = false;
    trial_step_events_ = current_step_events_;
  }
  step_.host_synchronisations = static_cast<int>(exchange_->host_waits() +
                                                 (hierarchical_ ? hierarchical_->host_waits() : 0) -
                                                 staged_.waits_before);
  staged_.stage = 0;
  forward_done_ = true;
}

// ---- adaptive pipelining ----

int ExpertParallelGpu::choose_pipeline_chunks(const std::vector<int64_t>& tokens_per_rank) {
  finish_trial_step();
  PipelineChoice& choice = choices_[tokens_per_rank];
  if (choice.candidates.empty()) {  // a new shape: its trials start
    choice.adaptive = true;
    choice.candidates.assign(kAdaptiveCandidates.begin(), kAdaptiveCandidates.end());
    choice.times_ms.assign(choice.candidates.size(), -1.0);
    auto trial = std::make_unique<Trial>();
    trial->best_ms.assign(choice.candidates.size(), std::numeric_limits<double>::infinity());
    trials_[tokens_per_rank] = std::move(trial);
  }
  if (choice.chosen != 0) return choice.chosen;
  const Trial& trial = *trials_.at(tokens_per_rank);
  trial_step_shape_ = tokens_per_rank;
  trial_step_candidate_ = trial.steps / kTrialStepsPerCandidate;
  return choice.candidates[static_cast<size_t>(trial_step_candidate_)];
}

void ExpertParallelGpu::finish_trial_step() {
  if (!trial_step_pending_) return;
  trial_step_pending_ = false;
  // Usually complete already: the count exchange just waited on the caller's stream.
  const StepEvents& events = step_events_[trial_step_events_];
  exchange_->wait_for_event(trial_step_has_backward_ ? events.backward_end : events.forward_end,
                            "ExpertParallelGpu: the end of a pipelining trial step");
  float forward_ms = 0.0f, backward_ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&forward_ms, events.forward_start, events.forward_end));
  if (trial_step_has_backward_) {
    CUDA_CHECK(cudaEventElapsedTime(&backward_ms, events.backward_start, events.backward_end));
  }
  Trial& trial = *trials_.at(trial_step_shape_);
  double& best = trial.best_ms[static_cast<size_t>(trial_step_candidate_)];
  best = std::min(best, static_cast<double>(forward_ms) + static_cast<double>(backward_ms));
  ++trial.steps;
  const size_t candidates = trial.best_ms.size();
  if (trial.steps < static_cast<int>(candidates) * kTrialStepsPerCandidate) return;

  // Every rank's times; a candidate is as slow as its slowest rank, and every rank picks the same d.
  const std::vector<double> all = all_gather<double>(exchange_->host(), std::span<const double>(trial.best_ms));
  PipelineChoice& choice = choices_.at(trial_step_shape_);
  size_t fastest = 0;
  for (size_t i = 0; i < candidates; ++i) {
    double slowest = 0.0;
    for (int p = 0; p < exchange_->size(); ++p) slowest = std::max(slowest, all[p * candidates + i]);
    choice.times_ms[i] = slowest;
    if (choice.times_ms[i] < choice.times_ms[fastest]) fastest = i;
  }
  choice.chosen = choice.candidates[fastest];
  trials_.erase(trial_step_shape_);
}

void ExpertParallelGpu::upload_tables(cudaStream_t stream) {
  const ExchangePlan& plan = *plan_;
  Tables& t = *tables_;
  const int d = plan.chunks(), R = plan.ranks();
  const int64_t E = plan.experts();
  t.words.clear();
  auto put = [&t](int64_t value) {
    if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument("expert parallel layer (GPU): an exchange index of " + std::to_string(value) +
                                  " does not fit the kernels' int32 indices");
    }
    t.words.push_back(static_cast<int32_t>(value));
  };
  t.segment_begin = t.words.size();
  for (int64_t e = 0; e < E; ++e) {
    for (int k = 0; k <= plan.segments(); ++k) put(plan.segment_begin(e, k));
  }
  t.segment_send_row = t.words.size();
  for (int64_t e = 0; e < E; ++e) {
    for (int k = 0; k < plan.segments(); ++k) put(plan.segment_send_row(e, k));
  }
  t.total_sent = t.words.size();
  put(plan.rows_sent());
  t.global_fraction = t.words.size();
  for (int64_t e = 0; e < E; ++e) {
    double routed = 0.0;
    for (int p = 0; p < R; ++p) routed += static_cast<double>(plan.routed(p, e));
    const float fraction = static_cast<float>(routed / (static_cast<double>(plan.tokens()) * config_.top_k));
    t.words.push_back(std::bit_cast<int32_t>(fraction));
  }
  t.group_begin = t.words.size();
  if (plan.copies() > 1) {  // r > 1, d = 1: group g's block starts where its first rank's does
    const int r = plan.copies();
    for (int g = 0; g < R / r; ++g) put(plan.send_row_offsets(0)[static_cast<size_t>(g * r)]);
    put(plan.rows_sent());
  }
  const int64_t E_c = plan.computed_experts();
  t.row_offsets.assign(d, 0);
  t.arrived.assign(d, 0);
  t.total_rows.assign(d, 0);
  t.arrived_before.assign(d, 0);
  t.block_start.assign(d, 0);
  for (int c = 0; c < d; ++c) {
    t.row_offsets[c] = t.words.size();
    for (int64_t j = 0; j <= E_c; ++j) put(plan.row_offset(c, j));
    t.arrived[c] = t.words.size();
    for (int64_t j = 0; j < E_c; ++j) put(plan.arrived(c, j));
    t.total_rows[c] = t.words.size();
    put(plan.total_rows(c));
    t.arrived_before[c] = t.words.size();
    for (int64_t j = 0; j < E_c; ++j) {
      for (int s = 0; s <= R; ++s) put(plan.arrived_before(c, j, s));
    }
    t.block_start[c] = t.words.size();
    for (int s = 0; s < R; ++s) {
      for (int64_t j = 0; j < E_c; ++j) put(plan.block_start(c, s, j));
    }
  }
  // The last upload may still be reading the pinned words (if the caller changed streams).
  exchange_->wait_for_event(tables_uploaded_, "ExpertParallelGpu: the last upload of the exchange tables");
  if (t.pinned_words < t.words.size()) {
    if (t.pinned != nullptr) CUDA_CHECK(cudaFreeHost(t.pinned));
    t.pinned = nullptr;
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&t.pinned), t.words.size() * sizeof(int32_t),
                             cudaHostAllocDefault));
    t.pinned_words = t.words.size();
  }
  std::memcpy(t.pinned, t.words.data(), t.words.size() * sizeof(int32_t));
  ensure(t.device, static_cast<int64_t>(t.words.size()));
  CUDA_CHECK(cudaMemcpyAsync(t.device.data(), t.pinned, t.words.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaEventRecord(tables_uploaded_, stream));
}

void ExpertParallelGpu::reserve_buffers() {
  const ExchangePlan& plan = *plan_;
  // The experts this rank computes: E_c of them, H_c = H / r hidden columns each at r > 1.
  const int64_t D = config_.model_dim, H = local_experts_config_.hidden_dim, E_c = plan.computed_experts();
  const bool ffn = options_.experts == ExpertCompute::ffn;
  const bool dropless = config_.formulation == Formulation::dropless;
  if (plan.copies() > 1) ensure(partials_, plan.rows_returned() * D);
  // The chunks that received rows take slots 0, 1, ... in chunk order (chunks past d: none).
  for (auto& chunk : chunks_) chunk->slot = -1;
  int slots = 0;
  int64_t most_received = 0, most_rows = 0;
  for (int c = 0; c < plan.chunks(); ++c) {
    Chunk& chunk = *chunks_[c];
    const int64_t received = plan.rows_received(c);
    ensure(chunk.received, received * D);
    if (!ffn) continue;
    ensure(chunk.sent_back, received * D);
    if (received == 0) continue;  // the experts skip this chunk
    chunk.slot = slots++;
    most_received = std::max(most_received, received);
    most_rows = std::max(most_rows, plan.total_rows(c));
  }
  slots_.count = slots;
  if (slots == 0) return;
  int64_t slot_rows = most_rows;
  if (dropless) {
    // Every chunk's topology has the same bound on block rows R (sized for the most rows a chunk
    // received, with headroom), so that slot k starts at block row k R, as the weight gradients'
    // walk over all slots (MicroBatchTopology) reads them. The products' grids and TMA descriptors
    // span that bound: the operands span it too, as MoeLayerGpu's do, so no tile of a block row
    // past the real ones reads outside an allocation.
    if (slots_.topology_tokens < most_received || slots_.topology_experts != E_c || slots_.topology_hidden != H) {
      slots_.topology_tokens = most_received + most_received / 4;  // headroom, as ensure()
      slots_.topology_experts = E_c;
      slots_.topology_hidden = H;
    }
    MoeConfig sizes = local_experts_config_;
    sizes.tokens = slots_.topology_tokens;
    for (auto& chunk : chunks_) {
      if (chunk->slot < 0) continue;
      if (!chunk->topology || chunk->topology_rows != sizes.tokens || chunk->topology_experts != E_c ||
          chunk->topology_hidden != H) {
        chunk->topology = std::make_unique<cuda::TopologyBuffers>(sizes);
        chunk->topology_rows = sizes.tokens;
        chunk->topology_experts = E_c;
        chunk->topology_hidden = H;
      }
      const cuda::DeviceTopology bound = chunk->topology->topology();
      slot_rows = int64_t{bound.max_block_rows} * bound.block_size;
    }
    if (slots > 1 && (!slots_.walk || slots_.walk->micro_batches() != slots || slots_.walk_tokens != sizes.tokens ||
                      slots_.walk_experts != E_c || slots_.walk_hidden != H)) {
      slots_.walk = std::make_unique<cuda::MicroBatchTopology>(sizes, slots);
      slots_.walk_tokens = sizes.tokens;
      slots_.walk_experts = E_c;
      slots_.walk_hidden = H;
    }
  }
  slots_.rows = slot_rows;
  const bool headroom = !dropless;  // the topology's bound has its own
  const int64_t all_rows = slots * slot_rows;
  ensure(slots_.permuted_x, all_rows * D, headroom);
  ensure(slots_.expert_out, all_rows * D, headroom);
  ensure(slots_.hidden, all_rows * H, headroom);
  ensure(slots_.d_pre_activation, all_rows * H, headroom);
  for (int c = 0; c < plan.chunks(); ++c) {
    Chunk& chunk = *chunks_[c];
    if (chunk.slot < 0) continue;
    const int64_t first_row = chunk.slot * slot_rows, rows = plan.total_rows(c);
    chunk.permuted_x = slots_.permuted_x.data() + first_row * D;
    chunk.expert_out = slots_.expert_out.data() + first_row * D;
    chunk.hidden = slots_.hidden.data() + first_row * H;
    chunk.d_pre_activation = slots_.d_pre_activation.data() + first_row * H;
    ensure(chunk.row_slot, rows);
    ensure(chunk.d_permuted_x, slot_rows * D, headroom);
    ensure(chunk.pre_activation, slot_rows * H, headroom);
    if (!dropless) {
      ensure(chunk.d_hidden, rows * H);
      for (DeviceBuffer<bf16*>* table : {&chunk.x_rows, &chunk.pre_rows, &chunk.hidden_rows, &chunk.out_rows,
                                         &chunk.d_hidden_rows, &chunk.d_pre_rows, &chunk.d_x_rows}) {
        ensure(*table, E_c);
      }
    }
  }
}

DevicePlan ExpertParallelGpu::home_view(int64_t local_tokens) const {
  DevicePlan view;  // the send order as a plan: row r of the send buffer holds slot send_slot[r]
  view.tokens = static_cast<int>(local_tokens);
  view.top_k = static_cast<int>(config_.top_k);
  view.num_experts = static_cast<int>(config_.num_experts);
  view.capacity = 0;
  view.block_size = static_cast<int>(config_.block_size);
  view.max_rows = static_cast<int>(local_tokens * config_.top_k);
  view.row_slot = const_cast<int*>(send_slot_.data());
  view.slot_row = const_cast<int*>(slot_send_row_.data());
  view.total_rows = tables_->at(tables_->total_sent);
  return view;
}

DevicePlan ExpertParallelGpu::expert_view(int c) const {
  const ExchangePlan& plan = *plan_;
  DevicePlan view;  // the local experts' rows over the rows received: one "token" per received row
  view.tokens = static_cast<int>(plan.rows_received(c));
  view.top_k = 1;
  view.num_experts = static_cast<int>(plan.computed_experts());
  view.capacity = static_cast<int>(plan.padded_rows(c));
  view.block_size = static_cast<int>(config_.block_size);
  view.max_rows = static_cast<int>(plan.total_rows(c));
  view.tokens_per_expert = tables_->at(tables_->arrived[c]);
  view.kept_per_expert = tables_->at(tables_->arrived[c]);
  view.row_offsets = tables_->at(tables_->row_offsets[c]);
  view.row_slot = const_cast<int*>(chunks_[c]->row_slot.data());
  view.total_rows = tables_->at(tables_->total_rows[c]);
  return view;
}

// ---- the pipeline ----

void ExpertParallelGpu::send_chunk(int c, const bf16* out) {
  Phase phase(timer_, "ep_dispatch", exchange_stream_);
  exchange_chunk(c, /*forward=*/true, out + plan_->chunk_send_begin(c) * config_.model_dim, chunks_[c]->received.data(),
                 exchange_stream_);
  CUDA_CHECK(cudaEventRecord(events_[2 + 2 * c], exchange_stream_));  // arrived(c)
}

void ExpertParallelGpu::bring_back_chunk(int c, bf16* back) {
  CUDA_CHECK(cudaStreamWaitEvent(exchange_stream_, events_[3 + 2 * c], 0));  // computed(c); before the phase: it
                                                                             // times the exchange alone
  Phase phase(timer_, "ep_combine_exchange", exchange_stream_);
  exchange_chunk(c, /*forward=*/false, chunk_result(c), back + plan_->chunk_send_begin(c) * config_.model_dim,
                 exchange_stream_);
}

// The caller's stream waiting on the exchange stream: the span between an event recorded before the
// wait (its work so far done) and one after it (the exchange done) is the communication the compute
// stream could not hide, the layer's exposed communication (zero when the rows were there first).
void ExpertParallelGpu::wait_for_exchange(cudaEvent_t exchanged, const char* name, cudaStream_t stream) {
  Phase phase(timer_, name, stream);
  CUDA_CHECK(cudaStreamWaitEvent(stream, exchanged, 0));
}

template <typename Work>
void ExpertParallelGpu::pipeline_out(const bf16* out, bf16* back, cudaStream_t stream, bool bring_back, Work&& work) {
  const int d = plan_->chunks();
  // The exchange stream starts once what came before on the caller's stream (the rows in send
  // order) is done.
  CUDA_CHECK(cudaEventRecord(events_[0], stream));
  CUDA_CHECK(cudaStreamWaitEvent(exchange_stream_, events_[0], 0));
  // Tutel's order: chunk c + 1 goes out before chunk c comes back, so that its exchange runs while
  // chunk c's experts do.
  send_chunk(0, out);
  for (int c = 0; c < d; ++c) {
    wait_for_exchange(events_[2 + 2 * c], "ep_wait_dispatch", stream);
    {
      Phase phase(timer_, "ep_experts", stream);
      work(c);
    }
    CUDA_CHECK(cudaEventRecord(events_[3 + 2 * c], stream));  // computed(c)
    if (c + 1 < d) send_chunk(c + 1, out);
    if (bring_back) bring_back_chunk(c, back);
  }
}

void ExpertParallelGpu::pipeline_back(bf16* back, cudaStream_t stream, bool brought_back) {
  if (!brought_back) {
    for (int c = 0; c < plan_->chunks(); ++c) bring_back_chunk(c, back);
  }
  CUDA_CHECK(cudaEventRecord(events_[1], exchange_stream_));  // returned
  wait_for_exchange(events_[1], "ep_wait_combine", stream);
}

void ExpertParallelGpu::exchange_chunk(int c, bool forward, const bf16* send, bf16* recv, cudaStream_t stream) {
  const ExchangePlan& plan = *plan_;
  const int64_t D = config_.model_dim;
  if (plan.layout() == 0) {  // data-parallel experts: every row stays here, a copy, no collective
    const size_t rank = static_cast<size_t>(plan.rank());
    const int64_t rows = plan.send_rows(c)[rank];  // = recv_rows(c)[rank]
    const int64_t from = (forward ? plan.send_row_offsets(c) : plan.recv_row_offsets(c))[rank];
    const int64_t to = (forward ? plan.recv_row_offsets(c) : plan.return_row_offsets(c))[rank];
    if (rows > 0) {
      CUDA_CHECK(cudaMemcpyAsync(recv + to * D, send + from * D, static_cast<size_t>(rows * D) * sizeof(bf16),
                                 cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  // Out: this rank's send rows to the experts' ranks (at r > 1 the r ranks of a group read one
  // block); back: the received rows to their sources (at r > 1 into r blocks, one per rank).
  const std::vector<int64_t> send_offsets = times(forward ? plan.send_row_offsets(c) : plan.recv_row_offsets(c), D);
  const std::vector<int64_t> recv_offsets = times(forward ? plan.recv_row_offsets(c) : plan.return_row_offsets(c), D);
  if (hierarchical_) {
    hierarchical_->all_to_all_v(send, send_offsets, recv, recv_offsets,
                                chunk_counts_[static_cast<size_t>(forward ? c : plan.chunks() + c)],
                                DataType::bfloat16, stream);
    return;
  }
  exchange_->all_to_all_v(send, times(forward ? plan.send_rows(c) : plan.recv_rows(c), D), send_offsets, recv,
                          times(forward ? plan.recv_rows(c) : plan.send_rows(c), D), recv_offsets,
                          DataType::bfloat16, stream);
}

void ExpertParallelGpu::hierarchical_counts() {
  const ExchangePlan& plan = *plan_;
  const int d = plan.chunks(), R = plan.ranks(), rank = plan.rank();
  const int64_t D = config_.model_dim;
  // [c]: the rows out, rank s to the rank t of the experts; [d + c]: the same rows back, t to s.
  chunk_counts_.assign(static_cast<size_t>(2 * d), std::vector<int64_t>(static_cast<size_t>(R) * R, 0));
  for (int c = 0; c < d; ++c) {
    std::vector<int64_t>& out = chunk_counts_[static_cast<size_t>(c)];
    std::vector<int64_t>& back = chunk_counts_[static_cast<size_t>(d + c)];
    for (int s = 0; s < R; ++s) {
      for (int64_t u = 0; u < plan.units(); ++u) {
        const int64_t elements = plan.part(c, s, u).count * D;
        const int t = plan.unit_rank(u);
        out[static_cast<size_t>(s) * R + t] += elements;
        back[static_cast<size_t>(t) * R + s] += elements;
      }
    }
    // This rank's row and column are the plan's own send and receive counts.
    for (int t = 0; t < R; ++t) {
      if (out[static_cast<size_t>(rank) * R + t] != plan.send_rows(c)[t] * D ||
          out[static_cast<size_t>(t) * R + rank] != plan.recv_rows(c)[t] * D) {
        throw std::logic_error("expert parallel layer (GPU): the 2DH count matrix disagrees with the plan");
      }
    }
    hierarchical_->reserve(out, DataType::bfloat16);
    hierarchical_->reserve(back, DataType::bfloat16);
  }
}

const bf16* ExpertParallelGpu::chunk_result(int c) const {
  return options_.experts == ExpertCompute::identity ? chunks_[c]->received.data() : chunks_[c]->sent_back.data();
}

void ExpertParallelGpu::sum_over_replicas(const ExpertParallelGpuGradients& gradients, cudaStream_t stream) {
  if (!placement_.replicated() || options_.experts != ExpertCompute::ffn) return;
  Phase phase(timer_, "ep_replica_all_reduce", stream);
  const size_t w1 = static_cast<size_t>(config_.model_dim) * config_.hidden_dim, w2 = w1;  // D H and H D
  if (replica_sums_.size() == 0) {  // the tables of this rank's replicas, once (the placement is fixed)
    std::vector<int> slot, row;
    std::vector<int64_t> place(static_cast<size_t>(placement_.experts()), -1);
    int64_t count = 0;
    for (int64_t e = 0; e < placement_.experts(); ++e) {
      if (placement_.replicas(e).size() > 1) place[static_cast<size_t>(e)] = count++;
    }
    const std::vector<int64_t>& mine = placement_.experts_of(rank_);
    for (size_t j = 0; j < mine.size(); ++j) {
      if (place[static_cast<size_t>(mine[j])] < 0) continue;
      slot.push_back(static_cast<int>(j));
      row.push_back(static_cast<int>(place[static_cast<size_t>(mine[j])]));
    }
    replicated_experts_ = static_cast<int>(count);
    local_replicas_ = static_cast<int>(slot.size());
    replica_sums_ = DeviceBuffer<float>(static_cast<size_t>(count) * (w1 + w2));
    replica_slot_ = DeviceBuffer<int>(std::max<size_t>(slot.size(), 1));
    replica_row_ = DeviceBuffer<int>(std::max<size_t>(row.size(), 1));
    if (!slot.empty()) {
      CUDA_CHECK(cudaMemcpy(replica_slot_.data(), slot.data(), slot.size() * sizeof(int), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(replica_row_.data(), row.data(), row.size() * sizeof(int), cudaMemcpyHostToDevice));
    }
  }
  const size_t rows = static_cast<size_t>(replicated_experts_);
  float* sums_w1 = replica_sums_.data();
  float* sums_w2 = replica_sums_.data() + rows * w1;
  CUDA_CHECK(cudaMemsetAsync(replica_sums_.data(), 0, replica_sums_.size() * sizeof(float), stream));
  pack_through_table(gradients.d_w1, replica_slot_.data(), replica_row_.data(), local_replicas_, w1, sums_w1, stream);
  pack_through_table(gradients.d_w2, replica_slot_.data(), replica_row_.data(), local_replicas_, w2, sums_w2, stream);
  exchange_->all_reduce_sum(replica_sums_.data(), replica_sums_.data(), static_cast<int64_t>(rows * (w1 + w2)),
                            DataType::float32, stream);
  unpack_through_table(sums_w1, replica_slot_.data(), replica_row_.data(), local_replicas_, w1, gradients.d_w1, stream);
  unpack_through_table(sums_w2, replica_slot_.data(), replica_row_.data(), local_replicas_, w2, gradients.d_w2, stream);
}

void ExpertParallelGpu::sum_partials(bf16* out, cudaStream_t stream) {
  const ExchangePlan& plan = *plan_;
  Phase phase(timer_, "ep_sum_partials", stream);
  sum_partial_rows(partials_.data(), tables_->at(tables_->group_begin), plan.ranks() / plan.copies(), plan.copies(),
                   static_cast<int>(plan.rows_sent()), static_cast<int>(config_.model_dim), out, stream);
}

// ---- the local experts ----

void ExpertParallelGpu::prepare_experts(int c, const ExpertParallelGpuWeights&, cudaStream_t stream) {
  const ExchangePlan& plan = *plan_;
  if (options_.experts == ExpertCompute::identity || plan.rows_received(c) == 0) return;
  Chunk& chunk = *chunks_[c];
  const int E_c = static_cast<int>(plan.computed_experts()), rows = static_cast<int>(plan.total_rows(c));
  build_expert_rows(tables_->at(tables_->row_offsets[c]), tables_->at(tables_->arrived_before[c]),
                    tables_->at(tables_->block_start[c]), E_c, plan.ranks(), rows, chunk.row_slot.data(), stream);
  if (config_.formulation == Formulation::dropless) {
    cuda::build_topology(expert_view(c), *chunk.topology, stream);
    return;
  }
  // [E_c, C_c, *] tensors: expert j's rows start at j C_c.
  const size_t C = static_cast<size_t>(plan.padded_rows(c)), D = config_.model_dim, H = local_experts_config_.hidden_dim;
  auto table = [&](DeviceBuffer<bf16*>& pointers, bf16* base, size_t width) {
    cuda::fill_strided_pointers(base, C * width, E_c, pointers.data(), stream);
  };
  table(chunk.x_rows, chunk.permuted_x, D);
  table(chunk.pre_rows, chunk.pre_activation.data(), H);
  table(chunk.hidden_rows, chunk.hidden, H);
  table(chunk.out_rows, chunk.expert_out, D);
  table(chunk.d_hidden_rows, chunk.d_hidden.data(), H);
  table(chunk.d_pre_rows, chunk.d_pre_activation, H);
  table(chunk.d_x_rows, chunk.d_permuted_x.data(), D);
}

ExpertParallelGpu::ChunkWork ExpertParallelGpu::chunk_work(int c) {
  const ExchangePlan& plan = *plan_;
  if (options_.experts == ExpertCompute::identity || plan.rows_received(c) == 0) return {};
  return {chunks_[c].get(), static_cast<int>(config_.model_dim), static_cast<int>(local_experts_config_.hidden_dim),
          static_cast<int>(plan.computed_experts()), static_cast<int>(plan.total_rows(c))};
}

void ExpertParallelGpu::experts_forward(int c, const ExpertParallelGpuWeights& weights, cudaStream_t stream) {
  const auto [chunk, D, H, E_c, rows] = chunk_work(c);
  if (chunk == nullptr) return;
  cuda::permute_tokens(expert_view(c), chunk->received.data(), chunk->permuted_x, D, stream);
  if (config_.formulation == Formulation::dropless) {
    const cuda::BlockSparseFfnOutputs outputs{chunk->pre_activation.data(), nullptr, chunk->hidden,
                                              chunk->expert_out};
    cuda::block_sparse_ffn_forward(local_experts_config_, chunk->topology->topology(),
                                   cuda::ExpertRows(chunk->permuted_x), weights.w1, weights.w2, outputs, stream);
  } else {
    // E_c products [C_c, D] x [D, H_c], GeLU, E_c products [C_c, H_c] x [H_c, D] (MoeLayerGpu's padded path).
    const int C = static_cast<int>(plan_->padded_rows(c));
    cublas_->set_stream(stream);
    cuda::gemm_batched(cublas_->get(), cuda::Op::none, cuda::Op::none, C, H, D, chunk->x_rows.data(), D, weights.w1,
                       H, chunk->pre_rows.data(), H, E_c);
    cuda::gelu_forward(chunk->pre_activation.data(), chunk->hidden, static_cast<size_t>(rows) * H, stream);
    cuda::gemm_batched(cublas_->get(), cuda::Op::none, cuda::Op::none, C, D, H, chunk->hidden_rows.data(), H,
                       weights.w2, D, chunk->out_rows.data(), D, E_c);
  }
  scatter_rows(chunk->row_slot.data(), chunk->expert_out, chunk->sent_back.data(), rows, D, stream);
}

void ExpertParallelGpu::experts_backward(int c, const ExpertParallelGpuWeights& weights,
                                         const ExpertParallelGpuGradients& gradients, bool first_with_rows,
                                         cudaStream_t stream) {
  const auto [chunk, D, H, E_c, rows] = chunk_work(c);
  if (chunk == nullptr) return;
  // d(expert outputs) in expert order, padding rows zero, into expert_out (the forward's values of
  // it are no longer needed: the combine's backward used the copies that went home).
  cuda::permute_tokens(expert_view(c), chunk->received.data(), chunk->expert_out, D, stream);
  if (config_.formulation == Formulation::dropless) {
    // The data gradients alone (d_pre, and the input rows' gradients that go home); the weight
    // gradients come once over every chunk's rows (expert_weight_gradients).
    const cuda::BlockSparseFfnOutputs forward{chunk->pre_activation.data(), nullptr, chunk->hidden, nullptr};
    cuda::BlockSparseFfnGradients out;
    out.d_pre_activation = chunk->d_pre_activation;
    out.d_permuted_x = chunk->d_permuted_x.data();
    cuda::block_sparse_ffn_backward(local_experts_config_, chunk->topology->topology(), chunk->permuted_x,
                                    weights.w1, weights.w2, forward, chunk->expert_out, out, stream);
  } else {
    // Per expert over its C_c rows (padding rows carry zero gradient); cuBLAS accumulates the weight
    // gradients of later chunks itself (beta = 1).
    //   dh = d_out W2ᵀ,  d_pre = dh * gelu'(pre),  dW2 += hiddenᵀ d_out,  dW1 += xᵀ d_pre,  dx = d_pre W1ᵀ
    const int C = static_cast<int>(plan_->padded_rows(c));
    const float beta = first_with_rows ? 0.0f : 1.0f;
    cublas_->set_stream(stream);
    cuda::gemm_batched(cublas_->get(), cuda::Op::none, cuda::Op::transpose, C, H, D, chunk->out_rows.data(), D,
                       weights.w2, D, chunk->d_hidden_rows.data(), H, E_c);
    cuda::gelu_backward(chunk->pre_activation.data(), chunk->d_hidden.data(), chunk->d_pre_activation,
                        static_cast<size_t>(rows) * H, stream);
    cuda::gemm_batched(cublas_->get(), cuda::Op::transpose, cuda::Op::none, H, D, C, chunk->hidden_rows.data(), H,
                       chunk->out_rows.data(), D, gradients.d_w2, D, E_c, beta);
    cuda::gemm_batched(cublas_->get(), cuda::Op::transpose, cuda::Op::none, D, H, C, chunk->x_rows.data(), D,
                       chunk->d_pre_rows.data(), H, gradients.d_w1, H, E_c, beta);
    cuda::gemm_batched(cublas_->get(), cuda::Op::none, cuda::Op::transpose, C, D, H, chunk->d_pre_rows.data(), H,
                       weights.w1, H, chunk->d_x_rows.data(), D, E_c);
  }
  scatter_rows(chunk->row_slot.data(), chunk->d_permuted_x.data(), chunk->sent_back.data(), rows, D, stream);
}

// Dropless: dW2_e = sum over the chunks of hidden_eᵀ d_out_e and dW1_e = sum of x_eᵀ d_pre_e, one
// DSᵀD and one DDS over every slot's rows (one slot: its own topology; several: the walk through
// all of them, MicroBatchTopology), so each tile reduces over all of an expert's rows and writes its
// gradient once, whatever d. Enqueued after the last chunk's data gradients, it runs while their
// rows travel home. Timed as the experts' work ("ep_experts").
void ExpertParallelGpu::expert_weight_gradients(const ExpertParallelGpuGradients& gradients, cudaStream_t stream) {
  if (options_.experts != ExpertCompute::ffn || config_.formulation != Formulation::dropless || slots_.count == 0) {
    return;
  }
  Phase phase(timer_, "ep_experts", stream);
  const int D = static_cast<int>(config_.model_dim), H = static_cast<int>(local_experts_config_.hidden_dim);
  cuda::DeviceTopology walk;
  if (slots_.count == 1) {
    for (const auto& chunk : chunks_) {
      if (chunk->slot == 0) walk = chunk->topology->topology();
    }
  } else {
    for (int c = 0; c < plan_->chunks(); ++c) {
      const Chunk& chunk = *chunks_[c];
      if (chunk.slot >= 0) slots_.walk->record(chunk.slot, expert_view(c), *chunk.topology, stream);
    }
    slots_.walk->build(stream);
    walk = slots_.walk->topology();
  }
  cuda::dsd_transposed(walk, slots_.hidden.data(), slots_.expert_out.data(), D, gradients.d_w2, D, stream);
  cuda::dds(walk, slots_.permuted_x.data(), D, slots_.d_pre_activation.data(), gradients.d_w1, H, 0, stream);
}

// ---- backward ----

void ExpertParallelGpu::backward(const bf16* x, const ExpertParallelGpuWeights& weights, const bf16* dy,
                                 const ExpertParallelGpuGradients& gradients, cudaStream_t stream) {
  backward_out(x, weights, dy, gradients, stream, /*bring_back=*/true);
  backward_back(stream, /*brought_back=*/true);
}

void ExpertParallelGpu::backward_experts(const bf16* x, const ExpertParallelGpuWeights& weights, const bf16* dy,
                                         const ExpertParallelGpuGradients& gradients, cudaStream_t stream) {
  backward_out(x, weights, dy, gradients, stream, /*bring_back=*/false);
}

void ExpertParallelGpu::backward_combine(cudaStream_t stream) {
  expect_stage(3, "backward_combine");
  backward_back(stream, /*brought_back=*/false);
}

void ExpertParallelGpu::backward_out(const bf16* x, const ExpertParallelGpuWeights& weights, const bf16* dy,
                                     const ExpertParallelGpuGradients& gradients, cudaStream_t stream,
                                     bool bring_back) {
  NvtxRange range("ep_backward_out");
  if (!forward_done_) {
    throw std::logic_error("ExpertParallelGpu::backward: call forward first (a failed forward does not count)");
  }
  expect_stage(0, "backward_experts");
  const ExchangePlan& plan = *plan_;
  const int64_t T_r = plan.local_tokens(), D = config_.model_dim;
  // The gradients the experts write: the caller's (r = 1), or those of the E_c experts this rank
  // computes (r != 1), summed onto the storing ranks after the exchange.
  ExpertParallelGpuGradients computed_gradients = gradients;
  if (layout_ != 1) {
    LayoutBuffers& b = layout_buffers();
    computed_gradients.d_w1 = b.d_w1.data();
    computed_gradients.d_w2 = b.d_w2.data();
  }
  const bool ffn = options_.experts == ExpertCompute::ffn;
  // A null pointer here is this rank's programming error; it is thrown before any collective, and
  // the peers then wait in the first exchange (unlike the forward, whose faults every rank sees).
  if (gradients.d_gate_weights == nullptr || (T_r > 0 && (x == nullptr || dy == nullptr || gradients.dx == nullptr ||
                                                          weights.gate_weights == nullptr)) ||
      (ffn && (weights.w1 == nullptr || weights.w2 == nullptr || gradients.d_w1 == nullptr ||
               gradients.d_w2 == nullptr))) {
    throw std::invalid_argument("ExpertParallelGpu::backward: x, dy, the weights and every gradient pointer must be "
                                "non-null");
  }
  const int64_t waits_before = exchange_->host_waits() + (hierarchical_ ? hierarchical_->host_waits() : 0);
  CUDA_CHECK(cudaEventRecord(step_events_[current_step_events_].backward_start, stream));
  // Shadowed experts: the stored ones' gradients into the caller's tables, the copies' into the layer's.
  if (shadowing()) computed_gradients = shadow_gradient_tables(gradients, stream);

  // ---- combine: d(rows sent) = w * dy, and d(combine weights) for the router ----
  if (T_r > 0) {
    Phase phase(timer_, "ep_combine_backward", stream);
    cuda::combine_backward(home_view(T_r), router_.combine_weights.data(), dy, returned_.data(), d_send_.data(),
                           d_combine_weights_.data(), static_cast<int>(D), stream);
  }

  // ---- the experts, chunk after chunk; their weight gradients stay here ----
  int first_with_rows = -1;
  for (int c = 0; c < plan.chunks() && first_with_rows < 0; ++c) {
    if (plan.rows_received(c) > 0) first_with_rows = c;
  }
  // (r = 1: the caller's weights; r != 1: those the forward gathered, still in the layout's buffers.)
  const ExpertParallelGpuWeights& computing = layout_ == 1 && !shadowing() ? weights : computed_weights_;
  const bool partial = plan.copies() > 1;  // r > 1: the r partial dx rows of each slot come back apart
  pipeline_out(d_send_.data(), partial ? partials_.data() : returned_dx_.data(), stream, bring_back,
               [&](int c) { experts_backward(c, computing, computed_gradients, c == first_with_rows, stream); });
  expert_weight_gradients(computed_gradients, stream);
  staged_ = Staged{};
  staged_.stage = 3;
  staged_.x = x;
  staged_.weights = weights;
  staged_.gradients = gradients;
  staged_.computed_gradients = computed_gradients;
  staged_.first_with_rows = first_with_rows;
  staged_.waits_before = waits_before;
}

void ExpertParallelGpu::backward_back(cudaStream_t stream, bool brought_back) {
  NvtxRange range("ep_backward_back");
  const Staged staged = staged_;
  staged_ = Staged{};
  const bf16* const x = staged.x;
  const ExpertParallelGpuWeights& weights = staged.weights;
  const ExpertParallelGpuGradients& gradients = staged.gradients;
  const ExpertParallelGpuGradients& computed_gradients = staged.computed_gradients;
  const int first_with_rows = staged.first_with_rows;
  const int64_t waits_before = staged.waits_before;
  const ExchangePlan& plan = *plan_;
  const int64_t T_r = plan.local_tokens(), E = config_.num_experts, K = config_.top_k, D = config_.model_dim;
  const int64_t E_c = plan.computed_experts(), H_c = local_experts_config_.hidden_dim;
  const bool ffn = options_.experts == ExpertCompute::ffn;
  const bool partial = plan.copies() > 1;
  pipeline_back(partial ? partials_.data() : returned_dx_.data(), stream, brought_back);
  if (partial) sum_partials(returned_dx_.data(), stream);
  if (ffn && first_with_rows < 0) {  // no row reached this rank's experts: their gradients are zero
    zero_through_tables(computed_gradients.d_w1, static_cast<int>(E_c), static_cast<size_t>(D) * H_c, stream);
    zero_through_tables(computed_gradients.d_w2, static_cast<int>(E_c), static_cast<size_t>(H_c) * D, stream);
  }
  return_expert_gradients(gradients, stream);  // r != 1: onto the storing ranks
  return_shadow_gradients(stream);  // the shadowed experts' copies: onto the storing ranks
  if (ffn && layout_ == 1 && options_.sum_replica_gradients) sum_over_replicas(gradients, stream);

  // ---- un-gather and the router ----
  if (T_r > 0) {
    Phase phase(timer_, "ep_router_backward", stream);
    const int T = static_cast<int>(T_r);
    cuda::permute_backward(home_view(T_r), returned_dx_.data(), gradients.dx, static_cast<int>(D),
                           /*accumulate=*/false, stream);
    // router_backward divides the losses' terms by its token count; the losses are over all T
    // tokens, so the coefficients are scaled by T_r / T.
    const double share = static_cast<double>(T_r) / static_cast<double>(plan.tokens());
    const float* global_fraction = reinterpret_cast<const float*>(tables_->at(tables_->global_fraction));
    cuda::router_backward(router_.probs.data(), router_.logsumexp.data(), router_.top_experts.data(),
                          d_combine_weights_.data(), global_fraction, d_logits_.data(), T, static_cast<int>(E),
                          static_cast<int>(K), config_.renormalize, config_.aux_loss_coef * share,
                          config_.z_loss_coef * share, stream);
    // d_logits in bf16 for the tensor-core GEMMs, as MoeLayerGpu does.
    cuda::float_to_bf16(d_logits_.data(), d_logits_bf16_.data(), static_cast<size_t>(T_r * E), stream);
    cublas_->set_stream(stream);
    // d_gate_weights [D, E] = xᵀ [D, T_r] d_logits [T_r, E];  dx [T_r, D] += d_logits Wgᵀ
    cuda::gemm(cublas_->get(), cuda::Op::transpose, cuda::Op::none, static_cast<int>(D), static_cast<int>(E), T, x,
               static_cast<int>(D), d_logits_bf16_.data(), static_cast<int>(E), gradients.d_gate_weights,
               static_cast<int>(E), 1.0f, 0.0f, /*c_is_float=*/true);
    cuda::gemm(cublas_->get(), cuda::Op::none, cuda::Op::transpose, T, static_cast<int>(D), static_cast<int>(E),
               d_logits_bf16_.data(), static_cast<int>(E), weights.gate_weights, static_cast<int>(E), gradients.dx,
               static_cast<int>(D), 1.0f, 1.0f, /*c_is_float=*/true);
  } else {
    CUDA_CHECK(cudaMemsetAsync(gradients.d_gate_weights, 0, static_cast<size_t>(D * E) * sizeof(float), stream));
  }
  if (options_.all_reduce_router_gradient) {
    Phase phase(timer_, "ep_router_all_reduce", stream);
    exchange_->all_reduce_sum(gradients.d_gate_weights, gradients.d_gate_weights, D * E, DataType::float32, stream);
  }
  CUDA_CHECK(cudaEventRecord(step_events_[current_step_events_].backward_end, stream));
  if (trial_step_pending_) trial_step_has_backward_ = true;
  step_.backward_host_synchronisations = static_cast<int>(
      exchange_->host_waits() + (hierarchical_ ? hierarchical_->host_waits() : 0) - waits_before);
}

}  // namespace moe::dist
