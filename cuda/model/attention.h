// model/attention.h: causal multi-head self-attention on the GPU, forward and backward: cuBLAS for the
// projections, and between them one of two cores from the heads' Q, K, V to the context:
//   AttentionCore::fused    flash_attention.h: tiles in shared memory, online softmax, no [S, S]
//                           matrix in global memory (head widths 32, 64, 128; the default there)
//   AttentionCore::unfused  the formulas below as written: cuBLAS batched products and our own
//                           causal softmax kernels (any head width; the readable baseline)
// The CPU oracle is
// moe::ref::attention_forward / attention_backward (reference_cpu/attention.h), whose formulas and
// layout these follow. Built into moe_cuda; tested by tests/cuda/test_attention.cpp
// (ctest --test-dir build -R CudaAttention; skips without a GPU).
//
// Dimension legend: N sequences, S sequence length, T = N * S tokens (t = n * S + s), D model width,
// heads, d = D / heads the head width, B = N * heads the (sequence, head) pairs, b = n * heads + h.
//   qkv      = x qkv_weights                      [T, 3D]  columns [Q | K | V], head h owns
//                                                          columns [h d, (h + 1) d) of each part
//   scores_b = Q_b K_bᵀ                           [S, S]   cuBLAS batched over b, fp32
//   probs_b  = causal softmax(scores_b / sqrt(d)) [S, S]   our kernel; zeros above the diagonal
//   context  = probs_b V_b, heads side by side    [T, D]   cuBLAS batched
//   out      = context out_weights                [T, D]
// Backward (d_out given):
//   d_out_weights = contextᵀ d_out,  d_context = d_out out_weightsᵀ
//   d_probs_b = d_context_b V_bᵀ,     d_V_b = probs_bᵀ d_context_b
//   d_scores_b = probs_b .* (d_probs_b - rowsum(probs_b .* d_probs_b)) / sqrt(d)   our kernel
//   d_Q_b = d_scores_b K_b,  d_K_b = d_scores_bᵀ Q_b
//   d_qkv_weights = xᵀ d_qkv,  dx = d_qkv qkv_weightsᵀ
//
// No copies into a [B, S, d] layout: Q_b, K_b, V_b and context_b are read and written in place,
// strided (row stride 3D or D), through device arrays of pointers (gemm_batched) that a small
// kernel fills on the device at every call. The full S x S products are computed and the softmax
// masks the upper triangle: twice the FLOPs a causal kernel needs, but three library calls a
// reader can check line by line against the formulas above.
//
// Precision: x, the weights, qkv, probs, context, out, d_out bf16; scores and d_probs fp32 (the
// softmax and its backward read them once, and their rows need the range); d_scores bf16 (operand
// of the next products); d_qkv_weights, d_out_weights and dx fp32 (weight gradients, and the input
// gradient that LayerNorm's backward reads). Every product accumulates in fp32.
//
// Memory (unfused): probs [B, S, S] bf16 is saved for the backward; the workspace holds one
// [B, S, S] fp32 and one [B, S, S] bf16 buffer. At N = 64, heads = 8, S = 256: 67 MB saved per layer.
// The fused core saves a log-sum-exp a row, [B, S] fp32: 0.5 MB at that shape, and its workspace
// holds a [B, S] fp32 buffer.
#pragma once

#include <cublas_v2.h>     // cublasHandle_t
#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>

#include "core/bf16.h"           // bf16
#include "core/device_buffer.h"  // DeviceBuffer

