// infer/sampling.h: choosing the next byte from the logits that a GPU decoding step downloads
// ([N, V] fp32): greedy, temperature and top-k, with a seed. Host code, built into moe_cuda;
// tested against moe::ref::ByteSampler by tests/cuda/test_infer.cpp (ctest --test-dir build -R
// CudaInferSampling; runs without a GPU).
//
// The rule is common/byte_sampling.h's, the one the CPU reference uses too, so that the oracle and
// the GPU pick the same byte from the same logits (the fp32 logits are widened to double, exactly).
// Sampling on the host costs one download of N x 256 floats per step, which the step's host
// synchronisation pays anyway; it keeps the rule in one readable place.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "byte_sampling.h"  // moe::SamplingSettings, moe::ByteSampler: the rule

namespace moe::cuda {

inline constexpr int64_t kByteValues = moe::kSampledByteValues;  // V

using SamplingSettings = moe::SamplingSettings;
using moe::validate;

class ByteSampler {
 public:
  ByteSampler(const SamplingSettings& settings, int64_t batch) : rule_(settings, batch) {}

  // The next byte of `sequence` from its logits [V]; advances its generator unless greedy.
  // Throws std::invalid_argument for a row that is not [V] or a logit that is not finite (naming it).
  int32_t sample(int64_t sequence, std::span<const float> logits);
  // One byte per row of next_logits [N, V].
  std::vector<int32_t> sample(std::span<const float> next_logits);

 private:
  moe::ByteSampler rule_;
};

}  // namespace moe::cuda
