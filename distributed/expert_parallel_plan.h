// expert_parallel_plan.h: who sends which token rows where, in one forward of the expert-parallel
// layer on the GPU (expert_parallel_gpu.h), computed on the host of every rank from the R x E count
// matrix that the count exchange brings (FastMoE reads these counts back to size its buffers; so
// does this layer). Plain C++, no CUDA: tested on CPU ranks.
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_plan
//
// Dimension legend: T tokens (all ranks), T_r this rank's, E experts, K top-k, C capacity, B block
// size, R ranks, E_r = E / R experts a rank (rank r owns experts [r E_r, (r + 1) E_r)), d chunks.
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
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe_config.h"  // MoeConfig, Formulation

namespace moe::dist {

class ExchangePlan {
 public:
  // routed: [R, E] routed slots (before dropping) of each rank; tokens_per_rank: [R] T_r.
  // Throws std::invalid_argument when the T_r do not add up to config.tokens (every rank holds the
  // same counts, so every rank throws the same message), or R does not divide E, or d < 1.
  ExchangePlan(const MoeConfig& config, int ranks, int rank, int chunks, std::span<const int64_t> tokens_per_rank,
               std::span<const int64_t> routed);

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  int chunks() const { return chunks_; }  // d
  int64_t experts() const { return experts_; }
  int64_t experts_per_rank() const { return experts_per_rank_; }  // E_r
  int64_t tokens() const { return tokens_; }                      // T
  int64_t local_tokens() const { return tokens_per_rank_[rank_]; }
  int64_t token_offset() const { return token_offset_; }          // this rank's first global token
  int64_t capacity() const { return capacity_; }                  // C; 0 when dropless
  int64_t routed(int source, int64_t expert) const { return routed_[index(source, expert)]; }
  int64_t kept(int source, int64_t expert) const { return kept_[index(source, expert)]; }
  const std::vector<int64_t>& routed_matrix() const { return routed_; }  // [R, E]
  const std::vector<int64_t>& kept_matrix() const { return kept_; }      // [R, E]
  int64_t dropped_slots() const { return dropped_slots_; }               // all ranks

  // The part of source rank `source`'s block of expert e that chunk c carries: its kept slots
  // [first, first + count), counted in that rank's kept slots of e (token order).
  struct Part {
    int64_t first = 0;
    int64_t count = 0;
  };
  Part part(int chunk, int source, int64_t expert) const;

  // ---- as the tokens' rank (this rank sends) ----
  int64_t rows_sent() const { return chunk_send_begin_[chunks_]; }  // kept slots of this rank
  int64_t chunk_send_begin(int chunk) const { return chunk_send_begin_[chunk]; }  // c in [0, d]
  std::span<const int64_t> send_rows(int chunk) const { return row_span(send_rows_, chunk); }           // [R]
  std::span<const int64_t> send_row_offsets(int chunk) const { return row_span(send_offsets_, chunk); }  // [R], in the chunk
  // Chunk c takes this rank's kept slots [slot_chunk_begin(e, c), slot_chunk_begin(e, c + 1)) of e;
  // c in [0, d], slot_chunk_begin(e, d) = kept(rank, e).
  int64_t slot_chunk_begin(int64_t expert, int chunk) const { return slot_chunk_begin_[expert * (chunks_ + 1) + chunk]; }
  // The send-buffer row of the first of those slots.
  int64_t part_send_row(int64_t expert, int chunk) const { return part_send_row_[expert * chunks_ + chunk]; }

  // ---- as the experts' rank (this rank receives and computes), chunk c ----
  std::span<const int64_t> recv_rows(int chunk) const { return row_span(recv_rows_, chunk); }           // [R]
  std::span<const int64_t> recv_row_offsets(int chunk) const { return row_span(recv_offsets_, chunk); }  // [R]
  int64_t rows_received(int chunk) const { return rows_received_[chunk]; }
  int64_t rows_received() const;  // all chunks
  // Local expert j (global id rank E_r + j):
  int64_t arrived(int chunk, int64_t j) const { return arrived_[chunk * experts_per_rank_ + j]; }
  // Its rows [row_offset(c, j), row_offset(c, j + 1)); j in [0, E_r]: B-rounded or the chunk's C share.
  int64_t row_offset(int chunk, int64_t j) const { return row_offsets_[chunk * (experts_per_rank_ + 1) + j]; }
  int64_t total_rows(int chunk) const { return row_offset(chunk, experts_per_rank_); }
  // Rows per expert in chunk c when dropping or padded (the same for every expert); 0 when dropless.
  int64_t padded_rows(int chunk) const;
  // Received rows of j from sources before s: s in [0, R].
  int64_t arrived_before(int chunk, int64_t j, int source) const {
    return arrived_before_[(chunk * experts_per_rank_ + j) * (ranks_ + 1) + source];
  }
  // Where block (source s, local expert j) starts in chunk c's receive buffer.
  int64_t block_start(int chunk, int source, int64_t j) const {
    return block_start_[(chunk * ranks_ + source) * experts_per_rank_ + j];
  }

 private:
  size_t index(int source, int64_t expert) const { return static_cast<size_t>(source * experts_ + expert); }
  std::span<const int64_t> row_span(const std::vector<int64_t>& v, int chunk) const {
    return std::span<const int64_t>(v).subspan(static_cast<size_t>(chunk) * ranks_, ranks_);
  }
  int64_t chunk_begin(int chunk, int64_t expert) const { return space_[expert] * chunk / chunks_; }

  int ranks_ = 1, rank_ = 0, chunks_ = 1;
  int64_t experts_ = 0, experts_per_rank_ = 0, tokens_ = 0, token_offset_ = 0, capacity_ = 0, block_size_ = 1;
  int64_t dropped_slots_ = 0;
  bool dropless_ = true;
  std::vector<int64_t> tokens_per_rank_;  // [R]
  std::vector<int64_t> routed_, kept_;    // [R, E]
  std::vector<int64_t> start_;            // [R, E] where rank r's block of e starts in e's row space
  std::vector<int64_t> space_;            // [E] n_e
  // as the tokens' rank
  std::vector<int64_t> chunk_send_begin_;  // [d + 1]
  std::vector<int64_t> send_rows_, send_offsets_;  // [d, R]
  std::vector<int64_t> slot_chunk_begin_;  // [E, d + 1]
  std::vector<int64_t> part_send_row_;     // [E, d]
  // as the experts' rank
  std::vector<int64_t> recv_rows_, recv_offsets_;  // [d, R]
  std::vector<int64_t> rows_received_;             // [d]
  std::vector<int64_t> arrived_;                   // [d, E_r]
  std::vector<int64_t> row_offsets_;               // [d, E_r + 1]
  std::vector<int64_t> arrived_before_;            // [d, E_r, R + 1]
  std::vector<int64_t> block_start_;               // [d, R, E_r]
};

}  // namespace moe::dist
