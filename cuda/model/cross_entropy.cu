// cross_entropy.cu: softmax cross-entropy over 256 classes, forward and backward (see cross_entropy.h).
#include "model/cross_entropy.h"

#include <cmath>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/launch_checks.h"  // check_not_null, check_range
#include "core/warp_reduce.cuh"  // warp_sum, warp_max

namespace moe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;                           // positions per block
constexpr int kClassesPerLane = kCrossEntropyClasses / 32;  // 8
constexpr int kMeanThreads = 1024;                          // the one block of the mean

// Lane l holds classes l, l + 32, ... (a warp reads 32 consecutive floats at a time: coalesced).
struct RowSoftmax {
  float logits[kClassesPerLane];
  float max;
  float sum;  // sum of exp(logit - max)
};

__device__ RowSoftmax load_row(const float* row, int lane) {
  RowSoftmax r;
  float row_max = -INFINITY;
  for (int i = 0; i < kClassesPerLane; ++i) {
    r.logits[i] = row[lane + 32 * i];
    row_max = fmaxf(row_max, r.logits[i]);
  }
  r.max = detail::warp_max(row_max);
  float sum = 0.0f;
  for (int i = 0; i < kClassesPerLane; ++i) sum += expf(r.logits[i] - r.max);
  r.sum = detail::warp_sum(sum);
  return r;
}

__global__ void cross_entropy_losses_kernel(const float* logits, const int32_t* targets, float* losses,
                                            int64_t positions) {
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= positions) return;
  const float* row = logits + t * kCrossEntropyClasses;
  const RowSoftmax r = load_row(row, lane);
  if (lane == 0) {
    const int32_t target = targets[t];
    const bool valid = target >= 0 && target < kCrossEntropyClasses;
    losses[t] = valid ? r.max + logf(r.sum) - row[target] : NAN;
  }
}

__global__ void mean_kernel(const float* values, float* mean, int64_t count) {
  __shared__ float partial[kMeanThreads];
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += kMeanThreads) sum += values[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kMeanThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *mean = partial[0] / static_cast<float>(count);
}

__global__ void cross_entropy_backward_kernel(const float* logits, const int32_t* targets, bf16* d_logits,
                                              int64_t positions, float scale) {
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= positions) return;
  const RowSoftmax r = load_row(logits + t * kCrossEntropyClasses, lane);
  const int32_t target = targets[t];
  const bool valid = target >= 0 && target < kCrossEntropyClasses;
  const float inverse_sum = 1.0f / r.sum;
  bf16* out = d_logits + t * kCrossEntropyClasses;
  for (int i = 0; i < kClassesPerLane; ++i) {
    const int c = lane + 32 * i;
    const float p = expf(r.logits[i] - r.max) * inverse_sum;
    const float g = valid ? (p - (c == target ? 1.0f : 0.0f)) * scale : NAN;
    out[c] = __float2bfloat16(g);
  }
}

void check_positions(const char* function, int64_t positions) {
  detail::check_range(function, "positions", positions, 1, int64_t{1} << 31, "int32 token positions");
}

unsigned row_blocks(int64_t positions) {
  return static_cast<unsigned>((positions + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void cross_entropy_forward(const float* logits, const int32_t* targets, float* losses, float* mean_loss,
                           int64_t positions, cudaStream_t stream) {
  constexpr const char* kFunction = "cross_entropy_forward";
  check_positions(kFunction, positions);
  detail::check_not_null(kFunction, {{"logits", logits}, {"targets", targets}, {"losses", losses},
                                     {"mean_loss", mean_loss}});
  cross_entropy_losses_kernel<<<row_blocks(positions), kWarpsPerBlock * 32, 0, stream>>>(logits, targets, losses,
                                                                                          positions);
  CUDA_CHECK(cudaGetLastError());
  mean_kernel<<<1, kMeanThreads, 0, stream>>>(losses, mean_loss, positions);
  CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_backward(const float* logits, const int32_t* targets, bf16* d_logits, int64_t positions,
                            cudaStream_t stream, int64_t mean_over) {
  constexpr const char* kFunction = "cross_entropy_backward";
  check_positions(kFunction, positions);
  if (mean_over == 0) mean_over = positions;
  detail::check_range(kFunction, "mean_over", mean_over, positions, int64_t{1} << 40,
                      "at least positions: the mean is over these positions and maybe other ranks'");
  detail::check_not_null(kFunction, {{"logits", logits}, {"targets", targets}, {"d_logits", d_logits}});
  cross_entropy_backward_kernel<<<row_blocks(positions), kWarpsPerBlock * 32, 0, stream>>>(logits, targets, d_logits,
                                                                                            positions, 1.0f / static_cast<float>(mean_over));  // d mean / d loss[t]
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
