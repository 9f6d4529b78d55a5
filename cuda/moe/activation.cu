// activation.cu: elementwise GeLU forward and backward (see activation.h).
#include "moe/activation.h"

#include "moe/activation_math.cuh"  // gelu, gelu_derivative
#include "core/cuda_check.h"        // CUDA_CHECK

namespace moe::cuda {

namespace {

// Grid-stride loops over bf16 pairs: each thread moves 4 bytes per array per iteration.
__global__ void gelu_forward_kernel(const __nv_bfloat162* pre, __nv_bfloat162* hidden, size_t pairs) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < pairs; i += size_t{gridDim.x} * blockDim.x) {
    const float2 a = __bfloat1622float2(pre[i]);
    hidden[i] = __floats2bfloat162_rn(gelu(a.x), gelu(a.y));
  }
}

__global__ void gelu_backward_kernel(const __nv_bfloat162* pre, const __nv_bfloat162* d_hidden,
                                     __nv_bfloat162* d_pre, size_t pairs) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < pairs; i += size_t{gridDim.x} * blockDim.x) {
    const float2 a = __bfloat1622float2(pre[i]);
    const float2 g = __bfloat1622float2(d_hidden[i]);
    d_pre[i] = __floats2bfloat162_rn(g.x * gelu_derivative(a.x), g.y * gelu_derivative(a.y));
  }
}

// Enough blocks of 256 threads to fill the GPU several times over; the loops cover the rest.
unsigned grid_for(size_t pairs) {
  const size_t blocks = (pairs + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

void check_even(size_t n) {
  if (n % 2 != 0) throw std::invalid_argument("gelu: element count must be even (bf16 pairs), got " + std::to_string(n));
}

}  // namespace

void gelu_forward(const bf16* pre, bf16* hidden, size_t n, cudaStream_t stream) {
  check_even(n);
  const size_t pairs = n / 2;
  gelu_forward_kernel<<<grid_for(pairs), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<__nv_bfloat162*>(hidden), pairs);
  CUDA_CHECK(cudaGetLastError());
}

void gelu_backward(const bf16* pre, const bf16* d_hidden, bf16* d_pre, size_t n, cudaStream_t stream) {
  check_even(n);
  const size_t pairs = n / 2;
  gelu_backward_kernel<<<grid_for(pairs), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<const __nv_bfloat162*>(d_hidden),
      reinterpret_cast<__nv_bfloat162*>(d_pre), pairs);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
