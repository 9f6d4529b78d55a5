// variant_layer.cpp: ep_bench's layer rows: the expert-parallel layer's training step (forward,
// backward, SGD on this rank's experts, as Tutel's benchmark times it), at one pipelining degree
// each (Tutel's d). The SGD runs at learning rate 0: it reads and writes every expert weight and
// gradient as a real step does, and leaves the weights, so every timed run checks the same layer. The shape is --layer (by default: T_r = 16384
// tokens a rank, D = 2048, H = 8192, E = 32, K = 2, dropless, B = 128), scaled down where ranks
// share a GPU or the memory estimate does not fit. size = the bytes a rank dispatches (T_r K D 2);
// a step moves them four times (tokens out and back, gradients out and back): bytes moved = 4 size,
// so algbw here is an effective exchange rate of the whole step, not of a collective.
// Checked against the single-GPU layer (MoeLayerGpu) on all R T_r tokens, computed once on every
// rank before the timing (where it fits): the largest relative error of this rank's y and dx.
// The adaptive row (pipeline_chunks = kAdaptivePipelineChunks) runs the layer's own trials in
// prepare(), outside the timing, so that the timed runs are of the degree the layer chose. The
// layout rows (--layouts) run the same step in Tutel's layout r, over the same stored experts; r = 0
// moves weights instead of token rows, so bytes moved stays the token rows' 4 size as a common
// scale, and the time is what compares.
// Skewed routing (--zipf S), by the Gumbel-max trick: token t's features 1 .. E hold Gumbel(0, 1)
// draws g[t][e] and its feature 0 is 1; the router's row 0 is -S log(e + 1) and rows 1 .. E the
// identity. So logit[t][e] = -S log(e + 1) + g[t][e] + the random rest (small), and the top-K
// experts of a token are K draws without replacement from Zipf(S) over the E experts (nearly:
// the random features add a little noise). Needs D > E. The draws depend on the global token, so
// the check sees the same inputs.
// The placement rows (--placements) run the d = 1 step with the experts placed by load
// (common/expert_placement.h): EPLB with 1 or 2 spare slots a rank, planned from one plain step's
// counts, or the busiest expert shadowed; each slot holds its expert's weights (the same values as
// the plain rows'), so the check is the same. Each prints the rows every rank's experts computed.
// The overlap row (--overlap) runs the d = 1 step as two micro-batches of T_r / 2 tokens, each its
// own layer on its own stream, in the language model's schedule (cuda/model/model.cu) without its
// attention: both halves' routing with their counts sent; A's counts received (the host's wait),
// its rows out and its experts; the same for B (B's rows out under A's experts); A's rows back
// (under B's experts), B's; the backward the same way; then B's gradients added to A's (the model
// adds its second micro-batch's the same way) before the SGD. With nothing but the layer to run,
// A's rows out have only B's routing under them. Each half's router losses are its own statistics, as in the model, so y
// equals the plain step's and dx differs by the aux loss's share (checked within the same tolerance).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "bench_kernels.h"        // fill_uniform
#include "core/device_buffer.h"  // DeviceBuffer
#include "core/elementwise.h"    // add_in_place
#include "ep_bench_variants.h"
#include "ep/expert_parallel_gpu.h"  // ExpertParallelGpu
#include "moe/block_sparse.h"     // expert_pointer_table
#include "moe/moe_layer.h"        // MoeLayerGpu, layer_memory_bytes: the check
#include "expert_placement.h"  // contiguous_placement, eplb_placement

