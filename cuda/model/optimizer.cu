// model/optimizer.cu: global gradient norm, clip scale and the AdamW update (see model/optimizer.h).
#include "model/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"     // CUDA_CHECK
#include "core/launch_checks.h"  // check_not_null, check_range

namespace moe::cuda {

namespace {

constexpr int kNormThreads = 256;
constexpr int kUpdateThreads = 256;

// Pass 1: block b, thread i sums the squares of float4 b * threads + i, + blocks * threads, ...
// (kNormUnroll of them loaded before any is added: the loads in flight are what bounds a read of
// the whole gradient), the scalars past the last whole float4 going to the threads of block 0; then
// the block adds its threads' sums in a fixed tree. The partition depends on the count only, so the
// norm has the same bits on every run. gradients must be 16-byte aligned (the launcher checks).
constexpr int kNormUnroll = 4;

// sums[0] becomes the sum of sums[0 .. N) by a fixed tree, so the same bits on every run; every
// thread of the N-thread block calls it once it has written its own sums[threadIdx.x].
template <int N, typename T>
__device__ __forceinline__ void block_tree_sum(T* sums) {
  __syncthreads();
  for (int stride = N / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
}

// The norm from the sum of squares, and the clip scale that brings it down to max_norm (1 when it
// is at most max_norm, or when max_norm <= 0 turns clipping off).
__device__ __forceinline__ void write_norm_and_clip(double squared, float* norm, float* clip_scale, float max_norm) {
  const double value = sqrt(squared);
  *norm = static_cast<float>(value);
  *clip_scale = (max_norm > 0.0f && value > max_norm) ? static_cast<float>(max_norm / value) : 1.0f;
}
__global__ void squares_partials_kernel(const float* gradients, int64_t count, float* partials) {
  __shared__ float sums[kNormThreads];
  const float4* quads = reinterpret_cast<const float4*>(gradients);
  const int64_t quad_count = count / 4, stride = int64_t{kGradientNormBlocks} * kNormThreads;
  float sum = 0.0f;
  int64_t i = int64_t{blockIdx.x} * kNormThreads + threadIdx.x;
  for (; i + (kNormUnroll - 1) * stride < quad_count; i += kNormUnroll * stride) {
    float4 q[kNormUnroll];
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) q[u] = quads[i + u * stride];
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) sum += q[u].x * q[u].x + q[u].y * q[u].y + q[u].z * q[u].z + q[u].w * q[u].w;
  }
  for (; i < quad_count; i += stride) {
    const float4 q = quads[i];
    sum += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
  }
  if (blockIdx.x == 0 && threadIdx.x < count % 4) {
    const float g = gradients[quad_count * 4 + threadIdx.x];
    sum += g * g;
  }
  sums[threadIdx.x] = sum;
  block_tree_sum<kNormThreads>(sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Pass 2: one block of kGradientNormBlocks threads, one partial each, a fixed tree in double.
__global__ void norm_finish_kernel(const float* partials, float* norm, float* clip_scale, float max_norm) {
  __shared__ double sums[kGradientNormBlocks];
  sums[threadIdx.x] = partials[threadIdx.x];
  block_tree_sum<kGradientNormBlocks>(sums);
  if (threadIdx.x == 0) write_norm_and_clip(sums[0], norm, clip_scale, max_norm);
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
  block_tree_sum<kNormThreads>(sums);
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Its pass 2: norm_finish_kernel's tree, stopping at the sum of squares.
__global__ void squared_finish_kernel(const float* partials, double* squared) {
  __shared__ double sums[kGradientNormBlocks];
  sums[threadIdx.x] = partials[threadIdx.x];
  block_tree_sum<kGradientNormBlocks>(sums);
  if (threadIdx.x == 0) *squared = sums[0];
}

__global__ void clip_from_squared_kernel(const double* squared, float* norm, float* clip_scale, float max_norm) {
  write_norm_and_clip(*squared, norm, clip_scale, max_norm);
}

struct UpdateConstants {  // per step, from the host
  float lr, beta1, beta2, eps, decay_factor;  // decay_factor = 1 - lr * weight_decay
  float inverse_correction1, inverse_correction2;  // 1 / (1 - beta^t)
};

// One element's update (AdamW, the bias corrections folded into the constants).
struct AdamWElement {
  const UpdateConstants& c;
  float scale;
  __device__ __forceinline__ float operator()(float weight, float gradient, float& m, float& v) const {
    const float g = gradient * scale;
    m = c.beta1 * m + (1.0f - c.beta1) * g;
    v = c.beta2 * v + (1.0f - c.beta2) * g * g;
    const float m_hat = m * c.inverse_correction1;
    const float v_hat = v * c.inverse_correction2;
    return weight * c.decay_factor - c.lr * m_hat / (sqrtf(v_hat) + c.eps);
  }
};

// The update reads weight, gradient, m and v and writes weight, m, v and the bf16 copy: 30 bytes an
// element, so the kernel is a stream through memory. The elements before the first 16-byte boundary
// of `weights` (the arrays share their offset) and after the last whole float4 go one by one, the
// rest four at a time (float4 loads and stores; the bf16 copy's 4 values as one 8-byte store).
__global__ void adamw_update_kernel(UpdateConstants c, float* weights, const float* gradients, float* m, float* v,
                                    bf16* weights_bf16, const float* gradient_scale, int64_t count, int64_t head) {
  const AdamWElement update{c, gradient_scale != nullptr ? *gradient_scale : 1.0f};
  const int64_t thread = int64_t{blockIdx.x} * blockDim.x + threadIdx.x, threads = int64_t{gridDim.x} * blockDim.x;
  const int64_t quads = (count - head) / 4, tail = head + quads * 4;
  const auto scalar = [&](int64_t i) {
    const float theta = update(weights[i], gradients[i], m[i], v[i]);
    weights[i] = theta;
    if (weights_bf16 != nullptr) weights_bf16[i] = __float2bfloat16(theta);
  };
  for (int64_t i = thread; i < head; i += threads) scalar(i);  // (all of them when the arrays are not aligned alike)
  for (int64_t i = tail + thread; i < count; i += threads) scalar(i);
  for (int64_t q = thread; q < quads; q += threads) {
    const int64_t i = head + 4 * q;
    float4 w = *reinterpret_cast<const float4*>(weights + i);
    const float4 g = *reinterpret_cast<const float4*>(gradients + i);
    float4 mq = *reinterpret_cast<const float4*>(m + i);
    float4 vq = *reinterpret_cast<const float4*>(v + i);
    w.x = update(w.x, g.x, mq.x, vq.x);
    w.y = update(w.y, g.y, mq.y, vq.y);
    w.z = update(w.z, g.z, mq.z, vq.z);
    w.w = update(w.w, g.w, mq.w, vq.w);
    *reinterpret_cast<float4*>(weights + i) = w;
    *reinterpret_cast<float4*>(m + i) = mq;
    *reinterpret_cast<float4*>(v + i) = vq;
    if (weights_bf16 != nullptr) {
      const __nv_bfloat162 low = __floats2bfloat162_rn(w.x, w.y), high = __floats2bfloat162_rn(w.z, w.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&low);
      packed.y = *reinterpret_cast<const uint32_t*>(&high);
      *reinterpret_cast<uint2*>(weights_bf16 + i) = packed;
    }
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
  detail::check_not_null(kFunction, {{"gradients", gradients}, {"partials", partials}, {"norm", norm},
                                     {"clip_scale", clip_scale}});
  if (reinterpret_cast<uintptr_t>(gradients) % 16 != 0) {
    throw std::invalid_argument("gradient_norm: gradients must be 16-byte aligned (float4 loads); a cudaMalloc'd "
                                "buffer is, and so is any offset that is a multiple of 4 floats");
  }
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
  detail::check_not_null(kFunction, {{"squared", squared}, {"norm", norm}, {"clip_scale", clip_scale}});
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
  detail::check_not_null(kFunction, {{"weights", weights}, {"gradients", gradients}, {"first_moment", first_moment},
                                     {"second_moment", second_moment}});
  const double t = static_cast<double>(step.step);
  UpdateConstants c{};
  c.lr = step.lr;
  c.beta1 = step.beta1;
  c.beta2 = step.beta2;
  c.eps = step.eps;
  c.decay_factor = static_cast<float>(1.0 - double(step.lr) * double(step.weight_decay));
  c.inverse_correction1 = static_cast<float>(1.0 / (1.0 - std::pow(double(step.beta1), t)));
  c.inverse_correction2 = static_cast<float>(1.0 / (1.0 - std::pow(double(step.beta2), t)));
  // The float4 part needs the four float arrays at one offset from 16-byte boundaries and the bf16
  // copy 8-byte aligned there (true of the model's flat buffers at any offset); else element by element.
  const auto misalignment = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes; };
  const uintptr_t offset = misalignment(weights, 16);
  const bool same_offset = misalignment(gradients, 16) == offset && misalignment(first_moment, 16) == offset &&
                           misalignment(second_moment, 16) == offset && offset % sizeof(float) == 0;
  int64_t head = same_offset ? std::min<int64_t>(count, int64_t((16 - offset) % 16 / sizeof(float))) : count;
  if (weights_bf16 != nullptr && head < count && misalignment(weights_bf16 + head, 8) != 0) head = count;
  const int64_t work = std::max<int64_t>((count - head) / 4, std::max<int64_t>(head, 3));  // threads needed
  const int64_t blocks = (work + kUpdateThreads - 1) / kUpdateThreads;
  adamw_update_kernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, 8192)), kUpdateThreads, 0, stream>>>(
      c, weights, gradients, first_moment, second_moment, weights_bf16, gradient_scale, count, head);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::cuda
