// offload/cpu_expert.cpp: see cpu_expert.h.
#include "offload/cpu_expert.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace moe::cuda {

namespace {

// Round to nearest even, as __float2bfloat16 does (NaN kept a NaN).
float round_to_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  if ((word & 0x7f800000u) == 0x7f800000u && (word & 0x007fffffu) != 0) return value;
  word += 0x7fffu + ((word >> 16) & 1u);
  word &= 0xffff0000u;
  float rounded;
  std::memcpy(&rounded, &word, sizeof rounded);
  return rounded;
}

float gelu(float a) {  // the tanh approximation, as the GPU experts and the reference
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * a * (1.0f + std::tanh(k * (a + 0.044715f * a * a * a)));
}

float silu(float a) { return a / (1.0f + std::exp(-a)); }

// The kernel's inner loop, compiled for AVX-512, AVX2 and plain x86-64, the best chosen when
// the program loads (GCC's target_clones). Each clone computes the same products and sums in the
// same order (ISO C++ does not fuse a multiply and an add), so every clone gives the same bits.
// Not under ThreadSanitizer, whose runtime is not up yet when the loader runs the clones' resolver.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define MOE_CPU_EXPERT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOE_CPU_EXPERT_CLONES
#endif

// out[j] += a * w[j], j < n, w bf16 (its bits shifted into an fp32's upper half).
MOE_CPU_EXPERT_CLONES void add_scaled(float* __restrict out, float a, const uint16_t* __restrict w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t word = static_cast<uint32_t>(w[j]) << 16;
    float value;
    std::memcpy(&value, &word, sizeof value);
    out[j] += a * value;
  }
}

// Runs work(t) on `threads` threads (t = 0 on the caller's), joined before it returns.
template <typename Work>
void run_threads(int threads, Work&& work) {
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back([&work, t] { work(t); });
  work(0);
  for (std::thread& thread : pool) thread.join();
}

}  // namespace

int check_cpu_expert_threads(int threads) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads < 1 || threads > cores) {
    throw std::invalid_argument("CPU experts: " + std::to_string(threads) + " threads; allowed: 1 to " +
                                std::to_string(cores) + " (this host's hardware threads)");
  }
  return threads;
}

CpuExpert::CpuExpert(const CpuExpertShape& shape, int threads) : shape_(shape) {
  if (shape.d_model < 1 || shape.hidden < 1) {
    throw std::invalid_argument("CPU experts: D = " + std::to_string(shape.d_model) + ", H = " +
                                std::to_string(shape.hidden) + "; allowed: D >= 1 and H >= 1");
  }
  // At most H threads: each owns at least one hidden column.
  threads_ = static_cast<int>(std::min<int64_t>(check_cpu_expert_threads(threads), shape.hidden));
  for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
}

CpuExpert::~CpuExpert() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void CpuExpert::work(int t) {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    slice(t, call_w1_, call_w2_, call_x_, call_rows_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_ == 0) done_.notify_one();
  }
}

void CpuExpert::forward(std::span<const uint16_t> weights, std::span<const float> x, int64_t rows, std::span<float> y) {
  const int64_t D = shape_.d_model;
  if (rows < 0 || static_cast<int64_t>(weights.size()) != shape_.weight_elements() ||
      static_cast<int64_t>(x.size()) != rows * D || static_cast<int64_t>(y.size()) != rows * D) {
    throw std::invalid_argument("CPU experts: weights " + std::to_string(weights.size()) + ", x " +
                                std::to_string(x.size()) + ", y " + std::to_string(y.size()) + " values for " +
                                std::to_string(rows) + " rows; allowed: weights " +
                                std::to_string(shape_.weight_elements()) + " (w1 then w2), x and y rows * D = " +
                                std::to_string(rows * D));
  }
  if (rows == 0) return;
  const int64_t H = shape_.hidden;
  const int64_t widest = (H + threads_ - 1) / threads_;
  partials_.assign(static_cast<size_t>(threads_ * rows * D), 0.0f);
  // Each slice zeroes its own part of hidden_ (slice()).
  hidden_.resize(static_cast<size_t>(threads_ * rows * widest * (shape_.activation == CpuExpertActivation::swiglu ? 2 : 1)));
  const uint16_t* w1 = weights.data();
  const uint16_t* w2 = weights.data() + D * shape_.w1_columns();
  {  // the workers take slices 1 .. threads - 1, the caller slice 0
    std::lock_guard<std::mutex> lock(mutex_);
    call_w1_ = w1;
    call_w2_ = w2;
    call_x_ = x.data();
    call_rows_ = rows;
    pending_ = threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  slice(0, w1, w2, x.data(), rows);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
  }
  // The partials in thread order: the same sums, in the same order, every call.
  std::fill(y.begin(), y.end(), 0.0f);
  for (int t = 0; t < threads_; ++t) {
    const float* partial = partials_.data() + static_cast<size_t>(t * rows * D);
    for (int64_t i = 0; i < rows * D; ++i) y[static_cast<size_t>(i)] += partial[i];
  }
}

