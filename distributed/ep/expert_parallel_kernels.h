// expert_parallel_kernels.h: the few kernels the expert-parallel layer on the GPU needs beyond
// cuda/'s router, dispatch plan, topology, permutes and block-sparse FFN: packing the routing
// summary for the count exchange, the send order of the token rows, the local experts' row map
// over the rows received, rows back in the order they came, and gradient tables summed over the
// pipeline's chunks; for Tutel's other layouts (expert_layouts.h), the expert weights packed in
// H-slices for their all-gather or all-to-all, their gradients unpacked back, and the r partial
// results of a sharded expert summed. Everything is asynchronous on `stream`; nothing reads back to the host.
// Built into moe_expert_parallel_gpu; used by expert_parallel_gpu.cpp.
//
// Dimension legend: T_r this rank's tokens, D model width, E experts, E_r local experts, K top-k,
// R ranks, d chunks; slot = t * K + k.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"  // bf16

namespace moe::dist {

using cuda::bf16;

// The routing summary a rank contributes to the count exchange, int32 words:
//   [0] T_r | [1, 1 + E) routed slots per expert | [1 + E, 1 + 2E) mean router probability per
//   expert (fp32 bits) | [1 + 2E] mean logsumexp^2 (fp32 bits).
// With T_r = 0 the pointers may be null: a summary of zeros.
inline constexpr int64_t routing_summary_words(int64_t experts) { return 2 * experts + 2; }
void pack_routing_summary(const int* tokens_per_expert,  // [E]
                          const float* mean_probs,       // [E]
                          const float* z_loss,           // [1]
                          int local_tokens, int experts,
                          int32_t* summary,  // [routing_summary_words(E)]
                          cudaStream_t stream);

// The send order: for each routed slot, grouped by expert in token order (routed_slots,
// routed_offsets: moe/dispatch.h), its send-buffer row (send_row_of, expert_parallel_index.h).
// Writes send_slot[row] = slot for every kept slot and slot_send_row[slot] = row, or -1 for a
// dropped slot: a view of DevicePlan (row_slot = send_slot, slot_row = slot_send_row) over which
// moe/permute.h's launchers gather the rows, combine what comes back, and run their backward.
void build_send_order(const int* top_experts,       // [T_r, K]
                      const int* routed_slots,      // [T_r * K]
                      const int* routed_offsets,    // [E + 1]
                      const int* segment_begin,     // [E, segments + 1]
                      const int* segment_send_row,  // [E, segments]
                      int slots, int segments,
                      int* send_slot,      // [T_r * K], the first rows_sent written
                      int* slot_send_row,  // [T_r * K]
                      cudaStream_t stream);

// The local experts' row map in one chunk: row_slot[row] = the received row feeding it
// (received_row_of, expert_parallel_index.h), -1 for padding; rows in [0, rows).
void build_expert_rows(const int* row_offsets,     // [E_r + 1]
                       const int* arrived_before,  // [E_r, R + 1]
                       const int* block_start,     // [R, E_r]
                       int experts, int ranks, int rows,
                       int* row_slot,  // [rows]
                       cudaStream_t stream);

// out[row_slot[r]] = rows[r] for every r < count with row_slot[r] >= 0: the experts' rows back in
// the order they were received, to be sent home. One warp per row, 16-byte copies where D allows.
void scatter_rows(const int* row_slot,  // [count]
                  const bf16* rows,     // [count, D]
                  bf16* out,            // [received, D]
                  int count, int model_dim, cudaStream_t stream);

// packed[row[i]][k] = table[slot[i]][k] for i < n, k < count: some of a pointer table's tensors into
// rows of one buffer (a placement's replicated experts' gradients, for their all-reduce).
void pack_through_table(float* const* table,  // device [slots] -> [count]
                        const int* slot, const int* row, int n, size_t count,
                        float* packed,  // [rows, count]
                        cudaStream_t stream);
// table[slot[i]][k] = packed[row[i]][k]: the inverse.
void unpack_through_table(const float* packed, const int* slot, const int* row, int n, size_t count,
                          float* const* table, cudaStream_t stream);
// to[e][i] = 0: the weight gradients of a rank whose experts received no row.
void zero_through_tables(float* const* to, int tables, size_t count, cudaStream_t stream);

// ---- Tutel's layouts r = 0 and r > 1 ----
// An expert's parameters as one block of P_c = 2 D H_c elements, H_c = H / slices: its W1 columns
// [s H_c, (s + 1) H_c) as [D, H_c], then its W2 rows [s H_c, (s + 1) H_c) as [H_c, D]. slices = 1
// is the whole expert (r = 0); slices = r the H-slices of r > 1.
//
// packed[s][j] = slice s of stored expert j: what slice s's computing rank gathers.
void pack_expert_slices(const bf16* const* w1,  // device [E_r] -> [D, H]
                        const bf16* const* w2,  // device [E_r] -> [H, D]
                        int experts, int model_dim, int hidden_dim, int slices,
                        bf16* packed,  // [slices, E_r, P_c]
                        cudaStream_t stream);
// The inverse for gradients: d_w1[j][:, s H_c + i], d_w2[j][s H_c + i, :] = packed[s][j], every
// slice s of every stored expert j written once.
void unpack_expert_slices(const float* packed,  // [slices, E_r, P_c]
                          float* const* d_w1,   // device [E_r] -> [D, H]
                          float* const* d_w2,   // device [E_r] -> [H, D]
                          int experts, int model_dim, int hidden_dim, int slices, cudaStream_t stream);

// ---- shadowed experts (ExpertParallelGpu's shadow_per_step) ----
// out[i] = source[i] >= 0 ? stored[source[i]] : copies + (-1 - source[i]) stride: a step's slot
// table, each slot pointing at a stored expert (the caller's table) or at a copy in the layer's
// buffer of copies, `stride` elements apart.
void assemble_pointer_table(const bf16* const* stored, const int* source, const bf16* copies, size_t stride, int n,
                            const bf16** out, cudaStream_t stream);
void assemble_pointer_table(float* const* stored, const int* source, float* copies, size_t stride, int n,
                            float** out, cudaStream_t stream);
// d_w1[j], d_w2[j] += sum over c < copies of blocks[c][j] (blocks: [copies, experts, P], one expert a
// block of P = 2 D H elements as pack_expert_slices's slices = 1), c in order: the other ranks'
// gradients of the shadowed experts this rank stores.
void add_expert_blocks(const float* blocks, int copies, int experts, int model_dim, int hidden_dim, float* const* d_w1,
                       float* const* d_w2, cudaStream_t stream);

// r > 1, the tokens' rank: out[u] = sum over i < r of partials[r u_g + i n_g + (u - u_g)] for each
// row u of group g's block [u_g, u_g + n_g) (n_g = u_{g+1} - u_g): the r ranks' partial results of
// one kept slot, summed in fp32 and rounded once.
void sum_partial_rows(const bf16* partials,    // [r * rows, D], group after group, r blocks each
                      const int* group_begin,  // [groups + 1] u_g; u_groups = rows
                      int groups, int copies, int rows, int model_dim,
                      bf16* out,  // [rows, D]
                      cudaStream_t stream);

}  // namespace moe::dist
