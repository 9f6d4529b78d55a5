// offload/cache_policy.cpp: the expert cache's host bookkeeping (see cache_policy.h).
#include "offload/cache_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace moe::cuda {

std::string to_string(CachePolicy policy) {
  switch (policy) {
    case CachePolicy::lru: return "lru";
    case CachePolicy::lfu: return "lfu";
    case CachePolicy::next_use: return "next_use";
  }
  return "?";
}

CachePolicy cache_policy_from_string(std::string_view name) {
  if (name == "lru") return CachePolicy::lru;
  if (name == "lfu") return CachePolicy::lfu;
  if (name == "next_use") return CachePolicy::next_use;
  throw std::invalid_argument("cache policy '" + std::string(name) + "' is not one of: lru, lfu, next_use");
}

int64_t minimum_cache_slots(int64_t experts, int64_t tokens_per_step, int64_t top_k) {
  if (experts <= 0 || tokens_per_step <= 0 || top_k <= 0 || top_k > experts) {
    throw std::invalid_argument("minimum_cache_slots: need E > 0, tokens_per_step > 0 and 0 < K <= E, got E=" +
                                std::to_string(experts) + " tokens_per_step=" + std::to_string(tokens_per_step) +
                                " K=" + std::to_string(top_k));
  }
  // tokens * K may overflow for absurd inputs only; E bounds the answer anyway.
  if (tokens_per_step >= experts) return experts;
  return std::min(experts, tokens_per_step * top_k);
}

namespace {
std::string megabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  return text;
}
}  // namespace

void check_cache_size(int64_t slots, int64_t minimum_slots, int64_t experts, int64_t tokens_per_step,
                      int64_t top_k, size_t expert_bytes) {
  if (slots >= minimum_slots) return;
  throw std::invalid_argument(
      "expert cache of " + std::to_string(slots) + " slots (" +
      megabytes(static_cast<double>(slots) * static_cast<double>(expert_bytes)) +
      ") is smaller than one step needs: minimum_cache_slots = min(E=" + std::to_string(experts) +
      ", tokens_per_step*K=" + std::to_string(tokens_per_step) + "*" + std::to_string(top_k) + ") = " +
      std::to_string(minimum_slots) + " slots (" +
      megabytes(static_cast<double>(minimum_slots) * static_cast<double>(expert_bytes)) + " at " +
      megabytes(static_cast<double>(expert_bytes)) + " per expert)");
}

int64_t cache_slots_in_megabytes(double megabytes_asked, size_t expert_bytes) {
  if (!(megabytes_asked > 0) || expert_bytes == 0) {
    throw std::invalid_argument("cache size in MB must be > 0, got " + std::to_string(megabytes_asked));
  }
  return static_cast<int64_t>(megabytes_asked * 1e6 / static_cast<double>(expert_bytes));
}

// ---- ExpertSlotMap ----

ExpertSlotMap::ExpertSlotMap(int64_t slots, int64_t blocks, int64_t experts, CachePolicy policy)
    : policy_(policy), blocks_(blocks), experts_(experts) {
  if (slots <= 0 || blocks <= 0 || experts <= 0) {
    throw std::invalid_argument("ExpertSlotMap: slots, blocks and experts must be > 0, got " +
                                std::to_string(slots) + ", " + std::to_string(blocks) + ", " +
                                std::to_string(experts));
  }
  holder_.assign(static_cast<size_t>(slots), ExpertKey{});
  pins_.assign(static_cast<size_t>(slots), 0);
  last_use_.assign(static_cast<size_t>(slots), 0);
  slot_of_.assign(static_cast<size_t>(blocks * experts), -1);
  use_counts_.assign(static_cast<size_t>(blocks * experts), 0);
  visits_.assign(static_cast<size_t>(blocks), 0);
  chosen_rate_.assign(static_cast<size_t>(blocks * experts), 0.0);
  rate_visit_.assign(static_cast<size_t>(blocks * experts), 0);
}

size_t ExpertSlotMap::key_index(int64_t block, int32_t expert) const {
  if (block < 0 || block >= blocks_ || expert < 0 || expert >= experts_) {
    throw std::invalid_argument("ExpertSlotMap: (block " + std::to_string(block) + ", expert " +
                                std::to_string(expert) + ") is outside " + std::to_string(blocks_) +
                                " blocks x " + std::to_string(experts_) + " experts");
  }
  return static_cast<size_t>(block * experts_ + expert);
}

void ExpertSlotMap::check_slot(int64_t slot) const {
  if (slot < 0 || slot >= slots()) {
    throw std::invalid_argument("ExpertSlotMap: slot " + std::to_string(slot) + " outside [0, " +
                                std::to_string(slots()) + ")");
  }
}

std::optional<int64_t> ExpertSlotMap::find(int64_t block, int32_t expert) const {
  const int64_t slot = slot_of_[key_index(block, expert)];
  if (slot < 0) return std::nullopt;
  return slot;
}

