// variant_micro_batches.cpp: moe_bench --micro-batches M, the whole dropless layer over M
// micro-batches with one product for the expert weight gradients (gradient accumulation), beside
// the same micro-batches each with its own weight gradients, one batch of M*T tokens, and dense
// cuBLAS on M*T*K rows.
//   cmake --build build --target moe_bench
//   build/cuda/bench/moe_bench --micro-batches 4 --shapes 16384,1024,4096,64,1 --routing zipf
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/routing_counts.h"    // routing_counts, top_experts_from_counts
#include "core/gemm.h"               // CublasHandle
#include "expert_ffn_block_sparse.h" // layer_config
#include "expert_ffn_cublas.h"       // CublasFfn (dense_cublas)
#include "core/phase_timer.h"        // PhaseTimer
#include "moe/moe_layer.h"           // MoeLayerGpu, compacted_weight_gradient_bytes
#include "moe_bench_variants.h"      // run_micro_batches

namespace moe::bench {
namespace {

// ---------------------------------------------------------------------------------------------
// [SECTION] the layer over micro-batches (--micro-batches M)
// ---------------------------------------------------------------------------------------------
// Gradient accumulation (cuda/moe/moe_layer.h): M micro-batches of T tokens, each routed, run
// forward and backward (dx, the router) on its own, and the expert weight gradients computed once
// over all M*T*K rows (one DSᵀD and one DDS: MicroBatchTopology). Timed as the whole dropless layer
// (B = 128) through MoeLayerGpu: router, plan, topology, permute, experts, combine and their
// backward, so the work outside the expert FFN is in these times (lesson 03: 8-9% of the forward
// at D = 1024). The rows, all at M*T*K routed rows, the same useful FLOPs:
//   layer_micro_batches    M x (forward_micro_batch + backward_micro_batch), expert_weight_gradients
//   layer_micro_batches_compacted  the same with each expert's rows of all M micro-batches copied
//                          into one B-rounded layout before the weight gradients
//                          (set_compacted_weight_gradients): fewer padding rows multiplied, the
//                          copies paid; its weight gradients checked against the slot layout's, and
//                          one step's phases of either layout printed (the copies, the products)
//   layer_per_micro_batch  M x (forward + backward), each micro-batch writing its own weight
//                          gradients: accumulating without the one product (less the M-1 additions)
//   layer_one_batch        the layer on one batch of M*T tokens (where it fits): no micro-batches
//   dense_cublas           the dense expert FFN on M*T*K rows: the baseline of the ratios
// "forward" is the M forwards alone. Routing: the counts rule (uniform, zipf, captured) on each
// micro-batch's T tokens, every micro-batch routed alike, imposed on the layer's own router through
// its input: token t's first E features are zero but at its K experts (1, 1 - 1/(4K), ...), and the
// gate weights are 8 times an E x E identity above zero rows, so the router's top-K is the rule's
// (checked); the other features are uniform in [-1, 1). Needs D >= E. The router losses are off
// (their coefficients change no time). Checked first: the one product's dW1, dW2 (experts 0 and
// E-1) against the sum of the per-micro-batch backward's, dWg (summed over the micro-batches, as a
// trainer does) and dx micro-batch by micro-batch, and layer_one_batch's dx against the
// micro-batches'. The timed step leaves each micro-batch's dWg in one buffer (no sum: a trainer's
// addition over its parameters is not the layer's).
class MicroBatchBench {
 public:
  MicroBatchBench(const Shape& shape, Routing routing, moe::Activation activation, const Options& options,
                  moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report)
      : s_(shape), routing_(routing), activation_(activation), M_(options.micro_batches), options_(options),
        cublas_(cublas), stream_(stream), report_(report),
        W1_(w1_width(shape.H, activation)) {
    label_ = s_.name() + " M=" + std::to_string(M_) + " " + std::string(moe::bench::to_string(routing_)) + " " +
             std::string(moe::to_string(activation_));
    config_ = layer_config(s_, activation_, Formulation::dropless, 128);
    config_.aux_loss_coef = 0.0;
    config_.z_loss_coef = 0.0;
  }

