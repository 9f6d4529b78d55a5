// attention_bench.cpp: causal multi-head attention, forward and backward, with the fused core
// (model/flash_attention.h) beside the unfused one (cuBLAS batched products and a softmax kernel)
// measured in the same run, at moe_train's "throughput" shape by default (N = 64 sequences of
// S = 256, D = 512, 8 heads of 64).
//
// Correct first: before any timing, both cores run forward and backward on the same random inputs
// and their outputs and input gradients are compared (relative error; the CPU reference checks
// each core in tests/cuda/test_attention.cpp). Then, with CUDA events, --rounds rounds in which
// every row runs --warmup untimed and --repeat timed runs on fresh random x and d_out; a row's
// figure is the median of its rounds x repeat runs. Rows:
//   fused_core_forward / fused_core_backward   flash_attention_forward / _backward alone
//   fused_forward / fused_backward             attention_forward / _backward: projections + core
//   unfused_forward / unfused_backward         the same with the unfused core
// TFLOP/s counts the core's causal FLOPs (4 S^2 d / 2 a pair forward, 2.5x that backward: the
// products a causal kernel needs, not the ones it does), so rows of both cores compare on one count.
//
// Build: cmake --build build --target attention_bench
// Run:   build/cuda/bench/attention_bench [--batch 64 --seq-len 256 --model-dim 512 --heads 8]
//        [--rounds 4 --repeat 10 --warmup 3] [--out FILE.json]
// Beside it: python3 cuda/bench/torch_attention_baseline.py (PyTorch's scaled_dot_product_attention).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "command_line.h"            // CLI::App, parse_command_line, whole_number
#include "core/bench_support.h"      // median, utc_now, write_results
#include "core/cuda_check.h"         // CUDA_CHECK
#include "core/device_buffer.h"      // DeviceBuffer
#include "core/device_info.h"        // fail_without_gpu, current_device
#include "core/gemm.h"               // CublasHandle
#include "model/attention.h"         // attention_forward / _backward, AttentionWorkspace, AttentionSavedBuffer
#include "model/flash_attention.h"   // flash_attention_forward / _backward
#include "program_exit.h"            // check_output_path