namespace moe::dist::bench {

// A rank's expert slots: each holds its expert's weights (the same values whichever rank holds it)
// and room for its gradients.
struct Slots {
  cuda::DeviceBuffer<bf16> w1, w2;                     // [slots, D, H], [slots, H, D]
  cuda::DeviceBuffer<const bf16*> w1_table, w2_table;  // [slots]
  cuda::DeviceBuffer<float> d_w1, d_w2;
  cuda::DeviceBuffer<float*> d_w1_table, d_w2_table;
};

struct LayerProblem {
  MoeConfig config;
  int64_t tokens_per_rank = 0, experts_per_rank = 0;
  cuda::DeviceBuffer<bf16> x, dy, gate, y;  // this rank's
  Slots slots;                              // its E_r experts
  cuda::DeviceBuffer<float> dx, d_gate;
  std::vector<float> reference_y, reference_dx;  // [T_r, D] this rank's rows of the single-GPU layer
  bool has_reference = false;
  std::string reference_note;
};

namespace {

// The seeds of each tensor: the same element gets the same value on every rank (bench_kernels.h).
enum Seed : uint64_t { kX = 21, kDy, kGate, kW1, kW2 };

// The slots of `experts` on this rank, each filled with its expert's weights (the elements of the
// whole [E, D, H] and [E, H, D] tensors the check uses).
Slots make_slots(BenchContext& ctx, const MoeConfig& c, const std::vector<int64_t>& experts) {
  const size_t n = experts.size(), w1_size = size_t(c.model_dim * c.hidden_dim), w2_size = w1_size;
  const uint64_t seed = ctx.options.seed;
  Slots slots;
  slots.w1 = cuda::DeviceBuffer<bf16>(n * w1_size);
  slots.w2 = cuda::DeviceBuffer<bf16>(n * w2_size);
  for (size_t j = 0; j < n; ++j) {
    const uint64_t e = static_cast<uint64_t>(experts[j]);
    fill_uniform(slots.w1.data() + j * w1_size, w1_size, seed + kW1, e * w1_size,
                 1.0f / std::sqrt(float(c.model_dim)), ctx.stream);
    fill_uniform(slots.w2.data() + j * w2_size, w2_size, seed + kW2, e * w2_size,
                 1.0f / std::sqrt(float(c.hidden_dim)), ctx.stream);
  }
  slots.w1_table = cuda::expert_pointer_table<const bf16>(slots.w1.data(), int(n), w1_size);
  slots.w2_table = cuda::expert_pointer_table<const bf16>(slots.w2.data(), int(n), w2_size);
  slots.d_w1 = cuda::DeviceBuffer<float>(n * w1_size);
  slots.d_w2 = cuda::DeviceBuffer<float>(n * w2_size);
  slots.d_w1_table = cuda::expert_pointer_table(slots.d_w1.data(), int(n), w1_size);
  slots.d_w2_table = cuda::expert_pointer_table(slots.d_w2.data(), int(n), w2_size);
  return slots;
}

// The step's SGD on the experts (see the top of this file): timed, weights unchanged.
constexpr float kLearningRate = 0.0f;

MoeConfig layer_config(const LayerShape& shape, int64_t tokens_per_rank, int ranks) {
  MoeConfig c;
  c.tokens = tokens_per_rank * ranks;
  c.model_dim = shape.model_dim;
  c.hidden_dim = shape.hidden_dim;
  c.num_experts = shape.experts;
  c.top_k = shape.top_k;
  c.block_size = shape.block_size;
  c.formulation = shape.formulation;
  c.capacity_factor = shape.capacity_factor;
  c.renormalize = true;  // Tutel's normalised top-K gates
  c.aux_loss_coef = 0.01;
  return c;
}

// GPU memory of one rank's expert-parallel layer and inputs; the received rows counted at 2x an
// even share (routing imbalance, the buffers' headroom, the topology's bound of B - 1 rows an expert),
// and 2.5x that where the adaptive trials keep every candidate's chunk buffers (chunk 0 at d = 1's
// size, chunk 1 at d = 2's half, chunks 2-3 at d = 4's quarters, chunks 4-7 at d = 8's eighths).
// The overlap row adds a second set of expert gradients (fp32). With the layout rows, r = 0's
// buffers on top: every expert gathered (bf16) and the gradients of all E experts (fp32) for their
// all-reduce, kept for the next call in that layout; r > 1 holds less.
double expert_parallel_bytes(const LayerShape& s, int64_t T_r, int ranks, bool pipelined, bool adaptive,
                             bool layouts, bool overlap) {
  const double D = s.model_dim, H = s.hidden_dim, E = s.experts, K = s.top_k, E_r = E / ranks;
  const double rows = 2.0 * T_r * K * (adaptive ? 2.5 : 1.0);
  const double home = 4.0 * T_r * K * D * 2 + T_r * E * 18.0 + T_r * D * 10.0;
  const double experts = rows * (5.0 * D * 2 + 4.0 * H * 2);
  // bf16, grads, scratch; the overlap row's second micro-batch's grads
  const double weights = E_r * 2 * D * H * (2.0 + 4.0 + (pipelined ? 4.0 : 0.0) + (overlap ? 4.0 : 0.0));
  const double gathered = layouts ? E * 2 * D * H * (2.0 + 4.0) : 0.0;             // r = 0: bf16, fp32 grads
  return home + experts + weights + gathered;
}

// GPU memory of the single-GPU check on all R T_r tokens.
double reference_bytes(const MoeConfig& all) {
  const double D = all.model_dim, H = all.hidden_dim, E = all.num_experts, T = all.tokens;
  return cuda::layer_memory_bytes(all) + E * 2 * D * H * (2.0 + 4.0) + T * D * 10.0;
}

// --zipf S (file comment): x [tokens, D] holds global tokens [first_token, first_token + tokens);
// its columns 0 .. E and the gate's rows 0 .. E [E + 1, E] are set.
void apply_zipf(bf16* x, int64_t first_token, int64_t tokens, int64_t D, bf16* gate, int64_t E, double s,
                uint64_t seed, cudaStream_t stream) {
  if (s <= 0) return;
  if (D <= E) throw std::invalid_argument("--zipf needs D > E (a feature a Gumbel draw for each expert)");
  const size_t width = static_cast<size_t>(E + 1);
  std::vector<float> features(static_cast<size_t>(tokens) * width);
  for (int64_t t = 0; t < tokens; ++t) {
    features[static_cast<size_t>(t) * width] = 1.0f;
    for (int64_t e = 0; e < E; ++e) {  // splitmix64 of (seed, global token, expert) -> u in (0, 1)
      uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>((first_token + t) * E + e) + 1;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      const double u = (static_cast<double>(z >> 11) + 0.5) / 9007199254740992.0;  // 2^53
      features[static_cast<size_t>(t) * width + 1 + static_cast<size_t>(e)] = static_cast<float>(-std::log(-std::log(u)));
    }
  }
  const std::vector<bf16> x_columns = cuda::to_bf16(features);
  CUDA_CHECK(cudaMemcpy2DAsync(x, static_cast<size_t>(D) * sizeof(bf16), x_columns.data(), width * sizeof(bf16),
                               width * sizeof(bf16), static_cast<size_t>(tokens), cudaMemcpyHostToDevice, stream));
  std::vector<float> rows(width * static_cast<size_t>(E), 0.0f);  // [E + 1, E]
  for (int64_t e = 0; e < E; ++e) {
    rows[static_cast<size_t>(e)] = static_cast<float>(-s * std::log(double(e + 1)));
    rows[static_cast<size_t>((1 + e) * E + e)] = 1.0f;
  }
  const std::vector<bf16> gate_rows = cuda::to_bf16(rows);
  CUDA_CHECK(cudaMemcpyAsync(gate, gate_rows.data(), gate_rows.size() * sizeof(bf16), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the host vectors go out of scope
}

// The single-GPU layer on every rank's tokens: this rank's rows of y and dx.
void compute_reference(BenchContext& ctx, LayerProblem& p) {
  const MoeConfig& c = p.config;
  const int64_t T = c.tokens, D = c.model_dim, H = c.hidden_dim, E = c.num_experts, T_r = p.tokens_per_rank;
  const uint64_t seed = ctx.options.seed;
  cudaStream_t stream = ctx.stream;
  cuda::DeviceBuffer<bf16> x(size_t(T * D)), dy(size_t(T * D)), y(size_t(T * D)), gate(size_t(D * E));
  cuda::DeviceBuffer<bf16> w1(size_t(E * D * H)), w2(size_t(E * H * D));
  fill_uniform(x.data(), x.size(), seed + kX, 0, 1.0f, stream);
  fill_uniform(dy.data(), dy.size(), seed + kDy, 0, 1.0f, stream);
  fill_uniform(gate.data(), gate.size(), seed + kGate, 0, 1.0f / std::sqrt(float(D)), stream);
  fill_uniform(w1.data(), w1.size(), seed + kW1, 0, 1.0f / std::sqrt(float(D)), stream);
  fill_uniform(w2.data(), w2.size(), seed + kW2, 0, 1.0f / std::sqrt(float(H)), stream);
  apply_zipf(x.data(), 0, T, D, gate.data(), E, ctx.options.zipf, seed, stream);
  auto w1_table = cuda::expert_pointer_table<const bf16>(w1.data(), int(E), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const bf16>(w2.data(), int(E), size_t(H * D));
  cuda::DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * H)), d_w2(size_t(E * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * H));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cuda::MoeLayerGpu layer(c);
  const cuda::MoeLayerWeights weights{gate.data(), w1_table.data(), w2_table.data()};
  layer.forward(x.data(), weights, y.data(), stream);
  layer.backward(x.data(), weights, dy.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                 stream);
  std::vector<bf16> y_rows(size_t(T_r * D));
  p.reference_dx.resize(size_t(T_r * D));
  const size_t first = size_t(ctx.rank * T_r * D);
  CUDA_CHECK(cudaMemcpyAsync(y_rows.data(), y.data() + first, y_rows.size() * sizeof(bf16), cudaMemcpyDeviceToHost,
                             stream));
  CUDA_CHECK(cudaMemcpyAsync(p.reference_dx.data(), dx.data() + first, p.reference_dx.size() * sizeof(float),
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  p.reference_y = cuda::to_float(y_rows);
  p.has_reference = true;
}

// ||got - expected|| / ||expected||.
double relative_error(const std::vector<float>& got, const std::vector<float>& expected) {
  double difference = 0, norm = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = double(got[i]) - double(expected[i]);
    difference += std::isfinite(d) ? d * d : 1e300;
    norm += double(expected[i]) * double(expected[i]);
  }
  return norm > 0 ? std::sqrt(difference / norm) : std::sqrt(difference);
}

// The overlap row's second micro-batch (the file comment): its layer over tokens [first, T_r), its
// stream, and its own expert and router gradients, added to the first's after the backward.
struct SecondMicroBatch {
  int64_t first = 0, tokens = 0;
  std::unique_ptr<ExpertParallelGpu> layer;
  cudaStream_t stream = nullptr;
  cudaEvent_t started = nullptr, finished = nullptr;
  cuda::DeviceBuffer<float> d_w1, d_w2, d_gate;
  cuda::DeviceBuffer<float*> d_w1_table, d_w2_table;
  SecondMicroBatch(BenchContext& ctx, const LayerProblem& p) {
    const MoeConfig& c = p.config;
    first = p.tokens_per_rank / 2;
    tokens = p.tokens_per_rank - first;
    MoeConfig half = c;
    half.tokens = tokens * ctx.ranks;
    layer = std::make_unique<ExpertParallelGpu>(ctx.layer, half, tokens);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&started, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&finished, cudaEventDisableTiming));
    const size_t n = static_cast<size_t>(p.experts_per_rank), w_size = size_t(c.model_dim * c.hidden_dim);
    d_w1 = cuda::DeviceBuffer<float>(n * w_size);
    d_w2 = cuda::DeviceBuffer<float>(n * w_size);
    d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(n), w_size);
    d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(n), w_size);
    d_gate = cuda::DeviceBuffer<float>(size_t(c.model_dim * c.num_experts));
  }
  ~SecondMicroBatch() {
    layer.reset();
    cudaEventDestroy(finished);
    cudaEventDestroy(started);
    cudaStreamDestroy(stream);
  }
  SecondMicroBatch(const SecondMicroBatch&) = delete;
  SecondMicroBatch& operator=(const SecondMicroBatch&) = delete;
};

