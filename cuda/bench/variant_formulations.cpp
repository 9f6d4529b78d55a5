// variant_formulations.cpp: moe_bench's formulations table for one shape, routing and activation:
// the expert FFN in every formulation (block-sparse at B = 128 and 64, grouped cuBLAS, padded,
// dropping at two capacity factors, dense cuBLAS), each checked against the grouped cuBLAS path
// (and, on small shapes, the CPU reference) before it is timed; the work outside the expert FFN
// (router, plan, topology, permute, combine) timed beside the block-sparse rows.
//   cmake --build build --target moe_bench && build/cuda/bench/moe_bench --shapes small
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
#include "expert_ffn.h"              // moe::ref::expert_ffn_forward (the CPU oracle)
#include "expert_ffn_block_sparse.h" // BlockSparseFfn, RouterBuffers, layer_config
#include "expert_ffn_cublas.h"       // CublasFfn, cublas_ffn_forward / backward
#include "moe/block_sparse.h"        // block_sparse_ffn_forward / backward
#include "moe/dispatch.h"            // build_dispatch_plan
#include "moe/permute.h"             // permute_tokens, unpermute_and_combine
#include "moe/router.h"              // router_logits, route_top_k, route_fused
#include "moe/topology.h"            // build_topology
#include "moe_bench_variants.h"      // run_formulations
#include "reference_cpu/dispatch.h"  // moe::ref::DispatchPlan (the CPU oracle's plan)

namespace moe::bench {
namespace {

class RoutingBench {
 public:
  RoutingBench(const Shape& shape, Routing routing, const ShapeInputs& in, const Options& options,
               moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report)
      : s_(shape), routing_(routing), in_(in), options_(options), cublas_(cublas), stream_(stream), report_(report) {
    counts_ = moe::bench::routing_counts(int64_t(s_.T) * s_.K, s_.E, routing_,
                                         options.captured ? options.captured->tokens_per_expert : std::vector<double>{});
    top_experts_host_ = moe::bench::top_experts_from_counts(counts_, s_.T, s_.K);
    top_experts_ = DeviceBuffer<int>(top_experts_host_);
    max_count_ = *std::max_element(counts_.begin(), counts_.end());
    label_ = s_.name() + " " + std::string(moe::bench::to_string(routing_)) + " " +
             std::string(moe::to_string(in_.activation));
  }

  void run() {
    std::printf("%s: max %d rows per expert (mean %.0f)\n", label_.c_str(), max_count_,
                double(s_.T) * s_.K / s_.E);
    guarded("grouped_cublas and dense_cublas", [&] { exact_rows(); });
    if (oracle_.out.empty()) return;  // nothing to compare the others with
    for (int B : {128, 64}) {
      guarded("block_sparse_B" + std::to_string(B), [&] { block_sparse(B); });
    }
    guarded("padded_max", [&] { capacity_path("padded_max", max_count_); });
    for (double cf : {1.0, 1.25}) {
      char name[32];
      std::snprintf(name, sizeof name, "dropping_cf%.2f", cf);
      guarded(name, [&] { capacity_path(name, int(moe::capacity(config(Formulation::padded, 1, cf)))); });
    }
  }

 private:
  // One formulation's section: an exception (a launcher's argument check, a CUDA or cuBLAS error)
  // becomes a failed check and the next formulation still runs.
  void guarded(const std::string& what, const std::function<void()>& section) {
    try {
      section();
    } catch (const std::exception& error) {
      record_fact(label_ + " " + what, false, std::string("threw: ") + error.what());
      (void)cudaGetLastError();  // clear a non-sticky error so the next section starts clean
    }
  }

  int64_t routed_rows() const { return int64_t(s_.T) * s_.K; }
  MoeConfig config(Formulation formulation, int block_size, double capacity_factor = 1.0) const {
    return layer_config(s_, in_.activation, formulation, block_size, capacity_factor);
  }
  size_t w1_elements() const { return size_t(s_.D) * in_.W1; }  // one expert's W1 [D, W1]
  size_t w2_elements() const { return size_t(s_.H) * s_.D; }    // one expert's W2 [H, D]

