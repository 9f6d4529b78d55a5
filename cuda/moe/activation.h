// activation.h: the expert activation as an elementwise pass, for the cuBLAS expert paths (the
// block-sparse kernels fuse it into their epilogue instead), with the formulas of the CPU
// reference (reference_cpu/expert_ffn.h).
//
// GeLU, tanh approximation:
//   forward : hidden = gelu(pre)                 pre, hidden [n] bf16
//   backward: d_pre  = d_hidden * gelu'(pre)     fp32 math, bf16 storage
//
// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): W1 is [D, 2H], its first H columns
// the gate projection and its last H the up projection, so a row of pre = x W1 holds
// [gate (H) | up (H)]. One fused pass per direction reads both halves of a row:
//   forward : hidden = silu(gate) * up                              pre [rows, 2H] -> hidden [rows, H]
//   backward: d_gate = d_hidden * up * silu'(gate)                  pre [rows, 2H], d_hidden [rows, H]
//             d_up   = d_hidden * silu(gate)                        -> d_pre [rows, 2H] = [d_gate | d_up]
// silu(a) = a sigmoid(a), silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a))). fp32 math, bf16 storage.
// H must be even (the kernels move bf16 pairs); rows * H below 2^31.
//
// Dimension legend: H expert hidden width; rows = the expert rows (E*C for the padded layout).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bf16.h"  // bf16
#include "moe_config.h"  // Activation

namespace moe::cuda {

void gelu_forward(const bf16* pre,  // [n]
                  bf16* hidden,     // [n]
                  size_t n, cudaStream_t stream);

void gelu_backward(const bf16* pre,       // [n]
                   const bf16* d_hidden,  // [n]
                   bf16* d_pre,           // [n]
                   size_t n, cudaStream_t stream);

void swiglu_forward(const bf16* pre,  // [rows, 2H] gate columns, then up columns
                    bf16* hidden,     // [rows, H]
                    int64_t rows, int64_t hidden_dim, cudaStream_t stream);

void swiglu_backward(const bf16* pre,       // [rows, 2H] as the forward read it
                     const bf16* d_hidden,  // [rows, H]
                     bf16* d_pre,           // [rows, 2H] d_gate columns, then d_up columns
                     int64_t rows, int64_t hidden_dim, cudaStream_t stream);

// The layer's activation over `rows` rows of H hidden values, the one call of the cuBLAS expert
// paths: SwiGLU's fused pass (pre [rows, 2H]), or GeLU elementwise over rows * H.
inline void activation_forward(Activation activation, const bf16* pre, bf16* hidden, int64_t rows,
                               int64_t hidden_dim, cudaStream_t stream) {
  if (activation == Activation::swiglu)
    swiglu_forward(pre, hidden, rows, hidden_dim, stream);
  else
    gelu_forward(pre, hidden, static_cast<size_t>(rows * hidden_dim), stream);
}
inline void activation_backward(Activation activation, const bf16* pre, const bf16* d_hidden, bf16* d_pre,
                                int64_t rows, int64_t hidden_dim, cudaStream_t stream) {
  if (activation == Activation::swiglu)
    swiglu_backward(pre, d_hidden, d_pre, rows, hidden_dim, stream);
  else
    gelu_backward(pre, d_hidden, d_pre, static_cast<size_t>(rows * hidden_dim), stream);
}

}  // namespace moe::cuda
