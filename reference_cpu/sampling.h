// sampling.h: choosing the next byte from the model's logits: greedy, temperature and top-k, with a
// seed, for Eigen rows. The rule itself is common/byte_sampling.h's, the one GPU generation uses
// too. Part of the CPU reference (moe::ref), used by generate.h; tested by
// tests/reference_cpu/test_generate.cpp (ctest --test-dir build -R ReferenceGenerate).
//
// V = 256 byte values. For one sequence's logits row [V]:
//   temperature == 0   greedy: the byte with the largest logit, ties to the lower byte; draws nothing
//   temperature  > 0   candidates = the bytes by descending logit (ties to the lower byte), cut to
//                      the first top_k when 0 < top_k < V (top-k sampling, Fan et al. 2018);
//                      p_i = exp((logit_i - max) / temperature), normalised over the candidates;
//                      one uniform draw u in [0, 1) picks the first candidate whose running sum of
//                      p exceeds u (the last one if rounding leaves u above the total)
// With top_k == 1 there is one candidate, the greedy byte, for any temperature.
//
// The draws are reproducible on any platform, so a GPU generator can make the same choices: sequence
// n owns std::mt19937_64(seed + n) and takes one 64-bit word per sampled byte,
// u = (word >> 11) * 2^-53 (the jitter's rule in router.h). A sequence's bytes depend on its own
// logits and the seed, not on the other sequences of the batch.
#pragma once

#include <cstdint>
#include <vector>

#include "byte_sampling.h"  // moe::SamplingSettings, moe::ByteSampler: the rule
#include "types.h"

namespace moe::ref {

using SamplingSettings = moe::SamplingSettings;
using moe::validate;

int32_t greedy_byte(const Eigen::Ref<const Eigen::RowVectorXd>& logits);  // [V]

class ByteSampler {
 public:
  ByteSampler(const SamplingSettings& settings, int64_t batch) : rule_(settings, batch) {}

  // The next byte of `sequence` from its logits row; advances that sequence's generator unless greedy.
  int32_t sample(int64_t sequence, const Eigen::Ref<const Eigen::RowVectorXd>& logits);  // [V]

  // One byte per row of next_logits [N, V], row n for sequence n.
  std::vector<int32_t> sample(const Matrix& next_logits);

 private:
  moe::ByteSampler rule_;
};

}  // namespace moe::ref