  void run() {
    const std::vector<int> counts = moe::bench::routing_counts(
        int64_t(s_.T) * s_.K, s_.E, routing_,
        options_.captured ? options_.captured->tokens_per_expert : std::vector<double>{});
    top_experts_ = moe::bench::top_experts_from_counts(counts, s_.T, s_.K);
    std::printf("%s: max %d rows per expert in each of %d micro-batches (mean %.0f)\n", label_.c_str(),
                *std::max_element(counts.begin(), counts.end()), M_, double(s_.T) * s_.K / s_.E);
    if (s_.D < s_.E) {
      record_fact(label_ + " routing", false, "D < E: the routing cannot be imposed through the input");
      return;
    }
    const size_t tokens = size_t(M_) * s_.T, D = s_.D, E = s_.E, H = s_.H;
    const size_t inputs_bytes = tokens * D * (2 + 2 + 2 + 4) + E * D * (W1_ + H) * (2 + 4) + D * E * 6;
    if (!fits(inputs_bytes + size_t(moe::cuda::layer_memory_bytes(config_, M_)), label_ + " layer_micro_batches",
              report_)) {
      return;
    }
    inputs();
    moe::cuda::MoeLayerGpu layer(config_, M_);
    gathers_rows_ = layer.gathers_rows();
    if (!check(layer)) return;

    Measurement& one_product = add_measurement("layer_micro_batches");
    time_rows(one_product, [&] { forward_micro_batches(layer); }, [&] { step(layer); });
    compacted(layer);
    Measurement& per_micro_batch = add_measurement("layer_per_micro_batch");
    time_rows(per_micro_batch, [&] {
      for (int m = 0; m < M_; ++m) layer.forward(x_of(m), weights(), y_of(m), stream_);
    }, [&] {
      for (int m = 0; m < M_; ++m) {
        layer.forward(x_of(m), weights(), y_of(m), stream_);
        layer.backward(x_of(m), weights(), dy_of(m), gradients(m), stream_);
      }
    });
    one_batch();
    dense();
  }

 private:
  moe::cuda::MoeLayerWeights weights() const { return {gate_.data(), w1_table_.data(), w2_table_.data()}; }
  size_t rows_of(int m) const { return size_t(m) * s_.T * s_.D; }  // micro-batch m's first element of [M*T, D]
  const bf16* x_of(int m) const { return x_.data() + rows_of(m); }
  const bf16* dy_of(int m) const { return dy_.data() + rows_of(m); }
  bf16* y_of(int m) { return y_.data() + rows_of(m); }
  float* dx_of(int m) { return dx_.data() + rows_of(m); }
  moe::cuda::MoeLayerGradients gradients(int m) {
    return {dx_of(m), d_gate_.data(), d_w1_table_.data(), d_w2_table_.data()};
  }
  void forward_micro_batches(moe::cuda::MoeLayerGpu& layer) {
    for (int m = 0; m < M_; ++m) layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
  }

  void step(moe::cuda::MoeLayerGpu& layer) {
    for (int m = 0; m < M_; ++m) {
      layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
      layer.backward_micro_batch(m, x_of(m), weights(), dy_of(m), dx_of(m), d_gate_.data(), stream_);
    }
    layer.expert_weight_gradients(d_w1_table_.data(), d_w2_table_.data(), stream_);
  }

  // One step with a phase timer: the weight gradients' phases (the copies, the products), in ms.
  std::string weight_gradient_phases(moe::cuda::MoeLayerGpu& layer) {
    moe::cuda::PhaseTimer timer;
    layer.set_phase_timer(&timer);
    step(layer);
    layer.set_phase_timer(nullptr);
    std::string text;
    char item[96];
    for (const moe::cuda::TimedPhase& p : timer.collect()) {
      if (p.name != "compact_rows" && p.name != "expert_weight_gradients") continue;
      std::snprintf(item, sizeof item, "%s%s %.3f ms", text.empty() ? "" : ", ", p.name.c_str(), p.duration_us / 1e3);
      text += item;
    }
    return text;
  }