namespace moe::cuda {

struct AttentionShape {
  int64_t batch = 0;      // N
  int64_t seq_len = 0;    // S
  int64_t model_dim = 0;  // D
  int64_t num_heads = 0;  // heads, D % heads == 0
};

// Throws std::invalid_argument naming the field, its value and what is allowed.
void check_attention_shape(const char* function, const AttentionShape& shape);

enum class AttentionCore {
  automatic,  // fused where flash_attention_supports the head width, else unfused
  fused,
  unfused,
};
const char* attention_core_name(AttentionCore core);  // "auto", "fused", "unfused"
// automatic resolved for this shape; fused for a head width without fused kernels throws
// std::invalid_argument saying which widths are allowed.
AttentionCore resolve_attention_core(const AttentionShape& shape, AttentionCore core);

// What the forward saves for the backward besides qkv and context: the fused core a log-sum-exp
// per (pair, row), the unfused core the probabilities. The core's pointer must be set; the other is
// not read.
struct AttentionSaved {
  float* log_sum_exp = nullptr;  // [B, S]      fused
  bf16* probs = nullptr;         // [B, S, S]   unfused
};

// One layer's saved tensor for a shape and a resolved core; at(n) points at sequence n's share, so
// that a caller splitting the batch into parts passes each part its own.
class AttentionSavedBuffer {
 public:
  AttentionSavedBuffer() = default;
  AttentionSavedBuffer(const AttentionShape& shape, AttentionCore core);
  AttentionSaved at(int64_t first_sequence);
  void fill_bytes(int byte, cudaStream_t stream);  // e.g. 0xFF: NaNs, to catch reads of a stale forward

 private:
  int64_t rows_per_sequence_ = 0;     // heads * S
  int64_t squares_per_sequence_ = 0;  // heads * S * S
  DeviceBuffer<float> log_sum_exp_;
  DeviceBuffer<bf16> probs_;
};

// The batched products' operand arrays, B pointers each: Q, K, V, scores / d_probs, probs,
// context / d_context, d_scores, d_Q, d_K, d_V.
inline constexpr int kAttentionPointerArrays = 10;

// The device scratch of one attention shape and core, reused by every layer of that shape (nothing
// in it outlives a forward or a backward call). The launchers own its contents.
struct AttentionWorkspace {
  explicit AttentionWorkspace(const AttentionShape& shape, AttentionCore core = AttentionCore::automatic);
  AttentionShape shape;
  AttentionCore core;             // resolved: fused or unfused
  DeviceBuffer<float> scores;     // unfused: [B, S, S] scores in the forward, d_probs in the backward
  DeviceBuffer<bf16> d_scores;    // unfused: [B, S, S]
  DeviceBuffer<float> delta;      // fused: [B, S] <dO, O> of each row
  DeviceBuffer<bf16> d_context;   // [T, D]
  DeviceBuffer<bf16> d_qkv;       // [T, 3D]
  DeviceBuffer<void*> pointers;   // unfused: [kAttentionPointerArrays, B] the batched products' operands
};

// The launchers bind `handle` to `stream` (cublasSetStream) and enqueue everything on it; no host
// synchronisation.
void attention_forward(cublasHandle_t handle, const AttentionShape& shape,
                       const bf16* x,            // [T, D]  LN1's output
                       const bf16* qkv_weights,  // [D, 3D]
                       const bf16* out_weights,  // [D, D]
                       bf16* qkv,                // [T, 3D]     saved for the backward
                       AttentionSaved saved,     // the core's, saved for the backward
                       bf16* context,            // [T, D]      saved for the backward
                       bf16* out,                // [T, D]
                       AttentionWorkspace& workspace, cudaStream_t stream);

// Overwrites d_qkv_weights, d_out_weights and dx.
void attention_backward(cublasHandle_t handle, const AttentionShape& shape,
                        const bf16* x,            // [T, D]
                        const bf16* qkv_weights,  // [D, 3D]
                        const bf16* out_weights,  // [D, D]
                        const bf16* qkv,          // [T, 3D]    from the forward
                        AttentionSaved saved,     // from the forward (read only)
                        const bf16* context,      // [T, D]     from the forward
                        const bf16* d_out,        // [T, D]
                        float* d_qkv_weights,     // [D, 3D]
                        float* d_out_weights,     // [D, D]
                        float* dx,                // [T, D]
                        AttentionWorkspace& workspace, cudaStream_t stream);

}  // namespace moe::cuda