// One row of the layer's step: at a pipelining degree, in a layout r, (placement not empty) at
// d = 1 with the experts placed by load, whose `note` receives the placement and the rows each
// rank's experts computed, or (overlap) at d = 1 as two overlapped micro-batches.
class LayerRow final : public Variant {
 public:
  LayerRow(BenchContext& ctx, std::shared_ptr<LayerProblem> problem, int chunks, std::shared_ptr<PipelineChoice> choice,
           int layout = -1, std::string placement = {}, std::shared_ptr<std::string> note = nullptr,
           bool overlap = false)
      : ctx_(ctx), problem_(std::move(problem)), chunks_(chunks), choice_(std::move(choice)), layout_(layout),
        placement_spec_(std::move(placement)), note_(std::move(note)), overlap_(overlap) {}
  std::string name() const override {
    if (overlap_) return "ep_layer d=1 overlap";
    if (!placement_spec_.empty()) return "ep_layer " + placement_spec_;
    if (layout_ >= 0) return "ep_layer r=" + std::to_string(layout_);
    return chunks_ == kAdaptivePipelineChunks ? "ep_layer adaptive" : "ep_layer d=" + std::to_string(chunks_);
  }
  std::vector<int64_t> sizes(const BenchOptions&) const override { return {bytes()}; }

