// test_cpu_expert.cpp: the expert FFN on the host (cuda/offload/cpu_expert.h) against the CPU
// reference's expert (reference_cpu/expert_ffn.h: activate, in double) on the same bf16-rounded
// weights and inputs: GeLU and SwiGLU, 1 to 8 rows, shapes that no thread count divides, one thread
// and several. The host kernel sums in fp32 and rounds the hidden activations to bf16 as the GPU
// experts do, so it matches the reference within bf16 tolerance. A result repeats bit for bit for
// the same thread count. Bad shapes, sizes and thread counts are errors that say what is allowed.
// Plain C++: runs on every machine, CI included.
//   ctest --test-dir build -R CpuExpert --output-on-failure
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "expert_ffn.h"  // moe::ref::activate
#include "moe_config.h"  // MoeConfig, Activation
#include "offload/cpu_expert.h"
#include "types.h"       // moe::ref::Matrix

namespace {

using moe::cuda::CpuExpert;
using moe::cuda::CpuExpertActivation;
using moe::cuda::CpuExpertShape;
using moe::ref::Matrix;

uint16_t bf16_bits(double value) {  // round to nearest even
  const float f = static_cast<float>(value);
  uint32_t word;
  std::memcpy(&word, &f, sizeof word);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

double of_bits(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

struct Case {
  CpuExpertShape shape;
  std::vector<uint16_t> weights;  // w1 [D, W1] then w2 [H, D], bf16 bits
  Matrix w1, w2;                  // the same values, double
};

Case make_case(int64_t D, int64_t H, CpuExpertActivation activation, uint64_t seed) {
  Case c;
  c.shape = {D, H, activation};
  const int64_t W1 = c.shape.w1_columns();
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  c.w1 = Matrix(D, W1);
  c.w2 = Matrix(H, D);
  for (int64_t i = 0; i < D; ++i) {
    for (int64_t j = 0; j < W1; ++j) {
      c.weights.push_back(bf16_bits(normal(generator) / std::sqrt(double(D))));
      c.w1(i, j) = of_bits(c.weights.back());
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    for (int64_t j = 0; j < D; ++j) {
      c.weights.push_back(bf16_bits(normal(generator) / std::sqrt(double(H))));
      c.w2(i, j) = of_bits(c.weights.back());
    }
  }
  return c;
}

// The reference expert on rows x [rows, D]: activate(x w1) w2, in double.
Matrix reference(const Case& c, const Matrix& x) {
  moe::MoeConfig config;
  config.model_dim = c.shape.d_model;
  config.hidden_dim = c.shape.hidden;
  config.activation = c.shape.activation == CpuExpertActivation::swiglu ? moe::Activation::swiglu : moe::Activation::gelu;
  const Matrix pre = x * c.w1;
  return moe::ref::activate(config, pre) * c.w2;
}

int host_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

TEST(CpuExpert, EqualsTheReferenceExpertWithinBf16Tolerance) {
  for (const CpuExpertActivation activation : {CpuExpertActivation::gelu, CpuExpertActivation::swiglu}) {
    // {1, 72}: fewer rows of w1 than threads; {67, 600}: W1 and D past one column tile of 512.
    for (const auto& [D, H] :
         std::vector<std::pair<int64_t, int64_t>>{{40, 72}, {67, 131}, {8, 1}, {1, 72}, {521, 600}}) {
      const Case c = make_case(D, H, activation, 7 + uint64_t(D) + uint64_t(H));
      for (const int64_t rows : {1, 3, 8}) {
        std::mt19937_64 generator(uint64_t(rows) * 31 + uint64_t(D));
        std::normal_distribution<double> normal(0.0, 1.0);
        Matrix x(rows, D);
        std::vector<float> x_values(size_t(rows * D));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t d = 0; d < D; ++d) {
            x(r, d) = of_bits(bf16_bits(normal(generator)));
            x_values[size_t(r * D + d)] = float(x(r, d));
          }
        }
        const Matrix want = reference(c, x);
        for (const int threads : {1, std::min(3, host_threads())}) {
          SCOPED_TRACE((activation == CpuExpertActivation::swiglu ? "swiglu" : "gelu") + std::string(", D = ") +
                       std::to_string(D) + ", H = " + std::to_string(H) + ", rows = " + std::to_string(rows) +
                       ", threads = " + std::to_string(threads));
          CpuExpert expert(c.shape, threads);
          std::vector<float> y(size_t(rows * D), -1.0f);
          expert.forward(c.weights, x_values, rows, y);
          double difference = 0, norm = 0;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t d = 0; d < D; ++d) {
              const double got = y[size_t(r * D + d)], expected = want(r, d);
              ASSERT_TRUE(std::isfinite(got));
              difference += (got - expected) * (got - expected);
              norm += expected * expected;
            }
          }
          // The hidden activations are rounded to bf16 (relative error up to 2^-8 each).
          EXPECT_LT(std::sqrt(difference / std::max(norm, 1e-30)), 1e-2);
          // Again: the same bits.
          std::vector<float> again(y.size(), -2.0f);
          expert.forward(c.weights, x_values, rows, again);
          EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(float)), 0) << "not repeatable";
        }
      }
    }
  }
}

