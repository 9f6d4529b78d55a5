// expert_parallel_cpu.cpp: FastMoE's expert-parallel layer on CPU ranks, with Tutel's chunked
// pipeline (see expert_parallel_cpu.h).
//
// Sections: ---- placement and settings ----  ---- the token exchange ----  ---- chunks ----
//           ---- forward ----  ---- backward ----
#include "ep/expert_parallel_cpu.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

#include "comm/all_to_all_2dh.h"            // HierarchicalAllToAll
#include "comm/rank_agreement.h"            // check_on_every_rank, check_same_on_every_rank
#include "reference_cpu/checks.h"      // check_shape, check_finite, check_expert_matrices
#include "reference_cpu/expert_ffn.h"  // expert_ffn_forward / backward, ExpertActivations

namespace moe::dist {

using ref::IndexVector;
using ref::Matrix;

// ---- placement and settings ----

ExpertParallelWeights local_weights(const MoeConfig& config, const ref::MoeWeights& all, int rank, int ranks) {
  return local_weights(config, all, rank, contiguous_placement(config.num_experts, ranks));
}

ExpertParallelWeights local_weights(const MoeConfig& config, const ref::MoeWeights& all, int rank,
                                    const ExpertPlacement& placement) {
  if (placement.experts() != config.num_experts) {
    throw std::invalid_argument("local_weights: the placement is of E = " + std::to_string(placement.experts()) +
                                " experts; the config has E = " + std::to_string(config.num_experts));
  }
  if (static_cast<int64_t>(all.w1.size()) != config.num_experts ||
      static_cast<int64_t>(all.w2.size()) != config.num_experts) {
    throw std::invalid_argument("local_weights: expected E = " + std::to_string(config.num_experts) +
                                " matrices in w1 and w2; got " + std::to_string(all.w1.size()) + " and " +
                                std::to_string(all.w2.size()));
  }
  if (rank < 0 || rank >= placement.ranks()) {
    throw std::invalid_argument("local_weights: rank = " + std::to_string(rank) + "; expected 0 <= rank < R = " +
                                std::to_string(placement.ranks()));
  }
  ExpertParallelWeights mine;
  mine.gate_weights = all.gate_weights;
  for (int64_t e : placement.experts_of(rank)) {
    mine.w1.push_back(all.w1[e]);
    mine.w2.push_back(all.w2[e]);
  }
  return mine;
}

namespace {

// The placement the layer uses: the options', or the contiguous default.
ExpertPlacement placement_in_use(const MoeConfig& config, int ranks, const ExpertParallelOptions& options) {
  return options.placement ? *options.placement : contiguous_placement(config.num_experts, ranks);
}

}  // namespace


// Settings first (the same on every rank, so the same outcome everywhere), then this rank's own
// inputs, whose failure every rank reports together.
void check_expert_parallel_inputs(Communicator& comm, const MoeConfig& config, const Matrix& x,
                          const ExpertParallelWeights& weights, const ExpertParallelOptions& options) {
  check_same_on_every_rank(comm, "expert parallel layer: the MoE configs", config_fingerprint(config));
  const uint64_t options_fingerprint =
      static_cast<uint64_t>(options.pipeline_chunks) * 1000003u +
      static_cast<uint64_t>(options.hierarchical ? options.hierarchical->ranks_per_node() : 0);
  check_same_on_every_rank(comm, "expert parallel layer: the options (pipeline_chunks, 2DH node size)",
                           options_fingerprint);
  validate(config);
  const ExpertPlacement placement = placement_in_use(config, comm.size(), options);
  check_same_on_every_rank(comm, "expert parallel layer: the expert placements", placement.fingerprint());
  if (placement.experts() != config.num_experts || placement.ranks() != comm.size()) {
    throw std::invalid_argument("expert parallel layer: the placement is of E = " + std::to_string(placement.experts()) +
                                " experts over R = " + std::to_string(placement.ranks()) + " ranks; the layer has E = " +
                                std::to_string(config.num_experts) + " over R = " + std::to_string(comm.size()));
  }
  if (placement.replicated() && config.formulation == Formulation::padded) {
    throw std::invalid_argument("expert parallel layer: the padded formulation computes each expert as C rows on "
                                "one rank; a placement with replicas takes dropless or dropping");
  }
  const int64_t per_rank = placement.slots_of(comm.rank());
  if (options.pipeline_chunks < 1) {
    throw std::invalid_argument("expert parallel layer: pipeline_chunks = " + std::to_string(options.pipeline_chunks) +
                                "; expected d >= 1");
  }
  if (options.hierarchical && options.hierarchical->world().size() != comm.size()) {
    throw std::invalid_argument("expert parallel layer: the 2D hierarchical all-to-all spans " +
                                std::to_string(options.hierarchical->world().size()) +
                                " ranks; it must be built over the layer's communicator of R = " +
                                std::to_string(comm.size()));
  }
  check_on_every_rank(comm, "expert parallel layer: bad input", [&] {
    const int64_t D = config.model_dim, H = config.hidden_dim, E = config.num_experts;
    ref::check_shape("x", x, x.rows(), D, "[T_r, D]");
    ref::check_finite("x", x);
    ref::check_shape("gate_weights", weights.gate_weights, D, E, "[D, E]");
    ref::check_finite("gate_weights", weights.gate_weights);
    ref::check_expert_matrices("w1", weights.w1, per_rank, D, w1_columns(config),
                               "[D, w1_columns] (one a slot the placement gives this rank)");
    ref::check_expert_matrices("w2", weights.w2, per_rank, H, D, "[H, D] (one a slot the placement gives this rank)");
  });
}

// ---- the token exchange ----

// All-to-all-v of whole rows of a row-major matrix: send_rows[p] rows of `send` (packed, peer after
// peer) go to rank p; recv_rows[p] rows arrive from rank p. Flat, or through Tutel's 2DH. The
// receive buffer starts as NaN, so a row that never arrives cannot pass for a result.
Matrix exchange_rows(Communicator& comm, HierarchicalAllToAll* hierarchical,
                     const Matrix& send,  // [sum send_rows, cols]
                     const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                     int64_t cols) {
  std::vector<int64_t> send_counts(send_rows.size()), recv_counts(recv_rows.size());
  int64_t total = 0;
  for (size_t p = 0; p < send_rows.size(); ++p) {
    send_counts[p] = send_rows[p] * cols;
    recv_counts[p] = recv_rows[p] * cols;
    total += recv_rows[p];
  }
  const std::vector<int64_t> send_offsets = exclusive_prefix_sum(send_counts);
  const std::vector<int64_t> recv_offsets = exclusive_prefix_sum(recv_counts);
  Matrix recv = Matrix::Constant(total, cols, std::numeric_limits<double>::quiet_NaN());
  if (hierarchical) {
    hierarchical->all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets,
                               DataType::float64);
  } else {
    comm.all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets,
                      DataType::float64);
  }
  return recv;
}

