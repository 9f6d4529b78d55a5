// test_communicator.cpp: every collective of the communicator (MPI backend) against what each rank
// computes by hand for its peers, on fresh random data, with uneven counts, zero counts and
// sub-groups; settings that differ between ranks fail on every rank (rank_agreement.h). Run by CTest
// at R = 1..4 ranks:
//   ctest --test-dir build -R DistributedCommunicator
//   mpirun -np 4 build/tests/distributed/test_distributed_communicator
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "distributed_test_support.h"  // pair_count, pair_value, exchange_layout
#include "mpi_test_support.h"
#include "comm/rank_agreement.h"  // check_same_on_every_rank

namespace moe::dist {
namespace {

using testing::exchange_layout;
using testing::ExchangeLayout;
using testing::expect_pair_blocks_and_untouched_gaps;
using testing::mix;
using testing::pair_count;
using testing::pair_send_buffer;
using testing::pair_value;
using testing::same_bits;
using testing::shared_seed;
using testing::value_from;
using testing::world;

// ---- all-to-all-v ----

// One all-to-all-v where rank s sends count(s, d) elements to rank d, packed on the send side and
// placed with a gap of `gap` poisoned elements before every block on the receive side. Checks the
// received blocks element by element and that the gaps are untouched.
template <typename Element, typename Count>
void check_all_to_all_v(uint64_t seed, Count count, int64_t gap) {
  Communicator& comm = world();
  const int me = comm.rank();
  const ExchangeLayout layout = exchange_layout(comm.size(), me, count, gap);
  const std::vector<Element> send = pair_send_buffer<Element>(seed, me, layout);
  const Element poison = value_from<Element>(mix(seed, 999));
  std::vector<Element> recv(static_cast<size_t>(layout.recv_end + gap), poison);

  all_to_all_v<Element>(comm, send, layout.send_counts, layout.send_offsets, recv, layout.recv_counts,
                        layout.recv_offsets);

  expect_pair_blocks_and_untouched_gaps(recv, layout, seed, me, poison);
}

template <typename Element>
class CommunicatorTyped : public ::testing::Test {};
using ElementTypes = ::testing::Types<uint8_t, int32_t, int64_t, float, double, uint16_t>;  // uint16_t: bf16 bits
TYPED_TEST_SUITE(CommunicatorTyped, ElementTypes);

TYPED_TEST(CommunicatorTyped, AllToAllVUnevenCounts) {
  const uint64_t seed = shared_seed();
  check_all_to_all_v<TypeParam>(seed, [&](int s, int d) { return pair_count(seed, s, d); }, 0);
}

TYPED_TEST(CommunicatorTyped, AllToAllVPlacesBlocksAtTheirOffsets) {
  const uint64_t seed = shared_seed();
  check_all_to_all_v<TypeParam>(seed, [&](int s, int d) { return 1 + pair_count(seed, s, d); }, 3);
}

TYPED_TEST(CommunicatorTyped, AllReduceSum) {
  Communicator& comm = world();
  const uint64_t seed = shared_seed();
  const int R = comm.size(), me = comm.rank();
  const int64_t n = 300;  // long enough for the vectorised reduction paths
  // Integers and bf16 get small whole numbers, whose sums every type holds exactly (bf16 has 8
  // significant bits: sums of four values in [-16, 16] are exact).
  auto contribution = [&](int rank, int64_t i) -> double {
    const uint64_t h = mix(seed, rank, i);
    if constexpr (std::is_floating_point_v<TypeParam>) return value_from<TypeParam>(h);
    else return static_cast<double>(static_cast<int64_t>(h % 33) - 16);
  };
  auto encode = [](double v) -> TypeParam {
    if constexpr (std::is_same_v<TypeParam, uint16_t>) {  // bf16 of a small integer: exact
      const float f = static_cast<float>(v);
      uint32_t word;
      std::memcpy(&word, &f, sizeof word);
      return static_cast<uint16_t>(word >> 16);
    } else if constexpr (std::is_same_v<TypeParam, uint8_t>) {
      return static_cast<uint8_t>(static_cast<int64_t>(v) & 0xff);  // wraps, as the sum does
    } else {
      return static_cast<TypeParam>(v);
    }
  };
  std::vector<TypeParam> send(n), recv(n), in_place(n);
  for (int64_t i = 0; i < n; ++i) send[i] = in_place[i] = encode(contribution(me, i));

  comm.all_reduce_sum(send.data(), recv.data(), n, data_type_of<TypeParam>());
  all_reduce_sum<TypeParam>(comm, in_place);

  for (int64_t i = 0; i < n; ++i) {
    double expected = 0.0;
    for (int p = 0; p < R; ++p) expected += contribution(p, i);
    if constexpr (std::is_floating_point_v<TypeParam>) {
      const double tolerance = std::is_same_v<TypeParam, float> ? 1e-5 : 1e-12;
      EXPECT_NEAR(recv[i], expected, tolerance * R) << "element " << i << " (seed " << seed << ")";
    } else {
      EXPECT_TRUE(same_bits(recv[i], encode(expected)))
          << "element " << i << " (seed " << seed << "): " << +recv[i] << ", expected " << +encode(expected);
    }
    EXPECT_TRUE(same_bits(in_place[i], recv[i])) << "in place differs at " << i;
  }
}

TYPED_TEST(CommunicatorTyped, AllGather) {
  Communicator& comm = world();
  const uint64_t seed = shared_seed();
  const int R = comm.size(), me = comm.rank();
  const int64_t n = 5;
  std::vector<TypeParam> mine(n);
  for (int64_t i = 0; i < n; ++i) mine[i] = pair_value<TypeParam>(seed, me, 0, i);

  const std::vector<TypeParam> all = all_gather<TypeParam>(comm, mine);
  // In place: this rank's block already sits at rank * n of the receive buffer.
  std::vector<TypeParam> in_place(static_cast<size_t>(n * R), value_from<TypeParam>(7));
  std::copy(mine.begin(), mine.end(), in_place.begin() + me * n);
  comm.all_gather(in_place.data() + me * n, in_place.data(), n, data_type_of<TypeParam>());

  ASSERT_EQ(all.size(), static_cast<size_t>(n * R));
  for (int p = 0; p < R; ++p) {
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_TRUE(same_bits(all[p * n + i], pair_value<TypeParam>(seed, p, 0, i))) << "rank " << p << " element " << i;
      EXPECT_TRUE(same_bits(in_place[p * n + i], all[p * n + i])) << "in place: rank " << p << " element " << i;
    }
  }
}

TYPED_TEST(CommunicatorTyped, BroadcastFromEveryRoot) {
  Communicator& comm = world();
  const uint64_t seed = shared_seed();
  for (int root = 0; root < comm.size(); ++root) {
    std::vector<TypeParam> data(11);
    for (size_t i = 0; i < data.size(); ++i) data[i] = pair_value<TypeParam>(seed, comm.rank(), root, i);
    broadcast<TypeParam>(comm, data, root);
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_TRUE(same_bits(data[i], pair_value<TypeParam>(seed, root, root, i))) << "root " << root << " element " << i;
    }
  }
}

