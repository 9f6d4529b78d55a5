// test_host_expert_choice.cpp: the copy-or-compute split of a block's missing experts
// (cuda/offload/host_expert_choice.h). The cost model's answer is checked against trying every
// subset of the misses (the optimum of max(copies, host work) by brute force), and on cases worked
// by hand; the two fixed modes and the error messages are checked as written.
// Plain C++: runs on every machine, CI included.
//   ctest --test-dir build -R HostExpertChoice --output-on-failure
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "offload/host_expert_choice.h"

namespace {

using moe::cuda::choose_host_experts;
using moe::cuda::HostExpertCosts;
using moe::cuda::HostExperts;
using moe::cuda::predicted_miss_ms;

TEST(HostExpertChoice, WorkedByHand) {
  // A copy takes 4 ms; the host takes 5 ms for one row, 6 for two, 7 for three.
  const HostExpertCosts costs{4.0, {5.0, 6.0, 7.0}};
  // One miss: copying (4 ms) beats the host (5 ms).
  EXPECT_TRUE(choose_host_experts(HostExperts::cost_model, std::vector<int32_t>{3}, std::vector<int64_t>{1}, costs)
                  .empty());
  // Two misses of one row: both copied 8 ms; one on the host max(4, 5) = 5 ms; both there 10 ms.
  const std::vector<int32_t> two{6, 2};
  EXPECT_EQ(choose_host_experts(HostExperts::cost_model, two, std::vector<int64_t>{1, 1}, costs),
            std::vector<int32_t>{2});  // equal host times: the smaller id goes
  // The one with fewer rows goes to the host: expert 6 has 1 row, expert 2 has 3.
  EXPECT_EQ(choose_host_experts(HostExperts::cost_model, two, std::vector<int64_t>{1, 3}, costs),
            std::vector<int32_t>{6});
  EXPECT_DOUBLE_EQ(predicted_miss_ms(two, std::vector<int64_t>{1, 3}, std::vector<int32_t>{6}, costs), 5.0);
  // Work already queued. The host busy for 3 ms: two misses of one row both copied finish at 8 ms,
  // one on the host at max(4, 3 + 5) = 8: a tie, so both are copied.
  EXPECT_TRUE(choose_host_experts(HostExperts::cost_model, two, std::vector<int64_t>{1, 1}, costs, {0.0, 3.0}).empty());
  // A host slower than a copy (5 ms against 4) still takes a lone miss when the copy engine has
  // 2 ms of copies queued ahead of it (6 ms against 5): consecutive blocks alternate.
  const std::vector<int32_t> one{1};
  const std::vector<int64_t> one_row{1};
  EXPECT_TRUE(choose_host_experts(HostExperts::cost_model, one, one_row, costs).empty());
  EXPECT_EQ(choose_host_experts(HostExperts::cost_model, one, one_row, costs, {2.0, 0.0}), one);
  EXPECT_DOUBLE_EQ(predicted_miss_ms(one, one_row, one, costs, {2.0, 0.0}), 5.0);
  // A block's round trip to the host, paid once when any expert goes there. At 2 ms, one of two
  // one-row misses on the host ends at max(4, 2 + 5) = 7 against 8 copied: still worth it. At 4 ms
  // it would end at 9: both are copied.
  HostExpertCosts with_round_trip = costs;
  with_round_trip.host_block_ms = 2.0;
  EXPECT_EQ(choose_host_experts(HostExperts::cost_model, two, std::vector<int64_t>{1, 1}, with_round_trip),
            std::vector<int32_t>{2});
  EXPECT_DOUBLE_EQ(predicted_miss_ms(two, std::vector<int64_t>{1, 1}, std::vector<int32_t>{2}, with_round_trip), 7.0);
  EXPECT_DOUBLE_EQ(predicted_miss_ms(two, std::vector<int64_t>{1, 1}, {}, with_round_trip), 8.0);
  with_round_trip.host_block_ms = 4.0;
  EXPECT_TRUE(choose_host_experts(HostExperts::cost_model, two, std::vector<int64_t>{1, 1}, with_round_trip).empty());
}

TEST(HostExpertChoice, TheCostModelFindsTheBestSplitOfEverySubset) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + int(random() % 8);
    HostExpertCosts costs;
    costs.copy_ms = 0.5 + double(random() % 100) / 10.0;
    const int table = 1 + int(random() % 6);
    double t = double(random() % 80) / 10.0 + 0.1;
    for (int r = 0; r < table; ++r) costs.host_ms.push_back(t += double(random() % 30) / 10.0);
    if (trial % 2 == 1) costs.host_block_ms = double(random() % 50) / 10.0;  // a block's round trip
    std::vector<int32_t> misses;
    std::vector<int64_t> rows;
    for (int i = 0; i < n; ++i) {
      misses.push_back(int32_t(3 * i + int(random() % 3)));
      rows.push_back(1 + int64_t(random() % 10));  // past the table too: the extrapolated line
    }
    moe::cuda::Backlogs backlogs;
    if (trial % 3 == 1) backlogs.copy_ms = double(random() % 200) / 10.0;
    if (trial % 3 == 2) backlogs.host_ms = double(random() % 200) / 10.0;
    double best = 1e300;
    for (unsigned mask = 0; mask < (1u << n); ++mask) {
      std::vector<int32_t> subset;
      for (int i = 0; i < n; ++i) {
        if (mask & (1u << i)) subset.push_back(misses[size_t(i)]);
      }
      best = std::min(best, predicted_miss_ms(misses, rows, subset, costs, backlogs));
    }
    const std::vector<int32_t> chosen = choose_host_experts(HostExperts::cost_model, misses, rows, costs, backlogs);
    EXPECT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
    EXPECT_NEAR(predicted_miss_ms(misses, rows, chosen, costs, backlogs), best, 1e-9) << "trial " << trial;
  }
}

