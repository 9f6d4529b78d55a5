// expert_layouts.h: Tutel's adaptive parallelism switching (Hwang et al., MLSys 2023) on CPU ranks:
// the MoE layer computed in one of three layouts, chosen per call, over one fixed storage of the
// parameters. Eigen, double precision, any Communicator (the MPI backend on the CPU).
//   mpirun -np 4 build/tests/distributed/test_distributed_expert_layouts
//   mpirun -np 4 build/lessons/lesson07_tutel          (section 4 runs every layout)
//
// Dimension legend: T tokens (all ranks), T_r this rank's tokens, D model width, H expert hidden
// width, E experts, K top-k, C capacity, B block size, R ranks; E_r = E / R experts stored a rank;
// r Tutel's parallelism degree; w1_columns = H (GeLU) or 2H (SwiGLU); P_e = D w1_columns + H D,
// the elements of one expert's W1 and W2.
//
// Storage, the same for every r: expert parallelism's placement (expert_parallel_cpu.h). Rank q
// stores experts [q E_r, (q + 1) E_r) whole (E % R == 0); the router is replicated. A layout never
// moves a stored copy: what it needs from other ranks it gathers for one step (kept in the forward
// record until its backward, then dropped), and the gradients of what it gathered go back to the
// storing rank, so the gradients always have the storage's shape. Switching r between two calls
// therefore moves no parameter and changes no result; only what the next call gathers changes.
// Tutel's r = 0 gathers the same way (ZeRO-style).
//
// The layouts (every rank routes its own tokens first: route_on_ranks, the R x E count matrix,
// capacity counted over all T tokens in token order, as the single-device layer counts it):
//   r = 0  data parallel experts. Each rank all-gathers every expert's W1 and W2 and computes all
//          E experts on its own tokens: no token row moves. Backward: each rank's gradients of all
//          E experts are summed onto the storing ranks (an all-to-all of the gradients, then a sum
//          in rank order: a reduce-scatter). Padded: expert e's padding rows up to C are made on
//          its storing rank, the only rank that pads it.
//   r = 1  expert parallel: FastMoE's layer, expert_parallel_forward / backward, unchanged (its
//          pipelining and 2DH options apply here only).
//   r > 1  experts sharded over r ranks along H. Rule: r divides R and H; the groups are r
//          consecutive ranks, group g = ranks [g r, (g + 1) r), and group g computes the experts
//          its ranks store, [g r E_r, (g + 1) r E_r), r E_r of them. Rank g r + s computes columns
//          [s H / r, (s + 1) H / r) of every group expert's W1 (for SwiGLU the same columns of the
//          gate and of the up half) and those rows of W2, gathered from the group's storing ranks.
//          Each kept slot's row goes to every rank of its expert's group; each returns a partial
//          expert output, h_s W2_s; the r partials are summed at the token's rank. Backward: the
//          output gradient goes to the same r ranks, the partial input gradients are summed at
//          home, the slices' weight gradients go back to the storing rank. r = R is plain tensor
//          (model) parallelism of every expert. Padded: every rank of the group pads each expert
//          to C rows of its slice.
// Every formulation in every layout (dropless rounds each computing rank's rows of an expert up to
// B). Each equals ref::moe_forward / moe_backward on all ranks' tokens within 1e-10 (relative,
// double): y, the aux and z losses, dx, the router gradient, every expert's dW1, dW2 on its
// storing rank.
//
// What a rank sends in one training step (forward + backward), in elements (bytes: x 8 here, in
// double; x 2 for bf16 on GPUs). n_out: kept rows this rank sends to other ranks (an r > 1 row
// counts once per receiving rank of the group), n_in: rows it receives from other ranks.
//   r = 0  weights 2 (R - 1) E_r P_e  (all-gather forward, reduce-scatter backward), tokens 0
//   r = 1  weights 0, tokens 2 (n_out + n_in) D  (dispatch and combine, forward and backward)
//   r > 1  weights 2 (r - 1) E_r P_e / r,        tokens 2 (n_out + n_in) D
// With uniform routing n_out = n_in = T_r K r (R - 1) / R (r >= 1): tokens 4 T_r K D r (R - 1) / R.
// What a rank holds for one step besides its stored E_r P_e: r = 0 all E experts (E P_e), r > 1 the
// H / r slices of its group's r E_r experts (E_r P_e), r = 1 nothing more.
//
// The choice (Tutel picks r at run time): choose_layout() from a cost model of these bytes, the
// number of collectives and the expert FLOPs of the busiest rank; or measure_layouts(), which times
// each candidate over a few calls (the slowest rank's time per call, agreed by an all-gather) and
// takes the fastest. On CPU ranks the measured times are of host MPI and Eigen, not of a GPU
// interconnect.
//
// Collective: every rank calls with the same config and layout. Bad settings (r not 0, 1 or a
// divisor of R; H % r != 0; E % R != 0; configs or layouts differing between ranks) and bad
// shapes are std::invalid_argument on every rank, never a hang.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"          // Communicator
#include "ep/expert_parallel_cpu.h"   // ExpertParallelWeights (the storage), the r = 1 layer, RoutingOnRanks
#include "ep/layout_choice.h"       // valid_layouts, check_layout, LayoutChoice, choose_layout
#include "moe_config.h"            // MoeConfig
#include "reference_cpu/dispatch.h"  // DispatchPlan
#include "reference_cpu/types.h"   // Matrix, IndexVector