// Thread t: hidden columns [h0, h1), then their share of y.
void CpuExpert::slice(int t, const uint16_t* w1, const uint16_t* w2, const float* x, int64_t rows) {
  const int64_t D = shape_.d_model, H = shape_.hidden, W1 = shape_.w1_columns();
  const bool swiglu = shape_.activation == CpuExpertActivation::swiglu;
  const int64_t widest = (H + threads_ - 1) / threads_;
  const int64_t h0 = std::min(H, t * widest), h1 = std::min(H, h0 + widest), width = h1 - h0;
  if (width <= 0) return;
  // pre[r][j] for j in the slice (gate), and pre[r][width + j] (up, SwiGLU): w1 row d read once.
  const int64_t columns = swiglu ? 2 * width : width;
  float* pre = hidden_.data() + static_cast<size_t>(t) * static_cast<size_t>(rows * widest * (swiglu ? 2 : 1));
  std::fill(pre, pre + rows * columns, 0.0f);
  // w1 row d's slice read once, for every row of x while it is in cache; sums in order of d.
  for (int64_t d = 0; d < D; ++d) {
    const uint16_t* row = w1 + d * W1;
    for (int64_t r = 0; r < rows; ++r) {
      add_scaled(pre + r * columns, x[r * D + d], row + h0, width);
      if (swiglu) add_scaled(pre + r * columns + width, x[r * D + d], row + H + h0, width);
    }
  }
  // hidden, in place over the gate columns, rounded to bf16 as the GPU stores it
  for (int64_t r = 0; r < rows; ++r) {
    float* out = pre + r * columns;
    for (int64_t j = 0; j < width; ++j) {
      out[j] = round_to_bf16(swiglu ? silu(out[j]) * out[width + j] : gelu(out[j]));
    }
  }
  // y partial [rows, D] += hidden[:, j] w2[h0 + j, :]: w2's rows of the slice, each read once, for
  // every row of x; sums in order of j.
  float* y = partials_.data() + static_cast<size_t>(t) * static_cast<size_t>(rows * D);
  for (int64_t j = 0; j < width; ++j) {
    for (int64_t r = 0; r < rows; ++r) add_scaled(y + r * D, pre[r * columns + j], w2 + (h0 + j) * D, D);
  }
}

double host_copy_gb_per_s(int64_t bytes, int threads, int repeats) {
  check_cpu_expert_threads(threads);
  const size_t n = static_cast<size_t>(std::max<int64_t>(bytes, 4) / 4);
  std::vector<float> a(n), b(n, 1.0f);
  double best = 0;
  for (int k = 0; k < std::max(1, repeats); ++k) {
    const auto start = std::chrono::steady_clock::now();
    run_threads(threads, [&](int t) {
      const size_t begin = n * static_cast<size_t>(t) / static_cast<size_t>(threads);
      const size_t end = n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
      std::memcpy(a.data() + begin, b.data() + begin, (end - begin) * sizeof(float));
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 2.0 * static_cast<double>(n * sizeof(float)) / seconds / 1e9);
    b[static_cast<size_t>(k) % n] = a[0] + 1.0f;  // the next copy is not of settled bytes alone
  }
  return best;
}

}  // namespace moe::cuda