  // The step with compaction before the weight gradients, checked against the slot layout's first.
  void compacted(moe::cuda::MoeLayerGpu& layer) {
    if (!fits(size_t(moe::cuda::compacted_weight_gradient_bytes(config_, M_)), label_ + " compacted", report_)) return;
    const std::string slot_phases = weight_gradient_phases(layer);
    layer.set_compacted_weight_gradients(true);
    poison();
    step(layer);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const size_t w1_elements = size_t(s_.D) * W1_, w2_elements = size_t(s_.H) * s_.D;
    for (size_t i = 0; i < checked_experts_.size(); ++i) {
      const std::string e = std::to_string(checked_experts_[i]);
      record_check(label_ + " dW1[" + e + "] compacted vs slots",
                   compare_floats(expert_slice(d_w1_.data(), checked_experts_[i], w1_elements), one_product_w1_[i]));
      record_check(label_ + " dW2[" + e + "] compacted vs slots",
                   compare_floats(expert_slice(d_w2_.data(), checked_experts_[i], w2_elements), one_product_w2_[i]));
    }
    const std::string compacted_phases = weight_gradient_phases(layer);
    record_fact(label_ + " weight-gradient phases, one step", true,
                "slots: " + slot_phases + "; compacted: " + compacted_phases);
    std::printf("  weight gradients, one step: slots: %s; compacted: %s\n", slot_phases.c_str(),
                compacted_phases.c_str());
    Measurement& m = add_measurement("layer_micro_batches_compacted");
    time_rows(m, [&] { forward_micro_batches(layer); }, [&] { step(layer); });
    layer.set_compacted_weight_gradients(false);
  }

  // The routing-carrying x, the gate weights that read it, random dy and expert weights.
  void inputs() {
    const size_t tokens = size_t(M_) * s_.T, D = s_.D, E = s_.E, H = s_.H, K = s_.K;
    std::vector<bf16> x(tokens * D), gate(D * E, __float2bfloat16(0.0f));
    const uint64_t key = splitmix64(options_.seed + 11);
    for (size_t i = 0; i < tokens; ++i) {
      const size_t t = i % size_t(s_.T);
      for (size_t d = 0; d < D; ++d) {
        const float unit = static_cast<float>(splitmix64(key ^ (i * D + d)) >> 40) * 0x1p-24f;
        x[i * D + d] = __float2bfloat16(d < E ? 0.0f : 2.0f * unit - 1.0f);
      }
      for (size_t k = 0; k < K; ++k) {
        x[i * D + size_t(top_experts_[t * K + k])] = __float2bfloat16(1.0f - 0.25f * float(k) / float(K));
      }
    }
    for (size_t e = 0; e < E; ++e) gate[e * E + e] = __float2bfloat16(8.0f);  // Wg [D, E]: row d = e
    x_ = DeviceBuffer<bf16>(x);
    gate_ = DeviceBuffer<bf16>(gate);
    dy_ = DeviceBuffer<bf16>(tokens * D);
    w1_ = DeviceBuffer<bf16>(E * D * W1_);
    w2_ = DeviceBuffer<bf16>(E * H * D);
    fill_uniform(dy_, 1.0f, options_.seed + 12);
    fill_uniform(w1_, 1.0f / std::sqrt(float(D)), options_.seed + 13);
    fill_uniform(w2_, 1.0f / std::sqrt(float(H)), options_.seed + 14);
    w1_table_ = moe::cuda::expert_pointer_table<const bf16>(w1_.data(), int(E), D * W1_);
    w2_table_ = moe::cuda::expert_pointer_table<const bf16>(w2_.data(), int(E), H * D);
    y_ = DeviceBuffer<bf16>(tokens * D);
    dx_ = DeviceBuffer<float>(tokens * D);
    d_gate_ = DeviceBuffer<float>(D * E);
    d_w1_ = DeviceBuffer<float>(E * D * W1_);
    d_w2_ = DeviceBuffer<float>(E * H * D);
    d_w1_table_ = moe::cuda::expert_pointer_table(d_w1_.data(), int(E), D * W1_);
    d_w2_table_ = moe::cuda::expert_pointer_table(d_w2_.data(), int(E), H * D);
  }

  void poison() {
    for (auto* buffer : {&dx_, &d_gate_, &d_w1_, &d_w2_}) buffer->fill_bytes(0xFF, stream_);
    y_.fill_bytes(0xFF, stream_);
  }

