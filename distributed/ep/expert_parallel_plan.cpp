// expert_parallel_plan.cpp: the exchange of one forward of the expert-parallel layer on the GPU,
// from the R x E count matrix (see expert_parallel_plan.h).
#include "ep/expert_parallel_plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace moe::dist {

ExchangePlan::ExchangePlan(const MoeConfig& config, int ranks, int rank, int chunks,
                           std::span<const int64_t> tokens_per_rank, std::span<const int64_t> routed, int layout,
                           const ExpertPlacement* placement)
    : ranks_(ranks), rank_(rank), chunks_(chunks), layout_(layout), experts_(config.num_experts), block_size_(config.block_size),
      dropless_(config.formulation == Formulation::dropless) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw std::invalid_argument("ExchangePlan: rank " + std::to_string(rank) + " of R = " + std::to_string(ranks));
  }
  if (!placement && (experts_ < 1 || experts_ % ranks != 0)) {
    throw std::invalid_argument("expert parallelism places E / R experts on every rank: E = " +
                                std::to_string(experts_) + " is not divisible by R = " + std::to_string(ranks) +
                                " ranks; choose E a multiple of R");
  }
  if (chunks < 1) throw std::invalid_argument("ExchangePlan: pipeline chunks d = " + std::to_string(chunks) + "; expected d >= 1");
  if (tokens_per_rank.size() != static_cast<size_t>(ranks) ||
      routed.size() != static_cast<size_t>(ranks) * static_cast<size_t>(experts_)) {
    throw std::invalid_argument("ExchangePlan: expected R = " + std::to_string(ranks) + " token counts and R x E = " +
                                std::to_string(ranks * experts_) + " routed counts");
  }
  if (layout < 0 || (layout > 1 && (ranks % layout != 0 || config.hidden_dim % layout != 0))) {
    throw std::invalid_argument("ExchangePlan: layout r = " + std::to_string(layout) + " with R = " +
                                std::to_string(ranks) + ", H = " + std::to_string(config.hidden_dim) +
                                "; expected 0, 1 or an r > 1 dividing R and H");
  }
  if (layout != 1 && chunks != 1) {
    throw std::invalid_argument("ExchangePlan: layout r = " + std::to_string(layout) + " with d = " +
                                std::to_string(chunks) + " chunks; the pipeline belongs to r = 1");
  }
  placement_ = placement ? *placement : contiguous_placement(experts_, ranks);
  if (placement_.experts() != experts_ || placement_.ranks() != ranks) {
    throw std::invalid_argument("ExchangePlan: a placement of E = " + std::to_string(placement_.experts()) +
                                " experts over R = " + std::to_string(placement_.ranks()) + " ranks for E = " +
                                std::to_string(experts_) + " over R = " + std::to_string(ranks));
  }
  if (!placement_.is_even_contiguous() && layout != 1) {
    throw std::invalid_argument("ExchangePlan: layout r = " + std::to_string(layout) +
                                " stores E / R experts a rank in id order; a placement of its own takes r = 1");
  }
  if (placement_.replicated() && config.formulation == Formulation::padded) {
    throw std::invalid_argument("ExchangePlan: the padded formulation computes each expert as C rows on one rank; "
                                "a placement with replicas takes dropless or dropping");
  }
  experts_per_rank_ = experts_ / ranks;  // the layouts' stored experts (r != 1 holds E / R in id order)
  computed_experts_ = layout == 0 ? experts_ : layout > 1 ? layout * experts_per_rank_ : units_of(rank);
  tokens_per_rank_.assign(tokens_per_rank.begin(), tokens_per_rank.end());
  routed_.assign(routed.begin(), routed.end());
  tokens_ = std::accumulate(tokens_per_rank_.begin(), tokens_per_rank_.end(), int64_t{0});
  token_offset_ = std::accumulate(tokens_per_rank_.begin(), tokens_per_rank_.begin() + rank, int64_t{0});
  if (tokens_ != config.tokens) {
    std::string counts;
    for (int p = 0; p < ranks; ++p) counts += (p ? ", " : "") + std::to_string(tokens_per_rank_[p]);
    throw std::invalid_argument("expert parallel layer: the ranks hold " + std::to_string(tokens_) + " tokens (" +
                                counts + " by rank); config.tokens says T = " + std::to_string(config.tokens) +
                                " (T counts the tokens of all ranks)");
  }
  for (int p = 0; p < ranks; ++p) {
    int64_t slots = 0;
    for (int64_t e = 0; e < experts_; ++e) slots += routed_[index(p, e)];
    if (slots != tokens_per_rank_[p] * config.top_k) {
      throw std::invalid_argument("ExchangePlan: rank " + std::to_string(p) + " routed " + std::to_string(slots) +
                                  " slots for " + std::to_string(tokens_per_rank_[p]) + " tokens; expected T_r * K");
    }
  }

  // ---- the capacity rule over all tokens ----
  capacity_ = dropless_ ? 0 : moe::capacity(config);
  kept_.assign(routed_.size(), 0);
  for (int64_t e = 0; e < experts_; ++e) {
    int64_t kept_before = 0;  // by earlier ranks, whose tokens come first
    for (int p = 0; p < ranks; ++p) {
      const int64_t r = routed_[index(p, e)];
      const int64_t k = dropless_ ? r : std::min(r, std::max<int64_t>(0, capacity_ - kept_before));
      kept_[index(p, e)] = k;
      kept_before += k;
      dropped_slots_ += r - k;
    }
  }

  // ---- the units: each source's piece for each, and each unit's row space ----
  const int64_t U = layout == 1 ? placement_.slots() : experts_;
  unit_rows_.assign(static_cast<size_t>(ranks) * U, 0);
  unit_first_.assign(static_cast<size_t>(ranks) * U, 0);
  start_.assign(static_cast<size_t>(ranks) * U, 0);
  space_.assign(U, 0);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t e = layout == 1 ? placement_.slot_expert(u) : u;
    const std::vector<int64_t>& replicas = placement_.replicas(e);
    const int64_t replica = layout == 1 ? std::find(replicas.begin(), replicas.end(), u) - replicas.begin() : 0;
    int64_t rows = 0;
    for (int p = 0; p < ranks; ++p) {
      const ExpertPlacement::Piece piece =
          layout == 1 ? placement_.piece(p, e, kept_[index(p, e)], replica) : ExpertPlacement::Piece{0, kept_[index(p, e)]};
      unit_rows_[unit_index(p, u)] = piece.count;
      unit_first_[unit_index(p, u)] = piece.first;
      start_[unit_index(p, u)] = rows;
      rows += piece.count;
    }
    space_[u] = dropless_ ? rows : capacity_;
  }

  const int d = chunks_, R = ranks_;
  const int64_t E = experts_;

  // ---- as the tokens' rank ----
  // Rank p receives, unit after unit of those it computes for this rank, the part of this rank's
  // piece that chunk c carries. At r > 1 the ranks of a group read one block.
  const int64_t E_c = computed_experts_;
  send_rows_.assign(static_cast<size_t>(d) * R, 0);
  send_offsets_.assign(static_cast<size_t>(d) * R, 0);
  return_offsets_.assign(static_cast<size_t>(d) * R, 0);
  chunk_send_begin_.assign(d + 1, 0);
  part_send_row_.assign(static_cast<size_t>(U) * d, 0);
  for (int c = 0; c < d; ++c) {
    int64_t row = chunk_send_begin_[c];
    for (int p = 0; p < R; ++p) {
      const int64_t first = first_expert_of(p), units_p = units_of(p);
      for (int64_t j = 0; j < units_p; ++j) {
        if (computes(p, rank_, first + j)) send_rows_[c * R + p] += part(c, rank_, first + j).count;
      }
      if (layout_ > 1 && p % layout_ != 0) {  // the group's block, already laid out for its first rank
        send_offsets_[c * R + p] = send_offsets_[c * R + p - p % layout_];
        continue;
      }
      send_offsets_[c * R + p] = row - chunk_send_begin_[c];
      for (int64_t j = 0; j < units_p; ++j) {
        const int64_t u = first + j;
        if (!computes(p, rank_, u)) continue;
        part_send_row_[u * d + c] = row;
        row += part(c, rank_, u).count;
      }
    }
    chunk_send_begin_[c + 1] = row;
    for (int p = 0; p < R; ++p) {
      // r > 1 (d = 1): group g's block of n_g rows at u_g comes back r times, at r u_g + i n_g.
      const int64_t offset = send_offsets_[c * R + p];
      return_offsets_[c * R + p] = layout_ > 1 ? layout_ * offset + (p % layout_) * send_rows_[c * R + p] : offset;
    }
  }
  // Expert e's kept slots here, in segments: every (replica, chunk) part that carries any, ascending.
  size_t most_replicas = 1;
  if (layout == 1) {
    for (int64_t e = 0; e < E; ++e) most_replicas = std::max(most_replicas, placement_.replicas(e).size());
  }
  segments_ = static_cast<int>(most_replicas) * d;
  segment_begin_.assign(static_cast<size_t>(E) * (segments_ + 1), 0);
  segment_send_row_.assign(static_cast<size_t>(E) * segments_, 0);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<std::pair<int64_t, int64_t>> parts;  // (first kept slot, its send row)
    const std::vector<int64_t> units = layout == 1 ? placement_.replicas(e) : std::vector<int64_t>{e};
    for (const int64_t u : units) {
      for (int c = 0; c < d; ++c) {
        const Part here = part(c, rank_, u);
        if (here.count > 0) parts.emplace_back(unit_first_[unit_index(rank_, u)] + here.first, part_send_row_[u * d + c]);
      }
    }
    std::sort(parts.begin(), parts.end());
    for (int k = 0; k <= segments_; ++k) {
      const size_t at = static_cast<size_t>(e) * (segments_ + 1) + k;
      segment_begin_[at] = k < static_cast<int>(parts.size()) ? parts[k].first : kept_[index(rank_, e)];
      if (k < segments_ && k < static_cast<int>(parts.size())) segment_send_row_[static_cast<size_t>(e) * segments_ + k] = parts[k].second;
    }
  }

  // ---- as the experts' rank ----
  const int64_t first = first_expert_of(rank_);
  recv_rows_.assign(static_cast<size_t>(d) * R, 0);
  recv_offsets_.assign(static_cast<size_t>(d) * R, 0);
  rows_received_.assign(d, 0);
  arrived_.assign(static_cast<size_t>(d) * E_c, 0);
  row_offsets_.assign(static_cast<size_t>(d) * (E_c + 1), 0);
  arrived_before_.assign(static_cast<size_t>(d) * E_c * (R + 1), 0);
  block_start_.assign(static_cast<size_t>(d) * R * E_c, 0);
  for (int c = 0; c < d; ++c) {
    int64_t received = 0;
    for (int s = 0; s < R; ++s) {
      recv_offsets_[c * R + s] = received;
      for (int64_t j = 0; j < E_c; ++j) {
        const int64_t count = computes(rank_, s, first + j) ? part(c, s, first + j).count : 0;
        block_start_[(c * R + s) * E_c + j] = received;
        arrived_before_[(c * E_c + j) * (R + 1) + s + 1] = arrived_before_[(c * E_c + j) * (R + 1) + s] + count;
        arrived_[c * E_c + j] += count;
        recv_rows_[c * R + s] += count;
        received += count;
      }
    }
    rows_received_[c] = received;
    if (layout_ == 0) {  // d = 1: one row count for this rank's experts, the most any of them got
      for (int64_t j = 0; j < E_c; ++j) local_padded_rows_ = std::max(local_padded_rows_, arrived_[j]);
    }
    for (int64_t j = 0; j < E_c; ++j) {
      const int64_t arrived_here = arrived_[c * E_c + j];
      const int64_t rows = dropless_ ? (arrived_here + block_size_ - 1) / block_size_ * block_size_ : padded_rows(c);
      row_offsets_[c * (E_c + 1) + j + 1] = row_offsets_[c * (E_c + 1) + j] + rows;
    }
  }
}

