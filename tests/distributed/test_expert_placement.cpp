// test_expert_placement.cpp: placements as data (common/expert_placement.h), one process.
// The contiguous default for any E over any R, the checks on a placement, the routing rule over
// replicas (pieces that cover the rows once, the source's own replica first, shares within a row),
// and EPLB: every slot filled, no rank holding an expert twice, a hand-worked case, the busiest rank
// never worse than the contiguous placement's on skewed loads, and its bad settings.
//   ctest --test-dir build -R ExpertPlacement --output-on-failure
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "expert_placement.h"

namespace moe::dist {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

double max_over_mean(const std::vector<double>& load) {
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(load.size());
  return *std::max_element(load.begin(), load.end()) / mean;
}

std::vector<double> zipf_loads(int64_t experts, double s) {
  std::vector<double> load(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) load[static_cast<size_t>(e)] = 1000.0 / std::pow(static_cast<double>(e + 1), s);
  return load;
}

// Every rank holds `slots` experts, none twice, every expert somewhere (the constructor checks the
// last two; the count is EPLB's promise).
void expect_full_slots(const ExpertPlacement& placement, int64_t slots) {
  for (int r = 0; r < placement.ranks(); ++r) EXPECT_EQ(placement.slots_of(r), slots) << "rank " << r;
  EXPECT_EQ(placement.slots(), slots * placement.ranks());
}

TEST(ExpertPlacement, ContiguousIsFastMoesWhenRanksDivideExperts) {
  const ExpertPlacement p = contiguous_placement(8, 4);
  EXPECT_TRUE(p.is_even_contiguous());
  EXPECT_FALSE(p.replicated());
  EXPECT_THAT(p.experts_of(2), ElementsAre(4, 5));
  for (int64_t slot = 0; slot < 8; ++slot) {
    EXPECT_EQ(p.slot_expert(slot), slot);
    EXPECT_EQ(p.slot_rank(slot), slot / 2);
  }
  EXPECT_EQ(p.describe(), "rank 0: 0 1 | rank 1: 2 3 | rank 2: 4 5 | rank 3: 6 7");
}

TEST(ExpertPlacement, ContiguousTakesAnyExpertsOverAnyRanks) {
  const ExpertPlacement p = contiguous_placement(8, 3);  // floor(r 8 / 3): 0, 2, 5, 8
  EXPECT_THAT(p.experts_of(0), ElementsAre(0, 1));
  EXPECT_THAT(p.experts_of(1), ElementsAre(2, 3, 4));
  EXPECT_THAT(p.experts_of(2), ElementsAre(5, 6, 7));
  EXPECT_FALSE(p.is_even_contiguous());
  EXPECT_EQ(p.first_slot(2), 5);
  EXPECT_THAT(error_of([] { contiguous_placement(3, 4); }), HasSubstr("needs 1 <= R <= E"));
}

TEST(ExpertPlacement, BadPlacementsNameTheirFault) {
  EXPECT_THAT(error_of([] { ExpertPlacement(4, {{0, 1}, {2, 7}}); }), HasSubstr("rank 1 holds expert 7"));
  EXPECT_THAT(error_of([] { ExpertPlacement(4, {{0, 1, 1}, {2, 3}}); }), HasSubstr("holds expert 1 twice"));
  EXPECT_THAT(error_of([] { ExpertPlacement(4, {{0, 1}, {3}}); }), HasSubstr("expert 2 is on no rank"));
  EXPECT_THAT(error_of([] { ExpertPlacement(4, {}); }), HasSubstr("no ranks"));
}

TEST(ExpertPlacement, FingerprintsDifferWhenTheRanksHoldOtherExperts) {
  const ExpertPlacement a(4, {{0, 1, 3}, {2, 3}}), b(4, {{0, 1}, {2, 3, 1}}), c(4, {{3, 1, 0}, {3, 2}});
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(a.fingerprint(), c.fingerprint());  // the order given does not matter: slots go by id
  EXPECT_TRUE(a.replicated());
  EXPECT_THAT(a.replicas(3), ElementsAre(2, 4));  // slot 2 on rank 0, slot 4 on rank 1
}

// The pieces of every source's rows cover them once, in token order, the shares within a row of
// each other, the source's own replica first.
TEST(ExpertPlacement, TheRoutingRuleSplitsRowsEvenlyAndKeepsTheSourcesOwnFirst) {
  const ExpertPlacement p(5, {{0, 4}, {1, 4}, {2, 3}, {3, 4}});  // expert 4 on ranks 0, 1 and 3
  for (int source = 0; source < 4; ++source) {
    for (int64_t rows : {0, 1, 2, 3, 7, 100}) {
      std::vector<int64_t> covered(static_cast<size_t>(rows), 0);
      std::vector<int64_t> counts;
      for (int64_t i = 0; i < 3; ++i) {
        const ExpertPlacement::Piece piece = p.piece(source, 4, rows, i);
        counts.push_back(piece.count);
        for (int64_t row = piece.first; row < piece.first + piece.count; ++row) ++covered[static_cast<size_t>(row)];
      }
      for (int64_t c : covered) EXPECT_EQ(c, 1) << "source " << source << ", " << rows << " rows";
      EXPECT_LE(*std::max_element(counts.begin(), counts.end()) - *std::min_element(counts.begin(), counts.end()), 1);
    }
  }
  // Source 1 holds replica 1 of expert 4 (slot 3): it takes the first piece, the longer one.
  EXPECT_EQ(p.piece(1, 4, 7, 1).first, 0);
  EXPECT_EQ(p.piece(1, 4, 7, 1).count, 3);
  EXPECT_EQ(p.piece(1, 4, 7, 2).first, 3);  // then round the replicas: 2, then 0
  EXPECT_EQ(p.piece(1, 4, 7, 0).first, 5);
  // Source 2 holds none: it starts at replica 2 mod 3 = 2.
  EXPECT_EQ(p.piece(2, 4, 7, 2).first, 0);
  // One replica: the whole block.
  EXPECT_EQ(p.piece(2, 0, 9, 0).count, 9);
}

// FasterMoE's shadowing: the expert on every rank, each source's rows on its own replica.
TEST(ExpertPlacement, ShadowedExpertsKeepEverySourcesRowsAtHome) {
  const ExpertPlacement base = contiguous_placement(6, 3);
  const ExpertPlacement p = base.with_shadowed({4});
  EXPECT_TRUE(p.shadowed(4));
  EXPECT_FALSE(p.shadowed(0));
  EXPECT_EQ(p.replicas(4).size(), 3u);
  EXPECT_EQ(p.describe(), "rank 0: 0 1 4* | rank 1: 2 3 4* | rank 2: 4* 5");
  for (int source = 0; source < 3; ++source) {
    for (int64_t i = 0; i < 3; ++i) {
      const bool own = p.slot_rank(p.replicas(4)[static_cast<size_t>(i)]) == source;
      EXPECT_EQ(p.piece(source, 4, 11, i).count, own ? 11 : 0);
    }
  }
  // The same ranks holding the same experts, not shadowed, are another placement.
  const ExpertPlacement copies(6, {{0, 1, 4}, {2, 3, 4}, {4, 5}});
  EXPECT_NE(p.fingerprint(), copies.fingerprint());
  EXPECT_THAT(error_of([&] { base.with_shadowed({6}); }), HasSubstr("shadowing expert 6"));
}

// Worked by hand: R = 2, E = 2 (one a rank), D = 4, H = 8, w1 columns 8: P_e = 4 8 + 8 4 = 64
// elements, so shadowing moves (R - 1) 64 (2 + 8) = 640 bytes. Expert 0's rows from rank 1 cross
// (rank 0 holds it): 20 of them are 8 4 20 = 640 bytes, not more; 21 are 672, more.
TEST(ExpertPlacement, WorthShadowingByHand) {
  const ExpertPlacement p = contiguous_placement(2, 2);
  const std::vector<int64_t> twenty = {500, 3, 20, 7};  // [R, E]: rank 0's own rows never cross
  EXPECT_TRUE(worth_shadowing(p, twenty, 4, 8, 8).empty());
  const std::vector<int64_t> more = {500, 3, 21, 7};
  EXPECT_THAT(worth_shadowing(p, more, 4, 8, 8), ElementsAre(0));
  EXPECT_TRUE(worth_shadowing(p.with_shadowed({0}), more, 4, 8, 8).empty());  // already shadowed
  EXPECT_TRUE(worth_shadowing(contiguous_placement(2, 1), std::vector<int64_t>{500, 500}, 4, 8, 8).empty());
}

// Worked by hand: E = 4 over R = 2, 1 redundant slot a rank, loads 8, 2, 2, 4. ceil(4 / 2) + 1 = 3
// slots a rank, two beyond the four experts. Replicate: expert 0 (8) gets one (4 a replica); then 0
// and 3 tie at 4, but 0 is on both ranks already, so 3 gets the other: loads a replica 4, 2, 2, 2.
// Pack, most first: 0 -> rank 0 (4), 0 -> rank 1 (4), 1 -> rank 0 (6), 2 -> rank 1 (6), 3 -> rank 0
// (8), 3 -> rank 1 (8). Contiguous placement would load the ranks 10 and 6.
TEST(ExpertPlacement, EplbHandWorkedCase) {
  const std::vector<double> load = {8, 2, 2, 4};
  const ExpertPlacement p = eplb_placement(load, 2, 1);
  EXPECT_THAT(p.experts_of(0), ElementsAre(0, 1, 3));
  EXPECT_THAT(p.experts_of(1), ElementsAre(0, 2, 3));
  EXPECT_THAT(expected_rank_load(p, load), ElementsAre(8.0, 8.0));
  EXPECT_THAT(expected_rank_load(contiguous_placement(4, 2), load), ElementsAre(10.0, 6.0));
}

TEST(ExpertPlacement, EplbFillsEverySlotAndNeverLosesToContiguousOnSkewedLoads) {
  for (int ranks : {2, 3, 4, 8}) {
    for (int64_t experts : {8, 12, 16, 64}) {
      if (experts < ranks) continue;
      for (double s : {0.0, 0.8, 1.0, 1.2}) {
        const std::vector<double> load = zipf_loads(experts, s);
        const int64_t base = (experts + ranks - 1) / ranks;
        for (int64_t redundant : {0, 1, 2}) {
          if (redundant > experts - base) continue;
          SCOPED_TRACE("E " + std::to_string(experts) + " R " + std::to_string(ranks) + " s " + std::to_string(s) +
                       " S " + std::to_string(redundant));
          const ExpertPlacement p = eplb_placement(load, ranks, redundant);
          expect_full_slots(p, base + redundant);
          const double eplb = max_over_mean(expected_rank_load(p, load));
          const double plain = max_over_mean(expected_rank_load(contiguous_placement(experts, ranks), load));
          EXPECT_LE(eplb, plain + 1e-12);
          if (redundant >= 1 && s >= 1.0) {
            EXPECT_LT(eplb, 0.9 * plain);  // a replica of the hot head pays
          }
        }
      }
    }
  }
}

// Random loads, including zeros and ties: the packing always finishes (its repair included) with a
// valid placement, the same for the same loads.
TEST(ExpertPlacement, EplbIsValidAndDeterministicOnRandomLoads) {
  std::mt19937_64 generator(20261128);
  for (int trial = 0; trial < 2000; ++trial) {
    const int ranks = 1 + static_cast<int>(generator() % 8);
    const int64_t experts = ranks + static_cast<int64_t>(generator() % 12);
    const int64_t base = (experts + ranks - 1) / ranks;
    const int64_t redundant = static_cast<int64_t>(generator() % static_cast<uint64_t>(experts - base + 1));
    std::vector<double> load(static_cast<size_t>(experts));
    for (double& l : load) l = static_cast<double>(generator() % 4 == 0 ? 0 : generator() % 50);
    const ExpertPlacement p = eplb_placement(load, ranks, redundant);  // the constructor checks validity
    expect_full_slots(p, base + redundant);
    EXPECT_EQ(p.fingerprint(), eplb_placement(load, ranks, redundant).fingerprint());
  }
}

TEST(ExpertPlacement, EplbBadSettingsNameWhatIsAllowed) {
  const std::vector<double> load = {1, 2, 3, 4};
  EXPECT_THAT(error_of([&] { eplb_placement(load, 2, 3); }), HasSubstr("allowed 0 .. E - ceil(E / R) = 2"));
  EXPECT_THAT(error_of([&] { eplb_placement(load, 2, -1); }), HasSubstr("redundant slots"));
  EXPECT_THAT(error_of([&] { eplb_placement(load, 5, 0); }), HasSubstr("needs 1 <= R <= E"));
  const std::vector<double> bad = {1, -2, 3, 4};
  EXPECT_THAT(error_of([&] { eplb_placement(bad, 2, 0); }), HasSubstr("expert 1's load"));
  const std::vector<double> nan = {1, 2, std::nan(""), 4};
  EXPECT_THAT(error_of([&] { eplb_placement(nan, 2, 0); }), HasSubstr("finite"));
}

}  // namespace
}  // namespace moe::dist
