// all_to_all_2dh.h: Tutel's two-dimensional hierarchical all-to-all (2DH; Hwang et al., MLSys 2023),
// over any communicator, for variable counts (the all-to-all-v of FastMoE's token exchange).
//
// A flat all-to-all over R ranks sends R - 1 messages per rank, each 1/R of its data: at scale the
// messages that cross between nodes become small and latency-bound. 2DH groups the ranks into
// nodes of G consecutive ranks (rank r = node n * G + local index g, N = R / G nodes) and sends in
// two stages:
//   1. intra-node: rank (n, g) hands node peer (n, g') everything it has for ranks (*, g'), the
//      destinations that share g''s local index;
//   2. inter-node: rank (n, g') sends rank (n', g') one message, the merged blocks of all G ranks of
//      node n for it: N - 1 messages crossing nodes, each G times larger than a flat one's.
// Between the stages a local copy turns [source g][destination node] into [destination node][source
// g] (Tutel's "stride memcpy"), and the second stage receives the blocks in source-rank order, so a
// last copy places them at the caller's offsets. Variable counts need one more small step first:
// an intra-node all-to-all of the counts, because the stage-1 receiver is not the destination.
//
// G is settable so that one host can act as several nodes in tests; G = 1 and G = R are the flat
// all-to-all with an extra copy. This is the host-buffer path (the CPU reference, the MPI backend).
//
// Where every rank already knows the whole R x R count matrix (the expert-parallel layer does: its
// count exchange gives every rank every rank's routing counts), the counts step is not needed:
// plan_hierarchical_all_to_all computes a rank's copies and both stages' counts and offsets from the
// matrix alone. all_to_all_v_known_counts runs those steps on host buffers; the GPU path
// (device_all_to_all_2dh.h) runs the same steps with device copies and NCCL.
//   ctest --test-dir build -R DistributedAllToAll2dh
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.h"

namespace moe::dist {

// One contiguous copy of `count` elements, from offset `from` of one buffer to offset `to` of another.
struct BlockCopy {
  int64_t from = 0;
  int64_t to = 0;
  int64_t count = 0;
};

// One rank's steps of one 2DH all-to-all-v, from the whole count matrix. Offsets and counts in
// elements. Rank r = n G + g (node n, local index g); N = R / G.
struct HierarchicalSteps {
  int ranks_per_node = 1;  // G
  int nodes = 1;           // N
  // send -> stage-1 send buffer, ordered [destination local index g'][destination node n']
  std::vector<BlockCopy> gather;
  // stage 1 over the node's G ranks: peer g' gets the blocks for ranks (*, g')
  std::vector<int64_t> stage1_send_counts, stage1_send_offsets, stage1_recv_counts, stage1_recv_offsets;  // [G]
  // stage-1 receive buffer [source local index][destination node] -> stage-2 send buffer
  // [destination node][source local index]: Tutel's stride copy, one merged message per node
  std::vector<BlockCopy> align;
  // stage 2 over the N ranks with this local index: what arrives is in source-rank order
  std::vector<int64_t> stage2_send_counts, stage2_send_offsets, stage2_recv_counts, stage2_recv_offsets;  // [N]
  // stage-2 receive buffer -> the caller's recv, at its offsets
  std::vector<BlockCopy> place;
  int64_t stage1_send_elements = 0, stage1_recv_elements = 0, stage2_recv_elements = 0;
  // A step whose every copy lands where it starts moves nothing: the buffer before it serves as the
  // buffer after it (G = 1 or N = 1, or a caller's layout that already has the stage's order).
  bool gather_is_identity = false, align_is_identity = false, place_is_identity = false;
};

// counts [R * R]: counts[s * R + t] elements go from rank s to rank t (every rank passes the same
// matrix). send_offsets and recv_offsets [R] are this rank's, as in Communicator::all_to_all_v; its
// send counts are row `rank` of the matrix, its receive counts column `rank`. Throws
// std::invalid_argument unless 1 <= G divides R, the spans have their sizes and counts are >= 0.
HierarchicalSteps plan_hierarchical_all_to_all(std::span<const int64_t> counts, int ranks, int ranks_per_node,
                                               int rank, std::span<const int64_t> send_offsets,
                                               std::span<const int64_t> recv_offsets);

class HierarchicalAllToAll {
 public:
  // Collective over world: splits it into nodes of G consecutive ranks and into the groups of ranks
  // with the same local index (one per node). Throws std::invalid_argument on every rank unless
  // G >= 1 and G divides R, or when ranks pass different G.
  HierarchicalAllToAll(Communicator& world, int ranks_per_node);

  int ranks_per_node() const { return ranks_per_node_; }  // G
  int nodes() const { return nodes_; }                     // N = R / G
  Communicator& world() const { return world_; }

  // The same contract as Communicator::all_to_all_v over world: counts and offsets in elements,
  // one per world rank; host buffers.
  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_offsets, void* recv,
                    std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                    DataType type);

  // The same exchange when every rank knows the whole count matrix (counts [R * R], see
  // plan_hierarchical_all_to_all): no counts step, the two stages and the copies only.
  void all_to_all_v_known_counts(const void* send, std::span<const int64_t> send_offsets, void* recv,
                                 std::span<const int64_t> recv_offsets, std::span<const int64_t> counts,
                                 DataType type);

 private:
  Communicator& world_;
  int ranks_per_node_ = 1;
  int nodes_ = 1;
  std::unique_ptr<Communicator> node_;    // the G ranks of this rank's node, ranked by local index
  std::unique_ptr<Communicator> across_;  // the N ranks with this rank's local index, ranked by node
};

}  // namespace moe::dist