// ---- chunks ----

ref::DispatchPlan plan_received_rows(const MoeConfig& config, int64_t capacity, int ranks, int64_t experts,
                                     const std::function<int64_t(int source, int64_t expert)>& received_rows,
                                     const std::function<int64_t(int64_t expert, int64_t arrived)>& padded_rows) {
  ref::DispatchPlan plan;
  plan.formulation = config.formulation;
  plan.num_experts = experts;
  plan.top_k = config.top_k;
  plan.block_size = config.block_size;
  plan.capacity = capacity;

  // Where each (source, local expert) block sits among the received rows: [source][local expert].
  std::vector<int64_t> block_start(static_cast<size_t>(ranks) * experts, 0);
  int64_t received = 0;
  for (int q = 0; q < ranks; ++q) {
    for (int64_t j = 0; j < experts; ++j) {
      block_start[q * experts + j] = received;
      received += received_rows(q, j);
    }
  }
  plan.tokens_per_expert.assign(experts, 0);
  plan.kept_per_expert.assign(experts, 0);
  plan.rows_per_expert.assign(experts, 0);
  plan.row_offsets.assign(experts + 1, 0);
  for (int64_t j = 0; j < experts; ++j) {
    int64_t arrived = 0;
    for (int q = 0; q < ranks; ++q) arrived += received_rows(q, j);
    int64_t rows = arrived;
    if (config.formulation == Formulation::padded) rows = padded_rows(j, arrived);
    if (config.formulation == Formulation::dropless) {
      rows = (arrived + config.block_size - 1) / config.block_size * config.block_size;  // up to B
    }
    plan.tokens_per_expert[j] = static_cast<int32_t>(arrived);
    plan.kept_per_expert[j] = static_cast<int32_t>(arrived);
    plan.rows_per_expert[j] = static_cast<int32_t>(rows);
    plan.row_offsets[j + 1] = static_cast<int32_t>(plan.row_offsets[j] + rows);
    plan.padding_rows += rows - arrived;
  }
  plan.total_rows = plan.row_offsets[experts];
  plan.tokens = received;
  plan.row_slot.assign(plan.total_rows, -1);
  for (int64_t j = 0; j < experts; ++j) {
    int64_t row = plan.row_offsets[j];
    for (int q = 0; q < ranks; ++q) {
      const int64_t count = received_rows(q, j);
      for (int64_t i = 0; i < count; ++i) {
        plan.row_slot[row++] = static_cast<int32_t>(block_start[q * experts + j] + i);
      }
    }
  }
  return plan;
}