  // The one product against the per-micro-batch backward, summed on the host; the routing first.
  bool check(moe::cuda::MoeLayerGpu& layer) {
    const size_t D = s_.D, E = s_.E, K = s_.K, w1_elements = D * W1_, w2_elements = size_t(s_.H) * D;
    const std::vector<int> experts = E > 1 ? std::vector<int>{0, int(E) - 1} : std::vector<int>{0};
    poison();
    int64_t flips = 0;
    std::vector<float> one_product_gate(D * E, 0.0f);  // each micro-batch's router gradient, summed
    for (int m = 0; m < M_; ++m) {
      layer.forward_micro_batch(m, x_of(m), weights(), y_of(m), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<int> top = layer.top_experts().download();
      for (size_t i = 0; i < size_t(s_.T) * K; ++i) flips += top[i] != top_experts_[i];
      layer.backward_micro_batch(m, x_of(m), weights(), dy_of(m), dx_of(m), d_gate_.data(), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<float> gate = d_gate_.download();
      for (size_t i = 0; i < gate.size(); ++i) one_product_gate[i] += gate[i];
    }
    layer.expert_weight_gradients(d_w1_table_.data(), d_w2_table_.data(), stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    record_fact(label_ + " layer routing is the counts rule", flips == 0,
                std::to_string(flips) + " slots of " + std::to_string(int64_t(M_) * s_.T * s_.K) + " differ");
    if (flips != 0) return false;
    one_product_dx_ = dx_.download();
    checked_experts_ = experts;
    std::vector<std::vector<float>>& one_product_w1 = one_product_w1_;
    std::vector<std::vector<float>>& one_product_w2 = one_product_w2_;
    for (int e : experts) {
      one_product_w1.push_back(expert_slice(d_w1_.data(), e, w1_elements));
      one_product_w2.push_back(expert_slice(d_w2_.data(), e, w2_elements));
    }
    // The same micro-batches, each with its own weight gradients, summed here in double.
    poison();
    std::vector<double> gate_sum(D * E, 0.0);
    std::vector<std::vector<double>> w1_sum(experts.size(), std::vector<double>(w1_elements, 0.0)),
        w2_sum(experts.size(), std::vector<double>(w2_elements, 0.0));
    for (int m = 0; m < M_; ++m) {
      layer.forward(x_of(m), weights(), y_of(m), stream_);
      layer.backward(x_of(m), weights(), dy_of(m), gradients(m), stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      const std::vector<float> gate = d_gate_.download();
      for (size_t i = 0; i < gate.size(); ++i) gate_sum[i] += gate[i];
      for (size_t i = 0; i < experts.size(); ++i) {
        const std::vector<float> w1 = expert_slice(d_w1_.data(), experts[i], w1_elements);
        const std::vector<float> w2 = expert_slice(d_w2_.data(), experts[i], w2_elements);
        for (size_t j = 0; j < w1_elements; ++j) w1_sum[i][j] += w1[j];
        for (size_t j = 0; j < w2_elements; ++j) w2_sum[i][j] += w2[j];
      }
    }
    auto compare = [](const std::vector<float>& candidate, const std::vector<double>& reference) {
      Difference d;
      for (size_t i = 0; i < reference.size(); ++i) d.add(candidate[i], reference[i]);
      return d;
    };
    record_check(label_ + " dWg one product vs per micro-batch, summed", compare(one_product_gate, gate_sum));
    for (size_t i = 0; i < experts.size(); ++i) {
      const std::string e = std::to_string(experts[i]);
      record_check(label_ + " dW1[" + e + "] one product vs per micro-batch, summed",
                   compare(one_product_w1[i], w1_sum[i]));
      record_check(label_ + " dW2[" + e + "] one product vs per micro-batch, summed",
                   compare(one_product_w2[i], w2_sum[i]));
    }
    record_check(label_ + " dx micro-batches vs per micro-batch", compare_floats(one_product_dx_, dx_.download()));
    return std::all_of(recorded_checks().end() - (2 + 2 * experts.size()), recorded_checks().end(), [](const Check& c) { return c.pass; });
  }

  Measurement& add_measurement(const std::string& formulation) {
    Measurement m;
    m.shape = s_;
    m.routing = routing_;
    m.activation = activation_;
    m.formulation = formulation;
    m.micro_batches = M_;
    m.block_size = formulation == "dense_cublas" ? 0 : 128;
    m.gathers_rows = formulation != "dense_cublas" && gathers_rows_;
    m.useful_rows = m.computed_rows = int64_t(M_) * s_.T * s_.K;
    m.dropped_fraction = 0;
    report_.measurements.push_back(m);
    return report_.measurements.back();
  }

  // As RoutingBench::time_forward_backward: each phase announced as it starts (power_trace.py).
  void time_rows(Measurement& m, const std::function<void()>& forward, const std::function<void()>& step) {
    announce_timing(m.formulation, "forward");
    m.forward = time_work(stream_, options_, forward);
    announce_timing(m.formulation, "forward+backward");
    m.forward_backward = time_work(stream_, options_, step);
    std::printf("  time  %-22s forward %8.3f ms   forward+backward %8.3f ms   (%d micro-batches)\n",
                m.formulation.c_str(), m.forward.median_ms, m.forward_backward.median_ms, M_);
    std::fflush(stdout);
  }

  // The layer on one batch of all M*T tokens (routed alike: the micro-batches side by side).
  void one_batch() {
    MoeConfig whole = config_;
    whole.tokens = int64_t(M_) * s_.T;
    if (!fits(size_t(moe::cuda::layer_memory_bytes(whole)), label_ + " layer_one_batch", report_)) return;
    moe::cuda::MoeLayerGpu layer(whole);
    const moe::cuda::MoeLayerGradients g = gradients(0);  // [M*T, D] from row 0
    poison();
    layer.forward(x_.data(), weights(), y_.data(), stream_);
    layer.backward(x_.data(), weights(), dy_.data(), g, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    record_check(label_ + " dx one batch vs micro-batches", compare_floats(dx_.download(), one_product_dx_));
    Measurement& m = add_measurement("layer_one_batch");
    time_rows(m, [&] { layer.forward(x_.data(), weights(), y_.data(), stream_); }, [&] {
      layer.forward(x_.data(), weights(), y_.data(), stream_);
      layer.backward(x_.data(), weights(), dy_.data(), g, stream_);
    });
  }

  // Dense cuBLAS on M*T*K rows, expert 0's weights for every row (checked in the formulations table).
  void dense() {
    const size_t rows = size_t(M_) * s_.T * s_.K;
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, activation_, 1), label_ + " dense_cublas", report_)) return;
    CublasFfn f(rows, s_.D, s_.H, activation_, ExpertGroups{{0}, {int(rows)}, {0}}, w1_.data(), w2_.data(), 1);
    fill_uniform(f.x, 1.0f, options_.seed + 15);
    fill_uniform(f.d_out, 1.0f, options_.seed + 16);
    cublasHandle_t h = cublas_.get();
    Measurement& m = add_measurement("dense_cublas");
    time_rows(m, [&] { cublas_ffn_forward(h, CublasKind::dense, f, stream_); }, [&] {
      cublas_ffn_forward(h, CublasKind::dense, f, stream_);
      cublas_ffn_backward(h, CublasKind::dense, f, stream_);
    });
  }

  Shape s_;
  Routing routing_;
  moe::Activation activation_;
  int M_;
  const Options& options_;
  moe::cuda::CublasHandle& cublas_;
  cudaStream_t stream_;
  Report& report_;
  size_t W1_;
  std::string label_;
  MoeConfig config_;
  bool gathers_rows_ = false;
  std::vector<int32_t> top_experts_;  // [T, K] every micro-batch's routing
  DeviceBuffer<bf16> x_, dy_, y_, gate_, w1_, w2_;  // [M*T, D] x3, [D, E], [E, D, W1], [E, H, D]
  DeviceBuffer<const bf16*> w1_table_, w2_table_;
  DeviceBuffer<float> dx_, d_gate_, d_w1_, d_w2_;  // [M*T, D], [D, E], [E, D, W1], [E, H, D]
  DeviceBuffer<float*> d_w1_table_, d_w2_table_;
  std::vector<float> one_product_dx_;  // [M*T, D] from the check
  std::vector<int> checked_experts_;   // 0 and E-1
  std::vector<std::vector<float>> one_product_w1_, one_product_w2_;  // their dW1, dW2 from the check
};

}  // namespace

void run_micro_batches(const Shape& shape, Routing routing, moe::Activation activation, const Options& options,
                       moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report) {
  MicroBatchBench(shape, routing, activation, options, cublas, stream, report).run();
}

}  // namespace moe::bench
