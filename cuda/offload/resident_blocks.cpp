// offload/resident_blocks.cpp: a few MoE blocks held on the GPU, the rest from an expert cache (see
// resident_blocks.h).
#include "offload/resident_blocks.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moe::cuda {

namespace {

std::vector<int64_t> checked_blocks(std::span<const int64_t> blocks, int64_t moe_blocks) {
  std::vector<int64_t> sorted(blocks.begin(), blocks.end());
  std::sort(sorted.begin(), sorted.end());
  const std::string allowed = "allowed: MoE block indices from 0 to " + std::to_string(moe_blocks - 1) +
                              ", each once, fewer than all " + std::to_string(moe_blocks) +
                              " (every block resident is gpu_only)";
  if (sorted.empty()) throw std::invalid_argument("resident blocks: none given; " + allowed);
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= moe_blocks) {
      throw std::invalid_argument("resident blocks: MoE block " + std::to_string(sorted[i]) + "; " + allowed);
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      throw std::invalid_argument("resident blocks: MoE block " + std::to_string(sorted[i]) + " twice; " + allowed);
    }
  }
  if (int64_t(sorted.size()) == moe_blocks) {
    throw std::invalid_argument("resident blocks: all " + std::to_string(moe_blocks) + " MoE blocks; " + allowed);
  }
  return sorted;
}

}  // namespace

std::vector<int64_t> parse_resident_blocks(const std::string& text, int64_t moe_blocks) {
  std::vector<int64_t> blocks;
  size_t begin = 0;
  while (!text.empty()) {  // every comma-separated part, empty ones included
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string part = text.substr(begin, end - begin);
    size_t used = 0;
    long long value = -1;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (part.empty() || used != part.size()) {
      throw std::invalid_argument("resident blocks: '" + part + "' in '" + text +
                                  "' is not a block index; allowed: a comma-separated list such as 0 or 0,3");
    }
    blocks.push_back(value);
    if (end == text.size()) break;
    begin = end + 1;
  }
  return checked_blocks(blocks, moe_blocks);
}

ResidentBlocks::ResidentBlocks(const PinnedExpertStore& store, std::span<const int64_t> blocks, ExpertSource& rest)
    : blocks_(checked_blocks(blocks, store.shape().blocks)), held_(store, blocks_), rest_(rest) {}

ExpertTables ResidentBlocks::acquire(int64_t block, std::span<const int32_t> experts, cudaStream_t compute) {
  return held_.resident(block) ? held_.acquire(block, experts, compute) : rest_.acquire(block, experts, compute);
}

void ResidentBlocks::release(int64_t block, cudaStream_t compute) {
  if (held_.resident(block)) {
    held_.release(block, compute);
  } else {
    rest_.release(block, compute);
  }
}

void ResidentBlocks::prefetch(int64_t block, std::span<const int32_t> experts) {
  if (!held_.resident(block)) rest_.prefetch(block, experts);
}

ExpertTables ResidentBlocks::acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                               cudaStream_t compute) {
  return held_.resident(block) ? held_.acquire(block, {}, compute)
                               : rest_.acquire_on_device(block, top_experts, slots, compute);
}

void ResidentBlocks::prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                        cudaStream_t compute) {
  if (!held_.resident(block)) rest_.prefetch_on_device(block, top_experts, slots, compute);
}

ExpertSource::HostPick ResidentBlocks::choose_host_experts(int64_t block, std::span<const int32_t> experts,
                                                           std::span<const int64_t> rows, bool chosen_ahead) {
  if (held_.resident(block)) return {};
  return rest_.choose_host_experts(block, experts, rows, chosen_ahead);
}

void ResidentBlocks::host_forward(int64_t block, int32_t expert, std::span<const float> x, int64_t rows,
                                  std::span<float> y) {
  if (held_.resident(block)) {
    throw std::logic_error("resident blocks: MoE block " + std::to_string(block) +
                           " is on the GPU; none of its experts is computed on the host");
  }
  rest_.host_forward(block, expert, x, rows, y);
}

}  // namespace moe::cuda