Matrix rows_in_plan_order(const ref::DispatchPlan& plan, const Matrix& received) {
  Matrix rows = Matrix::Zero(plan.total_rows, received.cols());
  for (int64_t row = 0; row < plan.total_rows; ++row) {
    if (plan.row_slot[row] >= 0) rows.row(row) = received.row(plan.row_slot[row]);
  }
  return rows;
}

Matrix rows_in_received_order(const ref::DispatchPlan& plan, const Matrix& rows, int64_t received_rows) {
  Matrix received = Matrix::Constant(received_rows, rows.cols(), std::numeric_limits<double>::quiet_NaN());
  for (int64_t row = 0; row < plan.total_rows; ++row) {
    if (plan.row_slot[row] >= 0) received.row(plan.row_slot[row]) = rows.row(row);
  }
  return received;
}

namespace {

// Which rows of which (source rank, slot) block each chunk carries. A slot's rows, over all ranks,
// form its row space: the rows each source sends it, source after source, so in global token order
// (source rank r's block is [start[r][p], start[r][p] + rows[r][p])), followed, when padded, by
// padding up to C. Chunk c takes rows [n c / d, n (c + 1) / d) of a row space of n rows (Tutel
// splits the capacity dimension the same way). Every rank computes the same layout from the R x P
// counts, so no chunk needs a count exchange of its own.
class ChunkLayout {
 public:
  struct Part {
    int64_t first = 0;  // first row of the block in the chunk, counted from the block's start
    int64_t count = 0;
  };

  ChunkLayout(const std::vector<int64_t>& rows, int ranks, int64_t slots, int64_t capacity, bool padded, int chunks)
      : rows_(rows), slots_(slots), chunks_(chunks), start_(rows.size(), 0), space_(slots, 0) {
    for (int64_t p = 0; p < slots; ++p) {
      int64_t total = 0;
      for (int r = 0; r < ranks; ++r) {
        start_[r * slots + p] = total;
        total += rows[r * slots + p];
      }
      space_[p] = padded ? capacity : total;
    }
  }

