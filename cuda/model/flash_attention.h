// model/flash_attention.h: the core of causal multi-head attention, fused: from the heads' Q, K and V
// to the context, forward and backward, with no [S, S] matrix in global memory. FlashAttention-2's
// algorithm (Dao, 2023) written for this project on the tensor cores' mma.sync. attention.h's
// attention_forward / attention_backward call it between their projections (AttentionCore::fused);
// tested by tests/cuda/test_flash_attention.cpp against the CPU reference and against the unfused
// core (ctest --test-dir build -R CudaFlashAttention; skips without a GPU).
//
// Layout (attention.h's legend): qkv [T, 3D] bf16 holds Q | K | V, head h owns columns [h d, (h+1) d)
// of each part; context [T, D] bf16; log_sum_exp [B, S] fp32, b = n * heads + h, row b * S + s.
//
// Forward, one CTA per (64 queries, pair b), four warps of 16 query rows:
//   Q tile -> registers                          once
//   for each 64-key tile K_j, V_j up to the diagonal (loaded into shared memory one tile ahead):
//     s   = Q K_jᵀ                                16 x 64 per warp, fp32 in registers
//     m'  = max(m, rowmax(s) scale)               the running row maximum (scale = 1 / sqrt(d))
//     p   = exp(s scale - m');  l = l e^(m - m') + rowsum(p);  o = o e^(m - m') + p V_j
//   context = o / l;  log_sum_exp = m + log l     what the backward needs to rebuild p
// The scores' accumulators are laid out as the next product's A operand wants them, so p goes from
// fp32 registers to bf16 registers and into p V_j without touching shared memory.
//
// Backward, given d_context (dO): delta_i = <dO_i, O_i> (a small kernel), then two kernels, so that
// every output has exactly one writer and the result is the same bits on every run:
//   dK, dV: one CTA per (64 keys, b), warps of 16 keys, over the query tiles from the diagonal on:
//     pᵀ = exp(K Qᵀ scale - lse);  dV += pᵀ dO;  dpᵀ = V dOᵀ;  dsᵀ = pᵀ (dpᵀ - delta);  dK += dsᵀ Q
//   dQ:     one CTA per (64 queries, b), warps of 16 queries, over the key tiles up to the diagonal:
//     p = exp(Q Kᵀ scale - lse);  dp = dO Vᵀ;  ds = p (dp - delta);  dQ += ds K
//   dQ and dK are scaled by 1 / sqrt(d) once at the end.
// FlashAttention-2 computes dQ inside the first loop with atomic adds: five products instead of our
// seven, but fp32 atomics land in a different order on every run. We pay two products (the scores
// and dp again) for determinism.
//
// Why mma.sync and not Hopper's wgmma: at this project's sizes (S = 256, d = 64) a CTA owns 64 x 64
// tiles and a wgmma needs a warpgroup on a 64-row tile with operands described by shared memory
// descriptors and a swizzled layout; mma.sync's m16n8k16 keeps every fragment in plain registers that
// a reader can follow from the PTX manual's layout figures, and the whole core stays a small fraction
// of the step (lessons/03_block_sparse.measured.md: 1.6 of the 13.0 ms training step). Measured on
// an H200: 111 TFLOP/s forward, 69 backward on the causal FLOPs, at that shape; no wgmma version
// has been written to compare (the block-sparse kernels, cuda/moe/, show what one takes).
//
// Precision: bf16 operands, fp32 accumulation, the softmax in fp32; p and ds are rounded to bf16 as
// the operands of the next product (the unfused core rounds probs and d_scores the same way).
// Head dims 32, 64 and 128 (flash_attention_supports); any S >= 1: the last tile's missing rows are
// read as zeros and never written.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"      // bf16
#include "model/attention.h"  // AttentionShape

namespace moe::cuda {

// Whether the fused core has kernels for this head width d = D / heads.
bool flash_attention_supports(int64_t head_dim);

// context and log_sum_exp from qkv. Throws std::invalid_argument for a shape check_attention_shape
// refuses, a head width without kernels, a null pointer or a pointer not 16-byte aligned.
void flash_attention_forward(const AttentionShape& shape,
                             const bf16* qkv,     // [T, 3D]
                             bf16* context,       // [T, D]
                             float* log_sum_exp,  // [B, S]
                             cudaStream_t stream);

// d_qkv (all of it: dQ | dK | dV) from the forward's qkv, context and log_sum_exp and d_context.
// delta is scratch of B * S floats.
void flash_attention_backward(const AttentionShape& shape,
                              const bf16* qkv,          // [T, 3D]
                              const bf16* context,      // [T, D]
                              const float* log_sum_exp, // [B, S]
                              const bf16* d_context,    // [T, D]
                              float* delta,             // [B, S] scratch
                              bf16* d_qkv,              // [T, 3D]
                              cudaStream_t stream);

}  // namespace moe::cuda
