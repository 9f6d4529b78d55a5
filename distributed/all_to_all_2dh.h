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
// all-to-all with an extra copy. This is the host-buffer path (the CPU reference, the MPI backend);
// on GPUs the copies are kernels and the stages run on NCCL.
//   ctest --test-dir build -R DistributedAllToAll2dh
#pragma once

#include <memory>

#include "communicator.h"

namespace moe::dist {

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

 private:
  Communicator& world_;
  int ranks_per_node_ = 1;
  int nodes_ = 1;
  std::unique_ptr<Communicator> node_;    // the G ranks of this rank's node, ranked by local index
  std::unique_ptr<Communicator> across_;  // the N ranks with this rank's local index, ranked by node
};

}  // namespace moe::dist