  int64_t chunk_begin(int chunk, int64_t slot) const { return space_[slot] * chunk / chunks_; }
  int64_t chunk_rows(int chunk, int64_t slot) const { return chunk_begin(chunk + 1, slot) - chunk_begin(chunk, slot); }

  Part part(int chunk, int source, int64_t slot) const {
    const int64_t block_begin = start_[source * slots_ + slot];
    const int64_t block_end = block_begin + rows_[source * slots_ + slot];
    const int64_t begin = std::max(block_begin, chunk_begin(chunk, slot));
    const int64_t end = std::min(block_end, chunk_begin(chunk + 1, slot));
    return end > begin ? Part{begin - block_begin, end - begin} : Part{};
  }

 private:
  const std::vector<int64_t>& rows_;  // [R, P]
  int64_t slots_;
  int chunks_;
  std::vector<int64_t> start_;  // [R, P] where each source's block begins in the slot's row space
  std::vector<int64_t> space_;  // [P] rows in each slot's row space
};

// ---- forward ----

// The reference router on this rank's tokens. The jitter noise of a token depends on its global
// position, so it is the global draw's rows of these tokens, applied here (the router then runs
// with jitter off on the already-scaled input: the same logits).
ref::RouterOutput route_shard(const MoeConfig& config, const Matrix& x, const Matrix& gate_weights,
                              int64_t token_offset) {
  const int64_t T_r = x.rows(), D = config.model_dim, E = config.num_experts, K = config.top_k;
  const Matrix noise = ref::jitter_noise(config, token_offset + T_r, D).bottomRows(T_r);
  ref::RouterOutput out;
  if (T_r > 0) {
    MoeConfig shard = config;
    shard.tokens = T_r;
    shard.jitter_eps = 0.0;
    out = ref::route(shard, x.cwiseProduct(noise), gate_weights);
  } else {  // a rank without tokens: empty tensors of the right widths
    out.logits.resize(0, E);
    out.probs.resize(0, E);
    out.logsumexp.resize(0);
    out.top_experts.resize(0, K);
    out.top_probs.resize(0, K);
    out.combine_weights.resize(0, K);
  }
  out.jitter_noise = noise;
  return out;
}

// The rows this rank's slots [first_slot, first_slot + local_slots) compute in one chunk: the
// formulation's row rule applied to the rows received, ordered [local slot][source rank][token].
ref::DispatchPlan plan_local_experts(const MoeConfig& config, const ChunkLayout& layout, int chunk, int64_t first_slot,
                                     int64_t local_slots, int ranks) {
  return plan_received_rows(
      config, config.formulation == Formulation::dropless ? 0 : capacity(config), ranks, local_slots,
      [&](int source, int64_t j) { return layout.part(chunk, source, first_slot + j).count; },
      [&](int64_t j, int64_t) { return layout.chunk_rows(chunk, first_slot + j); });  // zeros up to C
}

// The routing rule over replicas (expert_placement.h), for every source and slot: how many of the
// source's kept slots of the slot's expert go to it (rows, [R, P]) and where that piece starts
// among them (first, [R, P]).
void split_over_replicas(const ExpertPlacement& placement, const std::vector<int64_t>& kept, int ranks,
                         std::vector<int64_t>& rows, std::vector<int64_t>& first) {
  const int64_t E = placement.experts(), P = placement.slots();
  rows.assign(static_cast<size_t>(ranks) * P, 0);
  first.assign(static_cast<size_t>(ranks) * P, 0);
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& replicas = placement.replicas(e);
    for (size_t i = 0; i < replicas.size(); ++i) {
      for (int s = 0; s < ranks; ++s) {
        const ExpertPlacement::Piece piece = placement.piece(s, e, kept[s * E + e], static_cast<int64_t>(i));
        rows[s * P + replicas[i]] = piece.count;
        first[s * P + replicas[i]] = piece.first;
      }
    }
  }
}

}  // namespace

