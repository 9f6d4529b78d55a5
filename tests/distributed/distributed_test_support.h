// distributed_test_support.h: the all-to-all-v exchange the communicator tests share. Every rank
// knows what rank s sends rank d (pair_count elements, pair_value each), so it can lay out its own
// send and receive sides and check what arrived without being told. Used by test_communicator.cpp
// (MPI backend), test_nccl_communicator.cpp (NCCL backend) and test_all_to_all_2dh.cpp.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm/communicator.h"  // exclusive_prefix_sum
#include "mpi_test_support.h"

namespace moe::dist::testing {

// Elements rank `from` sends rank `to`: 0..4, a fifth of the pairs send nothing.
inline int64_t pair_count(uint64_t seed, int from, int to) { return static_cast<int64_t>(mix(seed, from, to) % 5); }

// Element i of what rank `from` sends rank `to`.
template <typename Element>
Element pair_value(uint64_t seed, int from, int to, int64_t i) {
  return value_from<Element>(mix(seed, from, to, static_cast<uint64_t>(i) + 1000));
}

// One rank's side of an all-to-all-v where rank s sends count(s, d) elements to rank d: packed on the
// send side, and on the receive side every block placed after a gap of `gap` unwritten elements.
struct ExchangeLayout {
  std::vector<int64_t> send_counts, send_offsets;  // [R]
  std::vector<int64_t> recv_counts, recv_offsets;  // [R]
  int64_t recv_end = 0;                            // one past the last received element
};

template <typename Count>
ExchangeLayout exchange_layout(int R, int me, Count count, int64_t gap) {
  ExchangeLayout layout;
  layout.send_counts.resize(R);
  layout.recv_counts.resize(R);
  layout.recv_offsets.resize(R);
  for (int p = 0; p < R; ++p) {
    layout.send_counts[p] = count(me, p);
    layout.recv_counts[p] = count(p, me);
  }
  layout.send_offsets = exclusive_prefix_sum(layout.send_counts);
  for (int p = 0; p < R; ++p) {
    layout.recv_offsets[p] = layout.recv_end + gap;
    layout.recv_end = layout.recv_offsets[p] + layout.recv_counts[p];
  }
  return layout;
}

// What rank `me` sends under `layout`: pair_value for every peer, packed in rank order.
template <typename Element>
std::vector<Element> pair_send_buffer(uint64_t seed, int me, const ExchangeLayout& layout) {
  std::vector<Element> send;
  for (int p = 0; p < static_cast<int>(layout.send_counts.size()); ++p) {
    for (int64_t i = 0; i < layout.send_counts[p]; ++i) send.push_back(pair_value<Element>(seed, me, p, i));
  }
  return send;
}

// Checks rank `me`'s receive buffer element by element against what every peer sent (pair_value),
// and that every element outside the blocks still holds `poison`.
template <typename Element>
void expect_pair_blocks_and_untouched_gaps(const std::vector<Element>& recv, const ExchangeLayout& layout,
                                           uint64_t seed, int me, const Element& poison) {
  std::vector<bool> written(recv.size(), false);
  for (int p = 0; p < static_cast<int>(layout.recv_counts.size()); ++p) {
    for (int64_t i = 0; i < layout.recv_counts[p]; ++i) {
      const size_t at = static_cast<size_t>(layout.recv_offsets[p] + i);
      written[at] = true;
      ASSERT_TRUE(same_bits(recv[at], pair_value<Element>(seed, p, me, i)))
          << "element " << i << " from rank " << p << " on rank " << me << " (seed " << seed << ")";
    }
  }
  for (size_t at = 0; at < recv.size(); ++at) {
    if (!written[at]) {
      EXPECT_TRUE(same_bits(recv[at], poison)) << "gap element " << at << " was written";
    }
  }
}

}  // namespace moe::dist::testing
