// core/elementwise.cu: casts, sums and poison fills over flat buffers (see core/elementwise.h).
#include "core/elementwise.h"

#include <cmath>  // NAN

#include "core/cuda_check.h"  // CUDA_CHECK

namespace moe::cuda {

namespace {

// Every kernel here is the same grid-stride loop around one line.
#define MOE_GRID_STRIDE_LOOP(i, n) \
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < (n); i += size_t{gridDim.x} * blockDim.x)

__global__ void float_to_bf16_kernel(const float* in, bf16* out, size_t n) {
  MOE_GRID_STRIDE_LOOP(i, n) out[i] = __float2bfloat16(in[i]);
}

__global__ void bf16_to_float_kernel(const bf16* in, float* out, size_t n) {
  MOE_GRID_STRIDE_LOOP(i, n) out[i] = __bfloat162float(in[i]);
}

__global__ void add_in_place_kernel(float* into, const float* from, size_t n) {
  MOE_GRID_STRIDE_LOOP(i, n) into[i] += from[i];
}

__global__ void residual_add_kernel(float* residual, const bf16* delta, bf16* residual_bf16, size_t n) {
  MOE_GRID_STRIDE_LOOP(i, n) {
    const float value = residual[i] + __bfloat162float(delta[i]);
    residual[i] = value;
    residual_bf16[i] = __float2bfloat16(value);
  }
}

__global__ void fill_nan_kernel(bf16* data, size_t n) {
  MOE_GRID_STRIDE_LOOP(i, n) data[i] = __float2bfloat16(NAN);
}

#undef MOE_GRID_STRIDE_LOOP

}  // namespace

void float_to_bf16(const float* in, bf16* out, size_t n, cudaStream_t stream) {
  float_to_bf16_kernel<<<grid_stride_blocks(n), kElementwiseThreads, 0, stream>>>(in, out, n);
  CUDA_CHECK(cudaGetLastError());
}

void bf16_to_float(const bf16* in, float* out, size_t n, cudaStream_t stream) {
  bf16_to_float_kernel<<<grid_stride_blocks(n), kElementwiseThreads, 0, stream>>>(in, out, n);
  CUDA_CHECK(cudaGetLastError());
}

void add_in_place(float* into, const float* from, size_t n, cudaStream_t stream) {
  add_in_place_kernel<<<grid_stride_blocks(n), kElementwiseThreads, 0, stream>>>(into, from, n);
  CUDA_CHECK(cudaGetLastError());
}

void residual_add(float* residual, const bf16* delta, bf16* residual_bf16, size_t n, cudaStream_t stream) {
  residual_add_kernel<<<grid_stride_blocks(n), kElementwiseThreads, 0, stream>>>(residual, delta, residual_bf16, n);
  CUDA_CHECK(cudaGetLastError());
}

void fill_nan(bf16* data, size_t n, cudaStream_t stream) {
  fill_nan_kernel<<<grid_stride_blocks(n), kElementwiseThreads, 0, stream>>>(data, n);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