TEST(HostExpertChoice, OffCopiesEveryMissAndMissesComputesEveryOne) {
  const HostExpertCosts costs{1.0, {100.0}};
  const std::vector<int32_t> misses{5, 1, 3};
  const std::vector<int64_t> rows{1, 2, 1};
  EXPECT_TRUE(choose_host_experts(HostExperts::off, misses, rows, costs).empty());
  EXPECT_EQ(choose_host_experts(HostExperts::misses, misses, rows, costs), (std::vector<int32_t>{1, 3, 5}));
  // With nothing measured the two fixed modes still answer; the cost model needs the copy time.
  EXPECT_EQ(choose_host_experts(HostExperts::misses, misses, rows, HostExpertCosts{}).size(), 3u);
  EXPECT_TRUE(choose_host_experts(HostExperts::cost_model, {}, {}, HostExpertCosts{}).empty());
}

TEST(HostExpertChoice, HostTimeBeyondTheTableFollowsItsLastTwoPoints) {
  const HostExpertCosts costs{1.0, {2.0, 3.0, 5.0}};
  EXPECT_DOUBLE_EQ(costs.host_ms_at(1), 2.0);
  EXPECT_DOUBLE_EQ(costs.host_ms_at(3), 5.0);
  EXPECT_DOUBLE_EQ(costs.host_ms_at(5), 9.0);
  EXPECT_DOUBLE_EQ((HostExpertCosts{1.0, {2.0}}).host_ms_at(4), 8.0);
}

TEST(HostExpertChoice, BadInputSaysWhatIsAllowed) {
  const HostExpertCosts costs{1.0, {2.0}};
  auto expect_error = [](auto&& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one saying: " << words;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(words), std::string::npos) << error.what();
    }
  };
  expect_error([&] { choose_host_experts(HostExperts::cost_model, std::vector<int32_t>{1, 2}, std::vector<int64_t>{1}, costs); },
               "2 misses but 1 row counts");
  expect_error([&] { choose_host_experts(HostExperts::misses, std::vector<int32_t>{4}, std::vector<int64_t>{0}, costs); },
               "expert 4 has 0 rows");
  expect_error([&] {
    choose_host_experts(HostExperts::cost_model, std::vector<int32_t>{4}, std::vector<int64_t>{1}, HostExpertCosts{0, {1.0}});
  }, "copy time must be > 0");
  expect_error([&] { (void)HostExpertCosts{}.host_ms_at(1); }, "not measured");
  expect_error([&] { (void)costs.host_ms_at(0); }, "rows must be >= 1");
  expect_error([&] { (void)moe::cuda::parse_host_experts("sometimes"); }, "allowed: off");
  EXPECT_EQ(moe::cuda::parse_host_experts("auto"), HostExperts::cost_model);
}

}  // namespace
