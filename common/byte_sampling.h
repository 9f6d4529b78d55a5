// byte_sampling.h: the rule that picks the next byte from a model's logits: greedy, temperature and
// top-k, with a seed. One copy, in plain C++, so that the CPU reference (reference_cpu/sampling.h,
// Eigen rows) and GPU generation (cuda/infer/sampling.h, downloaded fp32 logits) pick the same byte
// from the same logits. Tested through both: tests/reference_cpu/test_generate.cpp and
// tests/cuda/test_infer.cpp (CudaInferSampling, which runs without a GPU).
//
// V = 256 byte values. For one sequence's logits [V]:
//   temperature == 0   greedy: the byte with the largest logit, ties to the lower byte; draws nothing
//   temperature  > 0   candidates = the bytes by descending logit (stable: ties to the lower byte),
//                      cut to the first top_k when 0 < top_k < V (top-k sampling, Fan et al. 2018);
//                      p_i = exp((logit_i - max) / temperature), normalised over the candidates;
//                      one uniform draw u = (word >> 11) * 2^-53 of the sequence's
//                      std::mt19937_64(seed + n) picks the first candidate whose running sum of p
//                      exceeds u (the last one if rounding leaves u above the total)
// With top_k == 1 there is one candidate, the greedy byte, for any temperature.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace moe {

inline constexpr int64_t kSampledByteValues = 256;  // V

struct SamplingSettings {
  double temperature = 0.0;  // 0: greedy; > 0: sample from softmax(logits / temperature)
  int64_t top_k = 0;         // 0 or V: every byte is a candidate; 1..V-1: the top_k most likely
  uint64_t seed = 0;         // sequence n draws from std::mt19937_64(seed + n)
};

// Throws std::invalid_argument naming the field, its value and what is allowed.
void validate(const SamplingSettings& settings);

// The largest logit's byte, ties to the lower byte. Throws std::invalid_argument for a row that is
// not [V] or holds a logit that is not finite (naming it).
int32_t greedy_byte(std::span<const double> logits);  // [V]

class ByteSampler {
 public:
  ByteSampler(const SamplingSettings& settings, int64_t batch);  // batch: N sequences

  // The next byte of `sequence` from its logits [V]; advances that sequence's generator unless greedy.
  int32_t sample(int64_t sequence, std::span<const double> logits);

  int64_t batch() const { return static_cast<int64_t>(generators_.size()); }

 private:
  SamplingSettings settings_;
  std::vector<std::mt19937_64> generators_;  // [N]
};

}  // namespace moe