  Prepared prepare(int64_t) override {
    if (!placement_spec_.empty()) {
      place_experts();
      return {bytes(), problem_->tokens_per_rank, "bf16", 4.0 * static_cast<double>(bytes())};
    }
    if (overlap_) {  // the first micro-batch is layer_, over tokens [0, T_r / 2)
      second_ = std::make_unique<SecondMicroBatch>(ctx_, *problem_);
      MoeConfig half = problem_->config;
      half.tokens = second_->first * ctx_.ranks;
      layer_ = std::make_unique<ExpertParallelGpu>(ctx_.layer, half, second_->first);
      return {bytes(), problem_->tokens_per_rank, "bf16", 4.0 * static_cast<double>(bytes())};
    }
    layer_ = std::make_unique<ExpertParallelGpu>(ctx_.layer, problem_->config, problem_->tokens_per_rank,
                                                 ExpertParallelGpuOptions{.pipeline_chunks = chunks_});
    if (layout_ >= 0) layer_->set_layout(layout_);
    if (chunks_ == kAdaptivePipelineChunks) {
      // Every candidate's trial steps, then one step more: its forward reads the last trial and
      // every rank agrees on d. The same number of steps on every rank.
      const int steps = static_cast<int>(kAdaptiveCandidates.size()) * kTrialStepsPerCandidate + 1;
      for (int step = 0; step < steps; ++step) run(ctx_.stream);
      CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    }
    return {bytes(), problem_->tokens_per_rank, "bf16", 4.0 * static_cast<double>(bytes())};
  }

