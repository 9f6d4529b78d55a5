// expert_parallel_plan.h: who sends which token rows where, in one forward of the expert-parallel
// layer on the GPU (expert_parallel_gpu.h), computed on the host of every rank from the R x E count
// matrix that the count exchange brings (FastMoE reads these counts back to size its buffers; so
// does this layer). Plain C++, no CUDA: tested on CPU ranks.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_plan
//
// Dimension legend: T tokens (all ranks), T_r this rank's, E experts, K top-k, C capacity, B block
// size, R ranks, E_r = E / R experts a rank (rank r owns experts [r E_r, (r + 1) E_r)), d chunks;
// r Tutel's layout, E_c the experts a rank computes in it.
//
// The rules are those of the CPU reference of expert parallelism (expert_parallel_cpu.h), so both
// layers send the same rows:
//   capacity  dropping and padded keep, of expert e's routed slots in global token order, the first
//             C = ceil(capacity_factor * T * K / E); rank r keeps
//             kept[r][e] = min(routed[r][e], max(0, C - sum_{r' < r} kept[r'][e]));
//             dropless keeps every slot.
//   row space expert e's rows over all ranks: the kept slots of rank 0, then rank 1, ... (global
//             token order), and, dropping or padded, empty rows up to C (the GPU computes dropping as
//             padded, as MoeLayerGpu does). Its size n_e is C, or sum_r kept[r][e] when dropless.
//   chunks    Tutel's pipelining: chunk c takes rows [n_e c / d, n_e (c + 1) / d) of every expert's
//             row space; from source rank r it carries the part of r's block that falls there.
//   send      the sender's buffer holds its kept slots chunk after chunk; inside a chunk, the rows
//             for rank 0, then rank 1, ...; inside those, expert after expert, token order inside.
//   receive   chunk c's receive buffer holds, source rank after source rank, the expert after
//             expert blocks the source sent: [source][local expert][token].
//   experts   on the experts' rank, local expert j's rows in chunk c are its received rows in
//             source-rank order (so global token order, the single-device plan's order), rounded
//             up to B (dropless) or padded with zeros to the chunk's share of C.
// Padding rows are made where the experts are and never travel.
//
// Tutel's layouts (expert_layouts.h), the plan's `layout` r; the storage is the same for every r:
//   r = 1  the rules above: expert e is computed by its owner, rank e / E_r.
//   r = 0  data parallel experts: every rank computes all E experts on its own kept slots. The send
//          order is the rules above with every expert's rows addressed to this rank itself, so the
//          layer copies them instead of exchanging them. Padded: each expert padded to the largest
//          count of rows any expert got on this rank (the batched products need one row count;
//          padding rows never change a result).
//   r > 1  sharded over groups of r consecutive ranks: group g computes the r E_r experts its ranks
//          store, [g r E_r, (g + 1) r E_r), each rank H / r columns of each. Every kept slot goes to
//          all r ranks of its expert's group: the send buffer holds each row once (group after
//          group) and the r ranks of a group read the same block (send_row_offsets coincide). The r
//          partial results come back into r separate blocks (return_row_offsets), summed at home.
//          Padded: every rank of the group pads each group expert to C rows of its slice.
// r != 1 takes d = 1. The experts' side reads the same tables in every layout, over computed_experts()
// experts from first_computed_expert(): r E_r for r > 1, E for r = 0, E_r for r = 1.
//
// Placements (expert_placement.h; layout r = 1 only). The plan works in units: the experts' slots
// of the placement, numbered rank after rank (unit u on rank unit_rank(u) computes expert
// unit_expert(u)); with E / R experts a rank in id order, unit u is expert u, and every table is
// the one above. A source's kept slots of expert e go to e's replicas by the placement's routing
// rule: replica i gets a piece of them, rows_to_unit(s, u) long, and each unit's row space is the
// pieces its sources send it, source after source. Chunks split each unit's row space. The send
// order groups rows by destination rank, then unit, then token; on the sending rank, expert e's
// kept slots fall into segments (one per replica and chunk that carries any of them), each with
// the send-buffer row of its first slot: segment_begin and segment_send_row, which build_send_order
// reads (send_row_of). Padded takes no replicas (as in the CPU reference); dropping pads every unit
// to the chunk's share of C, as it pads every expert.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "expert_placement.h"  // ExpertPlacement
#include "moe_config.h"           // MoeConfig, Formulation