  Measurement& add_measurement(const std::string& formulation, int64_t computed_rows, int64_t useful_rows) {
    Measurement m;
    m.shape = s_;
    m.routing = routing_;
    m.activation = in_.activation;
    m.formulation = formulation;
    m.computed_rows = computed_rows;
    m.useful_rows = useful_rows;
    m.dropped_fraction = 1.0 - double(useful_rows) / double(routed_rows());
    report_.measurements.push_back(m);
    return report_.measurements.back();
  }

  // Each phase is announced as it starts ("timing NAME forward", then "timing NAME forward+backward";
  // the "time" line ends the second), flushed at once, so that a tool reading the output as it comes
  // knows what the GPU is running (cuda/bench/power_trace.py samples the clock and power beside it).
  void time_forward_backward(Measurement& m, const std::function<void()>& forward,
                             const std::function<void()>& backward) {
    announce_timing(m.formulation, "forward");
    m.forward = time_work(stream_, options_, forward);
    announce_timing(m.formulation, "forward+backward");
    m.forward_backward = time_work(stream_, options_, [&] {
      forward();
      backward();
    });
    std::printf("  time  %-20s forward %8.3f ms   forward+backward %8.3f ms\n", m.formulation.c_str(),
                m.forward.median_ms, m.forward_backward.median_ms);
    std::fflush(stdout);
    if (options_.kernel_trace) {
      trace(m, "forward", m.forward.median_ms, forward);
      trace(m, "forward+backward", m.forward_backward.median_ms, [&] {
        forward();
        backward();
      });
    }
  }

  // `repeat` runs of `work` back to back (the GPU is warm from the timing just done) under CUPTI.
  void trace(const Measurement& m, const char* phase, double timed_median_ms, const std::function<void()>& work) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    Trace t{s_, routing_, in_.activation, m.formulation, phase, timed_median_ms, {}};
    {
      moe::bench::KernelTrace tracer;
      for (int i = 0; i < options_.repeat; ++i) work();
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      t.summary = moe::bench::summarize_runs(tracer.take(), options_.repeat);
    }
    std::printf("  trace %-20s %-16s span %8.3f ms = kernels %8.3f + gaps %6.3f ms (%zu kernels a run)\n",
                m.formulation.c_str(), phase, t.summary.median_span_ms, t.summary.sum_kernels_ms,
                t.summary.sum_gaps_ms, t.summary.kernels.size());
    std::fflush(stdout);
    report_.traces.push_back(std::move(t));
  }

  std::vector<int> download_ints(const DeviceBuffer<int>& b) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return b.download();
  }

  // The plan the GPU built must hold the counts the host asked for.
  void check_plan(const std::string& what, const moe::cuda::DispatchPlanBuffers& plan, int64_t expected_dropped) {
    const std::vector<int> tokens_per_expert = download_ints(plan.tokens_per_expert);
    const std::vector<int> invalid = download_ints(plan.invalid_slots);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    const int64_t dropped = std::count(slot_row.begin(), slot_row.end(), -1);
    const bool ok = tokens_per_expert == counts_ && invalid[0] == 0 && dropped == expected_dropped;
    record_fact(label_ + " " + what + " GPU plan counts", ok,
                "invalid=" + std::to_string(invalid[0]) + " dropped=" + std::to_string(dropped) + "/" +
                    std::to_string(expected_dropped));
  }