  void run(cudaStream_t stream) override {
    LayerProblem& p = *problem_;
    Slots& slots = placement_spec_.empty() ? p.slots : slots_;  // the placement's own, or E / R in id order
    const ExpertParallelGpuWeights weights{p.gate.data(), slots.w1_table.data(), slots.w2_table.data()};
    if (second_) {
      run_overlapped(stream, weights);
    } else {
      layer_->forward(p.x.data(), p.tokens_per_rank, weights, p.y.data(), stream);
      layer_->backward(p.x.data(), weights, p.dy.data(),
                       {p.dx.data(), p.d_gate.data(), slots.d_w1_table.data(), slots.d_w2_table.data()}, stream);
    }
    if (timer_ != nullptr) timer_->begin("sgd_experts", stream);
    sgd_update(slots.w1.data(), slots.d_w1.data(), slots.w1.size(), kLearningRate, stream);
    sgd_update(slots.w2.data(), slots.d_w2.data(), slots.w2.size(), kLearningRate, stream);
    if (timer_ != nullptr) timer_->end(stream);
  }

  std::vector<PhaseTime> phases(cudaStream_t stream) override {
    cuda::PhaseTimer timer;
    timer_ = &timer;
    layer_->set_phase_timer(&timer);
    if (second_) {
      timer.name_stream(stream, kComputeRow);
      timer.name_stream(second_->stream, std::string(kComputeRow) + kSecondMicroBatchSuffix);
      second_->layer->set_phase_timer(&timer, std::string(kExchangeRow) + kSecondMicroBatchSuffix);
    }
    std::vector<PhaseTime> result = median_phases(timer, kPhaseRuns, [&] {
      ctx_.host.barrier();
      run(stream);
    });
    layer_->set_phase_timer(nullptr);
    if (second_) second_->layer->set_phase_timer(nullptr);
    timer_ = nullptr;
    return result;
  }

  Check check() override {
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    LayerProblem& p = *problem_;
    if (!p.has_reference) return {0, false, p.reference_note, false};
    const double y_error = relative_error(cuda::to_float(p.y.download()), p.reference_y);
    const double dx_error = relative_error(p.dx.download(), p.reference_dx);
    return {std::max(y_error, dx_error), false, {}, true};
  }

  int host_syncs() const override {
    int waits = 0;
    for (const ExpertParallelGpu* layer : {layer_.get(), second_ ? second_->layer.get() : nullptr}) {
      if (layer != nullptr) waits += layer->last_step().host_synchronisations + layer->last_step().backward_host_synchronisations;
    }
    return waits;
  }

  void release() override {
    if (choice_ && layer_) *choice_ = layer_->last_step().pipeline;
    layer_.reset();
    second_.reset();
    slots_ = Slots{};
  }

