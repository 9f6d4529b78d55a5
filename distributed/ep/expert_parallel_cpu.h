// expert_parallel_cpu.h: expert parallelism (FastMoE; He et al., 2021) on CPU ranks, the reference
// that every distributed MoE layer of the project is compared with. Eigen, double precision, one
// process per rank, any Communicator (the MPI backend on the CPU).
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_parallel_cpu
//
// Dimension legend: T tokens (all ranks together), T_r this rank's tokens, D model width, H expert
// hidden width, E experts, K top-k, C capacity, B block size, R ranks; E_r = E / R experts a rank;
// P the placement's slots (expert copies) on all ranks.
//
// Placement. The T tokens are sharded over the R ranks in token order: rank r holds tokens
// [token_offset, token_offset + T_r), any T_r >= 0 (a rank may hold none). The experts are placed
// by an ExpertPlacement (expert_placement.h): by default contiguously, E / R a rank when R divides E
// (rank r owning experts [r E_r, (r + 1) E_r), FastMoE's placement), one more on some ranks when it
// does not; or any placement, with replicated experts (EPLB's). Each rank holds the router weights
// (replicated, data parallel) and its slots' W1 and W2, in slot order (the experts it holds, by id).
// A replicated expert's rows are split over its replicas by the placement's routing rule.
//
// Forward, as FastMoE runs it:
//   1. route locally: the reference router on this rank's tokens (reference_cpu/router.h);
//   2. count exchange: one all-gather of the per-expert counts gives every rank the R x E matrix of
//      routed slots (FastMoE exchanges only the counts a rank needs; the whole matrix is as cheap
//      at this size and also gives the dropping rule and the load-balancing loss below);
//   3. all-to-all-v of the token rows, each to the rank that owns its expert;
//   4. the local experts over exactly the rows received (reference_cpu/expert_ffn.h);
//   5. all-to-all-v of the expert outputs back to the tokens' ranks;
//   6. the weighted combine (reference_cpu/permute.h's rule: y[t] = sum_k w[t, k] out(t, k)).
// Backward mirrors it: the output gradients of the slots travel to the experts, the experts'
// input gradients travel back. Expert weight gradients stay on the rank that holds the expert; a
// replicated expert's are summed over its replicas, so every replica gets the expert's whole
// gradient and the replicas stay identical (on CPU ranks one all-reduce over all ranks, zeros where a
// rank holds no replica: the sum of the replicas' sub-group, in one call every rank makes). The
// router weight gradient is all-reduced (summed), so it is the same on every rank.
//
// Formulations (reference_cpu/dispatch.h), with capacity counted the way the single-device layer
// counts it: C = ceil(capacity_factor * T * K / E) over all T tokens, and expert e keeps its first
// C slots in global token order. Shards are in token order, so from the R x E count matrix rank r
// knows how many slots of earlier ranks expert e already kept, and keeps
//   kept[r][e] = min(routed[r][e], max(0, C - sum_{r' < r} kept[r'][e]))
// of its own, in token order. Every result then equals the single-device layer's on all tokens.
//   dropping: only kept slots travel; a dropped slot adds zero to y.
//   padded  : the same kept slots travel; the owner pads each expert to C rows of zeros. Padding is
//             made where the experts live and never crosses the network. Padded takes no replicas
//             (C rows is one rank's computation of the expert; replicas split the rows).
//   dropless: every slot travels; the owner rounds each expert's rows up to B (MegaBlocks' layout).
// On the expert's rank, its rows are ordered by source rank, then token: global token order, the
// single-device plan's order. (With replicas, a replica's rows are the pieces the routing rule gives
// it, source after source.) The router losses are global: f_e from the count matrix, P_e and the
// z-loss from one all-reduce of per-rank sums.
//
// Tutel's adaptive pipelining (Hwang et al., MLSys 2023): with pipeline_chunks = d, each slot's
// rows are split into d chunks of its row space (C rows when padded, its kept rows otherwise;
// chunk c = rows [n c / d, n (c + 1) / d)), and dispatch -> experts -> combine runs chunk after
// chunk. On a GPU chunk c + 1's all-to-all overlaps chunk c's experts; on CPU ranks the chunks run
// one after the other, so this shows the schedule and that it changes no result, not a speed-up.
//
// Collective: every rank calls with the same config and options. Inputs are checked on every rank
// first (rank_agreement.h), so a bad setting or shape is a std::invalid_argument on every rank,
// naming the ranks at fault, never a hang.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"           // Communicator
#include "expert_placement.h"        // ExpertPlacement
#include "ep/placement.h"               // experts_per_rank, config_fingerprint
#include "moe_config.h"                 // MoeConfig
#include "reference_cpu/dispatch.h"     // DispatchPlan
#include "reference_cpu/moe_layer.h"    // MoeWeights
#include "reference_cpu/router.h"       // RouterOutput
#include "reference_cpu/types.h"        // Matrix, IndexVector

