// cpu_expert_bench.cpp: one expert's FFN on this host's CPU (offload/cpu_expert.h) at decode-time row
// counts, beside a STREAM-style copy with the same threads: how close the expert comes to the
// host's memory bandwidth, and what that is against copying the expert over PCIe.
//   build/cuda/offload/cpu_expert_bench                                      (the large experts: D=4096 H=14336 SwiGLU)
//   build/cuda/offload/cpu_expert_bench --d 768 --h 3072 --activation gelu   (a Switch-Base expert)
// Each row: the median of --repeats timed calls after one warm-up call, random bf16 weights (the
// time does not depend on their values), GB/s = the expert's weight bytes / the median time. The
// calls take --experts copies of the weights in turn, by default enough for 1 GiB, so that a call
// reads its expert from memory as a decode step does, not from the last call's bytes in the cache
// (a server's L3 can hold a whole 235 MB expert).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "command_line.h"  // parse_command_line, whole_number
#include "offload/cpu_expert.h"

int main(int argc, char** argv) {
  int64_t d = 4096, h = 14336;
  std::string activation = "swiglu", rows_text = "1,4,8";
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int repeats = 10;
  int experts = 0;  // 0: enough copies for 1 GiB
  CLI::App app{"One expert's FFN on the host's CPU against a STREAM-style copy (offload/cpu_expert.h)",
               "cpu_expert_bench"};
  app.add_option("--d", d, "D, the model width")->capture_default_str()->check(moe::whole_number(1, 1 << 16));
  app.add_option("--h", h, "H, the expert's hidden width")->capture_default_str()->check(moe::whole_number(1, 1 << 18));
  app.add_option("--activation", activation, "gelu or swiglu")->capture_default_str()->check(CLI::IsMember({"gelu", "swiglu"}));
  app.add_option("--rows", rows_text, "rows a call (a decode step's tokens for the expert), a list")
      ->capture_default_str()->check(moe::whole_number_list(1, 4096));
  app.add_option("--threads", threads, "threads (default: the host's hardware threads)")
      ->capture_default_str()->check(moe::whole_number(1, 4096));
  app.add_option("--repeats", repeats, "timed calls a row")->capture_default_str()->check(moe::whole_number(1, 10000));
  app.add_option("--experts", experts, "copies of the weights the calls take in turn (default: enough for 1 GiB)")
      ->check(moe::whole_number(1, 4096));
  if (const std::optional<int> exit_status = moe::parse_command_line(app, argc, argv)) return *exit_status;
  try {
    const moe::cuda::CpuExpertShape shape{d, h, activation == "swiglu" ? moe::cuda::CpuExpertActivation::swiglu
                                                                       : moe::cuda::CpuExpertActivation::gelu};
    moe::cuda::CpuExpert expert(shape, threads);
    const size_t elements = static_cast<size_t>(shape.weight_elements());
    const double weight_bytes = 2.0 * static_cast<double>(elements);
    if (experts == 0) experts = static_cast<int>(std::clamp(std::ceil(double(1 << 30) / weight_bytes), 1.0, 4096.0));
    std::vector<uint16_t> weights(elements * static_cast<size_t>(experts));
    std::mt19937 generator(1);
    for (uint16_t& w : weights) w = static_cast<uint16_t>(0x3c00u + (generator() & 0x00ffu));  // bf16 in [2^-7, 2^-6)
    const auto expert_weights = [&](int64_t call) {
      return std::span<const uint16_t>(weights).subspan(static_cast<size_t>(call % experts) * elements, elements);
    };
    const double copy = moe::cuda::host_copy_gb_per_s(static_cast<int64_t>(weight_bytes), expert.threads());
    std::printf("# cpu_expert_bench: D=%lld H=%lld %s, %.1f MB of bf16 weights (%d copies, taken in turn), %d threads "
                "of %u on this host\n",
                static_cast<long long>(d), static_cast<long long>(h), activation.c_str(), weight_bytes / 1e6, experts,
                expert.threads(), std::thread::hardware_concurrency());
    std::printf("# STREAM-style copy of as many bytes, same threads: %.1f GB/s (read + written)\n", copy);
    std::printf("#rows  median_ms  weights_GB/s  of_copy  PCIe-55GB/s_copy_ms\n");
    const std::vector<int64_t> row_counts = *moe::parse_integer_list(rows_text);
    for (const int64_t rows : row_counts) {
      std::vector<float> x(static_cast<size_t>(rows * d), 0.5f), y(static_cast<size_t>(rows * d));
      int64_t call = 0;
      expert.forward(expert_weights(call++), x, rows, y);  // warm-up: threads started once
      std::vector<double> ms;
      for (int k = 0; k < repeats; ++k) {
        const auto start = std::chrono::steady_clock::now();
        expert.forward(expert_weights(call++), x, rows, y);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(ms.begin(), ms.end());
      const double median = ms[ms.size() / 2], gb_per_s = weight_bytes / (median * 1e-3) / 1e9;
      std::printf("%5lld  %9.3f  %12.1f  %6.2fx  %19.3f\n", static_cast<long long>(rows), median, gb_per_s,
                  gb_per_s / copy, weight_bytes / 55e9 * 1e3);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "cpu_expert_bench: %s\n", error.what());
    return 2;
  }
  return 0;
}
