// expert_placement.h: which ranks hold which experts, as data: any E experts over any R ranks, an
// expert on one rank or replicated on several. Plain C++ (no Eigen, no CUDA, no communicator), so
// the expert-parallel layers, their plans and the simulator read the same rules.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_cpu
//
// Dimension legend: E experts, R ranks, P physical slots (all ranks' expert copies together),
// S redundant slots a rank.
//
// A placement lists, for every rank, the experts it holds; each is a slot. Slots are numbered rank
// after rank and, inside a rank, by expert id, so slot p is rank slot_rank(p)'s copy of expert
// slot_expert(p). Every expert has at least one slot (its replicas) and no rank holds an expert twice.
//
//   contiguous_placement(E, R)  rank r holds experts [floor(r E / R), floor((r + 1) E / R)): E / R a
//                               rank when R divides E (FastMoE's placement, the layers' default),
//                               one more on some ranks otherwise. No replicas.
//   eplb_placement(load, R, S)  DeepSeek's expert-parallel load balancer (EPLB), global policy:
//                               ceil(E / R) + S slots a rank. First replicate: while slots are
//                               free, the expert with the most load a replica (ties: the lower id)
//                               gets one more replica (at most R). Then pack: the replicas by load a
//                               replica, most first, each onto the least loaded rank that has a
//                               free slot and no replica of its expert (ties: the lower rank).
//
// The routing rule (which replica a row goes to). Source rank s routes n rows to expert e, in token
// order; e has n_e replicas, in slot order. The n rows are cut into n_e contiguous pieces in token
// order, the first n mod n_e pieces one row longer. The first piece goes to s's own replica when s
// holds one (the nearest), else to replica s mod n_e; the next pieces go round the replicas in slot
// order. Each replica thus gets an even share (within a row per source), and with one replica the
// whole block goes to the expert's one rank, exactly as without this file.
//
// Shadowed experts (FasterMoE; He et al., PPoPP 2022): an expert on every rank whose rows never
// travel: each source computes all its own rows on its own replica. Its weights travel instead (a
// broadcast before the step, its gradients summed after), which pays when its rows' bytes exceed
// its weights' (worth_shadowing).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moe::dist {

class ExpertPlacement {
 public:
  ExpertPlacement() = default;
  // rank_experts[r]: the experts rank r holds (any order; kept sorted). Throws std::invalid_argument
  // naming the fault unless R >= 1, every id is in [0, E), no rank lists an expert twice, and every
  // expert is held somewhere.
  ExpertPlacement(int64_t experts, std::vector<std::vector<int64_t>> rank_experts);

  int ranks() const { return static_cast<int>(rank_experts_.size()); }  // R
  int64_t experts() const { return experts_; }                          // E
  int64_t slots() const { return static_cast<int64_t>(slot_expert_.size()); }  // P
  const std::vector<int64_t>& experts_of(int rank) const { return rank_experts_[static_cast<size_t>(rank)]; }
  int64_t slots_of(int rank) const { return static_cast<int64_t>(experts_of(rank).size()); }
  int64_t first_slot(int rank) const { return first_slot_[static_cast<size_t>(rank)]; }
  int64_t slot_expert(int64_t slot) const { return slot_expert_[static_cast<size_t>(slot)]; }
  int slot_rank(int64_t slot) const { return slot_rank_[static_cast<size_t>(slot)]; }
  // The slots holding expert e, in slot order (so rank order): its replicas.
  const std::vector<int64_t>& replicas(int64_t expert) const { return replicas_[static_cast<size_t>(expert)]; }
  // Whether any expert has more than one replica.
  bool replicated() const { return slots() > experts_; }
  // Whether this is contiguous_placement(E, R) with R dividing E: today's layers' placement.
  bool is_even_contiguous() const;
  // Whether expert e is shadowed (file comment).
  bool shadowed(int64_t expert) const { return shadowed_[static_cast<size_t>(expert)]; }

  // This placement with `experts` shadowed: each added to every rank that lacks it. Throws unless
  // every id is in [0, E).
  ExpertPlacement with_shadowed(const std::vector<int64_t>& experts) const;

  // The routing rule (file comment): of the n rows source rank `source` routes to expert e, the
  // piece that goes to replica i (an index into replicas(e)): rows [first, first + count) of those n.
  struct Piece {
    int64_t first = 0;
    int64_t count = 0;
  };
  Piece piece(int source, int64_t expert, int64_t rows, int64_t replica) const;

  // A hash of R, E and every rank's experts (FNV-1a): ranks compare it before any work.
  uint64_t fingerprint() const;
  // One line a rank, a shadowed expert starred: "rank 0: 0 1 5* | rank 1: 2 3 5* | ...".
  std::string describe() const;

 private:
  int64_t experts_ = 0;
  std::vector<std::vector<int64_t>> rank_experts_;  // [R] sorted
  std::vector<int64_t> first_slot_;                 // [R + 1]
  std::vector<int64_t> slot_expert_;                // [P]
  std::vector<int> slot_rank_;                      // [P]
  std::vector<std::vector<int64_t>> replicas_;      // [E]
  std::vector<bool> shadowed_;                      // [E]
};

// Rank r holds experts [floor(r E / R), floor((r + 1) E / R)). Throws unless E >= 1 and 1 <= R <= E.
ExpertPlacement contiguous_placement(int64_t experts, int ranks);

// EPLB (file comment) from each expert's load (rows routed to it, summed over a window of steps;
// any non-negative numbers). Throws unless 1 <= R, every load is finite and >= 0, E >= R, and
// 0 <= S <= E - ceil(E / R) (a rank holds each expert at most once).
ExpertPlacement eplb_placement(std::span<const double> expert_load, int ranks, int64_t redundant_slots_per_rank);

// FasterMoE's choice, per step from the count matrix routed [R, E]: the experts whose rows would
// cross ranks under `placement` (each source's rows to replicas on other ranks) carry more bytes
// than shadowing them moves. Rows: 4 crossings a step (dispatch, combine and their backward twins)
// of D bf16 elements. Weights: a broadcast of P_e = D w1_columns + H D bf16 elements to R - 1 ranks,
// and their fp32 gradients summed by a ring all-reduce, 2 (R - 1) P_e elements in all. So e is
// shadowed when 8 D crossing_rows(e) > (R - 1) P_e (2 + 8) bytes. In id order; none at R = 1.
std::vector<int64_t> worth_shadowing(const ExpertPlacement& placement, std::span<const int64_t> routed,
                                     int64_t model_dim, int64_t w1_columns, int64_t hidden_dim);

// Each rank's load under a placement and the routing rule, when every source rank routes the same
// expert loads (the expectation; a placement's quality before any rows move): [R].
std::vector<double> expected_rank_load(const ExpertPlacement& placement, std::span<const double> expert_load);

}  // namespace moe::dist
