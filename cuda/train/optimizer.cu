// train/optimizer.cu: global gradient norm, clip scale and the AdamW update (see train/optimizer.h).
#include "train/optimizer.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/launch_checks.h"  // check_not_null, check_range

namespace moe::cuda {

namespace {

constexpr int kNormThreads = 256;
constexpr int kUpdateThreads = 256;

// Pass 1: block b, thread i sums the squares of entries b * threads + i, + blocks * threads, ...
// then the block adds its threads' sums in a fixed tree.
__global__ void squares_partials_kernel(const float* gradients, int64_t count, float* partials) {
  __shared__ float sums[kNormThreads];
  float sum = 0.0f;
  for (int64_t i = int64_t{blockIdx.x} * kNormThreads + threadIdx.x; i < count;
       i += int64_t{kGradientNormBlocks} * kNormThreads) {
    sum += gradients[i] * gradients[i];
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kNormThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Pass 2: one block of kGradientNormBlocks threads, one partial each, a fixed tree in double.
__global__ void norm_finish_kernel(const float* partials, float* norm, float* clip_scale, float max_norm) {
  __shared__ double sums[kGradientNormBlocks];
  sums[threadIdx.x] = partials[threadIdx.x];
  __syncthreads();
  for (int stride = kGradientNormBlocks / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double value = sqrt(sums[0]);
    *norm = static_cast<float>(value);
    *clip_scale = (max_norm > 0.0f && value > max_norm) ? static_cast<float>(max_norm / value) : 1.0f;
  }
}

// gradient_squared_norm's pass 1: squares_partials_kernel's partition applied to every span in turn.
__global__ void span_squares_partials_kernel(const float* gradients, const NormSpan* spans, int span_count,
                                             float* partials) {
  __shared__ float sums[kNormThreads];
  float sum = 0.0f;
  for (int s = 0; s < span_count; ++s) {
    const float* g = gradients + spans[s].offset;
    float span_sum = 0.0f;
    for (int64_t i = int64_t{blockIdx.x} * kNormThreads + threadIdx.x; i < spans[s].count;
         i += int64_t{kGradientNormBlocks} * kNormThreads) {
      span_sum += g[i] * g[i];
    }
    sum += spans[s].weight * span_sum;
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kNormThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Its pass 2: norm_finish_kernel's tree, stopping at the sum of squares.
__global__ void squared_finish_kernel(const float* partials, double* squared) {
  __shared__ double sums[kGradientNormBlocks];
  sums[threadIdx.x] = partials[threadIdx.x];
  __syncthreads();
  for (int stride = kGradientNormBlocks / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *squared = sums[0];
}

__global__ void clip_from_squared_kernel(const double* squared, float* norm, float* clip_scale, float max_norm) {
  const double value = sqrt(*squared);
  *norm = static_cast<float>(value);
  *clip_scale = (max_norm > 0.0f && value > max_norm) ? static_cast<float>(max_norm / value) : 1.0f;
}

struct UpdateConstants {  // per step, from the host
  float lr, beta1, beta2, eps, decay_factor;  // decay_factor = 1 - lr * weight_decay
  float inverse_correction1, inverse_correction2;  // 1 / (1 - beta^t)
};

__global__ void adamw_update_kernel(UpdateConstants c, float* weights, const float* gradients, float* m, float* v,
                                    bf16* weights_bf16, const float* gradient_scale, int64_t count) {
  const float scale = gradient_scale != nullptr ? *gradient_scale : 1.0f;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gradients[i] * scale;
    const float m_new = c.beta1 * m[i] + (1.0f - c.beta1) * g;
    const float v_new = c.beta2 * v[i] + (1.0f - c.beta2) * g * g;
    const float m_hat = m_new * c.inverse_correction1;
    const float v_hat = v_new * c.inverse_correction2;
    const float theta = weights[i] * c.decay_factor - c.lr * m_hat / (sqrtf(v_hat) + c.eps);
    m[i] = m_new;
    v[i] = v_new;
    weights[i] = theta;
    if (weights_bf16 != nullptr) weights_bf16[i] = __float2bfloat16(theta);
  }
}

void check_finite_range(const char* function, const char* name, float value, float lo, float hi, const char* allowed) {
  if (!std::isfinite(value) || value < lo || value > hi) {
    throw std::invalid_argument(std::string(function) + ": " + name + " = " + std::to_string(value) + "; expected " +
                                allowed);
  }
}

}  // namespace

void gradient_norm(const float* gradients, int64_t count, float* partials, float* norm, float* clip_scale,
                   float max_norm, cudaStream_t stream) {
  constexpr const char* kFunction = "gradient_norm";
  detail::check_range(kFunction, "count", count, 1, int64_t{1} << 40);
  if (std::isnan(max_norm)) throw std::invalid_argument("gradient_norm: max_norm = nan; expected a number");
  detail::check_not_null(kFunction, "gradients", gradients);
  detail::check_not_null(kFunction, "partials", partials);
  detail::check_not_null(kFunction, "norm", norm);
  detail::check_not_null(kFunction, "clip_scale", clip_scale);
  squares_partials_kernel<<<kGradientNormBlocks, kNormThreads, 0, stream>>>(gradients, count, partials);
  CUDA_CHECK(cudaGetLastError());
  norm_finish_kernel<<<1, kGradientNormBlocks, 0, stream>>>(partials, norm, clip_scale, max_norm);
  CUDA_CHECK(cudaGetLastError());
}

void gradient_squared_norm(const float* gradients, const NormSpan* spans, int span_count, float* partials,
                           double* squared, cudaStream_t stream) {
  constexpr const char* kFunction = "gradient_squared_norm";
  detail::check_range(kFunction, "span_count", span_count, 0, 1 << 20);
  detail::check_not_null(kFunction, "gradients", gradients);
  if (span_count > 0) detail::check_not_null(kFunction, "spans", spans);
  detail::check_not_null(kFunction, "partials", partials);
  detail::check_not_null(kFunction, "squared", squared);
  span_squares_partials_kernel<<<kGradientNormBlocks, kNormThreads, 0, stream>>>(gradients, spans, span_count,
                                                                                 partials);
  CUDA_CHECK(cudaGetLastError());
  squared_finish_kernel<<<1, kGradientNormBlocks, 0, stream>>>(partials, squared);
  CUDA_CHECK(cudaGetLastError());
}

void clip_scale_from_squared_norm(const double* squared, float* norm, float* clip_scale, float max_norm,
                                  cudaStream_t stream) {
  constexpr const char* kFunction = "clip_scale_from_squared_norm";
  if (std::isnan(max_norm)) throw std::invalid_argument("clip_scale_from_squared_norm: max_norm = nan; expected a number");
  detail::check_not_null(kFunction, "squared", squared);
  detail::check_not_null(kFunction, "norm", norm);
  detail::check_not_null(kFunction, "clip_scale", clip_scale);
  clip_from_squared_kernel<<<1, 1, 0, stream>>>(squared, norm, clip_scale, max_norm);
  CUDA_CHECK(cudaGetLastError());
}

void adamw_update(const AdamWStep& step, float* weights, const float* gradients, float* first_moment,
                  float* second_moment, bf16* weights_bf16, const float* gradient_scale, int64_t count,
                  cudaStream_t stream) {
  constexpr const char* kFunction = "adamw_update";
  detail::check_range(kFunction, "count", count, 1, int64_t{1} << 40);
  detail::check_range(kFunction, "step", step.step, 1, int64_t{1} << 40, "t counts from 1");
  check_finite_range(kFunction, "lr", step.lr, 0.0f, 1e3f, "a finite lr >= 0");
  check_finite_range(kFunction, "beta1", step.beta1, 0.0f, 0.999999f, "0 <= beta1 < 1");
  check_finite_range(kFunction, "beta2", step.beta2, 0.0f, 0.999999f, "0 <= beta2 < 1");
  check_finite_range(kFunction, "eps", step.eps, 1e-30f, 1.0f, "0 < eps <= 1");
  check_finite_range(kFunction, "weight_decay", step.weight_decay, 0.0f, 1e3f, "a finite weight_decay >= 0");
  detail::check_not_null(kFunction, "weights", weights);
  detail::check_not_null(kFunction, "gradients", gradients);
  detail::check_not_null(kFunction, "first_moment", first_moment);
  detail::check_not_null(kFunction, "second_moment", second_moment);
  const double t = static_cast<double>(step.step);
  UpdateConstants c{};
  c.lr = step.lr;
  c.beta1 = step.beta1;
  c.beta2 = step.beta2;
  c.eps = step.eps;
  c.decay_factor = static_cast<float>(1.0 - double(step.lr) * double(step.weight_decay));
  c.inverse_correction1 = static_cast<float>(1.0 / (1.0 - std::pow(double(step.beta1), t)));
  c.inverse_correction2 = static_cast<float>(1.0 / (1.0 - std::pow(double(step.beta2), t)));
  const int64_t blocks = (count + kUpdateThreads - 1) / kUpdateThreads;
  adamw_update_kernel<<<static_cast<unsigned>(blocks < 8192 ? blocks : 8192), kUpdateThreads, 0, stream>>>(
      c, weights, gradients, first_moment, second_moment, weights_bf16, gradient_scale, count);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