// The sums in the order cpu_expert.h states, in plain float arithmetic: thread t's partial of pre
// over w1's rows [d0, d1) in order of d, the partials added in thread order; the activation rounded
// to bf16; thread t's partial of y over its hidden columns in order of j; the partials in thread
// order. The kernel must give exactly these bits, whatever loops and vector widths it uses.
std::vector<float> in_the_stated_order(const Case& c, const std::vector<float>& x, int64_t rows, int threads) {
  const int64_t D = c.shape.d_model, H = c.shape.hidden, W1 = c.shape.w1_columns();
  const bool swiglu = c.shape.activation == CpuExpertActivation::swiglu;
  const auto part = [&](int64_t count, int t) {
    const int64_t widest = (count + threads - 1) / threads, begin = std::min(count, t * widest);
    return std::pair<int64_t, int64_t>{begin, std::min(count, begin + widest)};
  };
  const auto w = [&](int64_t index) { return float(of_bits(c.weights[size_t(index)])); };
  std::vector<float> pre(size_t(rows * W1), 0.0f), y(size_t(rows * D), 0.0f);
  for (int t = 0; t < threads; ++t) {
    const auto [d0, d1] = part(D, t);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < W1; ++j) {
        float sum = 0.0f;
        for (int64_t d = d0; d < d1; ++d) sum += x[size_t(r * D + d)] * w(d * W1 + j);
        pre[size_t(r * W1 + j)] += sum;
      }
    }
  }
  for (int t = 0; t < threads; ++t) {
    const auto [h0, h1] = part(H, t);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < D; ++e) {
        float sum = 0.0f;
        for (int64_t j = h0; j < h1; ++j) {
          const float a = pre[size_t(r * W1 + j)];
          const float hidden =
              swiglu ? a / (1.0f + std::exp(-a)) * pre[size_t(r * W1 + H + j)]
                     : 0.5f * a * (1.0f + std::tanh(0.7978845608028654f * (a + 0.044715f * a * a * a)));
          sum += float(of_bits(bf16_bits(hidden))) * w(D * W1 + j * D + e);
        }
        y[size_t(r * D + e)] += sum;
      }
    }
  }
  return y;
}

TEST(CpuExpert, AddsInTheStatedOrder) {
  for (const CpuExpertActivation activation : {CpuExpertActivation::gelu, CpuExpertActivation::swiglu}) {
    const Case c = make_case(45, 530, activation, 11);  // 8-row groups and tails, two column tiles
    for (const int64_t rows : {1, 5}) {
      std::mt19937_64 generator{uint64_t(rows)};
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> x(size_t(rows * 45));
      for (float& value : x) value = normal(generator);
      for (const int threads : {1, std::min(2, host_threads())}) {
        SCOPED_TRACE(std::string(activation == CpuExpertActivation::swiglu ? "swiglu" : "gelu") + ", rows = " +
                     std::to_string(rows) + ", threads = " + std::to_string(threads));
        CpuExpert expert(c.shape, threads);
        std::vector<float> y(x.size(), -1.0f);
        expert.forward(c.weights, x, rows, y);
        const std::vector<float> want = in_the_stated_order(c, x, rows, threads);
        EXPECT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0);
      }
    }
  }
}

TEST(CpuExpert, NoRowsWritesNothingAndBadInputIsAClearError) {
  const Case c = make_case(16, 24, CpuExpertActivation::gelu, 3);
  CpuExpert expert(c.shape, 1);
  std::vector<float> none;
  EXPECT_NO_THROW(expert.forward(c.weights, none, 0, none));

  auto message = [](auto&& work) {
    try {
      work();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  std::vector<float> x(16), y(16);
  const std::vector<uint16_t> short_weights(c.weights.begin(), c.weights.end() - 1);
  EXPECT_NE(message([&] { expert.forward(short_weights, x, 1, y); }).find("allowed: weights 768 (w1 then w2)"),
            std::string::npos);
  EXPECT_NE(message([&] { expert.forward(c.weights, x, 2, y); }).find("x and y rows * D = 32"), std::string::npos);
  EXPECT_NE(message([&] { CpuExpert bad({0, 24, CpuExpertActivation::gelu}, 1); }).find("allowed: D >= 1 and H >= 1"),
            std::string::npos);
  const int too_many = host_threads() + 1;
  EXPECT_NE(message([&] { CpuExpert bad(c.shape, too_many); })
                .find(std::to_string(too_many) + " threads; allowed: 1 to " + std::to_string(host_threads())),
            std::string::npos);
  EXPECT_NE(message([&] { CpuExpert bad(c.shape, 0); }).find("0 threads; allowed: 1 to"), std::string::npos);
  // More threads than hidden columns: at most H of them (each owns a column).
  if (host_threads() >= 2) {
    EXPECT_EQ(CpuExpert({4, 1, CpuExpertActivation::gelu}, 2).threads(), 1);
  }
}

TEST(CpuExpert, TheCopyBandwidthIsMeasured) {
  const double gb_per_s = moe::cuda::host_copy_gb_per_s(8 << 20, 1, 2);
  EXPECT_GT(gb_per_s, 0.1) << "8 MiB copied at under 0.1 GB/s";
  EXPECT_THROW(moe::cuda::host_copy_gb_per_s(1 << 20, 0), std::invalid_argument);
}

}  // namespace