// ---- zero counts ----

TEST(Communicator, AllToAllVWithNothingToSend) {
  const uint64_t seed = shared_seed();
  check_all_to_all_v<double>(seed, [](int, int) { return int64_t{0}; }, 0);
  check_all_to_all_v<double>(seed, [](int, int) { return int64_t{0}; }, 2);
}

TEST(Communicator, AllToAllVWhereTheLastRankSendsNothing) {
  // FastMoE's "a rank with no tokens": it still takes part, sends nothing, receives its share.
  const uint64_t seed = shared_seed();
  const int last = world().size() - 1;
  check_all_to_all_v<double>(seed, [&](int s, int d) { return s == last ? 0 : 1 + pair_count(seed, s, d); }, 0);
}

TEST(Communicator, AllToAllVWhereRankZeroReceivesNothing) {
  const uint64_t seed = shared_seed();
  check_all_to_all_v<float>(seed, [&](int s, int d) { return d == 0 ? 0 : pair_count(seed, s, d); }, 1);
}

TEST(Communicator, ZeroElementCollectives) {
  Communicator& comm = world();
  std::vector<double> empty;
  comm.all_reduce_sum(empty.data(), empty.data(), 0, DataType::float64);
  EXPECT_TRUE(all_gather<double>(comm, empty).empty());
  comm.broadcast(empty.data(), 0, DataType::float64, 0);
  comm.barrier();
}

// ---- bf16 sum rounding ----