 private:
  // The overlap row's step: the language model's schedule of two micro-batches (the file comment;
  // cuda/model/model.cu, forward_phases and backward_phases), A = layer_ on `stream`, B = second_.
  void run_overlapped(cudaStream_t stream, const ExpertParallelGpuWeights& weights) {
    LayerProblem& p = *problem_;
    SecondMicroBatch& b = *second_;
    ExpertParallelGpu& a = *layer_;
    const int64_t D = p.config.model_dim, offset = b.first * D;
    cudaStream_t s = b.stream;
    CUDA_CHECK(cudaEventRecord(b.started, stream));  // B starts behind what `stream` has
    CUDA_CHECK(cudaStreamWaitEvent(s, b.started, 0));
    a.forward_send_counts(p.x.data(), b.first, weights, p.y.data(), stream);
    b.layer->forward_send_counts(p.x.data() + offset, b.tokens, weights, p.y.data() + offset, s);
    a.forward_receive_counts(stream);
    a.forward_experts(stream);
    b.layer->forward_receive_counts(s);
    b.layer->forward_experts(s);
    a.forward_combine(stream);
    b.layer->forward_combine(s);
    a.backward_experts(p.x.data(), weights, p.dy.data(),
                       {p.dx.data(), p.d_gate.data(), p.slots.d_w1_table.data(), p.slots.d_w2_table.data()}, stream);
    b.layer->backward_experts(p.x.data() + offset, weights, p.dy.data() + offset,
                              {p.dx.data() + offset, b.d_gate.data(), b.d_w1_table.data(), b.d_w2_table.data()}, s);
    a.backward_combine(stream);
    b.layer->backward_combine(s);
    CUDA_CHECK(cudaEventRecord(b.finished, s));
    CUDA_CHECK(cudaStreamWaitEvent(stream, b.finished, 0));
    if (timer_ != nullptr) timer_->begin("sum_micro_batch_gradients", stream);
    cuda::add_in_place(p.slots.d_w1.data(), b.d_w1.data(), b.d_w1.size(), stream);
    cuda::add_in_place(p.slots.d_w2.data(), b.d_w2.data(), b.d_w2.size(), stream);
    cuda::add_in_place(p.d_gate.data(), b.d_gate.data(), b.d_gate.size(), stream);
    if (timer_ != nullptr) timer_->end(stream);
  }

  // The placement row's setup: one plain step's routed counts (every rank gets the whole matrix),
  // the placement planned from them, this rank's slots with their experts' weights (the plain rows'
  // values), the layer, and one step whose rows per rank go in the note.
  void place_experts() {
    LayerProblem& p = *problem_;
    const MoeConfig& c = p.config;
    const int R = ctx_.ranks;
    const int64_t E = c.num_experts;
    std::vector<int64_t> routed;
    {
      ExpertParallelGpu plain(ctx_.layer, c, p.tokens_per_rank);
      const ExpertParallelGpuWeights weights{p.gate.data(), p.slots.w1_table.data(), p.slots.w2_table.data()};
      plain.forward(p.x.data(), p.tokens_per_rank, weights, p.y.data(), ctx_.stream);
      CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
      routed = plain.last_step().routed_per_rank_expert;
    }
    std::vector<double> load(static_cast<size_t>(E), 0.0);
    for (int s = 0; s < R; ++s) {
      for (int64_t e = 0; e < E; ++e) load[static_cast<size_t>(e)] += static_cast<double>(routed[s * E + e]);
    }
    const int64_t hottest = std::max_element(load.begin(), load.end()) - load.begin();
    const ExpertPlacement plain = contiguous_placement(E, R);
    placement_ = placement_spec_ == "eplb1"    ? eplb_placement(load, R, 1)
                 : placement_spec_ == "eplb2"  ? eplb_placement(load, R, 2)
                 : placement_spec_ == "shadow" ? plain.with_shadowed({hottest})
                                               : plain;
    slots_ = make_slots(ctx_, c, placement_.experts_of(ctx_.rank));
    layer_ = std::make_unique<ExpertParallelGpu>(
        ctx_.layer, c, p.tokens_per_rank,
        ExpertParallelGpuOptions{.placement = &placement_, .shadow_per_step = placement_spec_ == "shadow_step"});
    run(ctx_.stream);
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    const std::vector<int64_t> computed = all_gather<int64_t>(ctx_.host, layer_->plan().rows_received());
    double most = 0, sum = 0;
    std::string rows;
    for (int64_t n : computed) {
      most = std::max(most, double(n));
      sum += double(n);
      rows += (rows.empty() ? "" : " ") + std::to_string(n);
    }
    char line[160];
    std::snprintf(line, sizeof line, "%s: rows each rank's experts compute %s, max/mean %.3f; ", placement_spec_.c_str(),
                  rows.c_str(), most / (sum / double(R)));
    std::string note = std::string(line) + placement_.describe();
    if (placement_spec_ == "shadow_step") {
      std::string chosen;
      for (int64_t e : layer_->last_step().shadowed) chosen += (chosen.empty() ? "e" : " e") + std::to_string(e);
      note += "; shadowed in the step: " + (chosen.empty() ? std::string("none") : chosen) + " (" +
              std::to_string(layer_->last_step().weight_elements_sent) + " weights sent by rank " + std::to_string(ctx_.rank) + ")";
    }
    if (placement_spec_ == "shadow") {
      const std::vector<int64_t> worth = worth_shadowing(plain, routed, c.model_dim, c.hidden_dim, c.hidden_dim);
      note += "; shadowing e" + std::to_string(hottest) + " worth it by the bytes test: " +
              (std::find(worth.begin(), worth.end(), hottest) != worth.end() ? "yes" : "no");
    }
    if (note_) *note_ = note;
  }