namespace moe::dist {

class HierarchicalAllToAll;  // all_to_all_2dh.h

// One rank's share of the layer's weights.
struct ExpertParallelWeights {
  ref::Matrix gate_weights;     // [D, E] the router, replicated on every rank
  std::vector<ref::Matrix> w1;  // this rank's slots x [D, w1_columns], in slot order (the placement's
                                // experts_of(rank)); E_r of them, ids r E_r + j, by default
  std::vector<ref::Matrix> w2;  // this rank's slots x [H, D]
};

struct ExpertParallelOptions {
  int pipeline_chunks = 1;  // d: Tutel's pipelining degree; 1 is FastMoE's single exchange
  // The token all-to-alls through Tutel's 2D hierarchical all-to-all (built over the same
  // communicator) instead of the flat one; nullptr: flat.
  HierarchicalAllToAll* hierarchical = nullptr;
  // Which ranks hold which experts; nullptr: contiguous_placement(E, R). Every rank passes the same.
  const ExpertPlacement* placement = nullptr;
};

// The weights rank `rank` holds under a placement: the router, and its slots' experts (tests and
// lessons slice the single-device weights with it). Without a placement: contiguous_placement(E, R).
ExpertParallelWeights local_weights(const MoeConfig& config, const ref::MoeWeights& all, int rank,
                                    const ExpertPlacement& placement);
ExpertParallelWeights local_weights(const MoeConfig& config, const ref::MoeWeights& all, int rank, int ranks);

// The forward's checks, collective: the configs, options and placements agree between ranks, the
// config is valid, the placement is of E experts over R ranks (padded: without replicas), and each
// rank's x and weights have their shapes; otherwise
// std::invalid_argument on every rank, naming the ranks at fault.
void check_expert_parallel_inputs(Communicator& communicator, const MoeConfig& config,
                                  const ref::Matrix& x,  // [T_r, D]
                                  const ExpertParallelWeights& weights, const ExpertParallelOptions& options);

// All-to-all-v of whole rows of a row-major matrix: send_rows[p] rows of `send` (packed, peer after
// peer) go to rank p; recv_rows[p] rows arrive from rank p, packed in rank order into a matrix that
// starts as NaN. Through Tutel's 2DH exchange when `hierarchical` is set, else flat. Collective.
ref::Matrix exchange_rows(Communicator& communicator, HierarchicalAllToAll* hierarchical,
                         const ref::Matrix& send,  // [sum send_rows, cols]
                         const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                         int64_t cols);

// The plan by which a rank's `experts` local experts compute the rows it received (a chunk's
// expert_plan in FastMoE's layer, the computed experts of a Tutel layout): received_rows(q, j)
// rows of local expert j arrived from rank q as one block, the blocks packed [source][local expert].
// The plan orders them [local expert][source rank][row], global token order, and gives expert j its
// arrived rows: padded_rows(j, arrived) when padded (zeros up to C), rounded up to B when dropless.
// row_slot is the index of the received row feeding each row, -1 for padding.
ref::DispatchPlan plan_received_rows(const MoeConfig& config, int64_t capacity, int ranks, int64_t experts,
                                     const std::function<int64_t(int source, int64_t expert)>& received_rows,
                                     const std::function<int64_t(int64_t expert, int64_t arrived)>& padded_rows);

// The received rows in such a plan's order: row r is received row row_slot[r]; padding rows zero.
ref::Matrix rows_in_plan_order(const ref::DispatchPlan& plan, const ref::Matrix& received);
// The plan's rows back in received order: received row row_slot[r] is row r of `rows`, in a matrix
// of `received_rows` rows that starts as NaN, so a row that no plan row fills cannot pass for a result.
ref::Matrix rows_in_received_order(const ref::DispatchPlan& plan, const ref::Matrix& rows, int64_t received_rows);

// Steps 1 and 2 of the forward and the dropping rule: what every expert layout (expert_layouts.h)
// shares before a token row moves. Collective; every rank gets the same count matrices.
struct RoutingOnRanks {
  int64_t tokens = 0;        // T, all ranks
  int64_t token_offset = 0;  // this rank's first global token
  int64_t local_tokens = 0;  // T_r
  int64_t capacity = 0;      // C (dropping / padded), 0 for dropless
  std::vector<int64_t> routed_per_rank_expert;  // [R, E] routed slots before dropping
  std::vector<int64_t> kept_per_rank_expert;    // [R, E] slots that get a row (C counted over all T)
  int64_t dropped_slots = 0;                    // all ranks
  ref::RouterOutput router;                     // this rank's tokens; f_e, P_e and the losses global
  std::vector<int64_t> routed_offsets;          // [E+1] this rank's slots grouped by expert
  ref::IndexVector routed_slots;                // [T_r*K] slot t*K+k, grouped by expert, token order inside
};

// Checks that the ranks' token counts add up to config.tokens (an error on every rank otherwise).
RoutingOnRanks route_on_ranks(Communicator& communicator, const MoeConfig& config,
                              const ref::Matrix& x,              // [T_r, D]
                              const ref::Matrix& gate_weights);  // [D, E]

// The router's part of the backward: its weight gradient, summed over ranks (returned, the same on
// every rank), and its input gradient, added to dx. `router` is this rank's forward routing (global
// f_e), `tokens` T; d_combine [T_r, K] is dL / d combine_weights.
ref::Matrix router_backward_on_ranks(Communicator& communicator, const MoeConfig& config,
                                     const ref::Matrix& x,  // [T_r, D]
                                     const ref::RouterOutput& router, int64_t tokens,
                                     const ref::Matrix& d_combine,  // [T_r, K]
                                     const ref::Matrix& gate_weights,  // [D, E]
                                     ref::Matrix& dx);                 // [T_r, D]

// One chunk of the exchange (the whole exchange when d = 1), on one rank, in both roles.
struct ExpertParallelChunk {
  // As the tokens' rank:
  std::vector<int64_t> send_rows;  // [R] rows sent to each rank (slots for its experts)
  ref::IndexVector sent_slots;     // [sum send_rows] the local slot t*K+k of each row sent, in send order
  // As the experts' rank:
  std::vector<int64_t> recv_rows;  // [R] rows received from each rank (ordered [source][local expert][token])
  ref::DispatchPlan expert_plan;   // this rank's slots (E_r experts by default) over this chunk:
                                   // rows_per_expert, row_offsets, row_slot = index of the received
                                   // row feeding each row, -1 for padding
  ref::Matrix permuted_x;          // [rows, D]           the received rows in expert order, padding zero
  ref::Matrix pre_activation;      // [rows, w1_columns]
  ref::Matrix hidden;              // [rows, H]
  ref::Matrix expert_out;          // [rows, D]
};

struct ExpertParallelForward {
  int64_t tokens = 0;            // T, all ranks
  int64_t token_offset = 0;      // this rank's first global token
  int64_t local_tokens = 0;      // T_r
  ExpertPlacement placement;     // the one used (the default made explicit)
  int64_t capacity = 0;          // C (dropping / padded), 0 for dropless
  std::vector<int64_t> routed_per_rank_expert;  // [R, E] routed slots before dropping (the count exchange)
  std::vector<int64_t> kept_per_rank_expert;    // [R, E] slots that get a row
  std::vector<int64_t> rows_per_rank_slot;      // [R, P] of those, the rows each source sends each slot
  int64_t dropped_slots = 0;                    // all ranks
  // This rank's tokens. jitter_noise holds the global noise's rows of these tokens;
  // expert_fraction (f_e), mean_probs (P_e), aux_loss and z_loss are global.
  ref::RouterOutput router;
  std::vector<ExpertParallelChunk> chunks;  // d chunks
  ref::IndexVector slot_chunk;              // [T_r*K] the chunk that carried each slot, -1 if dropped
  ref::Matrix slot_expert_out;              // [T_r*K, D] each slot's expert output, back home; 0 if dropped
  ref::Matrix y;                            // [T_r, D] the layer output (without the residual)
  double aux_loss = 0.0;                    // global, unscaled
  double z_loss = 0.0;                      // global, unscaled
  ExpertParallelOptions options;
};

struct ExpertParallelGradients {
  ref::Matrix x;                // [T_r, D]
  ref::Matrix gate_weights;     // [D, E] summed over ranks: the same on every rank
  std::vector<ref::Matrix> w1;  // this rank's slots x [D, w1_columns]; a replica's: its expert's whole gradient
  std::vector<ref::Matrix> w2;  // this rank's slots x [H, D]
};

ExpertParallelForward expert_parallel_forward(Communicator& communicator, const MoeConfig& config,
                                              const ref::Matrix& x,  // [T_r, D]
                                              const ExpertParallelWeights& weights,
                                              const ExpertParallelOptions& options = {});

// Differentiates the same scalar as ref::moe_backward, summed over ranks:
//   L = sum(dy .* y) + aux_loss_coef * aux_loss + z_loss_coef * z_loss.
ExpertParallelGradients expert_parallel_backward(Communicator& communicator, const MoeConfig& config,
                                                 const ref::Matrix& x,  // [T_r, D]
                                                 const ExpertParallelWeights& weights,
                                                 const ExpertParallelForward& forward,
                                                 const ref::Matrix& dy);  // [T_r, D]

// A replicated expert's weight gradients summed over its replicas, in place: w1 and w2 hold this
// rank's slots' gradients (placement.experts_of(rank) order) and end as their experts' sums.
// Collective: one all-reduce over all ranks, in which a rank adds zeros for the replicated experts it
// does not hold. Nothing happens without replicas.
void sum_over_replicas(Communicator& communicator, const MoeConfig& config, const ExpertPlacement& placement,
                       std::vector<ref::Matrix>& w1, std::vector<ref::Matrix>& w2);

}  // namespace moe::dist
