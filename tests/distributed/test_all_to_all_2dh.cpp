// test_all_to_all_2dh.cpp: Tutel's 2D hierarchical all-to-all equals the flat all-to-all-v, bit for
// bit, for every node size G that divides R (R = 4: G = 1, 2, 4; R = 2, 3: G = 1 and G = R), on
// fresh random data with uneven and zero counts; a G that does not divide R is an error on every
// rank. The steps from a known count matrix (plan_hierarchical_all_to_all, the GPU layer's path)
// equal the flat exchange too, in a packed and a gapped receive layout. Run by CTest at R = 1..4 ranks:
//   ctest --test-dir build -R DistributedAllToAll2dh
//   mpirun -np 4 build/tests/distributed/test_distributed_all_to_all_2dh
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <vector>

#include "comm/all_to_all_2dh.h"
#include "comm/communicator.h"
#include "distributed_test_support.h"  // exchange_layout
#include "mpi_test_support.h"

namespace moe::dist {
namespace {

using testing::exchange_layout;
using testing::ExchangeLayout;
using testing::mix;
using testing::same_bits;
using testing::shared_seed;
using testing::value_from;
using testing::world;

// Runs the same exchange flat and through 2DH (receive blocks placed with a gap before each) and
// expects identical receive buffers, gaps included.
template <typename Element, typename Count>
void expect_2dh_equals_flat(HierarchicalAllToAll& hierarchical, uint64_t seed, Count count) {
  Communicator& comm = world();
  const int me = comm.rank();
  const ExchangeLayout layout = exchange_layout(comm.size(), me, count, /*gap=*/2);
  std::vector<Element> send(static_cast<size_t>(layout.send_offsets.back() + layout.send_counts.back()));
  for (size_t i = 0; i < send.size(); ++i) send[i] = value_from<Element>(mix(seed, me, i));
  const Element poison = value_from<Element>(mix(seed, 12345));
  std::vector<Element> flat(static_cast<size_t>(layout.recv_end), poison), stepped(flat);

  all_to_all_v<Element>(comm, send, layout.send_counts, layout.send_offsets, flat, layout.recv_counts,
                        layout.recv_offsets);
  hierarchical.all_to_all_v(send.data(), layout.send_counts, layout.send_offsets, stepped.data(), layout.recv_counts,
                            layout.recv_offsets, data_type_of<Element>());

  for (size_t i = 0; i < flat.size(); ++i) {
    ASSERT_TRUE(same_bits(stepped[i], flat[i])) << "element " << i << " on rank " << me << " (seed " << seed << ")";
  }
}

template <typename Element>
class HierarchicalAllToAllTyped : public ::testing::Test {};
using ElementTypes = ::testing::Types<uint8_t, int64_t, float, double, uint16_t>;  // uint16_t: bf16 bits
TYPED_TEST_SUITE(HierarchicalAllToAllTyped, ElementTypes);

TYPED_TEST(HierarchicalAllToAllTyped, EqualsFlatForEveryNodeSize) {
  const int R = world().size();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("R = " + std::to_string(R) + ", G = " + std::to_string(G));
    HierarchicalAllToAll hierarchical(world(), G);
    EXPECT_EQ(hierarchical.nodes(), R / G);
    const uint64_t seed = shared_seed();
    // 0..6 elements per pair: a seventh of the pairs send nothing.
    expect_2dh_equals_flat<TypeParam>(hierarchical, seed, [&](int s, int d) {
      return static_cast<int64_t>(mix(seed, s, d, 77) % 7);
    });
  }
}

TEST(HierarchicalAllToAll, ZeroCountsAndSilentRanks) {
  const int R = world().size();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("G = " + std::to_string(G));
    HierarchicalAllToAll hierarchical(world(), G);
    const uint64_t seed = shared_seed();
    expect_2dh_equals_flat<double>(hierarchical, seed, [](int, int) { return int64_t{0}; });
    // Rank 0 sends nothing, the last rank receives nothing.
    expect_2dh_equals_flat<double>(hierarchical, seed, [&](int s, int d) {
      return s == 0 || d == R - 1 ? int64_t{0} : static_cast<int64_t>(1 + mix(seed, s, d) % 5);
    });
    // Everything goes to one rank: the expert-parallel case of all tokens on one rank's experts.
    expect_2dh_equals_flat<double>(hierarchical, seed, [&](int s, int d) {
      return d == R / 2 ? static_cast<int64_t>(10 + s) : int64_t{0};
    });
  }
}

TEST(HierarchicalAllToAll, RowsOfAMatrix) {
  // The expert-parallel layer moves rows of D doubles: counts are rows x D.
  const int R = world().size();
  const int64_t D = 13;
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    HierarchicalAllToAll hierarchical(world(), G);
    const uint64_t seed = shared_seed();
    expect_2dh_equals_flat<double>(hierarchical, seed, [&](int s, int d) {
      return D * static_cast<int64_t>(mix(seed, s, d) % 4);
    });
  }
}

// ---- the steps from a known count matrix ----