  int64_t bytes() const {
    const MoeConfig& c = problem_->config;
    return problem_->tokens_per_rank * c.top_k * c.model_dim * 2;
  }

  BenchContext& ctx_;
  std::shared_ptr<LayerProblem> problem_;
  int chunks_;
  std::shared_ptr<PipelineChoice> choice_;
  int layout_ = -1;  // Tutel's r of a layout row (r = 1 included); -1 for the pipelining rows
  std::string placement_spec_;  // plain, eplb1, eplb2, shadow, shadow_step; empty for the other rows
  std::shared_ptr<std::string> note_;
  bool overlap_ = false;                    // the overlap row: second_ is its second micro-batch
  std::unique_ptr<SecondMicroBatch> second_;
  ExpertPlacement placement_;
  Slots slots_;  // the placement row's slots
  std::unique_ptr<ExpertParallelGpu> layer_;
  cuda::PhaseTimer* timer_ = nullptr;  // while phases() runs
};

}  // namespace

std::shared_ptr<LayerProblem> make_layer_problem(BenchContext& ctx, std::vector<std::string>& messages) {
  const LayerShape& shape = ctx.options.layer;
  const int R = ctx.ranks;
  const bool adaptive = ctx.options.adaptive;
  const bool pipelined = adaptive || std::any_of(ctx.options.pipeline_chunks.begin(),
                                                 ctx.options.pipeline_chunks.end(), [](int d) { return d > 1; });
  int64_t T_r = shape.tokens_per_rank;
  char line[512];
  if (ctx.ranks_per_gpu > 1) {
    // Ranks that share a GPU check correctness; they split one rank's tokens between them.
    T_r = std::max<int64_t>(128, T_r / ctx.ranks_per_gpu);
    std::snprintf(line, sizeof line, "%d ranks share this GPU: the layer rows run T=%lld tokens per rank (was %lld)",
                  ctx.ranks_per_gpu, static_cast<long long>(T_r), static_cast<long long>(shape.tokens_per_rank));
    messages.push_back(line);
  }
  auto needed = [&](int64_t tokens) {
    const double ep = expert_parallel_bytes(shape, tokens, R, pipelined, adaptive, ctx.options.layouts, ctx.options.overlap);
    const double reference = reference_bytes(layer_config(shape, tokens, R));
    return ctx.ranks_per_gpu * std::max(ep, reference);  // the check runs before the layer, not beside it
  };
  const int64_t before = T_r;
  while (T_r > 128 && needed(T_r) > 0.85 * ctx.gpu_memory_bytes) T_r /= 2;
  // Every rank must run the same T_r: the smallest any rank could afford.
  const std::vector<int64_t> all = all_gather<int64_t>(ctx.host, T_r);
  T_r = *std::min_element(all.begin(), all.end());
  if (T_r != before) {
    std::snprintf(line, sizeof line,
                  "the layer at T=%lld tokens per rank needs about %.1f GiB per GPU (%d rank(s) on it) of %.1f GiB: "
                  "scaled down to T=%lld",
                  static_cast<long long>(before), needed(before) / (1 << 30), ctx.ranks_per_gpu,
                  ctx.gpu_memory_bytes / (1 << 30), static_cast<long long>(T_r));
    messages.push_back(line);
  }

  auto p = std::make_shared<LayerProblem>();
  p->config = layer_config(shape, T_r, R);
  p->tokens_per_rank = T_r;
  p->experts_per_rank = shape.experts / R;
  const int64_t D = shape.model_dim, E = shape.experts;
  const uint64_t seed = ctx.options.seed;

  // The check first, alone on the GPU, then freed before the layer's buffers are made.
  try {
    compute_reference(ctx, *p);
  } catch (const std::exception& error) {  // too large for one GPU, or for the kernels' int32 indices
    (void)cudaGetLastError();                // an allocation failure is not sticky; clear it
    p->reference_note = std::string("no single-GPU check: ") + error.what();
    messages.push_back(p->reference_note);
  }

  cudaStream_t stream = ctx.stream;
  p->x = cuda::DeviceBuffer<bf16>(size_t(T_r * D));
  p->dy = cuda::DeviceBuffer<bf16>(size_t(T_r * D));
  p->y = cuda::DeviceBuffer<bf16>(size_t(T_r * D));
  p->gate = cuda::DeviceBuffer<bf16>(size_t(D * E));
  // This rank's slices of the tensors the check made whole: its tokens, its experts.
  fill_uniform(p->x.data(), p->x.size(), seed + kX, uint64_t(ctx.rank * T_r * D), 1.0f, stream);
  fill_uniform(p->dy.data(), p->dy.size(), seed + kDy, uint64_t(ctx.rank * T_r * D), 1.0f, stream);
  fill_uniform(p->gate.data(), p->gate.size(), seed + kGate, 0, 1.0f / std::sqrt(float(D)), stream);
  apply_zipf(p->x.data(), int64_t{ctx.rank} * T_r, T_r, D, p->gate.data(), E, ctx.options.zipf, seed, stream);
  p->slots = make_slots(ctx, p->config, contiguous_placement(E, R).experts_of(ctx.rank));
  p->dx = cuda::DeviceBuffer<float>(size_t(T_r * D));
  p->d_gate = cuda::DeviceBuffer<float>(size_t(D * E));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return p;
}