namespace moe::dist {

class ExchangePlan {
 public:
  // routed: [R, E] routed slots (before dropping) of each rank; tokens_per_rank: [R] T_r.
  // placement: where the experts live; nullptr, E / R a rank in id order.
  // Throws std::invalid_argument when the T_r do not add up to config.tokens (every rank holds the
  // same counts, so every rank throws the same message), or R does not divide E without a
  // placement, or d < 1, or the layout r is not 0, 1 or a divisor of R and H, or r != 1 with d > 1,
  // or a placement other than E / R in id order with r != 1 or padded, or of another E or R.
  ExchangePlan(const MoeConfig& config, int ranks, int rank, int chunks, std::span<const int64_t> tokens_per_rank,
               std::span<const int64_t> routed, int layout = 1, const ExpertPlacement* placement = nullptr);

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  int chunks() const { return chunks_; }  // d
  int64_t experts() const { return experts_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }  // E_r
  int layout() const { return layout_; }                          // r
  // How many ranks compute each kept slot: r for r > 1, else 1.
  int copies() const { return layout_ > 1 ? layout_ : 1; }
  // The experts this rank computes, [first_computed_expert(), + computed_experts()): E_c of them.
  int64_t computed_experts() const { return computed_experts_; }
  int64_t first_computed_expert() const { return first_expert_of(rank_); }
  // Whether rank p computes expert e for the kept slots of rank `source`.
  bool computes(int p, int source, int64_t expert) const;
  int64_t tokens() const { return tokens_; }                      // T
  int64_t local_tokens() const { return tokens_per_rank_[rank_]; }
  int64_t token_offset() const { return token_offset_; }          // this rank's first global token
  int64_t capacity() const { return capacity_; }                  // C; 0 when dropless
  int64_t routed(int source, int64_t expert) const { return routed_[index(source, expert)]; }
  int64_t kept(int source, int64_t expert) const { return kept_[index(source, expert)]; }
  const std::vector<int64_t>& routed_matrix() const { return routed_; }  // [R, E]
  const std::vector<int64_t>& kept_matrix() const { return kept_; }      // [R, E]
  int64_t dropped_slots() const { return dropped_slots_; }               // all ranks

  // Units (see the file comment): U of them; without a placement of its own, unit u is expert u.
  const ExpertPlacement& placement() const { return placement_; }
  int64_t units() const { return static_cast<int64_t>(space_.size()); }
  int64_t unit_expert(int64_t unit) const { return layout_ == 1 ? placement_.slot_expert(unit) : unit; }
  int unit_rank(int64_t unit) const { return placement_.slot_rank(unit); }  // its storing rank
  // Rows source rank s sends unit u (all chunks): its piece of s's kept slots of u's expert.
  int64_t rows_to_unit(int source, int64_t unit) const { return unit_rows_[unit_index(source, unit)]; }

  // The part of source rank `source`'s piece for unit u that chunk c carries: rows [first, first +
  // count) of the piece (token order). Without replicas the piece is the source's kept slots of e.
  struct Part {
    int64_t first = 0;
    int64_t count = 0;
  };
  Part part(int chunk, int source, int64_t unit) const;

  // ---- as the tokens' rank (this rank sends) ----
  int64_t rows_sent() const { return chunk_send_begin_[chunks_]; }  // kept slots of this rank
  int64_t chunk_send_begin(int chunk) const { return chunk_send_begin_[chunk]; }  // c in [0, d]
  std::span<const int64_t> send_rows(int chunk) const { return row_span(send_rows_, chunk); }           // [R]
  std::span<const int64_t> send_row_offsets(int chunk) const { return row_span(send_offsets_, chunk); }  // [R], in the chunk
  // Where the results from rank p land in the buffer of returned rows, [copies() rows_sent()] rows;
  // the send_row_offsets when copies() == 1. r > 1: group g's r partial blocks one after another.
  std::span<const int64_t> return_row_offsets(int chunk) const { return row_span(return_offsets_, chunk); }  // [R]
  int64_t rows_returned() const { return rows_sent() * copies(); }
  // This rank's kept slots of expert e in n = segments() segments, ascending: segment k is slots
  // [segment_begin(e, k), segment_begin(e, k + 1)), k in [0, n], segment_begin(e, n) = kept(rank, e);
  // unused segments are empty, at the end. One per chunk without replicas (chunk c = segment c).
  int segments() const { return segments_; }
  int64_t segment_begin(int64_t expert, int k) const { return segment_begin_[expert * (segments_ + 1) + k]; }
  // The send-buffer row of segment k's first slot.
  int64_t segment_send_row(int64_t expert, int k) const { return segment_send_row_[expert * segments_ + k]; }