RoutingOnRanks route_on_ranks(Communicator& comm, const MoeConfig& config, const Matrix& x,
                              const Matrix& gate_weights) {
  const int R = comm.size(), rank = comm.rank();
  const int64_t E = config.num_experts, K = config.top_k;
  RoutingOnRanks f;

  // ---- the shard: every rank's token count, so each knows its place in token order ----
  const std::vector<int64_t> tokens_per_rank = all_gather<int64_t>(comm, static_cast<int64_t>(x.rows()));
  for (int p = 0; p < R; ++p) {
    if (p < rank) f.token_offset += tokens_per_rank[p];
    f.tokens += tokens_per_rank[p];
  }
  if (f.tokens != config.tokens) {
    std::string counts;
    for (int p = 0; p < R; ++p) counts += (p ? ", " : "") + std::to_string(tokens_per_rank[p]);
    throw std::invalid_argument("MoE layer on ranks: the ranks hold " + std::to_string(f.tokens) +
                                " tokens (" + counts + " by rank); config.tokens says T = " +
                                std::to_string(config.tokens) + " (T counts the tokens of all ranks)");
  }
  const int64_t T = f.tokens, T_r = x.rows();
  f.local_tokens = T_r;

  // ---- 1. route locally ----
  f.router = route_shard(config, x, gate_weights, f.token_offset);

  // ---- 2. the count exchange: the R x E matrix of routed slots, on every rank ----
  std::vector<int64_t> routed_here(E, 0);
  for (int64_t slot = 0; slot < T_r * K; ++slot) ++routed_here[f.router.top_experts.data()[slot]];
  f.routed_per_rank_expert = all_gather<int64_t>(comm, routed_here);

  // The router losses over all tokens: f_e from the counts; P_e and the z-loss from per-rank sums.
  std::vector<double> sums(E + 1, 0.0);
  for (int64_t e = 0; e < E; ++e) sums[e] = f.router.probs.col(e).sum();
  sums[E] = f.router.logsumexp.squaredNorm();
  all_reduce_sum<double>(comm, sums);
  f.router.expert_fraction = ref::Vector::Zero(E);
  f.router.mean_probs.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    for (int p = 0; p < R; ++p) f.router.expert_fraction(e) += static_cast<double>(f.routed_per_rank_expert[p * E + e]);
    f.router.mean_probs(e) = sums[e] / static_cast<double>(T);
  }
  f.router.expert_fraction /= static_cast<double>(T * K);
  f.router.aux_loss = static_cast<double>(E) * f.router.expert_fraction.dot(f.router.mean_probs);
  f.router.z_loss = sums[E] / static_cast<double>(T);

  // ---- the dropping rule over all tokens: each expert keeps its first C slots in token order ----
  const bool dropless = config.formulation == Formulation::dropless;
  f.capacity = dropless ? 0 : capacity(config);
  f.kept_per_rank_expert.assign(static_cast<size_t>(R) * E, 0);
  for (int64_t e = 0; e < E; ++e) {
    int64_t kept_before = 0;  // by earlier ranks, whose tokens come first
    for (int p = 0; p < R; ++p) {
      const int64_t routed = f.routed_per_rank_expert[p * E + e];
      const int64_t kept = dropless ? routed : std::min(routed, std::max<int64_t>(0, f.capacity - kept_before));
      f.kept_per_rank_expert[p * E + e] = kept;
      kept_before += kept;
      f.dropped_slots += routed - kept;
    }
  }

  // This rank's slots grouped by expert, token order inside (dispatch.cpp's stable counting sort).
  f.routed_offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) f.routed_offsets[e + 1] = f.routed_offsets[e] + routed_here[e];
  f.routed_slots.resize(T_r * K);
  std::vector<int64_t> cursor(f.routed_offsets.begin(), f.routed_offsets.end() - 1);
  for (int64_t slot = 0; slot < T_r * K; ++slot) {
    f.routed_slots[cursor[f.router.top_experts.data()[slot]]++] = static_cast<int32_t>(slot);
  }
  return f;
}

