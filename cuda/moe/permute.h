// moe/permute.h: applying a dispatch plan on the GPU: gather tokens into expert order (padding fused),
// scatter expert outputs back to tokens weighted by the router (un-permute and combine), and the
// backward of both. The CPU oracle is reference_cpu/permute.h and the combine part of
// moe::ref::moe_backward (reference_cpu/moe_layer.cpp).
// Built into moe_cuda; tested by tests/cuda/test_permute.cpp (ctest --test-dir build -R CudaPermute).
//
// Dimension legend: T tokens, D model width, K top-k; rows = the plan's max_rows (a host-known
// bound; the true row count stays on the device in plan.total_rows).
//
//   permute_tokens        permuted_x[r] = x[row_slot[r] / K], zero where row_slot[r] = -1 (rows
//                         r < total_rows; the rest untouched)
//   unpermute_and_combine y[t] = sum_k w[t, k] * expert_out[slot_row[t*K+k]]   (dropped slots add 0)
//   combine_backward      d_expert_out[r] = w[slot] * dy[slot / K], zero where row_slot[r] = -1
//                         (rows r < total_rows; the rest untouched, as permute_tokens)
//                         d_combine_weights[t, k] = <dy[t], expert_out[slot_row[t*K+k]]>, 0 if dropped
//   permute_backward      dx[t] (+)= sum_k d_permuted_x[slot_row[t*K+k]]
//
// The rows a plan uses (up to its device count total_rows) are all written, padding rows with
// zeros, so their products are zero and add nothing to weight gradients. Rows past total_rows are
// left as they were: no kernel reads them (the block-sparse products stop at the device's block
// count, and a capacity plan uses all of its E*C rows), and at T=16384 D=1024 E=64 B=128 they are a
// third of max_rows, which permute_tokens once spent a third of its bytes writing zeros to. Nothing needs atomics: the plan maps every row to at most one slot and every slot to
// at most one row, so each kernel either gathers per row or sums a token's K rows.
//
// Layout: one warp per row (or per token); each lane moves 8 bf16 = 16 bytes at a time when D is
// a multiple of 8 and the pointers are 16-byte aligned (the widest load a thread can issue), one
// bf16 at a time otherwise, and issues 4 such loads before its stores. Sums are in fp32.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"        // bf16
#include "moe/device_plan.h"  // DevicePlan

namespace moe::cuda {

void permute_tokens(const DevicePlan& plan,
                    const bf16* x,     // [T, D]
                    bf16* permuted_x,  // [max_rows, D]
                    int model_dim, cudaStream_t stream);

void unpermute_and_combine(const DevicePlan& plan,
                           const float* combine_weights,  // [T, K]
                           const bf16* expert_out,        // [max_rows, D]
                           bf16* y,                       // [T, D]
                           int model_dim, cudaStream_t stream);

// Rows computed elsewhere replace the experts' own: expert_out[slot_row[s]] = rows[s] for every
// slot s with replace[s] != 0 (a slot without a row, dropped, is skipped). A decoder that computes
// some experts on the host writes their outputs into `rows` by slot and runs this between the
// experts and unpermute_and_combine (moe_layer.h: ReplacedRows), so the combine sums them exactly
// as it sums the GPU's. One warp per slot.
void replace_slot_rows(const DevicePlan& plan,
                       const bf16* rows,         // [T*K, D] by slot
                       const int32_t* replace,   // [T*K] non-zero: take the slot's row from `rows`
                       bf16* expert_out,         // [max_rows, D]
                       int model_dim, cudaStream_t stream);

// The backward of unpermute_and_combine. d_combine_weights feeds router_backward (moe/router.h).
void combine_backward(const DevicePlan& plan,
                      const float* combine_weights,  // [T, K]
                      const bf16* dy,                // [T, D]
                      const bf16* expert_out,        // [max_rows, D]
                      bf16* d_expert_out,            // [max_rows, D]
                      float* d_combine_weights,      // [T, K]
                      int model_dim, cudaStream_t stream);

// The backward of permute_tokens: each token sums the gradients of its K rows. With accumulate,
// the sum is added to dx (e.g. onto the router's d_logits Wg^T); without, dx is overwritten.
void permute_backward(const DevicePlan& plan,
                      const bf16* d_permuted_x,  // [max_rows, D]
                      float* dx,                 // [T, D] fp32: it sums K expert paths and the router's
                      int model_dim, bool accumulate, cudaStream_t stream);

}  // namespace moe::cuda