  // -- grouped cuBLAS (the oracle of the other formulations) and dense cuBLAS, on exact rows --
  void exact_rows() {
    const size_t rows = size_t(routed_rows());
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, s_.E), label_ + " grouped_cublas", report_)) return;
    // A dropless plan with B = 1 lays the rows out expert after expert with no padding.
    moe::cuda::DispatchPlanBuffers plan(config(Formulation::dropless, 1));
    moe::cuda::build_dispatch_plan(top_experts_.data(), plan, stream_);
    check_plan("grouped_cublas", plan, 0);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    cublasHandle_t h = cublas_.get();
    // One forward and backward of f on the plan's rows of x and dy (its results poisoned first: an
    // unwritten one cannot pass), finished.
    auto run_once = [&](CublasFfn& f, CublasKind kind) {
      moe::cuda::permute_tokens(plan.plan(), in_.x.data(), f.x.data(), s_.D, stream_);
      moe::cuda::permute_tokens(plan.plan(), in_.dy.data(), f.d_out.data(), s_.D, stream_);
      f.poison_results();
      cublas_ffn_forward(h, kind, f, stream_);
      cublas_ffn_backward(h, kind, f, stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    };
    auto time_ffn = [&](const std::string& formulation, CublasFfn& f, CublasKind kind) {
      Measurement& m = add_measurement(formulation, routed_rows(), routed_rows());
      time_forward_backward(m, [&] { cublas_ffn_forward(h, kind, f, stream_); },
                            [&] { cublas_ffn_backward(h, kind, f, stream_); });
    };
    {
      CublasFfn f(rows, s_.D, s_.H, in_.activation, exact_groups(counts_), in_.w1.data(), in_.w2.data(), s_.E);
      run_once(f, CublasKind::grouped);
      oracle_.out = rows_by_slot(f.out.data(), rows, s_.D, slot_row);
      oracle_.dx = rows_by_slot(f.dx.data(), rows, s_.D, slot_row);
      for (int e : {0, s_.E - 1}) {
        if (counts_[e] == 0 || std::count(oracle_.checked_experts.begin(), oracle_.checked_experts.end(), e)) continue;
        oracle_.checked_experts.push_back(e);
        oracle_.dw1.push_back(expert_slice(f.dw1.data(), e, w1_elements()));
        oracle_.dw2.push_back(expert_slice(f.dw2.data(), e, w2_elements()));
      }
      // The oracle must at least be complete: every slot's row written with finite numbers.
      Difference finite;
      for (const bf16 v : oracle_.out) finite.add(to_float(v), 0.0);
      for (const bf16 v : oracle_.dx) finite.add(to_float(v), 0.0);
      record_fact(label_ + " grouped_cublas out, dx all written and finite", finite.not_finite == 0,
                  std::to_string(finite.not_finite) + " non-finite of " + std::to_string(finite.compared));
      if (finite.not_finite != 0) {
        oracle_ = Oracle{};
        return;
      }
      if (options_.selected("grouped_cublas")) time_ffn("grouped_cublas", f, CublasKind::grouped);
    }
    // Dense: expert 0's weights for every row, so its rows of expert 0 must equal the oracle's.
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, 1), label_ + " dense_cublas", report_)) return;
    ExpertGroups one{{0}, {int(rows)}, {0}};
    CublasFfn f(rows, s_.D, s_.H, in_.activation, one, in_.w1.data(), in_.w2.data(), 1);
    run_once(f, CublasKind::dense);
    std::vector<int> expert0_slots(slot_row.size(), -1);
    for (size_t slot = 0; slot < slot_row.size(); ++slot) {
      if (slot_row[slot] < counts_[0]) expert0_slots[slot] = slot_row[slot];
    }
    record_check(label_ + " dense_cublas out (expert 0 rows) vs grouped",
                 compare_slots(rows_by_slot(f.out.data(), rows, s_.D, expert0_slots), oracle_.out, s_.D, expert0_slots));
    record_check(label_ + " dense_cublas dx (expert 0 rows) vs grouped",
                 compare_slots(rows_by_slot(f.dx.data(), rows, s_.D, expert0_slots), oracle_.dx, s_.D, expert0_slots));
    time_ffn("dense_cublas", f, CublasKind::dense);
  }

  // Compares a formulation's out and dx (and weight gradients) with the oracle, slot by slot.
  template <typename WeightT>
  void compare_with_oracle(const std::string& name, const bf16* out, const bf16* dx, size_t max_rows,
                           const std::vector<int>& slot_row, const WeightT* dw1, const WeightT* dw2, bool weights) {
    record_check(label_ + " " + name + " out vs grouped",
                 compare_slots(rows_by_slot(out, max_rows, s_.D, slot_row), oracle_.out, s_.D, slot_row));
    record_check(label_ + " " + name + " dx vs grouped",
                 compare_slots(rows_by_slot(dx, max_rows, s_.D, slot_row), oracle_.dx, s_.D, slot_row));
    if (!weights) return;
    for (size_t i = 0; i < oracle_.checked_experts.size(); ++i) {
      const int e = oracle_.checked_experts[i];
      record_check(label_ + " " + name + " dW1[" + std::to_string(e) + "] vs grouped",
                   compare_floats(expert_slice(dw1, e, w1_elements()), oracle_.dw1[i]));
      record_check(label_ + " " + name + " dW2[" + std::to_string(e) + "] vs grouped",
                   compare_floats(expert_slice(dw2, e, w2_elements()), oracle_.dw2[i]));
    }
  }

  // -- dropless block-sparse (MegaBlocks) --
  void block_sparse(int B) {
    const std::string name = "block_sparse_B" + std::to_string(B);
    if (!options_.selected(name)) return;
    if (!fits(BlockSparseFfn::bytes(s_, in_.activation, B), label_ + " " + name, report_)) return;
    BlockSparseFfn f(config(Formulation::dropless, B));
    const moe::cuda::DevicePlan plan = f.plan.plan();
    const moe::cuda::DeviceTopology topology = f.topology.topology();
    moe::cuda::build_dispatch_plan(top_experts_.data(), f.plan, stream_);
    moe::cuda::build_topology(plan, f.topology, stream_);
    moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_);
    moe::cuda::permute_tokens(plan, in_.dy.data(), f.d_out.data(), s_.D, stream_);
    check_plan(name, f.plan, 0);
    f.out.fill_bytes(0xFF, stream_);
    f.dx.fill_bytes(0xFF, stream_);
    f.dw1.fill_bytes(0xFF, stream_);
    f.dw2.fill_bytes(0xFF, stream_);
    // What the layer runs: x's rows gathered by the forward's SDD where gathering pays (no permute
    // in the forward, so none in the routing overhead either; the backward then permutes x for its
    // DDS, and that permute is timed with the backward), else the permuted copy.
    const bool gathered =
        options_.rows == Options::Rows::layer      ? moe::cuda::gathering_pays(f.config)
        : options_.rows == Options::Rows::gathered ? moe::cuda::rows_gatherable(f.config)
                                                   : false;
    const moe::cuda::ExpertRows rows =
        gathered ? moe::cuda::ExpertRows::gathered(in_.x.data(), plan) : moe::cuda::ExpertRows(f.x.data());
    auto forward = [&] {
      moe::cuda::block_sparse_ffn_forward(f.config, topology, rows, in_.w1_of.data(), in_.w2_of.data(), f.outputs(),
                                          stream_);
    };
    auto backward = [&] {
      if (gathered) moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_);
      moe::cuda::block_sparse_ffn_backward(f.config, topology, f.x.data(), in_.w1_of.data(), in_.w2_of.data(),
                                           f.outputs(), f.d_out.data(), f.gradients(), stream_);
    };
    forward();
    backward();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::vector<int> slot_row = download_ints(f.plan.slot_row);
    const size_t max_rows = size_t(f.plan.max_rows());
    compare_with_oracle(name, f.out.data(), f.dx.data(), max_rows, slot_row, f.dw1.data(), f.dw2.data(), true);
    if (B == 128) cpu_oracle_check(name, f.out.data(), max_rows, slot_row);

    Measurement& m = add_measurement(name, -1, routed_rows());
    m.block_size = B;
    m.gathers_rows = gathered;  // and forward_backward_ms includes the backward's permute
    std::vector<int> total_rows = download_ints(f.plan.total_rows);
    m.computed_rows = total_rows[0];
    time_forward_backward(m, forward, backward);
    if (B == 128) routing_overhead(f, m.forward.median_ms, gathered);
  }

  // Everything of a forward layer step outside the expert FFN, with the real kernels: the router,
  // the plan, the topology, the permutation (unless the SDD gathers the rows, as the layer then runs
  // none) and the weighted un-permutation. The plan is built from
  // this bench's deterministic top_experts (so its sizes match the routing measured); the router
  // computes its losses from its own top_experts.
  void routing_overhead(BlockSparseFfn& f, double ffn_forward_ms, bool gathered) {
    if (!fits(size_t(s_.T) * (s_.D * 2 + s_.E * 8 + s_.K * 8) + size_t(s_.D) * s_.E * 2, label_ + " routing overhead",
              report_)) {
      return;
    }
    RouterBuffers r(s_);
    fill_uniform(r.gate_weights, 1.0f / std::sqrt(float(s_.D)), options_.seed + 5);
    const moe::cuda::DevicePlan plan = f.plan.plan();
    cublasHandle_t h = cublas_.get();
    std::vector<std::pair<std::string, std::function<void()>>> steps = {
        {"router_logits", [&] { moe::cuda::router_logits(h, in_.x.data(), r.gate_weights.data(), r.logits.data(), s_.T, s_.D, s_.E, stream_); }},
        {"route_top_k", [&] { moe::cuda::route_top_k(r.logits.data(), r.probs.data(), r.top_experts.data(), r.combine_weights.data(), r.logsumexp.data(), r.expert_fraction.data(), r.mean_probs.data(), r.aux_loss.data(), r.z_loss.data(), r.workspace, s_.T, s_.E, s_.K, false, stream_); }},
        {"build_dispatch_plan", [&] { moe::cuda::build_dispatch_plan(top_experts_.data(), f.plan, stream_); }},
        {"build_topology", [&] { moe::cuda::build_topology(plan, f.topology, stream_); }},
        {"permute_tokens", [&] { moe::cuda::permute_tokens(plan, in_.x.data(), f.x.data(), s_.D, stream_); }},
        {"unpermute_and_combine", [&] { moe::cuda::unpermute_and_combine(plan, r.combine_weights.data(), f.out.data(), r.y.data(), s_.D, stream_); }},
    };
    if (gathered) steps.erase(steps.begin() + 4);  // the SDD gathers the rows: the layer runs no permute
    Overhead o;
    o.shape = s_;
    o.routing = routing_;
    o.activation = in_.activation;
    for (const auto& [step, work] : steps) o.step_ms.emplace_back(step, time_work(stream_, options_, work).median_ms);
    o.total_ms = time_work(stream_, options_, [&] {
                   for (const auto& step : steps) step.second();
                 }).median_ms;
    o.ffn_forward_ms = ffn_forward_ms;
    o.share = o.total_ms / (o.total_ms + ffn_forward_ms);
    // Beside it, the router as one kernel (route_fused: the logits on the tensor cores, in shared
    // memory), which the layer does not run: router.h gives the measurements.
    o.fused_router_ms = time_work(stream_, options_, [&] {
                          moe::cuda::route_fused(in_.x.data(), r.gate_weights.data(), s_.D, r.probs.data(), r.top_experts.data(), r.combine_weights.data(), r.logsumexp.data(), r.expert_fraction.data(), r.mean_probs.data(), r.aux_loss.data(), r.z_loss.data(), r.workspace, s_.T, s_.E, s_.K, false, stream_);
                        }).median_ms;
    std::printf("  time  %-20s %8.3f ms (router_logits + route_top_k, the layer's: %.3f ms)\n", "route_fused",
                o.fused_router_ms, o.step_ms[0].second + o.step_ms[1].second);
    std::printf("  time  %-20s %8.3f ms outside the expert FFN: %.1f%% of the dropless forward layer\n",
                "routing overhead", o.total_ms, 100.0 * o.share);
    report_.overheads.push_back(o);
  }

  // An oracle independent of cuBLAS: the CPU reference on a few hundred slots (small shapes only:
  // it needs the weights in double precision on the host).
  void cpu_oracle_check(const std::string& name, const bf16* out, size_t max_rows, const std::vector<int>& slot_row) {
    if (size_t(s_.E) * w1_elements() > (size_t{1} << 25)) return;
    const int64_t slots = routed_rows();
    const int n = int(std::min<int64_t>(kOracleCpuRows, slots));
    std::vector<std::vector<int64_t>> chosen(s_.E);  // sampled slots, by expert
    for (int i = 0; i < n; ++i) {
      const int64_t slot = i * slots / n;
      chosen[top_experts_host_[slot]].push_back(slot);
    }
    moe::ref::DispatchPlan plan;
    plan.num_experts = s_.E;
    plan.row_offsets.push_back(0);
    std::vector<int64_t> order;
    for (int e = 0; e < s_.E; ++e) {
      plan.rows_per_expert.push_back(int32_t(chosen[e].size()));
      plan.row_offsets.push_back(plan.row_offsets.back() + int32_t(chosen[e].size()));
      order.insert(order.end(), chosen[e].begin(), chosen[e].end());
    }
    plan.total_rows = n;
    const std::vector<bf16> x = in_.x.download(), w1 = in_.w1.download(), w2 = in_.w2.download();
    moe::ref::Matrix permuted_x(n, s_.D);
    for (int r = 0; r < n; ++r) {
      const int64_t token = order[r] / s_.K;
      for (int d = 0; d < s_.D; ++d) permuted_x(r, d) = to_float(x[size_t(token) * s_.D + d]);
    }
    std::vector<moe::ref::Matrix> w1_ref(s_.E, moe::ref::Matrix(s_.D, in_.W1)), w2_ref(s_.E, moe::ref::Matrix(s_.H, s_.D));
    for (int e = 0; e < s_.E; ++e) {
      for (size_t i = 0; i < w1_elements(); ++i) w1_ref[e].data()[i] = to_float(w1[e * w1_elements() + i]);
      for (size_t i = 0; i < w2_elements(); ++i) w2_ref[e].data()[i] = to_float(w2[e * w2_elements() + i]);
    }
    const moe::ref::ExpertActivations ref =
        moe::ref::expert_ffn_forward(config(Formulation::dropless, 128), plan, permuted_x, w1_ref, w2_ref);
    const std::vector<bf16> gpu = rows_by_slot(out, max_rows, s_.D, slot_row);
    Difference d;
    for (int r = 0; r < n; ++r) {
      for (int c = 0; c < s_.D; ++c) d.add(to_float(gpu[size_t(order[r]) * s_.D + c]), ref.out(r, c));
    }
    record_check(label_ + " " + name + " out vs CPU reference (" + std::to_string(n) + " slots)", d);
  }

  // -- padded to the largest expert (C = max count) and dropping at a capacity factor --
  void capacity_path(const std::string& name, int C) {
    if (!options_.selected(name)) return;
    int64_t dropped = 0;
    for (int c : counts_) dropped += std::max(0, c - C);
    const size_t rows = size_t(s_.E) * C;
    if (!fits(CublasFfn::bytes(rows, s_.D, s_.H, in_.activation, s_.E) + rows * 8, label_ + " " + name, report_)) return;
    // The padded plan lays out E x [C, D]; its capacity comes from capacity_factor, so pick the factor
    // that gives exactly C (nudged past the rounding of ceil(cf * T*K / E)).
    MoeConfig padded = config(Formulation::padded, 1, double(C) * s_.E / double(routed_rows()));
    while (moe::capacity(padded) > C) padded.capacity_factor = std::nextafter(padded.capacity_factor, 0.0);
    while (moe::capacity(padded) < C) padded.capacity_factor = std::nextafter(padded.capacity_factor, 1e300);
    moe::cuda::DispatchPlanBuffers plan(padded);
    moe::cuda::build_dispatch_plan(top_experts_.data(), plan, stream_);
    check_plan(name, plan, dropped);
    const std::vector<int> slot_row = download_ints(plan.slot_row);
    cublasHandle_t h = cublas_.get();
    CublasFfn f(rows, s_.D, s_.H, in_.activation, capacity_groups(s_.E, C), in_.w1.data(), in_.w2.data(), s_.E);
    moe::cuda::permute_tokens(plan.plan(), in_.x.data(), f.x.data(), s_.D, stream_);
    moe::cuda::permute_tokens(plan.plan(), in_.dy.data(), f.d_out.data(), s_.D, stream_);
    f.poison_results();
    cublas_ffn_forward(h, CublasKind::batched, f, stream_);
    cublas_ffn_backward(h, CublasKind::batched, f, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    // Kept tokens must match exactly; weight gradients only when nothing was dropped.
    compare_with_oracle(name, f.out.data(), f.dx.data(), rows, slot_row, f.dw1.data(), f.dw2.data(), dropped == 0);
    Measurement& m = add_measurement(name, int64_t(rows), routed_rows() - dropped);
    m.capacity = C;
    time_forward_backward(m, [&] { cublas_ffn_forward(h, CublasKind::batched, f, stream_); },
                          [&] { cublas_ffn_backward(h, CublasKind::batched, f, stream_); });
  }

  Shape s_;
  Routing routing_;
  const ShapeInputs& in_;
  const Options& options_;
  moe::cuda::CublasHandle& cublas_;
  cudaStream_t stream_;
  Report& report_;
  std::string label_;
  std::vector<int> counts_;
  std::vector<int32_t> top_experts_host_;
  DeviceBuffer<int> top_experts_;  // [T, K]
  int max_count_ = 0;
  Oracle oracle_;
};

}  // namespace

void run_formulations(const Shape& shape, Routing routing, const ShapeInputs& inputs, const Options& options,
                      moe::cuda::CublasHandle& cublas, cudaStream_t stream, Report& report) {
  RoutingBench(shape, routing, inputs, options, cublas, stream, report).run();
}

}  // namespace moe::bench