  // ---- as the experts' rank (this rank receives and computes), chunk c ----
  std::span<const int64_t> recv_rows(int chunk) const { return row_span(recv_rows_, chunk); }           // [R]
  std::span<const int64_t> recv_row_offsets(int chunk) const { return row_span(recv_offsets_, chunk); }  // [R]
  int64_t rows_received(int chunk) const { return rows_received_[chunk]; }
  int64_t rows_received() const;  // all chunks
  // Computed expert j (global id first_computed_expert() + j; rank E_r + j at r = 1), j < E_c:
  int64_t arrived(int chunk, int64_t j) const { return arrived_[chunk * computed_experts_ + j]; }
  // Its rows [row_offset(c, j), row_offset(c, j + 1)); j in [0, E_c]: B-rounded or the chunk's C share.
  int64_t row_offset(int chunk, int64_t j) const { return row_offsets_[chunk * (computed_experts_ + 1) + j]; }
  int64_t total_rows(int chunk) const { return row_offset(chunk, computed_experts_); }
  // Rows per expert in chunk c when dropping or padded (the same for every expert); 0 when dropless.
  int64_t padded_rows(int chunk) const;
  // Received rows of j from sources before s: s in [0, R].
  int64_t arrived_before(int chunk, int64_t j, int source) const {
    return arrived_before_[(chunk * computed_experts_ + j) * (ranks_ + 1) + source];
  }
  // Where block (source s, local expert j) starts in chunk c's receive buffer.
  int64_t block_start(int chunk, int source, int64_t j) const {
    return block_start_[(chunk * ranks_ + source) * computed_experts_ + j];
  }

 private:
  size_t index(int source, int64_t expert) const { return static_cast<size_t>(source * experts_ + expert); }
  size_t unit_index(int source, int64_t unit) const { return static_cast<size_t>(source * units() + unit); }
  std::span<const int64_t> row_span(const std::vector<int64_t>& v, int chunk) const {
    return std::span<const int64_t>(v).subspan(static_cast<size_t>(chunk) * ranks_, ranks_);
  }
  int64_t chunk_begin(int chunk, int64_t unit) const { return space_[unit] * chunk / chunks_; }
  int64_t first_expert_of(int p) const;  // the first unit rank p computes
  int64_t units_of(int p) const;         // how many units rank p computes

  int ranks_ = 1, rank_ = 0, chunks_ = 1, layout_ = 1, segments_ = 1;
  ExpertPlacement placement_;
  int64_t computed_experts_ = 0, local_padded_rows_ = 0;  // E_c; r = 0 padded: the rows of every expert
  int64_t experts_ = 0, experts_per_rank_ = 0, tokens_ = 0, token_offset_ = 0, capacity_ = 0, block_size_ = 1;
  int64_t dropped_slots_ = 0;
  bool dropless_ = true;
  std::vector<int64_t> tokens_per_rank_;  // [R]
  std::vector<int64_t> routed_, kept_;    // [R, E]
  std::vector<int64_t> unit_rows_;        // [R, U] each source's piece for each unit
  std::vector<int64_t> unit_first_;       // [R, U] where that piece starts among the source's kept slots of e
  std::vector<int64_t> start_;            // [R, U] where rank r's piece starts in the unit's row space
  std::vector<int64_t> space_;            // [U] n_u
  // as the tokens' rank
  std::vector<int64_t> chunk_send_begin_;  // [d + 1]
  std::vector<int64_t> send_rows_, send_offsets_, return_offsets_;  // [d, R]
  std::vector<int64_t> part_send_row_;     // [U, d] the send row of each chunk's part of this rank's piece
  std::vector<int64_t> segment_begin_;     // [E, segments + 1]
  std::vector<int64_t> segment_send_row_;  // [E, segments]
  // as the experts' rank
  std::vector<int64_t> recv_rows_, recv_offsets_;  // [d, R]
  std::vector<int64_t> rows_received_;             // [d]
  std::vector<int64_t> arrived_;                   // [d, E_c]
  std::vector<int64_t> row_offsets_;               // [d, E_c + 1]
  std::vector<int64_t> arrived_before_;            // [d, E_c, R + 1]
  std::vector<int64_t> block_start_;               // [d, R, E_c]
};

}  // namespace moe::dist