TEST(Communicator, Bfloat16SumRoundsToNearestEven) {
  // bf16 values near 1 are 2^-7 apart. Rank 0 adds 1 (or 1 + 2^-7), rank 1 adds 2^-8, the others
  // 0: every partial sum is exact but the last, which lies halfway and goes to the even neighbour.
  Communicator& comm = world();
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  auto bits = [](float f) {
    uint32_t word;
    std::memcpy(&word, &f, sizeof word);
    return static_cast<uint16_t>(word >> 16);
  };
  const float mine[3][2] = {{1.0f, 1.0f + 0x1.0p-7f}, {0x1.0p-8f, 0x1.0p-8f}, {0.0f, 0.0f}};
  const int row = std::min(comm.rank(), 2);
  std::vector<uint16_t> data = {bits(mine[row][0]), bits(mine[row][1])};
  all_reduce_sum<uint16_t>(comm, data);
  EXPECT_EQ(data[0], bits(1.0f));                 // 1 + 2^-8: a tie, down to the even 1
  EXPECT_EQ(data[1], bits(1.0f + 0x1.0p-6f));     // 1 + 2^-7 + 2^-8: a tie, up to the even 1 + 2^-6
}

// ---- ranks and sub-groups ----

TEST(Communicator, RanksAreZeroToRMinusOne) {
  Communicator& comm = world();
  EXPECT_EQ(comm.backend(), "mpi");
  const std::vector<int32_t> ranks = all_gather<int32_t>(comm, static_cast<int32_t>(comm.rank()));
  for (int p = 0; p < comm.size(); ++p) EXPECT_EQ(ranks[p], p);
}

// Tutel's nodes: groups of G consecutive ranks, for every G that divides R.
TEST(Communicator, SplitIntoNodesOfConsecutiveRanks) {
  Communicator& comm = world();
  const uint64_t seed = shared_seed();
  const int R = comm.size(), me = comm.rank();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("G = " + std::to_string(G));
    std::unique_ptr<Communicator> node = comm.split(me / G);
    ASSERT_EQ(node->size(), G);
    ASSERT_EQ(node->rank(), me % G);
    const int first = me / G * G;  // the node's first world rank

    // Sum and gather within the node only.
    double value = value_from<double>(mix(seed, me));
    node->all_reduce_sum(&value, &value, 1, DataType::float64);
    double expected = 0.0;
    for (int p = first; p < first + G; ++p) expected += value_from<double>(mix(seed, p));
    EXPECT_NEAR(value, expected, 1e-12);
    const std::vector<int64_t> members = all_gather<int64_t>(*node, static_cast<int64_t>(me));
    for (int i = 0; i < G; ++i) EXPECT_EQ(members[i], first + i);

    // An all-to-all-v inside the node, with uneven counts.
    std::vector<int64_t> send_counts(G), recv_counts(G);
    for (int i = 0; i < G; ++i) {
      send_counts[i] = pair_count(seed, me, first + i);
      recv_counts[i] = pair_count(seed, first + i, me);
    }
    std::vector<int64_t> send;
    for (int i = 0; i < G; ++i) {
      for (int64_t j = 0; j < send_counts[i]; ++j) send.push_back(pair_value<int64_t>(seed, me, first + i, j));
    }
    std::vector<int64_t> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0}));
    all_to_all_v<int64_t>(*node, send, send_counts, exclusive_prefix_sum(send_counts), recv, recv_counts,
                          exclusive_prefix_sum(recv_counts));
    size_t at = 0;
    for (int i = 0; i < G; ++i) {
      for (int64_t j = 0; j < recv_counts[i]; ++j) EXPECT_EQ(recv[at++], pair_value<int64_t>(seed, first + i, me, j));
    }
    node->barrier();
  }
}

TEST(Communicator, SplitOrdersByKey) {
  // Odd and even ranks, each group ranked in reverse by its key.
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  std::unique_ptr<Communicator> group = comm.split(me % 2, R - me);
  const int group_size = (R - me % 2 + 1) / 2;
  ASSERT_EQ(group->size(), group_size);
  const std::vector<int32_t> members = all_gather<int32_t>(*group, static_cast<int32_t>(me));
  for (int i = 0; i < group_size; ++i) EXPECT_EQ(members[i], me % 2 + 2 * (group_size - 1 - i));
  // A split of a split: each rank alone.
  std::unique_ptr<Communicator> alone = group->split(group->rank());
  EXPECT_EQ(alone->size(), 1);
  EXPECT_EQ(alone->rank(), 0);
}