// Flat against all_to_all_v_known_counts, every rank passing the whole matrix; gap 0 is the packed
// layout of the GPU layer (its last copy then moves nothing), gap 2 leaves poisoned gaps between
// the receive blocks that must stay untouched.
void expect_known_counts_equal_flat(HierarchicalAllToAll& hierarchical, uint64_t seed, int64_t gap,
                                    const std::function<int64_t(int, int)>& count) {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  std::vector<int64_t> matrix(static_cast<size_t>(R) * R);
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < R; ++t) matrix[static_cast<size_t>(s) * R + t] = count(s, t);
  }
  const ExchangeLayout layout = exchange_layout(R, me, count, gap);
  std::vector<uint16_t> send(static_cast<size_t>(layout.send_offsets.back() + layout.send_counts.back()));
  for (size_t i = 0; i < send.size(); ++i) send[i] = value_from<uint16_t>(mix(seed, me, i, 5));
  const uint16_t poison = 0xFFFF;
  std::vector<uint16_t> flat(static_cast<size_t>(layout.recv_end), poison), stepped(flat);
  all_to_all_v<uint16_t>(comm, send, layout.send_counts, layout.send_offsets, flat, layout.recv_counts,
                         layout.recv_offsets);
  hierarchical.all_to_all_v_known_counts(send.data(), layout.send_offsets, stepped.data(), layout.recv_offsets,
                                         matrix, DataType::bfloat16);
  for (size_t i = 0; i < flat.size(); ++i) {
    ASSERT_EQ(stepped[i], flat[i]) << "element " << i << " on rank " << me << " (seed " << seed << ", gap " << gap
                                   << ")";
  }
}

TEST(HierarchicalAllToAll, KnownCountMatrixEqualsFlat) {
  const int R = world().size();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("R = " + std::to_string(R) + ", G = " + std::to_string(G));
    HierarchicalAllToAll hierarchical(world(), G);
    const uint64_t seed = shared_seed();
    for (int64_t gap : {0, 2}) {
      expect_known_counts_equal_flat(hierarchical, seed, gap,
                                     [&](int s, int d) { return static_cast<int64_t>(mix(seed, s, d, 91) % 7); });
      expect_known_counts_equal_flat(hierarchical, seed, gap, [&](int s, int d) {
        return s == 0 || d == R - 1 ? int64_t{0} : 3 * static_cast<int64_t>(1 + mix(seed, s, d) % 5);
      });
      expect_known_counts_equal_flat(hierarchical, seed, gap, [](int, int) { return int64_t{0}; });
    }
  }
}

TEST(HierarchicalAllToAll, StepsOfKnownCountsSkipCopiesThatMoveNothing) {
  // 4 ranks in 2 nodes of 2, 1 element per pair, packed: the gather and the align reorder, the
  // last copy lands every block where stage 2 put it.
  const std::vector<int64_t> ones(16, 1), packed{0, 1, 2, 3};
  const HierarchicalSteps steps = plan_hierarchical_all_to_all(ones, 4, 2, /*rank=*/1, packed, packed);
  EXPECT_EQ(steps.nodes, 2);
  EXPECT_FALSE(steps.gather_is_identity);  // [0 1 2 3] -> [g'=0: 0 2][g'=1: 1 3]
  EXPECT_FALSE(steps.align_is_identity);
  EXPECT_TRUE(steps.place_is_identity);
  EXPECT_EQ(steps.stage1_send_counts, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(steps.stage2_recv_counts, (std::vector<int64_t>{2, 2}));
  // One node (G = R): stage 1 is the flat exchange, the rest moves nothing.
  const HierarchicalSteps one_node = plan_hierarchical_all_to_all(ones, 4, 4, 1, packed, packed);
  EXPECT_TRUE(one_node.gather_is_identity && one_node.align_is_identity && one_node.place_is_identity);
  EXPECT_THROW(plan_hierarchical_all_to_all(ones, 4, 3, 1, packed, packed), std::invalid_argument);
}

TEST(HierarchicalAllToAll, NodeSizeThatDoesNotDivideRIsAnErrorOnEveryRank) {
  const int R = world().size();
  for (int G : {0, -1, R + 1, R == 3 ? 2 : 3}) {
    if (G >= 1 && R % G == 0) continue;
    try {
      HierarchicalAllToAll hierarchical(world(), G);
      ADD_FAILURE() << "G = " << G << " with R = " << R << " did not throw";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("must be >= 1 and divide the number of ranks R = " + std::to_string(R)),
                std::string::npos)
          << error.what();
    }
  }
  world().barrier();  // every rank threw, none is left waiting
}

TEST(HierarchicalAllToAll, NodeSizesThatDifferBetweenRanksAreAnErrorOnEveryRank) {
  const int R = world().size();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const int G = world().rank() == R - 1 ? R : 1;
  try {
    HierarchicalAllToAll hierarchical(world(), G);
    ADD_FAILURE() << "differing G did not throw";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("rank(s) " + std::to_string(R - 1) + " disagree with rank 0"),
              std::string::npos)
        << error.what();
  }
  world().barrier();
}

}  // namespace
}  // namespace moe::dist
