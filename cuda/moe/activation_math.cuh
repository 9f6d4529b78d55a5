// activation_math.cuh: the FFN's activations and their derivatives on the GPU, in fp32, with the
// formulas of the CPU reference (reference_cpu/expert_ffn.cpp): GeLU in its tanh form and SiLU.
// Shared by the elementwise kernels (activation.cu) and the block-sparse products' epilogues
// (block_sparse.cuh), so that every formulation computes the same function.
//
// tanh comes from the hardware: tanh.approx.f32 (PTX ISA, sm_75 and newer) is one instruction of
// the special-function unit, with a relative error of about 2^-11; tanhf is a sequence of about
// twenty (two special-function instructions among them). The values are stored in bf16, whose
// relative step is 2^-8, so the approximation changes a stored value by at most its last bit.
// It matters where the activation is an epilogue: the GeLU SDD computes 128 values per thread per
// tile while the tensor cores wait.
#pragma once

namespace moe::cuda {

__device__ __forceinline__ float fast_tanh(float u) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  return t;
#else
  return tanhf(u);
#endif
}

// gelu(a) = 0.5 a (1 + tanh(u)), u = sqrt(2/pi) (a + 0.044715 a^3)
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
__device__ __forceinline__ float gelu(float a) {
  return 0.5f * a * (1.0f + fast_tanh(kGeluScale * (a + kGeluCubic * a * a * a)));
}
__device__ __forceinline__ float gelu_derivative(float a) {
  const float t = fast_tanh(kGeluScale * (a + kGeluCubic * a * a * a));
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * a * a);
  return 0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * du;
}

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + __expf(-a)); }
__device__ __forceinline__ float silu(float a) { return a * sigmoid(a); }
__device__ __forceinline__ float silu_derivative(float a) {
  const float s = sigmoid(a);
  return s * (1.0f + a * (1.0f - s));
}

}  // namespace moe::cuda