// ---- bad arguments: every rank makes the same mistake, so every rank throws before sending ----

TEST(Communicator, BadArgumentsThrowBeforeAnyCommunication) {
  Communicator& comm = world();
  const int R = comm.size();
  std::vector<double> buffer(8);
  const std::vector<int64_t> zeros(R, 0), short_counts(R + 1, 0);
  std::vector<int64_t> negative(R, 0);
  negative[0] = -1;
  EXPECT_THROW(comm.all_to_all_v(buffer.data(), short_counts, zeros, buffer.data(), zeros, zeros, DataType::float64),
               std::invalid_argument);
  EXPECT_THROW(comm.all_to_all_v(buffer.data(), negative, zeros, buffer.data(), zeros, zeros, DataType::float64),
               std::invalid_argument);
  std::vector<int64_t> too_many(R, 0);
  too_many[R - 1] = 9;  // runs past the 8-element span
  EXPECT_THROW(all_to_all_v<double>(comm, buffer, too_many, zeros, buffer, zeros, zeros), std::invalid_argument);
  EXPECT_THROW(comm.all_reduce_sum(buffer.data(), buffer.data(), -1, DataType::float64), std::invalid_argument);
  EXPECT_THROW(comm.broadcast(buffer.data(), 1, DataType::float64, R), std::invalid_argument);
  EXPECT_THROW(comm.split(-1), std::invalid_argument);
  comm.barrier();  // every rank is still in step
}

// ---- settings that differ between ranks: every rank fails together, naming the ranks ----

TEST(Communicator, SettingsThatDifferFailOnEveryRankNamingTheRanks) {
  Communicator& comm = world();
  const int R = comm.size();
  EXPECT_NO_THROW(check_same_on_every_rank(comm, "the settings", 0x5eedull));
  // The odd ranks pass another fingerprint (a config hash that differs: config_fingerprint).
  const uint64_t fingerprint = comm.rank() % 2 == 1 ? 0xbadull : 0x5eedull;
  std::string odd_ranks;
  for (int p = 1; p < R; p += 2) odd_ranks += (odd_ranks.empty() ? "" : ", ") + std::to_string(p);
  if (odd_ranks.empty()) {  // R = 1: nothing to differ from
    EXPECT_NO_THROW(check_same_on_every_rank(comm, "the settings", fingerprint));
  } else {
    try {
      check_same_on_every_rank(comm, "the settings", fingerprint);
      ADD_FAILURE() << "differing fingerprints did not throw on rank " << comm.rank();
    } catch (const std::invalid_argument& error) {
      EXPECT_EQ(std::string(error.what()), "the settings differ between ranks: rank(s) " + odd_ranks +
                                               " disagree with rank 0; every rank must pass the same settings");
    }
  }
  comm.barrier();  // every rank is still in step
}

// A check that fails on several ranks: each distinct message once, with the ranks that gave it.
TEST(Communicator, FailedChecksNameEachMessageOnceWithItsRanks) {
  Communicator& comm = world();
  const int R = comm.size(), rank = comm.rank();
  const auto message_of = [&](const std::function<void()>& check) -> std::string {
    try {
      check_on_every_rank(comm, "the check", check);
    } catch (const std::invalid_argument& error) {
      return error.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(message_of([] {}), "(no error)");
  // Every rank with the same message: said once.
  EXPECT_EQ(message_of([] { throw std::invalid_argument("K > E"); }),
            R == 1 ? "the check: rank 0: K > E" : "the check: every rank: K > E");
  // The even and the odd ranks with a message each ("rank 0" / "ranks 0, 2").
  const auto named = [&](int first) {
    std::vector<int> ranks;
    for (int p = first; p < R; p += 2) ranks.push_back(p);
    std::string text = ranks.size() == 1 ? "rank" : "ranks";
    for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : " ") + std::to_string(ranks[i]);
    return text;
  };
  const std::string got = message_of([&] { throw std::invalid_argument(rank % 2 == 0 ? "even" : "odd"); });
  EXPECT_EQ(got, "the check: " + named(0) + ": even" + (R > 1 ? "; " + named(1) + ": odd" : std::string()));
  comm.barrier();
}

}  // namespace
}  // namespace moe::dist
