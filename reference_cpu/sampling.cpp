// sampling.cpp: Eigen rows handed to the rule of common/byte_sampling.h (see sampling.h).
#include "sampling.h"

#include <span>
#include <stdexcept>
#include <string>

namespace moe::ref {

namespace {

// An Eigen::Ref<const RowVectorXd> is contiguous (Eigen copies a strided row into a temporary).
std::span<const double> span_of(const Eigen::Ref<const Eigen::RowVectorXd>& logits) {
  return {logits.data(), static_cast<size_t>(logits.size())};
}

}  // namespace

int32_t greedy_byte(const Eigen::Ref<const Eigen::RowVectorXd>& logits) { return moe::greedy_byte(span_of(logits)); }

int32_t ByteSampler::sample(int64_t sequence, const Eigen::Ref<const Eigen::RowVectorXd>& logits) {
  return rule_.sample(sequence, span_of(logits));
}

std::vector<int32_t> ByteSampler::sample(const Matrix& next_logits) {
  if (next_logits.rows() != rule_.batch()) {
    throw std::invalid_argument("next_logits have " + std::to_string(next_logits.rows()) +
                                " rows; expected one per sequence, N = " + std::to_string(rule_.batch()));
  }
  std::vector<int32_t> bytes;
  for (int64_t n = 0; n < next_logits.rows(); ++n) bytes.push_back(sample(n, next_logits.row(n)));
  return bytes;
}

}  // namespace moe::ref
