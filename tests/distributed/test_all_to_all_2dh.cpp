// test_all_to_all_2dh.cpp: Tutel's 2D hierarchical all-to-all equals the flat all-to-all-v, bit for
// bit, for every node size G that divides R (R = 4: G = 1, 2, 4; R = 2, 3: G = 1 and G = R), on
// fresh random data with uneven and zero counts; a G that does not divide R is an error on every
// rank. Run by CTest at R = 1..4 ranks:
//   ctest --test-dir build -R DistributedAllToAll2dh
//   mpirun -np 4 build/tests/distributed/test_distributed_all_to_all_2dh
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "all_to_all_2dh.h"
#include "communicator.h"
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
