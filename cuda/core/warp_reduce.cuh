// warp_reduce.cuh: the warp-level sum and max that the transformer kernels (model/layer_norm.cu,
// model/attention.cu, cross_entropy.cu, train/optimizer.cu) reduce rows with. Device code only; included by .cu files.
// A butterfly (xor) shuffle leaves the result in every lane, so no lane has to broadcast it, and
// the order of the additions is fixed by the lane numbers: the same inputs give the same bits.
#pragma once

namespace moe::cuda::detail {

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

}  // namespace moe::cuda::detail