std::optional<int64_t> ExpertSlotMap::choose_victim() const {
  for (int64_t slot = 0; slot < slots(); ++slot) {
    if (holder_[static_cast<size_t>(slot)].block < 0) return slot;  // empty: nothing to evict
  }
  std::optional<int64_t> victim;
  auto ranks_lower = [&](int64_t a, int64_t b) {  // true when slot a is the better victim
    const auto ia = static_cast<size_t>(a), ib = static_cast<size_t>(b);
    if (policy_ == CachePolicy::lfu) {
      const uint64_t ca = use_counts_[key_index(holder_[ia].block, holder_[ia].expert)];
      const uint64_t cb = use_counts_[key_index(holder_[ib].block, holder_[ib].expert)];
      if (ca != cb) return ca < cb;
    }
    if (policy_ == CachePolicy::next_use) {
      const double na = expected_visits_to_next_use(holder_[ia].block, holder_[ia].expert);
      const double nb = expected_visits_to_next_use(holder_[ib].block, holder_[ib].expert);
      if (na != nb) return na > nb;
    }
    return last_use_[ia] < last_use_[ib];
  };
  for (int64_t slot = 0; slot < slots(); ++slot) {
    if (pins_[static_cast<size_t>(slot)] > 0) continue;
    if (!victim || ranks_lower(slot, *victim)) victim = slot;
  }
  return victim;
}

void ExpertSlotMap::assign(int64_t slot, int64_t block, int32_t expert) {
  check_slot(slot);
  const size_t key = key_index(block, expert);
  if (slot_of_[key] >= 0) {
    throw std::logic_error("ExpertSlotMap::assign: (block " + std::to_string(block) + ", expert " +
                           std::to_string(expert) + ") is already in slot " + std::to_string(slot_of_[key]));
  }
  if (pins_[static_cast<size_t>(slot)] > 0) {
    throw std::logic_error("ExpertSlotMap::assign: slot " + std::to_string(slot) + " is pinned (in use)");
  }
  ExpertKey& old = holder_[static_cast<size_t>(slot)];
  if (old.block >= 0) slot_of_[key_index(old.block, old.expert)] = -1;
  old = ExpertKey{block, expert};
  slot_of_[key] = slot;
  last_use_[static_cast<size_t>(slot)] = ++clock_;
}

void ExpertSlotMap::visit(int64_t block, std::span<const int32_t> chosen) {
  if (block < 0 || block >= blocks_) {
    throw std::invalid_argument("ExpertSlotMap::visit: block " + std::to_string(block) + " is outside [0, " +
                                std::to_string(blocks_) + ")");
  }
  for (const int32_t expert : chosen) key_index(block, expert);  // checks every id before any change
  position_ = block;
  const int64_t visit = ++visits_[static_cast<size_t>(block)];
  for (const int32_t expert : chosen) {
    const size_t key = key_index(block, expert);
    // The average after this visit: the decayed past, plus this visit's weight for being chosen.
    chosen_rate_[key] = chosen_rate(block, expert) + kChosenRateWeight;
    rate_visit_[key] = visit;
  }
}

double ExpertSlotMap::chosen_rate(int64_t block, int32_t expert) const {
  const size_t key = key_index(block, expert);
  const int64_t since = visits_[static_cast<size_t>(block)] - rate_visit_[key];
  return chosen_rate_[key] * std::pow(1.0 - kChosenRateWeight, static_cast<double>(since));
}

double ExpertSlotMap::expected_visits_to_next_use(int64_t block, int32_t expert) const {
  const double p = chosen_rate(block, expert);
  if (!(p > 0)) return std::numeric_limits<double>::infinity();
  // Visits until the decoder is back at `block`: the blocks after the last one visited, in order.
  const int64_t ahead = position_ < 0 ? block + 1 : (block - position_ + blocks_) % blocks_;
  const double d = ahead == 0 ? static_cast<double>(blocks_) : static_cast<double>(ahead);
  return d + static_cast<double>(blocks_) * (1.0 / p - 1.0);
}

void ExpertSlotMap::record_use(int64_t slot) {
  check_slot(slot);
  const ExpertKey key = holder_[static_cast<size_t>(slot)];
  if (key.block < 0) throw std::logic_error("ExpertSlotMap::record_use: slot " + std::to_string(slot) + " is empty");
  ++use_counts_[key_index(key.block, key.expert)];
  last_use_[static_cast<size_t>(slot)] = ++clock_;
}

void ExpertSlotMap::touch(int64_t slot) {
  check_slot(slot);
  last_use_[static_cast<size_t>(slot)] = ++clock_;
}

void ExpertSlotMap::pin(int64_t slot) {
  check_slot(slot);
  ++pins_[static_cast<size_t>(slot)];
}

void ExpertSlotMap::unpin(int64_t slot) {
  check_slot(slot);
  if (pins_[static_cast<size_t>(slot)] == 0) {
    throw std::logic_error("ExpertSlotMap::unpin: slot " + std::to_string(slot) + " is not pinned");
  }
  --pins_[static_cast<size_t>(slot)];
}

int64_t ExpertSlotMap::pinned_slots() const {
  return std::count_if(pins_.begin(), pins_.end(), [](int32_t pins) { return pins > 0; });
}

uint64_t ExpertSlotMap::use_count(int64_t block, int32_t expert) const {
  return use_counts_[key_index(block, expert)];
}

}  // namespace moe::cuda
