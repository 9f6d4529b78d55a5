// test_cache_policy.cpp: the expert cache's host bookkeeping (cuda/offload/cache_policy.h, the
// moe_cache_policy library): LRU, LFU and next-use eviction, pinned slots never evicted, the map consistent
// under random sequences, and the cache's size checks. Plain C++: it builds and runs on every machine,
// with or without CUDA (the GPU side of the cache is tests/cuda/test_offload.cpp).
// Run: ctest --test-dir build -R OffloadPolicy --output-on-failure
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "offload/cache_policy.h"  // ExpertSlotMap, CachePolicy, minimum_cache_slots

namespace {

using moe::cuda::CachePolicy;
using moe::cuda::ExpertSlotMap;

// The message of the std::invalid_argument that `call` throws; "" when it throws none.
template <typename Call>
std::string invalid_argument_message(Call call) {
  try {
    call();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

// Fills slots 0, 1, 2 with experts 0, 1, 2 of block 0, in that order (recency 0 < 1 < 2).
void fill_three(ExpertSlotMap& map) {
  for (int32_t e = 0; e < 3; ++e) {
    ASSERT_EQ(map.choose_victim(), e);  // empty slots first, lowest first
    map.assign(e, 0, e);
  }
}

// ---- the policy, on the CPU ----

TEST(CudaOffloadPolicy, LruEvictsTheLeastRecentlyUsedSlot) {
  ExpertSlotMap map(3, 1, 8, CachePolicy::lru);
  fill_three(map);
  map.record_use(0);                 // recency now 1 < 2 < 0
  EXPECT_EQ(map.choose_victim(), 1);
  map.assign(1, 0, 5);               // expert 1 out, 5 in
  EXPECT_FALSE(map.find(0, 1).has_value());
  EXPECT_EQ(map.find(0, 5), 1);
  EXPECT_EQ(map.holder(1).expert, 5);
  EXPECT_EQ(map.choose_victim(), 2);
  map.record_use(2);                 // recency 0 < 1(5) < 2
  EXPECT_EQ(map.choose_victim(), 0);
  map.touch(0);                      // a prefetch hint counts as recent too
  EXPECT_EQ(map.choose_victim(), 1);
}

TEST(CudaOffloadPolicy, LfuEvictsTheLeastChosenExpertTiesToTheLeastRecent) {
  ExpertSlotMap map(3, 1, 8, CachePolicy::lfu);
  fill_three(map);
  for (int i = 0; i < 3; ++i) map.record_use(0);  // counts: e0 3, e1 1, e2 2
  map.record_use(1);
  map.record_use(2);
  map.record_use(2);
  EXPECT_EQ(map.choose_victim(), 1);
  map.assign(1, 0, 3);  // e3 in (count 0)
  EXPECT_EQ(map.choose_victim(), 1);
  map.record_use(1);    // e3: 1, e2: 2, e0: 3
  EXPECT_EQ(map.choose_victim(), 1);
  map.assign(1, 0, 1);  // e1 back: its count (1) survived the eviction
  EXPECT_EQ(map.use_count(0, 1), 1u);
  map.record_use(1);    // e1: 2 = e2's count; e2 was used longer ago, so e2 goes first
  EXPECT_EQ(map.choose_victim(), 2);
  map.record_use(2);    // e2: 3 = e0's, e1 now lowest
  EXPECT_EQ(map.choose_victim(), 1);
}

// next_use by hand: 3 blocks of 4 experts, weight w = kChosenRateWeight per visit.
TEST(CudaOffloadPolicy, NextUseRanksByTheExpectedVisitsToTheNextUse) {
  const double w = ExpertSlotMap::kChosenRateWeight;
  ExpertSlotMap map(3, 3, 4, CachePolicy::next_use);
  const std::vector<int32_t> e0{0}, e1{1}, none{};
  map.visit(0, e0);  // block 0 chose expert 0: rate w
  EXPECT_DOUBLE_EQ(map.chosen_rate(0, 0), w);
  EXPECT_DOUBLE_EQ(map.chosen_rate(0, 1), 0.0);
  map.visit(0, e1);  // not chosen: w (1 - w); expert 1: w
  EXPECT_DOUBLE_EQ(map.chosen_rate(0, 0), w * (1 - w));
  map.visit(0, e0);  // chosen again: w (1 - w)^2 + w
  EXPECT_DOUBLE_EQ(map.chosen_rate(0, 0), w * (1 - w) * (1 - w) + w);
  EXPECT_DOUBLE_EQ(map.chosen_rate(0, 1), w * (1 - w));
  // From block 0 (the block visited last), block 0 is 3 visits away (a whole step), block 1 one,
  // block 2 two; then 3 (1/p - 1) more. Never chosen: infinitely far.
  const double p00 = map.chosen_rate(0, 0);
  EXPECT_DOUBLE_EQ(map.expected_visits_to_next_use(0, 0), 3 + 3 * (1 / p00 - 1));
  map.visit(1, e0);
  map.visit(2, e0);
  EXPECT_DOUBLE_EQ(map.chosen_rate(1, 0), w);
  EXPECT_DOUBLE_EQ(map.expected_visits_to_next_use(1, 0), 2 + 3 * (1 / w - 1));  // from block 2
  EXPECT_DOUBLE_EQ(map.expected_visits_to_next_use(2, 0), 3 + 3 * (1 / w - 1));
  EXPECT_DOUBLE_EQ(map.expected_visits_to_next_use(0, 0), 1 + 3 * (1 / p00 - 1));
  EXPECT_EQ(map.expected_visits_to_next_use(1, 3), std::numeric_limits<double>::infinity());

  // The victims: the same rate w for (1, 0) and (2, 0); block 2 was just visited, so its expert is
  // wanted last and goes first; an expert never chosen goes before either.
  map.assign(0, 1, 0);
  map.assign(1, 2, 0);
  map.assign(2, 0, 0);
  EXPECT_EQ(map.choose_victim(), 1);
  map.assign(1, 1, 3);  // (1, 3): never chosen
  EXPECT_EQ(map.choose_victim(), 1);
  map.visit(1, std::vector<int32_t>{3});  // now chosen: a rate w at block 1, like (1, 0) after a decay
  EXPECT_EQ(map.choose_victim(), 0);      // (1, 0) decayed to w (1 - w): farther than (1, 3) and (0, 0)
  EXPECT_THROW(map.visit(3, e0), std::invalid_argument);
  EXPECT_THROW(map.visit(-1, none), std::invalid_argument);
  EXPECT_THROW(map.visit(0, std::vector<int32_t>{4}), std::invalid_argument);
}

TEST(CudaOffloadPolicy, PinnedSlotsAreNeverEvicted) {
  for (const CachePolicy policy : {CachePolicy::lru, CachePolicy::lfu, CachePolicy::next_use}) {
    SCOPED_TRACE(moe::cuda::to_string(policy));
    ExpertSlotMap map(3, 2, 4, policy);
    fill_three(map);
    EXPECT_EQ(map.choose_victim(), 0);
    map.pin(0);
    EXPECT_EQ(map.choose_victim(), 1);
    map.pin(1);
    map.pin(2);
    EXPECT_EQ(map.pinned_slots(), 3);
    EXPECT_FALSE(map.choose_victim().has_value());  // every slot in use: nothing to evict
    EXPECT_THROW(map.assign(1, 1, 0), std::logic_error);
    map.pin(1);    // pins count: two holders
    map.unpin(1);
    EXPECT_FALSE(map.choose_victim().has_value());
    map.unpin(1);
    EXPECT_EQ(map.choose_victim(), 1);
    EXPECT_THROW(map.unpin(1), std::logic_error);  // unpinned twice
  }
}

TEST(CudaOffloadPolicy, RandomSequencesKeepTheMapConsistentAndNeverEvictPinnedSlots) {
  for (const CachePolicy policy : {CachePolicy::lru, CachePolicy::lfu, CachePolicy::next_use}) {
    SCOPED_TRACE(moe::cuda::to_string(policy));
    const int64_t slots = 5, blocks = 3, experts = 6;
    ExpertSlotMap map(slots, blocks, experts, policy);
    std::mt19937_64 generator(7);
    std::vector<int> pins(slots, 0);
    for (int step = 0; step < 5000; ++step) {
      const int64_t block = static_cast<int64_t>(generator() % blocks);
      const auto expert = static_cast<int32_t>(generator() % experts);
      const int op = static_cast<int>(generator() % 4);
      if (op == 0) {  // a use: a hit, or a miss into the victim
        map.visit(block, std::vector<int32_t>{expert});
        std::optional<int64_t> slot = map.find(block, expert);
        if (!slot) {
          slot = map.choose_victim();
          if (!slot) continue;
          ASSERT_EQ(pins[static_cast<size_t>(*slot)], 0) << "a pinned slot was chosen to evict";
          map.assign(*slot, block, expert);
        }
        map.record_use(*slot);
      } else if (op == 1) {
        const auto slot = static_cast<int64_t>(generator() % slots);
        if (map.holder(slot).block >= 0 && pins[static_cast<size_t>(slot)] < 2) {
          map.pin(slot);
          ++pins[static_cast<size_t>(slot)];
        }
      } else if (op == 2) {
        const auto slot = static_cast<int64_t>(generator() % slots);
        if (pins[static_cast<size_t>(slot)] > 0) {
          map.unpin(slot);
          --pins[static_cast<size_t>(slot)];
        }
      }
      for (int64_t slot = 0; slot < slots; ++slot) {  // holder and find agree
        const moe::cuda::ExpertKey key = map.holder(slot);
        if (key.block >= 0) {
          ASSERT_EQ(map.find(key.block, key.expert), slot);
        }
        ASSERT_EQ(map.pinned(slot), pins[static_cast<size_t>(slot)] > 0);
      }
    }
  }
}

TEST(CudaOffloadPolicy, CacheSmallerThanOneStepIsAClearError) {
  EXPECT_EQ(moe::cuda::minimum_cache_slots(64, 1, 1), 1);
  EXPECT_EQ(moe::cuda::minimum_cache_slots(64, 8, 2), 16);
  EXPECT_EQ(moe::cuda::minimum_cache_slots(8, 3, 2), 6);
  EXPECT_EQ(moe::cuda::minimum_cache_slots(8, 1000, 2), 8);
  EXPECT_THROW(moe::cuda::minimum_cache_slots(8, 0, 2), std::invalid_argument);
  EXPECT_THROW(moe::cuda::minimum_cache_slots(8, 1, 9), std::invalid_argument);

  const size_t expert_bytes = 4 * 768 * 3072;  // 9.4 MB
  EXPECT_NO_THROW(moe::cuda::check_cache_size(16, 16, 64, 8, 2, expert_bytes));
  const std::string too_small =
      invalid_argument_message([&] { moe::cuda::check_cache_size(15, 16, 64, 8, 2, expert_bytes); });
  for (const char* fragment : {"15 slots", "minimum_cache_slots", "E=64", "8*2", "16 slots", "151.0 MB"}) {
    EXPECT_NE(too_small.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << too_small;
  }

  EXPECT_EQ(moe::cuda::cache_slots_in_megabytes(100, expert_bytes), 10);  // 100 MB / 9.44 MB, rounded down
  EXPECT_EQ(moe::cuda::cache_slots_in_megabytes(5, expert_bytes), 0);
  EXPECT_THROW(moe::cuda::cache_slots_in_megabytes(0, expert_bytes), std::invalid_argument);
  EXPECT_EQ(moe::cuda::cache_policy_from_string("lfu"), CachePolicy::lfu);
  EXPECT_EQ(moe::cuda::cache_policy_from_string("next_use"), CachePolicy::next_use);
  EXPECT_EQ(moe::cuda::to_string(CachePolicy::next_use), "next_use");
  const std::string unknown = invalid_argument_message([] { moe::cuda::cache_policy_from_string("fifo"); });
  EXPECT_NE(unknown.find("'fifo' is not one of: lru, lfu, next_use"), std::string::npos) << unknown;
}

}  // namespace
