// dispatch.h: the dispatch plan: which routed slot (t, k) becomes which row of which expert's
// matrix product, in each formulation. Part of the CPU reference (moe::ref); built into
// moe_reference_cpu, tested by tests/reference_cpu.
//
// All three formulations start from the same stable sort of the T*K routed slots by expert (within
// an expert, slots keep increasing token order: slot = t * K + k). They differ only in rows:
//   dropping : capacity C = capacity(config); each expert keeps its first C slots in token order,
//              the rest are dropped (they add zero to y; the residual connection is the caller's).
//              rows_per_expert = kept_per_expert.
//   padded   : the same kept slots, but every expert owns exactly C rows; rows past its kept slots
//              are zero padding (GShard / Tutel: one dense batched product of E x [C, D]).
//   dropless : every slot is kept; each expert's rows are rounded up to a multiple of B so the
//              expert products tile into B x B blocks (MegaBlocks). row_offsets[1..E] is what
//              MegaBlocks calls padded_bins.
// Rows are laid out expert after expert: expert e owns rows [row_offsets[e], row_offsets[e+1]).
#pragma once

#include "moe_config.h"  // MoeConfig, Formulation
#include "types.h"

namespace moe::ref {

struct DispatchPlan {
  Formulation formulation = Formulation::dropless;
  int64_t tokens = 0;       // T
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  int64_t capacity = 0;     // C for dropping / padded; 0 for dropless (no capacity)
  int64_t block_size = 0;   // B, the dropless rounding of rows

  IndexVector tokens_per_expert;  // [E]   routed slots per expert, before dropping; sums to T*K
  IndexVector routed_offsets;     // [E+1] exclusive prefix sum of tokens_per_expert
  IndexVector routed_slots;       // [T*K] every routed slot, grouped by expert, token order inside
  IndexVector kept_per_expert;    // [E]   slots that get a row: min(count, C), or count if dropless
  IndexVector rows_per_expert;    // [E]   computed rows: kept, C, or kept rounded up to B
  IndexVector row_offsets;        // [E+1] exclusive prefix sum of rows_per_expert
  IndexVector row_slot;           // [rows] slot t*K+k feeding each row; -1 for a padding row
  IndexVector slot_row;           // [T*K] row of each slot; -1 if the slot was dropped

  int64_t total_rows = 0;     // rows = row_offsets[E]
  int64_t dropped_slots = 0;  // sum_e tokens_per_expert[e] - kept_per_expert[e]
  int64_t padding_rows = 0;   // rows fed by no slot (row_slot == -1)
};

// Validates config and the expert ids, then builds the plan for config.formulation.
DispatchPlan plan_dispatch(const MoeConfig& config,
                           const IndexMatrix& top_experts);  // [T, K] from route()

}  // namespace moe::ref
