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

// The kernel's inner loops, compiled for AVX-512, AVX2 and plain x86-64, the best chosen when the
// program loads (GCC's target_clones). Each clone computes the same products and sums in the same
// order (ISO C++ does not fuse a multiply and an add), so every clone gives the same bits.
// Not under ThreadSanitizer, whose runtime is not up yet when the loader runs the clones' resolver.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define MOE_CPU_EXPERT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOE_CPU_EXPERT_CLONES
#endif

// A bf16 weight as a float: its bits shifted into an fp32's upper half.
inline float bf16_value(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// out[j] += a * w[j], j < n: one row of w.
MOE_CPU_EXPERT_CLONES void add_scaled(float* __restrict out, float a, const uint16_t* __restrict w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] += a * bf16_value(w[j]);
}

// The same for 8 rows of w at once (row i at w + i * w_stride), one term after another:
//   out[j] = ((out[j] + a[0] w[0][j]) + a[1] w[1][j]) + ... + a[7] w[7][j]
// the bits of 8 add_scaled calls in row order, with out read and written once instead of 8 times.
MOE_CPU_EXPERT_CLONES void add_scaled_8(float* __restrict out, const float* __restrict a, const uint16_t* __restrict w,
                                        int64_t w_stride, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float sum = out[j];
    for (int i = 0; i < 8; ++i) sum += a[i] * bf16_value(w[i * w_stride + j]);
    out[j] = sum;
  }
}

// add_scaled_8 for 4 rows of out (row r at out + r * out_stride, its 8 factors at a + r * a_stride):
// each weight is converted once and used for the 4. The same bits as 4 add_scaled_8 calls.
MOE_CPU_EXPERT_CLONES void add_scaled_8x4(float* __restrict out, int64_t out_stride, const float* __restrict a,
                                          int64_t a_stride, const uint16_t* __restrict w, int64_t w_stride, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float v[8];
    for (int i = 0; i < 8; ++i) v[i] = bf16_value(w[i * w_stride + j]);
    for (int r = 0; r < 4; ++r) {
      float sum = out[r * out_stride + j];
      for (int i = 0; i < 8; ++i) sum += a[r * a_stride + i] * v[i];
      out[r * out_stride + j] = sum;
    }
  }
}

// out [rows, n] (row stride out_stride) += a [rows, k] (row stride a_stride) times w [k, n] (row
// stride w_stride, bf16): each out element gets its k terms added one after another, i = 0 .. k - 1,
// whichever loop below adds them. w is read once from memory, 8 rows at a time as 8 streams, in
// column tiles small enough that a tile's weights stay in L1 while every row of out takes them.
void add_product(float* out, int64_t out_stride, const float* a, int64_t a_stride, const uint16_t* w, int64_t w_stride,
                 int64_t rows, int64_t k, int64_t n) {
  constexpr int64_t kColumnTile = 512;  // 8 rows x 1 KB of weights
  for (int64_t i0 = 0; i0 < k; i0 += 8) {
    const bool full = k - i0 >= 8;
    for (int64_t c0 = 0; c0 < n; c0 += kColumnTile) {
      const int64_t width = std::min(kColumnTile, n - c0);
      const uint16_t* tile = w + i0 * w_stride + c0;
      int64_t r = 0;
      if (full) {
        for (; r + 4 <= rows; r += 4) {
          add_scaled_8x4(out + r * out_stride + c0, out_stride, a + r * a_stride + i0, a_stride, tile, w_stride, width);
        }
        for (; r < rows; ++r) add_scaled_8(out + r * out_stride + c0, a + r * a_stride + i0, tile, w_stride, width);
      } else {
        for (; r < rows; ++r) {
          for (int64_t i = i0; i < k; ++i) {
            add_scaled(out + r * out_stride + c0, a[r * a_stride + i], w + i * w_stride + c0, width);
          }
        }
      }
    }
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
  barrier_ = std::make_unique<std::barrier<>>(threads_);
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
    slice(t, call_w1_, call_w2_, call_x_, call_rows_, call_y_);
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
  const int64_t H = shape_.hidden, W1 = shape_.w1_columns();
  const int64_t widest = (H + threads_ - 1) / threads_;
  // Each slice zeroes its own parts (slice()); resize keeps the memory between calls.
  pre_partials_.resize(static_cast<size_t>(threads_ * rows * W1));
  hidden_.resize(static_cast<size_t>(threads_ * rows * widest));
  y_partials_.resize(static_cast<size_t>(threads_ * rows * D));
  const uint16_t* w1 = weights.data();
  const uint16_t* w2 = weights.data() + D * W1;
  {  // the workers take slices 1 .. threads - 1, the caller slice 0
    std::lock_guard<std::mutex> lock(mutex_);
    call_w1_ = w1;
    call_w2_ = w2;
    call_x_ = x.data();
    call_y_ = y.data();
    call_rows_ = rows;
    pending_ = threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  slice(0, w1, w2, x.data(), rows, y.data());
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
}

// Thread t's part of a call, in three phases with every thread at a barrier between them.
void CpuExpert::slice(int t, const uint16_t* w1, const uint16_t* w2, const float* x, int64_t rows, float* y) {
  const int64_t D = shape_.d_model, H = shape_.hidden, W1 = shape_.w1_columns();
  const bool swiglu = shape_.activation == CpuExpertActivation::swiglu;
  const auto part = [&](int64_t count, int64_t index) {  // [begin, end) of `count` split over the threads
    const int64_t widest = (count + threads_ - 1) / threads_;
    const int64_t begin = std::min(count, index * widest);
    return std::pair<int64_t, int64_t>{begin, std::min(count, begin + widest)};
  };

  // 1. pre's partial of w1's rows [d0, d1): w1 is row-major, so these rows are one contiguous run
  //    of memory, streamed once.
  const auto [d0, d1] = part(D, t);
  float* pre = pre_partials_.data() + static_cast<size_t>(t * rows * W1);
  std::fill(pre, pre + rows * W1, 0.0f);
  add_product(pre, W1, x + d0, D, w1 + d0 * W1, W1, rows, d1 - d0, W1);
  barrier_->arrive_and_wait();

  // 2. The hidden columns [h0, h1): pre summed over the threads' partials in thread order, the
  //    activation, rounded to bf16 as the GPU stores it; then y's partial from w2's rows [h0, h1),
  //    again one contiguous run.
  const auto [h0, h1] = part(H, t);
  const int64_t width = h1 - h0;
  float* hidden = hidden_.data() + static_cast<size_t>(t * rows * ((H + threads_ - 1) / threads_));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      float gate = 0.0f, up = 0.0f;
      for (int s = 0; s < threads_; ++s) {
        const float* partial = pre_partials_.data() + static_cast<size_t>((s * rows + r) * W1);
        gate += partial[h0 + j];
        if (swiglu) up += partial[H + h0 + j];
      }
      hidden[r * width + j] = round_to_bf16(swiglu ? silu(gate) * up : gelu(gate));
    }
  }
  float* y_partial = y_partials_.data() + static_cast<size_t>(t * rows * D);
  std::fill(y_partial, y_partial + rows * D, 0.0f);
  add_product(y_partial, D, hidden, width, w2 + h0 * D, D, rows, width, D);
  barrier_->arrive_and_wait();

  // 3. y's columns [c0, c1): the threads' partials added in thread order.
  const auto [c0, c1] = part(D, t);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      float sum = 0.0f;
      for (int s = 0; s < threads_; ++s) sum += y_partials_[static_cast<size_t>((s * rows + r) * D + c)];
      y[r * D + c] = sum;
    }
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