ExpertParallelForward expert_parallel_forward(Communicator& comm, const MoeConfig& config, const Matrix& x,
                                              const ExpertParallelWeights& weights,
                                              const ExpertParallelOptions& options) {
  check_expert_parallel_inputs(comm, config, x, weights, options);
  const int R = comm.size(), rank = comm.rank(), d = options.pipeline_chunks;
  const int64_t D = config.model_dim, K = config.top_k;

  ExpertParallelForward f;
  f.options = options;
  f.placement = placement_in_use(config, R, options);
  const ExpertPlacement& placement = f.placement;
  const int64_t P = placement.slots(), first_slot = placement.first_slot(rank), local_slots = placement.slots_of(rank);

  // ---- 1-2. route locally, the count exchange, the router losses and the dropping rule ----
  RoutingOnRanks routing = route_on_ranks(comm, config, x, weights.gate_weights);
  f.tokens = routing.tokens;
  f.token_offset = routing.token_offset;
  f.local_tokens = routing.local_tokens;
  f.capacity = routing.capacity;
  f.routed_per_rank_expert = std::move(routing.routed_per_rank_expert);
  f.kept_per_rank_expert = std::move(routing.kept_per_rank_expert);
  f.dropped_slots = routing.dropped_slots;
  f.router = std::move(routing.router);
  f.aux_loss = f.router.aux_loss;
  f.z_loss = f.router.z_loss;
  const std::vector<int64_t>& routed_offsets = routing.routed_offsets;
  const IndexVector& routed_slots = routing.routed_slots;
  const int64_t T_r = f.local_tokens;

  // ---- the kept slots over the experts' replicas: the rows each source sends each slot ----
  std::vector<int64_t> piece_first;  // [R, P] where each source's piece starts among its kept slots of the expert
  split_over_replicas(placement, f.kept_per_rank_expert, R, f.rows_per_rank_slot, piece_first);

  // ---- 3-5, chunk after chunk: dispatch, the local experts, the way back ----
  const ChunkLayout layout(f.rows_per_rank_slot, R, P, f.capacity, config.formulation == Formulation::padded, d);
  f.chunks.resize(d);
  f.slot_chunk.assign(T_r * K, -1);
  f.slot_expert_out = Matrix::Zero(T_r * K, D);
  for (int c = 0; c < d; ++c) {
    ExpertParallelChunk& chunk = f.chunks[c];

    // As the tokens' rank: slots are numbered rank after rank, so the rows are grouped by
    // destination rank, then slot (expert), then token.
    chunk.send_rows.assign(R, 0);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t e = placement.slot_expert(p);
      const ChunkLayout::Part part = layout.part(c, rank, p);
      const int64_t begin = routed_offsets[e] + piece_first[rank * P + p] + part.first;
      for (int64_t i = 0; i < part.count; ++i) {
        const int32_t slot = routed_slots[begin + i];
        chunk.sent_slots.push_back(slot);
        f.slot_chunk[slot] = c;
      }
      chunk.send_rows[placement.slot_rank(p)] += part.count;
    }
    Matrix send(static_cast<int64_t>(chunk.sent_slots.size()), D);
    for (size_t i = 0; i < chunk.sent_slots.size(); ++i) send.row(i) = x.row(chunk.sent_slots[i] / K);

    // ---- 3. all-to-all-v of the token rows ----
    chunk.recv_rows.assign(R, 0);
    for (int s = 0; s < R; ++s) {
      for (int64_t j = 0; j < local_slots; ++j) chunk.recv_rows[s] += layout.part(c, s, first_slot + j).count;
    }
    const Matrix received = exchange_rows(comm, options.hierarchical, send, chunk.send_rows, chunk.recv_rows, D);

    // ---- 4. the local experts over exactly the rows received ----
    chunk.expert_plan = plan_local_experts(config, layout, c, first_slot, local_slots, R);
    const ref::DispatchPlan& plan = chunk.expert_plan;
    chunk.permuted_x = rows_in_plan_order(plan, received);
    ref::ExpertActivations experts = ref::expert_ffn_forward(config, plan, chunk.permuted_x, weights.w1, weights.w2);
    chunk.pre_activation = std::move(experts.pre_activation);
    chunk.hidden = std::move(experts.hidden);
    chunk.expert_out = std::move(experts.out);

    // ---- 5. all-to-all-v of the expert outputs, back in the order they came ----
    const Matrix back = rows_in_received_order(plan, chunk.expert_out, received.rows());
    const Matrix returned = exchange_rows(comm, options.hierarchical, back, chunk.recv_rows, chunk.send_rows, D);
    for (size_t i = 0; i < chunk.sent_slots.size(); ++i) f.slot_expert_out.row(chunk.sent_slots[i]) = returned.row(i);
  }

  // ---- 6. the weighted combine; a dropped slot adds zero ----
  f.y = Matrix::Zero(T_r, D);
  for (int64_t t = 0; t < T_r; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      if (f.slot_chunk[t * K + k] >= 0) f.y.row(t) += f.router.combine_weights(t, k) * f.slot_expert_out.row(t * K + k);
    }
  }
  return f;
}

