// core/elementwise.h: the small elementwise passes that the model, inference, the MoE layer and the
// expert-parallel layer all need (casts, sums, poison fills), one launcher each, and the one rule
// for sizing a grid-stride launch. Memory-bound passes: each element is read and written once, so
// what matters is keeping every SM busy, not the exact grid.
//   cmake --build build --target moe_cuda      (tests: ctest --test-dir build -R CudaElementwise)
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "core/bf16.h"  // bf16

namespace moe::cuda {

// Threads a block of an elementwise pass: eight warps.
inline constexpr unsigned kElementwiseThreads = 256;

// Blocks for a grid-stride loop over `items` at `threads` a block: one item a thread up to
// `max_blocks` blocks (4096 x 256 is a million threads, several waves on an H200's 132 SMs), the loop
// covering the rest; at least one block, so that an empty pass is still a valid launch.
inline unsigned grid_stride_blocks(size_t items, unsigned threads = kElementwiseThreads, unsigned max_blocks = 4096) {
  return static_cast<unsigned>(std::clamp<size_t>((items + threads - 1) / threads, 1, max_blocks));
}

// out[i] = bf16(in[i]), round to nearest even.
void float_to_bf16(const float* in, bf16* out, size_t n, cudaStream_t stream);
// out[i] = float(in[i]), exact.
void bf16_to_float(const bf16* in, float* out, size_t n, cudaStream_t stream);
// into[i] += from[i] in fp32: a second gradient arriving at the same tensor.
void add_in_place(float* into, const float* from, size_t n, cudaStream_t stream);
// residual[i] += delta[i] in fp32, and residual_bf16[i] = bf16(residual[i]): the residual stream of
// a transformer block and the copy the next LayerNorm reads.
void residual_add(float* residual, const bf16* delta, bf16* residual_bf16, size_t n, cudaStream_t stream);
// data[i] = NaN: poison, so that a read of memory never written shows in the result.
void fill_nan(bf16* data, size_t n, cudaStream_t stream);

}  // namespace moe::cuda
