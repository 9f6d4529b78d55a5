// infer/sampling.cpp: downloaded fp32 logits handed to the rule of common/byte_sampling.h (see
// infer/sampling.h).
#include "infer/sampling.h"

#include <stdexcept>
#include <string>

namespace moe::cuda {

int32_t ByteSampler::sample(int64_t sequence, std::span<const float> logits) {
  // Widened to double (exact), the precision the rule and the CPU reference compare in.
  const std::vector<double> widened(logits.begin(), logits.end());
  return rule_.sample(sequence, widened);
}

std::vector<int32_t> ByteSampler::sample(std::span<const float> next_logits) {
  const size_t N = static_cast<size_t>(rule_.batch());
  if (next_logits.size() != N * kByteValues) {
    throw std::invalid_argument("next_logits have " + std::to_string(next_logits.size()) + " values; expected N x V = " +
                                std::to_string(N) + " x " + std::to_string(kByteValues));
  }
  std::vector<int32_t> bytes;
  for (size_t n = 0; n < N; ++n) bytes.push_back(sample(int64_t(n), next_logits.subspan(n * kByteValues, kByteValues)));
  return bytes;
}

}  // namespace moe::cuda
