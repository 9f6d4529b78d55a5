// expert_layout_choice_gpu.cpp: the layout r of the GPU expert-parallel layer, by cost model or by
// measurement (see expert_layout_choice_gpu.h).
#include "ep/expert_layout_choice_gpu.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cuda_check.h"  // CUDA_CHECK
#include "comm/rank_agreement.h"   // check_same_on_every_rank
#include "fnv1a.h"                // fnv1a_64_words: the candidates' fingerprint

namespace moe::dist {

LayoutCostModel gpu_layout_cost_model() {
  LayoutCostModel model;
  model.latency_us = 15.0;              // one NCCL collective of a few rows
  model.bytes_per_us = 150e3;           // 150 GB/s a rank: NVLink all-to-all, busbw
  model.expert_flops_per_us = 400e6;    // 400 TFLOP/s: bf16 tensor cores, well fed
  model.bytes_per_element = 2.0;        // token rows and gathered weights: bf16
  return model;
}

LayoutChoice choose_gpu_layout(ExpertParallelGpu& layer, const LayoutCostModel& model) {
  const MoeConfig& config = layer.config();
  const int R = layer.exchange().size();
  LayoutCostModel bf16_model = model;
  bf16_model.bytes_per_element = 2.0;
  LayoutChoice all = choose_layout(config, R, layer.last_step().kept_per_rank_expert, bf16_model);

  // The GPU's candidates, and its gradient bytes: fp32, and at r = 0 an all-reduce.
  const std::vector<int> valid = valid_gpu_layouts(config, layer.options(), R);
  const double E_r = static_cast<double>(layer.experts_per_rank());
  const double P_e = 2.0 * static_cast<double>(config.model_dim) * static_cast<double>(config.hidden_dim);
  LayoutChoice choice;
  choice.by = "cost model";
  for (LayoutEstimate estimate : all.estimates) {
    if (std::find(valid.begin(), valid.end(), estimate.r) == valid.end()) continue;
    const int r = estimate.r;
    if (r == 0) estimate.weight_bytes = (R - 1) * E_r * P_e * 2.0 + 2.0 * (R - 1) * E_r * P_e * 4.0;
    if (r > 1) estimate.weight_bytes = (r - 1) * E_r * P_e / r * (2.0 + 4.0);
    estimate.communication_us = estimate.collectives * model.latency_us +
                                (estimate.weight_bytes + estimate.token_bytes) / model.bytes_per_us;
    estimate.total_us = estimate.communication_us + estimate.compute_us;
    choice.candidates.push_back(r);
    choice.estimates.push_back(estimate);
  }
  size_t best = 0;  // ties keep the smaller r
  for (size_t i = 1; i < choice.estimates.size(); ++i) {
    if (choice.estimates[i].total_us < choice.estimates[best].total_us) best = i;
  }
  choice.r = choice.estimates.at(best).r;
  layer.set_layout(choice.r, choice);
  return choice;
}

LayoutChoice measure_gpu_layouts(ExpertParallelGpu& layer, const bf16* x, int64_t local_tokens,
                                 const ExpertParallelGpuWeights& weights, bf16* y, const bf16* dy,
                                 const ExpertParallelGpuGradients& gradients, cudaStream_t stream,
                                 std::span<const int> candidates, int timed_calls) {
  Communicator& host = layer.exchange().host();
  LayoutChoice choice;
  choice.by = "measurement";
  if (candidates.empty()) {
    choice.candidates = valid_gpu_layouts(layer.config(), layer.options(), host.size());
  } else {
    choice.candidates.assign(candidates.begin(), candidates.end());
    std::sort(choice.candidates.begin(), choice.candidates.end());
  }
  uint64_t fingerprint = fnv1a_64_words({static_cast<uint64_t>(timed_calls)});  // the call count, then the candidates
  for (int r : choice.candidates) fingerprint = fnv1a_64_words({static_cast<uint64_t>(r)}, fingerprint);
  check_same_on_every_rank(host, "measure_gpu_layouts: the candidates and timed_calls", fingerprint);
  if (choice.candidates.empty() || timed_calls < 1) {
    throw std::invalid_argument("measure_gpu_layouts: " + std::to_string(choice.candidates.size()) +
                                " candidates, timed_calls = " + std::to_string(timed_calls) +
                                "; expected at least one candidate and timed_calls >= 1");
  }
  cudaEvent_t start = nullptr, end = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&end));
  try {
    for (int r : choice.candidates) {
      layer.set_layout(r);  // checks r on every rank
      auto call = [&] {
        layer.forward(x, local_tokens, weights, y, stream);
        layer.backward(x, weights, dy, gradients, stream);
      };
      call();  // untimed: the layout's buffers are made here
      std::vector<double> mine;
      for (int i = 0; i < timed_calls; ++i) {
        CUDA_CHECK(cudaEventRecord(start, stream));
        call();
        CUDA_CHECK(cudaEventRecord(end, stream));
        layer.exchange().wait_for_event(end, "measure_gpu_layouts: the end of a timed call");
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
        mine.push_back(1e3 * static_cast<double>(ms));
      }
      const std::vector<double> all = all_gather<double>(host, mine);  // [R, timed_calls]
      std::vector<double> slowest(static_cast<size_t>(timed_calls), 0.0);
      for (int p = 0; p < host.size(); ++p) {
        for (int i = 0; i < timed_calls; ++i) slowest[i] = std::max(slowest[i], all[p * timed_calls + i]);
      }
      std::sort(slowest.begin(), slowest.end());
      choice.measured_us.push_back(slowest[static_cast<size_t>(timed_calls / 2)]);
    }
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(end);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  size_t best = 0;
  for (size_t i = 1; i < choice.measured_us.size(); ++i) {
    if (choice.measured_us[i] < choice.measured_us[best]) best = i;
  }
  choice.r = choice.candidates[best];
  layer.set_layout(choice.r, choice);
  return choice;
}

}  // namespace moe::dist