namespace moe::dist {

struct ExpertLayoutOptions {
  int r = 1;  // Tutel's degree: 0 data parallel, 1 expert parallel, r > 1 sharded over r ranks along H
  ExpertParallelOptions expert_parallel;  // r = 1 only (d chunks, 2DH); other r reject anything but the default
};

// Elements this rank sends to other ranks (its own blocks excluded) and its non-empty messages, as
// a flat exchange sends them (r = 1 through the 2DH exchange moves the same rows in two stages).
struct LayoutTraffic {
  int64_t weight_elements = 0;  // gathered expert weights (forward), their gradients (backward)
  int64_t token_elements = 0;   // token rows, expert outputs, their gradients
  int64_t messages = 0;
  LayoutTraffic& operator+=(const LayoutTraffic& other);
};

// r = 0 and r > 1: what this rank computes, from the weights it gathered.
struct GatheredExperts {
  int64_t first_expert = 0;   // global id of the first expert computed here
  int64_t hidden_begin = 0;   // the H columns of the slice: [hidden_begin, hidden_begin + hidden_width)
  int64_t hidden_width = 0;   // H (r = 0) or H / r
  std::vector<ref::Matrix> w1;  // [experts computed] x [D, w1_columns of the slice] (SwiGLU: gate slice, up slice)
  std::vector<ref::Matrix> w2;  // [experts computed] x [hidden_width, D]
};

struct ExpertLayoutForward {
  int r = 1;
  // Every layout:
  ref::Matrix y;          // [T_r, D] the layer output (without the residual)
  double aux_loss = 0.0;  // global, unscaled
  double z_loss = 0.0;
  std::vector<int64_t> kept_per_rank_expert;  // [R, E] slots that get a row
  int64_t dropped_slots = 0;
  LayoutTraffic traffic;  // this rank's forward
  // r = 1: FastMoE's record.
  ExpertParallelForward expert_parallel;
  // r = 0 and r > 1:
  RoutingOnRanks routing;
  GatheredExperts experts;
  std::vector<int64_t> send_rows;  // [R] rows sent to each rank
  std::vector<int64_t> recv_rows;  // [R] rows received from each rank, ordered [source][expert][token]
  ref::IndexVector sent_slots;     // the local slot t*K+k of each row sent, in send order
  ref::DispatchPlan expert_plan;   // the computed experts' rows; row_slot = received row, -1 for padding
  ref::Matrix permuted_x;          // [rows, D]
  ref::Matrix pre_activation;      // [rows, w1_columns of the slice]
  ref::Matrix hidden;              // [rows, hidden_width]
  ref::Matrix expert_out;          // [rows, D] this slice's partial outputs
  ref::IndexVector slot_kept;      // [T_r*K] 1 where the slot got a row
  ref::Matrix slot_expert_out;     // [T_r*K, D] each slot's expert output, summed over the slices
};

struct ExpertLayoutGradients {
  ref::Matrix x;                // [T_r, D]
  ref::Matrix gate_weights;     // [D, E] summed over ranks: the same on every rank
  std::vector<ref::Matrix> w1;  // E_r x [D, w1_columns] the experts this rank stores, whatever r
  std::vector<ref::Matrix> w2;  // E_r x [H, D]
  LayoutTraffic traffic;        // this rank's backward
};

ExpertLayoutForward expert_layout_forward(Communicator& communicator, const MoeConfig& config,
                                          const ref::Matrix& x,  // [T_r, D]
                                          const ExpertParallelWeights& stored,
                                          const ExpertLayoutOptions& options);

// Differentiates the same scalar as ref::moe_backward, summed over ranks:
//   L = sum(dy .* y) + aux_loss_coef * aux_loss + z_loss_coef * z_loss.
ExpertLayoutGradients expert_layout_backward(Communicator& communicator, const MoeConfig& config,
                                             const ref::Matrix& x,  // [T_r, D]
                                             const ExpertParallelWeights& stored,
                                             const ExpertLayoutForward& forward,
                                             const ref::Matrix& dy);  // [T_r, D]

// ---- the choice by measurement (the cost model: layout_choice.h) ----

// Times a forward and backward in each candidate layout (one untimed call each first, then
// timed_calls calls); a call's time is the slowest rank's, agreed by an all-gather, so every rank
// picks the same fastest r. Collective.
LayoutChoice measure_layouts(Communicator& communicator, const MoeConfig& config,
                             const ref::Matrix& x,   // [T_r, D]
                             const ref::Matrix& dy,  // [T_r, D]
                             const ExpertParallelWeights& stored, std::span<const int> candidates,
                             int timed_calls = 3);

}  // namespace moe::dist