namespace {

using moe::cuda::AttentionCore;
using moe::cuda::AttentionShape;
using moe::cuda::bf16;
using moe::cuda::DeviceBuffer;
using nlohmann::json;

struct Options {
  int64_t batch = 64, seq_len = 256, model_dim = 512, heads = 8;
  int rounds = 4, repeat = 10, warmup = 3;
  std::string out;
};

std::optional<int> parse_options(int argc, char** argv, Options& o) {
  CLI::App app{"attention_bench: causal attention forward and backward, fused core beside unfused", "attention_bench"};
  const int most = std::numeric_limits<int>::max();
  app.add_option("--batch", o.batch, "N sequences")->capture_default_str()->check(moe::whole_number(1, 1 << 16));
  app.add_option("--seq-len", o.seq_len, "S")->capture_default_str()->check(moe::whole_number(1, 1 << 14));
  app.add_option("--model-dim", o.model_dim, "D")->capture_default_str()->check(moe::whole_number(1, 1 << 14));
  app.add_option("--heads", o.heads, "heads; D / heads of 32, 64 or 128 for the fused core")->capture_default_str()
      ->check(moe::whole_number(1, 1 << 14));
  app.add_option("--rounds", o.rounds, "rounds over all rows, interleaved")->capture_default_str()
      ->check(moe::whole_number(1, most));
  app.add_option("--repeat", o.repeat, "timed runs per row and round")->capture_default_str()
      ->check(moe::whole_number(1, most));
  app.add_option("--warmup", o.warmup, "untimed runs of a row before its timed runs in each round")
      ->capture_default_str()->check(moe::whole_number(0, most));
  app.add_option("--out", o.out, "also write the results as JSON, with the device and the date");
  return moe::parse_command_line(app, argc, argv);
}

std::vector<bf16> random_bf16(size_t count, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<bf16> values(count);
  for (bf16& v : values) v = __float2bfloat16(float(normal(rng)));
  return values;
}

// ||a - b|| / ||b|| of two device arrays.
template <typename T>
double relative_error(const DeviceBuffer<T>& a, const DeviceBuffer<T>& b) {
  const std::vector<T> x = a.download(), y = b.download();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double u = double(float(x[i])), v = double(float(y[i]));
    diff += (u - v) * (u - v);
    norm += v * v;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// One core's attention layer: its buffers, workspace and saved tensor.
struct Layer {
  Layer(const AttentionShape& s, AttentionCore core)
      : shape(s), workspace(s, core), saved(s, core), qkv(size_t(tokens() * 3 * s.model_dim)),
        context(size_t(tokens() * s.model_dim)), out(size_t(tokens() * s.model_dim)),
        d_qkv_weights(size_t(s.model_dim * 3 * s.model_dim)), d_out_weights(size_t(s.model_dim * s.model_dim)),
        dx(size_t(tokens() * s.model_dim)) {}
  int64_t tokens() const { return shape.batch * shape.seq_len; }
  AttentionShape shape;
  moe::cuda::AttentionWorkspace workspace;
  moe::cuda::AttentionSavedBuffer saved;
  DeviceBuffer<bf16> qkv, context, out;
  DeviceBuffer<float> d_qkv_weights, d_out_weights, dx;
};

struct Inputs {
  DeviceBuffer<bf16> x, qkv_weights, out_weights, d_out;
};

void forward(cublasHandle_t cublas, Layer& l, Inputs& in, cudaStream_t stream) {
  moe::cuda::attention_forward(cublas, l.shape, in.x.data(), in.qkv_weights.data(), in.out_weights.data(),
                               l.qkv.data(), l.saved.at(0), l.context.data(), l.out.data(), l.workspace, stream);
}
void backward(cublasHandle_t cublas, Layer& l, Inputs& in, cudaStream_t stream) {
  moe::cuda::attention_backward(cublas, l.shape, in.x.data(), in.qkv_weights.data(), in.out_weights.data(),
                                l.qkv.data(), l.saved.at(0), l.context.data(), in.d_out.data(), l.d_qkv_weights.data(),
                                l.d_out_weights.data(), l.dx.data(), l.workspace, stream);
}

struct Row {
  std::string name;
  double core_gflop = 0;           // the core's causal FLOPs a run (TFLOP/s column)
  std::function<void()> enqueue;
  std::vector<double> times;
};

void time_row(Row& row, int warmup, int repeat, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) row.enqueue();
  std::vector<cudaEvent_t> events(size_t(2 * repeat));
  for (cudaEvent_t& e : events) CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < repeat; ++i) {
    CUDA_CHECK(cudaEventRecord(events[size_t(2 * i)], stream));
    row.enqueue();
    CUDA_CHECK(cudaEventRecord(events[size_t(2 * i + 1)], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int i = 0; i < repeat; ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events[size_t(2 * i)], events[size_t(2 * i + 1)]));
    row.times.push_back(ms);
  }
  for (cudaEvent_t e : events) CUDA_CHECK(cudaEventDestroy(e));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (const std::optional<int> exit_status = parse_options(argc, argv, o)) return *exit_status;
    if (!o.out.empty()) moe::check_output_path("--out", o.out);
    moe::cuda::check_attention_shape("attention_bench", {o.batch, o.seq_len, o.model_dim, o.heads});
  } catch (const std::exception& error) {
    std::fprintf(stderr, "attention_bench: %s\n", error.what());
    return 2;
  }
  if (const std::optional<int> no_gpu = moe::cuda::fail_without_gpu()) return *no_gpu;
  try {
    const AttentionShape shape{o.batch, o.seq_len, o.model_dim, o.heads};
    const int64_t T = o.batch * o.seq_len, D = o.model_dim, d = D / o.heads, S = o.seq_len;
    const moe::cuda::DeviceInfo device = moe::cuda::current_device();
    const std::string date = moe::cuda::utc_now("%Y-%m-%d");
    std::printf("attention_bench on %s, %s: N=%lld S=%lld D=%lld heads=%lld (d=%lld); %d rounds x %d runs after %d "
                "warm-up\n", device.name.c_str(), date.c_str(), (long long)o.batch, (long long)S, (long long)D,
                (long long)o.heads, (long long)d, o.rounds, o.repeat, o.warmup);
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    moe::cuda::CublasHandle cublas;
    std::mt19937_64 rng(1);
    Inputs in{DeviceBuffer<bf16>(random_bf16(size_t(T * D), 1.0, rng)),
              DeviceBuffer<bf16>(random_bf16(size_t(D * 3 * D), 1.0 / std::sqrt(double(D)), rng)),
              DeviceBuffer<bf16>(random_bf16(size_t(D * D), 1.0 / std::sqrt(double(D)), rng)),
              DeviceBuffer<bf16>(random_bf16(size_t(T * D), 1.0, rng))};

    const bool fused_ok = moe::cuda::flash_attention_supports(d);
    Layer unfused(shape, AttentionCore::unfused);
    std::optional<Layer> fused;
    if (fused_ok) fused.emplace(shape, AttentionCore::fused);

    // Correct first: both cores on the same inputs.
    json check;
    if (fused) {
      for (Layer* l : {&*fused, &unfused}) {
        forward(cublas.get(), *l, in, stream);
        backward(cublas.get(), *l, in, stream);
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      check = {{"out", relative_error(fused->out, unfused.out)}, {"dx", relative_error(fused->dx, unfused.dx)},
               {"d_qkv_weights", relative_error(fused->d_qkv_weights, unfused.d_qkv_weights)}};
      std::printf("fused vs unfused, relative error: out %.2e, dx %.2e, d_qkv_weights %.2e\n",
                  check["out"].get<double>(), check["dx"].get<double>(), check["d_qkv_weights"].get<double>());
    } else {
      std::printf("head width %lld has no fused kernels: unfused rows only\n", (long long)d);
    }

    // The core's causal FLOPs: Q Kᵀ and p V over the S (S + 1) / 2 visible pairs, 2 d FLOPs each.
    const double pairs = double(o.batch * o.heads);
    const double core_forward_gflop = pairs * 2.0 * 2.0 * double(d) * double(S) * double(S + 1) / 2.0 / 1e9;
    const double core_backward_gflop = 2.5 * core_forward_gflop;
    std::vector<Row> rows;
    if (fused) {
      Layer& f = *fused;
      rows.push_back({"fused_core_forward", core_forward_gflop, [&] {
                        moe::cuda::flash_attention_forward(shape, f.qkv.data(), f.context.data(), f.saved.at(0).log_sum_exp,
                                                           stream);
                      }, {}});
      rows.push_back({"fused_core_backward", core_backward_gflop, [&] {
                        moe::cuda::flash_attention_backward(shape, f.qkv.data(), f.context.data(),
                                                            f.saved.at(0).log_sum_exp, in.d_out.data(),
                                                            f.workspace.delta.data(), f.workspace.d_qkv.data(), stream);
                      }, {}});
      rows.push_back({"fused_forward", core_forward_gflop, [&] { forward(cublas.get(), f, in, stream); }, {}});
      rows.push_back({"fused_backward", core_backward_gflop, [&] { backward(cublas.get(), f, in, stream); }, {}});
    }
    rows.push_back({"unfused_forward", core_forward_gflop, [&] { forward(cublas.get(), unfused, in, stream); }, {}});
    rows.push_back({"unfused_backward", core_backward_gflop, [&] { backward(cublas.get(), unfused, in, stream); }, {}});

    for (int round = 0; round < o.rounds; ++round) {
      in.x.upload(random_bf16(size_t(T * D), 1.0, rng));  // fresh inputs every round
      in.d_out.upload(random_bf16(size_t(T * D), 1.0, rng));
      for (Row& row : rows) time_row(row, o.warmup, o.repeat, stream);
    }

    json results = {{"program", "attention_bench"}, {"device", device.name}, {"date", date},
                    {"shape", {{"batch", o.batch}, {"seq_len", S}, {"model_dim", D}, {"heads", o.heads}, {"head_dim", d}}},
                    {"rounds", o.rounds}, {"repeat", o.repeat}, {"warmup", o.warmup}, {"fused_vs_unfused", check}};
    std::printf("\n%-22s %10s %10s %14s\n", "row", "median ms", "min ms", "core TFLOP/s");
    for (const Row& row : rows) {
      const double ms = moe::cuda::median(row.times);
      const double best = *std::min_element(row.times.begin(), row.times.end());
      const double tflops = row.core_gflop / ms;  // GFLOP / ms = TFLOP/s
      std::printf("%-22s %10.4f %10.4f %14.1f\n", row.name.c_str(), ms, best, tflops);
      results["rows"].push_back({{"name", row.name}, {"median_ms", ms}, {"min_ms", best}, {"core_tflops", tflops},
                                 {"core_gflop", row.core_gflop}});
    }
    auto ms_of = [&](const std::string& name) {
      for (const Row& row : rows) if (row.name == name) return moe::cuda::median(row.times);
      return 0.0;
    };
    if (fused) {
      const double f = ms_of("fused_forward") + ms_of("fused_backward");
      const double u = ms_of("unfused_forward") + ms_of("unfused_backward");
      std::printf("\nforward + backward of one layer: fused %.3f ms, unfused %.3f ms (%.2fx)\n", f, u, u / f);
      results["layer_forward_backward_ms"] = {{"fused", f}, {"unfused", u}};
    }
    if (!o.out.empty()) moe::cuda::write_results(o.out, results);
    CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "attention_bench: %s\n", error.what());
    return 1;
  }
  return 0;
}
