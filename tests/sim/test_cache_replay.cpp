// test_cache_replay.cpp: moe_sim's replay of offloaded decoding (distributed/sim/cache_replay.h).
// The bundled recorded runs (notebooks_data/runs/offload_switch_*, generate_*) replayed through the
// expert cache's own eviction code give their recorded hits, misses, used prefetches and bytes in
// every step and block; Belady's policy never misses more than LRU or LFU; short request sequences
// give the misses worked out by hand; the predicted decode step is within 10% of the measured one;
// bad input is a clear error. Plain C++, no GPU.
// Run: ctest --test-dir build -R SimCacheReplay --output-on-failure   (from the repository root)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sim/cache_replay.h"

namespace {

using moe::sim::CacheReplay;
using moe::sim::OffloadBlockRecord;
using moe::sim::OffloadTrace;
using moe::sim::ReplayPolicy;

const std::string kRuns = "notebooks_data/runs/";
const std::vector<std::string> kRecordedRuns = {
    "offload_switch_on_demand",     "offload_switch_prefetch_all",  "offload_switch_pregated",
    "offload_switch_speculative",   "generate_pregated_on_demand",  "generate_pregated_prefetch_all",
    "generate_pregated_pregated",   "generate_pregated_speculative", "generate_self_speculative"};

// A trace of one MoE block of E experts that acquires one expert a step: requests "ABAC" -> 0 1 0 2.
OffloadTrace one_block_trace(const std::string& requests, int64_t slots) {
  OffloadTrace trace;
  trace.source = "requests " + requests;
  trace.mode = "on_demand";
  trace.policy = "lru";
  trace.cache_slots = slots;
  trace.experts = 26;
  trace.top_k = 1;
  trace.expert_bytes = 1000;
  trace.layers = {0};
  for (const char request : requests) {
    OffloadBlockRecord block;
    block.experts = {static_cast<int32_t>(request - 'A')};
    trace.steps.push_back({block});
    trace.spans.emplace_back();
  }
  return trace;
}

// Misses over every request, the first included.
int64_t misses(const std::string& requests, int64_t slots, ReplayPolicy policy) {
  return moe::sim::replay(one_block_trace(requests, slots), slots, policy, false).misses(0);
}

template <typename Call>
void expect_invalid(Call call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one naming '" << fragment << "'";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

// ---- the recorded runs ----

TEST(SimCacheReplay, RecordedRunsReplayExactly) {
  for (const std::string& run : kRecordedRuns) {
    SCOPED_TRACE(run);
    const OffloadTrace trace = moe::sim::read_offload_trace(kRuns + run);
    const CacheReplay replay = moe::sim::replay_recorded(trace);
    ASSERT_EQ(replay.steps.size(), trace.steps.size());
    EXPECT_EQ(moe::sim::first_difference(trace, replay), "");
    for (size_t s = 0; s < trace.steps.size(); ++s) {
      for (size_t j = 0; j < trace.steps[s].size(); ++j) {
        ASSERT_EQ(replay.steps[s].blocks[j].hits, trace.steps[s][j].hits) << "step " << s << " block " << j;
        ASSERT_EQ(replay.steps[s].blocks[j].misses, trace.steps[s][j].misses) << "step " << s << " block " << j;
      }
    }
  }
}

TEST(SimCacheReplay, BeladyNeverMissesMoreThanLruLfuOrNextUse) {
  for (const std::string& run : kRecordedRuns) {
    SCOPED_TRACE(run);
    const OffloadTrace trace = moe::sim::read_offload_trace(kRuns + run);
    for (const int64_t slots : {trace.minimum_slots(), trace.minimum_slots() + 4, 2 * trace.minimum_slots()}) {
      const int64_t belady = moe::sim::replay(trace, slots, ReplayPolicy::belady, false).misses(0);
      EXPECT_LE(belady, moe::sim::replay(trace, slots, ReplayPolicy::lru, false).misses(0)) << slots << " slots";
      EXPECT_LE(belady, moe::sim::replay(trace, slots, ReplayPolicy::lfu, false).misses(0)) << slots << " slots";
      EXPECT_LE(belady, moe::sim::replay(trace, slots, ReplayPolicy::next_use, false).misses(0)) << slots << " slots";
    }
  }
}

TEST(SimCacheReplay, PredictedDecodeStepWithinTenPercentOfTheMeasured) {
  for (const std::string& run : kRecordedRuns) {
    SCOPED_TRACE(run);
    const OffloadTrace trace = moe::sim::read_offload_trace(kRuns + run);
    const double gbs = moe::sim::measured_copy_gbs(trace);
    ASSERT_GT(gbs, 0);
    const moe::sim::StepTimePrediction time = moe::sim::predict_step_times(trace, moe::sim::replay_recorded(trace), gbs);
    EXPECT_EQ(time.steps.size() + 1, trace.steps.size());  // every decode step, not the prefill
    EXPECT_LT(std::abs(time.error()), 0.10) << time.median_predicted_us << " us against " << time.median_measured_us;
  }
}

// ---- by hand ----

TEST(SimCacheReplay, TwoSlotsABACBByHand) {
  // LRU: A miss, B miss, A hit, C evicts B (used longest ago), B evicts A: 4 misses.
  EXPECT_EQ(misses("ABACB", 2, ReplayPolicy::lru), 4);
  // LFU: at C, A was chosen twice and B once: B goes; at B, C (once) goes: 4 misses.
  EXPECT_EQ(misses("ABACB", 2, ReplayPolicy::lfu), 4);
  // Belady: at C, A is never used again and B is: A goes, and B hits: 3 misses.
  EXPECT_EQ(misses("ABACB", 2, ReplayPolicy::belady), 3);
}

TEST(SimCacheReplay, TwoSlotsAABCAByHand) {
  // LRU: A miss, A hit, B miss, C evicts A (its last use is older than B's load), A misses: 4.
  EXPECT_EQ(misses("AABCA", 2, ReplayPolicy::lru), 4);
  // LFU: at C, A (twice) stays and B (once) goes; A hits: 3.
  EXPECT_EQ(misses("AABCA", 2, ReplayPolicy::lfu), 3);
  // Belady: at C, B is never used again: it goes; A hits: 3.
  EXPECT_EQ(misses("AABCA", 2, ReplayPolicy::belady), 3);
  // Every distinct expert fits: only the cold misses, whatever the policy.
  for (const ReplayPolicy policy : {ReplayPolicy::lru, ReplayPolicy::lfu, ReplayPolicy::next_use, ReplayPolicy::belady}) {
    EXPECT_EQ(misses("AABCA", 3, policy), 3);
  }
}

// M MoE blocks visited in order, each choosing `chosen(step, block)`; demand fetching.
template <typename Chosen>
OffloadTrace blocks_trace(int64_t blocks, int64_t experts, int64_t steps, int64_t slots, Chosen chosen) {
  OffloadTrace trace = one_block_trace("", slots);
  trace.experts = experts;
  trace.layers.clear();
  for (int64_t j = 0; j < blocks; ++j) trace.layers.push_back(j);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<OffloadBlockRecord> step;
    for (int64_t j = 0; j < blocks; ++j) {
      OffloadBlockRecord block;
      block.layer = j;
      block.experts = chosen(s, j);
      step.push_back(block);
    }
    trace.steps.push_back(step);
    trace.spans.emplace_back();
  }
  return trace;
}

TEST(SimCacheReplay, AStepLargerThanTheCacheNextUseMissesAsBeladyAndLruEveryTime) {
  // Three blocks each choosing expert 0, every step, through two slots: a cycle of three requests.
  // LRU evicts the block visited longest ago, which is the one visited next: every request misses.
  // next_use gives up the block just visited, as Belady does, once its rates have settled (in the
  // first steps block 0 has been seen more often than the others): every other request hits.
  const OffloadTrace trace = blocks_trace(3, 4, 30, 2, [](int64_t, int64_t) { return std::vector<int32_t>{0}; });
  const size_t settled = 10;  // misses from step 10 on: 20 steps, 60 requests
  const int64_t lru = moe::sim::replay(trace, 2, ReplayPolicy::lru, false).misses(settled);
  const int64_t next_use = moe::sim::replay(trace, 2, ReplayPolicy::next_use, false).misses(settled);
  const int64_t belady = moe::sim::replay(trace, 2, ReplayPolicy::belady, false).misses(settled);
  EXPECT_EQ(lru, 60);
  EXPECT_EQ(next_use, belady);
  EXPECT_EQ(belady, 30);
}

TEST(SimCacheReplay, UniformRoutingThatDoesNotFitNextUseCopiesFarLessThanLru) {
  // The large-expert shape at batch 4: 4 blocks of 8 experts, 4 tokens of top-2 a block (about 6.6
  // distinct experts), 16 slots: the step needs about 27 experts. Seeded, so the counts are fixed.
  std::mt19937_64 generator(5);
  const OffloadTrace trace = blocks_trace(4, 8, 200, 16, [&](int64_t, int64_t) {
    std::set<int32_t> chosen;
    for (int token = 0; token < 4; ++token) {
      const auto first = static_cast<int32_t>(generator() % 8);
      const auto second = static_cast<int32_t>((first + 1 + generator() % 7) % 8);
      chosen.insert(first);
      chosen.insert(second);
    }
    return std::vector<int32_t>(chosen.begin(), chosen.end());
  });
  const int64_t lru = moe::sim::replay(trace, 16, ReplayPolicy::lru, false).misses();
  const int64_t next_use = moe::sim::replay(trace, 16, ReplayPolicy::next_use, false).misses();
  const int64_t belady = moe::sim::replay(trace, 16, ReplayPolicy::belady, false).misses();
  EXPECT_LT(next_use, 0.75 * static_cast<double>(lru)) << next_use << " against LRU's " << lru;
  EXPECT_LE(belady, next_use);
}

TEST(SimCacheReplay, AHeldBlockIsAlwaysAHitAndLeavesTheCacheToTheOthers) {
  // Block 0 asks for a new expert every step, block 1 always for expert 0, through one slot: block
  // 0's misses evict block 1's expert every step. With block 0 held on the GPU, its requests are
  // hits that copy nothing, and block 1 misses once.
  const OffloadTrace trace = blocks_trace(2, 4, 12, 1, [](int64_t s, int64_t j) {
    return std::vector<int32_t>{j == 0 ? static_cast<int32_t>(s % 4) : 0};
  });
  for (const ReplayPolicy policy : {ReplayPolicy::lru, ReplayPolicy::next_use, ReplayPolicy::belady}) {
    const CacheReplay cached = moe::sim::replay(trace, 1, policy, false);
    EXPECT_EQ(cached.misses(0), 24) << moe::sim::to_string(policy);
    const CacheReplay held = moe::sim::replay(trace, 1, policy, false, {0});
    EXPECT_EQ(held.misses(0), 1) << moe::sim::to_string(policy);
    for (const moe::sim::ReplayedStep& step : held.steps) {
      EXPECT_EQ(step.blocks[0].hits, 1);
      EXPECT_EQ(step.blocks[0].misses + step.blocks[0].bytes, 0);
      for (const moe::sim::ReplayedCopy& copy : step.copies) EXPECT_NE(copy.block, 0);
    }
    EXPECT_DOUBLE_EQ(held.hit_rate(0), 23.0 / 24.0);
  }
  expect_invalid([&] { moe::sim::replay(trace, 1, ReplayPolicy::lru, false, {2}); }, "held MoE block 2; allowed");
  expect_invalid([&] { moe::sim::replay(trace, 1, ReplayPolicy::lru, false, {1, 1}); }, "twice");
  expect_invalid([&] { moe::sim::replay(trace, 1, ReplayPolicy::lru, false, {0, 1}); }, "all 2");
}

TEST(SimCacheReplay, APrefetchThatIsUsedIsAHitAndItsCopyOverlapsTheBlockBefore) {
  // Two blocks; block 1's hint (expert 5) is given in block 0's acquire, and block 1 uses it.
  OffloadTrace trace = one_block_trace("A", 4);
  trace.layers = {0, 1};
  OffloadBlockRecord next;
  next.experts = {5};
  next.prefetched = {5};
  trace.steps[0].push_back(next);
  const CacheReplay replay = moe::sim::replay_recorded(trace);
  const moe::sim::ReplayedBlock& block1 = replay.steps[0].blocks[1];
  EXPECT_EQ(block1.hits, 1);
  EXPECT_EQ(block1.misses, 0);
  EXPECT_EQ(block1.prefetched, 1);
  EXPECT_EQ(block1.prefetched_used, 1);
  EXPECT_EQ(block1.bytes, 1000);
  ASSERT_EQ(replay.steps[0].copies.size(), 2u);
  EXPECT_TRUE(replay.steps[0].copies[0].on_demand);   // block 0's miss first,
  EXPECT_FALSE(replay.steps[0].copies[1].on_demand);  // then the prefetch, issued in block 0's acquire
  EXPECT_EQ(replay.steps[0].copies[1].issued_in, 0);
}

// ---- bad input ----

TEST(SimCacheReplay, BadInputIsAClearError) {
  expect_invalid([] { moe::sim::read_offload_trace(kRuns + "offload_switch_gpu_only"); }, "gpu_only");
  expect_invalid([] { moe::sim::read_offload_trace(kRuns + "train_dense_seed1"); }, "no offload events");
  expect_invalid([] { moe::sim::read_offload_trace(kRuns + "no_such_run"); }, "not a readable run record");
  const OffloadTrace trace = moe::sim::read_offload_trace(kRuns + "offload_switch_on_demand");
  EXPECT_EQ(trace.minimum_slots(), 8);  // the prefill: 8 prompt bytes, top-1, up to 8 distinct experts
  expect_invalid([&] { moe::sim::replay(trace, 7, ReplayPolicy::lru, false); }, "minimum of 8");
  expect_invalid([&] { moe::sim::replay(trace, 8, ReplayPolicy::belady, true); }, "without prefetch");
  expect_invalid([] { moe::sim::replay_policy_from_string("fifo"); }, "lru, lfu, next_use, belady");
  EXPECT_EQ(moe::sim::replay_policy_from_string("belady"), ReplayPolicy::belady);
}

}  // namespace
