// offload/cpu_expert.h: one expert's FFN computed on the host, from the bf16 weights the offload
// engine keeps in pinned memory (pinned_expert_store.h), for the rows of a decode step.
//
// Offloading systems compute a cold expert where its weights are instead of moving them: Fiddler
// (Kamahori et al., 2024) and KTransformers run the experts that are not on the GPU on the CPU, and
// llama.cpp's --cpu-moe / --n-cpu-moe keep some experts' FFNs on the host. At decode time an expert
// sees a handful of rows, so its FFN reads every weight once and does 2 FLOPs per weight and row:
// it is bound by the host's memory bandwidth, not its arithmetic. Copying the same expert to the GPU
// moves the same bytes over PCIe (about 55 GB/s pinned on an H200's host): whichever of the two is
// faster for an expert is a comparison of bandwidths (the copy can also be hidden, a block ahead).
//
//   pre    = x w1                      [rows, W1]   fp32 sums of bf16 products
//   hidden = gelu(pre)                 [rows, H]    (GeLU, tanh approximation)
//          = silu(pre[:, :H]) .* pre[:, H:]         (SwiGLU: gate columns, then up)
//            rounded to bf16, as the GPU experts store it
//   y      = hidden w2                 [rows, D]    fp32
//
// Layout, the store's: w1 [D, W1] row-major then w2 [H, D] row-major, bf16 as raw bits (uint16_t,
// the same bytes as __nv_bfloat16). x is fp32 [rows, D], y fp32 [rows, D].
//
// A call runs on T threads in three phases, every thread at a barrier between them, and each phase
// reads its weights as one contiguous run per thread (the rows of a row-major matrix):
//   1. thread t takes w1's rows [d0, d1) (D split over the threads) and writes its partial pre
//      [rows, W1] from them;
//   2. thread t takes the hidden columns [h0, h1) (H split over the threads): their pre is the T
//      partials added in thread order; the activation; then its partial y [rows, D] from w2's rows
//      [h0, h1);
//   3. thread t takes y's columns (D split again): the T partials added in thread order.
// Within a thread each sum adds its terms in order of d (of j for y), 8 weight rows at a time
// (add_product in cpu_expert.cpp), each weight converted once for up to 4 rows of x. So a result is
// the same bits run after run for the same thread count, on any x86-64 (no fused multiply-add);
// another count groups the sums differently: equal within fp32 rounding.
//
// Dimension legend: D model width, H expert hidden width, W1 w1's columns (H for GeLU, 2H for SwiGLU).
#pragma once

#include <barrier>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace moe::cuda {

enum class CpuExpertActivation { gelu, swiglu };

struct CpuExpertShape {
  int64_t d_model = 0;  // D
  int64_t hidden = 0;   // H
  CpuExpertActivation activation = CpuExpertActivation::gelu;
  int64_t w1_columns() const { return activation == CpuExpertActivation::swiglu ? 2 * hidden : hidden; }
  int64_t weight_elements() const { return d_model * w1_columns() + hidden * d_model; }
};

// The threads a CpuExpert may use: 1 .. the host's hardware threads. Throws std::invalid_argument
// naming the count asked and the host's, else returns the count.
int check_cpu_expert_threads(int threads);

// Computes experts of one shape with a fixed number of threads: the caller's and threads - 1
// workers started by the constructor, which wait between calls (a call wakes them and returns once
// all have finished its slices). Not thread-safe: one call at a time.
class CpuExpert {
 public:
  // Throws std::invalid_argument for D or H < 1, or a thread count check_cpu_expert_threads refuses.
  CpuExpert(const CpuExpertShape& shape, int threads);
  ~CpuExpert();
  CpuExpert(const CpuExpert&) = delete;
  CpuExpert& operator=(const CpuExpert&) = delete;

  // y [rows, D] = the expert FFN of x [rows, D] (file comment). weights: the expert's
  // weight_elements() bf16 values (w1 then w2). Throws std::invalid_argument if a span's size does
  // not match rows and the shape.
  void forward(std::span<const uint16_t> weights, std::span<const float> x, int64_t rows, std::span<float> y);

  const CpuExpertShape& shape() const { return shape_; }
  int threads() const { return threads_; }

 private:
  // Thread t's part of a call (the file comment's three phases).
  void slice(int t, const uint16_t* w1, const uint16_t* w2, const float* x, int64_t rows, float* y);

  void work(int t);  // a worker's loop: wait for a call, run slice t, report, until stopped

  CpuExpertShape shape_;
  int threads_ = 1;
  // The workers and the call they run: its arguments, a generation number each call advances, and
  // how many workers have yet to finish it.
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  int64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  const uint16_t *call_w1_ = nullptr, *call_w2_ = nullptr;
  const float* call_x_ = nullptr;
  float* call_y_ = nullptr;
  int64_t call_rows_ = 0;
  std::unique_ptr<std::barrier<>> barrier_;  // the phases' barrier, for the call's threads_ threads
  std::vector<float> pre_partials_;  // [threads, rows, W1]: phase 1's partial sums
  std::vector<float> hidden_;        // [threads, rows, slice width]: phase 2's activations
  std::vector<float> y_partials_;    // [threads, rows, D]: phase 2's partial y
};

// The host's memory bandwidth as a STREAM-style copy (a[i] = b[i] over `bytes` of floats each way,
// `threads` threads, each its own contiguous part): the best of `repeats` runs, in GB/s counting the
// bytes read and written. What the expert FFN's time should be compared with.
double host_copy_gb_per_s(int64_t bytes, int threads, int repeats = 5);

}  // namespace moe::cuda
