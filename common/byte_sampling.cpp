// byte_sampling.cpp: greedy, temperature and top-k choice of the next byte (see byte_sampling.h).
#include "byte_sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include "config_rejection.h"  // ConfigRejection, number_text

namespace moe {

namespace {

void check_logits(std::span<const double> logits) {
  if (static_cast<int64_t>(logits.size()) != kSampledByteValues) {
    throw std::invalid_argument("logits have " + std::to_string(logits.size()) + " entries; expected V = " +
                                std::to_string(kSampledByteValues));
  }
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isfinite(logits[i])) continue;
    std::ostringstream message;
    message << "logits[" << i << "] = " << logits[i] << "; expected a finite number";
    throw std::invalid_argument(message.str());
  }
}

}  // namespace

void validate(const SamplingSettings& s) {
  constexpr ConfigRejection reject{"sampling"};
  if (!std::isfinite(s.temperature) || s.temperature < 0.0) {
    reject("temperature", number_text(s.temperature), "a finite number >= 0 (0 = greedy)");
  }
  if (s.top_k < 0 || s.top_k > kSampledByteValues) {
    reject("top_k", std::to_string(s.top_k), "0 (every byte) to V = " + std::to_string(kSampledByteValues));
  }
}

int32_t greedy_byte(std::span<const double> logits) {
  check_logits(logits);
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: an equal logit keeps the lower byte
  }
  return static_cast<int32_t>(best);
}

ByteSampler::ByteSampler(const SamplingSettings& settings, int64_t batch) : settings_(settings) {
  validate(settings);
  if (batch < 1) throw std::invalid_argument("sampler batch (N) = " + std::to_string(batch) + "; expected N >= 1");
  for (int64_t n = 0; n < batch; ++n) generators_.emplace_back(settings.seed + static_cast<uint64_t>(n));
}

int32_t ByteSampler::sample(int64_t sequence, std::span<const double> logits) {
  if (sequence < 0 || sequence >= batch()) {
    throw std::invalid_argument("sequence " + std::to_string(sequence) + " is outside the sampler's batch of " +
                                std::to_string(batch()));
  }
  if (settings_.temperature == 0.0) return greedy_byte(logits);
  check_logits(logits);

  std::vector<int32_t> candidates(kSampledByteValues);
  std::iota(candidates.begin(), candidates.end(), 0);
  // Descending logit; stable, so equal logits keep the lower byte first.
  std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (settings_.top_k > 0) candidates.resize(static_cast<size_t>(settings_.top_k));

  const double max_logit = logits[candidates.front()];
  std::vector<double> weights(candidates.size());
  double total = 0.0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    weights[i] = std::exp((logits[candidates[i]] - max_logit) / settings_.temperature);
    total += weights[i];
  }
  const double u = static_cast<double>(generators_[sequence]() >> 11) * 0x1.0p-53;
  double running = 0.0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    running += weights[i] / total;
    if (running > u) return candidates[i];
  }
  return candidates.back();
}

}  // namespace moe
