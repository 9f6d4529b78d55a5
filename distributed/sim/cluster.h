// sim/cluster.h: the machine moe_sim simulates: N nodes of G GPUs each, R = N G ranks, rank r on
// node r / G (the order mpirun places ranks in). Inside a node the GPUs share NVLink; between nodes
// each GPU has its own NIC (InfiniBand), as on the DGX / HGX systems the published MoE runs use.
//
//   moe::sim::Cluster cluster = moe::sim::parse_cluster("nodes=128,gpus-per-node=8");  // R = 1024
//
// Dimension legend: R ranks (GPUs), G GPUs a node, N nodes.
#pragma once

#include <cstdint>
#include <string>

namespace moe::sim {

struct Cluster {
  int64_t nodes = 1;          // N
  int64_t gpus_per_node = 1;  // G

  int64_t ranks() const { return nodes * gpus_per_node; }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node; }
  int64_t local_index(int64_t rank) const { return rank % gpus_per_node; }
  bool same_node(int64_t a, int64_t b) const { return node_of(a) == node_of(b); }
};

inline constexpr int64_t kMaxSimulatedRanks = 65536;

// "nodes=N,gpus-per-node=G" (either order; a missing key is 1), or "ranks=R" for one node of R
// GPUs. Throws std::invalid_argument naming the text and what is allowed: N, G >= 1 and
// R = N G <= kMaxSimulatedRanks.
Cluster parse_cluster(const std::string& text);
std::string describe(const Cluster& cluster);  // "128 nodes x 8 GPUs (R = 1024)"

}  // namespace moe::sim