// ---- backward ----

ExpertParallelGradients expert_parallel_backward(Communicator& comm, const MoeConfig& config, const Matrix& x,
                                                 const ExpertParallelWeights& weights,
                                                 const ExpertParallelForward& forward, const Matrix& dy) {
  const int64_t D = config.model_dim, H = config.hidden_dim, K = config.top_k, T_r = forward.local_tokens;
  const int64_t per_rank = forward.placement.slots_of(comm.rank());
  check_same_on_every_rank(comm, "expert parallel backward: the MoE configs", config_fingerprint(config));
  check_on_every_rank(comm, "expert parallel backward: bad input", [&] {
    ref::check_shape("x", x, T_r, D, "[T_r, D] as in the forward pass");
    ref::check_shape("dy", dy, T_r, D, "[T_r, D]");
    ref::check_finite("dy", dy);
    if (static_cast<int>(forward.chunks.size()) != forward.options.pipeline_chunks ||
        static_cast<int64_t>(weights.w1.size()) != per_rank) {
      throw std::invalid_argument("the forward pass does not belong to these weights and this communicator");
    }
  });

  // ---- combine: y[t] = sum_k w[t, k] out(t, k) ----
  Matrix d_slot_out = Matrix::Zero(T_r * K, D);
  Matrix d_combine = Matrix::Zero(T_r, K);
  for (int64_t t = 0; t < T_r; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = t * K + k;
      if (forward.slot_chunk[slot] < 0) continue;  // dropped: nothing flows back through it
      d_slot_out.row(slot) = forward.router.combine_weights(t, k) * dy.row(t);
      d_combine(t, k) = dy.row(t).dot(forward.slot_expert_out.row(slot));
    }
  }

  ExpertParallelGradients grads;
  grads.x = Matrix::Zero(T_r, D);
  for (int64_t j = 0; j < per_rank; ++j) {
    grads.w1.push_back(Matrix::Zero(D, w1_columns(config)));
    grads.w2.push_back(Matrix::Zero(H, D));
  }

  // ---- the experts, chunk after chunk: output gradients out, input gradients back ----
  for (const ExpertParallelChunk& chunk : forward.chunks) {
    Matrix send(static_cast<int64_t>(chunk.sent_slots.size()), D);
    for (size_t i = 0; i < chunk.sent_slots.size(); ++i) send.row(i) = d_slot_out.row(chunk.sent_slots[i]);
    const Matrix received =
        exchange_rows(comm, forward.options.hierarchical, send, chunk.send_rows, chunk.recv_rows, D);

    const ref::DispatchPlan& plan = chunk.expert_plan;
    Matrix d_expert_out = rows_in_plan_order(plan, received);  // padding rows get no gradient
    const ref::ExpertActivations activations{chunk.pre_activation, chunk.hidden, chunk.expert_out};
    const ref::ExpertGradients experts = ref::expert_ffn_backward(config, plan, chunk.permuted_x, weights.w1,
                                                                  weights.w2, activations, d_expert_out);
    for (int64_t j = 0; j < per_rank; ++j) {  // expert weight gradients stay on this rank
      grads.w1[j] += experts.w1[j];
      grads.w2[j] += experts.w2[j];
    }

    const Matrix back = rows_in_received_order(plan, experts.permuted_x, received.rows());
    const Matrix returned =
        exchange_rows(comm, forward.options.hierarchical, back, chunk.recv_rows, chunk.send_rows, D);
    for (size_t i = 0; i < chunk.sent_slots.size(); ++i) grads.x.row(chunk.sent_slots[i] / K) += returned.row(i);
  }

  sum_over_replicas(comm, config, forward.placement, grads.w1, grads.w2);
  grads.gate_weights = router_backward_on_ranks(comm, config, x, forward.router, forward.tokens, d_combine,
                                                weights.gate_weights, grads.x);
  return grads;
}