int64_t ExchangePlan::first_expert_of(int p) const {
  if (layout_ == 1) return placement_.first_slot(p);
  if (layout_ == 0) return 0;
  const int group_ranks = layout_ > 1 ? layout_ : 1;
  return static_cast<int64_t>(p / group_ranks) * group_ranks * experts_per_rank_;
}

int64_t ExchangePlan::units_of(int p) const {
  if (layout_ == 1) return placement_.slots_of(p);
  return layout_ == 0 ? experts_ : layout_ * experts_per_rank_;
}

bool ExchangePlan::computes(int p, int source, int64_t unit) const {
  if (layout_ == 0) return p == source;
  const int64_t first = first_expert_of(p);
  return unit >= first && unit < first + units_of(p);
}

ExchangePlan::Part ExchangePlan::part(int chunk, int source, int64_t unit) const {
  const int64_t block_begin = start_[unit_index(source, unit)];
  const int64_t block_end = block_begin + unit_rows_[unit_index(source, unit)];
  const int64_t begin = std::max(block_begin, chunk_begin(chunk, unit));
  const int64_t end = std::min(block_end, chunk_begin(chunk + 1, unit));
  return end > begin ? Part{begin - block_begin, end - begin} : Part{};
}

int64_t ExchangePlan::rows_received() const {
  return std::accumulate(rows_received_.begin(), rows_received_.end(), int64_t{0});
}

int64_t ExchangePlan::padded_rows(int chunk) const {
  if (dropless_) return 0;
  if (layout_ == 0) return local_padded_rows_;
  return capacity_ * (chunk + 1) / chunks_ - capacity_ * chunk / chunks_;
}

}  // namespace moe::dist
