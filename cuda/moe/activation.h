// activation.h: the expert activation as an elementwise pass, for the cuBLAS expert paths (the
// block-sparse kernels fuse it into their epilogue instead). GeLU, tanh approximation, the same
// formula as the CPU reference's moe::ref::gelu.
//   forward : hidden = gelu(pre)                 pre, hidden [n] bf16
//   backward: d_pre  = d_hidden * gelu'(pre)     fp32 math, bf16 storage
#pragma once

#include <cuda_runtime.h>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

void gelu_forward(const bf16* pre,  // [n]
                  bf16* hidden,     // [n]
                  size_t n, cudaStream_t stream);

void gelu_backward(const bf16* pre,       // [n]
                   const bf16* d_hidden,  // [n]
                   bf16* d_pre,           // [n]
                   size_t n, cudaStream_t stream);

}  // namespace moe::cuda
