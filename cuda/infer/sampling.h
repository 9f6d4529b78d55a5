// infer/sampling.h: choosing the next byte from the logits that a GPU decoding step downloads
// ([N, V] fp32): greedy, temperature and top-k, with a seed. Host code, built into moe_cuda;
// tested against moe::ref::ByteSampler by tests/cuda/test_infer.cpp (ctest --test-dir build -R
// CudaInferSampling; runs without a GPU).
//
// The rule is reference_cpu/sampling.h's, step for step and in double, so that the CPU oracle and
// the GPU pick the same byte from the same logits (the cuda library does not link the Eigen
// reference, hence a copy of the rule rather than a call):
//   temperature == 0   greedy: the largest logit, ties to the lower byte; draws nothing
//   temperature  > 0   candidates by descending logit (stable: ties to the lower byte), cut to the
//                      first top_k when 0 < top_k < V; p_i = exp((logit_i - max) / temperature)
//                      normalised over them; one uniform draw u = (word >> 11) * 2^-53 of the
//                      sequence's std::mt19937_64(seed + n) picks the first candidate whose running
//                      sum of p exceeds u (the last if rounding leaves u above the total)
// Sampling on the host costs one download of N x 256 floats per step, which the step's host
// synchronisation pays anyway; it keeps the rule in one readable place.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace moe::cuda {

inline constexpr int64_t kByteValues = 256;  // V

struct SamplingSettings {
  double temperature = 0.0;  // 0: greedy; > 0: sample from softmax(logits / temperature)
  int64_t top_k = 0;         // 0 or V: every byte a candidate; 1..V-1: the top_k most likely
  uint64_t seed = 0;         // sequence n draws from std::mt19937_64(seed + n)
};

// Throws std::invalid_argument naming the field: temperature finite and >= 0, 0 <= top_k <= V.
void validate(const SamplingSettings& settings);

class ByteSampler {
 public:
  ByteSampler(const SamplingSettings& settings, int64_t batch);

  // The next byte of `sequence` from its logits [V]; advances its generator unless greedy.
  // Throws std::invalid_argument for a logit that is not finite (naming it).
  int32_t sample(int64_t sequence, std::span<const float> logits);
  // One byte per row of next_logits [N, V].
  std::vector<int32_t> sample(std::span<const float> next_logits);

 private:
  SamplingSettings settings_;
  std::vector<std::mt19937_64> generators_;  // [N]
};

}  // namespace moe::cuda