std::unique_ptr<Variant> make_layer_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem,
                                            int pipeline_chunks, std::shared_ptr<PipelineChoice> choice) {
  return std::make_unique<LayerRow>(ctx, std::move(problem), pipeline_chunks, std::move(choice));
}

std::unique_ptr<Variant> make_layout_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem, int layout) {
  return std::make_unique<LayerRow>(ctx, std::move(problem), 1, nullptr, layout);
}

std::unique_ptr<Variant> make_overlap_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem) {
  return std::make_unique<LayerRow>(ctx, std::move(problem), 1, nullptr, -1, std::string(), nullptr, /*overlap=*/true);
}

std::unique_ptr<Variant> make_placement_variant(BenchContext& ctx, std::shared_ptr<LayerProblem> problem,
                                                const std::string& placement, std::shared_ptr<std::string> note) {
  return std::make_unique<LayerRow>(ctx, std::move(problem), 1, nullptr, -1, placement, std::move(note));
}

LayerSummary layer_summary(const LayerProblem& p) {
  const MoeConfig& c = p.config;
  char line[256];
  std::snprintf(line, sizeof line, "T=%lld per rank (T=%lld in all), D=%lld, H=%lld, E=%lld (%lld a rank), K=%lld, %s",
                static_cast<long long>(p.tokens_per_rank), static_cast<long long>(c.tokens),
                static_cast<long long>(c.model_dim), static_cast<long long>(c.hidden_dim),
                static_cast<long long>(c.num_experts), static_cast<long long>(p.experts_per_rank),
                static_cast<long long>(c.top_k), std::string(to_string(c.formulation)).c_str());
  char rows[64];
  if (c.formulation == Formulation::dropless) std::snprintf(rows, sizeof rows, ", B=%lld", static_cast<long long>(c.block_size));
  else std::snprintf(rows, sizeof rows, ", capacity factor %.2f", c.capacity_factor);
  return {c, p.tokens_per_rank, std::string(line) + rows};
}

}  // namespace moe::dist::bench
