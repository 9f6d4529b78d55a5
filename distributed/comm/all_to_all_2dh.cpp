// all_to_all_2dh.cpp: Tutel's two-dimensional hierarchical all-to-all (see all_to_all_2dh.h).
#include "comm/all_to_all_2dh.h"

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "comm/rank_agreement.h"  // check_same_on_every_rank

namespace moe::dist {

// ---- the steps from a known count matrix ----

namespace {

bool moves_nothing(const std::vector<BlockCopy>& copies) {
  for (const BlockCopy& copy : copies) {
    if (copy.from != copy.to) return false;
  }
  return true;
}

}  // namespace

HierarchicalSteps plan_hierarchical_all_to_all(std::span<const int64_t> counts, int ranks, int ranks_per_node,
                                               int rank, std::span<const int64_t> send_offsets,
                                               std::span<const int64_t> recv_offsets) {
  const int R = ranks, G = ranks_per_node;
  if (G < 1 || R < 1 || R % G != 0) {
    throw std::invalid_argument("2DH all-to-all: ranks_per_node G = " + std::to_string(G) +
                                " must be >= 1 and divide the number of ranks R = " + std::to_string(R));
  }
  if (rank < 0 || rank >= R || counts.size() != static_cast<size_t>(R) * R ||
      send_offsets.size() != static_cast<size_t>(R) || recv_offsets.size() != static_cast<size_t>(R)) {
    throw std::invalid_argument("2DH all-to-all: expected rank in [0, R), an R x R count matrix and R offsets, R = " +
                                std::to_string(R));
  }
  for (int64_t count : counts) {
    if (count < 0) throw std::invalid_argument("2DH all-to-all: a negative count in the count matrix");
  }
  const int N = R / G, n = rank / G, g = rank % G;
  auto world_rank = [G](int node, int local) { return node * G + local; };
  auto count = [&](int source, int destination) { return counts[static_cast<size_t>(source) * R + destination]; };

  HierarchicalSteps steps;
  steps.ranks_per_node = G;
  steps.nodes = N;

  // ---- gather: this rank's blocks grouped by the destination's local index, node order inside ----
  steps.stage1_send_counts.assign(G, 0);
  int64_t at = 0;
  for (int local = 0; local < G; ++local) {
    for (int node = 0; node < N; ++node) {
      const int destination = world_rank(node, local);
      const int64_t elements = count(rank, destination);
      if (elements > 0) steps.gather.push_back({send_offsets[destination], at, elements});
      at += elements;
      steps.stage1_send_counts[local] += elements;
    }
  }
  steps.stage1_send_elements = at;
  steps.stage1_send_offsets = exclusive_prefix_sum(steps.stage1_send_counts);

  // ---- stage 1 receives, from node peer g'', its blocks for ranks (*, g): [g''][n'] ----
  std::vector<int64_t> block_offsets(static_cast<size_t>(G) * N);
  steps.stage1_recv_counts.assign(G, 0);
  at = 0;
  for (int peer = 0; peer < G; ++peer) {
    for (int node = 0; node < N; ++node) {
      block_offsets[static_cast<size_t>(peer) * N + node] = at;
      const int64_t elements = count(world_rank(n, peer), world_rank(node, g));
      at += elements;
      steps.stage1_recv_counts[peer] += elements;
    }
  }
  steps.stage1_recv_elements = at;
  steps.stage1_recv_offsets = exclusive_prefix_sum(steps.stage1_recv_counts);

  // ---- align: [g''][n'] -> [n'][g''], so each destination node gets one merged message ----
  steps.stage2_send_counts.assign(N, 0);
  at = 0;
  for (int node = 0; node < N; ++node) {
    for (int peer = 0; peer < G; ++peer) {
      const int64_t elements = count(world_rank(n, peer), world_rank(node, g));
      if (elements > 0) steps.align.push_back({block_offsets[static_cast<size_t>(peer) * N + node], at, elements});
      at += elements;
      steps.stage2_send_counts[node] += elements;
    }
  }
  steps.stage2_send_offsets = exclusive_prefix_sum(steps.stage2_send_counts);

  // ---- stage 2 receives, from node n'', the blocks of its G ranks for this rank: source order ----
  steps.stage2_recv_counts.assign(N, 0);
  for (int node = 0; node < N; ++node) {
    for (int local = 0; local < G; ++local) steps.stage2_recv_counts[node] += count(world_rank(node, local), rank);
  }
  steps.stage2_recv_offsets = exclusive_prefix_sum(steps.stage2_recv_counts);
  at = 0;
  for (int source = 0; source < R; ++source) {
    const int64_t elements = count(source, rank);
    if (elements > 0) steps.place.push_back({at, recv_offsets[source], elements});
    at += elements;
  }
  steps.stage2_recv_elements = at;

  steps.gather_is_identity = moves_nothing(steps.gather);
  steps.align_is_identity = moves_nothing(steps.align);
  steps.place_is_identity = moves_nothing(steps.place);
  return steps;
}

// ---- HierarchicalAllToAll ----

HierarchicalAllToAll::HierarchicalAllToAll(Communicator& world, int ranks_per_node)
    : world_(world), ranks_per_node_(ranks_per_node) {
  check_same_on_every_rank(world, "HierarchicalAllToAll: ranks_per_node (G)", static_cast<uint64_t>(ranks_per_node));
  const int R = world.size(), G = ranks_per_node;
  if (G < 1 || R % G != 0) {
    throw std::invalid_argument("HierarchicalAllToAll: ranks_per_node G = " + std::to_string(G) +
                                " must be >= 1 and divide the number of ranks R = " + std::to_string(R) +
                                " (a node is a group of G consecutive ranks)");
  }
  nodes_ = R / G;
  node_ = world.split(/*color=*/world.rank() / G);
  across_ = world.split(/*color=*/world.rank() % G);
}

void HierarchicalAllToAll::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                        std::span<const int64_t> send_offsets, void* recv,
                                        std::span<const int64_t> recv_counts,
                                        std::span<const int64_t> recv_offsets, DataType type) {
  check_all_to_all_arguments(world_, send_counts, send_offsets, recv_counts, recv_offsets);
  const int G = ranks_per_node_, N = nodes_;
  const size_t width = element_size(type);
  auto world_rank = [G](int node, int local) { return node * G + local; };
  const char* input = static_cast<const char*>(send);
  auto copy = [width](char* to, const char* from, int64_t elements) {
    if (elements > 0) std::memcpy(to, from, static_cast<size_t>(elements) * width);
  };

  // ---- counts: node peer g tells this rank what it holds for each destination (n', my g) ----
  // counts_out[g' * N + n'] = elements this rank sends to world rank (n', g'), sent to node peer g'.
  std::vector<int64_t> counts_out(static_cast<size_t>(G) * N), counts_in(static_cast<size_t>(G) * N);
  for (int g = 0; g < G; ++g) {
    for (int n = 0; n < N; ++n) counts_out[g * N + n] = send_counts[world_rank(n, g)];
  }
  const std::vector<int64_t> n_each(G, N);
  const std::vector<int64_t> n_offsets = exclusive_prefix_sum(n_each);
  node_->all_to_all_v(counts_out.data(), n_each, n_offsets, counts_in.data(), n_each, n_offsets, DataType::int64);
  // counts_in[g * N + n'] = elements node peer g sends to world rank (n', my local index).

  // ---- stage 1: within the node, grouped by the destination's local index ----
  std::vector<int64_t> stage1_send_counts(G, 0), stage1_recv_counts(G, 0);
  for (int g = 0; g < G; ++g) {
    for (int n = 0; n < N; ++n) {
      stage1_send_counts[g] += counts_out[g * N + n];
      stage1_recv_counts[g] += counts_in[g * N + n];
    }
  }
  const std::vector<int64_t> stage1_send_offsets = exclusive_prefix_sum(stage1_send_counts);
  const std::vector<int64_t> stage1_recv_offsets = exclusive_prefix_sum(stage1_recv_counts);
  std::vector<char> stage1_send(static_cast<size_t>(stage1_send_offsets.back() + stage1_send_counts.back()) * width);
  std::vector<char> stage1_recv(static_cast<size_t>(stage1_recv_offsets.back() + stage1_recv_counts.back()) * width);
  int64_t at = 0;
  for (int g = 0; g < G; ++g) {
    for (int n = 0; n < N; ++n) {
      const int destination = world_rank(n, g);
      copy(stage1_send.data() + at * width, input + send_offsets[destination] * width, send_counts[destination]);
      at += send_counts[destination];
    }
  }
  node_->all_to_all_v(stage1_send.data(), stage1_send_counts, stage1_send_offsets, stage1_recv.data(),
                      stage1_recv_counts, stage1_recv_offsets, type);

  // ---- align: [source g][destination node n'] -> [n'][g]: one merged message per node ----
  std::vector<int64_t> block_offsets(static_cast<size_t>(G) * N);  // where block (g, n') sits in stage1_recv
  at = 0;
  for (int g = 0; g < G; ++g) {
    for (int n = 0; n < N; ++n) {
      block_offsets[g * N + n] = at;
      at += counts_in[g * N + n];
    }
  }
  std::vector<int64_t> stage2_send_counts(N, 0), stage2_recv_counts(N, 0);
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      stage2_send_counts[n] += counts_in[g * N + n];
      stage2_recv_counts[n] += recv_counts[world_rank(n, g)];
    }
  }
  const std::vector<int64_t> stage2_send_offsets = exclusive_prefix_sum(stage2_send_counts);
  const std::vector<int64_t> stage2_recv_offsets = exclusive_prefix_sum(stage2_recv_counts);
  std::vector<char> stage2_send(stage1_recv.size());
  std::vector<char> stage2_recv(static_cast<size_t>(stage2_recv_offsets.back() + stage2_recv_counts.back()) * width);
  at = 0;
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      copy(stage2_send.data() + at * width, stage1_recv.data() + block_offsets[g * N + n] * width, counts_in[g * N + n]);
      at += counts_in[g * N + n];
    }
  }

  // ---- stage 2: across nodes; what arrives is in source-rank order (node, then local index) ----
  across_->all_to_all_v(stage2_send.data(), stage2_send_counts, stage2_send_offsets, stage2_recv.data(),
                        stage2_recv_counts, stage2_recv_offsets, type);

  // ---- place each source's block at the caller's offset ----
  char* output = static_cast<char*>(recv);
  at = 0;
  for (int source = 0; source < world_.size(); ++source) {
    copy(output + recv_offsets[source] * width, stage2_recv.data() + at * width, recv_counts[source]);
    at += recv_counts[source];
  }
}

