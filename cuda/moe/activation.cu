// activation.cu: elementwise GeLU and fused SwiGLU, forward and backward (see activation.h).
// Built into moe_cuda; tested through tests/cuda/test_moe_layer.cpp (the padded and dropping layers).
#include "moe/activation.h"

#include <stdexcept>
#include <string>

#include "moe/activation_math.cuh"  // gelu, gelu_derivative, silu, silu_derivative
#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/elementwise.h"       // grid_stride_blocks

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

// SwiGLU over bf16 pairs: pair i of hidden [rows, H] is row i / (H/2), pair column c = i % (H/2);
// in pre [rows, 2H] that row is H pairs long, its gate pair at row * H + c and its up pair H/2
// pairs further. The caller guarantees rows * H < 2^31, so 32-bit indices cover every pair.
__global__ void swiglu_forward_kernel(const __nv_bfloat162* pre, __nv_bfloat162* hidden, unsigned pairs,
                                      unsigned half_pairs) {  // half_pairs = H / 2
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
    const unsigned row = i / half_pairs, column = i - row * half_pairs;
    const unsigned gate_at = row * 2 * half_pairs + column;
    const float2 gate = __bfloat1622float2(pre[gate_at]);
    const float2 up = __bfloat1622float2(pre[gate_at + half_pairs]);
    hidden[i] = __floats2bfloat162_rn(silu(gate.x) * up.x, silu(gate.y) * up.y);
  }
}

__global__ void swiglu_backward_kernel(const __nv_bfloat162* pre, const __nv_bfloat162* d_hidden,
                                       __nv_bfloat162* d_pre, unsigned pairs, unsigned half_pairs) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
    const unsigned row = i / half_pairs, column = i - row * half_pairs;
    const unsigned gate_at = row * 2 * half_pairs + column;
    const float2 gate = __bfloat1622float2(pre[gate_at]);
    const float2 up = __bfloat1622float2(pre[gate_at + half_pairs]);
    const float2 g = __bfloat1622float2(d_hidden[i]);
    d_pre[gate_at] = __floats2bfloat162_rn(g.x * up.x * silu_derivative(gate.x), g.y * up.y * silu_derivative(gate.y));
    d_pre[gate_at + half_pairs] = __floats2bfloat162_rn(g.x * silu(gate.x), g.y * silu(gate.y));
  }
}

void check_even(size_t n) {
  if (n % 2 != 0) throw std::invalid_argument("gelu: element count must be even (bf16 pairs), got " + std::to_string(n));
}

// SwiGLU's shapes: H even (bf16 pairs), rows >= 0, rows * 2H within the kernels' 32-bit indices.
void check_swiglu_shape(const char* function, int64_t rows, int64_t hidden_dim) {
  const std::string f = std::string("moe::cuda::") + function + ": ";
  if (hidden_dim <= 0 || hidden_dim % 2 != 0) {
    throw std::invalid_argument(f + "hidden_dim (H) = " + std::to_string(hidden_dim) +
                                "; allowed: a positive even number (the kernel moves bf16 pairs)");
  }
  if (rows < 0 || rows * 2 * hidden_dim > int64_t{1} << 31) {
    throw std::invalid_argument(f + "rows = " + std::to_string(rows) + " with H = " + std::to_string(hidden_dim) +
                                "; allowed: 0 <= rows and rows * 2H <= 2^31 (32-bit indexing)");
  }
}

}  // namespace

void gelu_forward(const bf16* pre, bf16* hidden, size_t n, cudaStream_t stream) {
  check_even(n);
  const size_t pairs = n / 2;
  gelu_forward_kernel<<<grid_stride_blocks(pairs), kElementwiseThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<__nv_bfloat162*>(hidden), pairs);
  CUDA_CHECK(cudaGetLastError());
}

void gelu_backward(const bf16* pre, const bf16* d_hidden, bf16* d_pre, size_t n, cudaStream_t stream) {
  check_even(n);
  const size_t pairs = n / 2;
  gelu_backward_kernel<<<grid_stride_blocks(pairs), kElementwiseThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<const __nv_bfloat162*>(d_hidden),
      reinterpret_cast<__nv_bfloat162*>(d_pre), pairs);
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_forward(const bf16* pre, bf16* hidden, int64_t rows, int64_t hidden_dim, cudaStream_t stream) {
  check_swiglu_shape("swiglu_forward", rows, hidden_dim);
  const size_t pairs = static_cast<size_t>(rows * hidden_dim / 2);
  if (pairs == 0) return;
  swiglu_forward_kernel<<<grid_stride_blocks(pairs), kElementwiseThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<__nv_bfloat162*>(hidden),
      static_cast<unsigned>(pairs), static_cast<unsigned>(hidden_dim / 2));
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward(const bf16* pre, const bf16* d_hidden, bf16* d_pre, int64_t rows, int64_t hidden_dim,
                     cudaStream_t stream) {
  check_swiglu_shape("swiglu_backward", rows, hidden_dim);
  const size_t pairs = static_cast<size_t>(rows * hidden_dim / 2);
  if (pairs == 0) return;
  swiglu_backward_kernel<<<grid_stride_blocks(pairs), kElementwiseThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(pre), reinterpret_cast<const __nv_bfloat162*>(d_hidden),
      reinterpret_cast<__nv_bfloat162*>(d_pre), static_cast<unsigned>(pairs), static_cast<unsigned>(hidden_dim / 2));
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