void sum_over_replicas(Communicator& comm, const MoeConfig& config, const ExpertPlacement& placement,
                       std::vector<Matrix>& w1, std::vector<Matrix>& w2) {
  if (!placement.replicated()) return;
  // The replicated experts, in id order, each at a fixed place in one buffer that every rank lays
  // out the same way: [its W1 gradient, its W2 gradient].
  const int64_t w1_size = config.model_dim * w1_columns(config), w2_size = config.hidden_dim * config.model_dim;
  std::vector<int64_t> place(static_cast<size_t>(placement.experts()), -1);
  int64_t size = 0;
  for (int64_t e = 0; e < placement.experts(); ++e) {
    if (placement.replicas(e).size() > 1) {
      place[static_cast<size_t>(e)] = size;
      size += w1_size + w2_size;
    }
  }
  std::vector<double> sums(static_cast<size_t>(size), 0.0);
  const std::vector<int64_t>& mine = placement.experts_of(comm.rank());
  for (size_t j = 0; j < mine.size(); ++j) {
    const int64_t at = place[static_cast<size_t>(mine[j])];
    if (at < 0) continue;
    std::copy_n(w1[j].data(), w1_size, sums.begin() + at);
    std::copy_n(w2[j].data(), w2_size, sums.begin() + at + w1_size);
  }
  all_reduce_sum<double>(comm, sums);
  for (size_t j = 0; j < mine.size(); ++j) {
    const int64_t at = place[static_cast<size_t>(mine[j])];
    if (at < 0) continue;
    std::copy_n(sums.begin() + at, w1_size, w1[j].data());
    std::copy_n(sums.begin() + at + w1_size, w2_size, w2[j].data());
  }
}

Matrix router_backward_on_ranks(Communicator& comm, const MoeConfig& config, const Matrix& x,
                                const ref::RouterOutput& router, int64_t tokens, const Matrix& d_combine,
                                const Matrix& gate_weights, Matrix& dx) {
  // ---- the router: logits = (x .* noise) Wg; its weight gradient summed over ranks ----
  // The losses are means over all T tokens, f_e counted over all ranks (the count exchange).
  const Matrix d_logits = ref::router_backward(config, router, d_combine, tokens, router.expert_fraction);
  Matrix d_gate_weights = x.cwiseProduct(router.jitter_noise).transpose() * d_logits;
  all_reduce_sum<double>(comm, std::span<double>(d_gate_weights.data(), d_gate_weights.size()));
  dx += (d_logits * gate_weights.transpose()).cwiseProduct(router.jitter_noise);
  return d_gate_weights;
}

}  // namespace moe::dist