void HierarchicalAllToAll::all_to_all_v_known_counts(const void* send, std::span<const int64_t> send_offsets,
                                                     void* recv, std::span<const int64_t> recv_offsets,
                                                     std::span<const int64_t> counts, DataType type) {
  const HierarchicalSteps steps =
      plan_hierarchical_all_to_all(counts, world_.size(), ranks_per_node_, world_.rank(), send_offsets, recv_offsets);
  const size_t width = element_size(type);
  auto run = [width](const std::vector<BlockCopy>& copies, const void* from, void* to) {
    for (const BlockCopy& copy : copies) {
      std::memcpy(static_cast<char*>(to) + copy.to * width, static_cast<const char*>(from) + copy.from * width,
                  static_cast<size_t>(copy.count) * width);
    }
  };
  // A step that moves nothing is skipped, its input serving as its output (as on the GPU).
  std::vector<char> stage1_send, stage1_recv(static_cast<size_t>(steps.stage1_recv_elements) * width + 1), stage2_send,
      stage2_recv;
  const void* stage1_in = send;
  if (!steps.gather_is_identity) {
    stage1_send.resize(static_cast<size_t>(steps.stage1_send_elements) * width + 1);
    run(steps.gather, send, stage1_send.data());
    stage1_in = stage1_send.data();
  }
  node_->all_to_all_v(stage1_in, steps.stage1_send_counts, steps.stage1_send_offsets, stage1_recv.data(),
                      steps.stage1_recv_counts, steps.stage1_recv_offsets, type);
  const void* stage2_in = stage1_recv.data();
  if (!steps.align_is_identity) {
    stage2_send.resize(stage1_recv.size());
    run(steps.align, stage1_recv.data(), stage2_send.data());
    stage2_in = stage2_send.data();
  }
  void* stage2_out = recv;
  if (!steps.place_is_identity) {
    stage2_recv.resize(static_cast<size_t>(steps.stage2_recv_elements) * width + 1);
    stage2_out = stage2_recv.data();
  }
  across_->all_to_all_v(stage2_in, steps.stage2_send_counts, steps.stage2_send_offsets, stage2_out,
                        steps.stage2_recv_counts, steps.stage2_recv_offsets, type);
  if (!steps.place_is_identity) run(steps.place, stage2_recv.data(), recv);
}

}  // namespace moe::dist
