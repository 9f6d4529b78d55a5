// infer/generate.cpp: prefill, sample, decode, repeat (see infer/generate.h).
#include "infer/generate.h"

#include <stdexcept>
#include <string>

namespace moe::cuda {

Generation generate(InferenceModelGpu& model, const std::vector<std::vector<int32_t>>& prompts,
                    int64_t max_new_bytes, const SamplingSettings& sampling, const OnBytes& on_bytes) {
  validate(sampling);
  const int64_t S = model.config().seq_len, N = model.config().batch;
  if (max_new_bytes < 1) {
    throw std::invalid_argument("max_new_bytes = " + std::to_string(max_new_bytes) + "; expected >= 1");
  }
  for (size_t n = 0; n < prompts.size(); ++n) {
    const int64_t needed = static_cast<int64_t>(prompts[n].size()) + max_new_bytes - 1;
    if (needed > S) {
      throw std::invalid_argument("prompt " + std::to_string(n) + " has " + std::to_string(prompts[n].size()) +
                                  " bytes; with max_new_bytes = " + std::to_string(max_new_bytes) + " it needs " +
                                  std::to_string(needed) + " positions, and the context holds S = " +
                                  std::to_string(S));
    }
  }
  ByteSampler sampler(sampling, N);
  Generation generation;
  generation.bytes.resize(size_t(N));
  generation.steps.push_back(model.prefill(prompts));
  for (int64_t produced = 1;; ++produced) {
    const std::vector<int32_t> next = sampler.sample(generation.steps.back().next_logits);
    for (int64_t n = 0; n < N; ++n) generation.bytes[size_t(n)].push_back(next[size_t(n)]);
    if (on_bytes) on_bytes(produced - 1, next);
    if (produced == max_new_bytes) break;
    generation.steps.push_back(model.decode_step(next));
  }
  return generation;
}

}  // namespace moe::cuda
